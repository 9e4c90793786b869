"""`plait serve`: flags reach the server config, and a real process prints its address and serves."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, SERVE_SHUTDOWN_TIMEOUT_S, plait_serve_process, start_plait_serve, stop_plait_serve

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")


def test_serve_flags_reach_the_configs(monkeypatch):
    import plait.entrypoints.server as server
    from plait.entrypoints import cli

    seen = []
    monkeypatch.setattr(server, "serve", lambda e, c, **_: seen.append((e, c)))
    monkeypatch.setenv("PLAIT_API_KEY", "from-env")
    assert cli.main(["serve", "--port", "0", "--max-num-batched-tokens", "64"]) == 0
    assert cli.main(["serve", "--api-key", "from-flag", "--host", "0.0.0.0", "--served-model-name", "m"]) == 0
    assert cli.main(["serve", "--served-model-name", "a", "b", "--trust-request-chat-template",
                     "--disable-log-stats"]) == 0
    (engine_a, config_a), (_, config_b), (_, config_c) = seen
    assert not config_a.disable_log_stats and config_c.disable_log_stats
    assert engine_a.max_num_batched_tokens == 64
    assert (config_a.host, config_a.port, config_a.api_key) == ("127.0.0.1", 0, "from-env")
    assert not config_a.trust_request_chat_template
    assert (config_b.host, config_b.api_key, config_b.served_model_name) == ("0.0.0.0", "from-flag", ["m"])
    assert config_c.served_model_names == ("a", "b") and config_c.trust_request_chat_template
    # vLLM's VLLM_API_KEY where PLAIT_API_KEY is not set; plait's wins where both are.
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm-env")
    assert cli.main(["serve"]) == 0
    monkeypatch.delenv("PLAIT_API_KEY")
    assert cli.main(["serve"]) == 0
    assert [config.api_key for _, config in seen[3:]] == ["from-env", "from-vllm-env"]


def test_serve_lora_flags_reach_the_configs(monkeypatch, capsys):
    """vLLM's --enable-lora, --max-loras, --max-lora-rank (defaults off, 1, 16) and --lora-modules
    (name=path or JSON); runtime loading under vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING; a malformed module
    fails at parsing."""
    import plait.entrypoints.server as server
    from plait.entrypoints import cli
    from plait.lora.request import LoRAModulePath

    seen = []
    monkeypatch.setattr(server, "serve", lambda e, c, **_: seen.append((e, c)))
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    assert cli.main(["serve", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "32", "--lora-modules",
                     "sql=/a/sql", '{"name": "chat", "path": "/b", "base_model_name": "m"}']) == 0
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    assert cli.main(["serve"]) == 0
    (engine, config), (plain_engine, plain) = seen
    assert (engine.enable_lora, engine.max_loras, engine.max_lora_rank) == (True, 2, 32)
    assert config.lora_modules == [LoRAModulePath("sql", "/a/sql"), LoRAModulePath("chat", "/b", "m")]
    assert not config.allow_runtime_lora_updating
    assert (plain_engine.enable_lora, plain_engine.max_loras, plain_engine.max_lora_rank) == (False, 1, 16)
    assert plain.lora_modules == () and plain.allow_runtime_lora_updating
    with pytest.raises(SystemExit):
        cli.main(["serve", "--lora-modules", "nameonly"])
    assert "a LoRA module is name=path or a JSON object" in capsys.readouterr().err


def test_serve_chat_template_and_tool_calling_flags(monkeypatch, capsys, tmp_path):
    """vLLM's --chat-template (a file or the template's text), --enable-auto-tool-choice and
    --tool-call-parser; a bad combination or an unreadable template fails before the model loads."""
    import plait.entrypoints.server as server
    from plait.entrypoints import cli

    seen = []
    monkeypatch.setattr(server, "serve", lambda engine_config, config, **_: seen.append(config))
    template = tmp_path / "tools.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    assert cli.main(["serve", "--chat-template", str(template), "--enable-auto-tool-choice",
                     "--tool-call-parser", "hermes"]) == 0
    assert cli.main(["serve", "--chat-template", "{{ messages[0]['content'] }}!"]) == 0
    assert cli.main(["serve"]) == 0
    (a, b, c) = seen
    assert a.chat_template_text == template.read_text() and a.enable_auto_tool_choice
    assert a.tool_call_parser == "hermes"
    assert b.chat_template_text == "{{ messages[0]['content'] }}!" and not b.enable_auto_tool_choice
    assert c.chat_template_text is None and c.tool_call_parser is None
    assert cli.main(["serve", "--enable-auto-tool-choice"]) == 2
    assert "needs a tool_call_parser" in capsys.readouterr().err
    assert cli.main(["serve", "--chat-template", str(tmp_path / "missing.jinja")]) == 2
    assert "looks like a file's path" in capsys.readouterr().err
    # Refused by name once the (here absent) --tool-parser-plugin could have added it, before the model loads.
    assert cli.main(["serve", "--tool-call-parser", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown tool call parser 'nope'; known: " in err and "granite, hermes, llama3_json" in err
    with pytest.raises(SystemExit):
        cli.main(["serve", "--chat-template-content-format", "parts"])
    assert "invalid choice: 'parts'" in capsys.readouterr().err
    assert len(seen) == 3
    assert (c.chat_template_content_format, c.response_role) == ("auto", "assistant")


def test_serve_exclude_tools_and_token_ids_flags(monkeypatch):
    """vLLM's --exclude-tools-when-tool-choice-none and --return-tokens-as-token-ids reach the server config,
    off by default as in vLLM."""
    import plait.entrypoints.server as server
    from plait.entrypoints import cli

    seen = []
    monkeypatch.setattr(server, "serve", lambda engine_config, config, **_: seen.append(config))
    assert cli.main(["serve", "--exclude-tools-when-tool-choice-none", "--return-tokens-as-token-ids"]) == 0
    assert cli.main(["serve"]) == 0
    on, off = seen
    assert on.exclude_tools_when_tool_choice_none and on.return_tokens_as_token_ids
    assert not (off.exclude_tools_when_tool_choice_none or off.return_tokens_as_token_ids)


def test_serve_cors_and_generation_config_flags(monkeypatch, capsys):
    """vLLM's --allowed-origins / --allowed-methods / --allowed-headers (JSON lists), --allow-credentials and
    --generation-config."""
    import plait.entrypoints.server as server
    from plait.entrypoints import cli

    seen = []
    monkeypatch.setattr(server, "serve", lambda e, c, **_: seen.append((e, c)))
    assert cli.main(["serve"]) == 0
    assert cli.main(["serve", "--allowed-origins", '["https://a.example"]',
                     "--allowed-methods", '["GET", "POST"]', "--allowed-headers", '["content-type"]',
                     "--allow-credentials", "--generation-config", "vllm"]) == 0
    (engine_a, config_a), (engine_b, config_b) = seen
    assert (config_a.allowed_origins, config_a.allowed_methods, config_a.allowed_headers) == (("*",),) * 3
    assert not config_a.allow_credentials and engine_a.generation_config == "auto"
    assert (config_b.allowed_origins, config_b.allowed_methods, config_b.allowed_headers) == (
        ["https://a.example"], ["GET", "POST"], ["content-type"])
    assert config_b.allow_credentials and engine_b.generation_config == "vllm"
    with pytest.raises(SystemExit):
        cli.main(["serve", "--allowed-origins", "https://a.example"])  # not JSON
    assert "JSON list of strings" in capsys.readouterr().err


def test_serve_runs_the_engine_with_serving_defaults(monkeypatch):
    """`plait serve` builds its engine with usage "serve" (vLLM's serving token budget on a GPU), in a process
    of its own unless --no-engine-process says on a thread of the server's; the engine process is started
    with the port (launcher.launch) before the server stack is imported, and the server adopts it."""
    import plait.entrypoints.launcher as launcher
    import plait.entrypoints.server as server
    from plait.config import EngineConfig
    from plait.entrypoints import cli

    built, started = [], []

    class Stop(Exception):
        pass

    def fake(kind):
        def build(config, started=None):
            built.append((kind, config, started))
            raise Stop
        return build

    def start(config):
        started.append(config)
        return f"engine process {len(started)}"

    monkeypatch.setattr(launcher, "start_engine_process", start)
    monkeypatch.setattr(server, "LLMEngine", fake("thread"))
    monkeypatch.setattr(server, "EngineProcess", fake("process"))
    with pytest.raises(Stop):
        server.serve(EngineConfig(model="m"), server.ServerConfig(port=0))
    with pytest.raises(Stop):
        server.serve(EngineConfig(model="m"), server.ServerConfig(port=0), engine_process=False)
    assert [(kind, process) for kind, _, process in built] == [("process", "engine process 1"),
                                                               ("thread", None)]
    assert all(config.usage == "serve" and config.model == "m" for _, config, _ in built)
    assert [config.usage for config in started] == ["serve"]
    seen = []

    def serve(engine_config, config, **kw):
        sock, process = kw["launched"]  # the port already taken (0: a free one), the engine process started
        seen.append((kw["engine_process"], process, sock.getsockname()[1] > 0))
        sock.close()

    monkeypatch.setattr(server, "serve", serve)
    assert cli.main(["serve", "--port", "0"]) == 0
    assert cli.main(["serve", "--no-engine-process", "--port", "0"]) == 0
    assert seen == [(True, "engine process 2", True), (False, None, True)]


@pytest.mark.parametrize("extra", [[], ["--data-parallel-size", "2"]])
def test_an_address_in_use_is_refused_before_the_model_loads(tmp_path, capsys, extra):
    """As vLLM's server, plait serve takes its port first: a port in use is one line and exit status 2 at
    once (here before the model, which does not exist, is even looked for), not a traceback after loading."""
    from plait.entrypoints import cli
    from plait.entrypoints.server import bind_socket

    with bind_socket("127.0.0.1", 0) as taken:
        port = taken.getsockname()[1]
        args = ["serve", "--model", str(tmp_path / "no-such-model"), "--port", str(port), *extra]
        assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert f"plait: error: cannot serve on 127.0.0.1:{port}: Address already in use" in err


def test_serve_takes_vllm_flags_whose_values_plait_has(monkeypatch, capsys, tmp_path):
    """vLLM's aliases (-tp, --num-gpu-blocks-override), flags that change nothing here (the custom all-reduce,
    a Hub token, a code revision) and flags whose value is what plait does (one pipeline stage, the 'mp'
    executor, one API server) are accepted with the serve options they set; other values are refused by
    name before the model loads."""
    import plait.entrypoints.server as server
    from plait.entrypoints import cli

    seen = []
    monkeypatch.setattr(server, "serve", lambda e, c, **kw: seen.append((e, c, kw)))
    log_config = tmp_path / "logging.json"
    log_config.write_text(json.dumps({"version": 1}))
    media = tmp_path / "media"
    media.mkdir()
    assert cli.main(["serve", "--port", "0", "-tp", "1", "--num-gpu-blocks-override", "64",
                     "--kv-cache-memory-bytes", "2G", "--disable-custom-all-reduce",
                     "--distributed-executor-backend", "mp", "-pp", "1", "--model-impl", "vllm",
                     "--config-format", "hf", "--hf-token", "hf_secret", "--code-revision", "main",
                     "--disable-frontend-multiprocessing", "--api-server-count", "1",
                     "--enable-force-include-usage", "--enable-tokenizer-info-endpoint",
                     "--middleware", "a.one", "--middleware", "b.two", "--log-config-file", str(log_config),
                     "--ssl-cert-reqs", "1", "--allowed-local-media-path", str(media),
                     "--disable-cascade-attn", "--swap-space", "4",
                     "--max-parallel-loading-workers", "2", "--lora-dtype", "auto",
                     "--max-seq-len-to-capture", "8192", "--preemption-mode", "recompute",
                     "--mamba-ssm-cache-dtype", "float32", "--mamba-cache-dtype", "auto",
                     "--structured-outputs-config", '{"backend": "guidance", "disable_fallback": true}',
                     "--data-parallel-backend", "mp", "--data-parallel-size-local", "1",
                     "--ignore-patterns", "*.pt", "--mm-processor-cache-gb", "0",
                     "--disable-hybrid-kv-cache-manager", "--allowed-media-domains", "example.com",
                     "--show-hidden-metrics-for-version", "0.25",
                     "--override-pooler-config", '{"pooling_type": "MEAN"}']) == 0
    ((engine, config, kwargs),) = seen
    assert (engine.tensor_parallel_size, engine.num_kv_blocks, engine.kv_cache_memory_bytes) == (1, 64, 2**31)
    assert engine.pooler_config.pooling_type == "MEAN"  # --override-pooler-config: vLLM's older name
    assert kwargs["engine_process"] is False
    assert config.enable_force_include_usage and config.enable_tokenizer_info_endpoint
    assert config.middleware == ["a.one", "b.two"] and config.log_config_file == str(log_config)
    assert (config.ssl_cert_reqs, config.allowed_local_media_path) == (1, str(media))
    for flags, words in [(["-pp", "2"], "pipeline parallelism is not available"),
                         (["--distributed-executor-backend", "ray"], "--distributed-executor-backend ray"),
                         (["--distributed-executor-backend", "uni", "-tp", "2"], "backend uni"),
                         (["--model-impl", "transformers"], "--model-impl transformers"),
                         (["--config-format", "mistral"], "--config-format mistral"),
                         (["--lora-dtype", "float16"], "--lora-dtype float16 is not available"),
                         (["--preemption-mode", "swap"], "--preemption-mode swap is not available"),
                         (["--mamba-ssm-cache-dtype", "bfloat16"], "SSM state in float32"),
                         (["--data-parallel-backend", "ray"], "--data-parallel-backend ray"),
                         (["--data-parallel-size-local", "1", "-dp", "2"], "must be --data-parallel-size"),
                         (["--structured-outputs-config", '{"backend": "xgrammar"}'], "backend 'xgrammar'"),
                         (["--structured-outputs-config", '{"enable_in_reasoning": true}'],
                          "'enable_in_reasoning' is not available"),
                         (["--tokenizer-mode", "slow"], "--tokenizer-mode slow is not available"),
                         (["--guided-decoding-backend", "xgrammar"], "structured outputs are llguidance's"),
                         (["--api-server-count", "2"], "--api-server-count"),
                         (["--allowed-local-media-path", str(tmp_path / "none")], "is not a folder"),
                         (["--log-config-file", str(tmp_path / "none.json")], "is not a file")]:
        assert cli.main(["serve", "--port", "0", "--no-engine-process", *flags]) == 2, flags
        assert words in capsys.readouterr().err, flags
    assert len(seen) == 1


def test_serve_loader_error_stack_and_h11_flags_reach_the_configs(monkeypatch, capsys, tmp_path):
    """vLLM's --hf-config-path, --safetensors-load-strategy, --model-loader-extra-config and
    --additional-config '{}' reach the engine's config; --log-error-stack (on by default under
    VLLM_SERVER_DEV_MODE=1, as vLLM's) and the h11 limits the server's. Values plait cannot honour are
    refused by name before the model loads."""
    import plait.entrypoints.server as server
    from plait.entrypoints import cli

    seen = []
    monkeypatch.setattr(server, "serve", lambda e, c, **_: seen.append((e, c)))
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    assert cli.main(["serve", "--port", "0", "--no-engine-process", "--hf-config-path", str(tmp_path),
                     "--safetensors-load-strategy", "eager",
                     "--model-loader-extra-config", '{"enable_multithread_load": true, "num_threads": 4}',
                     "--additional-config", "{}", "--log-error-stack",
                     "--h11-max-incomplete-event-size", "8192", "--h11-max-header-count", "64"]) == 0
    assert cli.main(["serve", "--port", "0", "--no-engine-process"]) == 0
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    assert cli.main(["serve", "--port", "0", "--no-engine-process"]) == 0
    assert cli.main(["serve", "--port", "0", "--no-engine-process", "--no-log-error-stack"]) == 0
    (engine, config), (plain_engine, plain), (_, dev), (_, dev_off) = seen
    assert (engine.hf_config_path, engine.safetensors_load_strategy) == (str(tmp_path), "eager")
    assert engine.model_loader_extra_config == {"enable_multithread_load": True, "num_threads": 4}
    assert engine.additional_config is None
    assert config.log_error_stack and (config.h11_max_incomplete_event_size, config.h11_max_header_count) == (
        8192, 64)
    assert (plain_engine.hf_config_path, plain_engine.safetensors_load_strategy) == (None, "lazy")
    assert plain_engine.model_loader_extra_config is None
    assert not plain.log_error_stack
    assert plain.h11_max_incomplete_event_size is None and plain.h11_max_header_count is None
    assert dev.log_error_stack and not dev_off.log_error_stack
    refused = [(["--additional-config", '{"ascend_scheduler_config": {}}'],
                "additional_config ['ascend_scheduler_config'] is not available"),
               (["--model-loader-extra-config", '{"enable_multithread_load": true, "pattern": "x"}'],
                "model_loader_extra_config ['pattern'] is not available"),
               (["--safetensors-load-strategy", "fast"], "safetensors_load_strategy must be one of")]
    for flags, words in refused:
        assert cli.main(["serve", "--port", "0", "--no-engine-process", *flags]) == 2, flags
        assert words in capsys.readouterr().err, flags
    for flag, value in (("--h11-max-header-count", "0"), ("--h11-max-incomplete-event-size", "-1")):
        with pytest.raises(SystemExit):  # refused as the command line is read
            cli.main(["serve", flag, value])
        assert f"argument {flag}: must be a whole number >= 1, got '{value}'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="h11_max_header_count must be a whole number >= 1"):
        server.ServerConfig(h11_max_header_count=0)
    assert len(seen) == 4


async def _ok_app(scope, receive, send):
    """An ASGI app answering 200 to every HTTP request."""
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def test_h11_limits_bound_requests_on_the_servers_uvicorn():
    """--h11-max-incomplete-event-size runs uvicorn's h11 protocol with that bound (uvicorn's "auto" would run
    httptools, which has none): a request head past it is answered 400 before it is complete.
    --h11-max-header-count answers 431 to a request with more headers. Both on the uvicorn that
    uvicorn_server (plait serve's and the data-parallel front's) builds, serving a plain app."""
    import socket
    import threading

    from plait.entrypoints.server import ServerConfig, bind_socket, uvicorn_server

    assert uvicorn_server(_ok_app, ServerConfig()).config.http == "auto"
    http = uvicorn_server(_ok_app, ServerConfig(log_level="critical", h11_max_incomplete_event_size=1024,
                                                h11_max_header_count=10))
    assert (http.config.http, http.config.h11_max_incomplete_event_size) == ("h11", 1024)
    sock = bind_socket("127.0.0.1", 0)
    thread = threading.Thread(target=http.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not http.started:
            assert thread.is_alive() and time.monotonic() < deadline
            time.sleep(0.01)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        # httpx sends 5 headers of its own (host, accept, accept-encoding, connection, user-agent).
        assert httpx.get(url, headers={f"x-{i}": "v" for i in range(5)}).status_code == 200
        many = httpx.get(url, headers={f"x-{i}": "v" for i in range(6)})
        assert many.status_code == 431
        assert "11 headers, more than the limit of 10" in many.json()["error"]["message"]
        with socket.create_connection(sock.getsockname(), timeout=10) as raw:
            # 4 KiB of a head that has not ended: past the bound, answered without waiting for its end.
            raw.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 4096)
            assert raw.recv(64).startswith(b"HTTP/1.1 400 ")
    finally:
        http.should_exit = True
        thread.join(10)
        sock.close()


def test_log_error_stack_logs_the_trace_of_error_responses(tiny_llama, caplog):
    """--log-error-stack: a 400 a request earns, a 500 from an engine error and a stream's error chunk log
    the exception's stack trace, named by status and request; without it none of them is logged."""
    import logging

    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine
    from plait.entrypoints.async_engine import RequestFailedError
    from plait.entrypoints.server import BackgroundServer, OpenAIServer, ServerConfig

    engine = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=8, max_model_len=64, num_kv_blocks=16))

    async def failing_route():
        raise RequestFailedError("the engine failed while running this request: injected")

    logged = {}
    for flag in (False, True):
        server = OpenAIServer(engine, ServerConfig(log_level="warning", log_error_stack=flag))
        server.app.add_api_route("/failing", failing_route)
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="plait.entrypoints.server"):
            with BackgroundServer(server) as url:
                bad = httpx.post(f"{url}/v1/completions", timeout=30,
                                 json={"model": server.model_name, "prompt": [5, 6, 7], "temperature": -1})
                assert bad.status_code == 400
                assert httpx.get(f"{url}/failing", timeout=30).status_code == 500
            chunk = server._stream_error(RequestFailedError("mid-stream"))
            assert chunk.startswith("data: ") and "mid-stream" in chunk
        logged[flag] = [r for r in caplog.records if r.getMessage().startswith("error response")]
        text = caplog.text
    assert logged[False] == []
    messages = [r.getMessage() for r in logged[True]]
    assert [m.split(":")[0] for m in messages] == ["error response 400 to POST /v1/completions",
                                                   "error response 500 to GET /failing",
                                                   "error response 500 in a stream"], messages
    assert all(r.exc_info is not None for r in logged[True])
    assert "in failing_route" in text and "RequestFailedError" in text  # the trace itself


async def stamp_responses(request, call_next):
    """A user's --middleware function: every response carries a header."""
    response = await call_next(request)
    response.headers["x-stamped"] = request.url.path
    return response


def test_vllm_server_options_on_a_live_server(tiny_model):
    """vLLM's --enable-force-include-usage (every stream ends with usage), --enable-tokenizer-info-endpoint
    (GET /tokenizer_info, the tokenizer's settings without file paths and the chat template) and --middleware
    (a function and a class, outside the key check) on a real server with the openai client; none of it
    without the flags, and a middleware path that does not import stops the server from starting."""
    openai = pytest.importorskip("openai")
    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine
    from plait.entrypoints.server import BackgroundServer, OpenAIServer, ServerConfig

    model = tiny_model
    engine = LLMEngine(EngineConfig(model=str(model), max_model_len=128, num_kv_blocks=64))
    config = ServerConfig(log_level="warning", api_key="key", enable_force_include_usage=True,
                          enable_tokenizer_info_endpoint=True,
                          middleware=[f"{__name__}.stamp_responses",
                                      "starlette.middleware.gzip.GZipMiddleware"])
    ask = dict(model="tiny-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True,
               extra_body={"ignore_eos": True})
    with BackgroundServer(OpenAIServer(engine, config)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="key", max_retries=0, timeout=60)
        chunks = list(client.chat.completions.create(**ask))
        assert chunks[-1].usage.completion_tokens == 3 and all(c.usage is None for c in chunks[:-1])
        completion = list(client.completions.create(model="tiny-model", prompt="hi", max_tokens=2,
                                                    stream=True, extra_body={"ignore_eos": True}))
        assert completion[-1].usage.completion_tokens == 2
        info = httpx.get(f"{url}/tokenizer_info")
        tokenizer = engine.tokenizer
        assert info.status_code == 200 and info.headers["x-stamped"] == "/tokenizer_info"
        assert info.headers["content-encoding"] == "gzip"  # the class, GZipMiddleware
        info = info.json()
        assert info["tokenizer_class"] == type(tokenizer).__name__
        assert info["chat_template"] == tokenizer.chat_template and info["eos_token"] == tokenizer.eos_token
        assert "name_or_path" not in info and str(model) not in json.dumps(info)
        refused = httpx.get(f"{url}/v1/models", headers={"Accept-Encoding": "gzip"})
        assert refused.status_code == 401 and refused.headers["x-stamped"] == "/v1/models"
    with BackgroundServer(OpenAIServer(engine, ServerConfig(log_level="warning"))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        assert all(c.usage is None for c in client.chat.completions.create(**ask))
        assert httpx.get(f"{url}/tokenizer_info").status_code == 404
        assert "x-stamped" not in httpx.get(f"{url}/health").headers
    for path in ("no_such_module.thing", f"{__name__}.QUESTIONS_UNDEFINED", "json.dumps"):
        with pytest.raises(ValueError, match="middleware"):
            OpenAIServer(engine, ServerConfig(middleware=[path]))


def test_default_chat_template_kwargs_apply_unless_a_request_sets_them(tiny_model):
    """vLLM's --default-chat-template-kwargs: every chat renders with them (here Qwen3-style thinking off: the
    prompt closes the reasoning, and the qwen3 reasoning parser reads all of the answer as content) unless
    the request sets the variable itself."""
    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine
    from plait.entrypoints.llm import encode_rendered, render_chat
    from plait.entrypoints.server import BackgroundServer, OpenAIServer, ServerConfig

    template = (ROOT / "tests" / "reasoning_chat_template.jinja").read_text()
    model = tiny_model
    engine = LLMEngine(EngineConfig(model=str(model), max_model_len=128, num_kv_blocks=64))
    config = ServerConfig(log_level="warning", chat_template=template, reasoning_parser="qwen3",
                          default_chat_template_kwargs='{"enable_thinking": false}')
    messages = [{"role": "user", "content": "hi"}]
    ask = {"model": "tiny-model", "messages": messages, "max_tokens": 4, "temperature": 0.0,
           "ignore_eos": True}
    thinking_on = {"chat_template_kwargs": {"enable_thinking": True}}
    with BackgroundServer(OpenAIServer(engine, config)) as url:
        tokens = [httpx.post(f"{url}/tokenize", json={"messages": messages, **extra}).json()["tokens"]
                  for extra in ({}, thinking_on)]
        answers = [httpx.post(f"{url}/v1/chat/completions", json={**ask, **extra}).json()
                   for extra in ({}, thinking_on)]
    answers = [answer["choices"][0]["message"] for answer in answers]
    want = [encode_rendered(engine.tokenizer, render_chat(engine.tokenizer, messages, chat_template=template,
                                                          kwargs={"enable_thinking": on}))
            for on in (False, True)]
    assert tokens == want and tokens[0] != tokens[1]
    assert answers[0]["reasoning"] is None and answers[0]["content"]
    assert answers[1]["reasoning"]  # thinking on: no </think> in 4 tokens, so all of it is reasoning
    with pytest.raises(ValueError, match="default_chat_template_kwargs"):
        ServerConfig(default_chat_template_kwargs="[1]")


def test_documents_and_reasoning_effort_reach_the_chat_template_as_vllm(tiny_model):
    """vLLM's chat fields that are template variables: documents (RAG templates) and reasoning_effort
    (gpt-oss's template reads it; the Responses API's reasoning.effort becomes it), under the request's
    chat_template_kwargs of the same names; a completion's prompt cannot take them."""
    openai = pytest.importorskip("openai")
    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine
    from plait.entrypoints.llm import encode_rendered
    from plait.entrypoints.server import BackgroundServer, OpenAIServer, ServerConfig

    template = ("{% for d in documents or [] %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
                "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                "effort={{ reasoning_effort | default('unset') }}")
    model = tiny_model
    engine = LLMEngine(EngineConfig(model=str(model), max_model_len=128, num_kv_blocks=64))
    messages = [{"role": "user", "content": "hi"}]
    docs = [{"title": "A", "text": "apples"}]

    def rendered(text: str) -> list[int]:
        return encode_rendered(engine.tokenizer, text)

    config = ServerConfig(log_level="warning", chat_template=template)
    with BackgroundServer(OpenAIServer(engine, config)) as url:
        def tokens(**extra) -> list[int]:
            return httpx.post(f"{url}/tokenize", json={"messages": messages, **extra}).json()["tokens"]

        assert tokens() == rendered("user: hi\neffort=unset")
        assert tokens(documents=docs, reasoning_effort="high") == rendered("[A: apples]user: hi\neffort=high")
        assert tokens(reasoning_effort="high", chat_template_kwargs={"reasoning_effort": "low"}) == rendered(
            "user: hi\neffort=low")
        bad = httpx.post(f"{url}/tokenize", json={"messages": messages, "reasoning_effort": "extreme"})
        assert bad.status_code == 400
        prompt_only = httpx.post(f"{url}/tokenize", json={"prompt": "hi", "documents": docs})
        assert prompt_only.status_code == 400 and "documents applies to messages only" in prompt_only.text
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        asked = client.chat.completions.create(model="tiny-model", messages=messages, max_tokens=1,
                                               reasoning_effort="low", extra_body={"documents": docs})
        assert asked.usage.prompt_tokens == len(rendered("[A: apples]user: hi\neffort=low"))
        response = client.responses.create(model="tiny-model", input="hi", max_output_tokens=1,
                                           reasoning={"effort": "medium"})
        assert response.usage.input_tokens == len(rendered("user: hi\neffort=medium"))


def test_a_server_with_skip_tokenizer_init_answers_token_ids(tiny_model):
    """vLLM's --skip-tokenizer-init on a model that has a tokenizer: completions of token-id prompts answer
    their token ids (the text empty; logprobs name tokens by id); text prompts, chat and /tokenize are 400s
    saying why."""
    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine
    from plait.entrypoints.server import BackgroundServer, OpenAIServer, ServerConfig

    model = tiny_model
    body = {"model": "tiny-model", "prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True,
            "return_token_ids": True, "temperature": 0.0}
    answers = []
    for skip in (False, True):
        engine = LLMEngine(EngineConfig(model=str(model), max_model_len=128, num_kv_blocks=64,
                                        skip_tokenizer_init=skip))
        with BackgroundServer(OpenAIServer(engine, ServerConfig(log_level="warning"))) as url:
            answers.append(httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0])
            if skip:
                scored = httpx.post(f"{url}/v1/completions", json={**body, "logprobs": 2}).json()
                text = httpx.post(f"{url}/v1/completions", json={**body, "prompt": "hi"})
                ask = {"model": "tiny-model", "messages": [{"role": "user", "content": "hi"}]}
                chat = httpx.post(f"{url}/v1/chat/completions", json=ask)
                tokenize = httpx.post(f"{url}/tokenize", json={"prompt": "hi"})
    assert answers[1]["token_ids"] == answers[0]["token_ids"] and answers[1]["text"] == ""
    # No text to name tokens by: logprobs name them "token_id:<id>", so the alternatives stay apart.
    logprobs = scored["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{t}" for t in answers[1]["token_ids"]]
    assert all(len(top) == 2 for top in logprobs["top_logprobs"])
    assert text.status_code == 400 and "skip_tokenizer_init" in text.json()["error"]["message"]
    assert chat.status_code == 400 and "chat template" in chat.json()["error"]["message"]
    assert tokenize.status_code == 400 and "no tokenizer" in tokenize.json()["error"]["message"]


def test_a_unix_socket_in_use_or_of_another_file_is_refused_and_a_stale_one_replaced(tmp_path, capsys):
    """vLLM's --uds: a path a server listens on, or a file that is not a socket, is refused before the model
    loads; a socket file left by a killed server is replaced; a server's own goes when it stops."""
    import socket

    from plait.entrypoints import cli
    from plait.entrypoints.launcher import bind_unix_socket, close_socket

    path = str(tmp_path / "s.sock")
    live = bind_unix_socket(path)
    args = ["serve", "--model", str(tmp_path / "no-such-model"), "--uds", path]
    assert cli.main(args) == 2
    assert f"cannot serve on unix socket {path}: a server is listening on it" in capsys.readouterr().err
    close_socket(live, path)
    assert not os.path.exists(path)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)
    stale.close()  # as a killed server leaves it: the file, and no one listening
    with contextlib.closing(bind_unix_socket(path)) as again:
        assert again.getsockname() == path and os.stat(path).st_mode & 0o777 == 0o666
    os.unlink(path)
    Path(path).write_text("not a socket")
    assert cli.main(args) == 2
    assert "the path exists and is not a socket" in capsys.readouterr().err


def test_plait_serve_on_a_unix_socket_as_vllm(tmp_path, tiny_model):
    """vLLM's --uds with --disable-fastapi-docs, --response-role and --chat-template-content-format on a real
    `plait serve`: the openai client talks through the socket, the answers carry the role, a template's
    content is the format chosen, there are no docs pages, and the socket file goes when the server stops."""
    openai = pytest.importorskip("openai")
    from plait.entrypoints.llm import encode_rendered
    from plait.loader.tokenizer import load_tokenizer

    model = tiny_model
    path = str(tmp_path / "plait.sock")
    # It loops over a message's content, so "auto" would give it the parts; "string" gives it their text.
    template = ("{% for m in messages %}<{{ m['role'] }}>{% if m['content'] is string %}{{ m['content'] }}"
                "{% else %}{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endif %}{% endfor %}")
    args = [sys.executable, "-m", "plait.entrypoints.cli", "serve", "--model", str(model), "--max-model-len",
            "128", "--num-kv-blocks", "64", "--uds", path, "--disable-fastapi-docs", "--response-role", "bot",
            "--chat-template", template, "--chat-template-content-format", "string", "--log-level", "warning"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env)
    try:
        banner = "".join(itertools.takewhile(lambda line: "-d '" not in line, proc.stdout))
        assert f"on unix socket {path} (OpenAI API at http://localhost/v1 through it)" in banner
        assert f"curl --unix-socket {path} http://localhost/v1/chat/completions" in banner
        http = httpx.Client(transport=httpx.HTTPTransport(uds=path), base_url="http://localhost", timeout=60)
        client = openai.OpenAI(base_url="http://localhost/v1", api_key="none", http_client=http,
                               max_retries=0)
        parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
        messages = [{"role": "user", "content": parts}]
        kwargs = dict(model="tiny-model", messages=messages, max_tokens=2)
        assert client.chat.completions.create(**kwargs).choices[0].message.role == "bot"
        stream = client.chat.completions.create(stream=True, **kwargs)
        assert next(c for c in stream if c.choices).choices[0].delta.role == "bot"
        tokens = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
        assert tokens["tokens"] == encode_rendered(load_tokenizer(model), "<user>a\nb")
        assert [http.get(page).status_code for page in ("/docs", "/redoc", "/openapi.json")] == [404] * 3
        assert http.get("/health").status_code == 200
    finally:
        stop_plait_serve(proc)
    assert proc.returncode == 0 and not os.path.exists(path)


def test_plait_serve_process(tmp_path, tiny_model):
    model = tiny_model
    args = ["--model", str(model), "--max-model-len", "128", "--num-kv-blocks", "64"]
    with plait_serve_process(tmp_path, args, {"PLAIT_API_KEY": "cli-key"}) as (url, banner):
        assert "tiny-model" in banner  # the served name: the model folder's name
        assert f"curl {url}/v1/chat/completions" in banner and "Bearer $PLAIT_API_KEY" in banner
        body = {"model": "tiny-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": "Bearer cli-key"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert httpx.post(f"{url}/v1/chat/completions", json=body).status_code == 401


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads a process's children from /proc")
def test_plait_serve_exits_when_its_engine_dies(tmp_path, tiny_model):
    """As vLLM's: an engine that dies under `plait serve` (its process killed here) fails the request in
    flight with an error, then ends the server with ENGINE_DEAD_EXIT_CODE, for its supervisor to restart."""
    from plait.entrypoints.server import ENGINE_DEAD_EXIT_CODE

    model = tiny_model
    args = ["--model", str(model), "--max-model-len", "128", "--num-kv-blocks", "64"]
    proc, url, _, log_path = start_plait_serve(tmp_path, args)
    try:
        (engine_pid,) = _children(proc.pid)
        body = {"model": "tiny-model", "prompt": "hi", "max_tokens": 100, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # it is running
            os.kill(engine_pid, signal.SIGKILL)
            rest = "\n".join(lines)
        assert '"error"' in rest and "engine" in rest
        proc.wait(SERVE_SHUTDOWN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == ENGINE_DEAD_EXIT_CODE, log_path.read_text()
    assert "the engine stopped" in log_path.read_text()


def _self_signed(tmp_path):
    """A key and a certificate for 127.0.0.1, made by the openssl command (skipped where there is none)."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return str(key), str(cert)


def test_serve_vllm_logging_and_https_flags_reach_the_config(monkeypatch, tmp_path):
    import plait.entrypoints.server as server
    from plait.entrypoints import cli

    key, cert = _self_signed(tmp_path)
    seen = []
    monkeypatch.setattr(server, "serve", lambda e, c, **_: seen.append((e, c)))
    assert cli.main(["serve", "--ssl-keyfile", key, "--ssl-certfile", cert, "--enable-ssl-refresh",
                     "--root-path", "/api",
                     "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log",
                     "--enable-log-requests",
                     "--max-log-len", "10", "--disable-log-requests", "--trust-remote-code",
                     "--tokenizer", "some/tokenizer", "--revision", "v2", "--download-dir", str(tmp_path),
                     "--max-logprobs", "-1", "--override-generation-config", '{"temperature": 0.3}',
                     "--scheduling-policy", "priority", "--enable-sleep-mode",
                     "--enable-prompt-tokens-details", "--enable-server-load-tracking",
                     "--enable-request-id-headers", "--step-timeline-file", "steps.json",
                     "--no-warm-up"]) == 0
    engine, config = seen[0]
    assert (config.ssl_keyfile, config.ssl_certfile, config.root_path) == (key, cert, "/api")
    assert config.enable_ssl_refresh
    assert (config.uvicorn_log_level, config.disable_uvicorn_access_log) == ("warning", True)
    assert (config.enable_log_requests, config.max_log_len) == (True, 10)
    assert config.enable_prompt_tokens_details and config.enable_server_load_tracking
    assert config.enable_request_id_headers and engine.warm_up is False
    assert config.step_timeline_file == "steps.json"
    assert (engine.tokenizer, engine.revision, engine.download_dir) == ("some/tokenizer", "v2", str(tmp_path))
    assert (engine.max_logprobs, engine.override_generation_config) == (-1, {"temperature": 0.3})
    assert engine.scheduling_policy == "priority" and engine.enable_sleep_mode
    for bad, words in [(dict(ssl_keyfile=key), "both ssl_keyfile and ssl_certfile"),
                       (dict(ssl_ca_certs=cert), "needs ssl_keyfile and ssl_certfile"),
                       (dict(ssl_keyfile=key, ssl_certfile=str(tmp_path / "none.pem")), "is not a file")]:
        with pytest.raises(ValueError, match=words):
            server.ServerConfig(**bad)


def test_https_serves_the_openai_client_and_logs_requests(tmp_path, tiny_llama, caplog):
    """--ssl-keyfile / --ssl-certfile: the openai client, trusting the certificate, gets its completion over
    HTTPS (plain HTTP gets none); --enable-log-requests logs each request and --enable-log-outputs each
    finished output, streamed or not, both cut to --max-log-len and named by the response's id."""
    import logging

    openai = pytest.importorskip("openai")
    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine
    from plait.entrypoints.server import BackgroundServer, OpenAIServer, ServerConfig

    key, cert = _self_signed(tmp_path)
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=8, max_model_len=128))
    config = ServerConfig(log_level="warning", ssl_keyfile=key, ssl_certfile=cert, enable_log_requests=True,
                          max_log_len=3, enable_log_outputs=True)
    prompt = [5, 17, 33, 2, 9, 41]
    with caplog.at_level(logging.INFO, logger="plait.entrypoints.server"):
        with BackgroundServer(OpenAIServer(engine, config)) as url:
            assert url.startswith("https://")
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60,
                                   http_client=httpx.Client(verify=cert))
            ids = {"ignore_eos": True, "return_token_ids": True}
            reply = client.completions.create(model=engine.model_name, prompt=prompt, max_tokens=3,
                                              temperature=0.0, extra_body=ids,
                                              extra_headers={"X-Request-Id": "trace-7"})
            assert reply.usage.completion_tokens == 3 and reply.id == "cmpl-trace-7"
            reply_ids = reply.choices[0].token_ids
            chunks = list(client.completions.create(model=engine.model_name, prompt=prompt, max_tokens=2,
                                                    stream=True, extra_body=ids,
                                                    extra_headers={"X-Request-Id": "trace-8"}))
            assert {c.id for c in chunks} == {"cmpl-trace-8"}
            stream_ids = [t for c in chunks for ch in c.choices for t in ch.token_ids]
            with pytest.raises(httpx.HTTPError):
                httpx.get(url.replace("https://", "http://") + "/health", timeout=5)
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Received request")]
    assert len(logged) == 2 and "prompt_token_ids: [5, 17, 33]," in logged[0], logged
    assert logged[0].startswith("Received request cmpl-trace-7-0: "), logged  # vLLM's name: id, then index
    outputs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Generated response")]
    assert outputs == [f"Generated response cmpl-trace-7-0: output: '', output_token_ids: {reply_ids}, "
                       "finish_reason: length",
                       f"Generated response cmpl-trace-8-0: output: '', output_token_ids: {stream_ids}, "
                       "finish_reason: length"], outputs
    assert "temperature=0.0" in logged[0]


def test_ssl_refresh_serves_a_rotated_certificate_without_a_restart(tmp_path, tiny_llama):
    """--enable-ssl-refresh: once the key and certificate files are replaced, new connections get the new
    certificate (the openai client trusting only it gets its answer); without the flag the old one stays."""
    import ssl
    from urllib.parse import urlparse

    openai = pytest.importorskip("openai")
    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine
    from plait.entrypoints import server as srv

    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    key, cert = _self_signed(first)
    new_key, new_cert = _self_signed(second)
    served_key, served_cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=8, max_model_len=64))

    def served_certificate(url: str) -> str:
        address = urlparse(url)
        return ssl.get_server_certificate((address.hostname, address.port))

    for refresh in (True, False):
        served_key.write_bytes(Path(key).read_bytes()), served_cert.write_bytes(Path(cert).read_bytes())
        config = srv.ServerConfig(log_level="warning", ssl_keyfile=str(served_key),
                                  ssl_certfile=str(served_cert), enable_ssl_refresh=refresh)
        with srv.BackgroundServer(srv.OpenAIServer(engine, config)) as url:
            assert ssl.PEM_cert_to_DER_cert(served_certificate(url)) == ssl.PEM_cert_to_DER_cert(
                Path(cert).read_text())
            time.sleep(1.1)  # a later modification time than the first files'
            served_key.write_bytes(Path(new_key).read_bytes())
            served_cert.write_bytes(Path(new_cert).read_bytes())
            want = ssl.PEM_cert_to_DER_cert(Path(new_cert).read_text())
            # Without the flag, three polls' time shows that nothing reloads.
            deadline = time.monotonic() + (10 if refresh else 3) * srv.SSL_REFRESH_POLL_S
            while ssl.PEM_cert_to_DER_cert(served_certificate(url)) != want and time.monotonic() < deadline:
                time.sleep(0.2)
            rotated = ssl.PEM_cert_to_DER_cert(served_certificate(url)) == want
            assert rotated == refresh
            if refresh:
                client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60,
                                       http_client=httpx.Client(verify=new_cert))
                reply = client.completions.create(model=engine.model_name, prompt=[5, 6, 7], max_tokens=2)
                assert reply.usage.completion_tokens >= 1
    with pytest.raises(ValueError, match="enable_ssl_refresh reloads the HTTPS files"):
        srv.ServerConfig(enable_ssl_refresh=True)


def test_data_parallel_serves_one_address_over_replicas(tmp_path, tiny_model):
    """`plait serve --data-parallel-size 2`: two replica processes behind one address. The openai client's
    concurrent requests (streamed or not) get the answers one server gives, spread over both replicas (their
    merged /metrics count each under its engine label); a bad request gets the replica's 400, the API key is
    checked, a stored response is found on its replica whichever is least busy, and the replicas end with the
    server."""
    import asyncio

    openai = pytest.importorskip("openai")
    from plait import LLM, SamplingParams

    model = tiny_model
    prompts = [[5 + i, 17, 33 + 2 * i, 9] for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    longer = {"max_position_embeddings": 1024}  # room for the hung-up stream's 1,000 tokens below
    llm = LLM(str(model), max_model_len=1024, num_kv_blocks=160, hf_overrides=longer)
    want = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                          use_tqdm=False)]
    args = ["--model", str(model), "--max-model-len", "1024", "--num-kv-blocks", "160",
            "--hf-overrides", json.dumps(longer), "--data-parallel-size", "2",
            "--step-timeline-file", str(tmp_path / "steps.json")]
    with plait_serve_process(tmp_path, args, {"PLAIT_API_KEY": "dp-key"}) as (url, banner):
        assert "2 data parallel replicas" in banner and f"curl {url}/v1/chat/completions" in banner
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="dp-key", max_retries=0, timeout=120)

        async def ask(i: int) -> list[int]:
            kwargs = dict(model="tiny-model", prompt=prompts[i], max_tokens=6, temperature=0.0, logprobs=0,
                          extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
            if i % 2:
                tokens = []
                async for chunk in await client.completions.create(stream=True, **kwargs):
                    tokens += chunk.choices[0].logprobs.tokens if chunk.choices else []
            else:
                tokens = (await client.completions.create(**kwargs)).choices[0].logprobs.tokens
            return [int(t.split(":")[1]) for t in tokens]

        async def everything() -> list[list[int]]:
            return await asyncio.gather(*(ask(i) for i in range(len(prompts))))

        assert asyncio.run(everything()) == want
        metrics = httpx.get(f"{url}/metrics").text
        counts = {}
        for line in metrics.splitlines():
            if line.startswith("vllm:request_success_total{"):
                engine = line.split('engine="')[1].split('"')[0]
                counts[engine] = counts.get(engine, 0) + float(line.rsplit(" ", 1)[1])
        assert set(counts) == {"0", "1"} and all(c > 0 for c in counts.values()), counts
        assert sum(counts.values()) == len(prompts)
        assert metrics.count("# TYPE vllm:request_success_total counter") == 1
        bad = httpx.post(f"{url}/v1/completions", headers={"Authorization": "Bearer dp-key"},
                         json={"model": "tiny-model", "prompt": "hi", "max_tokens": 0})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/health").json() == {"status": "ok", "replicas": [200, 200]}

        # A client that hangs up mid-stream: the front closes the replica's stream, which aborts the request
        # there long before its 1,000 tokens (a few seconds of this model's decode on two cores).
        def totals(name: str) -> float:
            text = httpx.get(f"{url}/metrics").text
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith(name + "{"))

        before = totals("vllm:generation_tokens_total")
        long = {"model": "tiny-model", "prompt": prompts[0], "max_tokens": 1000, "stream": True,
                "ignore_eos": True}
        auth = {"Authorization": "Bearer dp-key"}
        with httpx.stream("POST", f"{url}/v1/completions", json=long, headers=auth, timeout=60) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # the stream has started; leaving the block closes the connection
        deadline = time.monotonic() + 30
        while totals("vllm:num_requests_running") + totals("vllm:num_requests_waiting") > 0:
            assert time.monotonic() < deadline, "the abandoned request kept running"
            time.sleep(0.1)
        assert totals("vllm:generation_tokens_total") - before < 1000

        # Stored responses made at once land on both replicas; with both idle again the least busy is replica
        # 0, yet each is found, and a follow-up naming one runs where it is stored: their ids name it.
        async def at_once() -> list:
            fresh = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="dp-key", max_retries=0, timeout=120)
            return await asyncio.gather(*(fresh.responses.create(model="tiny-model", input=f"Hello {i}",
                                                                 max_output_tokens=8) for i in range(6)))

        made = asyncio.run(at_once())
        assert {r.id[:len("resp_dpN-")] for r in made} == {"resp_dp0-", "resp_dp1-"}
        sync = openai.OpenAI(base_url=f"{url}/v1", api_key="dp-key", max_retries=0, timeout=120)
        for stored in made:
            assert sync.responses.retrieve(stored.id).output_text == stored.output_text
        stored = next(r for r in made if r.id.startswith("resp_dp1-"))
        follow = sync.responses.create(model="tiny-model", input="And then?", max_output_tokens=3,
                                       previous_response_id=stored.id)
        assert follow.id.startswith("resp_dp1-") and follow.previous_response_id == stored.id
    # Each replica wrote its own engine's steps when it stopped (the front runs no engine).
    steps = [json.loads((tmp_path / f"steps.dp{i}.json").read_text())["steps"] for i in (0, 1)]
    assert all(steps) and not (tmp_path / "steps.json").exists()


def test_data_parallel_replicas_take_their_own_gpus_and_metrics_merge():
    from plait.entrypoints.data_parallel import merge_metrics, replica_devices, replica_timeline_file

    # Each replica's engine keeps a step timeline of its own.
    assert replica_timeline_file("/tmp/run/steps.json", 1) == "/tmp/run/steps.dp1.json"
    assert replica_timeline_file(None, 0) is None

    assert [replica_devices(i, 1, "0,1,2,3") for i in range(4)] == ["0", "1", "2", "3"]
    assert [replica_devices(i, 2, "4,5,6,7") for i in range(2)] == ["4,5", "6,7"]  # within what is visible
    with pytest.raises(ValueError, match="replica 2 needs GPUs 4..5, but only 4 are visible"):
        replica_devices(2, 2, "0,1,2,3")
    one = ('# HELP vllm:num_requests_running Requests running.\n# TYPE vllm:num_requests_running gauge\n'
           'vllm:num_requests_running{model_name="m"} 2.0\n# HELP up Up.\n# TYPE up gauge\nup 1.0\n')
    two = one.replace("2.0", "5.0")
    merged = merge_metrics([one, two])
    assert merged.count("# TYPE vllm:num_requests_running gauge") == 1
    assert 'vllm:num_requests_running{engine="0",model_name="m"} 2.0' in merged
    assert 'vllm:num_requests_running{engine="1",model_name="m"} 5.0' in merged
    assert 'up{engine="1"} 1.0' in merged
    # Each family's comments, then its samples from every replica.
    lines = merged.splitlines()
    where = [lines.index(line) for line in ("# TYPE up gauge", 'up{engine="0"} 1.0', 'up{engine="1"} 1.0')]
    assert where == sorted(where)


def test_data_parallel_front_routes_broadcasts_and_reports_health():
    """The front alone, over stand-in replicas (httpx's MockTransport): a request goes to the replica with
    the fewest in flight (one that refuses the connection: to the next; all of them: a 503 naming the error),
    a LoRA load to every replica (the first refusal is the client's answer), and /health is ok only while
    every replica is."""
    import asyncio
    import subprocess

    from plait.entrypoints.data_parallel import DataParallelFront, Replica

    seen: list[tuple[str, str]] = []
    refuse_loads_at = {"http://r1"}
    down: set[str] = set()
    unreachable: set[str] = set()

    def answer(status: int, body: dict) -> httpx.Response:
        async def chunks():  # a stream, as a server's body arrives (httpx reads a bytes body at once)
            yield json.dumps(body).encode()

        return httpx.Response(status, headers={"content-type": "application/json"}, content=chunks())

    def replica(request: httpx.Request) -> httpx.Response:
        origin = f"{request.url.scheme}://{request.url.host}"
        query = request.url.query.decode()
        seen.append((origin, f"{request.url.path}?{query}" if query else request.url.path))
        if origin in down:
            return answer(503, {"status": "down"})
        if origin in unreachable:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/v1/load_lora_adapter" and origin in refuse_loads_at:
            return answer(400, {"error": {"message": "bad adapter", "param": "lora_path"}})
        return answer(200, {"replica": origin, "path": request.url.path,
                            "auth": request.headers.get("authorization")})

    replicas = [Replica(i, subprocess.Popen(["true"]), url=f"http://r{i}") for i in range(3)]
    front = DataParallelFront(replicas, api_key="k", max_body_bytes=1 << 20)
    front.client = httpx.AsyncClient(transport=httpx.MockTransport(replica))
    auth = {"Authorization": "Bearer k"}

    async def scenario() -> None:
        app = httpx.ASGITransport(app=front.app)
        async with httpx.AsyncClient(transport=app, base_url="http://front") as c:
            replicas[0].in_flight, replicas[1].in_flight, replicas[2].in_flight = 2, 0, 1
            r = await c.post("/v1/completions", json={"prompt": "x"}, headers=auth)
            assert r.json() == {"replica": "http://r1", "path": "/v1/completions", "auth": "Bearer k"}
            assert [x.in_flight for x in replicas] == [2, 0, 1]  # its stream done, r1 has none again
            unreachable.update({"http://r1", "http://r2"})  # refused before answering: retried elsewhere
            r = await c.post("/v1/completions", json={"prompt": "x"}, headers=auth)
            assert r.json()["replica"] == "http://r0" and [x.in_flight for x in replicas] == [2, 0, 1]
            unreachable.add("http://r0")
            r = await c.post("/v1/completions", json={"prompt": "x"}, headers=auth)
            assert r.status_code == 503 and "ConnectError: connection refused" in r.json()["error"]["message"]
            assert [x.in_flight for x in replicas] == [2, 0, 1]
            unreachable.clear()
            assert (await c.post("/v1/completions", json={})).status_code == 401  # the key, checked first
            seen.clear()
            load = {"lora_name": "a", "lora_path": "/x"}
            r = await c.post("/v1/load_lora_adapter", json=load, headers=auth)
            assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
            assert seen == [("http://r0", "/v1/load_lora_adapter"), ("http://r1", "/v1/load_lora_adapter")]
            refuse_loads_at.clear()
            seen.clear()
            r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "a"}, headers=auth)
            assert r.status_code == 200
            assert [path for _, path in seen] == ["/v1/unload_lora_adapter"] * 3
            seen.clear()
            assert (await c.post("/reset_prefix_cache")).status_code == 200  # dev mode: every replica's cache
            assert seen == [(f"http://r{i}", "/reset_prefix_cache") for i in range(3)]
            seen.clear()
            assert (await c.post("/sleep", params={"level": 1})).status_code == 200  # sleep mode: all of them
            assert (await c.post("/wake_up", params={"tags": "weights"})).status_code == 200
            assert seen == ([(f"http://r{i}", "/sleep?level=1") for i in range(3)]
                            + [(f"http://r{i}", "/wake_up?tags=weights") for i in range(3)])
            assert (await c.get("/health")).json() == {"status": "ok", "replicas": [200, 200, 200]}
            down.add("http://r2")
            r = await c.get("/health")
            assert r.status_code == 503 and r.json()["replicas"] == [200, 200, 503]

    asyncio.run(scenario())
    for r in replicas:
        r.process.wait()


def test_plait_serve_takes_logits_processors_and_prompt_embeds_through_its_engine_process(tmp_path,
                                                                                          tiny_model):
    """`plait serve --logits-processors module:Class --enable-prompt-embeds`, its engine in a process of its
    own (the default): the processor is imported there by name and reads the request's vllm_xargs, and
    prompt_embeds cross the process boundary; the openai client's calls as vLLM's docs make them."""
    openai = pytest.importorskip("openai")
    import torch
    from test_prompt_embeds import _encoded

    model = tiny_model
    args = [str(model), "--max-model-len", "128", "--num-kv-blocks", "64", "--enable-prompt-embeds",
            "--logits-processors", "test_logits_processors:TargetToken"]
    tests = str(Path(__file__).parent)
    with plait_serve_process(tmp_path, args, env={"PYTHONPATH": f"{ROOT}{os.pathsep}{tests}"}) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        ask = dict(model="tiny-model", max_tokens=4, temperature=0)
        forced = client.completions.create(prompt="hi", **ask, extra_body={
            "return_token_ids": True, "ignore_eos": True, "vllm_xargs": {"target_token": 9}})
        assert forced.choices[0].token_ids == [9] * 4
        with pytest.raises(openai.BadRequestError, match="target_token must be a token id"):
            client.completions.create(prompt="hi", **ask, extra_body={"vllm_xargs": {"target_token": "x"}})
        width = json.loads((model / "config.json").read_text())["hidden_size"]
        embeds = torch.randn(5, width, generator=torch.Generator().manual_seed(1))
        answer = client.completions.create(prompt="", **ask, extra_body={
            "prompt_embeds": _encoded(embeds), "return_token_ids": True, "ignore_eos": True})
        assert len(answer.choices[0].token_ids) == 4 and answer.usage.prompt_tokens == 5


@pytest.fixture(scope="module")
def stream_interval_engine(tiny_model):
    """A tiny model with the default model's tokenizer and chat template (a Responses stream's conversation
    needs them), for the --stream-interval tests' servers."""
    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(tiny_model), block_size=8, max_model_len=128))


@pytest.fixture(scope="module", params=[4, 1], ids=["interval4", "interval1"])
def stream_interval_served(request, stream_interval_engine):
    """stream_interval_engine served with --stream-interval 4, then 1 (pytest runs the tests of one server,
    then stops it and starts the next): (the interval, an openai client, the model's name)."""
    openai = pytest.importorskip("openai")
    from plait.entrypoints.server import BackgroundServer, OpenAIServer, ServerConfig

    config = ServerConfig(log_level="warning", stream_interval=request.param)
    with BackgroundServer(OpenAIServer(stream_interval_engine, config)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        yield request.param, client, stream_interval_engine.model_name


def test_stream_interval_sends_fuller_chunks_after_the_first(stream_interval_served):
    """vLLM's --stream-interval 4: a streamed answer's first token is not held (time to first token), then
    chunks of at least 4 tokens but its last; the tokens are the unstreamed answer's, as under 1."""
    from plait.entrypoints.server import ServerConfig

    interval, client, model = stream_interval_served
    ask = dict(model=model, prompt=[5, 6, 7, 8], max_tokens=11, temperature=0,
               extra_body={"ignore_eos": True, "return_token_ids": True})
    whole = client.completions.create(**ask).choices[0].token_ids
    sizes, ids = [], []
    for chunk in client.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            if choice.token_ids:
                sizes.append(len(choice.token_ids))
                ids += choice.token_ids
    assert ids == whole and len(whole) == 11
    # A reader that falls behind gets piled-up outputs merged (merge_backlog), so chunks may only grow:
    # under interval 4, at most the first token alone and then 10 tokens in chunks of 4 or more.
    assert all(size >= interval for size in sizes[1:-1]) and len(sizes) <= (4 if interval == 4 else 11)
    with pytest.raises(ValueError, match="stream_interval must be a whole number >= 1"):
        ServerConfig(stream_interval=0)


def test_responses_stream_interval_sends_fuller_text_deltas_after_the_first(stream_interval_served):
    """--stream-interval reaches Responses streams as it does completions' and chat's (the same
    RequestStream.read_as_chunks): under 4, the first text delta is the first token alone, then deltas of at
    least 4 tokens but the last; under 1, a delta per token (or per output read, where the reader fell
    behind). Each delta's tokens are counted by its logprobs, one per token; the text is the unstreamed
    answer's."""
    interval, client, model = stream_interval_served
    ask = dict(model=model, input="Count to ten.", max_output_tokens=11, temperature=0, store=False,
               include=["message.output_text.logprobs"], top_logprobs=0, extra_body={"ignore_eos": True})
    whole = client.responses.create(**ask)
    events = list(client.responses.create(**ask, stream=True))
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    sizes = [len(delta.logprobs) for delta in deltas]
    assert "".join(delta.delta for delta in deltas) == whole.output_text
    assert sum(sizes) == events[-1].response.usage.output_tokens == 11
    # As above, a reader that falls behind may get more tokens a delta, never fewer (under 1, the last two
    # tokens often come as one delta on 2 busy cores): under 4, at most 1, 4, 4 and 2.
    assert all(size >= interval for size in sizes[1:-1]) and len(sizes) <= (4 if interval == 4 else 11)
