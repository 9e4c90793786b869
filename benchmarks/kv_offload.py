"""What KV offloading (--kv-offloading-size) buys: the time to first token of a long prompt whose prefix the
device cache evicted, copied back from host memory, against the same prompt recomputed (cold) and against a
prefix the device still holds; and the host link's bandwidth the copy implies.

    python benchmarks/kv_offload.py --model shared/bench/models/llama-8b --load-format dummy \\
        --out benchmarks/results/kv_offload_llama8b_h200.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from plait.config import EngineConfig
from plait.engine.engine import LLMEngine
from plait.sampling_params import SamplingParams

GIB = 2**30
FIRST_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def ttft_ms(engine: LLMEngine, prompt: list[int], request_id: str) -> tuple[float, int]:
    """Milliseconds from adding ``prompt`` to its first token, and how many of its tokens were cached."""
    start = time.perf_counter()
    engine.add_request(prompt, FIRST_TOKEN, request_id=request_id)
    cached = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            cached = out.num_cached_tokens
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - start), cached


def measure(args: argparse.Namespace, offload_gib: float | None) -> dict:
    engine = LLMEngine(EngineConfig(model=args.model, load_format=args.load_format, seed=0,
                                    max_model_len=args.input_len + 16, num_kv_blocks=args.num_kv_blocks,
                                    enable_prefix_caching=True, kv_offloading_size=offload_gib))
    prompt = list(range(100, 100 + args.input_len))
    others = [[7 + k, *range(1000 + k, 1000 + k + args.input_len - 1)] for k in range(args.num_evicting)]
    cold, _ = ttft_ms(engine, prompt, "cold")
    device_hit, device_cached = ttft_ms(engine, prompt, "device-hit")
    for k, other in enumerate(others):  # their blocks push the prompt's out of the device cache
        ttft_ms(engine, other, f"other-{k}")
    returning, returning_cached = ttft_ms(engine, prompt, "returning")
    stats = engine.kv_cache.stats
    caches = engine.runner.kv_caches
    token_bytes = len(caches) * caches[0][:, 0, 0].numel() * caches[0].element_size()
    result = {"kv_offloading_size_gib": offload_gib, "ttft_cold_ms": round(cold, 2),
              "ttft_device_hit_ms": round(device_hit, 2), "device_hit_cached_tokens": device_cached,
              "ttft_returning_ms": round(returning, 2), "returning_cached_tokens": returning_cached,
              "host_hit_tokens": stats.host_hits, "offloaded_blocks": stats.offloaded_blocks,
              "kv_bytes_per_token": token_bytes}
    if stats.host_hits:
        copied = stats.host_hits * token_bytes
        result["copied_back_gib"] = round(copied / GIB, 3)
        result["implied_host_to_device_gb_per_s"] = round(copied / 1e9 / ((returning - device_hit) / 1000), 1)
    engine.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--input-len", type=int, default=8192)
    parser.add_argument("--num-evicting", type=int, default=3, help="prompts of that length run between")
    parser.add_argument("--num-kv-blocks", type=int, default=1600, help="device blocks: room for ~3 prompts")
    parser.add_argument("--offload-gib", type=float, default=16.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    runs = [measure(args, args.offload_gib), measure(args, None)]
    report = {"device": torch.cuda.get_device_name(), "model": args.model, "input_len": args.input_len,
              "num_kv_blocks": args.num_kv_blocks, "num_evicting": args.num_evicting, "runs": runs,
              "returning_speedup": round(runs[1]["ttft_returning_ms"] / runs[0]["ttft_returning_ms"], 2)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
