"""Weights replaced in place (an RL loop's update between rollouts), and the prefix cache emptied: after
LLM.load_weights(B's tensors), an engine of model A answers as an engine of B does, cached prefixes of A's
KV included; the prefix cache emptied alone (LLM.reset_prefix_cache, the server's dev-mode endpoint)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts

from plait import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
KNOBS = dict(block_size=8, max_model_len=128, num_kv_blocks=128)  # a fixed cache: engines share a GPU too


def _answers(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_loaded_weights_answer_as_that_model_and_the_cache_is_emptied(tiny_llama, other_llama):
    folder_b, weights_b = other_llama
    prompts = random_prompts(4, 30, 60, seed=21)
    llm = LLM(str(tiny_llama), **KNOBS)
    before = _answers(llm, prompts)
    assert llm.engine.kv_cache.num_cached_blocks > 0  # A's prompts are cached: they must not serve B
    llm.load_weights(weights_b.items())
    assert llm.engine.kv_cache.num_cached_blocks == 0
    want = _answers(LLM(str(folder_b), **KNOBS), prompts)
    assert want != before, "B should answer otherwise than A"
    assert _answers(llm, prompts) == want
    # And back: A's own tensors (a generator of them, as a trainer may stream them) restore A's answers.
    from transformers import AutoModelForCausalLM

    weights_a = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).state_dict()
    llm.load_weights((name, t) for name, t in weights_a.items())
    assert _answers(llm, prompts) == before


def test_load_weights_refuses_a_busy_engine_an_incomplete_set_and_lora(tiny_llama, other_llama):
    _, weights_b = other_llama
    llm = LLM(str(tiny_llama), **KNOBS)
    llm.engine.add_request(random_prompts(1, 10, 10, seed=1)[0], GREEDY)
    with pytest.raises(ValueError, match="needs an idle engine"):
        llm.load_weights(weights_b.items())
    assert not llm.reset_prefix_cache()  # a request holds blocks: nothing forgotten
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.reset_prefix_cache() and llm.engine.kv_cache.num_cached_blocks == 0
    partial = [(n, t) for n, t in weights_b.items() if "layers.1." not in n]
    with pytest.raises(ValueError, match="checkpoint is missing"):
        llm.load_weights(partial)
    with pytest.raises(ValueError, match="has no place"):
        llm.load_weights([*weights_b.items(), ("model.layers.9.mlp.up_proj.weight", torch.zeros(2, 2))])
    with pytest.raises(ValueError, match="not supported for an engine with LoRA"):
        LLM(str(tiny_llama), enable_lora=True, **KNOBS).load_weights(weights_b.items())


def test_dev_mode_resets_the_prefix_cache(tiny_llama, monkeypatch):
    """vLLM's VLLM_SERVER_DEV_MODE=1 adds POST /reset_prefix_cache: the cache is emptied (a 409 while
    requests hold blocks); without the switch there is no such endpoint."""
    httpx = pytest.importorskip("httpx")
    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine
    from plait.entrypoints.server import BackgroundServer, OpenAIServer, ServerConfig

    engine = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=8, max_model_len=64))
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    with BackgroundServer(OpenAIServer(engine, ServerConfig(log_level="warning"))) as url:
        assert httpx.post(f"{url}/reset_prefix_cache").status_code == 404
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    with BackgroundServer(OpenAIServer(engine, ServerConfig(log_level="warning"))) as url:
        body = {"model": engine.model_name, "prompt": list(range(3, 40)), "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        assert engine.kv_cache.num_cached_blocks > 0
        assert httpx.post(f"{url}/reset_prefix_cache").status_code == 200
        assert engine.kv_cache.num_cached_blocks == 0


def test_load_weights_sends_each_tensor_parallel_rank_its_slices(tiny_llama, other_llama):
    """Two ranks: the driver streams each rank its slices of B's tensors, and the split engine answers as a
    split engine of B. A set the model refuses is refused on every rank alike (a ValueError, no rank left
    waiting), and a whole set loads after it."""
    from conftest import run_greedy

    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine

    folder_b, weights_b = other_llama
    prompts = random_prompts(4, 10, 40, seed=23)
    knobs = dict(KNOBS, tensor_parallel_size=2)
    split_b = LLMEngine(EngineConfig(model=str(folder_b), **knobs))
    try:
        want = run_greedy(split_b, prompts, GREEDY.max_tokens)[0]
    finally:
        split_b.shutdown()
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), **knobs))
    try:
        assert run_greedy(engine, prompts, GREEDY.max_tokens)[0] != want
        partial = [(n, t) for n, t in weights_b.items() if "layers.1." not in n]
        with pytest.raises(ValueError, match="checkpoint is missing"):
            engine.load_weights(partial)
        engine.load_weights(weights_b.items())
        assert run_greedy(engine, prompts, GREEDY.max_tokens)[0] == want
    finally:
        engine.shutdown()


def test_reload_weights_reads_a_checkpoint_from_disk(tiny_llama, other_llama):
    """vLLM's collective_rpc("reload_weights"): LLM.reload_weights(folder) answers as that checkpoint's model;
    with no path, the engine's own model comes back; a missing folder is a FileNotFoundError."""
    folder_b, _ = other_llama
    prompts = random_prompts(3, 20, 40, seed=24)
    llm = LLM(str(tiny_llama), **KNOBS)
    own = _answers(llm, prompts)
    want = _answers(LLM(str(folder_b), **KNOBS), prompts)
    llm.reload_weights(str(folder_b))
    assert _answers(llm, prompts) == want
    llm.reload_weights()
    assert _answers(llm, prompts) == own
    with pytest.raises(FileNotFoundError):
        llm.reload_weights(str(folder_b / "nowhere"))
