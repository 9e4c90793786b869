"""What cpu_offload_gb costs: batch-1 decode of a model with and without its first layers' weights in host
memory, the GPU memory each engine holds, and the host link's bandwidth those steps imply.

    python benchmarks/cpu_offload.py --model shared/bench/models/llama-8b --load-format dummy \\
        --offload-gb 0,4,8 --out benchmarks/results/cpu_offload_llama8b_h200.json
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


def measure(args: argparse.Namespace, offload_gb: float) -> dict:
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    engine = LLMEngine(EngineConfig(model=args.model, load_format=args.load_format, seed=0,
                                    max_model_len=2048, num_kv_blocks=args.num_kv_blocks,
                                    enable_prefix_caching=False, cpu_offload_gb=offload_gb))
    held = torch.cuda.memory_allocated() - before
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompt = list(range(100, 100 + args.input_len))
    token_times = []
    for rep in range(2):  # the first is warm-up
        engine.add_request(prompt, params, request_id=f"r{rep}")
        last, times = time.perf_counter(), []
        while engine.has_unfinished_requests():
            for _ in engine.step():
                now = time.perf_counter()
                times.append(now - last)
                last = now
        token_times = times[1:]  # decode steps only
    offload = engine.runner.weight_offload
    offloaded = offload.num_bytes if offload is not None else 0
    ms = 1000 * sum(token_times) / len(token_times)
    result = {"cpu_offload_gb": offload_gb, "ms_per_token": round(ms, 3), "gpu_bytes_held": held,
              "offloaded_bytes": offloaded, "offloaded_layers": offload.num_layers if offload else 0}
    del engine
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--offload-gb", default="0,4,8", help="comma-separated GiB values (0: none)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-kv-blocks", type=int, default=1024)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    runs = [measure(args, float(gb)) for gb in args.offload_gb.split(",")]
    base = runs[0]
    for r in runs[1:]:
        extra_s = (r["ms_per_token"] - base["ms_per_token"]) / 1000
        # Each decode step copies the offloaded bytes to the device once: the link's rate those steps imply.
        r["implied_host_link_gb_s"] = round(r["offloaded_bytes"] / extra_s / 1e9, 1) if extra_s > 0 else None
        r["gpu_bytes_saved"] = base["gpu_bytes_held"] - r["gpu_bytes_held"]
    result = {"what": "batch-1 greedy decode, ms per output token with the first layers' weights offloaded "
                      "(cpu_offload_gb) and without; implied_host_link_gb_s = offloaded bytes / the extra "
                      "time per token",
              "command": "python benchmarks/cpu_offload.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
              "device": torch.cuda.get_device_name(), "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
