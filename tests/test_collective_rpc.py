"""vLLM's LLM.collective_rpc and worker_extension_cls, as RL libraries use them: an extension's methods run on
every rank's worker, weights sent one tensor at a time through it make the engine answer as the model they
came from (prefix cache emptied), functions run with the worker first, and a failure or a bad extension is a
clear error that leaves the engine serving. One device, and two gloo ranks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import rpc_extension
import torch
from conftest import random_prompts
from rpc_extension import WeightSyncExtension, fail_on_rank_1, rank_and_world
from test_load_weights import GREEDY, KNOBS, greedy_answers, split_greedy_answers

from plait import LLM

EXTENSION = "rpc_extension.WeightSyncExtension"


def test_an_extension_syncs_weights_one_tensor_at_a_time(tiny_llama, other_llama):
    folder_b, weights_b = other_llama
    prompts = random_prompts(4, 20, 50, seed=31)
    want = greedy_answers(LLM(str(folder_b), **KNOBS), prompts)
    llm = LLM(str(tiny_llama), worker_extension_cls=EXTENSION, **KNOBS)
    before = greedy_answers(llm, prompts)
    assert before != want and llm.engine.kv_cache.num_cached_blocks > 0
    assert llm.collective_rpc("where", args=("a",)) == [(0, 1, "cpu", "a")]
    assert llm.collective_rpc("where", kwargs={"tag": "b"}) == [(0, 1, "cpu", "b")]
    assert llm.collective_rpc(rank_and_world) == [(0, 1)]
    assert llm.collective_rpc(lambda worker: worker.rank + 1) == [1]  # one device: nothing is pickled
    for name, tensor in weights_b.items():
        llm.collective_rpc("update_named_param", args=(name, tensor))
    assert llm.engine.kv_cache.num_cached_blocks == 0  # A's cached prompts must not serve B
    assert greedy_answers(llm, prompts) == want
    # Worker's own methods, as vLLM's: reload_weights (the engine's own checkpoint), get_model.
    llm.collective_rpc("reload_weights")
    assert greedy_answers(llm, prompts) == before
    assert llm.collective_rpc("get_model") == [llm.engine.runner.model]


def test_an_extension_is_a_class_or_its_name_and_may_not_hide_the_worker(tiny_llama):
    llm = LLM(str(tiny_llama), worker_extension_cls=WeightSyncExtension, **KNOBS)
    num_parameters = sum(p.numel() for p in llm.engine.runner.model.parameters())
    assert llm.collective_rpc("num_parameters") == [num_parameters]
    with pytest.raises(AttributeError, match="no method 'nowhere'"):
        llm.collective_rpc("nowhere")
    with pytest.raises(TypeError):
        llm.collective_rpc("where", args=(1, 2, 3))
    assert greedy_answers(llm, random_prompts(1, 5, 5, seed=1))  # still serving
    with pytest.raises(ValueError, match=r"defines \['load_weights'\], which plait's Worker already has"):
        LLM(str(tiny_llama), worker_extension_cls=rpc_extension.ClashingExtension, **KNOBS)
    with pytest.raises(ValueError, match="cannot import 'no_such_module'"):
        LLM(str(tiny_llama), worker_extension_cls="no_such_module.Extension", **KNOBS)
    with pytest.raises(ValueError, match="is not a class"):
        LLM(str(tiny_llama), worker_extension_cls="rpc_extension.rank_and_world", **KNOBS)
    # Without an extension the worker's own methods are there.
    assert LLM(str(tiny_llama), **KNOBS).collective_rpc(rank_and_world) == [(0, 1)]


def test_collective_rpc_runs_on_every_tensor_parallel_rank(tiny_llama, other_llama, monkeypatch):
    """Two gloo ranks: each runs the method (its result in rank order); whole tensors sent to every rank, one
    at a time, each keeping its slices, make the split engine answer as a split engine of B; a rank's failure
    is raised with its traceback once every rank has answered, and the engine goes on; a lambda is refused
    (the other rank could not unpickle it); a rank that does not answer in time is a TimeoutError."""
    from conftest import run_greedy

    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine

    # The ranks are fresh interpreters: the extension's module must be on their path.
    tests = str(Path(rpc_extension.__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    folder_b, weights_b = other_llama
    prompts = random_prompts(3, 10, 40, seed=32)
    knobs = dict(KNOBS, tensor_parallel_size=2)
    want = split_greedy_answers(folder_b, prompts, knobs)
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), worker_extension_cls=EXTENSION, **knobs))
    try:
        assert engine.collective_rpc("where", args=("x",)) == [(0, 2, "cpu", "x"), (1, 2, "cpu", "x")]
        assert engine.collective_rpc(rank_and_world) == [(0, 2), (1, 2)]
        sizes = engine.collective_rpc("num_parameters")
        assert sizes[0] > sizes[1] > 0  # the driver alone holds the LM head; each its slices of the rest
        assert run_greedy(engine, prompts, GREEDY.max_tokens)[0] != want
        for name, tensor in weights_b.items():
            engine.collective_rpc("update_whole_param", args=(name, tensor))
        assert run_greedy(engine, prompts, GREEDY.max_tokens)[0] == want
        with pytest.raises(RuntimeError, match="(?s)failed on tensor-parallel rank 1.*rank 1 says no"):
            engine.collective_rpc(fail_on_rank_1)
        with pytest.raises(ValueError, match="must pickle"):
            engine.collective_rpc(lambda worker: worker.rank)
        assert engine.collective_rpc(rank_and_world) == [(0, 2), (1, 2)]  # in step after both
        assert run_greedy(engine, prompts, GREEDY.max_tokens)[0] == want
        with pytest.raises(TimeoutError, match="rank 1 did not answer in time"):
            engine.collective_rpc("sleep_on_rank_1", args=(3.0,), timeout=0.5)
        with pytest.raises(Exception, match="start a new engine"):
            engine.collective_rpc(rank_and_world)
    finally:
        engine.shutdown()


def test_dev_mode_collective_rpc_endpoint(tiny_llama, monkeypatch):
    """vLLM's POST /collective_rpc (VLLM_SERVER_DEV_MODE=1): each rank's result, JSON values as they are;
    an unknown method a 400."""
    httpx = pytest.importorskip("httpx")
    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine
    from plait.entrypoints.server import BackgroundServer, OpenAIServer, ServerConfig

    engine = LLMEngine(EngineConfig(model=str(tiny_llama), worker_extension_cls=EXTENSION, block_size=8,
                                    max_model_len=64))
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    with BackgroundServer(OpenAIServer(engine, ServerConfig(log_level="warning"))) as url:
        got = httpx.post(f"{url}/collective_rpc", json={"method": "where", "args": ["t"]}, timeout=60)
        assert got.status_code == 200 and got.json() == {"results": [[0, 1, "cpu", "t"]]}
        got = httpx.post(f"{url}/collective_rpc", json={"method": "num_parameters"}, timeout=60)
        assert got.json()["results"][0] == sum(p.numel() for p in engine.runner.model.parameters())
        bad = httpx.post(f"{url}/collective_rpc", json={"method": "nowhere"}, timeout=60)
        assert bad.status_code == 400 and "no method 'nowhere'" in bad.json()["error"]["message"]
    assert torch.is_grad_enabled()  # nothing leaked out of the engine's thread
