"""Invariant 10: bad input is rejected with a clear error before it enters the engine."""

from __future__ import annotations

import pytest

from plait.config import EngineConfig
from plait.engine.engine import LLMEngine
from plait.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(EngineConfig(model=str(tiny_llama), max_model_len=64, block_size=8))


def _assert_untouched(engine):
    assert not engine.has_unfinished_requests()
    assert engine.is_idle_and_clean()


@pytest.mark.parametrize("prompt,match", [
    ([], "empty"),
    ([1] * 64, "maximum context length is 64 tokens"),
    ([1] * 500, "500 input tokens"),
    ([1, 99999], "out of range"),
    ([1, -3], "out of range"),
    ("text but no tokenizer", "no tokenizer"),
    ([1, 2.5], "integers"),
    (None, "prompt must be"),
])
def test_bad_prompts_rejected(engine, prompt, match):
    with pytest.raises((ValueError, TypeError), match=match):
        engine.add_request(prompt, SamplingParams())
    _assert_untouched(engine)


@pytest.mark.parametrize("kwargs,match", [
    ({"logit_bias": {3: 1.0, 512: 1.0}}, "logit_bias token id 512 is out of range for a vocabulary of 512"),
    ({"allowed_token_ids": [1, 10**6]}, "allowed_token_ids token id 1000000 is out of range"),
])
def test_sampling_token_ids_beyond_the_vocabulary_rejected(engine, kwargs, match):
    """The tiny model's vocabulary is 512 ids: an id beyond it would index past the logits row on the
    device, so it is refused when the request is added, as an out-of-range prompt id is."""
    with pytest.raises(ValueError, match=match):
        engine.add_request([1, 2, 3], SamplingParams(**kwargs))
    _assert_untouched(engine)


@pytest.mark.parametrize("kwargs,field", [
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -7}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"temperature": float("nan")}, "temperature"),
    ({"presence_penalty": 9.0}, "presence_penalty"),
    ({"logprobs": -1}, "logprobs"),  # the upper bound is the engine's max_logprobs (test_hf_parity.py)
    ({"n": 0}, "n"),
])
def test_bad_sampling_values_rejected(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_engine_keeps_serving_after_bad_input(engine):
    with pytest.raises(ValueError):
        engine.add_request([], SamplingParams())
    engine.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert len(outs) == 1 and len(outs[0].outputs[0].token_ids) == 3
    _assert_untouched(engine)


@pytest.mark.parametrize("kwargs,match", [
    ({"model": "/no/such/model"}, "does not exist"),
    ({"model": "meta-llama/Llama-3-8B"}, "local"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
    ({"scheduling_policy": "fastest"}, "scheduling_policy"),
    ({"block_size": -1}, "block_size"),
    ({"dtype": "float8"}, "dtype"),
])
def test_bad_engine_config_rejected(kwargs, match):
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        LLMEngine(EngineConfig(**kwargs))


def test_unknown_engine_option_named():
    from plait.entrypoints.llm import LLM

    with pytest.raises(TypeError, match="max_num_batched_tokenz"):
        LLM(max_num_batched_tokenz=5)


def test_bad_model_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises((ValueError, FileNotFoundError), match=str(tmp_path.name)):
        LLMEngine(EngineConfig(model=str(tmp_path)))
