"""W8A8 FP8 matmuls: per-token activation quantisation, a decode-sized FP8 GEMV, and the dispatch to them."""

# A matmul of an Fp8Linear runs in three parts on CUDA:
#   1. quantize_rows_fp8: each row of x gets its own scale (amax / 448) and is rounded to float8_e4m3fn
#      codes, one Triton launch. A row's codes depend on that row alone, so no token's arithmetic depends
#      on what else is in the step.
#   2a. up to SKINNY_MAX_M rows: fp8_skinny, a GEMV-shaped kernel that streams the 8-bit weight at HBM
#      bandwidth and multiplies codes on tensor cores (tl.dot of FP8 operands, x's rows padded to 16,
#      accumulated in fp32). No code is widened on CUDA cores, which is what bounded a
#      16-bit-activation version at ~50% of bandwidth.
#   2b. more rows: torch._scaled_mm (cuBLASLt's FP8 GEMM) with row-wise scales.
#   3. both apply scale_x[m] * scale_w[n] to the fp32 sums, then the bias, then round to x's dtype.
# plait.layers.fp8.fp8_linear_ref is the same function in torch (fp32 arithmetic on the dequantised
# codes): the CPU path, and the oracle of the tests.

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from plait.kernels.interpreter import static_iters, trip_count
from plait.kernels.pdl import pdl_args, pdl_prologue
from plait.kernels.skinny_gemm import program_tile, reduce_splits, sm_count
from plait.layers.fp8 import FP8_MAX, INV_FP8_MAX, MIN_SCALE

# Rows up to this take the FP8 GEMV; more take cuBLASLt's FP8 GEMM.
SKINNY_MAX_M = 16
# tl.dot's smallest N: x rows are padded up to it.
DOT_N = 16
# K elements a quantisation program reads per loop step.
QUANT_BLOCK_K = 1024


@dataclass(frozen=True)
class Fp8GemvConfig:
    block_n: int = 64  # weight rows per program
    block_k: int = 512  # K codes per loop step (512 bytes a weight row)
    split_k: int = 0  # programs along K; 0 = chosen to fill the GPU (split_for_gemv)
    num_warps: int = 4
    num_stages: int = 4  # loads in flight through shared memory


def _c(block_n: int, block_k: int, split_k: int, num_stages: int = 4) -> Fp8GemvConfig:
    return Fp8GemvConfig(block_n, block_k, split_k, 4, num_stages)


# Measured shapes, keyed by (M bucket: 1, 4 or 16, N, K): the fastest of a sweep over block_n 64/128,
# block_k 128-512, split 1-8 and 3-4 stages, each timed alone in a CUDA graph over 8 weight copies (H200,
# benchmarks/results/fp8_w8a8_h200.json). Others take Fp8GemvConfig() with split_for_gemv's split.
FP8_GEMV_CONFIGS: dict[tuple[int, int, int], Fp8GemvConfig] = {
    # llama-8b qkv: 10.0 / 10.0 / 9.6 us against an FP8 read floor of 5.9 (bf16 skinny 16.5 at M=1)
    (1, 6144, 4096): _c(128, 256, 2),
    (4, 6144, 4096): _c(128, 256, 2),
    (16, 6144, 4096): _c(64, 512, 1, num_stages=3),
    # llama-8b o: 8.2 / 7.9 / 7.7 us against an FP8 read floor of 3.9 (bf16 skinny 9.8 at M=1)
    (1, 4096, 4096): _c(64, 128, 4),
    (4, 4096, 4096): _c(64, 128, 4),
    (16, 4096, 4096): _c(64, 256, 4, num_stages=3),
    # llama-8b gate/up: 34.5 / 33.5 / 31.0 us against an FP8 read floor of 27.5 (bf16 skinny 57.3 at M=1)
    (1, 28672, 4096): _c(128, 256, 4, num_stages=3),
    (4, 28672, 4096): _c(64, 512, 1, num_stages=3),
    (16, 28672, 4096): _c(128, 128, 1),
    # llama-8b down: 18.4 / 18.3 / 17.9 us against an FP8 read floor of 13.8 (bf16 skinny 28.8 at M=1)
    (1, 4096, 14336): _c(128, 256, 4),
    (4, 4096, 14336): _c(128, 256, 4),
    (16, 4096, 14336): _c(64, 512, 2),
}
# The default config's split-K stops short of this many programs per SM: one wave, each program with
# num_stages tiles in flight, measured as fast as more, smaller programs.
GEMV_PROGRAMS_PER_SM = 1.5


def m_bucket(m: int) -> int:
    return 1 if m == 1 else 4 if m <= 4 else 16


def split_for_gemv(programs: int, k: int, block_k: int, num_sms: int) -> int:
    """The largest power-of-two split of K that keeps the launch within GEMV_PROGRAMS_PER_SM programs per
    SM, each split at least two K steps."""
    split = 1
    while programs * split * 2 <= GEMV_PROGRAMS_PER_SM * num_sms and k // (split * 2) >= 2 * block_k:
        split *= 2
    return split


@triton.jit
def round_to_e4m3(v):
    """v (fp32, |v| <= 448) rounded to the nearest float8_e4m3fn value, ties to even, as an fp32.

    Rounding here, then converting an exactly representable value, gives torch's codes bit for bit on
    any backend (Triton's CPU interpreter rounds fp8 conversions that carry into the exponent wrongly)."""
    # Normal range: keep 3 of fp32's 23 mantissa bits, round half to even on the 20 dropped.
    bits = v.to(tl.uint32, bitcast=True)
    normal = ((bits + (0x7FFFF + ((bits >> 20) & 1))) & 0xFFF00000).to(tl.float32, bitcast=True)
    # Subnormals (below 2^-6) sit on a grid of 2^-9: adding and taking away 1.5 * 2^23 rounds to it. On the
    # magnitude, with the sign put back after, so that what rounds to zero keeps its sign (-0, as torch).
    magnitude = tl.abs(v)
    # (The sign goes back in as a bit: Triton negates as 0 - x, which turns -0 into +0.)
    sub = ((magnitude * 512.0 + 12582912.0) - 12582912.0) / 512.0
    sub = (sub.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)
    return tl.where(magnitude < 0.015625, sub, normal)


@triton.jit(do_not_specialize=["M"])
def _quantize_rows_kernel(x_ptr, codes_ptr, scale_ptr, M, K, stride_xm, row_iters, chunk_iters,
                          STATIC_ROW_ITERS: tl.constexpr, STATIC_CHUNK_ITERS: tl.constexpr,
                          BLOCK_K: tl.constexpr, FP8_MAX_: tl.constexpr, INV_FP8_MAX_: tl.constexpr,
                          MIN_SCALE_: tl.constexpr, PDL: tl.constexpr):
    # Program (row, chunk): the row's amax over all of K, scale = amax * fp32(1 / FP8_MAX), then the codes
    # of its chunk of K, round_to_nearest_even(x / scale). Every chunk of a row computes the same scale.
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for it in range(trip_count(STATIC_ROW_ITERS, row_iters)):
        k = it * BLOCK_K + offs
        x = tl.load(x_ptr + row * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    # As the reference: amax times fp32(1 / FP8_MAX), then IEEE division (div_rn, as torch's tensor
    # division) for the codes, so they are the reference's bit for bit.
    scale = tl.maximum(tl.max(amax, axis=0) * INV_FP8_MAX_, MIN_SCALE_)
    if chunk == 0:
        tl.store(scale_ptr + row, scale)
    k_lo = chunk * trip_count(STATIC_CHUNK_ITERS, chunk_iters) * BLOCK_K
    for it in range(trip_count(STATIC_CHUNK_ITERS, chunk_iters)):
        k = k_lo + it * BLOCK_K + offs
        x = tl.load(x_ptr + row * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX_), FP8_MAX_)
        tl.store(codes_ptr + row * K + k, round_to_e4m3(q).to(tl.float8e4nv), mask=k < K)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """plait.layers.fp8.quantize_rows in one Triton launch: (codes [M, K] float8_e4m3fn, scales [M] fp32)."""
    # x: [M, K] (unit stride along K)
    m, k = x.shape
    codes = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m == 0:
        return codes, scale
    block = min(QUANT_BLOCK_K, triton.next_power_of_2(k))
    row_iters = triton.cdiv(k, block)
    # Decode-sized steps: a row's K is cut into chunks, one program each (each reads the whole row for
    # its amax, from L2), so a 14,336-wide row is not one program's serial walk. Prompt-sized steps have
    # rows enough to fill the GPU: one program a row reads it once for the amax, once for the codes.
    chunk_iters = 1 if m <= SKINNY_MAX_M else row_iters
    _quantize_rows_kernel[(m, triton.cdiv(row_iters, chunk_iters))](
        x, codes, scale, m, k, x.stride(0), row_iters, chunk_iters,
        STATIC_ROW_ITERS=static_iters(x.is_cuda, row_iters),
        STATIC_CHUNK_ITERS=static_iters(x.is_cuda, chunk_iters),
        BLOCK_K=block, FP8_MAX_=FP8_MAX, INV_FP8_MAX_=INV_FP8_MAX, MIN_SCALE_=MIN_SCALE, num_warps=4,
        **pdl_args(x),
    )
    return codes, scale


@triton.jit(do_not_specialize=["M"])
def _fp8_gemv_kernel(
    xq_ptr, sx_ptr, w_ptr, sw_ptr, b_ptr, out_ptr, part_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, k_iters,
    STATIC_K_ITERS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
    TO_WORKSPACE: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
):
    # out[m, n] = sx[m] * sw[n] * sum_k xq[m, k] * w[n, k] (+ bias[n]), for M <= BLOCK_M rows.
    pdl_prologue(PDL)
    pid_n, pid_k, offs_n, offs_m, offs_k, rows_n, rows_m, k_lo = program_tile(
        M, N, k_iters, STATIC_K_ITERS, BLOCK_M, BLOCK_N, BLOCK_K)
    x_ptrs = xq_ptr + rows_m[:, None] * stride_xm + (k_lo + offs_k)[None, :]
    # The weight is loaded as its transpose, [BLOCK_K, BLOCK_N] with K contiguous: the K-major B operand
    # FP8 dots take. (The weight as the dot's M side, x^T as its N side, gave wrong sums for M > 1.)
    wt_ptrs = w_ptr + rows_n[None, :] * stride_wn + (k_lo + offs_k)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for it in range(trip_count(STATIC_K_ITERS, k_iters)):
        shift = it * BLOCK_K
        if EVEN_K:
            x = tl.load(x_ptrs + shift)
            wt = tl.load(wt_ptrs + shift)
        else:
            k_mask = (k_lo + shift + offs_k) < K
            x = tl.load(x_ptrs + shift, mask=k_mask[None, :], other=0.0)
            wt = tl.load(wt_ptrs + shift, mask=k_mask[:, None], other=0.0)
        # acc: [BLOCK_M, BLOCK_N] += x: [BLOCK_M, BLOCK_K] @ w^T: [BLOCK_K, BLOCK_N]
        acc = tl.dot(x, wt, acc)
    sw = tl.load(sw_ptr + rows_n)
    sx = tl.load(sx_ptr + rows_m)
    y = acc * sx[:, None] * sw[None, :]  # [BLOCK_M, BLOCK_N]
    store_tile(y, out_ptr, part_ptr, b_ptr, offs_m, offs_n, M, N, stride_om, pid_k, TO_WORKSPACE, HAS_BIAS)


@triton.jit
def store_tile(y, out_ptr, part_ptr, b_ptr, offs_m, offs_n, M, N, stride_om, pid_k,
               TO_WORKSPACE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A GEMV program's fp32 tile y [BLOCK_M, BLOCK_N] (rows offs_m, columns offs_n): to split pid_k's
    partials, part [split_k, M, N], which the reduce launch sums in a fixed order and biases; or biased and
    rounded to out."""
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if TO_WORKSPACE:
        tl.store(part_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :], y, mask=mask)
    else:
        if HAS_BIAS:
            y += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=mask)


def gemv_config(m: int, n: int, k: int, device: torch.device) -> Fp8GemvConfig:
    cfg = FP8_GEMV_CONFIGS.get((m_bucket(m), n, k))
    if cfg is not None:
        return cfg
    cfg = Fp8GemvConfig()
    block_k = min(cfg.block_k, max(DOT_N * 2, triton.next_power_of_2(k)))
    split = split_for_gemv(triton.cdiv(n, cfg.block_n), k, block_k, sm_count(device))
    return Fp8GemvConfig(cfg.block_n, block_k, split, cfg.num_warps, cfg.num_stages)


def fp8_skinny(codes: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None, out_dtype: torch.dtype, config: Fp8GemvConfig | None = None
               ) -> torch.Tensor:
    """(codes * scale) @ (weight * weight_scale)^T (+ bias) for at most SKINNY_MAX_M rows, in out_dtype."""
    # codes: [M, K] fp8; scale: [M] fp32; weight: [N, K] fp8; weight_scale: [N] fp32 -> [M, N]
    m, k = codes.shape
    n = weight.shape[0]
    if not 0 < m <= SKINNY_MAX_M:
        raise ValueError(f"fp8_skinny takes 1..{SKINNY_MAX_M} rows, got {m}")
    cfg = config or gemv_config(m, n, k, codes.device)
    out = torch.empty((m, n), dtype=out_dtype, device=codes.device)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    part = (torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=codes.device)
            if cfg.split_k > 1 else out)
    bias_arg = bias if bias is not None else out
    iters = k_per_split // cfg.block_k
    _fp8_gemv_kernel[(triton.cdiv(n, cfg.block_n), cfg.split_k)](
        codes, scale, weight, weight_scale, bias_arg, out, part, m, n, k, codes.stride(0), weight.stride(0),
        out.stride(0), iters, STATIC_K_ITERS=static_iters(codes.is_cuda, iters),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_M=DOT_N, TO_WORKSPACE=cfg.split_k > 1,
        EVEN_K=k_per_split * cfg.split_k == k, HAS_BIAS=bias is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(codes),
    )
    if cfg.split_k > 1:
        reduce_splits(part, bias, out)
    return out


def scaled_mm_usable(n: int, k: int) -> bool:
    """cuBLASLt's FP8 GEMM wants K and N in multiples of 16."""
    return n % 16 == 0 and k % 16 == 0 and hasattr(torch, "_scaled_mm")


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp8_linear_ref on CUDA: x quantised per row, then the FP8 GEMV or cuBLASLt's FP8 GEMM."""
    # x: [..., K] bf16/fp16; weight: [N, K] float8_e4m3fn; weight_scale: [N] fp32 -> [..., N]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], weight.shape[0]
    codes, scale = quantize_rows_fp8(x2)
    if m == 0:
        out = x2.new_empty((0, n))
    elif m <= SKINNY_MAX_M or not scaled_mm_usable(n, x2.shape[1]):
        out = fp8_skinny_rows(codes, scale, weight, weight_scale, bias, x.dtype)
    else:
        # Row-wise scales need a bf16 result (cuBLASLt); an fp16 model rounds that once more.
        out = torch._scaled_mm(codes, weight.t(), scale_a=scale[:, None], scale_b=weight_scale[None, :],
                               bias=bias.to(torch.bfloat16) if bias is not None else None,
                               out_dtype=torch.bfloat16)
        out = out.to(x.dtype)
    return out.view(*x.shape[:-1], n)


def fp8_skinny_rows(codes: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor,
                    weight_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
                    ) -> torch.Tensor:
    """fp8_skinny over any number of rows, SKINNY_MAX_M at a time (shapes cuBLASLt refuses)."""
    parts = [fp8_skinny(codes[i:i + SKINNY_MAX_M], scale[i:i + SKINNY_MAX_M], weight, weight_scale, bias,
                        out_dtype) for i in range(0, codes.shape[0], SKINNY_MAX_M)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)
