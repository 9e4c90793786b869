"""FP8 KV cache against the model-dtype cache: how many tokens fit, and how fast long contexts decode.

Llama-8B shape, random weights, bf16. For each kv_cache_dtype, in a fresh process: the KV blocks the
engine sizes from gpu_memory_utilization (capacity in tokens), then --requests prompts of --prompt tokens
decoding --output tokens each, all at once. Decode steps of the full batch read the weights once and
every row's K/V once, so at long contexts the cache's bytes dominate: the JSON gives their median time,
the bytes each reads and the bandwidth that implies, for both dtypes, measured in the same run.

    PYTHONPATH=. python benchmarks/kv_cache_fp8.py --out benchmarks/results/kv_cache_fp8_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from plait.bench.shared import run_isolated


def measure(kv_cache_dtype: str, args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine
    from plait.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=args.config, load_format="dummy", kv_cache_dtype=kv_cache_dtype,
                                    max_num_seqs=args.requests, max_model_len=args.prompt + args.output,
                                    enable_prefix_caching=False))
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(1)

    def batch(n: int, length: int) -> list[list[int]]:
        return [torch.randint(10, vocab, (length,), generator=g).tolist() for _ in range(n)]

    def run(prompts: list[list[int]], output: int, desc: str) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
        start = time.perf_counter()
        for p in prompts:
            engine.add_request(p, params)
        with tqdm(total=len(prompts) * output, desc=desc, unit="tok", leave=False) as bar:
            while engine.has_unfinished_requests():
                bar.update(sum(len(o.outputs[0].delta_token_ids) for o in engine.step()))
        torch.cuda.synchronize()
        return time.perf_counter() - start

    run(batch(8, 512), 16, f"{kv_cache_dtype} warm-up")
    engine.timeline.clear()
    engine.record_timeline = True
    seconds = run(batch(args.requests, args.prompt), args.output, kv_cache_dtype)
    engine.record_timeline = False
    full = [s.duration_s for s in engine.timeline
            if s.num_prefill_tokens == 0 and s.num_decode_tokens == args.requests]
    step_s = statistics.median(full)
    runner = engine.runner
    weight_bytes = sum(t.numel() * t.element_size() for t in runner.model.parameters())
    weight_bytes -= runner.model.model.embed_tokens.weight.numel() * 2  # only the looked-up rows are read
    kv_per_token = runner._bytes_per_block() / engine.config.block_size
    mean_context = args.prompt + args.output / 2
    read = weight_bytes + kv_per_token * mean_context * args.requests
    return {
        "kv_cache_dtype": kv_cache_dtype,
        "num_kv_blocks": runner.num_kv_blocks,
        "kv_capacity_tokens": runner.num_kv_blocks * engine.config.block_size,
        "kv_bytes_per_token": kv_per_token,
        "seconds": seconds,
        "output_tok_per_s": args.requests * args.output / seconds,
        "full_batch_decode_steps": len(full),
        "decode_step_ms_median": step_s * 1e3,
        "decode_tok_per_s": args.requests / step_s,
        "bytes_read_per_decode_step": read,
        "implied_read_GBps": read / step_s / 1e9,
        "cuda_graph_replay_rate": (runner.breakdown.graph_single_token_steps
                                   / max(runner.breakdown.single_token_steps, 1)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="benchmarks/configs/llama-8b")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--output", type=int, default=512)
    parser.add_argument("--out", default="benchmarks/results/kv_cache_fp8.json")
    args = parser.parse_args()
    runs = {dtype: run_isolated(measure, dtype, args) for dtype in ("auto", "fp8")}
    auto, fp8 = runs["auto"], runs["fp8"]
    result = {
        "what": __doc__.split("\n\n")[0],
        "device": torch.cuda.get_device_name(),
        "config": args.config,
        "requests": args.requests, "prompt_tokens": args.prompt, "output_tokens": args.output,
        "runs": runs,
        "capacity_ratio": fp8["kv_capacity_tokens"] / auto["kv_capacity_tokens"],
        "decode_step_speedup": auto["decode_step_ms_median"] / fp8["decode_step_ms_median"],
        "output_throughput_ratio": fp8["output_tok_per_s"] / auto["output_tok_per_s"],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
