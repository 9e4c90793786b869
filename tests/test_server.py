"""The OpenAI-compatible server end to end: a real uvicorn server, the default model, the openai client."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import importlib.util
import json
import random
import re
import shutil
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
prometheus_parser = pytest.importorskip("prometheus_client.parser")

from conftest import (  # noqa: E402
    LORA_MODULES,
    PERSON,
    PHONE,
    idle_serving_engine,
    make_lora_adapter,
    run_greedy,
)

from plait import __version__  # noqa: E402
from plait.config import EngineConfig  # noqa: E402
from plait.engine.engine import LLMEngine  # noqa: E402
from plait.entrypoints.llm import apply_chat_template  # noqa: E402
from plait.entrypoints.protocol import (  # noqa: E402
    DEFAULT_COMPLETION_MAX_TOKENS,
    MAX_N,
    ChatCompletionRequest,
    CompletionRequest,
)
from plait.entrypoints.server import (  # noqa: E402
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    SSE_DONE,
    BackgroundServer,
    OpenAIServer,
    ServerConfig,
)
from plait.lora.request import LoRAModulePath  # noqa: E402
from plait.sampling_params import (  # noqa: E402
    MAX_ALLOWED_TOKEN_IDS,
    MAX_LOGIT_BIAS_ENTRIES,
    SamplingParams,
)

API_KEY = "test-key-1234"
# Short answers keep the module within a few minutes on two busy cores.
MAX_TOKENS = 12
CONCURRENT_MAX_TOKENS = 16
NUM_CLIENTS = 32
NUM_DISCONNECTING = 8
# Disconnecting clients ask for far more than they read, so their requests can only end by abort.
DISCONNECT_MAX_TOKENS = 400
CLIENT_TIMEOUT_S = 240.0
IDLE_TIMEOUT_S = 30.0
# What a client of /v1/completions that leaves max_tokens out waits for at most (16 tokens take ~1 s); a
# server that ignored the default would run to the end of the 8k context.
DEFAULT_MAX_TOKENS_TIMEOUT_S = 60.0
QUESTIONS = [
    "Name a color.", "What is 2 + 2?", "Say hello in French.", "Name a planet.",
    "What is the opposite of hot?", "Name a fruit.", "What do bees make?", "Name a large animal.",
]


@pytest.fixture(scope="module")
def served(serving_engine):
    """The default model (conftest's serving_engine: a 256-token budget) behind an API key."""
    engine = idle_serving_engine(serving_engine)
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


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=CLIENT_TIMEOUT_S)


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


def _vllm(name: str, model: str, le: str | None = None, **labels: str) -> str:
    """The key _metrics gives a vLLM-named sample: its labels, model_name among them, folded in."""
    folded = ",".join(f"{k}={v}" for k, v in sorted({**labels, "model_name": model}.items()))
    return f"vllm:{name}{{{folded}}}" + (f"[le={le}]" if le is not None else "")


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


def test_openapi_bounds_logprobs_by_the_engines_max_logprobs(served):
    """/openapi.json gives the logprobs fields the engine's max_logprobs (20 here) as their maximum, so
    clients and fuzzers read the bound the server enforces; chat's logprobs flag stays a boolean."""
    _, url = served
    schemas = httpx.get(f"{url}/openapi.json").json()["components"]["schemas"]

    def maxima(request: str, name: str) -> list:
        field = schemas[request]["properties"][name]
        return [o.get("maximum") for o in [field, *field.get("anyOf", ())] if o.get("type") == "integer"]

    assert maxima("CompletionRequest", "logprobs") == [20]
    assert maxima("CompletionRequest", "prompt_logprobs") == [20]
    assert maxima("ChatCompletionRequest", "top_logprobs") == [20]
    assert maxima("ChatCompletionRequest", "logprobs") == []


def test_docs_pages_as_vllm(served):
    """As vLLM's server, FastAPI's browsable pages describe the API from /openapi.json (--disable-fastapi-docs
    drops all three: test_server_cli)."""
    _, url = served
    for page in ("/docs", "/redoc"):
        r = httpx.get(f"{url}{page}")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "/openapi.json" in r.text


def test_chat_stream_equals_non_stream_with_usage(served, client, model):
    server, _ = served
    messages = _messages("Name three rivers.")
    kwargs = dict(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0.0)
    full = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=2)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert not choice.message.model_extra  # no reasoning field without --reasoning-parser
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
    assert not any(c.choices[0].delta.model_extra for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        choice.finish_reason]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_return_token_ids_as_vllm(served, client, model):
    """vLLM's return_token_ids: the prompt's ids (the chat's rendered prompt, each completion choice's own)
    and each choice's output ids, which decode to its text; streamed, the prompt's ids in the first chunk and
    each chunk's new ids, which add up to the non-streamed ones (chunks held back mid-character pass theirs
    on); asked for nothing, no such field at all."""
    server, url = served
    tokenizer = server.tokenizer
    messages = _messages("Write the word 'café' three times.")
    chat = dict(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0.0, n=2, seed=3)
    full = client.chat.completions.create(**chat, extra_body={"return_token_ids": True})
    assert full.prompt_token_ids == apply_chat_template(tokenizer, messages)
    for choice in full.choices:
        assert tokenizer.decode(choice.token_ids, skip_special_tokens=True) == choice.message.content
    assert full.usage.completion_tokens == sum(len(c.token_ids) for c in full.choices)
    chunks = list(client.chat.completions.create(**chat, stream=True, extra_body={"return_token_ids": True}))
    assert chunks[0].prompt_token_ids == full.prompt_token_ids
    assert all(getattr(c, "prompt_token_ids", None) is None for c in chunks[1:])
    for index, choice in enumerate(full.choices):
        streamed = [t for c in chunks for ch in c.choices if ch.index == index
                    for t in getattr(ch, "token_ids", None) or []]
        assert streamed == choice.token_ids

    prompts = ["The capital of France is", "Numbers: 1, 2, 3,"]
    completion = dict(model=model, prompt=prompts, max_tokens=MAX_TOKENS, temperature=0.0)
    full = client.completions.create(**completion, extra_body={"return_token_ids": True})
    for choice, prompt in zip(full.choices, prompts):
        assert choice.prompt_token_ids == _post(url, "/tokenize", {"prompt": prompt}).json()["tokens"]
        assert tokenizer.decode(choice.token_ids, skip_special_tokens=True) == choice.text
    chunks = list(client.completions.create(**completion, stream=True, extra_body={"return_token_ids": True}))
    for choice in full.choices:
        mine = [ch for c in chunks for ch in c.choices if ch.index == choice.index]
        assert mine[0].prompt_token_ids == choice.prompt_token_ids
        assert all(getattr(ch, "prompt_token_ids", None) is None for ch in mine[1:])
        assert [t for ch in mine for t in ch.token_ids] == choice.token_ids

    beams = _post(url, "/v1/completions", {"model": model, "prompt": prompts[0], "max_tokens": 4, "n": 2,
                                           "use_beam_search": True, "return_token_ids": True}).json()
    assert all(c["prompt_token_ids"] == full.choices[0].prompt_token_ids and c["token_ids"]
               for c in beams["choices"])
    plain = _post(url, "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 2}).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


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


BEAM_PROMPT = "The capital of France is"


def _beams(client, model: str, n: int, max_tokens: int, **extra) -> object:
    return client.completions.create(model=model, prompt=BEAM_PROMPT, n=n, max_tokens=max_tokens,
                                     extra_body={"use_beam_search": True, **extra})


def test_beam_search_completions_as_vllm(client, model):
    """vLLM's use_beam_search: n beams as n choices, best first; usage counts the prompt once, every beam."""
    greedy = client.completions.create(model=model, prompt=BEAM_PROMPT, max_tokens=4, temperature=0.0,
                                       extra_body={"ignore_eos": True})
    one = _beams(client, model, 1, 4, ignore_eos=True)  # one beam without EOS is greedy decoding
    assert one.choices[0].text == greedy.choices[0].text
    three = _beams(client, model, 3, 4, ignore_eos=True)
    assert [c.index for c in three.choices] == [0, 1, 2] and three.choices[0].text == greedy.choices[0].text
    assert len({c.text for c in three.choices}) == 3
    assert {c.finish_reason for c in three.choices} == {"length"}
    assert three.usage.completion_tokens == 3 * 4 and three.usage.prompt_tokens == greedy.usage.prompt_tokens
    # EOS ends a beam ("stop", vLLM's stop_reason: the EOS id) that still ranks against the live ones, by
    # cumulative logprob over length ** length_penalty: a steep penalty favours the longer live beams.
    stopped = _beams(client, model, 3, 6)
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == " Paris."
    assert stopped.choices[0].stop_reason == 2  # SmolLM2's <|im_end|>
    with_eos = _beams(client, model, 3, 6, include_stop_str_in_output=True)
    assert with_eos.usage.completion_tokens == stopped.usage.completion_tokens + 1  # its EOS is counted
    steep = _beams(client, model, 3, 6, length_penalty=2.0)
    assert {c.finish_reason for c in steep.choices} == {"length"}  # " Paris." ranks below them all now


def test_beam_search_chat_streams_as_vllm(client, model):
    """Chat streams use_beam_search too, as vLLM: each beam whole in one chunk once the search ends."""
    kwargs = dict(model=model, messages=_messages("What is 2 + 2?"), n=2, max_tokens=6,
                  extra_body={"use_beam_search": True})
    whole = client.chat.completions.create(**kwargs)
    assert [c.index for c in whole.choices] == [0, 1]
    usage = {"include_usage": True}
    chunks = list(client.chat.completions.create(stream=True, stream_options=usage, **kwargs))
    content = {c.choices[0].index: c.choices[0].delta.content for c in chunks if c.choices
               and c.choices[0].finish_reason}
    assert content == {c.index: c.message.content for c in whole.choices}
    assert chunks[-1].usage == whole.usage


@pytest.mark.parametrize(("path", "extra", "param"), [
    ("/v1/completions", {"stream": True}, "stream"),  # vLLM's completions refuse it, in vLLM's words
    ("/v1/completions", {"stop": ["."]}, "stop"),
    ("/v1/completions", {"n": 11}, "n"),  # 2 x n candidates a step, within 20 logprobs
    ("/v1/chat/completions", {"logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
])
def test_beam_search_refuses_what_it_cannot_honour(served, path, extra, param):
    _, url = served
    body = {"max_tokens": 2, "use_beam_search": True, **extra}
    body.update({"prompt": BEAM_PROMPT} if path == "/v1/completions" else {"messages": _messages("Hi")})
    r = _post(url, path, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    if param == "stream":
        assert r.json()["error"]["message"] == "Streaming is not currently supported with beam search"


def test_completions_default_to_16_tokens(client, model):
    """As OpenAI and vLLM: /v1/completions without max_tokens stops after 16 tokens (chat has no such cap)."""
    r = client.with_options(timeout=DEFAULT_MAX_TOKENS_TIMEOUT_S).completions.create(
        model=model, prompt="Once upon a time", temperature=0.0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == DEFAULT_COMPLETION_MAX_TOKENS == 16
    assert r.choices[0].finish_reason == "length"
    # An explicit null lifts the cap, as in vLLM (its benchmark client sends null for "no limit").
    assert CompletionRequest.model_validate({"prompt": "x"}).requested_max_tokens == 16
    assert CompletionRequest.model_validate({"prompt": "x", "max_tokens": None}).requested_max_tokens is None


def test_context_overflow_uses_vllm_wording(served, model):
    """Clients match vLLM's context-length messages word for word (e.g. to trim a conversation)."""
    server, url = served
    limit = server.max_model_len
    prompt = [1] * (limit - 8)  # fits, but not with the default 16 completion tokens
    error = _post(url, "/v1/completions", {"model": model, "prompt": prompt}).json()["error"]
    assert error["message"] == (
        f"This model's maximum context length is {limit} tokens. However, you requested {limit + 8} tokens "
        f"({limit - 8} in the messages, 16 in the completion). Please reduce the length of the messages or "
        f"completion.")
    assert (error["code"], error["param"]) == ("context_length_exceeded", "max_tokens")
    full = {"model": model, "prompt": [1] * limit, "max_tokens": 1}  # no room for one token
    error = _post(url, "/v1/completions", full).json()["error"]
    assert error["message"] == (
        f"This model's maximum context length is {limit} tokens. However, your request has {limit} input "
        f"tokens. Please reduce the length of the input messages.")
    assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt")
    long_chat = {"model": model, "messages": _messages("hi " * limit), "max_tokens": 1}
    error = _post(url, "/v1/chat/completions", long_chat).json()["error"]
    assert error["message"].startswith(f"This model's maximum context length is {limit} tokens. ")
    assert (error["code"], error["param"]) == ("context_length_exceeded", "messages")


# Every optional field of the requests as null, which OpenAI's spec allows and SDKs of other languages
# send for "not set": each takes its default.
NULL_SAMPLING_FIELDS = dict.fromkeys([
    "model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "n",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens",
    "skip_special_tokens", "include_stop_str_in_output", "stream", "stream_options", "logit_bias",
    "allowed_token_ids", "prompt_logprobs", "truncate_prompt_tokens", "truncation_side",
    "return_tokens_as_token_ids", "user",
])


def test_null_fields_mean_default(served, model):
    _, url = served
    completion = {**NULL_SAMPLING_FIELDS, **dict.fromkeys(["logprobs", "echo", "best_of", "suffix"]),
                  "prompt": "The sky is", "max_tokens": 2}
    r = _post(url, "/v1/completions", completion)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["usage"]["completion_tokens"] <= 2
    chat = {**NULL_SAMPLING_FIELDS, **dict.fromkeys(["max_tokens", "logprobs", "top_logprobs",
                                                     "add_generation_prompt", "echo"]),
            "messages": [{"role": "user", "content": "Hi", "name": None}], "max_completion_tokens": 2}
    r = _post(url, "/v1/chat/completions", chat)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"] is None
    options = {"include_usage": None, "continuous_usage_stats": None}
    streamed = {**chat, "stream": True, "stream_options": options}
    events = [line for line in _post(url, "/v1/chat/completions", streamed).text.splitlines() if line]
    assert events[-1] == "data: [DONE]" and '"usage":{' in events[-2]  # include_usage: null = its default


def _one_token(server: OpenAIServer, text: str) -> int:
    (token_id,) = server.tokenizer.encode(text, add_special_tokens=False)
    return token_id


def test_logit_bias_forces_a_token(served, client, model):
    """OpenAI's logit_bias ({"<id>": bias}, the ids as strings): +100 makes greedy decoding pick that id
    at every position, on both endpoints and streamed too."""
    server, _ = served
    river = _one_token(server, " river")
    kwargs = dict(model=model, max_tokens=4, temperature=0.0, logit_bias={str(river): 100},
                  extra_body={"ignore_eos": True})
    completion = client.completions.create(prompt="Name a color:", **kwargs)
    assert completion.choices[0].text == " river" * 4
    chat = client.chat.completions.create(messages=_messages("Name a color."), logprobs=True, **kwargs)
    assert [entry.token for entry in chat.choices[0].logprobs.content] == [" river"] * 4
    streamed = client.chat.completions.create(messages=_messages("Name a color."), stream=True, **kwargs)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == chat.choices[0].message.content
    # A ban moves greedy decoding off the token it would pick.
    plain = client.completions.create(model=model, prompt="The sky is", max_tokens=1, temperature=0.0)
    first = _one_token(server, plain.choices[0].text)
    banned = client.completions.create(model=model, prompt="The sky is", max_tokens=1, temperature=0.0,
                                       logit_bias={str(first): -100})
    assert banned.choices[0].text not in ("", plain.choices[0].text)


def test_bad_words_keep_words_out_of_the_output(client, model):
    """vLLM's bad_words (extra_body with the openai client): a word the free answer uses is absent once
    banned, in chat and completions alike."""
    prompt = "The capital of France is"
    free = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0.0)
    word = max(free.choices[0].text.split(), key=len).strip(".,")
    banned = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0.0,
                                       extra_body={"bad_words": [word]})
    assert word in free.choices[0].text and word not in banned.choices[0].text
    chat = client.chat.completions.create(model=model, messages=_messages(prompt), max_tokens=12,
                                          temperature=0.0, extra_body={"bad_words": [word]})
    assert word not in chat.choices[0].message.content


def test_allowed_token_ids_restrict_the_output(served, client, model):
    """vLLM's allowed_token_ids (extra_body with the openai client): random sampling draws only those ids."""
    server, url = served
    words = [" yes", " no", " maybe"]
    allowed = [_one_token(server, w) for w in words]
    extra = {"allowed_token_ids": allowed, "ignore_eos": True}
    chat = client.chat.completions.create(model=model, messages=_messages("Is the sky blue?"), max_tokens=8,
                                          temperature=1.0, seed=3, n=2, logprobs=True, extra_body=extra)
    for choice in chat.choices:
        assert {entry.token for entry in choice.logprobs.content} <= set(words)
        tokens = _post(url, "/tokenize", {"prompt": choice.message.content}).json()["tokens"]
        assert set(tokens) <= set(allowed)
    completion = client.completions.create(model=model, prompt="Answer:", max_tokens=6, temperature=1.5,
                                           logprobs=1, extra_body=extra)
    assert set(completion.choices[0].logprobs.tokens) <= set(words)


def test_harmless_unknown_fields_are_accepted(client, model):
    """Fields plait has no use for but that change nothing are ignored, as before."""
    r = client.chat.completions.create(
        model=model, messages=_messages("Hi"), max_tokens=2, user="u", metadata={"k": "v"}, store=False,
        service_tier="auto", parallel_tool_calls=False, tool_choice="none", response_format={"type": "text"},
        extra_body={"tools": [], "guided_json": None, "prompt_logprobs": None, "some_future_field": 1})
    assert r.usage.completion_tokens >= 1


def test_guided_choice_as_vllm(client, model):
    """vLLM's guided_choice and structured_outputs={"choice": ...}: every answer is one of the choices,
    sampled or greedy, on both endpoints, streamed too."""
    choices = ["red", "green", "blue", "light blue"]
    for body in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        r = client.completions.create(model=model, prompt="My favourite colour is", max_tokens=10, n=3,
                                      temperature=1.2, seed=3, extra_body=body)
        assert all(c.text in choices and c.finish_reason == "stop" for c in r.choices), r.choices
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "A colour?"}],
                                           max_tokens=10, temperature=0.0, extra_body=body)
        assert r.choices[0].message.content in choices
    stream = client.completions.create(model=model, prompt="Sky:", max_tokens=10, stream=True,
                                       extra_body={"guided_choice": choices})
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) in choices




def _is_person(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"name", "age", "color"} and isinstance(value["name"], str)
            and isinstance(value["age"], int) and value["color"] in ("red", "green", "blue"))


@pytest.mark.skipif(importlib.util.find_spec("llguidance") is None, reason="llguidance is not installed")
def test_structured_outputs_through_the_openai_client(client, model):
    """OpenAI's response_format json_schema (streamed too), vLLM's guided_regex (n > 1) and structured_outputs
    on both endpoints: every answer matches, and ends with "stop"."""
    messages = _messages("Describe a person as JSON: name, age and favourite color.")
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(model=model, messages=messages, response_format=fmt, max_tokens=48,
                                       temperature=0.0)
    assert r.choices[0].finish_reason == "stop" and _is_person(r.choices[0].message.content)
    stream = client.chat.completions.create(model=model, messages=messages, response_format=fmt,
                                            max_tokens=48, temperature=1.0, seed=5, stream=True)
    chunks = [chunk for chunk in stream if chunk.choices]
    assert _is_person("".join(c.choices[0].delta.content or "" for c in chunks))
    assert chunks[-1].choices[0].finish_reason == "stop"
    r = client.completions.create(model=model, prompt="Call me at", max_tokens=16, n=2, temperature=1.0,
                                  seed=2, extra_body={"guided_regex": PHONE})
    assert all(c.finish_reason == "stop" and re.fullmatch(PHONE, c.text) for c in r.choices), r.choices
    stream = client.completions.create(model=model, prompt="Call me at", max_tokens=16, stream=True,
                                       extra_body={"structured_outputs": {"regex": PHONE}})
    assert re.fullmatch(PHONE, "".join(chunk.choices[0].text for chunk in stream if chunk.choices))


WEATHER_CALL = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                "required": ["city", "unit"], "additionalProperties": False}
WEATHER_TAG = {"type": "structural_tag", "triggers": ["<function="], "structures": [
    {"begin": "<function=get_weather>", "schema": WEATHER_CALL, "end": "</function>"}]}
WEATHER_CALL_TEXT = re.compile(r"(.*)<function=get_weather>(.*)</function>(.*)", re.DOTALL)


def _weather_call(text: str) -> dict:
    """The arguments of the one get_weather call in ``text``, checked against WEATHER_CALL."""
    match = WEATHER_CALL_TEXT.fullmatch(text)
    assert match, text
    arguments = json.loads(match[2])
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("C", "F"), text
    return arguments


@pytest.mark.skipif(importlib.util.find_spec("llguidance") is None, reason="llguidance is not installed")
def test_structural_tag_through_the_openai_client(client, model):
    """vLLM's response_format structural_tag on chat (the model, shown one call, writes another: JSON of the
    schema, which its own lacks, between begin and end), and structured_outputs' structural_tag (its JSON
    text; compact JSON, which the stop string cannot cut) on a streamed completion."""
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": '<function=get_weather>{"city": "Paris"}</function>'},
                {"role": "user", "content": "Weather in Oslo?"}]
    r = client.chat.completions.create(model=model, messages=messages, response_format=WEATHER_TAG,
                                       max_tokens=24, temperature=0.0)
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    assert isinstance(_weather_call(r.choices[0].message.content)["city"], str)
    prompt = f"Q: weather in Paris?\nA: {messages[1]['content']}\nQ: weather in Oslo?\nA:"
    body = {"structured_outputs": {"structural_tag": json.dumps(WEATHER_TAG), "disable_any_whitespace": True}}
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0.0,
                                       stop=["\n"], stream=True, extra_body=body)
    _weather_call("".join(chunk.choices[0].text for chunk in stream if chunk.choices))


def test_a_batch_of_prompts_times_n_in_one_request(client, model):
    """A batch of prompts, each sampled n times, in one call (as RL rollouts ask): 20 x 4 = 80 sequences,
    more than the old cap of 64; choice i * n + k is prompt i's k-th sample, as OpenAI and vLLM order them."""
    prompts = [f"Count to {i}:" for i in range(20)]
    r = client.completions.create(model=model, prompt=prompts, n=4, max_tokens=2, temperature=0.0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == list(range(80))
    for i in range(20):  # greedy: the n samples of one prompt agree
        assert len({c.text for c in r.choices[4 * i: 4 * i + 4]}) == 1
    assert r.usage.completion_tokens == 160


def _streamed_text(chunks: list) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_stream_options_as_vllm(client, model):
    """stream_options at all asks for the usage chunk (include_usage defaults to true, as in vLLM);
    continuous_usage_stats puts the usage so far on every chunk."""
    kwargs = dict(model=model, messages=_messages("Name a color."), max_tokens=4, temperature=0.0,
                  stream=True, extra_body={"ignore_eos": True})

    def chunks(**options) -> list:
        return list(client.chat.completions.create(**kwargs, **options))

    assert all(c.usage is None for c in chunks())  # no stream_options: no usage
    assert all(c.usage is None for c in chunks(stream_options={"include_usage": False}))
    assert all(c.usage is None for c in chunks(stream_options={"include_usage": False,
                                                              "continuous_usage_stats": True}))
    plain = chunks(stream_options={})
    assert plain[-1].choices == [] and plain[-1].usage.completion_tokens == 4
    assert all(c.usage is None for c in plain[:-1])
    continuous = chunks(stream_options={"continuous_usage_stats": True})
    # The same answer; not always in the same chunks: a stream read slower than the engine steps gets
    # several tokens' text in one chunk (" I'm" once, " I" and "'m" in the other request, on a loaded CI).
    assert _streamed_text(continuous) == _streamed_text(plain)
    assert [c.choices[0].finish_reason for c in continuous if c.choices][-1] == "length"
    usages = [c.usage for c in continuous]
    assert all(u is not None and u.total_tokens == u.prompt_tokens + u.completion_tokens for u in usages)
    assert usages[0].completion_tokens == 0  # the role chunk, before any token
    assert [u.completion_tokens for u in usages] == sorted(u.completion_tokens for u in usages)
    assert usages[-2] == usages[-1] == plain[-1].usage  # the last token's chunk, then the usage chunk

    completion = list(client.completions.create(
        model=model, prompt="The sky is", max_tokens=4, temperature=0.0, stream=True,
        stream_options={"continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    assert all(c.usage is not None for c in completion)
    assert completion[-1].choices == [] and completion[-1].usage.completion_tokens == 4


# -- echo and prompt logprobs -----------------------------------------------------------------------

ECHO_PROMPT = "The capital of France is Paris"


def _prefix_top(url: str, prompt_ids: list[int]) -> tuple[str, float]:
    """The most likely next token after these ids and its logprob, by a plain greedy completion."""
    body = {"prompt": prompt_ids, "max_tokens": 1, "logprobs": 1, "temperature": 0.0}
    logprobs = _post(url, "/v1/completions", body).json()["choices"][0]["logprobs"]
    return logprobs["tokens"][0], logprobs["token_logprobs"][0]


def test_completion_echo_returns_the_prompt_first(served, client, model):
    """vLLM's echo: the choice's text is the prompt's (token ids decoded) and then the completion's; the
    usage counts what it did without echo."""
    server, _ = served
    kwargs = dict(model=model, max_tokens=3, temperature=0.0)
    plain = client.completions.create(prompt=ECHO_PROMPT, **kwargs)
    echoed = client.completions.create(prompt=ECHO_PROMPT, echo=True, **kwargs)
    assert echoed.choices[0].text == ECHO_PROMPT + plain.choices[0].text
    assert echoed.usage == plain.usage
    ids = list(server.tokenizer.encode(ECHO_PROMPT))
    by_ids = client.completions.create(prompt=ids, echo=True, **kwargs)
    assert by_ids.choices[0].text == server.tokenizer.decode(ids) + plain.choices[0].text
    batch = client.completions.create(prompt=[ECHO_PROMPT, "Hi"], echo=True, n=2, **kwargs)
    for choice, prompt in zip(batch.choices, [ECHO_PROMPT, ECHO_PROMPT, "Hi", "Hi"], strict=True):
        assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)


def test_echo_logprobs_score_the_prompt_as_lm_eval(served):
    """What lm-evaluation-harness's local-completions sends for loglikelihoods: the prompt's tokens lead
    the logprobs, the first with nulls, each next one with its logprob given the ones before it."""
    server, url = served
    ids = list(server.tokenizer.encode(ECHO_PROMPT))
    body = {"prompt": ECHO_PROMPT, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    r = _post(url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1
    assert lp["tokens"][:len(ids)] == [server.tokenizer.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for token, logprob, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert -1e4 < logprob <= 0.0 and top[token] == logprob and 1 <= len(top) <= 2
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids) + 1)]
    assert choice["text"] == ECHO_PROMPT + lp["tokens"][-1]
    assert r.json()["usage"]["prompt_tokens"] == len(ids) and r.json()["usage"]["completion_tokens"] == 1
    # Each prompt position holds the distribution a completion of the ids before it samples from.
    for i in (1, len(ids) - 1):
        best, best_logprob = _prefix_top(url, ids[:i])
        assert lp["top_logprobs"][i][best] == pytest.approx(best_logprob, abs=1e-3)


def test_echo_with_max_tokens_0_answers_the_prompt_alone(served, model):
    """OpenAI's and vLLM's echo with max_tokens 0 (how scoring clients ask for a prompt's logprobs): the text
    is the prompt, its logprobs the prompt's own, as in the answer with one generated token less that token;
    the same streamed, and with the token ids; max_tokens 0 without echo is a 400."""
    server, url = served
    ids = list(server.tokenizer.encode(ECHO_PROMPT))
    body = {"model": model, "prompt": ECHO_PROMPT, "logprobs": 1, "echo": True, "temperature": 0.0}
    one = _post(url, "/v1/completions", {**body, "max_tokens": 1}).json()["choices"][0]
    r = _post(url, "/v1/completions", {**body, "max_tokens": 0, "return_token_ids": True, "n": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 0 and r.json()["usage"]["prompt_tokens"] == len(ids)
    for choice in r.json()["choices"]:
        assert choice["text"] == ECHO_PROMPT and choice["finish_reason"] == "length"
        assert choice["token_ids"] == [] and choice["prompt_token_ids"] == ids
        got, want = choice["logprobs"], one["logprobs"]
        for key in ("tokens", "text_offset"):
            assert got[key] == want[key][:len(ids)], key
        assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None  # the first has no context
        # Another batch (n=2) rounds the last bits differently.
        assert got["token_logprobs"][1:] == pytest.approx(want["token_logprobs"][1:len(ids)], abs=1e-4)
        for top, top_want in zip(got["top_logprobs"][1:], want["top_logprobs"][1:len(ids)], strict=True):
            assert top == pytest.approx(top_want, abs=1e-4)
    events = _post(url, "/v1/completions", {**body, "max_tokens": 0, "stream": True}).text.split("\n\n")
    chunks = [json.loads(e.removeprefix("data: "))["choices"][0] for e in events[:-2]]
    assert "".join(c["text"] for c in chunks) == ECHO_PROMPT and chunks[-1]["finish_reason"] == "length"
    streamed = [v for c in chunks for v in c["logprobs"]["token_logprobs"]]
    assert streamed[0] is None
    assert streamed[1:] == pytest.approx(one["logprobs"]["token_logprobs"][1:-1], abs=1e-4)
    bad = _post(url, "/v1/completions", {**body, "max_tokens": 0, "echo": False})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens", bad.text


def test_streamed_echo_sends_the_prompt_with_the_first_chunk(served, model):
    """As vLLM: the prompt's text and logprobs open each choice's stream; the chunks add up to the answer
    without streaming."""
    _, url = served
    body = {"model": model, "prompt": ECHO_PROMPT, "max_tokens": 3, "logprobs": 1, "echo": True,
            "temperature": 0.0, "ignore_eos": True}
    full = _post(url, "/v1/completions", body).json()["choices"][0]
    events = _post(url, "/v1/completions", {**body, "stream": True}).text.split("\n\n")
    chunks = [json.loads(e.removeprefix("data: "))["choices"][0] for e in events[:-2]]  # [DONE], ""
    assert events[-2:] == [SSE_DONE.strip(), ""]
    assert chunks[0]["text"].startswith(ECHO_PROMPT)
    assert chunks[0]["logprobs"]["token_logprobs"][0] is None
    assert "".join(c["text"] for c in chunks) == full["text"]
    for key in ("tokens", "token_logprobs", "text_offset"):
        assert [v for c in chunks for v in c["logprobs"][key]] == full["logprobs"][key], key


def _check_prompt_logprobs(server: OpenAIServer, entries: list, prompt_ids: list[int], num_top: int) -> None:
    """vLLM's format: null, then per token {id: {logprob, rank, decoded_token}}: the token, ranked in the
    whole vocabulary, and the top-n, ranked 1..n best first."""
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for token_id, entry in zip(prompt_ids[1:], entries[1:], strict=True):
        own = entry[str(token_id)]
        assert -1e4 < own["logprob"] <= 0.0 and own["decoded_token"] == server.tokenizer.decode([token_id])
        top = sorted((e["rank"], e["logprob"]) for t, e in entry.items()
                     if t != str(token_id) or e["rank"] <= num_top)
        assert [rank for rank, _ in top] == list(range(1, num_top + 1))
        assert [logprob for _, logprob in top] == sorted((lp for _, lp in top), reverse=True)
        assert len(entry) == num_top + (own["rank"] > num_top)
        # The token's rank in the vocabulary: past the top-n exactly where its logprob is below theirs.
        assert own["rank"] >= 1 and (own["rank"] > num_top) == (num_top == 0 or own["logprob"] < top[-1][1])


def test_prompt_logprobs_as_vllm(served, model):
    """vLLM's prompt_logprobs extension: on each choice of a completion, at the top of a chat response."""
    server, url = served
    ids = list(server.tokenizer.encode(ECHO_PROMPT))
    body = {"model": model, "prompt": ECHO_PROMPT, "max_tokens": 2, "temperature": 0.0}
    r = _post(url, "/v1/completions", {**body, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    _check_prompt_logprobs(server, r.json()["choices"][0]["prompt_logprobs"], ids, 2)
    # With echo and logprobs too: the same numbers in both places.
    both = _post(url, "/v1/completions", {**body, "prompt_logprobs": 1, "echo": True, "logprobs": 1}).json()
    choice = both["choices"][0]
    _check_prompt_logprobs(server, choice["prompt_logprobs"], ids, 1)
    assert [e and e[str(t)]["logprob"] for t, e in zip(ids, choice["prompt_logprobs"])] == (
        choice["logprobs"]["token_logprobs"][:len(ids)])
    assert _post(url, "/v1/completions", body).json()["choices"][0]["prompt_logprobs"] is None

    messages = _messages("Name a color.")
    chat = _post(url, "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 2,
                                               "n": 2, "prompt_logprobs": 0})
    assert chat.status_code == 200, chat.text
    assert len(chat.json()["choices"]) == 2  # one prompt_logprobs for the prompt they share
    prompt_ids = apply_chat_template(server.tokenizer, messages)
    _check_prompt_logprobs(server, chat.json()["prompt_logprobs"], prompt_ids, 0)


def test_truncate_prompt_tokens_as_vllm(served, client, model):
    """vLLM's truncate_prompt_tokens: each prompt of a batch keeps its last k tokens (a shorter one stays
    whole), a chat its rendered prompt's; usage counts what was kept, and echo and prompt_logprobs show it."""
    server, url = served
    tokenizer = server.tokenizer
    ids, keep = list(tokenizer.encode(ECHO_PROMPT)), 3
    kwargs = dict(model=model, max_tokens=2, temperature=0.0)
    expected = client.completions.create(prompt=ids[-keep:], **kwargs).choices[0].text
    hi = list(tokenizer.encode("Hi"))
    for batch in ([ECHO_PROMPT, "Hi"], [ids, hi]):  # text prompts, token-id prompts
        r = client.completions.create(prompt=batch, echo=True, logprobs=1, **kwargs,
                                      extra_body={"truncate_prompt_tokens": keep, "prompt_logprobs": 0})
        cut, whole = r.choices
        assert cut.text == tokenizer.decode(ids[-keep:]) + expected
        assert cut.logprobs.tokens[:keep] == [tokenizer.decode([t]) for t in ids[-keep:]]
        _check_prompt_logprobs(server, cut.prompt_logprobs, ids[-keep:], 0)
        assert whole.text.startswith("Hi") and len(whole.prompt_logprobs) == len(hi)
        assert r.usage.prompt_tokens == keep + len(hi)

    messages = _messages("Name a color.")
    rendered = apply_chat_template(tokenizer, messages)
    chat = _post(url, "/v1/chat/completions", {**kwargs, "messages": messages, "truncate_prompt_tokens": keep,
                                               "prompt_logprobs": 0}).json()
    assert chat["usage"]["prompt_tokens"] == keep
    _check_prompt_logprobs(server, chat["prompt_logprobs"], rendered[-keep:], 0)
    plain = client.completions.create(prompt=rendered[-keep:], **kwargs).choices[0].text
    assert chat["choices"][0]["message"]["content"] == plain


def test_truncate_prompt_tokens_against_max_tokens(served, client, model):
    """As vLLM's server: k may not exceed the context less the request's max_tokens (its words), and -1
    keeps exactly that many (a guided choice keeps the answer short however large max_tokens is)."""
    server, url = served
    ids, keep = list(server.tokenizer.encode(ECHO_PROMPT)), 3
    room = server.max_model_len - keep
    body = {"model": model, "prompt": ids, "max_tokens": room, "guided_choice": ["yes", "no"]}
    r = _post(url, "/v1/completions", {**body, "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == keep, r.text
    error = _post(url, "/v1/completions", {**body, "truncate_prompt_tokens": keep + 1}).json()["error"]
    assert error["message"] == (f"truncate_prompt_tokens={keep + 1} cannot be greater than max_model_len - "
                                f"max_tokens = {keep}. Please request a smaller truncation size.")
    assert error["param"] == "truncate_prompt_tokens"
    words = f"cannot be greater than max_model_len - max_completion_tokens = {keep}\\."
    with pytest.raises(openai.BadRequestError, match=words) as e:
        client.chat.completions.create(model=model, messages=_messages("hi"), max_completion_tokens=room,
                                       extra_body={"truncate_prompt_tokens": keep + 1})
    assert e.value.status_code == 400 and e.value.body["param"] == "truncate_prompt_tokens"


# -- vLLM's return_tokens_as_token_ids and chat echo ---------------------------------------------------

AS_IDS = {"return_tokens_as_token_ids": True}
# Two runs of one request may differ in their last float bits (a prefix-cache hit computes less of it).
LOGPROB_TOLERANCE = 1e-4
TOKEN_ID_NAME = re.compile(r"token_id:(\d+)")


def _named_text(server: OpenAIServer, name: str) -> str:
    """The text of the token a "token_id:<id>" name names (what logprobs name it by without the option)."""
    match = TOKEN_ID_NAME.fullmatch(name)
    assert match is not None, name
    return server.tokenizer.decode([int(match.group(1))], skip_special_tokens=False)


def test_return_tokens_as_token_ids_in_chat(served, client, model):
    """vLLM's return_tokens_as_token_ids: chat logprobs name the chosen tokens and their alternatives
    "token_id:<id>", the ids of the tokens the plain answer names by text; as vLLM gives them, a chosen
    token's bytes stay its text's, an alternative's are its name's; streamed the same."""
    server, _ = served
    kwargs = dict(model=model, messages=_messages("Name a color."), max_tokens=4, temperature=0.0,
                  logprobs=True, top_logprobs=2)
    close = functools.partial(pytest.approx, abs=LOGPROB_TOLERANCE)
    plain = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    by_id = client.chat.completions.create(**kwargs, extra_body=AS_IDS).choices[0].logprobs.content
    assert len(by_id) == len(plain) == 4
    for text_entry, id_entry in zip(plain, by_id, strict=True):
        assert _named_text(server, id_entry.token) == text_entry.token
        assert (id_entry.logprob, id_entry.bytes) == (close(text_entry.logprob), text_entry.bytes)
        assert [(_named_text(server, t.token), t.logprob) for t in id_entry.top_logprobs] == [
            (t.token, close(t.logprob)) for t in text_entry.top_logprobs]
        assert all(t.bytes == list(t.token.encode()) for t in id_entry.top_logprobs)
    stream = client.chat.completions.create(**kwargs, stream=True, extra_body=AS_IDS)
    assert [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
            ] == by_id


def test_return_tokens_as_token_ids_in_completions(served, model, monkeypatch):
    """The same on /v1/completions, the echoed prompt's tokens too, top_logprobs keyed by the names, streamed
    or not; text_offset still indexes the text, and prompt_logprobs keep their decoded text (vLLM's do).
    --return-tokens-as-token-ids makes it the default, which a request's false (not its null) turns off."""
    server, url = served
    ids = list(server.tokenizer.encode(ECHO_PROMPT))
    body = {"model": model, "prompt": ECHO_PROMPT, "max_tokens": 3, "logprobs": 2, "echo": True,
            "temperature": 0.0, "ignore_eos": True}
    plain = _post(url, "/v1/completions", {**body, "prompt_logprobs": 1}).json()["choices"][0]
    by_id = _post(url, "/v1/completions", {**body, "prompt_logprobs": 1, **AS_IDS}).json()["choices"][0]
    lp, plain_lp = by_id["logprobs"], plain["logprobs"]
    assert lp["tokens"][:len(ids)] == [f"token_id:{t}" for t in ids]
    assert [_named_text(server, t) for t in lp["tokens"]] == plain_lp["tokens"]
    assert lp["text_offset"] == plain_lp["text_offset"]
    assert lp["token_logprobs"][1:] == pytest.approx(plain_lp["token_logprobs"][1:], abs=LOGPROB_TOLERANCE)
    assert lp["top_logprobs"][0] is None
    for top, plain_top in zip(lp["top_logprobs"][1:], plain_lp["top_logprobs"][1:], strict=True):
        assert {_named_text(server, t): v for t, v in top.items()} == pytest.approx(plain_top,
                                                                                    abs=LOGPROB_TOLERANCE)
    assert by_id["text"] == plain["text"]
    assert [e and {t: v["decoded_token"] for t, v in e.items()} for e in by_id["prompt_logprobs"]] == [
        e and {t: v["decoded_token"] for t, v in e.items()} for e in plain["prompt_logprobs"]]
    events = _post(url, "/v1/completions", {**body, **AS_IDS, "stream": True}).text.split("\n\n")[:-2]
    chunks = [json.loads(e.removeprefix("data: "))["choices"][0]["logprobs"] for e in events]
    for key in ("tokens", "text_offset", "top_logprobs"):
        assert [v for c in chunks for v in c[key]] == lp[key], key

    monkeypatch.setattr(server.config, "return_tokens_as_token_ids", True)  # --return-tokens-as-token-ids
    short = {"model": model, "prompt": "Hi", "max_tokens": 1, "logprobs": 0}
    for asked, named in ((None, True), (False, False), (True, True)):
        r = _post(url, "/v1/completions", {**short, "return_tokens_as_token_ids": asked}).json()
        assert bool(TOKEN_ID_NAME.fullmatch(r["choices"][0]["logprobs"]["tokens"][0])) == named, asked


CHAT_ECHO_CASES = [
    # (messages, request options, what echo puts before the answer): vLLM echoes the last message where its
    # role is the answer's, which is the assistant's, or the last message's own without a generation prompt.
    ([{"role": "user", "content": "hi"}], {}, ""),
    ([{"role": "user", "content": "hi"}], {"add_generation_prompt": False}, "hi"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}], {}, "Hello"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}],
     {"continue_final_message": True, "add_generation_prompt": False}, "Hello"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}], {"echo": False}, ""),
    ([{"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], {},
     "a\nb"),  # text parts joined by newlines, as vLLM's chat parser joins them
    ([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}], {}, ""),
]


@pytest.mark.parametrize("messages,options,echoed", CHAT_ECHO_CASES)
def test_chat_echo_text_as_vllm(messages, options, echoed):
    body = ChatCompletionRequest.model_validate({"messages": messages, "echo": True, **options})
    assert body.echo_text() == echoed


def test_answer_role_as_vllm():
    """vLLM's --response-role names the answer where the template adds a generation prompt; without one the
    answer continues the last message, in its role. Echo compares the last message's role with it."""
    asked = [{"role": "user", "content": "hi"}, {"role": "bot", "content": "Hello"}]
    body = ChatCompletionRequest.model_validate({"messages": asked, "echo": True})
    assert (body.answer_role(), body.answer_role("bot")) == ("assistant", "bot")
    assert (body.echo_text(), body.echo_text("bot")) == ("", "Hello")
    continued = ChatCompletionRequest.model_validate({"messages": asked, "add_generation_prompt": False})
    assert continued.answer_role("assistant") == continued.answer_role("bot") == "bot"


def test_an_answer_without_generation_prompt_keeps_the_last_role(client, model):
    """As vLLM's: with add_generation_prompt false the model continues the last message, and the answer
    (its message, and a stream's first delta) carries that message's role, not the assistant's."""
    kwargs = dict(model=model, messages=_messages("Name a river."), max_tokens=2, temperature=0.0,
                  extra_body={"add_generation_prompt": False})
    assert client.chat.completions.create(**kwargs).choices[0].message.role == "user"
    first = next(c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices)
    assert first.choices[0].delta.role == "user"
    asked = client.chat.completions.create(**{**kwargs, "extra_body": {}})
    assert asked.choices[0].message.role == "assistant"


def test_text_parts_reach_the_template_joined_by_newlines_as_vllm(served, model):
    """vLLM's chat parser joins a message's text parts with newlines for a template that takes text: the
    prompt is the one of the joined string, as /tokenize renders it and as the answer shows."""
    _, url = served
    text_parts = [{"type": "text", "text": "Name a"}, {"type": "text", "text": "river."}]
    parts, joined = {"role": "user", "content": text_parts}, {"role": "user", "content": "Name a\nriver."}
    tokens = [_post(url, "/tokenize", {"model": model, "messages": [m]}).json()["tokens"]
              for m in (parts, joined)]
    assert tokens[0] == tokens[1]
    body = {"model": model, "max_tokens": 4, "temperature": 0.0}
    answers = [_post(url, "/v1/chat/completions", {**body, "messages": [m]}).json()["choices"][0]["message"]
               for m in (parts, joined)]
    assert answers[0] == answers[1]


def test_chat_echo_as_vllm(client, model):
    """vLLM's chat echo: the continued assistant message comes back whole (its text, then the model's), in a
    chunk of its own after each choice's role when streamed; a user's last message is not echoed."""
    prefill = [{"role": "user", "content": "Name a river."}, {"role": "assistant", "content": "The Nile is"}]
    options = {"continue_final_message": True, "add_generation_prompt": False}
    kwargs = dict(model=model, max_tokens=3, temperature=0.0)
    plain = client.chat.completions.create(messages=prefill, extra_body=options, **kwargs)
    echoed = client.chat.completions.create(messages=prefill, extra_body={**options, "echo": True}, **kwargs)
    assert echoed.choices[0].message.content == "The Nile is" + plain.choices[0].message.content
    assert echoed.usage == plain.usage
    stream = client.chat.completions.create(messages=prefill, extra_body={**options, "echo": True}, n=2,
                                            stream=True, **kwargs)
    deltas = [(c.choices[0].index, c.choices[0].delta) for c in stream if c.choices]
    assert [(i, d.role, d.content) for i, d in deltas[:4]] == [
        (0, "assistant", ""), (1, "assistant", ""), (0, None, "The Nile is"), (1, None, "The Nile is")]
    for index in (0, 1):
        assert "".join(d.content or "" for i, d in deltas if i == index) == echoed.choices[0].message.content
    question = _messages("Name a river.")
    answers = [client.chat.completions.create(messages=question, extra_body=extra, **kwargs)
               for extra in ({}, {"echo": True})]
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content


def test_invocations_answer_as_the_api_the_body_names(served, model):
    """vLLM's /invocations (SageMaker): messages are a chat completion, a prompt a completion, each answered
    as its own endpoint answers it (streamed too); a body with neither, or a bad field, is a 400."""
    _, url = served
    chat = {"model": model, "messages": _messages("Name a river."), "max_tokens": 4, "temperature": 0.0}
    completion = {"model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0.0}
    routes = (("/v1/chat/completions", chat, "message"), ("/v1/completions", completion, "text"))
    for path, body, field in routes:
        want, got = (_post(url, p, body).json()["choices"][0] for p in (path, "/invocations"))
        assert got[field] == want[field] and got["finish_reason"] == want["finish_reason"]
    streamed = _post(url, "/invocations", {**chat, "stream": True})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.text.rstrip().endswith("data: [DONE]")
    for body, words in (({"model": model, "input": "hi"}, "messages (chat completions) or a prompt"),
                        ({**chat, "max_tokens": "many"}, "max_tokens")):
        r = _post(url, "/invocations", body)
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_tokenize_detokenize_and_version(served, model):
    """vLLM's /tokenize, /detokenize and /version: the ids the completion endpoints feed the engine."""
    server, url = served
    prompt = "The capital of France is"
    ids = list(server.tokenizer.encode(prompt))
    r = _post(url, "/tokenize", {"model": model, "prompt": prompt})
    assert r.json() == {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids,
                        "token_strs": None}
    with_strs = _post(url, "/tokenize", {"prompt": prompt, "return_token_strs": True}).json()
    assert with_strs["token_strs"] == server.tokenizer.convert_ids_to_tokens(ids)
    messages = _messages("Name three rivers.")
    chat = _post(url, "/tokenize", {"model": model, "messages": messages}).json()
    assert chat["tokens"] == apply_chat_template(server.tokenizer, messages)  # what chat completions run
    bare = _post(url, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert bare["count"] < chat["count"] and chat["tokens"][:bare["count"]] == bare["tokens"]
    assert _post(url, "/detokenize", {"model": model, "tokens": ids}).json() == {"prompt": prompt}
    assert httpx.get(f"{url}/version").json() == {"version": __version__}


def test_chat_template_controls(served, client, model, monkeypatch):
    """vLLM's chat extensions: continue_final_message prefills the assistant's answer; a request's own
    template and its variables (chat_template_kwargs) run only on a server started trusting them."""
    server, url = served
    messages = [{"role": "user", "content": "Name a river."}, {"role": "assistant", "content": "The Nile is"}]
    options = {"continue_final_message": True, "add_generation_prompt": False}
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0.0,
                                           extra_body=options)
    continued = apply_chat_template(server.tokenizer, messages, add_generation_prompt=False,
                                    continue_final_message=True)
    closed = apply_chat_template(server.tokenizer, messages, add_generation_prompt=False)
    assert reply.usage.prompt_tokens == len(continued) < len(closed)  # no end-of-turn after "The Nile is"
    template = "{% for m in messages %}{{ m['content'] }}|{% endfor %}{{ greeting }}"
    own = {"chat_template": template, "chat_template_kwargs": {"greeting": "Hi"}}
    with pytest.raises(openai.BadRequestError, match="trust-request-chat-template"):
        client.chat.completions.create(model=model, messages=messages[:1], max_tokens=2, extra_body=own)
    # --trust-request-chat-template, on the shared server for this test only (the flag is read per request,
    # as test_tool_calling's server, started with it, shows too): no second engine to load.
    monkeypatch.setattr(server.config, "trust_request_chat_template", True)
    r = _post(url, "/v1/chat/completions", {"messages": messages[:1], "max_tokens": 2, **own})
    assert r.status_code == 200, r.text
    rendered = list(server.tokenizer.encode("Name a river.|Hi", add_special_tokens=False))
    assert r.json()["usage"]["prompt_tokens"] == len(rendered)


def test_api_key_guards_only_the_v1_routes(served):
    """As vLLM's --api-key: Prometheus scrapes /metrics without it; /tokenize and /version are open too."""
    _, url = served
    assert httpx.get(f"{url}/metrics").status_code == 200
    assert httpx.get(f"{url}/version").status_code == 200
    assert httpx.post(f"{url}/tokenize", json={"prompt": "hi"}).status_code == 200
    assert httpx.post(f"{url}/detokenize", json={"tokens": [1]}).status_code == 200
    for path in ("/v1/models", "/v1/nothing"):
        assert httpx.get(f"{url}{path}").status_code == 401


def test_several_served_model_names(tiny_llama):
    """vLLM's --served-model-name a b: responses report the first name, requests may use any."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), max_model_len=64, block_size=8))
    server = OpenAIServer(engine, ServerConfig(served_model_name=["first", "alias"], log_level="warning"))
    with BackgroundServer(server) as url:
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["first", "alias"]
        body = {"model": "alias", "prompt": [5, 6, 7], "max_tokens": 2}
        r = httpx.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["model"] == "first"
        usage = r.json()["usage"]
        r = httpx.post(f"{url}/v1/completions", json={**body, "model": "other"})
        assert r.status_code == 404 and "'first', 'alias'" in r.json()["error"]["message"]
        # /metrics labels every vllm:* series with the first name, as vLLM's does, whichever was asked.
        after = _metrics(url)
        assert sum(after[_vllm("request_success_total", "first", finished_reason=reason)]
                   for reason in ("stop", "length", "abort", "error")) == 1
        assert after[_vllm("prompt_tokens_total", "first")] == usage["prompt_tokens"] == 3
        assert after[_vllm("generation_tokens_total", "first")] == usage["completion_tokens"]
        # (vllm:cache_config_info, as vLLM's, carries the cache's configuration instead.)
        labelled = [key for key in after if key.startswith("vllm:") and "cache_config_info" not in key]
        assert labelled and all("model_name=first" in key for key in labelled)
    with pytest.raises(ValueError, match="served_model_name"):
        ServerConfig(served_model_name=[])


# -- LoRA adapters --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_served(tiny_llama, tmp_path_factory):
    """A tiny model serving two LoRA adapters under their own names (one slot: they take turns), with
    runtime loading on."""
    root = tmp_path_factory.mktemp("served-loras")
    sql = make_lora_adapter(root / "sql", tiny_llama, ["q_proj", "v_proj"], rank=8, alpha=16, seed=1)
    chat = make_lora_adapter(root / "chat", tiny_llama, list(LORA_MODULES), rank=4, alpha=8, seed=2)
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), max_model_len=64, block_size=8, enable_lora=True))
    modules = [LoRAModulePath("sql", str(sql)), LoRAModulePath("chat", str(chat), base_model_name="tiny")]
    config = ServerConfig(served_model_name="tiny", lora_modules=modules, allow_runtime_lora_updating=True,
                          log_level="warning")
    server = OpenAIServer(engine, config)
    with BackgroundServer(server) as url:
        yield server, url


def _greedy_token_ids(client, model: str, prompt: list[int], max_tokens: int) -> list[int]:
    as_ids = {"return_tokens_as_token_ids": True, "ignore_eos": True}
    r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                  logprobs=1, extra_body=as_ids)
    assert r.model == model  # responses name the adapter that ran, as vLLM's
    return [int(token.split(":")[1]) for token in r.choices[0].logprobs.tokens]


def test_a_lora_adapter_is_selected_by_model_name(lora_served, tiny_llama):
    """"model" naming an adapter runs it: the tokens the offline engine gives with that adapter."""
    server, url = lora_served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S)
    prompt = [5, 6, 7, 8, 9]
    got = {model: _greedy_token_ids(client, model, prompt, 6) for model in ("sql", "chat", "tiny")}
    offline = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=8, enable_lora=True))
    for model in ("sql", "chat", "tiny"):
        expected, _ = run_greedy(offline, [prompt], 6, loras=[server.lora_requests.get(model)])
        assert got[model] == expected[0], model
    assert got["sql"] != got["tiny"] and got["chat"] != got["tiny"]
    chunks = list(client.completions.create(model="chat", prompt=prompt, max_tokens=3, stream=True))
    assert {chunk.model for chunk in chunks} == {"chat"}


def test_lora_requests_info_names_the_running_and_waiting_adapters(lora_served):
    """vLLM's vllm:lora_requests_info, which LoRA-aware routers read: with one adapter slot, the first
    request's adapter runs and the second's waits for the slot."""
    from plait.entrypoints.async_engine import EngineStats, _lora_stats
    from plait.entrypoints.metrics import ServerMetrics

    server, url = lora_served
    idle = _metrics(url)
    assert idle["vllm:lora_requests_info{max_lora=1,running_lora_adapters=,waiting_lora_adapters=}"] > 0
    engine = LLMEngine(EngineConfig(model=str(server.engine._engine.config.model), max_model_len=64,
                                    block_size=8, enable_lora=True))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for name in ("sql", "chat"):
        engine.add_request([5, 6, 7], params, lora_request=server.lora_requests[name])
    engine.step()
    stats = EngineStats(**_lora_stats(engine))
    assert (stats.max_loras, stats.running_loras, stats.waiting_loras) == (1, ("sql",), ("chat",))
    text = ServerMetrics(lambda: stats, "tiny").render().decode()
    assert ('vllm:lora_requests_info{max_lora="1",running_lora_adapters="sql",waiting_lora_adapters="chat"}'
            in text)


def test_models_lists_lora_adapters_with_their_parent(lora_served, tiny_llama):
    """As vLLM's /v1/models: the base model, then each adapter with the base as its parent and its folder as
    its root."""
    server, url = lora_served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    cards = [m.model_dump() for m in client.models.list().data]
    assert [(c["id"], c["parent"]) for c in cards] == [("tiny", None), ("sql", "tiny"), ("chat", "tiny")]
    assert cards[0]["root"] == str(Path(tiny_llama).resolve()) and cards[0]["max_model_len"] == 64
    assert cards[1]["root"] == server.lora_requests["sql"].lora_path


def test_unknown_models_and_bad_adapters_get_4xx(lora_served, tiny_llama, tmp_path):
    """An unknown model is vLLM's 404; an adapter plait cannot serve is a 400 at /v1/load_lora_adapter and
    stops the server at start-up; loaded adapters are served until unloaded."""
    server, url = lora_served
    r = httpx.post(f"{url}/v1/completions", json={"model": "nope", "prompt": [5, 6], "max_tokens": 1})
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert error["type"] == "NotFoundError" and error["param"] == "model"
    assert error["message"].startswith("The model `nope` does not exist.")
    big = make_lora_adapter(tmp_path / "big", tiny_llama, ["q_proj"], rank=32, alpha=32, seed=3)
    small = make_lora_adapter(tmp_path / "small", tiny_llama, ["o_proj"], rank=2, alpha=4, seed=4)

    def load(name: str, path: Path) -> httpx.Response:
        return httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})

    for name, path, words in (("big", big, "LoRA rank 32 is greater than max_lora_rank 16."),
                              ("gone", tmp_path / "gone", "no adapter_config.json"),
                              ("sql", small, "has already been loaded"),
                              ("tiny", small, "served model name")):
        r = load(name, path)
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert load("small", small).text == "Success: LoRA adapter 'small' added successfully."
    assert "small" in [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
    body = {"model": "small", "prompt": [5, 6], "max_tokens": 2}
    r = httpx.post(f"{url}/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["model"] == "small"
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "small"}).status_code == 200
    assert httpx.post(f"{url}/v1/completions", json=body).status_code == 404
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "small"}).status_code == 404
    # At start-up: a bad adapter, a name taken, or adapters without --enable-lora.
    config = {"model": str(tiny_llama), "max_model_len": 64, "block_size": 8}
    lora_engine = LLMEngine(EngineConfig(**config, enable_lora=True))
    for modules, words in (([LoRAModulePath("big", str(big))], "greater than max_lora_rank"),
                           ([LoRAModulePath("x", str(small))] * 2, "has already been loaded")):
        with pytest.raises(ValueError, match=words):
            OpenAIServer(lora_engine, ServerConfig(lora_modules=modules))
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        OpenAIServer(LLMEngine(EngineConfig(**config)),
                     ServerConfig(lora_modules=[LoRAModulePath("s", str(small))]))


# -- CORS -----------------------------------------------------------------------------------------

PAGE_ORIGIN = "https://page.example"
OTHER_ORIGIN = "https://other.example"


def _preflight(origin: str = PAGE_ORIGIN, method: str = "POST", headers: str = "authorization, content-type"
               ) -> dict[str, str]:
    """What a browser sends before a cross-origin POST with an API key: no key of its own."""
    return {"Origin": origin, "Access-Control-Request-Method": method,
            "Access-Control-Request-Headers": headers}


def test_cors_as_vllm_defaults(served, model):
    """vLLM's CORS defaults (any origin, method and header): a preflight to a /v1 route passes without the
    key, and responses, refusals and streams alike, let the page read them."""
    _, url = served
    r = httpx.options(f"{url}/v1/chat/completions", headers=_preflight())
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == "*"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert r.headers["access-control-allow-headers"] == "authorization, content-type"
    assert "access-control-allow-credentials" not in r.headers  # --allow-credentials is off by default
    assert httpx.options(f"{url}/v1/models").status_code == 405  # no preflight: the app's answer, not a 401
    keyed = {"Origin": PAGE_ORIGIN, "Authorization": f"Bearer {API_KEY}"}
    ok = httpx.get(f"{url}/v1/models", headers=keyed)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "*"
    refused = httpx.get(f"{url}/v1/models", headers={"Origin": PAGE_ORIGIN})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"
    body = {"model": model, "prompt": "Hi", "max_tokens": 1, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=keyed) as streamed:
        assert streamed.status_code == 200 and streamed.headers["access-control-allow-origin"] == "*"
        assert [line for line in streamed.iter_lines() if line][-1] == SSE_DONE.strip()


def test_cors_flags_restrict(tiny_llama):
    """The CORS flags (--allowed-origins, -methods, -headers, --allow-credentials) reach the middleware."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), max_model_len=64, block_size=8))
    config = ServerConfig(allowed_origins=[PAGE_ORIGIN], allowed_methods=["POST"],
                          allowed_headers=["content-type"], allow_credentials=True, log_level="warning")
    with BackgroundServer(OpenAIServer(engine, config)) as url:
        allowed = _preflight(headers="content-type")
        r = httpx.options(f"{url}/v1/completions", headers=allowed)
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == PAGE_ORIGIN
        assert r.headers["access-control-allow-credentials"] == "true"
        for refused in (_preflight(OTHER_ORIGIN, headers="content-type"), _preflight(method="DELETE",
                        headers="content-type"), _preflight(headers="x-secret")):
            assert httpx.options(f"{url}/v1/completions", headers=refused).status_code == 400
        r = httpx.get(f"{url}/v1/models", headers={"Origin": PAGE_ORIGIN})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == PAGE_ORIGIN
        r = httpx.get(f"{url}/v1/models", headers={"Origin": OTHER_ORIGIN})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    with pytest.raises(ValueError, match="allowed_origins"):
        ServerConfig(allowed_origins="*")


# -- generation_config.json -----------------------------------------------------------------------

# Sampling defaults a model's generation_config.json may set (do_sample is ignored, as vLLM ignores it).
MODEL_SAMPLING_DEFAULTS = {"temperature": 0.0, "top_p": 0.9, "top_k": 7, "min_p": 0.05,
                           "repetition_penalty": 1.1, "max_new_tokens": 5, "do_sample": True}
TINY_MAX_MODEL_LEN = 64


def _model_with_generation_config(tiny_llama: Path, folder: Path, generation_config: dict) -> Path:
    shutil.copytree(tiny_llama, folder)
    (folder / "generation_config.json").write_text(json.dumps(generation_config))
    return folder


def _record_params(server: OpenAIServer) -> list[SamplingParams]:
    """The SamplingParams of every engine request the server makes from now on."""
    seen: list[SamplingParams] = []
    add = server.engine.add

    async def recording(children, **kwargs):
        seen.extend(params for _, params in children)
        return await add(children, **kwargs)

    server.engine.add = recording
    return seen


def test_generation_config_defaults_as_vllm(tiny_llama, tmp_path):
    """As vLLM's --generation-config auto: the model's generation_config.json sets what a request leaves out
    (its max_new_tokens being max_tokens), the request's own values win, and "vllm" ignores the file."""
    folder = _model_with_generation_config(tiny_llama, tmp_path / "model", MODEL_SAMPLING_DEFAULTS)
    prompt = [5, 6, 7, 8, 9]
    unset = {"prompt": prompt, "max_tokens": None, "logprobs": 0, "ignore_eos": True}  # null: the default

    def served(generation_config: str):
        engine = LLMEngine(EngineConfig(model=str(folder), max_model_len=TINY_MAX_MODEL_LEN, block_size=8,
                                        generation_config=generation_config))
        server = OpenAIServer(engine, ServerConfig(log_level="warning"))
        return server, _record_params(server)

    server, seen = served("auto")
    with BackgroundServer(server) as url:
        default = httpx.post(f"{url}/v1/completions", json=unset).json()
        greedy = httpx.post(f"{url}/v1/completions", json={**unset, "temperature": 0.0}).json()
        own = {"temperature": 0.7, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
               "max_tokens": 9, "seed": 1}
        assert httpx.post(f"{url}/v1/completions", json={**unset, **own}).status_code == 200
        # A default max_tokens is cut to the room left; a request's own beyond the context is refused.
        long_prompt = list(range(3, TINY_MAX_MODEL_LEN - 2 + 3))
        cut = httpx.post(f"{url}/v1/completions", json={**unset, "prompt": long_prompt}).json()
        too_long = httpx.post(f"{url}/v1/completions", json={**unset, "prompt": long_prompt, "max_tokens": 5})
    first, _, mine = seen[:3]
    assert (first.temperature, first.top_p, first.top_k, first.min_p, first.repetition_penalty,
            first.max_tokens) == (0.0, 0.9, 7, 0.05, 1.1, 5)
    assert default["choices"][0]["finish_reason"] == "length" and default["usage"]["completion_tokens"] == 5
    assert default["choices"][0]["logprobs"] == greedy["choices"][0]["logprobs"]  # the same greedy tokens
    assert (mine.temperature, mine.top_p, mine.top_k, mine.min_p, mine.repetition_penalty,
            mine.max_tokens) == (0.7, 1.0, 0, 0.0, 1.0, 9)
    assert cut["usage"]["completion_tokens"] == 2 and cut["choices"][0]["finish_reason"] == "length"
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"

    server, seen = served("vllm")
    with BackgroundServer(server) as url:
        assert httpx.post(f"{url}/v1/completions", json={**unset, "max_tokens": 3}).status_code == 200
    (plain,) = seen
    assert (plain.temperature, plain.top_p, plain.top_k, plain.min_p, plain.repetition_penalty,
            plain.max_tokens) == (1.0, 1.0, 0, 0.0, 1.0, 3)


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
    assert after[_vllm("kv_cache_usage_perc", model)] == 0.0
    assert after[_vllm("num_requests_running", model)] == after[_vllm("num_requests_waiting", model)] == 0
    assert server.engine.call_threadsafe(lambda e: e.is_idle_and_clean(), IDLE_TIMEOUT_S)
    aborted = _vllm("request_success_total", model, finished_reason="abort")
    assert after[aborted] - before[aborted] == NUM_DISCONNECTING
    finished = sum(_delta(before, after, _vllm("request_success_total", model, finished_reason=r))
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
    aborted = _vllm("request_success_total", model, finished_reason="abort")
    assert after[aborted] - before[aborted] == 1
    assert after[_vllm("kv_cache_usage_perc", model)] == 0.0


# -- bad input ---------------------------------------------------------------------------------


TOO_LONG = 9000  # token ids: more than the default model's 8192-token context
TOOL_F = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
NAMED_F = {"type": "function", "function": {"name": "f"}}
TAG_A = {"begin": "<a>", "schema": {"type": "object"}, "end": "</a>"}  # a structural tag's structure


def _tag(structures: list | None = None, triggers: list | None = None) -> dict:
    """A structural_tag response_format (as vLLM's structural_tag fields take its JSON too)."""
    return {"type": "structural_tag", "structures": [TAG_A] if structures is None else structures,
            "triggers": ["<a"] if triggers is None else triggers}


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
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "at least 1 (0 only with echo"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty", "less than or"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs", "more than the 20 this engine"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, 400, "min_tokens",
     "min_tokens must be <= max_tokens"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop", "empty string"),
    ("/v1/completions", {"prompt": "x", "n": MAX_N + 1}, 400, "n", "less than or equal to"),
    ("/v1/completions", {"prompt": ["x"] * 33, "n": MAX_N}, 400, "n", "sequences"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", "empty"),
    ("/v1/completions", {"prompt": [1, 10**9]}, 400, "prompt", "out of range"),
    ("/v1/completions", {"prompt": [1, -3]}, 400, "prompt", "greater than or equal to 0"),
    ("/v1/completions", {"prompt": [1] * TOO_LONG}, 400, "prompt", "maximum context length"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**5}, 400, "max_tokens", "maximum context length"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs",
     "is more than the 20 this engine returns"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1}, 400, "prompt_logprobs", "greater than or"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs",
     "stream"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 21}, 400,
     "prompt_logprobs", "more than the 20"),
    # logit_bias: OpenAI's bounds, ids as digit strings, within the vocabulary (49152 ids), few enough
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1": 100.5}}, 400, "logit_bias", "less than or equal"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1": -101}}, 400, "logit_bias", "greater than or"),
    ("/v1/completions", b'{"prompt": "x", "logit_bias": {"1": NaN}}', 400, "logit_bias", "finite"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1": "5"}}, 400, "logit_bias", "valid number"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"one": 5}}, 400, "logit_bias", "pattern"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"-1": 5}}, 400, "logit_bias", "pattern"),
    ("/v1/completions", {"prompt": "x", "logit_bias": [[1, 5]]}, 400, "logit_bias", "valid dictionary"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"49152": 5}}, 400, "logit_bias",
     "logit_bias token id 49152 is out of range for a vocabulary of 49152"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}},
     400, "logit_bias", "at most 1024 items"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"10000000": 1}},
     400, "logit_bias", "out of range"),
    # bad_words: a list of words, none blank, few enough
    ("/v1/completions", {"prompt": "x", "bad_words": "word"}, 400, "bad_words", "valid list"),
    ("/v1/completions", {"prompt": "x", "bad_words": ["ok", " "]}, 400, "bad_words", "blank"),
    ("/v1/completions", {"prompt": "x", "bad_words": ["w"] * 129}, 400, "bad_words", "at most 128 items"),
    # allowed_token_ids: not empty, ids within the vocabulary, few enough
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids", "at least 1"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": [-1]}, 400, "allowed_token_ids",
     "greater than or equal to 0"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": ["5"]}, 400, "allowed_token_ids", "integer"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": list(range(MAX_ALLOWED_TOKEN_IDS + 1))}, 400,
     "allowed_token_ids", "at most 1024 items"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "allowed_token_ids": [5, 49152]},
     400, "allowed_token_ids", "allowed_token_ids token id 49152 is out of range"),
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
    # features plait does not implement get a 400 naming them, never output that ignored them
    *[(path, {**base, field: value}, 400, field, "not supported") for path, base in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "x"}),
    ) for field, value in (
        ("functions", [{"name": "f"}]),
        ("function_call", "auto"),
        ("response_format", {"type": "xml"}),
        ("structured_outputs", {"json": {"type": "object"}, "whitespace_pattern": " "}),
        ("response_format", {"type": "structural_tag", "format": {"type": "triggered_tags"}}),
        ("structured_outputs", {"structural_tag": json.dumps({"format": {"type": "any_text"}})}),
    )],
    # tool calling: chat's only (as OpenAI's); vLLM's checks, in its words where it has them
    *[("/v1/completions", {"prompt": "x", field: value}, 400, field, "not supported") for field, value in (
        ("tools", [TOOL_F]), ("tool_choice", "auto"), ("tool_choice", NAMED_F))],
    *[("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **fields}, 400, param, words)
      for fields, param, words in (
        ({"tools": [TOOL_F]}, "tool_choice",  # "auto", the default with tools; this server has no parser
         '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'),
        ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
        ({"tool_choice": "auto", "tools": []}, "tool_choice", "`tools` must be set"),
        ({"tool_choice": NAMED_F}, "tool_choice", "`tools` must be set"),
        ({"tools": [TOOL_F], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice",
         "does not match any of the specified `tools`"),
        ({"tools": [TOOL_F], "tool_choice": "any"}, "tool_choice", "'required'"),
        ({"tools": [TOOL_F], "tool_choice": NAMED_F, "response_format": {"type": "json_object"}},
         "tool_choice", "cannot both"),
        ({"tools": [TOOL_F, TOOL_F], "tool_choice": "required"}, "tools", "unique"),
        ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools", "required"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools", "'function'"),
        ({"tools": [{"function": {"name": ""}}]}, "tools", "at least 1"),
        ({"tools": [{"function": {"name": "f", "parameters": "{}"}}]}, "tools", "valid dictionary"),
        ({"tools": [{"function": {"name": "f", "parameters": {"type": "bogus"}}}], "tool_choice": "required"},
         "tools", "bogus"),  # llguidance's message
        ({"tools": [{"function": {"name": "f", "parameters": {"$defs": {"A": {}}}}},
                    {"function": {"name": "g", "parameters": {"$defs": {"A": {"type": "string"}}}}}],
          "tool_choice": "required"}, "tools", "differently"),
    )],
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {
        "name": "f"}}]}]}, 400, "messages", "required"),  # a tool call without its arguments
    # structured outputs: well-formed requests, schemas, regexes and grammars (llguidance's own messages)
    *[(path, {**base, field: value}, 400, field, words) for path, base in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "x"}),
    ) for field, value, words in (
        ("response_format", {"type": "json_schema"}, "needs json_schema"),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "x"}}, "required"),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}},
         "valid dictionary"),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"required": 5}}},
         "required"),
        ("guided_json", {"type": "bogus"}, "bogus"),
        ("guided_json", "{not json", "not valid JSON"),
        ("guided_regex", "[0-9", "unclosed character class"),
        ("guided_grammar", "start: nothing_defined", "unknown name"),
        ("structured_outputs", {"choice": ["a", "b"], "regex": "[ab]"}, "exactly one"),
        ("structured_outputs", {"regex": 5}, "valid string"),
        # structural tags: vLLM's model's types, and its backends' checks (llguidance's and xgrammar's)
        ("response_format", {"type": "structural_tag"}, "needs structures"),
        ("response_format", {"type": "structural_tag", "structures": [TAG_A]}, "and triggers"),
        ("response_format", _tag([]), "non-empty"),
        ("response_format", _tag([{**TAG_A, "begin": 5}]), "valid string"),
        ("response_format", _tag([{"begin": "<a>", "end": ""}]), "schema must be a JSON schema object"),
        ("response_format", _tag(triggers=["<b"]), "begin '<a>' does not match any trigger"),
        ("response_format", _tag(triggers=["<", "<a"]), "mutually inclusive"),
        ("response_format", _tag(triggers=[""]), "non-empty str"),
        ("structural_tag", "{}", "needs structures"),
        ("structural_tag", json.dumps(_tag([{**TAG_A, "schema": {"type": "bogus"}}])),
         "structures[0] schema: Invalid type: bogus"),  # llguidance's message, from the engine
        ("structured_outputs", {"structural_tag": "{not json"}, "not valid JSON"),
        ("structured_outputs", {"structural_tag": 5}, "valid dictionary"),
    )],
    ("/v1/completions", {"prompt": "x", "structural_tag": json.dumps(_tag()), "guided_regex": "a"}, 400,
     "guided_regex", "cannot both"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": _tag(),
                              "structured_outputs": {"structural_tag": _tag()}}, 400, "response_format",
     "cannot both"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "a", "response_format": {"type": "json_object"}}, 400,
     "guided_regex", "cannot both"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a"}, "allowed_token_ids": [1]}, 400,
     "structured_outputs", "cannot be combined"),
    ("/v1/completions", {"prompt": "x", "guided_choice": []}, 400, "guided_choice", "at least 1"),
    ("/v1/completions", {"prompt": "x", "guided_choice": ["a", ""]}, 400, "guided_choice", "empty string"),
    ("/v1/completions", {"prompt": "x", "guided_choice": ["a"], "structured_outputs": {"choice": ["b"]}}, 400,
     "guided_choice", "cannot both"),
    ("/v1/completions", {"prompt": "x", "guided_choice": ["a"], "allowed_token_ids": [1]}, 400,
     "guided_choice", "cannot be combined"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": "yes"}, 400, "echo",
     "valid boolean"),
    ("/v1/completions", {"prompt": "x", "return_tokens_as_token_ids": 1}, 400, "return_tokens_as_token_ids",
     "valid boolean"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "continue_final_message": True}, 400, "continue_final_message", "cannot both"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ x }}"},
     400, "chat_template", "trust-request-chat-template"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "chat_template_kwargs": {"chat_template": "{{ x }}"}}, 400, "chat_template",
     "trust-request-chat-template"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": "x"},
     400, "chat_template_kwargs", "valid dictionary"),
    ("/tokenize", {}, 400, "prompt", "either prompt or messages"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "hi"}]}, 400, "prompt", "either"),
    ("/tokenize", {"prompt": 5}, 400, "prompt", "valid string"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": True}, 400,
     "add_special_tokens", "not supported"),
    ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "model", "does not exist"),
    ("/tokenize", {"prompt": "x", "tools": [TOOL_F]}, 400, "tools", "messages only"),
    ("/tokenize", {"prompt": "x", "tool_choice": "none"}, 400, "tool_choice", "messages only"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True}, 400,
     "continue_final_message", "cannot both"),
    # truncate_prompt_tokens: -1 or at least 1 (vLLM's bound in pydantic's words), within the context
    ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": -2}, 400, "truncate_prompt_tokens",
     "greater than or equal to -1"),
    ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens",
     "truncate_prompt_tokens must be >= 1, or -1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "truncate_prompt_tokens": "5"},
     400, "truncate_prompt_tokens", "valid integer"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "truncate_prompt_tokens": TOO_LONG}, 400, "truncate_prompt_tokens",
     "cannot be greater than max_model_len - max_tokens = 8192."),  # chat's max_tokens: none, so 0
    ("/v1/completions", {"prompt": "x", "truncation_side": "right"}, 400, "truncation_side", "'left'"),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens", "out of range"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens", "valid integer"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens", "greater than or equal to 0"),
    ("/detokenize", {}, 400, "tokens", "required"),
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
    # vLLM's names, types and model_name label, so dashboards built for vLLM read these as they are.
    vllm = lambda name, **labels: _vllm(name, model, **labels)
    assert delta(vllm("request_success_total", finished_reason="length")) == 1
    assert delta(vllm("prompt_tokens_total")) == r.usage.prompt_tokens
    assert delta(vllm("generation_tokens_total")) == 5
    assert delta(vllm("time_to_first_token_seconds_count")) == 1
    assert delta(vllm("inter_token_latency_seconds_count")) == 4  # between 5 tokens
    assert delta(vllm("e2e_request_latency_seconds_count")) == 1
    assert delta(vllm("e2e_request_latency_seconds_sum")) > 0
    # vLLM's per-request phases: they add up to the engine's own span of the request.
    for phase in ("queue_time", "prefill_time", "decode_time", "inference_time"):
        assert delta(vllm(f"request_{phase}_seconds_count")) == 1, phase
    inference = delta(vllm("request_inference_time_seconds_sum"))
    assert inference > 0 and inference == pytest.approx(
        delta(vllm("request_prefill_time_seconds_sum")) + delta(vllm("request_decode_time_seconds_sum")))
    assert inference + delta(vllm("request_queue_time_seconds_sum")) <= delta(
        vllm("e2e_request_latency_seconds_sum"))
    assert delta(vllm("request_prompt_tokens_sum")) == r.usage.prompt_tokens
    assert delta(vllm("request_generation_tokens_sum")) == 5
    # vLLM's per-prompt parameters, and the longest of a prompt's sequences.
    assert (delta(vllm("request_params_n_count")), delta(vllm("request_params_n_sum"))) == (1, 1)
    assert delta(vllm("request_params_max_tokens_sum")) == 5
    assert delta(vllm("request_max_num_generation_tokens_sum")) == 5
    # vLLM's per-request TPOT: the decode time over the 4 tokens after the first.
    assert delta(vllm("request_time_per_output_token_seconds_count")) == 1
    assert delta(vllm("request_time_per_output_token_seconds_sum")) == pytest.approx(
        delta(vllm("request_decode_time_seconds_sum")) / 4)
    assert delta(vllm("request_generation_tokens_bucket", le="5.0")) == 1
    # plait's own per-step histograms, and vLLM's tokens-per-step one that adds them up.
    steps = delta("plait_step_decode_tokens_count")
    assert steps >= 5  # one prefill step (which samples the first token), then 4 decodes
    assert delta("plait_step_decode_tokens_sum") == 4
    assert delta("plait_step_prefill_tokens_sum") >= 1
    assert delta("plait_engine_steps_total") == steps
    assert delta(vllm("iteration_tokens_total_count")) == steps
    assert delta(vllm("iteration_tokens_total_sum")) == (delta("plait_step_prefill_tokens_sum")
                                                          + delta("plait_step_decode_tokens_sum"))
    assert after[vllm("kv_cache_usage_perc")] == 0.0
    assert after[vllm("num_requests_running")] == after[vllm("num_requests_waiting")] == 0
    assert after[vllm("num_preemptions_total")] >= 0
    # Two prompts, n = 2 each: two prompts' parameters, and each prompt's longest sequence (all run to 3).
    client.completions.create(model=model, prompt=["One", "Two"], n=2, max_tokens=3, temperature=0.8,
                              extra_body={"ignore_eos": True})
    again = _metrics(url)
    grew = lambda name: _delta(after, again, vllm(name))
    assert (grew("request_params_n_count"), grew("request_params_n_sum")) == (2, 4)
    assert (grew("request_params_max_tokens_count"), grew("request_params_max_tokens_sum")) == (2, 6)
    longest = "request_max_num_generation_tokens"
    assert (grew(f"{longest}_count"), grew(f"{longest}_sum")) == (2, 6)
    assert grew("request_generation_tokens_count") == 4
    # vLLM's KV cache info gauge: what routers read the cache's capacity from.
    engine = server.engine._engine
    blocks = engine.kv_cache.num_usable_blocks
    info = {"block_size": str(engine.config.block_size), "cache_dtype": "auto", "num_gpu_blocks": str(blocks),
            "kv_cache_size_tokens": str(blocks * engine.config.block_size), "enable_prefix_caching": "True",
            "gpu_memory_utilization": str(engine.config.gpu_memory_utilization)}
    folded = ",".join(f"{k}={v}" for k, v in sorted(info.items()))
    assert after[f"vllm:cache_config_info{{{folded}}}"] == 1.0
    # Nothing left under the old plait_ names that vLLM has a name for.
    for old in ("plait_requests_finished_total", "plait_prompt_tokens_total", "plait_kv_cache_usage_perc",
                "plait_time_to_first_token_seconds_count", "plait_num_requests_running"):
        assert not any(key.startswith(old) for key in after), old


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
    assert _delta(before, after, _vllm("prefix_cache_hits_total", model)) > 0
    assert _delta(before, after, _vllm("prefix_cache_queries_total", model)) > 0
    assert after["plait_prefix_cache_blocks"] > 0
    assert 0 < after["plait_prefix_cache_hit_rate"] <= 1
    assert "plait_prefix_cache_evicted_blocks_total" in after


def _tiny_prefix_engine(tiny_llama) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_llama), max_model_len=TINY_MAX_MODEL_LEN, block_size=8))


@contextlib.contextmanager
def _cached_tokens_server(engine: LLMEngine):
    """``engine`` served with --enable-prompt-tokens-details: (its URL, its model's name, a client)."""
    server = OpenAIServer(engine, ServerConfig(log_level="warning", enable_prompt_tokens_details=True))
    with BackgroundServer(server) as url:
        yield url, server.model_name, openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                                    timeout=CLIENT_TIMEOUT_S)


def test_prompt_tokens_details_say_what_the_cache_served(tiny_llama):
    """vLLM's --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens is 0 for a new prompt
    and whole blocks of it the second time, in a completion and in a stream's usage chunk; without the flag
    the field is null. /ping answers as /health, GET or POST."""
    engine = _tiny_prefix_engine(tiny_llama)
    prompt = list(range(5, 45))
    with _cached_tokens_server(engine) as (url, name, client):
        first = client.completions.create(model=name, prompt=prompt, max_tokens=2, temperature=0.0).usage
        again = client.completions.create(model=name, prompt=prompt, max_tokens=2, temperature=0.0).usage
        assert first.prompt_tokens_details.cached_tokens == 0
        cached = again.prompt_tokens_details.cached_tokens
        assert 0 < cached < again.prompt_tokens and cached % 8 == 0
        chunks = list(client.completions.create(model=name, prompt=prompt, max_tokens=2, stream=True,
                                                stream_options={"include_usage": True}))
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
        for method in ("GET", "POST"):
            assert httpx.request(method, f"{url}/ping").json() == {"status": "ok"}
    with BackgroundServer(OpenAIServer(engine, ServerConfig(log_level="warning"))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=CLIENT_TIMEOUT_S)
        usage = client.completions.create(model=name, prompt=prompt, max_tokens=2, temperature=0.0).usage
        assert usage.prompt_tokens_details is None


def test_cache_salt_shares_the_prefix_cache_only_within_a_salt(tiny_llama):
    """vLLM's cache_salt: a prompt's cached blocks serve the same prompt again only under the same salt (or,
    unsalted, only unsalted requests), streamed or not; an empty or non-string salt is a 400 naming it."""
    prompt = list(range(5, 45))
    with _cached_tokens_server(_tiny_prefix_engine(tiny_llama)) as (url, name, client):
        def cached(salt: str | None, **kw) -> int:
            extra = {"cache_salt": salt} if salt is not None else {}
            usage = client.completions.create(model=name, prompt=prompt, max_tokens=2, temperature=0.0,
                                              extra_body=extra, **kw).usage
            return usage.prompt_tokens_details.cached_tokens

        assert cached("tenant-a") == 0
        hit = cached("tenant-a")
        assert hit > 0
        assert cached("tenant-b") == 0 and cached(None) == 0
        assert cached(None) == hit and cached("tenant-b") == hit
        chunks = list(client.completions.create(model=name, prompt=prompt, max_tokens=2, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"cache_salt": "tenant-c"}))
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0
        for bad in ("", 5, ["tenant-a"]):
            r = httpx.post(f"{url}/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 2,
                                                          "cache_salt": bad}, timeout=CLIENT_TIMEOUT_S)
            assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
        assert cached("tenant-a") == hit  # the bad requests changed nothing


def test_chat_and_responses_take_a_cache_salt(served, client, model):
    """The chat and Responses APIs pass cache_salt on: a conversation repeated under a new salt finds no
    cached block, then under the same salt again its blocks (counted by vLLM's prefix-cache metrics)."""
    _, url = served
    messages = _messages("Name three colours of the rainbow, and say which comes first.")
    hits = _vllm("prefix_cache_hits_total", model)

    def hits_of(send) -> float:
        before = _metrics(url)
        send()
        return _delta(before, _metrics(url), hits)

    for salt in (f"chat-{uuid.uuid4().hex}", f"responses-{uuid.uuid4().hex}"):
        if salt.startswith("chat"):
            def send(s=salt):
                client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0.0,
                                               extra_body={"cache_salt": s})
        else:
            def send(s=salt):
                client.responses.create(model=model, input=messages[0]["content"], max_output_tokens=2,
                                        temperature=0.0, extra_body={"cache_salt": s})
        assert hits_of(send) == 0
        assert hits_of(send) > 0
    r = _post(url, "/v1/chat/completions", {"model": model, "messages": messages, "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text


def _check_request_ids(url: str, model: str, echo: bool) -> None:
    body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 2}

    def post(extra: dict | None = None, request_id: str | None = None) -> httpx.Response:
        headers = {"X-Request-Id": request_id} if request_id is not None else {}
        return httpx.post(f"{url}/v1/completions", json={**body, **(extra or {})}, headers=headers,
                          timeout=CLIENT_TIMEOUT_S)

    def echoed(r: httpx.Response, want: str) -> bool:
        return r.headers.get("x-request-id") == want if echo else "x-request-id" not in r.headers

    r = post(request_id="trace-1")
    assert r.json()["id"] == "cmpl-trace-1" and echoed(r, "trace-1")
    r = post({"request_id": "mine"})
    assert r.json()["id"] == "cmpl-mine" and echoed(r, "mine")
    r = post({"request_id": "mine"}, request_id="header-wins")
    assert r.json()["id"] == "cmpl-header-wins" and echoed(r, "header-wins")
    r = post()
    fresh = r.json()["id"].removeprefix("cmpl-")
    assert re.fullmatch(r"[0-9a-f]{32}", fresh) and echoed(r, fresh)
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                      headers={"X-Request-Id": "trace-2"}, timeout=CLIENT_TIMEOUT_S) as r:
        ids = {json.loads(line[6:])["id"] for line in r.iter_lines() if line.startswith("data: {")}
        assert ids == {"cmpl-trace-2"} and echoed(r, "trace-2")
    r = post({"request_id": ""})
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", r.json()["id"])
    for odd in ("请求-1", "line\nbreak"):  # a body id that is no header value: a fresh one in the header
        r = post({"request_id": odd})
        assert r.status_code == 200 and r.json()["id"] == f"cmpl-{odd}"
        assert not echo or re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
    r = post({"request_id": 5}, request_id="bad-1")
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id" and echoed(r, "bad-1")
    health = httpx.get(f"{url}/health", timeout=CLIENT_TIMEOUT_S)
    assert health.status_code == 200
    if echo:
        assert re.fullmatch(r"[0-9a-f]{32}", health.headers["x-request-id"])
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=CLIENT_TIMEOUT_S)
    raw = client.completions.with_raw_response.create(model=model, prompt=[5, 6], max_tokens=2,
                                                      extra_headers={"X-Request-Id": "sdk-1"})
    assert raw.parse().id == "cmpl-sdk-1" and echoed(raw, "sdk-1")


def test_response_ids_follow_x_request_id_as_vllm(tiny_llama):
    """A response's id takes the request's X-Request-Id header, else its body's request_id, else a fresh uuid
    (streamed chunks too); with --enable-request-id-headers every response, errors and /health included,
    carries X-Request-Id: the request's own, else its response's id, else a fresh one."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), max_model_len=TINY_MAX_MODEL_LEN))
    for echo in (False, True):
        server = OpenAIServer(engine, ServerConfig(log_level="warning", enable_request_id_headers=echo))
        with BackgroundServer(server) as url:
            _check_request_ids(url, server.model_name, echo)


def test_server_load_tracking_counts_requests_in_flight(tiny_llama):
    """vLLM's --enable-server-load-tracking: GET /load says how many model-running requests are in flight,
    counted from arrival to the response's last byte (the middleware over a stand-in app whose stream waits),
    and 0 once a real completion is done; without the flag there is no /load."""
    from plait.entrypoints.middleware import LoadTrackingMiddleware, ServerLoad

    load = ServerLoad()
    release = asyncio.Event()

    async def streaming_app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        await release.wait()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def scenario() -> list[int]:
        app = LoadTrackingMiddleware(streaming_app, load)
        sent = []

        async def send(message):
            sent.append(message)

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        seen = []
        for path, method in [("/v1/chat/completions", "POST"), ("/v1/models", "GET"), ("/tokenize", "POST")]:
            release.clear()
            task = asyncio.create_task(app({"type": "http", "path": path, "method": method}, receive, send))
            await asyncio.sleep(0.01)
            seen.append(load.in_flight)
            release.set()
            await task
            seen.append(load.in_flight)
        return seen

    assert asyncio.run(scenario()) == [1, 0, 0, 0, 0, 0]  # only the model-running endpoint counts

    engine = LLMEngine(EngineConfig(model=str(tiny_llama), max_model_len=TINY_MAX_MODEL_LEN, block_size=8))
    server = OpenAIServer(engine, ServerConfig(log_level="warning", enable_server_load_tracking=True))
    tracking = [m.kwargs["load"] for m in server.app.user_middleware if m.cls is LoadTrackingMiddleware]
    assert tracking == [server.load]  # the counter /load reads is the one the middleware keeps
    with BackgroundServer(server) as url:
        assert httpx.get(f"{url}/load").json() == {"server_load": 0}
        body = {"model": server.model_name, "prompt": [5, 6, 7], "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=body).status_code == 200
        assert httpx.get(f"{url}/load").json() == {"server_load": 0}
        assert server.load.in_flight == 0
    with BackgroundServer(OpenAIServer(engine, ServerConfig(log_level="warning"))) as url:
        assert httpx.get(f"{url}/load").status_code == 404


def test_server_writes_its_step_timeline_when_it_stops(tiny_llama, tmp_path):
    """--step-timeline-file: every step the engine ran while serving, on the host's monotonic clock (so a
    load generator can line requests up with steps), in the file `plait bench timeline` plots."""
    from plait.bench.timeline import load, summarize

    engine = LLMEngine(EngineConfig(model=str(tiny_llama), max_model_len=TINY_MAX_MODEL_LEN, block_size=8,
                                    max_num_batched_tokens=16))
    path = tmp_path / "steps" / "timeline.json"
    server = OpenAIServer(engine, ServerConfig(log_level="warning", step_timeline_file=str(path)))
    started = time.monotonic()
    with BackgroundServer(server) as url:
        body = {"model": server.model_name, "prompt": list(range(5, 45)), "max_tokens": 3, "ignore_eos": True}
        assert httpx.post(f"{url}/v1/completions", json=body).status_code == 200
        assert not path.exists()  # written when the server stops
    ((steps, _),) = load(path).values()
    summary = summarize(steps)
    # A 40-token prompt in 16-token chunks (3 steps; the last samples the first token), then 2 decodes.
    assert (summary["prefill_tokens"], summary["decode_tokens"], summary["steps"]) == (40, 2, 5)
    assert started <= steps[0]["start_time"] <= steps[-1]["start_time"] <= time.monotonic()
    # A path the server could not write at the end is refused at the start.
    with pytest.raises(ValueError, match="cannot write"):
        OpenAIServer(engine, ServerConfig(step_timeline_file=str(tmp_path)))  # a folder


# -- the Responses API ---------------------------------------------------------------------------


RESPONSES_QUESTION = "What is 2 + 2?"  # answered in ~12 tokens, ending with EOS
RESPONSES_MAX_TOKENS = 40
CHAIN_MAX_TOKENS = 8  # enough for a few words of each turn
INSTRUCTIONS = "Answer in one short sentence."
WEATHER_TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER_CALL}


def _chat_answer(client, model: str, messages: list[dict], max_tokens: int):
    return client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                          temperature=0.0)


def _usage_counts(usage) -> tuple[int, int, int]:
    return usage.input_tokens, usage.output_tokens, usage.total_tokens


def test_responses_create_stream_and_chain_as_the_chat_completion(client, model):
    """Greedy, a response's text and usage are those of the chat completion of the same messages, its
    instructions a system message first; include logprobs gives one per output token; it is stored, and reads
    back whole. Streamed: OpenAI's events in OpenAI's order, numbered from 0, which the SDK's stream helper
    accumulates into the same text. A next turn after previous_response_id is the chat completion of the
    whole conversation."""
    messages = [{"role": "system", "content": INSTRUCTIONS}, *_messages(RESPONSES_QUESTION)]
    chat = _chat_answer(client, model, messages, RESPONSES_MAX_TOKENS)
    kwargs = dict(model=model, instructions=INSTRUCTIONS, input=RESPONSES_QUESTION,
                  max_output_tokens=RESPONSES_MAX_TOKENS, temperature=0.0)
    r = client.responses.create(**kwargs, metadata={"k": "v"}, include=["message.output_text.logprobs"],
                                top_logprobs=2)
    assert chat.choices[0].finish_reason == "stop"
    assert r.status == "completed" and r.incomplete_details is None
    assert r.output_text == chat.choices[0].message.content
    u = chat.usage
    assert _usage_counts(r.usage) == (u.prompt_tokens, u.completion_tokens, u.total_tokens)
    (message,) = r.output
    assert message.type == "message" and message.status == "completed" and message.id.startswith("msg_")
    logprobs = message.content[0].logprobs
    assert len(logprobs) == r.usage.output_tokens and all(len(lp.top_logprobs) == 2 for lp in logprobs)
    assert (r.id.startswith("resp_") and r.model == model and r.instructions == INSTRUCTIONS
            and r.metadata == {"k": "v"} and r.store and r.temperature == 0.0)
    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()

    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text == r.output_text and final.status == "completed"
    assert _usage_counts(final.usage) == _usage_counts(r.usage)
    types = [event.type for event in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id
    assert client.responses.retrieve(final.id).output_text == final.output_text  # stored too

    # previous_response_id: the stored input and output come first, so the answer is the chat completion of
    # the whole conversation; the instructions are not carried on (OpenAI's rule).
    second = client.responses.create(model=model, previous_response_id=r.id, input="And 3 + 3?",
                                     max_output_tokens=CHAIN_MAX_TOKENS, temperature=0.0)
    messages = [*_messages(RESPONSES_QUESTION), {"role": "assistant", "content": r.output_text},
                *_messages("And 3 + 3?")]
    chat = _chat_answer(client, model, messages, CHAIN_MAX_TOKENS)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.previous_response_id == r.id and second.instructions is None


def test_responses_cut_short_unstored_and_abandoned(served, client, model):
    """An answer cut by max_output_tokens is incomplete (reason max_output_tokens), streamed or not, and is
    the chat completion's (items as input: developer as system, input_text parts); store false keeps nothing;
    a client that hangs up mid-stream aborts the request."""
    server, url = served
    items = [{"role": "developer", "content": [{"type": "input_text", "text": INSTRUCTIONS}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Name three rivers."}]}]
    cut = client.responses.create(model=model, input=items, max_output_tokens=3, temperature=0.0, store=False)
    chat = _chat_answer(client, model, [{"role": "system", "content": INSTRUCTIONS},
                                        *_messages("Name three rivers.")], 3)
    assert chat.choices[0].finish_reason == "length" and cut.output_text == chat.choices[0].message.content
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output[0].status == "incomplete" and cut.usage.output_tokens == 3
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(cut.id)
    events = list(client.responses.create(model=model, input=items, max_output_tokens=2, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.output[0].status == "incomplete"

    _wait_idle(server)
    before = _metrics(url)
    with client.responses.stream(model=model, input=items, max_output_tokens=DISCONNECT_MAX_TOKENS,
                                 extra_body={"ignore_eos": True}) as stream:
        for _ in zip(range(6), stream):  # a few events, then hang up
            pass
    _wait_idle(server)
    aborted = _vllm("request_success_total", model, finished_reason="abort")
    assert _metrics(url)[aborted] - before[aborted] == 1


@pytest.mark.skipif(importlib.util.find_spec("llguidance") is None, reason="llguidance is not installed")
def test_responses_text_format_json_schema(client, model):
    """text.format json_schema is chat's response_format: the output text is JSON matching the schema."""
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    question = "Describe a person as JSON: name, age and favourite color."
    r = client.responses.create(model=model, input=question, text={"format": fmt}, max_output_tokens=48,
                                temperature=0.0, store=False)
    assert r.status == "completed" and _is_person(r.output_text)
    assert r.text.format.type == "json_schema" and r.text.format.name == "person"


RESPONSES_BAD_REQUESTS = [
    # (fields beside model and input, status, param)
    ({"background": True}, 400, "background"),
    ({"prompt": {"id": "pmpt_1"}}, 400, "prompt"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools"),
    ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, 400, "tools"),
    ({"tools": [WEATHER_TOOL]}, 400, "tool_choice"),  # "auto" needs --enable-auto-tool-choice, as in chat
    ({"tool_choice": "required"}, 400, "tool_choice"),  # no tools
    ({"tool_choice": {"type": "file_search"}}, 400, "tool_choice"),
    ({"include": ["reasoning.encrypted_content"]}, 400, "include"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     400, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, 400, "input"),
    ({"text": {"format": {"type": "xml"}}}, 400, "text"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text"),
    ({"max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"max_output_tokens": 9000}, 400, "max_output_tokens"),  # beyond the context: vLLM's words
    ({"temperature": "hot"}, 400, "temperature"),
    ({"previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
]


@pytest.mark.parametrize("fields,status,param", RESPONSES_BAD_REQUESTS,
                         ids=[f"{i}-{case[2]}" for i, case in enumerate(RESPONSES_BAD_REQUESTS)])
def test_responses_bad_requests_get_openai_errors(served, model, fields, status, param):
    _, url = served
    r = _post(url, "/v1/responses", {"model": model, "input": "Hi", "max_output_tokens": 1, **fields})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error


def test_responses_retrieve_and_cancel_as_vllm(served, client, model):
    """GET and cancel of an unknown id: 404; cancel of a stored (so finished) response: vLLM's 400."""
    _, url = served
    auth = {"Authorization": f"Bearer {API_KEY}"}
    for path in ("/v1/responses/resp_unknown", "/v1/responses/resp_unknown/cancel"):
        call = httpx.get if not path.endswith("cancel") else httpx.post
        r = call(f"{url}{path}", headers=auth)
        assert r.status_code == 404 and "resp_unknown" in r.json()["error"]["message"]
    done = client.responses.create(model=model, input="Hi", max_output_tokens=1)
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
        client.responses.cancel(done.id)
    assert client.responses.retrieve(done.id).status == "incomplete"


# -- embeddings (a pooling model) ---------------------------------------------------------------

EMBED_TEXTS = ["The cat sat on the mat.", "A cat was sitting on a mat.",
               "Quarterly revenue rose by 4 percent.", "Bonjour !"]


@pytest.fixture(scope="module")
def embedding_server():
    """The default model as a pooling model (LAST pooling, normalised) behind an API key, and its engine's
    own embeddings of EMBED_TEXTS, made before the server took the engine."""
    engine = LLMEngine(EngineConfig(runner="pooling", max_num_batched_tokens=16))
    for i, text in enumerate(EMBED_TEXTS):
        engine.add_request(text, request_id=str(i))
    offline = {}
    while engine.has_unfinished_requests():
        offline.update({int(o.request_id): o for o in engine.step()})
    server = OpenAIServer(engine, ServerConfig(api_key=API_KEY, log_level="warning"))
    with BackgroundServer(server) as url:
        yield server, url, [offline[i] for i in range(len(EMBED_TEXTS))]


def test_embeddings_with_the_openai_client(embedding_server):
    """client.embeddings.create as OpenAI's docs use it (base64 on the wire, the client's default), and with
    floats: each input's embedding, in input order, equal to the engine's own; usage counts the prompts."""
    server, url, offline = embedding_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=CLIENT_TIMEOUT_S)
    before = _metrics(url)
    r = client.embeddings.create(model=server.model_name, input=EMBED_TEXTS)
    floats = client.embeddings.create(model=server.model_name, input=EMBED_TEXTS, encoding_format="float")
    after = _metrics(url)
    assert r.object == "list" and r.model == server.model_name and r.id.startswith("embd-")
    for response in (r, floats):
        assert [d.index for d in response.data] == [0, 1, 2, 3]
        assert all(d.object == "embedding" for d in response.data)
        for d, out in zip(response.data, offline):
            assert len(d.embedding) == 576
            torch.testing.assert_close(torch.tensor(d.embedding), out.outputs.data, atol=1e-5, rtol=0)
    num_prompt = sum(len(o.prompt_token_ids) for o in offline)
    assert r.usage.prompt_tokens == r.usage.total_tokens == num_prompt
    vllm = lambda name, **labels: _vllm(name, server.model_name, **labels)
    assert _delta(before, after, vllm("prompt_tokens_total")) == 2 * num_prompt
    assert _delta(before, after, vllm("request_success_total", finished_reason="stop")) == 8
    assert _delta(before, after, vllm("generation_tokens_total")) == 0
    # One input, and inputs as token ids, as OpenAI's API takes them.
    one = client.embeddings.create(model=server.model_name, input=EMBED_TEXTS[2])
    ids = client.embeddings.create(model=server.model_name, input=offline[2].prompt_token_ids)
    batch = client.embeddings.create(model=server.model_name, input=[o.prompt_token_ids for o in offline])
    for response, expected in ((one, [offline[2]]), (ids, [offline[2]]), (batch, offline)):
        got = torch.tensor([d.embedding for d in response.data])
        torch.testing.assert_close(got, torch.stack([o.outputs.data for o in expected]), atol=1e-5, rtol=0)


def test_embeddings_extensions_and_bad_input(embedding_server):
    """vLLM's truncate_prompt_tokens; 400s, OpenAI-style, for what a request cannot have, while the server
    keeps serving; the text endpoints are closed on a pooling model."""
    server, url, offline = embedding_server
    body = {"model": server.model_name, "input": EMBED_TEXTS[0], "encoding_format": "float"}
    cut = _post(url, "/v1/embeddings", {**body, "truncate_prompt_tokens": 3})
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 3
    plain = _post(url, "/v1/embeddings", {**body, "add_special_tokens": False, "normalize": False})
    assert plain.status_code == 200
    vector = torch.tensor(plain.json()["data"][0]["embedding"])
    assert abs(vector.norm().item() - 1) > 1e-3  # not normalised
    torch.testing.assert_close(torch.nn.functional.normalize(vector, dim=-1), offline[0].outputs.data,
                               atol=1e-5, rtol=0)
    cases = [
        ({**body, "dimensions": 8}, "does not support matryoshka representation", "dimensions"),
        # Found by the fuzzer: a 500 until the parameters' own check answered 400.
        ({**body, "dimensions": -3}, "Dimensions must be greater than 0", "dimensions"),
        ({**body, "dimensions": 0}, "Dimensions must be greater than 0", "dimensions"),
        ({**body, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be >= 1 or -1",
         "truncate_prompt_tokens"),  # a 500 too, until the same fix (the fuzzer again)
        ({**body, "input": []}, "input is empty", "input"),
        ({**body, "input": [""]}, "prompt is empty", "input"),
        ({**body, "input": "", "add_special_tokens": False}, "prompt is empty", "input"),
        ({**body, "input": [[1, 2], [10**6]]}, "out of range", "input"),
        ({**body, "input": "word " * 9000}, "maximum context length is 8192 tokens", "input"),
        ({**body, "encoding_format": "bytes"}, "encoding_format", "encoding_format"),
        ({**body, "model": "other"}, "does not exist", "model"),
    ]
    for request, message, param in cases:
        r = _post(url, "/v1/embeddings", request)
        error = r.json()["error"]
        assert r.status_code == (404 if param == "model" else 400), (request, r.text)
        assert message in error["message"] and error["param"] == param, (request, error)
    chat = {"model": server.model_name, "messages": [{"role": "user", "content": "hi"}]}
    for path, body_, api in (("/v1/chat/completions", chat, "Chat Completions API"),
                             ("/v1/completions", {"prompt": "hi"}, "Completions API"),
                             ("/v1/responses", {"input": "hi"}, "Responses API"),
                             ("/classify", {"input": "hi"}, "Classification API")):
        r = _post(url, path, body_)
        assert r.status_code == 400 and f"does not support {api}" in r.json()["error"]["message"]
    assert _post(url, "/v1/embeddings", body).status_code == 200
    assert server.engine.is_alive


def test_generating_model_refuses_embeddings(served, client, model):
    with pytest.raises(openai.BadRequestError, match="does not support Embeddings API"):
        client.embeddings.create(model=model, input="hello")
    r = _post(served[1], "/pooling", {"input": "hello"})
    assert r.status_code == 400 and "does not support Pooling API" in r.json()["error"]["message"]


def test_chat_embeddings_and_the_pooling_endpoint(embedding_server):
    """vLLM's chat form of /v1/embeddings: messages rendered under the model's chat template (no generation
    prompt by default), pooled as that text is; vLLM's /pooling gives the model's pooled output (here the
    embedding) for inputs or messages; 400s for bodies that mix or miss them."""
    server, url, offline = embedding_server
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": EMBED_TEXTS[0]}]
    rendered = server.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    as_text = _post(url, "/v1/embeddings", {"input": rendered, "add_special_tokens": False}).json()
    chat = _post(url, "/v1/embeddings", {"messages": messages})
    assert chat.status_code == 200, chat.text
    assert chat.json()["data"][0]["embedding"] == as_text["data"][0]["embedding"]
    assert chat.json()["usage"]["prompt_tokens"] == as_text["usage"]["prompt_tokens"] > 10
    prompted = _post(url, "/v1/embeddings", {"messages": messages, "add_generation_prompt": True}).json()
    assert prompted["usage"]["prompt_tokens"] > chat.json()["usage"]["prompt_tokens"]
    pooled = _post(url, "/pooling", {"input": EMBED_TEXTS}).json()
    assert pooled["object"] == "list" and pooled["id"].startswith("pool-")
    assert [(d["index"], d["object"]) for d in pooled["data"]] == [(i, "pooling") for i in range(4)]
    for d, o in zip(pooled["data"], offline):
        torch.testing.assert_close(torch.tensor(d["data"]), o.outputs.data, atol=1e-6, rtol=0)
    packed = _post(url, "/pooling", {"input": EMBED_TEXTS[1], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(packed["data"][0]["data"]), dtype="<f4")
    torch.testing.assert_close(torch.from_numpy(decoded.copy()), offline[1].outputs.data, atol=1e-6, rtol=0)
    pooled_chat = _post(url, "/pooling", {"messages": messages}).json()
    assert pooled_chat["data"][0]["data"] == pytest.approx(chat.json()["data"][0]["embedding"], abs=1e-6)
    cases = [
        ({"input": "hi", "messages": messages}, "either input or messages", "input"),
        ({"encoding_format": "float"}, "either input or messages", "input"),
        ({"messages": messages, "add_special_tokens": True}, "add_special_tokens is not supported", None),
        ({"input": "hi", "chat_template": "{{ 1 }}"}, "applies to messages only", "chat_template"),
        ({"messages": messages, "continue_final_message": True, "add_generation_prompt": True},
         "cannot both be true", "continue_final_message"),
    ]
    for path in ("/v1/embeddings", "/pooling"):
        for body, message, param in cases:
            r = _post(url, path, body)
            error = r.json()["error"]
            assert r.status_code == 400 and message in error["message"], (path, body, r.text)
            assert param is None or error["param"] == param, (path, body, error)
    assert server.engine.is_alive



def test_score_and_rerank(embedding_server):
    """vLLM's /score and the Jina / Cohere /rerank it serves (also at /v1/rerank, /v2/rerank), on an
    embedding model: cosine similarities of the engine's own embeddings, documents best first, top_n."""
    server, url, offline = embedding_server
    vectors = [o.outputs.data for o in offline]
    cosine = lambda i, j: torch.nn.functional.cosine_similarity(vectors[i], vectors[j], dim=0).item()  # noqa: E731
    r = _post(url, "/score", {"text_1": EMBED_TEXTS[0], "text_2": EMBED_TEXTS[1:]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and [d["object"] for d in body["data"]] == ["score"] * 3
    assert [d["score"] for d in body["data"]] == pytest.approx([cosine(0, j) for j in (1, 2, 3)], abs=1e-5)
    assert body["usage"]["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in offline)
    pairs = _post(url, "/v1/score", {"text_1": EMBED_TEXTS[:2], "text_2": EMBED_TEXTS[2:]}).json()
    assert [d["score"] for d in pairs["data"]] == pytest.approx([cosine(0, 2), cosine(1, 3)], abs=1e-5)
    query, documents = EMBED_TEXTS[0], EMBED_TEXTS[1:]
    want = sorted(((cosine(0, j + 1), j) for j in range(3)), reverse=True)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        ranked = _post(url, path, {"query": query, "documents": documents, "top_n": 2}).json()
        assert [(x["index"], x["document"]["text"]) for x in ranked["results"]] == [
            (j, documents[j]) for _, j in want[:2]]
        assert [x["relevance_score"] for x in ranked["results"]] == pytest.approx([s for s, _ in want[:2]],
                                                                                  abs=1e-5)
    everything = _post(url, "/rerank", {"query": query, "documents": documents}).json()
    assert len(everything["results"]) == 3 and everything["usage"]["total_tokens"] > 0
    bad = _post(url, "/score", {"text_1": EMBED_TEXTS[:2], "text_2": EMBED_TEXTS[:3]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_2"
    assert _post(url, "/rerank", {"query": query, "documents": []}).status_code == 400
