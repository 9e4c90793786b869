"""Fused rotary + KV store (one launch) against apply_rotary then store_kv (two), Llama-8B attention shapes.

    PYTHONPATH=. python benchmarks/kernels/rope_store_bench.py --out benchmarks/results/rope_store_h200.json

Each token count is timed with triton.testing.do_bench (median of eager launches, L2 flushed between
them); the 1-token case, a batch-1 decode layer's, also as the median of CUDA-graph replays of back-to-back
calls (do_bench_cudagraph), as a captured decode step launches them, with PDL on and off where the device
has it. Before timing, the fused result is checked bit for bit against the two kernels.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

from plait.kernels import pdl
from plait.kernels.rope_store import rope_store_kv
from plait.kernels.rotary import apply_rotary
from plait.kernels.store_kv import store_kv
from plait.layers.rotary import RotaryEmbedding

LLAMA_8B = dict(heads=32, kv_heads=8, head_dim=128, theta=500000.0)
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
DEVICE = "cuda"
MAX_POSITIONS = 8192
TOKENS = (1, 16384)
GRAPH_TOKENS = 1  # decode: launch latency dominates, so it is timed as a captured step runs it
REP_MS = 100  # do_bench's measuring time per case
GRAPH_REP_MS = 20  # per graph replay; do_bench_cudagraph takes the median of 10 replays


def make_case(t: int, seed: int = 0) -> dict:
    """q, k, v as views of one fused qkv output; slots of a prefill whose blocks are shuffled over a pool."""
    c = LLAMA_8B
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    hq, hkv, d = c["heads"], c["kv_heads"], c["head_dim"]
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g, device=DEVICE).to(DTYPE)
    num_blocks = triton.cdiv(t, BLOCK_SIZE) + 1
    blocks = torch.randperm(num_blocks, generator=g, device=DEVICE)[: triton.cdiv(t, BLOCK_SIZE)]
    tokens = torch.arange(t, device=DEVICE)
    return {
        "q": qkv[:, : hq * d].view(t, hq, d),
        "k": qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d),
        "v": qkv[:, (hq + hkv) * d :].view(t, hkv, d),
        "cache": torch.zeros(2, num_blocks, BLOCK_SIZE, hkv, d, dtype=DTYPE, device=DEVICE),
        "slots": blocks[tokens // BLOCK_SIZE] * BLOCK_SIZE + tokens % BLOCK_SIZE,
        "positions": torch.randint(0, MAX_POSITIONS, (t,), generator=g, device=DEVICE),
        "cos_sin": RotaryEmbedding(d, MAX_POSITIONS, c["theta"]).cos_sin.to(DEVICE),
    }


def ops(case: dict) -> dict[str, Callable[[], object]]:
    q, k, v, cache, slots = (case[n] for n in ("q", "k", "v", "cache", "slots"))
    pos, cs = case["positions"], case["cos_sin"]

    def separate() -> torch.Tensor:
        q_rot, k_rot = apply_rotary(pos, q, k, cs)
        store_kv(k_rot, v, cache[0], cache[1], slots)
        return q_rot

    return {"fused": lambda: rope_store_kv(pos, q, k, v, cs, cache[0], cache[1], slots), "separate": separate}


def check_exact(case: dict, fns: dict[str, Callable[[], object]]) -> bool:
    results = {}
    for name, fn in fns.items():
        case["cache"].zero_()
        results[name] = (fn(), case["cache"].clone())
    (q_a, c_a), (q_b, c_b) = results.values()
    return torch.equal(q_a, q_b) and torch.equal(c_a, c_b)


def moved_bytes(t: int, fused: bool) -> int:
    """HBM bytes each way would move at least: fused reads q, k, v once and writes q_out and both caches;
    the pair also writes the rotated k and reads it back for the store."""
    c, elem = LLAMA_8B, torch.finfo(DTYPE).bits // 8
    q, kv = t * c["heads"] * c["head_dim"] * elem, t * c["kv_heads"] * c["head_dim"] * elem
    return 2 * (q + 2 * kv) if fused else 2 * (q + kv) + 2 * (2 * kv)


def bench(t: int) -> list[dict]:
    case = make_case(t)
    fns = ops(case)
    exact = check_exact(case, fns)
    rows = []
    for name, fn in fns.items():
        us = do_bench(fn, rep=REP_MS, return_mode="median") * 1e3
        rows.append({"tokens": t, "op": name, "timing": "do_bench", "pdl": pdl.use_pdl(case["q"]), "us": us,
                     "GBps": moved_bytes(t, name == "fused") / (us * 1e-6) / 1e9, "exact": exact})
    if t == GRAPH_TOKENS:
        pdl_modes = (True, False) if pdl.use_pdl(case["q"]) else (False,)
        for enabled in pdl_modes:
            pdl.set_pdl_enabled(enabled)
            try:
                for name, fn in ops(case).items():
                    us = do_bench_cudagraph(fn, rep=GRAPH_REP_MS, return_mode="median") * 1e3
                    rows.append({"tokens": t, "op": name, "timing": "graph", "pdl": enabled, "us": us,
                                 "GBps": moved_bytes(t, name == "fused") / (us * 1e-6) / 1e9, "exact": exact})
            finally:
                pdl.set_pdl_enabled(True)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"\n{'tokens':>6s} {'timing':>8s} {'pdl':>5s} {'separate us':>12s} {'fused us':>9s} "
          f"{'saved us':>9s} {'fused/sep':>9s} {'fused GB/s':>10s}  exact")
    keys = sorted({(r["tokens"], r["timing"], r["pdl"]) for r in rows}, key=lambda x: (x[0], x[1], not x[2]))
    for key in keys:
        pair = {r["op"]: r for r in rows if (r["tokens"], r["timing"], r["pdl"]) == key}
        sep, fused = pair["separate"], pair["fused"]
        print(f"{key[0]:6d} {key[1]:>8s} {str(key[2]):>5s} {sep['us']:12.2f} {fused['us']:9.2f} "
              f"{sep['us'] - fused['us']:9.2f} {fused['us'] / sep['us']:9.2f} {fused['GBps']:10.0f}  "
              f"{fused['exact']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/rope_store.json")
    parser.add_argument("--tokens", nargs="*", type=int, default=list(TOKENS))
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    rows = []
    for t in args.tokens:
        rows += bench(t)
        print(f"T={t} done", flush=True)
    result = {"gpu": props.name, "torch": torch.__version__, "triton": triton.__version__,
              "shape": {**LLAMA_8B, "block_size": BLOCK_SIZE, "dtype": str(DTYPE)}, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print_table(rows)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
