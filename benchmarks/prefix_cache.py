"""Prefix-caching benchmark (issue 6): 64 requests sharing a 2,048-token prefix plus 128 tokens of
their own, 128 output tokens each, all submitted at once; TTFT and total time, cache on and off.

Runs on any device; the committed numbers are from a GPU (random weights, Llama-8B shape):
    PYTHONPATH=. python benchmarks/prefix_cache.py --config benchmarks/configs/llama-8b
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from plait.bench.shared import device_name
from plait.config import EngineConfig
from plait.engine.engine import LLMEngine
from plait.sampling_params import SamplingParams


def prompts(n: int, prefix_len: int, own_len: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(10, vocab, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(10, vocab, (own_len,), generator=g).tolist() for _ in range(n)]


def run(engine: LLMEngine, batch: list[list[int]], output_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    hits_before = engine.kv_cache.stats.hits
    start = time.perf_counter()
    for i, p in enumerate(batch):
        engine.add_request(p, params, request_id=f"p{time.monotonic_ns()}-{i}")
    ttft = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                ttft.append(out.metrics["first_token_time"] - out.metrics["arrival_time"])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    total = time.perf_counter() - start
    return {"ttft_p50_s": statistics.median(ttft), "ttft_p99_s": sorted(ttft)[int(0.99 * (len(ttft) - 1))],
            "total_s": total, "cached_prompt_tokens": engine.kv_cache.stats.hits - hits_before,
            "output_tok_per_s": len(batch) * output_tokens / total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="benchmarks/configs/llama-8b")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prefix", type=int, default=2048)
    parser.add_argument("--own", type=int, default=128)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--out", default="benchmarks/results/prefix_cache.json")
    args = parser.parse_args()

    engine = LLMEngine(EngineConfig(model=args.config, load_format="dummy", max_num_seqs=args.requests,
                                    max_num_batched_tokens=args.budget, max_model_len=4096))
    vocab = engine.model_config.vocab_size
    result = {"device": device_name(),
              "config": args.config, "attention_backend": engine.runner.attn_backend.name,
              "requests": args.requests, "prefix_tokens": args.prefix, "own_tokens": args.own,
              "output_tokens": args.output, "max_num_batched_tokens": args.budget}
    run(engine, prompts(4, 64, 16, vocab, seed=2), 4)  # warm-up
    for label, on, seed in (("cache_off", False, 1), ("cache_on", True, 3)):
        # Fresh prompts per setting (other seeds), so the "on" run finds nothing from the "off" run.
        engine.kv_cache.enable_prefix_caching = on
        result[label] = run(engine, prompts(args.requests, args.prefix, args.own, vocab, seed), args.output)
        print(label, result[label], flush=True)
    result["ttft_p50_speedup"] = result["cache_off"]["ttft_p50_s"] / result["cache_on"]["ttft_p50_s"]
    result["total_time_speedup"] = result["cache_off"]["total_s"] / result["cache_on"]["total_s"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
