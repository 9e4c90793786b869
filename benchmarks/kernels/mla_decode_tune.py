"""Sweep MLA's decode tiles on a GPU: paged attention over DeepSeek's latent cache (512 + 64 wide rows).

    PYTHONPATH=. python benchmarks/kernels/mla_decode_tune.py --out mla_decode_tune.json

For each case (query heads, rows, context) it times every (tile_n, num_warps, num_stages, splits)
candidate of the one-token-row launch in a CUDA graph (launch latency out, as in a replayed decode step)
beside the default plan, and prints the best, so DECODE_TILE_N[512] / the decode warps and stages and the
split count for MLA can be chosen from one run.
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import replace
from pathlib import Path

import torch
import triton
from tqdm import tqdm

from plait.kernels.paged_attention import (
    PagedAttentionPlan,
    mla_cache_views,
    paged_attention,
    plan_paged_attention,
)

LATENT, ROPE = 512, 64  # DeepSeek-V2 / V3: kv_lora_rank, qk_rope_head_dim
BLOCK_SIZE = 16
# (query heads, rows, context): V2-Lite's 16 heads and V3's 128, W3's batch of one at W3's and a long
# context, and batches.
CASES = [(16, 1, 640), (16, 1, 4096), (16, 64, 1024), (128, 1, 640), (128, 8, 2048)]
TILES = list(itertools.product((16, 32, 64), (4, 8), (1, 2, 3)))  # tile_n, warps, stages
SPLITS = (None, 1, 4, 16)  # None: the heuristic's count, balanced on the device


def _case(heads: int, rows: int, context: int) -> tuple:
    g = torch.Generator(device="cuda").manual_seed(0)
    blocks_per_row = triton.cdiv(context, BLOCK_SIZE)
    num_blocks = rows * blocks_per_row + 1
    latent = torch.randn(num_blocks, BLOCK_SIZE, 1, LATENT + ROPE, device="cuda", dtype=torch.bfloat16,
                         generator=g)
    k, v = mla_cache_views(latent, heads, LATENT)
    tables = (torch.randperm(num_blocks - 1, device="cuda", generator=g) + 1)[: rows * blocks_per_row]
    q = torch.randn(rows, heads, LATENT + ROPE, device="cuda", dtype=torch.bfloat16, generator=g)
    out = torch.empty(rows, heads, LATENT, device="cuda", dtype=torch.bfloat16)
    qsl = torch.arange(rows + 1, device="cuda", dtype=torch.int32)
    seq_lens = torch.full((rows,), context, device="cuda", dtype=torch.int32)
    return q, k, v, out, qsl, seq_lens, tables.view(rows, blocks_per_row).int()


def _time_us(case: tuple, plan: PagedAttentionPlan, context: int) -> float:
    q, k, v, out, qsl, seq_lens, tables = case
    fn = lambda: paged_attention(q, k, v, out, qsl, seq_lens, tables, 0.1, 1, context, plan=plan)
    fn()  # compile outside the graph
    return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3


def _plan(heads: int, rows: int, context: int, splits: int | None) -> PagedAttentionPlan:
    return plan_paged_attention(rows, rows, heads, heads // 16, LATENT, torch.bfloat16, 1, context,
                                torch.device("cuda"), num_kv_splits=splits)


def _sweep(heads: int, rows: int, context: int, bar: tqdm) -> dict:
    case = _case(heads, rows, context)
    default = _plan(heads, rows, context, None)
    default_us = _time_us(case, default, context)
    timings = []
    for splits, (tile_n, warps, stages) in itertools.product(SPLITS, TILES):
        base = _plan(heads, rows, context, splits)
        more = {}
        if splits is None:  # the heuristic's minimum keys per split, in this plan's tiles
            keys = default.config.min_split_tiles * default.config.tile_n
            more = {"min_split_tiles": max(1, keys // tile_n)}
        config = replace(base.config, tile_n=tile_n, num_warps=warps, num_stages=stages, **more)
        plan = replace(base, config=config)
        try:
            timings.append((_time_us(case, plan, context), tile_n, warps, stages, splits))
        except Exception as e:  # a config that does not fit (shared memory, registers) is skipped
            timings.append((float("inf"), tile_n, warps, stages, splits, type(e).__name__))
        bar.update()
    best = min(timings, key=lambda t: t[0])
    c = default.config
    row = {"heads": heads, "rows": rows, "context": context, "default": vars(c), "default_us": default_us,
           "best_us": best[0], "best": {"tile_n": best[1], "num_warps": best[2], "num_stages": best[3],
                                        "splits": best[4]},
           "all": [list(t) for t in timings]}
    print(f"heads {heads:3d} rows {rows:3d} ctx {context:5d}: default {default_us:6.1f} us (tile {c.tile_n} "
          f"w{c.num_warps} s{c.num_stages} splits {c.num_splits}), best {best[0]:6.1f} us (tile {best[1]} "
          f"w{best[2]} s{best[3]} splits {best[4]})", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with tqdm(total=len(CASES) * len(SPLITS) * len(TILES), desc="MLA decode configs") as bar:
        results = [_sweep(*case, bar) for case in CASES]
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "cases": results},
                                             indent=1))


if __name__ == "__main__":
    main()
