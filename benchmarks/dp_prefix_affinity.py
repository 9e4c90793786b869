"""Multi-turn chats through `plait serve --data-parallel-size 2`, routed by prefix affinity or to the least
busy replica: how much of each turn's prompt (the whole conversation so far) the replicas' prefix caches
serve, and the time to first token. A random 2-layer Llama with the default model's tokenizer and chat
template, so any machine runs it; the replicas' merged /metrics count the cache's hits.

    PYTHONPATH=. python benchmarks/dp_prefix_affinity.py --out benchmarks/results/dp_prefix_affinity_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
from tqdm import tqdm

from plait.bench.serve_client import wait_healthy

ROOT = Path(__file__).resolve().parents[1]
CONVERSATIONS = 24
TURNS = 5
USER_WORDS = 60  # ~80 tokens a user turn
REPLY_TOKENS = 24
MAX_MODEL_LEN = 2048
WORDS = ("river mountain quiet signal copper garden lantern orbit velvet harbor meadow pixel thunder canvas "
         "marble echo willow frost ember compass tide saffron glacier nectar").split()


def _tiny_model(folder: Path) -> Path:
    spec = importlib.util.spec_from_file_location("fuzz_server", ROOT / "scripts" / "fuzz_server.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.make_tiny_model(folder)


def _serve(model: Path, routing: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "plait.entrypoints.cli", "serve", "--model", str(model), "--port", "0",
         "--log-level", "warning", "--disable-log-stats", "--max-model-len", str(MAX_MODEL_LEN),
         "--hf-overrides", json.dumps({"max_position_embeddings": MAX_MODEL_LEN}),
         "--num-kv-blocks", "2048", "-dp", "2", "--data-parallel-routing", routing],
        stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        found = re.search(r"on (http://127\.0\.0\.1:\d+) ", line)
        if found:
            url = found.group(1)
            wait_healthy(url, limit_s=math.inf, poll_s=0.2)
            return proc, url
    raise RuntimeError("plait serve printed no address")


async def _conversation(client: openai.AsyncOpenAI, model: str, index: int, bar: tqdm) -> list[float]:
    rng = random.Random(index)
    messages = [{"role": "system", "content": f"Conversation {index}. " + " ".join(rng.choices(WORDS, k=40))}]
    ttfts = []
    for _ in range(TURNS):
        messages.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=USER_WORDS))})
        start = time.perf_counter()
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=REPLY_TOKENS, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True})
        reply, first = "", None
        async for chunk in stream:
            if first is None:
                first = time.perf_counter() - start
            if chunk.choices and chunk.choices[0].delta.content:
                reply += chunk.choices[0].delta.content
        ttfts.append(first)
        messages.append({"role": "assistant", "content": reply})
        bar.update(1)
    return ttfts


def _counter(metrics: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(name + "{"))


def run(model: Path, routing: str) -> dict:
    proc, url = _serve(model, routing)
    try:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)

        async def everyone() -> list[list[float]]:
            with tqdm(total=CONVERSATIONS * TURNS, desc=routing, unit="turn") as bar:
                return await asyncio.gather(*(_conversation(client, model.name, i, bar)
                                              for i in range(CONVERSATIONS)))

        start = time.perf_counter()
        ttfts = [t for conv in asyncio.run(everyone()) for t in conv]
        wall = time.perf_counter() - start
        metrics = httpx.get(f"{url}/metrics").text
    finally:
        proc.send_signal(2)
        proc.wait(60)
    hits, queries = _counter(metrics, "vllm:prefix_cache_hits_total"), _counter(
        metrics, "vllm:prefix_cache_queries_total")
    return {"routing": routing, "turns": len(ttfts), "wall_s": round(wall, 2),
            "prompt_tokens_looked_up": queries, "prompt_tokens_from_cache": hits,
            "cache_hit_rate": round(hits / queries, 4) if queries else None,
            "ttft_ms": {"mean": round(1e3 * statistics.mean(ttfts), 1),
                        "p50": round(1e3 * statistics.median(ttfts), 1),
                        "p99": round(1e3 * sorted(ttfts)[int(0.99 * (len(ttfts) - 1))], 1)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = _tiny_model(Path(tmp) / "tiny-chat")
        rows = [run(model, routing) for routing in ("least-busy", "prefix-affinity")]
    result = {"what": " ".join(__doc__.split("\n\n")[0].split()),
              "machine": f"{platform.machine()} CPU",
              "conversations": CONVERSATIONS, "turns": TURNS, "reply_tokens": REPLY_TOKENS, "rows": rows}
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
