"""plait bench: vLLM's serving metrics on hand-made timings, `plait bench serve` against a live server (its
counts equal the server's /metrics), a tiny W4 under both policies, the step timeline, the W5 sweep."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from plait.bench.datasets import LengthRange, file_requests, parse_mix, random_requests
from plait.bench.metrics import RequestResult, calculate_metrics, parse_goodput, peak_output_rate, summarize
from plait.bench.serve_client import (
    PER_REQUEST_FIELDS,
    ServeBenchConfig,
    _is_token_chunk,
    arrival_offsets,
    build_payload,
)

REPO = Path(__file__).resolve().parents[1]


# -- metrics on hand-made timings -------------------------------------------------------------------


def _hand_made() -> list[RequestResult]:
    return [
        # sent at 0.0; chunks at 0.5, 0.6, 0.8, 1.1: TTFT 0.5, TPOT (1.1 - 0.5) / 3 = 0.2
        RequestResult(True, 0.0, 0.5, [0.1, 0.2, 0.3], 1.1, prompt_len=10, output_tokens=4),
        # one token: no TPOT, and TPOT 0 for goodput
        RequestResult(True, 1.0, 0.2, [], 0.2, prompt_len=20, output_tokens=1),
        RequestResult(False, 0.2, error="HTTP 500"),
        # sent at 0.5; chunks at 0.8, 1.2: TPOT 0.4
        RequestResult(True, 0.5, 0.3, [0.4], 0.7, prompt_len=30, output_tokens=2),
    ]


def test_throughput_bench_counts_gc_pauses_and_compiles():
    """What `plait bench throughput` reports beside its timed run: garbage collections (each stalls the
    host between steps) and Triton compiles (a timed run should have none)."""
    import gc

    from plait.bench.throughput import gc_pauses, triton_compiles

    with gc_pauses() as pauses:
        gc.collect()
        gc.collect()
    assert len(pauses) == 2 and all(p >= 0 for p in pauses)
    with triton_compiles() as compiled:
        pass
    assert compiled == []


def test_metrics_match_vllm_definitions_by_hand():
    m = calculate_metrics(_hand_made(), duration_s=2.0, percentiles=(50, 90, 99),
                          goodput={"ttft": 400.0, "tpot": 300.0})
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (60, 7)
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(3.5)
    assert m["total_token_throughput"] == pytest.approx(33.5)
    # Only the one-token request meets TTFT <= 400 ms and TPOT <= 300 ms.
    assert m["request_goodput"] == pytest.approx(0.5)
    expected_ms = {
        "ttft": (1000 / 3, 300, 460, 496),  # [200, 300, 500]
        "tpot": (300, 300, 380, 398),  # [200, 400]: the one-token request has none
        "itl": (250, 250, 370, 397),  # [100, 200, 300, 400], pooled over requests
        "e2el": (2000 / 3, 700, 1020, 1092),  # [200, 700, 1100]
    }
    for name, (mean, median, p90, p99) in expected_ms.items():
        got = [m[f"mean_{name}_ms"], m[f"median_{name}_ms"], m[f"p90_{name}_ms"], m[f"p99_{name}_ms"]]
        assert got == pytest.approx([mean, median, p90, p99]), name
    assert m["std_itl_ms"] == pytest.approx(float(np.std([100, 200, 300, 400])))
    # Chunks per one-second bucket: 0.5 0.6 0.8 0.8 | 1.1 1.2 1.2; all three in flight at t=1.0.
    assert (m["max_output_tokens_per_s"], m["max_concurrent_requests"]) == (4.0, 3)


def test_metric_edge_cases():
    no_goodput = calculate_metrics(_hand_made(), duration_s=2.0)
    assert no_goodput["request_goodput"] is None
    assert summarize("ttft", [], (99,)) == {"mean_ttft_ms": 0.0, "median_ttft_ms": 0.0, "std_ttft_ms": 0.0,
                                            "p99_ttft_ms": 0.0}
    # A server that reports no usage: the token chunks are counted instead.
    unreported = RequestResult(True, 0.0, 0.1, [0.1, 0.1], 0.3)
    assert unreported.num_output_tokens == 3 and unreported.tpot == pytest.approx(0.1)
    assert unreported.chunk_times == pytest.approx([0.1, 0.2, 0.3])
    assert peak_output_rate([RequestResult(False)]) == (0.0, 0)
    assert parse_goodput(["ttft:1000", "TPOT:50", "e2el:2.5"]) == {"ttft": 1000.0, "tpot": 50.0, "e2el": 2.5}
    for bad in (["ttft"], ["itl:5"], ["ttft:x"], ["ttft:0"], ["tpot:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
    with pytest.raises(ValueError):
        calculate_metrics([], duration_s=0.0)


def test_arrivals():
    assert arrival_offsets(3, math.inf, "poisson", 0) == [0.0, 0.0, 0.0]
    assert arrival_offsets(4, 2.0, "fixed", 0) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    poisson = arrival_offsets(50, 4.0, "poisson", seed=7)
    assert poisson == arrival_offsets(50, 4.0, "poisson", seed=7)
    assert poisson != arrival_offsets(50, 4.0, "poisson", seed=8)
    assert all(b >= a for a, b in zip(poisson, poisson[1:])) and poisson[0] > 0
    assert poisson[-1] == pytest.approx(50 / 4.0)  # scaled to n / rate, as vLLM does
    gaps = np.diff(poisson)
    assert gaps.std() > 0.5 * gaps.mean()  # exponential gaps, not a fixed rate
    # vLLM's --burstiness: gamma gaps of that shape, the same schedule length; burstier below 1.
    assert arrival_offsets(50, 4.0, "poisson", 7, burstiness=1.0) == poisson

    def spread(burstiness: float) -> float:
        offsets = arrival_offsets(2000, 4.0, "poisson", 7, burstiness)
        assert offsets[-1] == pytest.approx(2000 / 4.0)
        return float(np.diff(offsets).std() / np.diff(offsets).mean())

    assert spread(0.2) > 1.5 > spread(1.0) > 0.7 > spread(5.0)  # CV of gamma gaps: 1 / sqrt(shape)
    with pytest.raises(ValueError, match="burstiness"):
        ServeBenchConfig(burstiness=0.0)
    with pytest.raises(ValueError, match="Poisson"):
        ServeBenchConfig(burstiness=2.0, arrival="fixed")


def test_ready_check_waits_for_a_server_that_is_still_loading(monkeypatch):
    """vLLM's --ready-check-timeout-sec: the run starts once the server lists its models, and gives up after
    the timeout; without it, an unreachable server fails at once."""
    import asyncio

    from plait.bench import serve_client

    calls = []
    down_for = [2]  # polls that fail before the server is up

    async def loading(client, base_url, headers):
        calls.append(base_url)
        if len(calls) <= down_for[0]:
            raise ValueError("cannot reach the server")
        return "the-model"

    monkeypatch.setattr(serve_client, "first_model", loading)
    monkeypatch.setattr(serve_client, "READY_POLL_S", 0.01)
    waiting = ServeBenchConfig(ready_timeout_s=30.0)
    assert asyncio.run(serve_client._ready(None, waiting, {})) == "the-model" and len(calls) == 3
    calls.clear()
    with pytest.raises(ValueError, match="cannot reach"):
        asyncio.run(serve_client._ready(None, ServeBenchConfig(), {}))  # no wait: the first failure
    assert len(calls) == 1
    calls.clear()
    down_for[0] = 10**9  # never up
    with pytest.raises(ValueError, match="cannot reach"):
        asyncio.run(serve_client._ready(None, ServeBenchConfig(ready_timeout_s=0.05), {}))


def test_vllm_bench_serve_flags_map_to_plaits():
    """`vllm bench serve`'s names: the server from --host/--port, the endpoint from --backend or --endpoint,
    random lengths within --random-range-ratio, --metric-percentiles; conflicting spellings are errors."""
    from plait.bench.serve_client import config_from_args, samples_from_args
    from plait.entrypoints.cli import build_parser

    def parsed(*argv: str):
        args = build_parser().parse_args(["bench", "serve", *argv])
        return args, config_from_args(args)

    args, config = parsed("--host", "10.0.0.5", "--port", "8100", "--backend", "openai-chat",
                          "--random-input-len", "100", "--random-output-len", "10", "--random-range-ratio",
                          "0.1", "--metric-percentiles", "50,99", "--burstiness", "0.5", "--ignore-eos")
    assert (config.base_url, config.endpoint_type, config.burstiness) == ("http://10.0.0.5:8100", "chat", 0.5)
    assert (args.prompt_mix, args.output_len, config.percentiles) == ("1:90-110", "9-11", (50.0, 99.0))
    assert config.ignore_eos
    args, config = parsed("--endpoint", "/v1/chat/completions", "--random-input-len", "64")
    assert (config.base_url, config.endpoint_type) == ("http://127.0.0.1:8000", "chat")
    assert (args.prompt_mix, args.output_len) == ("1:64-64", "128-128")  # vLLM's default output length
    args, config = parsed()
    assert (args.prompt_mix, args.output_len, config.endpoint_type) == ("0.8:128-512,0.2:2048-8192", "64-512",
                                                                        "completions")
    assert config.ignore_eos and config.percentiles == (90.0, 99.0)
    for argv, words in ((["--host", "h"], "needs --port"),
                        (["--base-url", "http://x", "--port", "1"], "not both"),
                        (["--backend", "openai-chat", "--endpoint-type", "completions"], "different"),
                        (["--random-input-len", "8", "--output-len", "4"], "not both"),
                        (["--random-range-ratio", "1.5"], "range-ratio"),
                        (["--percentiles", "99", "--metric-percentiles", "99"], "not both"),
                        (["--percentile-metrics", "ttft,latency"], "unknown metrics"),
                        (["--dataset", "file", "--dataset-path", "p.txt", "--random-prefix-len", "4"],
                         "for --dataset random"),
                        (["--tokenizer", "some/folder"], "random prompts sent to chat")):
        with pytest.raises(ValueError, match=words):
            samples_from_args(*parsed(*argv))


def test_random_requests_follow_the_mix():
    mix = "0.8:16-32,0.2:100-120"
    requests = random_requests(10, vocab_size=500, seed=3, prompt_mix=mix, output_lens="4-9")
    assert requests == random_requests(10, vocab_size=500, seed=3, prompt_mix=mix, output_lens="4-9")
    lens = [r.prompt_len for r in requests]
    assert sum(16 <= n <= 32 for n in lens) == 8 and sum(100 <= n <= 120 for n in lens) == 2
    assert all(len(r.prompt) == r.prompt_len for r in requests)
    assert all(10 <= t < 500 for r in requests for t in r.prompt)
    assert all(4 <= r.output_len <= 9 for r in requests)
    # vLLM's --random-prefix-len: the same random prefix before every prompt, which is otherwise unchanged.
    shared = random_requests(10, vocab_size=500, seed=3, prompt_mix=mix, output_lens="4-9", prefix_len=7)
    prefix = shared[0].prompt[:7]
    assert all(r.prompt[:7] == prefix and r.prompt[7:] == plain.prompt for r, plain in zip(shared, requests))
    lengths = [(r.prompt_len - 7, r.output_len) for r in shared]
    assert lengths == [(r.prompt_len, r.output_len) for r in requests]
    assert parse_mix("3:1-2,1:5") == [(0.75, LengthRange(1, 2)), (0.25, LengthRange(5, 5))]
    assert LengthRange.parse(str(LengthRange(3, 9))) == LengthRange(3, 9)
    assert LengthRange.around(100, 0.1) == LengthRange(90, 110)  # vLLM's int(), not rounding up to 111
    assert LengthRange.around(1, 0.5) == LengthRange(1, 1)
    for bad in ("0:1-2", "1:5-2", "x:1", "1-2"):
        with pytest.raises(ValueError):
            parse_mix(bad)


def test_file_requests(tmp_path):
    text = tmp_path / "prompts.txt"
    text.write_text("Name a color.\n\nWhat is 2 + 2?\n")
    assert [r.prompt for r in file_requests(text, None, "5", 0)] == ["Name a color.", "What is 2 + 2?"]
    cycled = file_requests(text, 3, "5", 0)
    assert [r.prompt for r in cycled][2] == "Name a color." and all(r.output_len == 5 for r in cycled)
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text('{"prompt": "Hi"}\n{"prompt": "Bye", "other": 1}\n')
    assert [r.prompt for r in file_requests(jsonl, None, "5", 0)] == ["Hi", "Bye"]
    jsonl.write_text('{"text": "Hi"}\n')
    with pytest.raises(ValueError, match="prompt"):
        file_requests(jsonl, None, "5", 0)


def test_token_chunks_and_payloads():
    role_only = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    assert not _is_token_chunk(role_only, "chat")
    assert _is_token_chunk({"choices": [{"delta": {"content": "Hi"}}]}, "chat")
    assert _is_token_chunk({"choices": [{"delta": {}, "finish_reason": "length"}]}, "chat")
    assert _is_token_chunk({"choices": [{"text": ""}]}, "completions")  # an empty token is still a token
    assert not _is_token_chunk({"choices": [], "usage": {"completion_tokens": 3}}, "completions")
    config = ServeBenchConfig(endpoint_type="chat")
    with pytest.raises(ValueError, match="text prompts"):
        build_payload(random_requests(1, 100, 0, "1:4", "2")[0], config, "m")


# -- `plait bench serve` against a live server -----------------------------------------------------------


@pytest.fixture(scope="module")
def served(serving_engine):
    pytest.importorskip("fastapi")
    from conftest import idle_serving_engine

    from plait.entrypoints.server import BackgroundServer, OpenAIServer, ServerConfig

    engine = idle_serving_engine(serving_engine)  # the default model under a 256-token budget
    vocab = engine.model_config.vocab_size
    with BackgroundServer(OpenAIServer(engine, ServerConfig(log_level="warning"))) as url:
        yield url, vocab


def _counters(url: str) -> dict[str, float]:
    """The server's request and token counters from /metrics, by vLLM's names (which plait's server
    exports), summed over their labels (model_name, finished_reason): so it reads a vLLM server too."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    names = {"vllm:request_success_total": "requests", "vllm:prompt_tokens_total": "prompt_tokens",
             "vllm:generation_tokens_total": "generation_tokens"}
    samples = dict.fromkeys(names.values(), 0.0)
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            if s.name in names:
                samples[names[s.name]] += s.value
    return samples


def _bench(argv: list[str]) -> int:
    from plait.entrypoints.cli import main

    return main(["bench", "serve", "--disable-tqdm", *argv])


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before}


def _assert_all_metrics(result: dict) -> None:
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p90", "p99"):
            value = result[f"{stat}_{name}_ms"]
            assert math.isfinite(value) and value >= 0, (stat, name)
        assert result[f"median_{name}_ms"] > 0, name
    for key in ("request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
                "max_output_tokens_per_s", "duration"):
        assert math.isfinite(result[key]) and result[key] > 0, key


def test_bench_serve_counts_match_server_metrics(served, tmp_path):
    url, vocab = served
    before = _counters(url)
    out = tmp_path / "serve.json"
    status = _bench(["--base-url", url, "--num-prompts", "6", "--prompt-mix", "1:8-40", "--output-len", "8",
                     "--vocab-size", str(vocab), "--request-rate", "20", "--arrival", "poisson",
                     "--seed", "5", "--max-concurrency", "3", "--goodput", "ttft:60000", "tpot:60000",
                     "--request-id-prefix", "run-7-", "--save-detailed", "--result-file", str(out)])
    delta = _delta(before, _counters(url))
    assert status == 0
    result = json.loads(out.read_text())
    # vLLM's --request-id-prefix: request i went with X-Request-Id run-7-<i>, which named the server's answer.
    assert result["response_ids"] == [f"cmpl-run-7-{i}" for i in range(6)]
    _assert_all_metrics(result)
    assert (result["completed"], result["failed"]) == (6, 0)
    assert result["max_concurrent_requests"] <= 3
    # Everything met the loose SLOs, so goodput is the request throughput.
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert result["output_lens"] == [8] * 6
    assert result["input_lens"] == [r.prompt_len for r in random_requests(6, vocab, 5, "1:8-40", "8")]
    assert delta == {"requests": 6, "prompt_tokens": result["total_input_tokens"],
                     "generation_tokens": result["total_output_tokens"]}
    assert result["total_output_tokens"] == 48


def test_bench_serve_chat_file_dataset(served, tmp_path):
    url, _ = served
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Name a color."}\n{"prompt": "What do bees make?"}\n')
    before = _counters(url)
    out = tmp_path / "chat.json"
    status = _bench(["--base-url", url, "--endpoint-type", "chat", "--dataset", "file", "--dataset-path",
                     str(prompts), "--output-len", "6", "--result-file", str(out)])
    delta = _delta(before, _counters(url))
    result = json.loads(out.read_text())
    assert status == 0 and (result["completed"], result["total_output_tokens"]) == (2, 12)
    assert result["mean_ttft_ms"] > 0 and result["request_goodput"] is None
    # Without --save-detailed the file keeps the settings and metrics only, as vLLM's bench writes it.
    assert not set(PER_REQUEST_FIELDS) & set(result) and result["num_prompts"] == 2
    assert delta == {"requests": 2, "prompt_tokens": result["total_input_tokens"],
                     "generation_tokens": 12}


def _sharegpt_file(path, conversations: list[list[str]]):
    """A ShareGPT JSON (ShareGPT_V3's layout) of the given turns, alternating human and gpt."""
    records = [{"id": f"c{i}", "conversations": [{"from": ("human", "gpt")[k % 2], "value": v}
                                                 for k, v in enumerate(turns)]}
               for i, turns in enumerate(conversations)]
    path.write_text(json.dumps(records))
    return path


def test_sharegpt_sampling_follows_vllms_rules(tmp_path):
    """Conversations of two turns or more, in an order the seed shuffles, the reply's length as the output
    length, and vLLM's length limits; only as many texts are counted as the sample needs."""
    from plait.bench.datasets import (
        SHAREGPT_COUNT_BATCH,
        SHAREGPT_MAX_PROMPT_TOKENS,
        read_sharegpt,
        sharegpt_requests,
    )

    ok = [[f"question {i} " + "w " * 6, "answer " * (5 + i)] for i in range(SHAREGPT_COUNT_BATCH + 6)]
    bad = [["short", "an answer of many words here"],  # a 1-token prompt
           ["a long enough question here", "no"],  # a 1-token reply
           ["w " * (SHAREGPT_MAX_PROMPT_TOKENS + 1), "an answer of many words here"],
           ["only one turn"]]
    path = _sharegpt_file(tmp_path / "sharegpt.json", bad + ok)
    pairs = read_sharegpt(path)
    assert len(pairs) == len(ok) + 3  # the one-turn conversation is not a pair
    counted = []

    def words(texts: list[str]) -> list[int]:  # a stand-in tokenizer: one token a word
        counted.extend(texts)
        return [len(t.split()) for t in texts]

    first = sharegpt_requests(pairs, 5, seed=3, count_tokens=words)
    assert len(first) == 5 and len(counted) == 2 * SHAREGPT_COUNT_BATCH  # one batch was enough
    assert all(r.prompt.startswith("question") and r.output_len == len(dict(pairs)[r.prompt].split())
               and r.prompt_len == 8 for r in first)
    assert [r.prompt for r in sharegpt_requests(pairs, 5, 3, words)] == [r.prompt for r in first]
    assert [r.prompt for r in sharegpt_requests(pairs, 5, 4, words)] != [r.prompt for r in first]
    assert {r.output_len for r in sharegpt_requests(pairs, 5, 3, words, output_len=7)} == {7}
    with pytest.raises(ValueError, match="within the length limits"):
        sharegpt_requests(pairs, len(ok) + 1, 3, words)
    with pytest.raises(ValueError, match="no conversation"):
        read_sharegpt(_sharegpt_file(tmp_path / "none.json", [["one turn"]]))


def test_bench_serve_sharegpt_dataset(served, tmp_path):
    """`--dataset-name sharegpt` (vLLM's flag) against a live server: its /tokenize counts the replies, and
    each request asks for its reply's length."""
    import httpx

    url, _ = served
    conversations = [["Name three colors of the rainbow, please.", "Red, orange and yellow are three."],
                     ["What do bees make from flower nectar?", "Bees make honey from the nectar of flowers."],
                     ["Say hello in French and in Spanish.", "Bonjour in French, and hola in Spanish."]]
    path = _sharegpt_file(tmp_path / "sharegpt.json", conversations)
    replies = {q: httpx.post(f"{url}/tokenize", json={"prompt": a}).json()["count"] for q, a in conversations}
    before = _counters(url)
    out = tmp_path / "sharegpt_result.json"
    status = _bench(["--base-url", url, "--dataset-name", "sharegpt", "--dataset-path", str(path),
                     "--num-prompts", "3", "--save-detailed", "--result-file", str(out)])
    delta = _delta(before, _counters(url))
    result = json.loads(out.read_text())
    assert status == 0 and (result["completed"], result["failed"]) == (3, 0)
    assert sorted(result["output_lens"]) == sorted(replies.values())
    assert delta == {"requests": 3, "prompt_tokens": result["total_input_tokens"],
                     "generation_tokens": sum(replies.values())}
    # Counted here with the served model's tokenizer instead (for a server without /tokenize): the same.
    from plait.loader.source import default_model_path

    again = tmp_path / "local_count.json"
    assert _bench(["--base-url", url, "--dataset-name", "sharegpt", "--dataset-path", str(path),
                   "--tokenizer", str(default_model_path()), "--num-prompts", "3", "--save-detailed",
                   "--result-file", str(again)]) == 0
    assert sorted(json.loads(again.read_text())["output_lens"]) == sorted(replies.values())


def test_a_vllm_bench_serve_command_line_runs_as_it_is(served, tmp_path):
    """A `vllm bench serve` command line (its flags, not plait's) against a live plait server."""
    url, vocab = served
    port = url.rsplit(":", 1)[1]
    status = _bench(["--backend", "vllm", "--host", "127.0.0.1", "--port", port, "--dataset-name", "random",
                     "--random-input-len", "12", "--random-output-len", "3", "--num-prompts", "3",
                     "--request-rate", "30", "--burstiness", "0.5", "--ignore-eos",
                     "--metric-percentiles", "99", "--percentile-metrics", "ttft,tpot,itl",
                     "--vocab-size", str(vocab), "--save-result", "--save-detailed",
                     "--result-dir", str(tmp_path / "results"), "--result-filename", "run.json"])
    result = json.loads((tmp_path / "results" / "run.json").read_text())
    assert status == 0 and (result["completed"], result["output_lens"]) == (3, [3, 3, 3])
    assert result["input_lens"] == [12, 12, 12] and "p99_ttft_ms" in result and "p90_ttft_ms" not in result
    assert result["burstiness"] == 0.5
    # No --request-id-prefix: vLLM's fresh "bench-<8 hex>-" one, which the server's answers carry.
    prefix = result["request_id_prefix"]
    assert re.fullmatch(r"bench-[0-9a-f]{8}-", prefix)
    assert result["response_ids"] == [f"cmpl-{prefix}{i}" for i in range(3)]


def test_random_prompts_go_to_chat_as_text(served, tmp_path):
    """`--backend openai-chat --dataset-name random` (a common vLLM command line): random ids made text by the
    server's /detokenize, or by --tokenizer the same way, then sent as chat messages."""
    from plait.bench.serve_client import local_detokenizer, server_detokenizer
    from plait.loader.source import default_model_path

    url, vocab = served
    ids = random_requests(2, vocab, seed=4, prompt_mix="1:12", output_lens="3")
    texts = server_detokenizer(ServeBenchConfig(base_url=url))([r.prompt for r in ids])
    assert texts == local_detokenizer(str(default_model_path()))([r.prompt for r in ids])
    assert all(isinstance(t, str) and t for t in texts)
    out = tmp_path / "chat_random.json"
    status = _bench(["--base-url", url, "--backend", "openai-chat", "--dataset-name", "random",
                     "--random-input-len", "12", "--random-output-len", "3", "--num-prompts", "2",
                     "--vocab-size", str(vocab), "--seed", "4", "--save-detailed", "--result-file", str(out)])
    result = json.loads(out.read_text())
    assert status == 0 and (result["completed"], result["output_lens"]) == (2, [3, 3])
    assert all(n > 12 for n in result["input_lens"])  # the chat template's tokens and the text's own


def test_health_waits(served):
    """The scripts' start-up wait: a live server is healthy at once; a port nobody serves never is."""
    import socket

    from plait.bench.serve_client import is_healthy, wait_healthy

    url, _ = served
    assert is_healthy(url) and wait_healthy(url, limit_s=5)
    with socket.socket() as sock:  # a free port, closed again: nothing listens there
        sock.bind(("127.0.0.1", 0))
        nobody = f"http://127.0.0.1:{sock.getsockname()[1]}"
    assert not is_healthy(nobody) and not wait_healthy(nobody, limit_s=0.3, poll_s=0.1)


def test_bench_serve_plots(served, tmp_path):
    pytest.importorskip("matplotlib")
    from plait.bench.plots import SERVE_PLOTS

    url, vocab = served
    status = _bench(["--base-url", url, "--num-prompts", "3", "--prompt-mix", "1:8-16", "--output-len", "4",
                     "--vocab-size", str(vocab), "--plot", str(tmp_path / "plots")])
    assert status == 0
    for name in SERVE_PLOTS:
        assert (tmp_path / "plots" / name).stat().st_size > 0


def test_first_requests_plot_from_committed_results(tmp_path):
    """benchmarks/first_requests.py --plot: the H200 runs with and without the warm-up, side by side."""
    pytest.importorskip("matplotlib")
    results = REPO / "benchmarks" / "results" / "first_requests_h200"
    png = tmp_path / "first.png"

    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "first_requests.py"), "--plot", str(png),
                          f"without={results / 'first_requests_no_warm_up.json'}",
                          f"with={results / 'first_requests_warm_up.json'}"], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_serve_reports_failures(served, tmp_path):
    url, _ = served
    out = tmp_path / "bad.json"
    # Token ids beyond the vocabulary: the server refuses every request (400), and the run says so.
    status = _bench(["--base-url", url, "--num-prompts", "2", "--prompt-mix", "1:4", "--output-len", "2",
                     "--vocab-size", "10000000", "--save-detailed", "--result-file", str(out)])
    result = json.loads(out.read_text())
    assert status == 1 and (result["completed"], result["failed"]) == (0, 2)
    assert all(e.startswith("HTTP 400") for e in result["errors"])


# -- W4 and the step timeline ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared_bench() -> Path:
    from plait.bench.shared import find_shared

    try:
        return find_shared()
    except FileNotFoundError as err:
        pytest.skip(str(err))


# The long prompt is no multiple of the budget, so under prefill_first too its last chunk leaves room
# for the streams' decodes in the step that makes its first token.
W4_TINY = dict(num_streams=4, stream_prompt_len=16, stream_output_len=48, long_prompt_len=200,
               long_output_len=8, arrive_after=16)
W4_BUDGET = 64


def test_w4_tiny_both_policies(tiny_llama, shared_bench, tmp_path):
    from plait.entrypoints.cli import main

    out = tmp_path / "w4.json"
    shape = [f"--{k.replace('_', '-')}={v}" for k, v in W4_TINY.items()]
    status = main(["bench", "w4", "--model", str(tiny_llama), "--max-num-batched-tokens", str(W4_BUDGET),
                   "--shared", str(shared_bench), *shape, "--result-file", str(out)])
    assert status == 0
    result = json.loads(out.read_text())
    assert set(result["policies"]) == {"mixed", "prefill_first"}
    for policy, run in result["policies"].items():
        metrics = run["metrics"]
        for key in ("ttft_long_ms", "steady_itl_p50_ms", "steady_itl_p99_ms", "window_itl_p50_ms",
                    "window_itl_p99_ms", "window_itl_max_ms", "output_tok_s", "p99_itl_window_over_steady"):
            value = metrics[key]
            assert value is not None and math.isfinite(value) and value > 0, (policy, key)
        assert metrics["n_steady"] > 0 and metrics["n_window"] > 0
        outputs = W4_TINY["num_streams"] * W4_TINY["stream_output_len"] + W4_TINY["long_output_len"]
        assert run["num_output_tokens"] == outputs
        steps = run["timeline"]
        # The timeline holds exactly the timed run: every prompt token once, and every output token
        # but the five made by a last prefill chunk as a decode token.
        prompts = W4_TINY["num_streams"] * W4_TINY["stream_prompt_len"] + W4_TINY["long_prompt_len"]
        assert sum(s["num_prefill_tokens"] for s in steps) == prompts
        assert sum(s["num_decode_tokens"] for s in steps) == outputs - (W4_TINY["num_streams"] + 1)
        assert all(s["num_prefill_tokens"] + s["num_decode_tokens"] <= W4_BUDGET for s in steps)
        arrival = run["marks"]["long request arrives"]
        # The streams' prompts share the first step, so the steady state before the arrival is decodes only.
        assert steps[0]["num_prefill_tokens"] == W4_TINY["num_streams"] * W4_TINY["stream_prompt_len"]
        assert all(s["num_prefill_tokens"] == 0 for s in steps[1:] if s["start_time"] < arrival), policy
        long_prefill = [s for s in steps if s["start_time"] >= arrival and s["num_prefill_tokens"] > 0]
        assert long_prefill
        stalled = [s for s in long_prefill if s["num_decode_tokens"] == 0]
        # mixed plaits the long prompt into the running decodes; prefill_first stalls them.
        assert (not stalled) if policy == "mixed" else stalled, policy
    assert result["comparison"]["ttft_long_mixed_over_prefill_first"] > 0
    pytest.importorskip("matplotlib")
    from plait.bench.w4 import plot_w4

    pngs = plot_w4(result, tmp_path / "w4.png")
    assert [p.name for p in pngs] == ["w4.png", "w4_itl.png"] and all(p.stat().st_size > 0 for p in pngs)
    # `plait bench timeline` reads a w4 result too: one panel per policy.
    assert main(["bench", "timeline", str(out), "--plot", str(tmp_path / "again.png")]) == 0
    assert (tmp_path / "again.png").stat().st_size > 0


def test_timeline_dump_load_plot(tiny_llama, tmp_path):
    from conftest import random_prompts, run_greedy

    from plait.bench import timeline
    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_llama), max_num_batched_tokens=32))
    engine.record_timeline = True
    prompts = random_prompts(3, 20, 40, seed=11)
    run_greedy(engine, prompts, max_tokens=6, arrive_every=2)
    steps = engine.timeline
    assert steps and not any(s.used_cuda_graph for s in steps)  # CPU: no CUDA graphs
    path = timeline.dump(steps, tmp_path / "timeline.json", marks={"start": 0.0})
    (name, (loaded, marks)), = timeline.load(path).items()
    assert marks == {"start": 0.0} and len(loaded) == len(steps)
    assert loaded[0]["start_time"] == 0.0
    for record, step in zip(loaded, steps):
        assert record["start_time"] == pytest.approx(step.start_time - steps[0].start_time)
        assert {k: v for k, v in record.items() if k != "start_time"} == {
            k: v for k, v in vars(step).items() if k != "start_time"}
    summary = timeline.summarize(loaded)
    assert summary["prefill_tokens"] == sum(len(p) for p in prompts)
    assert summary["decode_tokens"] == 3 * 6 - 3
    assert summary["steps"] == len(steps) and summary["cuda_graph_steps"] == 0
    pytest.importorskip("matplotlib")
    from plait.entrypoints.cli import main

    png = tmp_path / "timeline.png"
    assert main(["bench", "timeline", str(path), "--plot", str(png)]) == 0
    assert png.stat().st_size > 0
    # A window of a timeline on another clock (a server's), and two files side by side.
    start = loaded[1]["start_time"]
    cut = timeline.window(loaded, start, span=loaded[3]["start_time"] - start)
    assert [s["index"] for s in cut] == [loaded[1]["index"], loaded[2]["index"]]
    assert cut[0]["start_time"] == 0.0
    other = timeline.dump(steps[:2], tmp_path / "other.json")
    two = ["bench", "timeline", str(path), str(other)]
    assert main([*two, "--start", str(start), "0", "--plot", str(png)]) == 0
    with pytest.raises(SystemExit, match="one per file"):
        main([*two, "--start", "1", "2", "3"])


# -- the W5 sweep script --------------------------------------------------------------------------------


def test_w5_sweep_smoke(tiny_llama, tmp_path):
    """One policy, one rate, four requests on a tiny model's config with random weights: the script's
    whole path, as the GPU run takes it."""
    pytest.importorskip("fastapi")
    from conftest import TINY_VOCAB

    model = tmp_path / "tiny"
    model.mkdir()
    shutil.copy(tiny_llama / "config.json", model / "config.json")  # no weights, no tokenizer
    out = tmp_path / "w5"
    cmd = [sys.executable, str(REPO / "scripts" / "w5_sweep.py"), "--out", str(out), "--rates", "8",
           "--policies", "mixed", "--num-prompts", "4", "--prompt-mix", "0.5:8-16,0.5:40-60", "--output-len",
           "3-6", "--disable-tqdm", "--step-timelines", "--", "--model", str(model), "--load-format", "dummy"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((out / "w5.json").read_text())
    (row,) = summary["policies"]["mixed"]
    assert summary["vocab_size"] == TINY_VOCAB  # read from the model's config.json
    assert (row["completed"], row["failed"], row["request_rate"]) == (4, 0, 8.0)
    # A gap per chunk after the first: at most one per token (fewer where the server's reader fell behind
    # and merged tokens into one chunk, which timing decides).
    detail = json.loads((out / "mixed_rate8.json").read_text())
    gaps = [len(itl) for itl in detail["itls"]]
    assert all(0 <= g <= n - 1 for g, n in zip(gaps, detail["output_lens"])) and all(detail["output_lens"])
    assert "| 8 | 4 | 0 |" in (out / "w5.md").read_text()
    # The server's step timeline covers the run (and its warm-up request), on the clock of the rate's start.
    steps = json.loads((out / "timeline_mixed.json").read_text())["steps"]
    assert sum(s["num_prefill_tokens"] for s in steps) >= sum(detail["input_lens"])
    started = detail["started_monotonic"]
    assert started < steps[0]["start_time"] < steps[-1]["start_time"] < started + 60


def test_run_isolated_runs_in_a_fresh_process_and_raises_its_errors():
    """`plait bench throughput` runs each workload through run_isolated, so that no workload's numbers
    depend on what an earlier one left in the process (heap, GPU allocator, compiled kernels)."""
    import os

    from plait.bench.shared import run_isolated

    assert run_isolated(os.getpid) != os.getpid()
    assert run_isolated(divmod, 17, 5) == (3, 2)
    with pytest.raises(ValueError, match="invalid literal"):
        run_isolated(int, "not a number")


def _tiny_shared(tmp_path, tiny_llama):
    """A shared/bench folder whose W3 is a tiny random Llama: workloads.py from ../shared's shape."""
    import shutil

    shared = tmp_path / "bench"
    (shared / "models").mkdir(parents=True)
    (shared / "models" / "tiny").mkdir()
    shutil.copy(tiny_llama / "config.json", shared / "models" / "tiny" / "config.json")
    (shared / "workloads.py").write_text(
        "import torch\n"
        "def random_prompts(n, min_len, max_len, vocab_size, seed):\n"
        "    g = torch.Generator().manual_seed(seed)\n"
        "    lens = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()\n"
        "    return [torch.randint(10, vocab_size, (int(k),), generator=g).tolist() for k in lens]\n"
        "OFFLINE = {'W3': ('tiny', 1, 8, 8, 6), 'W1': ('tiny', 4, 4, 12, 5)}\n")
    return shared


@pytest.mark.parametrize("in_process", [False, True])
def test_throughput_bench_end_to_end_on_cpu(tmp_path, tiny_llama, in_process):
    """`plait bench throughput` on CPU over a tiny model: every workload runs (in a fresh process each,
    by default), produces its output tokens, and the report carries the device and the step breakdown."""
    import argparse
    import json

    from plait.bench import throughput

    parser = argparse.ArgumentParser()
    throughput.add_parser(parser.add_subparsers())
    out = tmp_path / "result.json"
    argv = ["throughput", "--shared", str(_tiny_shared(tmp_path, tiny_llama)), "--workloads", "W3,W1",
            "--max-num-seqs", "4", "--out", str(out)] + (
        ["--in-process", "--output-kind", "cumulative"] if in_process else [])
    args = parser.parse_args(argv)
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["isolated"] is not in_process
    w3, w1 = report["workloads"]
    assert (w3["workload"], w3["output_tokens"], w3["requests"]) == ("W3", 6, 1)
    assert (w1["workload"], w1["output_tokens"], w1["requests"]) == ("W1", 4 * 5, 4)
    assert w3["ms_per_token"] > 0 and w1["output_tok_per_s"] > 0
    assert w1["step_breakdown"]["steps"] >= 5
    assert w1["output_kind"] == ("cumulative" if in_process else "final_only")  # the same tokens counted


def test_throughput_table_prints_each_floor_only_where_measured():
    """The printed table gives a batch-1 workload its ratio to one read of the weights (W3's goal) beside the
    whole-run floor, and "-" where a run measured no roofline, never a made-up 0.00x."""
    from plait.bench.throughput import format_table

    breakdown = {"host_s": dict.fromkeys(("schedule", "prepare", "launch", "sample", "postprocess"), 0.1),
                 "graph_replay_rate_of_single_token_steps": 1.0, "gpu_forward_graph_s": 2.0,
                 "graph_steps": 10, "gpu_forward_s": 2.5, "steps": 12, "wall_s": 3.0}
    rows = [{"workload": "W3", "output_tok_per_s": 234.0, "ms_per_token": 4.28, "ratio_to_vllm_h200": 1.1,
             "ratio_to_floor": 1.21, "ratio_to_weight_read_floor": 1.134, "step_breakdown": breakdown},
            {"workload": "W1", "output_tok_per_s": 31851.0, "ms_per_token": None, "ratio_to_vllm_h200": None,
             "step_breakdown": breakdown}]
    header, w3, w1 = format_table({"device": "cpu", "workloads": rows}).splitlines()[1:]
    columns = [c.strip() for c in header.split("|")]
    w3, w1 = [c.strip() for c in w3.split("|")], [c.strip() for c in w1.split("|")]
    floor, weights = columns.index("vs floor"), columns.index("vs weight-read floor")
    assert (w3[floor], w3[weights]) == ("1.21x", "1.13x")
    assert (w1[floor], w1[weights]) == ("-", "-")


def test_vllm_throughput_run_on_any_model(tmp_path, tiny_llama, capsys):
    """`plait bench throughput --model ...` as `vllm bench throughput`: random prompts within the range ratio,
    every requested token produced, vLLM's printed line and JSON keys; ShareGPT conversations counted with
    the model's own tokenizer (the default model's)."""
    from plait.entrypoints.cli import main
    from plait.loader.source import default_model_path

    out = tmp_path / "tp.json"
    assert main(["bench", "throughput", "--model", str(tiny_llama), "--input-len", "16", "--output-len", "4",
                 "--random-range-ratio", "0.25", "--num-prompts", "6", "--max-num-seqs", "4",
                 "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["num_requests"] == 6 and 6 * 3 <= result["output_tokens"] <= 6 * 5
    assert 6 * (12 + 3) <= result["total_num_tokens"] <= 6 * (20 + 5)
    assert result["tokens_per_second"] == pytest.approx(result["total_num_tokens"] / result["elapsed_time"])
    assert f"Throughput: {result['requests_per_second']:.2f} requests/s" in capsys.readouterr().out
    turns = [["Name two colors of the sea, please.", "Blue and green."],
             ["What do cows drink every day?", "Cows drink water."]]
    sharegpt = _sharegpt_file(tmp_path / "sg.json", turns)
    out = tmp_path / "sg_result.json"
    assert main(["bench", "throughput", "--model", str(default_model_path()), "--dataset-name", "sharegpt",
                 "--dataset-path", str(sharegpt), "--num-prompts", "2", "--output-json", str(out)]) == 0
    from plait.loader.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    replies = sum(len(tokenizer(a)["input_ids"]) for a in ("Blue and green.", "Cows drink water."))
    assert json.loads(out.read_text())["output_tokens"] == replies
    assert main(["bench", "throughput", "--model", str(tiny_llama), "--dataset-name", "sharegpt",
                 "--dataset-path", str(sharegpt)]) != 0  # a folder without a tokenizer cannot count them
    assert "has none" in capsys.readouterr().err


def test_vllm_latency_run(tmp_path, tiny_llama, capsys, monkeypatch):
    """`plait bench latency` as `vllm bench latency`: warm-up then timed iterations of one batch (every prompt
    of --input-len ids, --n samples of exactly --output-len tokens each, or a beam search of width --n),
    vLLM's printed lines and JSON keys; --profile writes a trace instead."""
    from plait.entrypoints import llm as llm_module
    from plait.entrypoints.cli import main

    calls = []
    generate, beam_search = llm_module.LLM.generate, llm_module.LLM.beam_search

    detokenized = []

    def counting_generate(self, prompts, params=None, **kw):
        outs = generate(self, prompts, params, **kw)
        calls.append([(len(o.prompt_token_ids), [len(c.token_ids) for c in o.outputs]) for o in outs])
        detokenized.append(params.detokenize)
        return outs

    def counting_beam_search(self, prompts, params, **kw):
        outs = beam_search(self, prompts, params, **kw)
        calls.append(("beams", len(outs), [len(s.tokens) for o in outs for s in o.sequences]))
        return outs

    monkeypatch.setattr(llm_module.LLM, "generate", counting_generate)
    out = tmp_path / "lat.json"
    assert main(["bench", "latency", "--model", str(tiny_llama), "--input-len", "12", "--output-len", "5",
                 "--batch-size", "3", "--n", "2", "--num-iters-warmup", "1", "--num-iters", "4",
                 "--output-json", str(out)]) == 0
    assert calls == [[(12, [5, 5])] * 3] * 5  # 1 warm-up + 4 timed, each the whole batch
    result = json.loads(out.read_text())
    lat = result["latencies"]
    assert len(lat) == 4 and all(t > 0 for t in lat) and result["avg_latency"] == pytest.approx(sum(lat) / 4)
    pct = [result["percentiles"][p] for p in ("10", "25", "50", "75", "90", "99")]
    assert pct == sorted(pct) and min(lat) <= pct[0] and pct[-1] <= max(lat)
    printed = capsys.readouterr().out
    assert f"Avg latency: {result['avg_latency']} seconds" in printed
    assert f"99% percentile latency: {result['percentiles']['99']} seconds" in printed
    assert set(detokenized) == {True}
    assert main(["bench", "latency", "--model", str(tiny_llama), "--input-len", "4", "--output-len", "2",
                 "--batch-size", "1", "--num-iters-warmup", "0", "--num-iters", "1",
                 "--disable-detokenize"]) == 0
    assert detokenized[-1] is False

    calls.clear()
    monkeypatch.setattr(llm_module.LLM, "beam_search", counting_beam_search)
    assert main(["bench", "latency", "--model", str(tiny_llama), "--input-len", "6", "--output-len", "3",
                 "--batch-size", "2", "--n", "2", "--use-beam-search", "--num-iters-warmup", "0",
                 "--num-iters", "1"]) == 0
    assert [c for c in calls if c[0] == "beams"] == [("beams", 2, [6 + 3] * 4)]

    monkeypatch.setenv("PLAIT_TORCH_PROFILER_DIR", str(tmp_path / "traces"))
    assert main(["bench", "latency", "--model", str(tiny_llama), "--input-len", "4", "--output-len", "2",
                 "--batch-size", "1", "--profile"]) == 0
    assert any((tmp_path / "traces").iterdir())
    assert main(["bench", "latency", "--model", str(tiny_llama), "--num-iters", "0"]) != 0
    assert "--num-iters" in capsys.readouterr().err


def test_embedding_throughput_bench_on_cpu(tmp_path, tiny_models):
    """benchmarks/embedding_throughput.py over a tiny Qwen3 config: plait and transformers embed the same
    prompts with the same saved weights, so their embeddings agree (fp32), and the report has both sides."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import embedding_throughput
    finally:
        sys.path.pop(0)
    out = tmp_path / "embed.json"
    report = embedding_throughput.main(["--config", str(tiny_models["qwen3"]), "--num-prompts", "24",
                                        "--lengths", "5-90", "--dtype", "float32", "--hf-batch", "8",
                                        "--warmup-prompts", "2", "--max-num-batched-tokens", "64",
                                        "--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert report["device"] == "cpu" and report["roofline"] is None and report["num_prompts"] == 24
    assert report["cosine_plait_vs_transformers"]["min"] > 0.99999
    assert report["plait"]["steps"] >= report["tokens"] // 64  # chunked under the 64-token budget
    assert report["plait"]["tokens_per_s"] > 0 and report["transformers"]["tokens_per_s"] > 0


def test_bench_throughput_and_latency_take_vllm_speculative_config(tmp_path, tiny_llama):
    """`--speculative-config` as vLLM's bench commands take it: the engine drafts (here with the target as
    its own draft model: every draft kept under the throughput run's greedy decoding; the latency run samples
    at temperature 1, as vLLM's, where a random model keeps few) and the result JSON counts the drafts."""
    from plait.entrypoints.cli import main

    spec = json.dumps({"model": str(tiny_llama), "num_speculative_tokens": 3})
    out = tmp_path / "tp.json"
    assert main(["bench", "throughput", "--model", str(tiny_llama), "--input-len", "16", "--output-len", "12",
                 "--num-prompts", "4", "--speculative-config", spec, "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["output_tokens"] == 4 * 12
    assert result["spec_decode"]["num_draft_tokens"] > 0 and result["spec_decode"]["acceptance_rate"] >= 0.9
    out = tmp_path / "lat.json"
    assert main(["bench", "latency", "--model", str(tiny_llama), "--input-len", "8", "--output-len", "10",
                 "--batch-size", "2", "--num-iters-warmup", "0", "--num-iters", "2", "--speculative-config",
                 spec, "--output-json", str(out)]) == 0
    drafts = json.loads(out.read_text())["spec_decode"]
    assert drafts["num_draft_tokens"] > 0 and len(drafts["accepted_per_position"]) == 3
