"""Prompt-chunk attention tiles and split counts (GPU): which launch shape attends a chunk of a few hundred
tokens over a long cached context fastest, and what the same shapes do to whole fresh prompts.

    PYTHONPATH=. python benchmarks/kernels/chunk_attention_sweep.py --out chunk_sweep.json

Every case is one step of a 32-layer Llama-8B (32 q / 8 kv heads, head dim 128, bf16, 16-token pages), each
layer over its own cache, replayed from a CUDA graph (benchmarks/kernels/attention_bench.py's StepPart and
step_ms). Variants: the shipped heuristic, then (BLOCK_M, TILE_N, stages) tiles with forced split counts.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

import plait.kernels.paged_attention as pa
from benchmarks.kernels.attention_bench import STEP_MODEL, StepPart, step_ms

# (name, rows as (context_len, query_len)): W4's chunks beside decodes at growing contexts, a cap-128
# chunk late, and prompt-heavy steps the same tiles serve (W1's fresh prompts, prefill_first's whole one).
CASES = [
    ("252 after 0", [(0, 252)]),
    ("252 after 1024", [(1024, 252)]),
    ("252 after 2048", [(2048, 252)]),
    ("252 after 3840", [(3840, 252)]),
    ("124 after 3968", [(3968, 124)]),
    ("16 x 512 fresh", [(0, 512)] * 16),
    ("4096 fresh", [(0, 4096)]),
]
# (block_m, tile_n, warps, stages, splits); None: the heuristic's.
VARIANTS = [(None, None, None, None, None)]
VARIANTS += [(128, 64, 8, 2, s) for s in (1, 2, 3, 4)]
VARIANTS += [(64, 64, 4, st, s) for st in (2, 3) for s in (1, 2, 3, 4, 6)]
VARIANTS += [(64, 128, 4, 2, s) for s in (1, 2, 4)]
VARIANTS += [(128, 128, 8, 3, s) for s in (1, 2, 3)]


def variant_name(v: tuple) -> str:
    block_m, tile_n, warps, stages, splits = v
    if block_m is None:
        return "heuristic"
    return f"M{block_m} N{tile_n} w{warps} st{stages} split{splits}"


def run_variant(part: StepPart, v: tuple) -> float:
    block_m, tile_n, warps, stages, splits = v
    default_tiles = pa._default_tiles

    def tiles(head_dim, group, dtype, max_query_len, fp8_cache=False):
        if block_m is None or max_query_len <= 1:
            return default_tiles(head_dim, group, dtype, max_query_len, fp8_cache)
        return block_m, tile_n, warps, stages

    pa._default_tiles = tiles
    try:
        plan = pa.plan_paged_attention(part.num_tokens, part.num_rows, part.hq, part.hkv, part.d,
                                       torch.bfloat16, part.max_query_len, part.max_seq_len, part.q.device,
                                       splits)
        return step_ms([part], [plan])
    finally:
        pa._default_tiles = default_tiles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    _, hq, hkv, d = STEP_MODEL
    t0 = time.perf_counter()
    results = []
    for name, rows in tqdm(CASES, desc="cases"):
        part = StepPart(rows, hq, hkv, d, device)
        flops = sum(4 * n * (c + (n + 1) / 2) * hq * d for c, n in rows) * 32
        times = {}
        for v in VARIANTS:
            try:
                times[variant_name(v)] = run_variant(part, v)
            except Exception as err:  # a tile that does not fit (shared memory), recorded as such
                times[variant_name(v)] = f"{type(err).__name__}: {str(err)[:80]}"
        numeric = {k: t for k, t in times.items() if isinstance(t, float)}
        best = min(numeric, key=numeric.get)
        results.append({"case": name, "rows": rows, "ms_32_layers": times, "best": best,
                        "best_ms": numeric[best], "heuristic_ms": numeric["heuristic"],
                        "heuristic_tflops": flops / numeric["heuristic"] / 1e9,
                        "best_tflops": flops / numeric[best] / 1e9})
        print(f"{name:>16}: heuristic {numeric['heuristic']:.3f} ms, best {best} {numeric[best]:.3f} ms",
              flush=True)
        del part
        torch.cuda.empty_cache()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": __import__("triton").__version__, "cases": results, "wall_s": time.perf_counter() - t0}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
