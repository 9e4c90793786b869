"""Sweep the decode tile shape of paged attention on a GPU (bandwidth-bound batches of one-token rows).

    PYTHONPATH=. python benchmarks/kernels/decode_tune.py --out decode_tune.json

For each model shape, row count and context it times every (tile_n, num_warps, num_stages) candidate
of the unified kernel (no split) and prints the achieved KV-read GB/s beside the current default, so
better entries for DECODE_TILE_N / the decode warps and stages can be chosen from one run.
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import replace
from pathlib import Path

import torch
import triton

from plait.kernels.paged_attention import PagedAttentionPlan, paged_attention, plan_paged_attention

SHAPES = {"qwen3-0.6b": (16, 8, 128), "llama-8b": (32, 8, 128)}  # (Hq, Hkv, D)
BLOCK_SIZE = 16
CANDIDATES = list(itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4)))  # tile_n, warps, stages


def _case(rows: int, context: int, hq: int, hkv: int, d: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    blocks_per_row = triton.cdiv(context, BLOCK_SIZE)
    num_blocks = rows * blocks_per_row + 1
    k = torch.randn(num_blocks, BLOCK_SIZE, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    # Shuffled blocks, as a long-running cache has them.
    tables = (torch.randperm(num_blocks - 1, device="cuda", generator=g) + 1)[: rows * blocks_per_row]
    tables = tables.view(rows, blocks_per_row).int()
    q = torch.randn(rows, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    qsl = torch.arange(rows + 1, device="cuda", dtype=torch.int32)
    seq_lens = torch.full((rows,), context, device="cuda", dtype=torch.int32)
    kv_bytes = rows * context * hkv * d * 2 * 2
    return q, k, v, qsl, seq_lens, tables, kv_bytes


def _time(case: tuple, plan: PagedAttentionPlan, context: int) -> float:
    q, k, v, qsl, seq_lens, tables, _ = case
    out = torch.empty_like(q)
    scale = q.shape[-1] ** -0.5
    fn = lambda: paged_attention(q, k, v, out, qsl, seq_lens, tables, scale, 1, context, plan=plan)
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3


def _sweep(name: str, rows: int, context: int) -> dict:
    hq, hkv, d = SHAPES[name]
    case = _case(rows, context, hq, hkv, d)
    kv_bytes = case[-1]
    base = plan_paged_attention(rows, rows, hq, hkv, d, torch.bfloat16, 1, context, case[0].device,
                                num_kv_splits=1)
    default_s = _time(case, base, context)
    other_order = replace(base.config, heads_fastest=not base.config.heads_fastest)
    other_order_s = _time(case, PagedAttentionPlan(other_order), context)
    # The same values stored head-major ([blocks, Hkv, block_size, D]): a kv head's keys of a block in
    # one 4 KB run. Measured on an H200: within 0.2% of the runner's token-major layout, so not used.
    as_head_major = lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)
    head_major = (case[0], as_head_major(case[1]), as_head_major(case[2]), *case[3:])
    head_major_s = _time(head_major, base, context)
    timings = []
    for tile_n, warps, stages in CANDIDATES:
        cfg = replace(base.config, tile_n=tile_n, num_warps=warps, num_stages=stages)
        try:
            timings.append((_time(case, PagedAttentionPlan(cfg), context), tile_n, warps, stages))
        except Exception:  # a config that does not fit (shared memory, registers) is skipped
            timings.append((float("inf"), tile_n, warps, stages))
    best = min(timings)
    row = {"model": name, "rows": rows, "context": context, "default": vars(base.config),
           "default_GBps": kv_bytes / default_s / 1e9, "best_GBps": kv_bytes / best[0] / 1e9,
           "other_launch_order_GBps": kv_bytes / other_order_s / 1e9,
           "head_major_cache_GBps": kv_bytes / head_major_s / 1e9,
           "best": {"tile_n": best[1], "num_warps": best[2], "num_stages": best[3]},
           "all": [[t[1], t[2], t[3], kv_bytes / t[0] / 1e9] for t in timings]}
    print(f"{name:11s} rows {rows:3d} ctx {context:5d}: default {row['default_GBps']:6.0f} GB/s "
          f"(tile {base.config.tile_n} w{base.config.num_warps} s{base.config.num_stages}, heads fastest "
          f"{base.config.heads_fastest}; other order {row['other_launch_order_GBps']:6.0f}; "
          f"head-major cache {row['head_major_cache_GBps']:6.0f}), best "
          f"{row['best_GBps']:6.0f} (tile {best[1]} w{best[2]} s{best[3]})", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="64,256")
    parser.add_argument("--contexts", default="512,800,1024,2048")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    grid = itertools.product(SHAPES, map(int, args.rows.split(",")), map(int, args.contexts.split(",")))
    results = [_sweep(name, rows, context) for name, rows, context in grid]
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
