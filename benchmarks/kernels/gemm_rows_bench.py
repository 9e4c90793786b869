"""Mixed-step GEMMs (GPU): cuBLAS against Triton tiles at 256-1024 rows, the shapes of a step that carries
a prompt chunk beside decodes.

    PYTHONPATH=. python benchmarks/kernels/gemm_rows_bench.py --out benchmarks/results/gemm_rows_h200.json

W4's goal needs a Llama-8B step of ~256 rows to finish within ~1.5x a decode step; in the step profile
(mixed_step_costs_h200.json) cuBLAS ran o and down at ~475 TFLOP/s there, gate/up at ~600. This measures
each projection alone, cuBLAS (both of torch's BLAS libraries) against Triton GEMMs on TMA descriptors
with and without split-K, timed as dense_bench.py times: CUDA-graph replays, every call reading the
next of several weight copies (none in L2). Dense peak is measured in the same run (an 8192^3 matmul).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from tqdm import tqdm
from triton.tools.tensor_descriptor import TensorDescriptor

from benchmarks.kernels.dense_bench import MODELS, rotating, timed, weight_copies
from plait.kernels.interpreter import static_iters, trip_count

DTYPE = torch.bfloat16
DEVICE = "cuda"
M_VALUES = (256, 384, 512, 1024)
PROJS = ("qkv", "o", "gate_up", "down")
# (block_m, block_n, block_k, num_stages, num_warps)
TILES = [
    (128, 256, 64, 4, 8), (128, 256, 64, 3, 8), (128, 128, 64, 4, 4), (128, 128, 64, 5, 8),
    (128, 128, 128, 3, 8), (64, 256, 64, 4, 4), (64, 128, 128, 4, 4), (64, 128, 64, 5, 4),
    (256, 128, 64, 4, 8), (128, 192, 64, 4, 8),
]
SPLITS = (1, 2, 4)
REDUCE_BLOCK = 1024


@triton.jit
def _gemm_kernel(a_desc, b_desc, c_ptr, part_ptr, M, N, k_iters, STATIC_ITERS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    # Program (tile, split): tiles run M-fastest, so the programs that read one weight tile are adjacent
    # and the second reads it from L2.
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m
    pid_n = pid // num_m
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    k0 = split * k_iters * BLOCK_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for it in range(trip_count(STATIC_ITERS, k_iters)):
        a = a_desc.load([off_m, k0 + it * BLOCK_K])  # [BLOCK_M, BLOCK_K]
        b = b_desc.load([off_n, k0 + it * BLOCK_K])  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(a, b.T, acc)
    rows = off_m + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, BLOCK_N)
    mask = rows[:, None] < M
    if SPLIT == 1:
        tl.store(c_ptr + rows[:, None] * N + cols[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        base = part_ptr + split.to(tl.int64) * M * N
        tl.store(base + rows[:, None] * N + cols[None, :], acc, mask=mask)


@triton.jit
def _reduce_kernel(part_ptr, c_ptr, total, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(part_ptr + s * total + offs, mask=mask, other=0.0)
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)


class TritonGemm:
    """x @ w.T for one weight, one tile config and one split, with its descriptors built once."""

    def __init__(self, x: torch.Tensor, w: torch.Tensor, tile: tuple, split: int) -> None:
        bm, bn, bk, self.stages, self.warps = tile
        self.bm, self.bn, self.bk, self.split = bm, bn, bk, split
        m, k = x.shape
        n = w.shape[0]
        self.m, self.n, self.k = m, n, k
        self.a = TensorDescriptor.from_tensor(x, [bm, bk])
        self.b = TensorDescriptor.from_tensor(w, [bn, bk])
        self.out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        self.part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else self.out
        self.grid = (triton.cdiv(m, bm) * (n // bn), split)

    def __call__(self) -> torch.Tensor:
        iters = self.k // self.split // self.bk
        _gemm_kernel[self.grid](self.a, self.b, self.out, self.part, self.m, self.n, iters,
                                STATIC_ITERS=static_iters(self.out.is_cuda, iters),
                                BLOCK_M=self.bm, BLOCK_N=self.bn, BLOCK_K=self.bk, SPLIT=self.split,
                                num_stages=self.stages, num_warps=self.warps)
        if self.split > 1:
            total = self.m * self.n
            _reduce_kernel[(triton.cdiv(total, REDUCE_BLOCK),)](self.part, self.out, total, SPLIT=self.split,
                                                                BLOCK=REDUCE_BLOCK)
        return self.out


def valid(tile: tuple, split: int, n: int, k: int) -> bool:
    bm, bn, bk, stages, _ = tile
    smem = (bm + bn) * bk * 2 * stages
    return n % bn == 0 and k % (bk * split) == 0 and smem <= 220 * 1024


def tflops(m: int, n: int, k: int, us: float) -> float:
    return 2 * m * n * k / (us * 1e-6) / 1e12


def dense_peak() -> float:
    a = torch.randn(8192, 8192, dtype=DTYPE, device=DEVICE)
    b = torch.randn(8192, 8192, dtype=DTYPE, device=DEVICE)
    us = timed(lambda: a @ b)
    return tflops(8192, 8192, 8192, us)


def bench_shape(proj: str, n: int, k: int, l2: int, bar: tqdm) -> list[dict]:
    ws = weight_copies(n, k, l2)
    rows = []
    for m in M_VALUES:
        x = torch.randn(m, k, dtype=DTYPE, device=DEVICE)
        ref = F.linear(x, ws[0]).float()
        row = {"proj": proj, "m": m, "n": n, "k": k, "weight_copies": len(ws)}
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            row[f"{lib}_us"] = timed(rotating([lambda w=w, x=x: F.linear(x, w) for w in ws]))
        torch.backends.cuda.preferred_blas_library("cublas")
        results = []
        for tile in TILES:
            for split in SPLITS:
                bar.update(1)
                if not valid(tile, split, n, k):
                    continue
                try:
                    gemms = [TritonGemm(x, w, tile, split) for w in ws]
                    got = gemms[0]().float()
                    err = ((got - ref).abs().max() / ref.abs().max()).item()
                    us = timed(rotating(gemms))
                except Exception as exc:  # a tile that does not compile (shared memory) is skipped, said
                    results.append({"tile": tile, "split": split, "error": repr(exc)[:200]})
                    continue
                results.append({"tile": tile, "split": split, "us": us, "rel_err": err})
                del gemms
        ok = [r for r in results if "us" in r]
        best = min(ok, key=lambda r: r["us"])
        row["triton_best"] = best
        row["triton_all"] = results
        cub = min(row["cublas_us"], row["cublaslt_us"])
        row["tflops"] = {"cublas": tflops(m, n, k, row["cublas_us"]),
                         "cublaslt": tflops(m, n, k, row["cublaslt_us"]),
                         "triton_best": tflops(m, n, k, best["us"])}
        row["triton_over_best_cublas"] = cub / best["us"]
        tf = row["tflops"]
        print(f"\n{proj:8s} M={m:5d} cuBLAS {row['cublas_us']:7.1f} us ({tf['cublas']:4.0f} TF/s)"
              f"  cuBLASLt {row['cublaslt_us']:7.1f}  triton {best['us']:7.1f} ({tf['triton_best']:4.0f})"
              f" {best['tile']} split {best['split']}  err {best['rel_err']:.1e}", flush=True)
        rows.append(row)
    del ws
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="llama-8b", choices=sorted(MODELS))
    args = parser.parse_args()
    start = time.perf_counter()
    props = torch.cuda.get_device_properties(0)
    peak = dense_peak()
    print(f"{props.name}: dense bf16 8192^3 matmul {peak:.0f} TFLOP/s", flush=True)
    shapes = MODELS[args.model]
    total = len(PROJS) * len(M_VALUES) * len(TILES) * len(SPLITS)
    rows = []
    with tqdm(total=total, desc="GEMM configs") as bar:
        for proj in PROJS:
            n, k = shapes[proj]
            rows += bench_shape(proj, n, k, props.L2_cache_size, bar)
    result = {"device": props.name, "torch": torch.__version__, "triton": triton.__version__,
              "model": args.model, "dense_peak_tflops": peak, "rows": rows,
              "wall_s": time.perf_counter() - start,
              "command": "PYTHONPATH=. python benchmarks/kernels/gemm_rows_bench.py --out " + str(args.out)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print("\nsum over the four projections (us):")
    for m in M_VALUES:
        sel = [r for r in rows if r["m"] == m]
        cub = sum(min(r["cublas_us"], r["cublaslt_us"]) for r in sel)
        tri = sum(min(r["triton_best"]["us"], r["cublas_us"], r["cublaslt_us"]) for r in sel)
        print(f"M={m:5d} best cuBLAS {cub:7.1f}  best of all {tri:7.1f}  ({cub / tri:.3f}x)")


if __name__ == "__main__":
    main()
