"""Dense-kernel benchmark (GPU): skinny GEMM vs cuBLAS at decode batch sizes, norms/rotary/SiLU vs torch.

    PYTHONPATH=. python benchmarks/kernels/dense_bench.py --out benchmarks/results/dense_kernels.json

Times are medians of CUDA-graph replays (triton.testing.do_bench_cudagraph): each graph holds a run
of back-to-back calls, as a captured decode step does. Plain do_bench zeroes a 256 MB buffer before
every call, leaving L2 full of dirty lines whose write-back would compete with the weight reads
being measured; here instead every call reads the next of several weight copies, together at least
L2_COPIES_FACTOR x the L2 size, so no weight is in L2 when it is read. Weight GB/s is set against
a large x.sum() read measured in the same run. Candidate configs are tried per shape; the best are
printed as lines to paste into SKINNY_CONFIGS / GATE_UP_CONFIGS (plait/kernels/skinny_gemm.py).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench, do_bench_cudagraph

from plait.kernels import activation, rms_norm, rotary, skinny_gemm
from plait.kernels.skinny_gemm import SkinnyConfig, heuristic_config, m_bucket, split_for
from plait.layers.rotary import RotaryEmbedding

MODELS = {
    "llama-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                 "lm_head": (128256, 4096)},
    "qwen3-0.6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
                   "lm_head": (151936, 1024)},
    "smollm3-3b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (22016, 2048), "down": (2048, 11008),
                   "lm_head": (128256, 2048)},
}
M_VALUES = (1, 2, 4, 8, 16)
DTYPE = torch.bfloat16
DEVICE = "cuda"
L2_COPIES_FACTOR = 3  # weight copies read in turn cover this many L2 sizes
MAX_COPY_BYTES = 6 * 1024**3
READ_BYTES = 2 * 1024**3  # the x.sum() bandwidth probe
REP_MS = 3  # per graph replay; do_bench_cudagraph takes the median of 10 replays
BETTER_BY = 1.03  # a candidate must beat the heuristic by 3% to be suggested for the table
ELEMENTWISE_T = (1, 256, 2048)
LLAMA = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, inter=14336)

# Alternatives tried per M bucket, beside the heuristic's pick; split-K is filled in per shape.
# (block_n, block_k, warps, prefetch): prefetch = K steps whose tiles are in flight ahead of the FMAs
FMA_CANDIDATES = [(4, 512, 4, 1), (8, 512, 4, 1), (8, 256, 4, 1), (16, 256, 8, 1), (8, 1024, 8, 1),
                  (8, 128, 4, 2)]
DOT_CANDIDATES = [(16, 256, 3), (32, 128, 4), (64, 128, 4), (32, 256, 3)]
# Past this many seconds the remaining shapes are swept --quick, so a run stays under 3 minutes.
SWEEP_BUDGET_S = 130
FMA_MAX_ELEMENTS = 8192  # the candidates may go past the heuristic's accumulator budget


def timed(fn: Callable[[], object]) -> float:
    """Median microseconds per call of fn inside a CUDA graph of back-to-back calls."""
    return do_bench_cudagraph(fn, rep=REP_MS, return_mode="median") * 1e3


def rotating(calls: list[Callable[[], object]]) -> Callable[[], object]:
    state = {"i": 0}

    def call() -> object:
        fn = calls[state["i"] % len(calls)]
        state["i"] += 1
        return fn()

    return call


def weight_copies(n: int, k: int, l2_bytes: int) -> list[torch.Tensor]:
    size = n * k * torch.finfo(DTYPE).bits // 8
    count = max(2, min(math.ceil(L2_COPIES_FACTOR * l2_bytes / size), MAX_COPY_BYTES // size))
    return [torch.empty(n, k, dtype=DTYPE, device=DEVICE).normal_(0, 0.02) for _ in range(count)]


def candidates(m: int, n: int, k: int, sms: int, halves: int) -> list[SkinnyConfig]:
    bm = m_bucket(m)
    out = [heuristic_config(m, n, k, sms, halves)]
    if bm <= 4:
        for bn, bk, warps, prefetch in FMA_CANDIDATES:
            if bm * bn * bk * halves <= FMA_MAX_ELEMENTS:
                split = split_for(triton.cdiv(n, bn), k, bk, sms)
                out.append(SkinnyConfig(bn, bk, split, use_dot=False, num_warps=warps, num_stages=1,
                                        prefetch=prefetch))
    for bn, bk, stages in DOT_CANDIDATES:
        split = split_for(triton.cdiv(n, bn), k, bk, sms)
        out.append(SkinnyConfig(bn, bk, split, use_dot=True, num_warps=4, num_stages=stages))
    unique = []
    for cfg in out:
        if cfg not in unique:
            unique.append(cfg)
    return unique


def gbps(nbytes: int, us: float) -> float:
    return nbytes / (us * 1e-6) / 1e9


def bench_linear(model: str, proj: str, n: int, k: int, sms: int, l2: int, read_gbps: float,
                 m_values: tuple[int, ...], quick: bool, deadline: float) -> list[dict]:
    ws = weight_copies(n, k, l2)
    rows = []
    for m in m_values:
        row = bench_one_m(model, proj, ws, m, sms, read_gbps, quick or time.perf_counter() > deadline)
        rows.append(row)
        print(f"{model:11s} {proj:8s} M={m:2d} cuBLAS {row['cublas_GBps']:7.0f} GB/s  "
              f"heuristic {row['heuristic_GBps']:7.0f}  best {row['best_GBps']:7.0f}", flush=True)
    del ws
    torch.cuda.empty_cache()
    return rows


def bench_one_m(model: str, proj: str, ws: list[torch.Tensor], m: int, sms: int, read_gbps: float,
                quick: bool) -> dict:
    n, k = ws[0].shape
    x = torch.randn(m, k, dtype=DTYPE, device=DEVICE)
    row = {"model": model, "proj": proj, "n": n, "k": k, "m": m, "weight_copies": len(ws), "quick": quick}
    row["cublas_us"] = timed(rotating([lambda w=w: F.linear(x, w) for w in ws]))
    results = []
    cands = candidates(m, n, k, sms, 1)
    for cfg in cands[:2] if quick else cands:
        t0 = time.perf_counter()
        us = timed(rotating([lambda w=w, c=cfg: skinny_gemm.skinny_linear(x, w, config=c) for w in ws]))
        results.append({"config": cfg.__dict__, "us": us, "wall_s": time.perf_counter() - t0})
    row["heuristic"] = results[0]
    row["best"] = min(results, key=lambda r: r["us"])
    row["candidates"] = results
    if m == 1:  # host launch cost shows when steps run without graphs
        row["eager_wall_us"] = {
            "cublas": eager_us(rotating([lambda w=w: F.linear(x, w) for w in ws])),
            "skinny": eager_us(rotating([lambda w=w: skinny_gemm.skinny_linear(x, w) for w in ws]))}
    if proj == "gate_up":
        row.update(bench_gate_up(x, ws, n // 2, k, sms, quick))
    wbytes = n * k * torch.finfo(DTYPE).bits // 8
    for key, us in [("cublas", row["cublas_us"]), ("heuristic", row["heuristic"]["us"]),
                    ("best", row["best"]["us"])]:
        row[f"{key}_GBps"] = gbps(wbytes, us)
        row[f"{key}_of_read_bw"] = gbps(wbytes, us) / read_gbps
    return row


def bench_gate_up(x: torch.Tensor, ws: list[torch.Tensor], inter: int, k: int, sms: int,
                  quick: bool) -> dict:
    """gate/up + SiLU-and-mul: fused kernel vs skinny + Triton silu vs cuBLAS + torch silu."""
    m = x.shape[0]
    out = {"unfused_torch_us": timed(rotating([lambda w=w: activation.silu_and_mul_ref(F.linear(x, w))
                                               for w in ws])),
           "unfused_triton_us": timed(rotating([lambda w=w: activation.silu_and_mul(
               skinny_gemm.skinny_linear(x, w)) for w in ws]))}
    results = []
    cands = candidates(m, inter, k, sms, 2)
    for cfg in cands[:2] if quick else cands[:4]:
        us = timed(rotating([lambda w=w, c=cfg: skinny_gemm.skinny_gate_up_silu(x, w, config=c) for w in ws]))
        results.append({"config": cfg.__dict__, "us": us})
    out["fused_heuristic"] = results[0]
    out["fused_best"] = min(results, key=lambda r: r["us"])
    out["fused_candidates"] = results
    return out


def bench_elementwise() -> list[dict]:
    """Triton vs the torch path for the norm, rotary and SiLU kernels at Llama-8B widths."""
    rows = []
    for t in ELEMENTWISE_T:
        for name, (tri, ref) in elementwise_ops(t).items():
            row = {"op": name, "t": t, "triton_us": timed(tri), "torch_us": timed(ref),
                   "triton_eager_us": eager_us(tri), "torch_eager_us": eager_us(ref)}
            rows.append(row)
            print(f"{name:19s} T={t:4d} triton {row['triton_us']:7.2f} us  torch {row['torch_us']:7.2f} us  "
                  f"(eager wall {row['triton_eager_us']:.1f} / {row['torch_eager_us']:.1f} us)", flush=True)
    return rows


def elementwise_ops(t: int) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    c, eps = LLAMA, 1e-5
    w = torch.randn(c["hidden"], dtype=DTYPE, device=DEVICE)
    cos_sin = RotaryEmbedding(c["head_dim"], 8192, 500000.0).cos_sin.to(DEVICE)
    x = torch.randn(t, c["hidden"], dtype=DTYPE, device=DEVICE)
    res = torch.randn_like(x)
    q_size, kv_size = c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"]
    qkv = torch.randn(t, q_size + 2 * kv_size, dtype=DTYPE, device=DEVICE)
    q = qkv[:, :q_size].view(t, c["heads"], c["head_dim"])
    k = qkv[:, q_size : q_size + kv_size].view(t, c["kv_heads"], c["head_dim"])
    pos = torch.randint(0, 8192, (t,), device=DEVICE)
    gate_up = torch.randn(t, 2 * c["inter"], dtype=DTYPE, device=DEVICE)
    return {
        "rms_norm": (lambda: rms_norm.rms_norm(x, w, eps), lambda: rms_norm.rms_norm_ref(x, w, eps)),
        "fused_add_rms_norm": (lambda: rms_norm.fused_add_rms_norm(x, res, w, eps),
                               lambda: rms_norm.fused_add_rms_norm_ref(x, res, w, eps)),
        "rotary": (lambda: rotary.apply_rotary(pos, q, k, cos_sin),
                   lambda: rotary.rotary_ref(pos, q, k, cos_sin)),
        "silu_and_mul": (lambda: activation.silu_and_mul(gate_up),
                         lambda: activation.silu_and_mul_ref(gate_up)),
    }


def eager_us(fn: Callable[[], object], calls: int = 200) -> float:
    """Wall microseconds per call launched eagerly (host launch cost included), no graph."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def read_bandwidth() -> float:
    probe = torch.empty(READ_BYTES // 2, dtype=DTYPE, device=DEVICE).normal_()
    ms = do_bench(lambda: probe.sum(dtype=torch.float32), return_mode="median")
    probe = None
    torch.cuda.empty_cache()
    return READ_BYTES / (ms * 1e-3) / 1e9


def suggestions(rows: list[dict]) -> list[str]:
    """Dict entries to paste into SKINNY_CONFIGS / GATE_UP_CONFIGS where a candidate beat the heuristic."""
    plain, gate = [], []
    for r in rows:
        if r["best"]["us"] * BETTER_BY < r["heuristic"]["us"]:
            plain.append(_entry((m_bucket(r["m"]), r["n"], r["k"]), r["best"]["config"], r, r["proj"]))
        if "fused_best" in r and r["fused_best"]["us"] * BETTER_BY < r["fused_heuristic"]["us"]:
            key = (m_bucket(r["m"]), r["n"] // 2, r["k"])
            gate.append(_entry(key, r["fused_best"]["config"], r, "gate_up+silu"))
    lines = ["SKINNY_CONFIGS entries:"] + plain if plain else []
    return lines + (["GATE_UP_CONFIGS entries:"] + gate if gate else [])


def _entry(key: tuple[int, int, int], cfg: dict, row: dict, what: str) -> str:
    args = ", ".join(f"{name}={value}" for name, value in cfg.items())
    return f"    {key}: SkinnyConfig({args}),  # {row['model']} {what} M={row['m']}"


def print_tables(read_gbps: float, lin: list[dict], elem: list[dict], lines: list[str]) -> None:
    print(f"\nHBM read bandwidth (x.sum over {READ_BYTES >> 30} GiB): {read_gbps:.0f} GB/s")
    print("\nweight GB/s (share of read bandwidth)   skinny/cuBLAS time ratio < 1 means skinny is faster")
    print(f"{'model':11s} {'proj':8s} {'M':>3s} {'cuBLAS':>13s} {'heuristic':>13s} {'best':>13s} "
          f"{'best/cuBLAS':>11s}  best config")
    for r in lin:
        cells = [f"{r[f'{k}_GBps']:6.0f} ({r[f'{k}_of_read_bw']:4.0%})"
                 for k in ("cublas", "heuristic", "best")]
        b = r["best"]["config"]
        cfg = (f"{'dot' if b['use_dot'] else 'fma'} n{b['block_n']} k{b['block_k']} s{b['split_k']} "
               f"w{b['num_warps']} st{b['num_stages']}")
        print(f"{r['model']:11s} {r['proj']:8s} {r['m']:3d} {cells[0]:>13s} {cells[1]:>13s} {cells[2]:>13s} "
              f"{r['best']['us'] / r['cublas_us']:11.2f}  {cfg}")
    gate = [r for r in lin if "fused_best" in r]
    if gate:
        print("\ngate_up + silu_and_mul (us): cuBLAS+torch | skinny+triton silu | fused heuristic | "
              "fused best")
        for r in gate:
            print(f"{r['model']:11s} M={r['m']:2d} {r['unfused_torch_us']:8.1f} "
                  f"{r['unfused_triton_us']:8.1f} {r['fused_heuristic']['us']:8.1f} "
                  f"{r['fused_best']['us']:8.1f}")
    print("\nelementwise (us, graph replay): triton vs torch path")
    for r in elem:
        print(f"{r['op']:19s} T={r['t']:4d} {r['triton_us']:8.2f} {r['torch_us']:8.2f}  "
              f"x{r['torch_us'] / r['triton_us']:.2f}")
    print("\nconfig lines (best beat the heuristic by > 3%):" if lines
          else "\nheuristic was within 3% everywhere")
    for line in lines:
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/dense_kernels.json")
    parser.add_argument("--models", nargs="*", default=sorted(MODELS))
    parser.add_argument("--m", nargs="*", type=int, default=list(M_VALUES))
    parser.add_argument("--quick", action="store_true", help="heuristic + one alternative per shape")
    args = parser.parse_args()
    start = time.perf_counter()
    props = torch.cuda.get_device_properties(0)
    sms, l2 = props.multi_processor_count, props.L2_cache_size
    read_gbps = read_bandwidth()
    print(f"{props.name}: {sms} SMs, L2 {l2 >> 20} MiB, read {read_gbps:.0f} GB/s", flush=True)
    lin = []
    for model in args.models:
        for proj, (n, k) in MODELS[model].items():
            lin += bench_linear(model, proj, n, k, sms, l2, read_gbps, tuple(args.m), args.quick,
                                start + SWEEP_BUDGET_S)
    elem = bench_elementwise()
    lines = suggestions(lin)
    result = {"gpu": props.name, "sms": sms, "l2_bytes": l2, "read_GBps": read_gbps,
              "torch": torch.__version__, "triton": triton.__version__, "linear": lin, "elementwise": elem,
              "config_lines": lines, "wall_s": time.perf_counter() - start}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print_tables(read_gbps, lin, elem, lines)
    print(f"\nwrote {args.out} in {result['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
