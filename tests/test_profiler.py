"""The torch profiler around engine steps, as vLLM's: LLM.start_profile / stop_profile, and the server's
/start_profile and /stop_profile where a trace folder is set; the trace is a Chrome trace of the steps'
ops."""

from __future__ import annotations

import json

import pytest

from plait import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = {"prompt_token_ids": [5, 17, 33, 9, 41, 2]}


def _ops(path) -> set[str]:
    return {event.get("name", "") for event in json.loads(path.read_text())["traceEvents"]}


def test_llm_profiles_the_steps_between_start_and_stop(tiny_llama, tmp_path, monkeypatch):
    for name in ("PLAIT_TORCH_PROFILER_DIR", "VLLM_TORCH_PROFILER_DIR"):
        monkeypatch.delenv(name, raising=False)
    llm = LLM(str(tiny_llama), block_size=8, max_model_len=64)
    with pytest.raises(ValueError, match="PLAIT_TORCH_PROFILER_DIR"):
        llm.start_profile()
    with pytest.raises(ValueError, match="not running"):
        llm.stop_profile()
    llm.start_profile(tmp_path / "traces")
    with pytest.raises(ValueError, match="already running"):
        llm.start_profile(tmp_path / "traces")
    llm.generate(PROMPT, GREEDY, use_tqdm=False)
    trace = llm.stop_profile()
    assert trace.parent == tmp_path / "traces" and trace.suffix == ".json"
    ops = _ops(trace)
    assert any(op.startswith("aten::") for op in ops), sorted(ops)[:20]
    # vLLM's variable names the folder too.
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "vllm"))
    llm.start_profile()
    assert llm.stop_profile().parent == tmp_path / "vllm"


def test_server_profiles_where_a_trace_folder_is_set(tiny_llama, tmp_path, monkeypatch):
    httpx = pytest.importorskip("httpx")
    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine
    from plait.entrypoints.server import BackgroundServer, OpenAIServer, ServerConfig

    engine = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=8, max_model_len=64))
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    monkeypatch.delenv("PLAIT_TORCH_PROFILER_DIR", raising=False)
    with BackgroundServer(OpenAIServer(engine, ServerConfig(log_level="warning"))) as url:
        assert httpx.post(f"{url}/start_profile").status_code == 404  # as vLLM: no folder, no endpoint
    monkeypatch.setenv("PLAIT_TORCH_PROFILER_DIR", str(tmp_path))
    with BackgroundServer(OpenAIServer(engine, ServerConfig(log_level="warning"))) as url:
        assert httpx.post(f"{url}/stop_profile").status_code == 400  # not started
        assert httpx.post(f"{url}/start_profile").status_code == 200
        body = {"model": engine.model_name, "prompt": PROMPT["prompt_token_ids"], "max_tokens": 3}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        r = httpx.post(f"{url}/stop_profile", timeout=60)
        assert r.status_code == 200
    trace = tmp_path / r.json()["trace"].rsplit("/", 1)[1]
    assert trace.is_file() and any(op.startswith("aten::") for op in _ops(trace))



def test_bench_serve_profiles_the_timed_run(tiny_llama, tmp_path, monkeypatch, capsys):
    """`plait bench serve --profile` (vLLM's flag): the server's profiler runs around the timed run and the
    trace it wrote is named; a server without a trace folder refuses, and the run says why."""
    pytest.importorskip("httpx")
    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine
    from plait.entrypoints.cli import main
    from plait.entrypoints.server import BackgroundServer, OpenAIServer, ServerConfig

    engine = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=8, max_model_len=64))
    bench = ["bench", "serve", "--disable-tqdm", "--num-prompts", "2", "--prompt-mix", "1:4-8",
             "--output-len", "2", "--vocab-size", str(engine.model_config.vocab_size), "--profile"]
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    monkeypatch.setenv("PLAIT_TORCH_PROFILER_DIR", str(tmp_path / "traces"))
    with BackgroundServer(OpenAIServer(engine, ServerConfig(log_level="warning"))) as url:
        assert main([*bench, "--base-url", url]) == 0
    (trace,) = (tmp_path / "traces").iterdir()
    assert f"server trace: {trace}" in capsys.readouterr().out
    assert any(op.startswith("aten::") for op in _ops(trace))
    monkeypatch.delenv("PLAIT_TORCH_PROFILER_DIR")
    with BackgroundServer(OpenAIServer(engine, ServerConfig(log_level="warning"))) as url:
        assert main([*bench, "--base-url", url]) != 0
    assert "POST /start_profile answered 404" in capsys.readouterr().err
