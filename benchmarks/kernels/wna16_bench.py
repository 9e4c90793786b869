"""W4A16 GEMM benchmark (GPU): plait's Triton kernel against cuBLAS bf16 and the weight-read floor.

    PYTHONPATH=. python -m benchmarks.kernels.wna16_bench --out benchmarks/results/wna16_kernels_h200.json

Llama-8B's projections as a GPTQ / AWQ checkpoint holds them (4-bit codes, fp16 scales and zeros per
128-row group), x in bf16, at decode and prompt row counts. Times are medians of CUDA-graph replays
(dense_bench.timed), each call reading the next of several weight copies that together
exceed L2 three times over, so no weight is read from L2. The floor is the layer's bytes (codes, scales,
zeros, x, out) at the read bandwidth of a large x.sum() measured in the same run. Decode row counts also try
a small sweep of launch shapes (FMA_CONFIGS holds the one-row winners). `dequant_then_cublas_us` is torch's
reference dequantisation then cuBLAS (what a kernel-less path would cost), not the kernel's own prompt path.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.kernels.dense_bench import L2_COPIES_FACTOR, read_bandwidth, rotating, timed
from plait.kernels.skinny_gemm import sm_count
from plait.kernels.wna16_gemm import (
    DEQUANT_MIN_M,
    FMA_MAX_M,
    FmaConfig,
    WNA16Config,
    default_config,
    fma_config,
    wna16_gemm,
)
from plait.layers.wna16 import WNA16Spec, dequantize, pack_rows, quantize_rtn

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
M_VALUES = (1, 2, 4, 8, 16, 64, 256, 1024, 4096)
SWEEP_M = (1, 4, 16)
GROUP = 128
# Launch shapes tried: the FMA GEMV's up to FMA_MAX_M rows, the dot GEMV's above.
DOT_CANDIDATES = [WNA16Config(16, bn, bk, 0, 1, w, s) for bn in (32, 64, 128) for bk in (64, 128, 256)
                  for w in (4,) for s in (3, 4)]
FMA_CANDIDATES = [FmaConfig(bn, bw, 0, w, s) for bn in (64, 128, 256) for bw in (16, 32, 64) for w in (4, 8)
                  for s in (2, 3)]


def layers(n: int, k: int, l2: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Copies of one random layer: (codes, scales, zeros, its bf16 weight)."""
    spec = WNA16Spec("gptq", 4, GROUP, sym=True)
    w = torch.randn(n, k, device="cuda") * 0.02
    q, s, z = quantize_rtn(w, spec)
    codes, zeros = pack_rows(q, 4), z.to(torch.uint8)
    dense = dequantize(codes, s, zeros, 4, torch.bfloat16)
    copies = max(2, math.ceil(L2_COPIES_FACTOR * l2 / layer_bytes((codes, s, zeros))))
    return [(codes.clone(), s.clone(), zeros.clone(), dense) for _ in range(copies)]


def layer_bytes(layer: tuple[torch.Tensor, ...]) -> int:
    codes, scales, zeros = layer[:3]
    return codes.numel() * 4 + scales.numel() * 2 + zeros.numel()


def path(m: int, n: int, k: int, device: torch.device) -> str:
    """Which of wna16_gemm's paths a call of m rows takes, with its launch shape."""
    if m >= DEQUANT_MIN_M:
        return "dequantise, then cuBLAS"
    fma = fma_config(m, n, k, k // GROUP, 4)
    return f"FMA GEMV {fma}" if fma is not None else f"dot {default_config(m, n, k, sm_count(device))}"


def bench_m(name: str, x: torch.Tensor, copies: list, dense: list[torch.Tensor], gbps: float,
            sweep: bool) -> dict:
    """One row count of one layer: the kernel (and at SWEEP_M its launch-shape sweep), cuBLAS bf16 on the
    dequantised weight, dequantising then cuBLAS, and the floor."""
    (m, k), n = x.shape, copies[0][0].shape[1]
    floor_us = (layer_bytes(copies[0]) + (m * k + m * n) * 2) / gbps / 1e3
    triton_us = timed(rotating([lambda c=c: wna16_gemm(x, c[0], c[1], c[2], 4) for c in copies]))
    cublas_us = timed(rotating([lambda w=w: F.linear(x, w) for w in dense]))
    deq_us = timed(rotating([lambda c=c: F.linear(x, dequantize(c[0], c[1], c[2], 4, torch.bfloat16))
                             for c in copies[:2]]))
    ref = F.linear(x.float(), copies[0][3].float())
    err = (wna16_gemm(x, *copies[0][:3], 4).float() - ref).abs().max().item() / ref.abs().max().item()
    row = {"layer": name, "n": n, "k": k, "m": m, "triton_us": triton_us, "cublas_bf16_us": cublas_us,
           "dequant_then_cublas_us": deq_us, "floor_us": floor_us, "x_floor": triton_us / floor_us,
           "tflops": 2 * m * n * k / triton_us / 1e6, "rel_err": err,
           "path": path(m, n, k, x.device)}
    if sweep and m in SWEEP_M:
        timings = [(timed(rotating([lambda c=c, cand=cand: wna16_gemm(x, c[0], c[1], c[2], 4, config=cand)
                                    for c in copies])), cand)
                   for cand in (FMA_CANDIDATES if m <= FMA_MAX_M else DOT_CANDIDATES)]
        best = min(timings, key=lambda t: t[0])
        row["sweep_best_us"], row["sweep_best"] = best[0], best[1].__dict__
    print(f"{name:8s} m={m:5d} triton {triton_us:8.1f} us ({row['x_floor']:.2f}x floor {floor_us:.1f}, "
          f"{row['tflops']:.0f} TFLOP/s) cublas-bf16 {cublas_us:8.1f} deq+cublas {deq_us:8.1f}"
          + (f" sweep {row['sweep_best_us']:.1f} {row['sweep_best']}" if "sweep_best" in row else ""),
          flush=True)
    return row


def bench_shape(name: str, n: int, k: int, l2: int, gbps: float, m_values: tuple[int, ...],
                sweep: bool) -> list[dict]:
    copies = layers(n, k, l2)
    dense = [copies[0][3].clone() for _ in range(max(2, math.ceil(L2_COPIES_FACTOR * l2 / (n * k * 2))))]
    return [bench_m(name, torch.randn(m, k, device="cuda", dtype=torch.bfloat16), copies, dense, gbps, sweep)
            for m in m_values]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=None)
    p.add_argument("--m", default=",".join(map(str, M_VALUES)), help="row counts (comma-separated)")
    p.add_argument("--no-sweep", action="store_true", help="time the default launch shapes only")
    args = p.parse_args()
    props = torch.cuda.get_device_properties(0)
    l2 = props.L2_cache_size
    gbps = read_bandwidth()
    print(f"{props.name}: read {gbps:.0f} GB/s, L2 {l2 / 2**20:.0f} MiB")
    start = time.time()
    m_values = tuple(int(m) for m in args.m.split(","))
    rows = [r for name, (n, k) in SHAPES.items()
            for r in bench_shape(name, n, k, l2, gbps, m_values, not args.no_sweep)]
    result = {"device": props.name, "read_gbps": gbps, "group": GROUP, "bits": 4, "x_dtype": "bfloat16",
              "scale_dtype": "float16", "seconds": time.time() - start, "rows": rows}
    decode = [r for r in rows if r["m"] == 1]
    result["llama8b_layer_sum_m1"] = {k: sum(r[k] for r in decode) * 32 for k in
                                      ("triton_us", "cublas_bf16_us", "floor_us")}
    print("32 layers at m=1:", {k: round(v, 1) for k, v in result["llama8b_layer_sum_m1"].items()})
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
