"""`plait bench serve`: a streaming load generator for any OpenAI-compatible server, with vLLM's metrics.

Requests stream (SSE, parsed here: no OpenAI SDK) from /v1/completions or /v1/chat/completions with
``stream_options.include_usage``, so token counts are the server's own. A chunk carries a token when it
has a choice; for chat, the choice must also carry content or a finish reason, because servers send an
opening role-only chunk that may leave before any token exists. See plait.bench.metrics for the metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from plait.bench.datasets import (
    W5_OUTPUT_LENS,
    W5_PROMPT_MIX,
    LengthRange,
    SampleRequest,
    file_requests,
    parse_image_size,
    random_requests,
    read_sharegpt,
    sharegpt_requests,
    token_counter,
    with_random_images,
)
from plait.bench.metrics import (
    DEFAULT_PERCENTILES,
    RequestResult,
    calculate_metrics,
    parse_goodput,
    percentile_key,
)
from plait.bench.shared import write_json

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
DATASETS = ("random", "file", "sharegpt")
# vLLM's --backend names of the OpenAI-compatible endpoints, and its random dataset's default lengths.
BACKEND_ENDPOINTS = {"vllm": "completions", "openai": "completions", "openai-chat": "chat"}
VLLM_RANDOM_INPUT_LEN = 1024
VLLM_RANDOM_OUTPUT_LEN = 128
ARRIVALS = ("poisson", "fixed")
API_KEY_ENVS = ("OPENAI_API_KEY", "PLAIT_API_KEY")
DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_NUM_PROMPTS = 200  # W5's count
# Random token ids must fit the served model's vocabulary, which the API does not report; 32,000 fits
# every common family (Llama 2 has exactly that many).
DEFAULT_VOCAB_SIZE = 32000
DEFAULT_TIMEOUT_S = 6 * 3600.0  # vLLM's client limit: no benchmark request should take longer
CONNECT_TIMEOUT_S = 30.0
READY_POLL_S = 1.0  # how often --ready-check-timeout-sec asks a server that is not up yet
HEALTH_PROBE_TIMEOUT_S = 5.0  # one GET /health of is_healthy
MAX_ERROR_CHARS = 500
SSE_DATA = "data:"
SSE_DONE = "[DONE]"


@dataclass
class ServeBenchConfig:
    """How to send the requests."""

    base_url: str = DEFAULT_BASE_URL
    endpoint_type: str = "completions"
    model: str | None = None  # None: the first model the server lists
    api_key: str | None = None
    request_rate: float = math.inf  # requests per second; inf = all at once
    arrival: str = "poisson"  # gaps between requests: "poisson" (seeded) or "fixed"
    # vLLM's --burstiness: Poisson gaps become gamma-distributed with this shape (same mean); 1 is Poisson,
    # below 1 burstier, above 1 more even.
    burstiness: float = 1.0
    seed: int = 0
    max_concurrency: int | None = None  # at most this many requests in flight
    ignore_eos: bool = True  # so every request generates exactly its output length
    temperature: float = 0.0
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    goodput: dict[str, float] = field(default_factory=dict)  # SLOs in ms, e.g. {"ttft": 1000}
    num_warmups: int = 0  # requests sent (and not measured) before the timed run
    # vLLM's --profile: the server's torch profiler (POST /start_profile, /stop_profile) runs around the timed
    # run; the server writes the trace (it needs VLLM_TORCH_PROFILER_DIR or PLAIT_TORCH_PROFILER_DIR set).
    profile: bool = False
    # vLLM's --ready-check-timeout-sec: wait up to this long for the server to list its models before the run
    # (a server still loading); 0: it must answer at once.
    ready_timeout_s: float = 0.0
    show_progress: bool = True
    timeout_s: float = DEFAULT_TIMEOUT_S
    # vLLM's --request-id-prefix: timed request i is sent with X-Request-Id <prefix><i>, so the server's ids
    # and log lines name it (a fresh "bench-<8 hex>-" per run, as vLLM's); None or "": no header.
    request_id_prefix: str | None = field(default_factory=lambda: f"bench-{uuid.uuid4().hex[:8]}-")

    def __post_init__(self) -> None:
        if self.endpoint_type not in ENDPOINT_PATHS:
            raise ValueError(f"endpoint type must be one of {sorted(ENDPOINT_PATHS)}, "
                             f"got {self.endpoint_type!r}")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {ARRIVALS}, got {self.arrival!r}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be positive, got {self.burstiness}")
        if self.burstiness != 1.0 and self.arrival != "poisson":
            raise ValueError("burstiness shapes Poisson arrivals: it needs arrival 'poisson'")
        if not self.request_rate > 0:
            raise ValueError(f"request rate must be positive (inf = all at once), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max concurrency must be >= 1, got {self.max_concurrency}")
        if self.num_warmups < 0:
            raise ValueError(f"the number of warm-up requests must be >= 0, got {self.num_warmups}")
        self.base_url = self.base_url.rstrip("/")


# The result's lists of one entry per request: kept only with --save-detailed, as vLLM's bench keeps them
# (a run of 2,000 streams writes ~6.6 MB of them, its metrics a few KB).
PER_REQUEST_FIELDS = ("input_lens", "output_lens", "start_times", "ttfts", "latencies", "itls", "errors",
                      "response_ids")


@dataclass
class ServeBenchRun:
    """A finished run: what was asked, what each request saw, and the metrics."""

    config: ServeBenchConfig
    model: str
    results: list[RequestResult]  # start times relative to the run's start
    metrics: dict[str, Any]
    trace: str | None = None  # with profile: the server's trace file, as it named it

    def to_json(self, detailed: bool = True) -> dict[str, Any]:
        """vLLM's result layout: settings, the metrics, then (``detailed``) per-request lists."""
        c = self.config
        result = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "base_url": c.base_url, "endpoint_type": c.endpoint_type, "model": self.model,
            "num_prompts": len(self.results),
            "request_rate": "inf" if math.isinf(c.request_rate) else c.request_rate,
            "arrival": c.arrival, "burstiness": c.burstiness, "seed": c.seed,
            "max_concurrency": c.max_concurrency,
            "ignore_eos": c.ignore_eos, "goodput_slos_ms": c.goodput, "percentiles": list(c.percentiles),
            **self.metrics,
            "input_lens": [r.prompt_len for r in self.results],
            "output_lens": [r.num_output_tokens for r in self.results],
            "start_times": [r.start_time for r in self.results],
            "ttfts": [r.ttft for r in self.results],
            "latencies": [r.latency for r in self.results],
            "itls": [r.itl for r in self.results],
            "errors": [r.error for r in self.results],
            "request_id_prefix": c.request_id_prefix,
            "response_ids": [r.response_id for r in self.results],
        }
        if not detailed:
            for field in PER_REQUEST_FIELDS:
                del result[field]
        return result


def arrival_offsets(n: int, rate: float, arrival: str, seed: int, burstiness: float = 1.0) -> list[float]:
    """When each request is sent, in seconds after the start, as `vllm bench serve` schedules them.

    Each request waits one gap (1/rate, or exponential with mean 1/rate for Poisson; gamma of shape
    ``burstiness`` with that mean where it is not 1) after the one before it. Random gaps are then scaled so
    the last request goes at n / rate, as vLLM does, so throughput does not move with the seed's luck.
    """
    if math.isinf(rate):
        return [0.0] * n
    if arrival == "fixed":
        return [(i + 1) / rate for i in range(n)]
    rng = np.random.default_rng(seed)
    gaps = (rng.exponential(1.0 / rate, size=n) if burstiness == 1.0
            else rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n))
    offsets = np.cumsum(gaps)
    return (offsets * (n / rate / offsets[-1])).tolist()


def build_payload(sample: SampleRequest, config: ServeBenchConfig, model: str) -> dict[str, Any]:
    """The JSON body of one streamed request."""
    payload: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                               "temperature": config.temperature}
    if config.ignore_eos:
        payload["ignore_eos"] = True  # vLLM extension, which plait honours
    if config.endpoint_type == "completions":
        if sample.images:
            raise ValueError("images go with chat requests: use --endpoint-type chat")
        payload.update(prompt=sample.prompt, max_tokens=sample.output_len)
    else:
        if not isinstance(sample.prompt, str):
            raise ValueError("chat requests need text prompts: random token ids go to "
                             "--endpoint-type completions")
        content: str | list[dict[str, Any]] = sample.prompt
        if sample.images:
            content = [*({"type": "image_url", "image_url": {"url": url}} for url in sample.images),
                       {"type": "text", "text": sample.prompt}]
        payload.update(messages=[{"role": "user", "content": content}],
                       max_completion_tokens=sample.output_len)
    return payload


def _sse_data(line: str) -> str | None:
    """The payload of an SSE data line; None for comments, other fields and blank lines."""
    if not line.startswith(SSE_DATA):
        return None
    return line[len(SSE_DATA):].strip()


def _is_token_chunk(event: dict[str, Any], endpoint_type: str) -> bool:
    choices = event.get("choices")
    if not choices:
        return False  # e.g. the closing usage chunk
    if endpoint_type == "completions":
        return True  # the text may be empty (a special token) and it is still a token
    choice = choices[0]
    delta = choice.get("delta") or {}
    return bool(delta.get("content")) or choice.get("finish_reason") is not None


async def send_request(client: Any, url: str, payload: dict[str, Any], headers: dict[str, str],
                       endpoint_type: str, prompt_len: int | None) -> RequestResult:
    """Send one streamed request and time its token chunks (start_time on time.perf_counter's clock)."""
    result = RequestResult(prompt_len=prompt_len or 0)
    start = last = time.perf_counter()
    result.start_time = start
    got_token = False
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:MAX_ERROR_CHARS]}"
                return result
            async for line in response.aiter_lines():
                data = _sse_data(line)
                if not data:
                    continue
                if data == SSE_DONE:
                    break
                now = time.perf_counter()
                event = json.loads(data)
                if result.response_id is None and isinstance(event.get("id"), str):
                    result.response_id = event["id"]
                if "error" in event:
                    result.error = f"server error mid-stream: {json.dumps(event['error'])[:MAX_ERROR_CHARS]}"
                    return result
                if _is_token_chunk(event, endpoint_type):
                    if got_token:
                        result.itl.append(now - last)
                    else:
                        result.ttft = now - start
                        got_token = True
                    last = now
                usage = event.get("usage")
                if usage:
                    result.output_tokens = int(usage.get("completion_tokens") or 0)
                    if usage.get("prompt_tokens") is not None:
                        result.prompt_len = int(usage["prompt_tokens"])
    except Exception as err:  # any failure is this request's, recorded, and never ends the run
        result.error = f"{type(err).__name__}: {err}"[:MAX_ERROR_CHARS]
        return result
    if not got_token:
        result.error = "the stream ended without a token chunk"
        return result
    result.success = True
    result.latency = last - start
    return result


def _headers(config: ServeBenchConfig) -> dict[str, str]:
    key = config.api_key
    if key is None:
        key = next((os.environ[k] for k in API_KEY_ENVS if os.environ.get(k)), None)
    return {"Authorization": f"Bearer {key}"} if key else {}


def is_healthy(base_url: str, timeout_s: float = HEALTH_PROBE_TIMEOUT_S) -> bool:
    """Whether the server at ``base_url`` answers GET /health with 200 now (no answer: not healthy)."""
    import httpx

    try:
        return httpx.get(f"{base_url}/health", timeout=timeout_s, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(base_url: str, limit_s: float, poll_s: float = 1.0,
                 probe_timeout_s: float = HEALTH_PROBE_TIMEOUT_S) -> bool:
    """Poll /health every ``poll_s`` until it answers 200 (True) or ``limit_s`` has passed (False): the wait
    of scripts that start a server and then load it."""
    deadline = time.monotonic() + limit_s
    while not is_healthy(base_url, probe_timeout_s):
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


async def first_model(client: Any, base_url: str, headers: dict[str, str]) -> str:
    """The id of the first model the server lists at /v1/models."""
    import httpx

    try:
        response = await client.get(f"{base_url}/v1/models", headers=headers)
    except httpx.HTTPError as err:
        raise ValueError(f"cannot reach the server at {base_url}: {type(err).__name__}: {err}") from err
    if response.status_code != 200:
        raise ValueError(f"{base_url}/v1/models answered {response.status_code}: "
                         f"{response.text[:MAX_ERROR_CHARS]}")
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"the server at {base_url} lists no models")
    return models[0]["id"]


async def run_benchmark(samples: Sequence[SampleRequest], config: ServeBenchConfig) -> ServeBenchRun:
    """Send every sample on the configured arrival schedule; measure them all."""
    try:
        import httpx
    except ImportError as err:
        raise ValueError(f"`plait bench serve` needs httpx: pip install 'plait[bench]' ({err})") from err
    if not samples:
        raise ValueError("there are no requests to send")
    headers = _headers(config)
    # No pool limit without --max-concurrency: a request waiting for a connection would count the
    # wait in its TTFT.
    limits = httpx.Limits(max_connections=config.max_concurrency,
                          max_keepalive_connections=config.max_concurrency)
    timeout = httpx.Timeout(config.timeout_s, connect=CONNECT_TIMEOUT_S)
    # trust_env=False: no proxy from the environment stands between the benchmark and the server.
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        listed = await _ready(client, config, headers)
        model = config.model or listed
        url = config.base_url + ENDPOINT_PATHS[config.endpoint_type]
        payloads = [build_payload(s, config, model) for s in samples]
        for _ in range(config.num_warmups):
            warm = await send_request(client, url, payloads[0], headers, config.endpoint_type, None)
            if not warm.success:
                raise ValueError(f"the warm-up request failed: {warm.error}")
        if config.profile:
            await _profiler(client, config.base_url, headers, "start")
        results, duration = await _timed_run(client, url, headers, samples, payloads, config)
        trace = await _profiler(client, config.base_url, headers, "stop") if config.profile else None
    metrics = calculate_metrics(results, duration, config.percentiles, config.goodput or None)
    return ServeBenchRun(config, model, results, metrics, trace)


async def _ready(client: Any, config: ServeBenchConfig, headers: dict[str, str]) -> str:
    """The server's first model, once it lists one: at once, or within config.ready_timeout_s."""
    deadline = time.monotonic() + config.ready_timeout_s
    while True:
        try:
            return await first_model(client, config.base_url, headers)
        except ValueError:
            if time.monotonic() >= deadline:
                raise
        await asyncio.sleep(READY_POLL_S)


async def _profiler(client: Any, base_url: str, headers: dict[str, str], verb: str) -> str | None:
    """POST /start_profile or /stop_profile; what the server says of the trace it wrote (None if nothing)."""
    response = await client.post(f"{base_url}/{verb}_profile", headers=headers)
    if response.status_code != 200:
        hint = (" (the server profiles only where VLLM_TORCH_PROFILER_DIR or PLAIT_TORCH_PROFILER_DIR is set)"
                if response.status_code == 404 else "")
        raise ValueError(f"--profile: POST /{verb}_profile answered {response.status_code}{hint}: "
                         f"{response.text[:MAX_ERROR_CHARS]}")
    try:
        return response.json().get("trace")
    except ValueError:
        return None  # vLLM's server answers with no body


async def _timed_run(client: Any, url: str, headers: dict[str, str], samples: Sequence[SampleRequest],
                     payloads: list[dict[str, Any]], config: ServeBenchConfig
                     ) -> tuple[list[RequestResult], float]:
    offsets = arrival_offsets(len(samples), config.request_rate, config.arrival, config.seed,
                              config.burstiness)
    gate = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    prefix = config.request_id_prefix
    progress = tqdm(total=len(samples), desc="requests", unit="req", disable=not config.show_progress)
    t0 = time.perf_counter()

    async def one(i: int) -> RequestResult:
        delay = t0 + offsets[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        mine = {**headers, "X-Request-Id": f"{prefix}{i}"} if prefix else headers
        if gate is None:
            result = await send_request(client, url, payloads[i], mine, config.endpoint_type,
                                        samples[i].prompt_len)
        else:
            async with gate:  # the clock starts once the request is really sent, as in vLLM
                result = await send_request(client, url, payloads[i], mine, config.endpoint_type,
                                            samples[i].prompt_len)
        progress.update(1)
        return result

    try:
        results = list(await asyncio.gather(*(one(i) for i in range(len(samples)))))
    finally:
        progress.close()
    duration = time.perf_counter() - t0
    for r in results:
        r.start_time -= t0
    return results, duration


def summary_text(run: ServeBenchRun) -> str:
    """The run's metrics as a `vllm bench serve`-style table."""
    m = run.metrics
    lines = ["============ Serving Benchmark Result ============"]

    def row(label: str, value: Any, fmt: str = "{:<10.2f}") -> None:
        lines.append(f"{label:<40}" + (fmt.format(value) if value is not None else "-"))

    row("Successful requests:", m["completed"], "{:<10}")
    row("Failed requests:", m["failed"], "{:<10}")
    row("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input_tokens"], "{:<10}")
    row("Total generated tokens:", m["total_output_tokens"], "{:<10}")
    row("Request throughput (req/s):", m["request_throughput"])
    if run.config.goodput:
        row("Request goodput (req/s):", m["request_goodput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Peak output token throughput (tok/s):", m["max_output_tokens_per_s"])
    row("Peak concurrent requests:", m["max_concurrent_requests"], "{:<10}")
    row("Total token throughput (tok/s):", m["total_token_throughput"])
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for name, title in titles.items():
        lines.append(f"{title:-^50}")
        row(f"Mean {name.upper()} (ms):", m[f"mean_{name}_ms"])
        row(f"Median {name.upper()} (ms):", m[f"median_{name}_ms"])
        for p in run.config.percentiles:
            key = percentile_key(p)
            row(f"{key.upper()} {name.upper()} (ms):", m[f"{key}_{name}_ms"])
    lines.append("=" * 50)
    return "\n".join(lines)


# -- the command ----------------------------------------------------------------------------------


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `plait bench serve`."""
    p = subparsers.add_parser("serve", help="load-test an OpenAI-compatible server (vLLM's metrics)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help=f"(default: {DEFAULT_BASE_URL}, or --host and --port)")
    p.add_argument("--endpoint-type", choices=sorted(ENDPOINT_PATHS), default=None,
                   help="(default: completions, or what --endpoint or --backend names)")
    vllm = p.add_argument_group("vLLM's names (so `vllm bench serve` command lines run as they are)")
    vllm.add_argument("--host", default=None, help="with --port, the server when --base-url is not given")
    vllm.add_argument("--port", type=int, default=None)
    vllm.add_argument("--endpoint", choices=sorted(ENDPOINT_PATHS.values()), default=None,
                      help="the API path: /v1/completions or /v1/chat/completions")
    vllm.add_argument("--backend", choices=sorted(BACKEND_ENDPOINTS), default=None,
                      help="vllm / openai: completions; openai-chat: chat completions")
    vllm.add_argument("--random-input-len", type=int, default=None,
                      help=f"random prompts of this many tokens (vLLM's default {VLLM_RANDOM_INPUT_LEN}) ...")
    vllm.add_argument("--random-output-len", type=int, default=None,
                      help=f"... asking for this many (vLLM's default {VLLM_RANDOM_OUTPUT_LEN}) ...")
    vllm.add_argument("--random-range-ratio", type=float, default=None,
                      help="... each uniform within this ratio of it (vLLM's default 0: exactly)")
    vllm.add_argument("--random-prefix-len", type=int, default=0,
                      help="random prompts all start with the same this many random tokens (default: 0)")
    vllm.add_argument("--burstiness", type=float, default=1.0,
                      help="Poisson gaps drawn from a gamma of this shape (1: Poisson, < 1 burstier)")
    vllm.add_argument("--metric-percentiles", default=None, help="as --percentiles (vLLM's default: 99)")
    vllm.add_argument("--percentile-metrics", default=None,
                      help="accepted: every metric's percentiles are reported (ttft, tpot, itl, e2el)")
    vllm.add_argument("--ready-check-timeout-sec", type=float, default=0.0,
                      help="wait up to this long for the server to come up (vLLM waits 600 by default; "
                           "plait's bench fails at once)")
    vllm.add_argument("--save-result", action="store_true", help="write the result JSON into --result-dir")
    vllm.add_argument("--result-dir", default=".", help="(default: the current directory)")
    vllm.add_argument("--result-filename", default=None,
                      help="(default: plait-<rate>qps-<model>-<time>.json)")
    vllm.add_argument("--save-detailed", action="store_true",
                      help="the result JSON keeps each request's lengths, TTFT, latency, ITLs, error and "
                           "response id (default: only the settings and metrics, as vLLM's)")
    vllm.add_argument("--ignore-eos", dest="ignore_eos", action="store_true", default=True,
                      help="accepted: plait's bench ignores EOS by default (--no-ignore-eos: they may stop)")
    p.add_argument("--model", default=None, help="model name to send (default: the first the server lists)")
    p.add_argument("--api-key", default=None, help=f"(default: ${' or $'.join(API_KEY_ENVS)})")
    data = p.add_argument_group("requests")
    data.add_argument("--dataset", "--dataset-name", choices=DATASETS, default="random",
                      help="random token ids (as text for chat), --dataset-path's prompts, or ShareGPT "
                           "conversations sampled as vLLM's bench does (counted by the server's /tokenize)")
    data.add_argument("--dataset-path", default=None,
                      help="file: one prompt per line, or .jsonl with a \"prompt\" field; sharegpt: the JSON "
                           "(e.g. ShareGPT_V3_unfiltered_cleaned_split.json)")
    data.add_argument("--tokenizer", default=None,
                      help="sharegpt: count tokens with this tokenizer (an HF folder or a GGUF file), not "
                           "with the server's /tokenize")
    data.add_argument("--sharegpt-output-len", type=int, default=None,
                      help="sharegpt: ask every request for this many tokens (default: its answer's length)")
    data.add_argument("--num-prompts", type=int, default=None,
                      help=f"(default: {DEFAULT_NUM_PROMPTS} random, or every prompt of the file once)")
    data.add_argument("--prompt-mix", default=None,
                      help=f"random prompt lengths, WEIGHT:LOW-HIGH,... (default: W5's {W5_PROMPT_MIX})")
    data.add_argument("--output-len", default=None,
                      help=f"output tokens per request, N or LOW-HIGH (default: W5's {W5_OUTPUT_LENS})")
    data.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                      help=f"random token ids are drawn below this (default: {DEFAULT_VOCAB_SIZE})")
    data.add_argument("--images-per-prompt", type=int, default=0,
                      help="random images sent with each chat prompt, a new one each (default: 0)")
    data.add_argument("--image-size", default="336x336", help="their WIDTHxHEIGHT (default: 336x336)")
    data.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                      help="let requests stop at EOS (default: ignore it, so output lengths are exact)")
    data.add_argument("--temperature", type=float, default=0.0)
    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=math.inf,
                      help="requests/s (default: inf, all at once)")
    load.add_argument("--arrival", choices=ARRIVALS, default="poisson", help="gaps between requests")
    load.add_argument("--seed", type=int, default=0, help="seed of the prompts and the Poisson gaps")
    load.add_argument("--max-concurrency", type=int, default=None)
    load.add_argument("--num-warmups", type=int, default=0, help="unmeasured requests sent first")
    load.add_argument("--request-id-prefix", default=None,
                      help="as vLLM's: request i is sent with X-Request-Id PREFIX<i> (default: a fresh "
                           "'bench-<8 hex>-'; '' sends none)")
    load.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="per-request limit, seconds")
    load.add_argument("--profile", action="store_true",
                      help="run the server's torch profiler around the timed run (as vLLM's; the server "
                           "needs VLLM_TORCH_PROFILER_DIR or PLAIT_TORCH_PROFILER_DIR)")
    out = p.add_argument_group("results")
    out.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                     help="SLOs for goodput, e.g. --goodput ttft:1000 tpot:50 (names: ttft, tpot, e2el)")
    out.add_argument("--percentiles", default=None,
                     help="comma-separated, besides the median (default: 90,99)")
    out.add_argument("--result-file", default=None, help="write the result JSON here")
    out.add_argument("--plot", default=None, metavar="DIR", help="write PNGs here (needs matplotlib)")
    out.add_argument("--disable-tqdm", action="store_true")
    p.set_defaults(func=main)
    return p


def parse_percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"percentiles {text!r} must be comma-separated numbers") from None
    if not values or not all(0 <= v <= 100 for v in values):
        raise ValueError(f"percentiles {text!r} must be numbers in [0, 100]")
    return values


def resolve_vllm_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fold vLLM's names into plait's (in place): the server from --host/--port, the endpoint type from
    --endpoint or --backend, random lengths from --random-*-len and --random-range-ratio, percentiles from
    --metric-percentiles. Where both spellings are given they must agree or it is an error."""
    if args.base_url is None:
        if args.host is not None and args.port is None:
            raise ValueError("--host needs --port (or give --base-url)")
        args.base_url = (f"http://{args.host or '127.0.0.1'}:{args.port}" if args.port is not None
                         else DEFAULT_BASE_URL)
    elif args.host is not None or args.port is not None:
        raise ValueError("give --base-url or --host/--port, not both")
    named = {name for name in (
        args.endpoint_type,
        {path: kind for kind, path in ENDPOINT_PATHS.items()}.get(args.endpoint),
        BACKEND_ENDPOINTS.get(args.backend)) if name is not None}
    if len(named) > 1:
        raise ValueError(f"--endpoint-type, --endpoint and --backend name different endpoints: "
                         f"{sorted(named)}")
    args.endpoint_type = named.pop() if named else "completions"
    if {args.random_input_len, args.random_output_len, args.random_range_ratio} != {None}:
        if args.prompt_mix is not None or args.output_len is not None:
            raise ValueError("give --random-input-len/--random-output-len or --prompt-mix/--output-len, "
                             "not both")
        ratio = 0.0 if args.random_range_ratio is None else args.random_range_ratio
        inputs = LengthRange.around(args.random_input_len or VLLM_RANDOM_INPUT_LEN, ratio)
        args.prompt_mix = f"1:{inputs}"
        args.output_len = str(LengthRange.around(args.random_output_len or VLLM_RANDOM_OUTPUT_LEN, ratio))
    args.prompt_mix = args.prompt_mix or W5_PROMPT_MIX
    args.output_len = args.output_len or W5_OUTPUT_LENS
    if args.percentiles is not None and args.metric_percentiles is not None:
        raise ValueError("give --percentiles or --metric-percentiles, not both")
    args.percentiles = (args.percentiles or args.metric_percentiles
                        or ",".join(f"{p:g}" for p in DEFAULT_PERCENTILES))
    if args.percentile_metrics is not None:
        unknown = {m.strip() for m in args.percentile_metrics.split(",")} - {"ttft", "tpot", "itl", "e2el"}
        if unknown:
            raise ValueError(f"--percentile-metrics: unknown metrics {sorted(unknown)}")
    return args


def result_path(args: argparse.Namespace, model: str) -> Path | None:
    """Where the result JSON goes: --result-file, or with --save-result --result-dir's
    --result-filename (default: plait-<rate>qps-<model>-<time>.json, after vLLM's)."""
    if args.result_file:
        return Path(args.result_file)
    if not args.save_result:
        return None
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    name = args.result_filename or f"plait-{rate}qps-{Path(model).name}-{stamp}.json"
    return Path(args.result_dir) / name


def config_from_args(args: argparse.Namespace) -> ServeBenchConfig:
    resolve_vllm_args(args)
    return ServeBenchConfig(
        base_url=args.base_url, endpoint_type=args.endpoint_type, model=args.model, api_key=args.api_key,
        request_rate=args.request_rate, arrival=args.arrival, seed=args.seed, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos, temperature=args.temperature,
        percentiles=parse_percentiles(args.percentiles), goodput=parse_goodput(args.goodput),
        num_warmups=args.num_warmups, show_progress=not args.disable_tqdm, timeout_s=args.timeout,
        profile=args.profile, ready_timeout_s=args.ready_check_timeout_sec,
        **({"request_id_prefix": args.request_id_prefix} if args.request_id_prefix is not None else {}))


def _local_tokenizer(tokenizer_path: str) -> Any:
    from plait.loader.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_path)
    if tokenizer is None:
        raise ValueError(f"--tokenizer {tokenizer_path}: the folder holds no tokenizer")
    return tokenizer


def local_token_counter(tokenizer_path: str) -> Callable[[list[str]], list[int]]:
    """Counts texts' tokens with a tokenizer read here (an HF folder or a GGUF file, as vLLM's bench takes
    --tokenizer), for servers without /tokenize; special tokens added, as a completion's prompt gets them."""
    return token_counter(_local_tokenizer(tokenizer_path))


def local_detokenizer(tokenizer_path: str) -> Callable[[list[list[int]]], list[str]]:
    """Token ids to text with a tokenizer read here (random prompts sent to chat completions)."""
    tokenizer = _local_tokenizer(tokenizer_path)
    return lambda batch: [tokenizer.decode(ids) for ids in batch]


def _server_tokenizer_call(config: ServeBenchConfig, path: str, field: str, what: str
                           ) -> Callable[[list[Any]], list[Any]]:
    """A function of a batch: each item POSTed to the server's ``path`` (/tokenize or /detokenize, vLLM's and
    plait's) with the served model, the answer's ``field`` kept; ``what`` says in errors why it was asked."""
    import httpx

    headers = _headers(config)
    model = config.model or asyncio.run(_listed_model(config, headers))
    timeout = httpx.Timeout(config.timeout_s, connect=CONNECT_TIMEOUT_S)
    key = "prompt" if path == "/tokenize" else "tokens"

    def call(batch: list[Any]) -> list[Any]:
        answers = []
        with httpx.Client(timeout=timeout, trust_env=False) as client:
            for item in batch:
                response = client.post(f"{config.base_url}{path}", json={"model": model, key: item},
                                       headers=headers)
                if response.status_code != 200:
                    raise ValueError(f"{what} with the server's {path}, which answered "
                                     f"{response.status_code} (or give --tokenizer): "
                                     f"{response.text[:MAX_ERROR_CHARS]}")
                answers.append(response.json()[field])
        return answers

    return call


def server_detokenizer(config: ServeBenchConfig) -> Callable[[list[list[int]]], list[str]]:
    """Token ids to text with the served model's tokenizer, through the server's /detokenize: random prompts
    sent to chat completions, which takes text only."""
    return _server_tokenizer_call(config, "/detokenize", "prompt", "random prompts for chat are made text")


def server_token_counter(config: ServeBenchConfig) -> Callable[[list[str]], list[int]]:
    """Counts texts' tokens with the served model's tokenizer, through the server's /tokenize, so the load
    generator needs no tokenizer of its own."""
    return _server_tokenizer_call(config, "/tokenize", "count", "--dataset sharegpt counts tokens")


async def _listed_model(config: ServeBenchConfig, headers: dict[str, str]) -> str:
    import httpx

    async with httpx.AsyncClient(trust_env=False, timeout=CONNECT_TIMEOUT_S) as probe:
        return await first_model(probe, config.base_url, headers)


def samples_from_args(args: argparse.Namespace, config: ServeBenchConfig | None = None
                      ) -> list[SampleRequest]:
    """The requests to send, from ``args`` as config_from_args resolved them (vLLM's names folded in, the
    defaults set); ``config`` (the server to ask) is needed for --dataset sharegpt."""
    if args.sharegpt_output_len is not None and args.dataset != "sharegpt":
        raise ValueError("--sharegpt-output-len is for --dataset sharegpt")
    chat = args.endpoint_type == "chat"
    if args.tokenizer is not None and not (args.dataset == "sharegpt" or (args.dataset == "random" and chat)):
        raise ValueError("--tokenizer is for --dataset sharegpt, or random prompts sent to chat completions")
    if args.random_prefix_len and args.dataset != "random":
        raise ValueError("--random-prefix-len is for --dataset random")
    if args.dataset in ("file", "sharegpt") and not args.dataset_path:
        raise ValueError(f"--dataset {args.dataset} needs --dataset-path")
    if args.dataset == "file":
        samples = file_requests(args.dataset_path, args.num_prompts, args.output_len, args.seed)
    elif args.dataset == "sharegpt":
        if config is None:
            raise ValueError("--dataset sharegpt needs the server, to count tokens")
        n = DEFAULT_NUM_PROMPTS if args.num_prompts is None else args.num_prompts
        count = local_token_counter(args.tokenizer) if args.tokenizer else server_token_counter(config)
        pairs = read_sharegpt(args.dataset_path)
        samples = sharegpt_requests(pairs, n, args.seed, count, args.sharegpt_output_len)
    else:
        if args.dataset_path:
            raise ValueError("--dataset-path is for --dataset file or sharegpt")
        n = DEFAULT_NUM_PROMPTS if args.num_prompts is None else args.num_prompts
        samples = random_requests(n, args.vocab_size, args.seed, args.prompt_mix, args.output_len,
                                  args.random_prefix_len)
        if chat:  # chat takes text: the random ids as the served model's tokenizer reads them, as vLLM does
            if config is None and args.tokenizer is None:
                raise ValueError("random prompts for chat need the server (or --tokenizer) to make them text")
            texts = (local_detokenizer(args.tokenizer) if args.tokenizer else server_detokenizer(config))(
                [s.prompt for s in samples])
            samples = [dataclasses.replace(s, prompt=t, prompt_len=None) for s, t in zip(samples, texts)]
    if args.images_per_prompt:
        if args.endpoint_type != "chat":
            raise ValueError("--images-per-prompt sends images with chat requests: use --endpoint-type chat")
        samples = with_random_images(samples, args.images_per_prompt, parse_image_size(args.image_size),
                                     args.seed)
    return samples


def main(args: argparse.Namespace) -> int:
    """Run `plait bench serve`; exit status 1 when any request failed."""
    config = config_from_args(args)
    samples = samples_from_args(args, config)
    run = asyncio.run(run_benchmark(samples, config))
    print(summary_text(run))
    if run.trace:
        print(f"server trace: {run.trace}")
    for error in sorted({r.error for r in run.results if r.error})[:10]:
        print(f"failed: {error}", file=sys.stderr)
    path = result_path(args, run.model)
    if path is not None:
        print(f"result: {write_json(path, run.to_json(detailed=args.save_detailed))}")
    if args.plot:
        from plait.bench.plots import plot_serve

        for path in plot_serve(run.results, args.plot):
            print(f"plot: {path}")
    return 0 if run.metrics["failed"] == 0 else 1
