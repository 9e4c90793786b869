"""Custom logits processors (vLLM's --logits-processors): per-request settings in extra_args / vllm_xargs,
processors that read output ids under overlapped steps, argmax-invariant ones skipped for greedy steps, and
the refusals (bad names, bad settings, speculative decoding)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts

from plait.config import EngineConfig
from plait.entrypoints.llm import LLM
from plait.logits_processor import LogitsProcessor, load_logits_processors
from plait.sampling_params import SamplingParams

TARGET = 7
MAX_TOKENS = 8
PROMPTS = random_prompts(4, 3, 20, seed=21)


class TargetToken(LogitsProcessor):
    """vLLM's example: rows whose extra_args name a target_token may sample only it."""

    reads_output_token_ids = False

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        target = (params.extra_args or {}).get("target_token")
        if target is not None and (isinstance(target, bool) or not isinstance(target, int) or target < 0):
            raise ValueError(f"target_token must be a token id, got {target!r}")

    def applies_to(self, params: SamplingParams) -> bool:
        return "target_token" in (params.extra_args or {})

    def apply(self, logits: torch.Tensor, rows) -> torch.Tensor:
        for i, row in enumerate(rows):
            target = (row.params.extra_args or {}).get("target_token")
            if target is not None:
                kept = logits[i, target].item()
                logits[i].fill_(float("-inf"))
                logits[i, target] = kept
        return logits


class Successor(LogitsProcessor):
    """Each row's next token is its last output token + 1: it reads output ids, so a stale last id (one still
    on the device) would repeat a token instead."""

    def apply(self, logits: torch.Tensor, rows) -> torch.Tensor:
        for i, row in enumerate(rows):
            if row.output_token_ids:
                successor = (row.output_token_ids[-1] + 1) % logits.shape[1]
                logits[i].fill_(float("-inf"))
                logits[i, successor] = 0.0
        return logits


class CountsCalls(LogitsProcessor):
    """Argmax-invariant (it changes nothing): skipped where every row is greedy."""

    calls = 0

    def is_argmax_invariant(self) -> bool:
        return True

    def apply(self, logits: torch.Tensor, rows) -> torch.Tensor:
        type(self).calls += 1
        return logits


class WrongShape(LogitsProcessor):
    def apply(self, logits: torch.Tensor, rows) -> torch.Tensor:
        return logits[:, :-1]


def _outputs(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kw)


def test_target_token_processor_changes_only_the_requests_that_ask(tiny_llama):
    """Rows with extra_args get the target, greedy or sampled; every other row's answer is the one it gets
    without the processor."""
    plain = LLM(model=str(tiny_llama), block_size=8)
    baseline = _outputs(plain, [_greedy()] * len(PROMPTS))
    llm = LLM(model=str(tiny_llama), block_size=8, logits_processors=["test_logits_processors:TargetToken"])
    target = {"target_token": TARGET}
    params = [_greedy(extra_args=target), _greedy(),
              SamplingParams(temperature=1.0, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True,
                             extra_args=target),
              _greedy(extra_args={"unrelated": "x"})]
    got = _outputs(llm, params)
    assert got[0] == got[2] == [TARGET] * MAX_TOKENS
    assert got[1] == baseline[1] and got[3] == baseline[3]
    assert baseline[0] != [TARGET] * MAX_TOKENS, "the target is what the model says anyway"
    with pytest.raises(ValueError, match="target_token must be a token id, got 'seven'"):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, _greedy(extra_args={"target_token": "seven"}),
                     use_tqdm=False)


def test_processor_that_reads_outputs_sees_every_token_under_overlap(tiny_llama):
    """Successor reads each row's last token: with overlapped steps (async scheduling) and without, every
    output counts up from its first token."""
    for overlap in (True, False):
        llm = LLM(model=str(tiny_llama), block_size=8, async_scheduling=overlap,
                  logits_processors=[Successor])
        for out in _outputs(llm, [_greedy()] * len(PROMPTS)):
            assert out == [out[0] + k for k in range(MAX_TOKENS)], out


def test_argmax_invariant_processor_is_skipped_for_greedy_steps(tiny_llama):
    llm = LLM(model=str(tiny_llama), block_size=8, logits_processors=[CountsCalls])
    CountsCalls.calls = 0
    _outputs(llm, [_greedy()] * len(PROMPTS))
    assert CountsCalls.calls == 0
    _outputs(llm, [SamplingParams(temperature=0.8, seed=1, max_tokens=MAX_TOKENS)] * len(PROMPTS))
    assert CountsCalls.calls > 0


def test_bad_processors_are_refused_by_name(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="cannot import 'no_such_module'"):
        load_logits_processors(["no_such_module:Processor"])
    with pytest.raises(ValueError, match="has no 'Missing'"):
        load_logits_processors(["test_logits_processors:Missing"])
    with pytest.raises(TypeError, match="not a subclass of plait.logits_processor.LogitsProcessor"):
        load_logits_processors(["test_logits_processors:_outputs"])
    loaded = load_logits_processors(["test_logits_processors.Successor", TargetToken])
    assert loaded == [Successor, TargetToken]
    with pytest.raises(ValueError, match="not supported with speculative decoding"):
        EngineConfig(logits_processors=[Successor],
                     speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    llm = LLM(model=str(tiny_llama), block_size=8, logits_processors=[WrongShape])
    with pytest.raises(RuntimeError, match=r"WrongShape returned \(1, \d+\), not logits of shape"):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, _greedy(), use_tqdm=False)


def test_cli_takes_logits_processors_and_the_server_vllm_xargs():
    from plait.entrypoints.cli import _engine_config, parse_args
    from plait.entrypoints.protocol import CompletionRequest

    config = _engine_config(parse_args(["serve", "--logits-processors", "a.b:C", "d.E"]))
    assert config.logits_processors == ["a.b:C", "d.E"]
    body = CompletionRequest(prompt="hi", vllm_xargs={"target_token": TARGET, "words": ["x", 1]})
    assert body.sampling_params(max_tokens=4, logprobs=None).extra_args == {"target_token": TARGET,
                                                                             "words": ["x", 1]}
    with pytest.raises(ValueError, match="extra_args must be a dict with string keys"):
        SamplingParams(extra_args={1: "x"})


def test_server_passes_vllm_xargs_to_the_processor(tiny_llama):
    """The openai client's extra_body vllm_xargs reach the processor; a setting it refuses is a 400 naming
    it, and the server goes on serving."""
    openai = pytest.importorskip("openai")
    from plait.engine.engine import LLMEngine
    from plait.entrypoints.server import BackgroundServer, OpenAIServer, ServerConfig

    engine = LLMEngine(EngineConfig(model=str(tiny_llama), max_model_len=64, block_size=8,
                                    logits_processors=[TargetToken]))
    with BackgroundServer(OpenAIServer(engine, ServerConfig(log_level="warning"))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id

        def complete(**extra):
            return client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                             temperature=0, extra_body={"return_token_ids": True, **extra})

        assert complete(vllm_xargs={"target_token": TARGET}).choices[0].token_ids == [TARGET] * MAX_TOKENS
        with pytest.raises(openai.BadRequestError, match="target_token must be a token id"):
            complete(vllm_xargs={"target_token": -1})
        assert complete().choices[0].token_ids != [TARGET] * MAX_TOKENS
        # Without enable_prompt_embeds the schema leaves prompt_embeds out: the prompt is required.
        import httpx

        schema = httpx.get(f"{url}/openapi.json").json()["components"]["schemas"]["CompletionRequest"]
        assert "prompt_embeds" not in schema["properties"]
        assert [alternative["required"] for alternative in schema["anyOf"]] == [["prompt"]]
