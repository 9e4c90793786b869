"""The OpenAI-compatible server end to end: a real uvicorn server, the default model, the openai client."""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
prometheus_parser = pytest.importorskip("prometheus_client.parser")

from plait.config import EngineConfig  # noqa: E402
from plait.engine.engine import LLMEngine  # noqa: E402
from plait.entrypoints.llm import apply_chat_template  # noqa: E402
from plait.entrypoints.protocol import MAX_N  # noqa: E402
from plait.entrypoints.server import (  # noqa: E402
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    BackgroundServer,
    OpenAIServer,
    ServerConfig,
)

API_KEY = "test-key-1234"
MAX_NUM_BATCHED_TOKENS = 256
# Short answers keep the module within a few minutes on two busy cores.
MAX_TOKENS = 12
CONCURRENT_MAX_TOKENS = 16
NUM_CLIENTS = 32
NUM_DISCONNECTING = 8
# Disconnecting clients ask for far more than they read, so their requests can only end by abort.
DISCONNECT_MAX_TOKENS = 400
CLIENT_TIMEOUT_S = 240.0
IDLE_TIMEOUT_S = 30.0
QUESTIONS = [
    "Name a color.", "What is 2 + 2?", "Say hello in French.", "Name a planet.",
    "What is the opposite of hot?", "Name a fruit.", "What do bees make?", "Name a large animal.",
]


@pytest.fixture(scope="module")
def served():
    engine = LLMEngine(EngineConfig(max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS))
    server = OpenAIServer(engine, ServerConfig(api_key=API_KEY, log_level="warning"))
    with BackgroundServer(server) as url:
        yield server, url


@pytest.fixture(scope="module")
def client(served):
    _, url = served
    return openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=CLIENT_TIMEOUT_S)


@pytest.fixture(scope="module")
def model(served) -> str:
    return served[0].model_name


def _messages(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def _metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics by name (with labels folded into the name)."""
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    samples = {}
    for family in prometheus_parser.text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "le")
            key = f"{s.name}{{{labels}}}" if labels else s.name
            if "le" in s.labels:
                key += f"[le={s.labels['le']}]"
            samples[key] = s.value
    return samples


def _delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after[name] - before.get(name, 0.0)


def _wait_idle(server: OpenAIServer) -> None:
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.engine.call_threadsafe(lambda e: not e.has_unfinished_requests(), IDLE_TIMEOUT_S):
            return
        time.sleep(0.05)
    raise AssertionError("the engine did not become idle")


# -- happy paths ---------------------------------------------------------------------------------


def test_models_health_and_auth(served, client, model):
    server, url = served
    assert [m.id for m in client.models.list().data] == [model]
    assert model == "SmolLM2-135M-Instruct.Q4_1"  # the default model file's stem
    assert httpx.get(f"{url}/health").status_code == 200  # no key needed
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.get(f"{url}/v1/models", headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "hi"})
    assert r.status_code == 401


def test_chat_stream_equals_non_stream_with_usage(served, client, model):
    server, _ = served
    messages = _messages("Name three rivers.")
    kwargs = dict(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0.0)
    full = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=2)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    prompt_ids = apply_chat_template(server.tokenizer, messages)
    assert full.usage.prompt_tokens == len(prompt_ids)
    assert full.usage.completion_tokens == len(choice.logprobs.content) <= MAX_TOKENS
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
    assert all(entry.logprob <= 0.0 for entry in choice.logprobs.content)

    usage_opts = {"include_usage": True}
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options=usage_opts))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        choice.finish_reason]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_equals_non_stream(served, client, model):
    server, _ = served
    prompt = "The capital of France is"
    prompt_ids = list(server.tokenizer.encode(prompt))
    kwargs = dict(model=model, max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True})
    by_text = client.completions.create(prompt=prompt, logprobs=2, **kwargs)
    by_ids = client.completions.create(prompt=prompt_ids, **kwargs)
    choice = by_text.choices[0]
    assert choice.text == by_ids.choices[0].text and choice.finish_reason == "length"
    assert by_text.usage.prompt_tokens == len(prompt_ids)
    assert by_text.usage.completion_tokens == MAX_TOKENS == len(choice.logprobs.tokens)
    assert len(choice.logprobs.top_logprobs) == MAX_TOKENS
    assert choice.logprobs.text_offset[0] == 0

    usage_opts = {"include_usage": True}
    chunks = list(client.completions.create(prompt=prompt, stream=True, stream_options=usage_opts, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_n_and_prompt_batch(served, client, model):
    kwargs = dict(model=model, prompt=["Once upon a time", "The sky is"], n=2, max_tokens=4, temperature=0.8,
                  seed=7, extra_body={"ignore_eos": True})
    r = client.completions.create(**kwargs)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 4 * 4
    again = client.completions.create(**kwargs)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeded: reproducible
    stop = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=MAX_TOKENS,
                                     temperature=0.0, stop=[","])
    assert stop.choices[0].finish_reason == "stop" and "," not in stop.choices[0].text


# -- concurrency and disconnects -----------------------------------------------------------------


def test_concurrent_streams_with_disconnects(served, client, model):
    server, url = served
    solo = {}
    for q in QUESTIONS:  # one at a time: each alone in the engine
        r = client.chat.completions.create(model=model, messages=_messages(q),
                                           max_tokens=CONCURRENT_MAX_TOKENS, temperature=0.0)
        solo[q] = (r.choices[0].message.content, r.choices[0].finish_reason)
    _wait_idle(server)
    before = _metrics(url)
    rng = random.Random(1234)
    leavers = dict.fromkeys(rng.sample(range(NUM_CLIENTS), NUM_DISCONNECTING))
    for i in leavers:
        leavers[i] = rng.randint(1, 4)  # chunks read before hanging up

    async def one(aclient: openai.AsyncOpenAI, i: int) -> tuple[str, str | None, int]:
        q = QUESTIONS[i % len(QUESTIONS)]
        max_tokens = DISCONNECT_MAX_TOKENS if i in leavers else CONCURRENT_MAX_TOKENS
        extra = {"ignore_eos": True} if i in leavers else {}
        stream = await aclient.chat.completions.create(model=model, messages=_messages(q),
                                                       max_tokens=max_tokens, temperature=0.0, stream=True,
                                                       extra_body=extra)
        text, finish, n = "", None, 0
        async for chunk in stream:
            n += 1
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
            if i in leavers and n >= leavers[i]:
                await stream.close()  # hang up mid-stream
                break
        return text, finish, n

    async def run_all() -> list[tuple[str, str | None, int]]:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0,
                                      timeout=CLIENT_TIMEOUT_S) as aclient:
            return await asyncio.wait_for(asyncio.gather(*(one(aclient, i) for i in range(NUM_CLIENTS))),
                                          CLIENT_TIMEOUT_S)

    results = asyncio.run(run_all())
    for i, (text, finish, _) in enumerate(results):
        if i not in leavers:
            assert (text, finish) == solo[QUESTIONS[i % len(QUESTIONS)]], f"client {i}"
        else:
            assert finish is None, f"client {i} should have left before the end"
    _wait_idle(server)
    after = _metrics(url)
    assert after["plait_kv_cache_usage_perc"] == 0.0
    assert after["plait_num_requests_running"] == after["plait_num_requests_waiting"] == 0
    assert server.engine.call_threadsafe(lambda e: e.is_idle_and_clean(), IDLE_TIMEOUT_S)
    aborted = "plait_requests_finished_total{finished_reason=abort}"
    assert after[aborted] - before[aborted] == NUM_DISCONNECTING
    finished = sum(_delta(before, after, f"plait_requests_finished_total{{finished_reason={r}}}")
                   for r in ("stop", "length"))
    assert finished == NUM_CLIENTS - NUM_DISCONNECTING
    # They really ran together: some step decoded for more than 8 of them at once.
    decode_steps = _delta(before, after, "plait_step_decode_tokens_count")
    assert _delta(before, after, "plait_step_decode_tokens_bucket[le=8.0]") < decode_steps


def test_non_streaming_client_timeout_aborts(served, model):
    """A client that gives up on a non-streamed request (timeout) frees its blocks too."""
    server, url = served
    before = _metrics(url)
    body = {"model": model, "prompt": "Count slowly:", "max_tokens": DISCONNECT_MAX_TOKENS,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                   timeout=httpx.Timeout(10.0, read=1.0))
    _wait_idle(server)
    after = _metrics(url)
    aborted = "plait_requests_finished_total{finished_reason=abort}"
    assert after[aborted] - before[aborted] == 1
    assert after["plait_kv_cache_usage_perc"] == 0.0


# -- bad input ---------------------------------------------------------------------------------


TOO_LONG = 9000  # token ids: more than the default model's 8192-token context

BAD_REQUESTS = [
    # (path, body (dict, or raw bytes), status, param, words the message must contain)
    ("/v1/completions", b"{not json", 400, None, "invalid JSON"),
    ("/v1/completions", b"[1, 2]", 400, None, "invalid request body"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "valid integer"),
    ("/v1/completions", {"prompt": "x", "temperature": True}, 400, "temperature", "valid number"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt", "prompt"),
    ("/v1/completions", {}, 400, "prompt", "required"),
    ("/v1/completions", {"prompt": "x", "n": 1.5}, 400, "n", "valid integer"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", "greater than or equal to 0"),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, "temperature", "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", "greater than 0"),
    ("/v1/completions", {"prompt": "x", "top_k": -5}, 400, "top_k", "greater than or equal to -1"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty", "less than or"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs", "less than or equal to 20"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, 400, "min_tokens",
     "min_tokens must be <= max_tokens"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop", "empty string"),
    ("/v1/completions", {"prompt": "x", "n": MAX_N + 1}, 400, "n", "less than or equal to"),
    ("/v1/completions", {"prompt": ["x"] * 8, "n": MAX_N}, 400, "n", "sequences"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", "empty"),
    ("/v1/completions", {"prompt": [1, 10**9]}, 400, "prompt", "out of range"),
    ("/v1/completions", {"prompt": [1, -3]}, 400, "prompt", "greater than or equal to 0"),
    ("/v1/completions", {"prompt": [1] * TOO_LONG}, 400, "prompt", "max_model_len"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**5}, 400, "max_tokens", "maximum context length"),
    ("/v1/completions", {"prompt": "x", "echo": True}, 400, "echo", "not supported"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1": 5}}, 400, "logit_bias", "not supported"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options",
     "stream"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "does not exist"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "at least 1"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages", "required"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400,
     "top_logprobs", "requires logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": 10**5}, 400, "max_tokens", "maximum context length"),
]


@pytest.mark.parametrize("path,body,status,param,words", BAD_REQUESTS,
                         ids=[f"{i}-{case[3] or 'body'}" for i, case in enumerate(BAD_REQUESTS)])
def test_bad_requests_get_openai_errors(served, model, path, body, status, param, words):
    server, url = served
    if isinstance(body, dict) and body.get("model") is None:
        body = {**body, "model": model}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{url}{path}", content=content,
                   headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    assert words.lower() in error["message"].lower(), error


def test_transport_limits_and_unknown_routes(served, client, model):
    server, url = served
    auth = {"Authorization": f"Bearer {API_KEY}"}
    big = b'{"prompt": "' + b"x" * DEFAULT_MAX_REQUEST_BODY_BYTES + b'"}'
    r = httpx.post(f"{url}/v1/completions", content=big, headers={**auth, "Content-Type": "application/json"})
    assert r.status_code == 413 and "larger than" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/completions", content=(big[i:i + 65536] for i in range(0, len(big), 65536)),
                   headers={**auth, "Content-Type": "application/json"})  # chunked: no Content-Length
    assert r.status_code == 413
    r = httpx.post(f"{url}/v1/completions", content=json.dumps({"prompt": "x"}), headers=auth)  # no type
    assert r.status_code == 400
    assert httpx.get(f"{url}/v1/nothing", headers=auth).status_code == 404
    r = httpx.get(f"{url}/v1/completions", headers=auth)
    assert r.status_code == 405 and "error" in r.json() and r.headers["allow"] == "POST"
    # ...and the server still serves.
    ok = client.completions.create(model=model, prompt="Hello", max_tokens=2)
    assert ok.usage.completion_tokens >= 1
    assert server.engine.is_alive


# -- metrics ------------------------------------------------------------------------------------


def test_metrics_move_with_traffic(served, client, model):
    server, url = served
    _wait_idle(server)
    before = _metrics(url)
    r = client.completions.create(model=model, prompt="Tell me a story", max_tokens=5, temperature=0.0,
                                  extra_body={"ignore_eos": True})
    after = _metrics(url)
    delta = lambda name: _delta(before, after, name)
    assert delta("plait_requests_finished_total{finished_reason=length}") == 1
    assert delta("plait_prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("plait_generation_tokens_total") == 5
    assert delta("plait_time_to_first_token_seconds_count") == 1
    assert delta("plait_inter_token_latency_seconds_count") == 4  # between 5 tokens
    assert delta("plait_e2e_request_latency_seconds_count") == 1
    steps = delta("plait_step_decode_tokens_count")
    assert steps >= 5  # one prefill step (which samples the first token), then 4 decodes
    assert delta("plait_step_decode_tokens_sum") == 4
    assert delta("plait_step_prefill_tokens_sum") >= 1
    assert delta("plait_engine_steps_total") == steps
    assert after["plait_kv_cache_usage_perc"] == 0.0


def test_prefix_cache_metrics_move(served, client, model):
    """A prompt sent twice is served from the prefix cache the second time, and /metrics says so."""
    server, url = served
    prompt = "Here is a long preamble that both requests share, word for word. " * 4
    client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0.0)
    _wait_idle(server)
    before = _metrics(url)
    client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0.0)
    _wait_idle(server)
    after = _metrics(url)
    assert _delta(before, after, "plait_prefix_cache_hits_total") > 0
    assert _delta(before, after, "plait_prefix_cache_queries_total") > 0
    assert after["plait_prefix_cache_blocks"] > 0
    assert 0 < after["plait_prefix_cache_hit_rate"] <= 1
    assert "plait_prefix_cache_evicted_blocks_total" in after
