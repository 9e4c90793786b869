"""EngineProcess: the engine's loop in a process of its own answers exactly as on a thread of the server's
(cumulative outputs summed back from the deltas that cross), and errors, aborts, a failing step and a dead
process reach the server as they should."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import math
import os
import re
import time
from operator import methodcaller
from pathlib import Path

import pytest
import torch
from conftest import SERVING_MAX_NUM_BATCHED_TOKENS, break_next_step, idle_serving_engine

from plait.config import EngineConfig
from plait.engine.engine import LLMEngine
from plait.entrypoints.async_engine import (
    AsyncLLMEngine,
    EngineClient,
    EngineDeadError,
    RequestFailedError,
)
from plait.entrypoints.engine_process import EngineProcess
from plait.sampling_params import RequestOutputKind, SamplingParams

TESTS = Path(__file__).resolve().parent
TIMEOUT_S = 240.0
LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# Every kind of output and what each carries: logprobs, prompt logprobs, a stop string, seeded sampling, and a
# prompt longer than the 256-token budget (its prefill crosses steps).
REQUESTS = [
    ("The capital of France is", SamplingParams(temperature=0.0, max_tokens=10, logprobs=2,
                                                prompt_logprobs=1)),
    ("List three colors:", SamplingParams(temperature=0.0, max_tokens=16, stop=["."])),
    ("Once upon a time", SamplingParams(temperature=0.8, seed=11, max_tokens=12, logprobs=1,
                                        output_kind=RequestOutputKind.DELTA)),
    ("Water boils at", SamplingParams(temperature=0.0, max_tokens=8,
                                      output_kind=RequestOutputKind.FINAL_ONLY)),
    (" ".join(["word"] * 300) + " and then", SamplingParams(temperature=0.0, max_tokens=6,
                                                             prompt_logprobs=0)),
]


def _comparable(out) -> dict:
    """An output's fields, without its id (each client names its own) and times (which differ between runs),
    but with how many steps it saw."""
    fields = dataclasses.asdict(out)
    del fields["request_id"]
    metrics = fields.pop("metrics")
    fields["num_output_times"] = len(metrics.get("output_times", ()))
    return fields


def _same(a, b) -> bool:
    """Equal, floats to 1e-4: logprobs of the same tokens differ in the last bits between steps batched
    differently (the two runs' timing batches them differently); tokens and text must not. So may a
    logprob's rank in the vocabulary, by the ids tied with it to those bits (thousands deep in the tail)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-5)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(
            math.isclose(a[k], b[k], rel_tol=1e-2) if k == "rank" and a[k] and b[k] else _same(a[k], b[k])
            for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


async def _outputs(client: EngineClient) -> list[list[dict]]:
    """Every output of each of REQUESTS, added one after another and read at once."""
    streams = [await client.add([(prompt, params)]) for prompt, params in REQUESTS]

    async def read(stream) -> list[dict]:
        async with stream:
            return [_comparable(out) async for _, out in stream]

    return list(await asyncio.gather(*(read(s) for s in streams)))


def _run(client: EngineClient, scenario) -> None:
    async def main() -> None:
        client.start()
        try:
            await asyncio.wait_for(scenario(client), TIMEOUT_S)
        finally:
            await client.shutdown()

    asyncio.run(main())


def test_outputs_match_the_thread_engine(serving_engine):
    """Same model, same config: every output of every kind, field by field, as the engine on a thread makes
    it (no answer depends on where the loop runs, nor on how the steps were batched)."""
    engine = idle_serving_engine(serving_engine)
    engine.reset_prefix_cache()  # both engines start with an empty prefix cache
    results = {}

    async def collect(name, client):
        results[name] = await _outputs(client)

    _run(AsyncLLMEngine(engine), functools.partial(collect, "thread"))
    process = EngineProcess(EngineConfig(max_num_batched_tokens=SERVING_MAX_NUM_BATCHED_TOKENS))
    _run(process, functools.partial(collect, "process"))
    thread, proc = results["thread"], results["process"]
    assert [len(outs) for outs in proc] == [len(outs) for outs in thread]
    for want, got in zip(thread, proc):
        for w, g in zip(want, got):
            assert _same(g, w), (g, w)
    cumulative, _, delta, final, _ = proc
    assert cumulative[-1]["outputs"][0]["token_ids"] == [t for o in cumulative for t in
                                                        o["outputs"][0]["delta_token_ids"]]
    assert len(cumulative[-1]["outputs"][0]["logprobs"]) == 10 and cumulative[-1]["prompt_logprobs"]
    assert len(delta) == 12 and all(len(o["outputs"][0]["token_ids"]) == 1 for o in delta)
    assert len(final) == 1 and final[0]["num_output_times"] == 8
    assert engine.is_idle_and_clean()


# -- run in the engine process (this folder is on its PYTHONPATH) -------------------------------------


def refuse(request, engine) -> None:
    raise ValueError("refused by the validator")


def test_errors_aborts_failures_and_death(tiny_llama, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    from plait.entrypoints.protocol import ProtocolError
    from plait.entrypoints.server import OpenAIServer

    process = EngineProcess(EngineConfig(model=str(tiny_llama), max_model_len=64, block_size=8))
    assert process.info.max_model_len == 64 and process.info.tokenizer is None
    assert not process.is_alive  # until started

    async def idle(client) -> bool:
        for _ in range(200):  # aborts land at the loop's next gap
            if await client.call(methodcaller("is_idle_and_clean")):
                return True
            await asyncio.sleep(0.01)
        return False

    async def scenario(client: EngineProcess) -> None:
        # Bad input is refused before anything is queued, with its kind (a 400 to the server) and details.
        with pytest.raises(ValueError, match="empty"):
            await client.add([([5, 6], GREEDY), ([], GREEDY)])
        with pytest.raises(ValueError, match="refused by the validator"):
            await client.add([([5, 6], GREEDY)], validate=refuse)
        fits = functools.partial(OpenAIServer._check_fits, max_tokens=60)
        with pytest.raises(ProtocolError) as err:
            await client.add([(list(range(5, 15)), GREEDY)], validate=fits)
        assert err.value.param == "max_tokens" and err.value.code == "context_length_exceeded"
        # A function that cannot cross is refused here; the loop goes on.
        with pytest.raises(Exception, match="lambda|pickle"):
            await client.call(lambda engine: engine.num_running)
        assert await idle(client)

        # Leaving a stream aborts what it left unfinished.
        stream = await client.add([([5, 6, 7], LONG), ([8, 9], LONG)])
        async with stream:
            await stream.__anext__()
        assert sorted(stream.aborted) == [0, 1] and await idle(client)

        # A failing step fails the requests it ran, not the loop.
        streams = [await client.add([([5, 6, 7], LONG)]), await client.add([([8, 9], LONG)])]
        await streams[0].__anext__()
        await client.call(break_next_step)
        for s in streams:
            with pytest.raises(RequestFailedError, match="injected failure"):
                async for _ in s:
                    pass
        assert client.is_alive and await idle(client)
        stream = await client.add([([5, 6, 7], GREEDY)])
        outs = [out async for _, out in stream]
        assert len(outs[-1].outputs[0].token_ids) == GREEDY.max_tokens and client.stats.num_failed_steps == 1

        # A dead engine process fails what was running and refuses what comes.
        stream = await client.add([([5, 6, 7], dataclasses.replace(LONG, max_tokens=60))])
        await stream.__anext__()
        client._proc.kill()
        with pytest.raises(EngineDeadError, match="exited"):
            async for _ in stream:
                pass
        assert not client.is_alive
        with pytest.raises(EngineDeadError):
            await client.add([([5, 6], GREEDY)])

    _run(process, scenario)


class _Interrupted(Exception):
    """Stands in for KeyboardInterrupt, which would stop the test session if it got past the test."""


def test_an_interrupted_start_kills_the_loading_engine_process(tiny_llama, monkeypatch):
    """Ctrl-C while the engine process loads (it reads no command until it has): it is killed at once, not
    asked to stop, which would wait out ENGINE_STOP_TIMEOUT_S."""
    import signal
    import subprocess
    import threading

    spawned = []
    real_popen = subprocess.Popen

    def popen(*args, **kwargs):
        spawned.append(real_popen(*args, **kwargs))
        return spawned[-1]

    monkeypatch.setattr(subprocess, "Popen", popen)

    def interrupt(signum, frame):
        raise _Interrupted

    previous = signal.signal(signal.SIGINT, interrupt)
    try:
        # Python and torch take the engine process longer than this to import, so it is still loading.
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        started = time.monotonic()
        with pytest.raises(_Interrupted):
            EngineProcess(EngineConfig(model=str(tiny_llama)))
    finally:
        signal.signal(signal.SIGINT, previous)
    (proc,) = spawned
    assert proc.poll() == -signal.SIGKILL and time.monotonic() - started < 10


def test_a_model_that_does_not_load_is_reported(tmp_path):
    """The engine process raises what the engine raises on a thread (a bad model is the caller's error, of
    the same kind and message), with the engine process's traceback as its cause."""
    bad = tmp_path / "bad-model"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"], "vocab_size": 8,
                                                 "hidden_size": 8}))
    for model in (tmp_path / "no-such-model", bad):
        with pytest.raises(Exception) as on_thread:
            LLMEngine(EngineConfig(model=str(model)))
        started = time.monotonic()
        with pytest.raises(type(on_thread.value), match=re.escape(str(on_thread.value))) as in_process:
            EngineProcess(EngineConfig(model=str(model)))
        assert time.monotonic() - started < TIMEOUT_S
        cause = in_process.value.__cause__
        assert isinstance(cause, RuntimeError) and "failed to load the model" in str(cause)
        assert "Traceback" in str(cause)


def _answers(url: str, model: str) -> dict:
    """What a client sees of the same requests: chat (whole and streamed), completions with logprobs
    (streamed), a request beyond the context, and what /metrics counted of them."""
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    parser = pytest.importorskip("prometheus_client.parser")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT_S)
    messages = [{"role": "user", "content": "Name three fruits."}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0.0,
                                          logprobs=True, top_logprobs=2)
    chunks = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0.0,
                                            stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    completion = client.completions.create(model=model, prompt="The sun is", max_tokens=8, temperature=0.0,
                                           logprobs=2, stream=True)
    # A reader that falls behind gets tokens merged into fewer chunks: compare what the chunks add up to.
    chunks = [c.choices[0] for c in completion if c.choices]
    pieces = ("".join(c.text for c in chunks), [top for c in chunks for top in c.logprobs.top_logprobs])
    too_long = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 10**6})
    metrics = {}
    for family in parser.text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        if family.name in ("vllm:request_success", "vllm:generation_tokens", "vllm:prompt_tokens"):
            metrics[family.name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return {"chat": chat.choices[0].message.content, "top": chat.choices[0].logprobs.model_dump(),
            "usage": chat.usage.model_dump(), "streamed": streamed, "completion": pieces,
            "too_long": (too_long.status_code, too_long.json()["error"]["code"]), "metrics": metrics}


def test_the_server_answers_the_same_through_an_engine_process(tiny_serving_engine, tiny_default_vocab_model):
    """The official client sees the same answers from a server whose engine runs in a process of its own;
    when that process dies, /health says so and requests get an error, not a hang. (No answer depends on the
    model's weights: the random tiny one with the default model's tokenizer and chat template serves.)"""
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from plait.entrypoints.server import BackgroundServer, OpenAIServer, ServerConfig

    engine = idle_serving_engine(tiny_serving_engine)
    thread_server = OpenAIServer(engine, ServerConfig(log_level="warning"))
    with BackgroundServer(thread_server) as url:
        want = _answers(url, thread_server.model_name)
    process = EngineProcess(EngineConfig(model=str(tiny_default_vocab_model),
                                         max_num_batched_tokens=SERVING_MAX_NUM_BATCHED_TOKENS))
    server = OpenAIServer(process, ServerConfig(log_level="warning"))
    with BackgroundServer(server) as url:
        assert _answers(url, server.model_name) == want
        assert httpx.get(f"{url}/health").status_code == 200
        process._proc.kill()
        process._proc.wait()
        deadline = time.monotonic() + TIMEOUT_S
        while httpx.get(f"{url}/health").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        body = {"model": server.model_name, "prompt": "hi", "max_tokens": 4}
        r = httpx.post(f"{url}/v1/completions", json=body)
        assert r.status_code >= 500 and r.json()["error"]["message"]
    assert want["too_long"] == (400, "context_length_exceeded")
    assert want["metrics"]["vllm:request_success"] == 3
    assert engine.is_idle_and_clean()


def test_pooled_outputs_cross_whole(tiny_llama):
    """An embedding (a tensor) crosses the pipe as the engine made it."""
    from plait.entrypoints.llm import LLM
    from plait.pooling_params import PoolingParams

    prompts = [[5, 6, 7], list(range(10, 40))]
    llm = LLM(str(tiny_llama), runner="pooling", max_num_batched_tokens=64)
    embedded = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    want = [torch.tensor(o.outputs.embedding) for o in embedded]
    process = EngineProcess(EngineConfig(model=str(tiny_llama), runner="pooling", max_num_batched_tokens=64))
    assert process.info.pooling_spec is not None
    got = []

    async def scenario(client: EngineProcess) -> None:
        stream = await client.add([(p, PoolingParams()) for p in prompts])
        got.extend(out for _, out in sorted([item async for item in stream], key=lambda item: item[0]))

    _run(process, scenario)
    assert [out.prompt_token_ids for out in got] == prompts
    for out, data in zip(got, want):
        assert out.finished and torch.allclose(out.outputs.data, data, atol=1e-5)


def test_lora_adapters_through_an_engine_process(tiny_llama, tmp_path):
    """LoRA adapters cross as requests name them: one given at start-up is read and checked in the engine
    process before serving (a bad one stops the server with the engine's reason), another is loaded at run
    time; each answers with the tokens the offline engine gives under it."""
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    from conftest import LORA_MODULES, make_lora_adapter, run_greedy

    from plait.entrypoints.server import BackgroundServer, OpenAIServer, ServerConfig
    from plait.lora.request import LoRAModulePath

    sql = make_lora_adapter(tmp_path / "sql", tiny_llama, ["q_proj", "v_proj"], rank=8, alpha=16, seed=1)
    chat = make_lora_adapter(tmp_path / "chat", tiny_llama, list(LORA_MODULES), rank=4, alpha=8, seed=2)
    big = make_lora_adapter(tmp_path / "big", tiny_llama, ["q_proj"], rank=32, alpha=32, seed=3)
    config = EngineConfig(model=str(tiny_llama), max_model_len=64, block_size=8, enable_lora=True)
    process = EngineProcess(config)
    with pytest.raises(ValueError, match="greater than max_lora_rank"):
        OpenAIServer(process, ServerConfig(lora_modules=[LoRAModulePath("big", str(big))]))
    server = OpenAIServer(process, ServerConfig(served_model_name="tiny", lora_modules=[
        LoRAModulePath("sql", str(sql))], allow_runtime_lora_updating=True, log_level="warning"))
    prompt = [5, 6, 7, 8, 9]
    with BackgroundServer(server) as url:
        r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": str(chat)})
        assert r.status_code == 200, r.text
        r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(big)})
        assert r.status_code == 400 and "greater than max_lora_rank" in r.json()["error"]["message"]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT_S)
        got = {}
        for model in ("sql", "chat", "tiny"):
            out = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0.0,
                                            logprobs=1, extra_body={"return_tokens_as_token_ids": True,
                                                                    "ignore_eos": True})
            got[model] = [int(token.split(":")[1]) for token in out.choices[0].logprobs.tokens]
    offline = LLMEngine(config)
    for model in ("sql", "chat", "tiny"):
        want, _ = run_greedy(offline, [prompt], 6, loras=[server.lora_requests.get(model)])
        assert got[model] == want[0], model
    assert got["sql"] != got["tiny"] and got["chat"] != got["tiny"]
