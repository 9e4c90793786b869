"""Block-wise FP8 matmuls (DeepSeek / Qwen FP8 checkpoints): per-token-group input quantisation, the GEMM."""

# A block-wise FP8 layer (plait.layers.fp8_block) holds weight codes with one fp32 scale per
# [block_n, block_k] tile, and quantises its input per token and per group of block_k along K, so
#   out[m, n] = sum over K blocks kb of  sx[m, kb] * sw[n // block_n, kb] * sum_{k in kb} cx[m, k] * cw[n, k]
# On CUDA: quantize_groups_fp8 (one Triton launch), then
#   - decode-sized steps (<= 16 rows): _fp8_block_gemm_kernel, whose programs walk K one block at a time,
#     take each block's FP8 dot on tensor cores (x as the dot's M side, the weight loaded as its transpose)
#     and scale it into an fp32 accumulator, K split over programs (fp32 partials summed in a fixed order by
#     skinny_gemm.reduce_splits) so that the weight streams from enough of them: as fast as the per-row FP8
#     GEMV (Llama-8B layers on an H200, benchmarks/results/fp8_block_h200.json);
#   - more rows: cuBLASLt's block-scaled FP8 GEMM (torch._scaled_mm with 1x128 / 128x128 scales, the
#     DeepSeek recipe), 1.8-2x faster there than the Triton kernel, which takes the blocks cuBLASLt does not
#     (sides other than 128) and the torch / CUDA builds without it.
# plait.layers.fp8_block.fp8_block_linear_ref is the same function in torch (fp32 on the dequantised codes):
# the CPU path and the tests' oracle.

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from plait.kernels.fp8_gemm import SKINNY_MAX_M, round_to_e4m3, scaled_mm_usable, split_for_gemv, store_tile
from plait.kernels.interpreter import static_iters, trip_count
from plait.kernels.pdl import pdl_args, pdl_prologue
from plait.kernels.skinny_gemm import reduce_splits, sm_count
from plait.layers.fp8 import FP8_MAX, INV_FP8_MAX, MIN_SCALE

# Rows up to SKINNY_MAX_M (the per-row GEMV's bound) are decode-sized: 16-row tiles, K split over programs.
DOT_M = 16  # tl.dot's smallest M: decode rows are padded to it
# Prompt-sized steps on the Triton kernel: rows a program.
PROMPT_BLOCK_M = 64
# Hopper's FP8 tensor cores accumulate with fewer bits than fp32; Triton adds their partial sums into an
# fp32 accumulator every this many K elements (its default: never within a dot). At Llama-8B prompt shapes
# on an H200, 64 gave half the default's error (9e-5 against 1.6e-4 of the largest output) at the same
# speed; 32 cost 1.4x, full precision 2.2x.
IMPRECISE_ACC_K = 64
# cuBLASLt's block-scaled FP8 GEMM takes these tiles only, and row counts in multiples of this (others
# are padded with zero rows: CUBLAS_STATUS_NOT_SUPPORTED at 17, 255, 257 rows on an H200, torch 2.11).
CUBLAS_BLOCK = (128, 128)
CUBLAS_ROW_MULTIPLE = 4
# cuBLASLt reads the weight's scale grid transposed, [K / 128, N / 128] with K / 128 fp32 values between its
# columns: a K of 2,816 (22 groups) gave garbage on an H200 (torch 2.11, CUDA 13), a K of 5,632 (44) the exact
# product; so the K groups must come in multiples of 4 (16 bytes), and other Ks take the Triton kernel.
CUBLAS_SCALE_GROUPS_MULTIPLE = 4


@dataclass(frozen=True)
class BlockGemmConfig:
    block_m: int  # rows a program (16: decode-sized steps)
    block_n: int  # output columns a program, within one weight block row
    split_k: int = 0  # programs along K; 0 = chosen to fill the GPU (decode-sized steps)
    num_warps: int = 4
    num_stages: int = 3


def block_gemm_config(m: int, block: tuple[int, int]) -> BlockGemmConfig:
    """The launch shape for ``m`` rows of a layer with weight blocks ``block``: of a sweep over Llama-8B's
    layers on an H200 (block_n 32-128, split 1-8, 3-5 stages; benchmarks/results/fp8_block_h200.json), the
    one close to each shape's best at 1 and 16 rows (10.5 / 8.0 / 35.8 / 21.6 us at M=1 for qkv / o /
    gate_up / down, against 10.3 / 8.4 / 35.7 / 19.8 for the per-row FP8 GEMV), and at prompt sizes the
    Triton kernel's fastest (64 x 128 tiles)."""
    if m <= SKINNY_MAX_M:
        return BlockGemmConfig(DOT_M, min(128, block[0]), num_stages=4)
    return BlockGemmConfig(PROMPT_BLOCK_M, min(128, block[0]), num_stages=4)


@triton.jit(do_not_specialize=["M"])
def _quantize_groups_kernel(x_ptr, codes_ptr, scale_ptr, M, K, stride_xm,
                            GROUP: tl.constexpr, GROUPS_PER_PROGRAM: tl.constexpr, FP8_MAX_: tl.constexpr,
                            INV_FP8_MAX_: tl.constexpr, MIN_SCALE_: tl.constexpr, PDL: tl.constexpr):
    # Program (row, run of GROUPS_PER_PROGRAM groups): each group's scale = amax * fp32(1 / FP8_MAX) of its
    # GROUP elements, then their codes, round_to_nearest_even(x / scale) with IEEE division, as the torch
    # reference. Scales are stored M-major (scale[g, m] at g * M + m), the layout cuBLASLt reads.
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)
    k = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [GROUPS_PER_PROGRAM, GROUP]
    x = tl.load(x_ptr + row * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1) * INV_FP8_MAX_, MIN_SCALE_)
    tl.store(scale_ptr + groups * M + row, scale, mask=groups * GROUP < K)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -FP8_MAX_), FP8_MAX_)
    tl.store(codes_ptr + row * K + k, round_to_e4m3(q).to(tl.float8e4nv), mask=k < K)


# Groups of a row one quantisation program takes (1,024 elements at 128-wide groups): a program per group
# made ~2M programs of 128 elements at a 16K-token Llama-8B prompt step.
QUANT_GROUPS_PER_PROGRAM = 8


def quantize_groups_fp8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """plait.layers.fp8_block.quantize_groups in one launch: (codes [M, K] float8_e4m3fn, scales [M, cdiv(K,
    group)] fp32, M-major: strides (1, M)), each group of ``group`` elements of a row on its own scale."""
    # x: [M, K] (unit stride along K)
    m, k = x.shape
    groups = triton.cdiv(k, group)
    codes = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((groups, m), dtype=torch.float32, device=x.device).t()
    per_program = min(QUANT_GROUPS_PER_PROGRAM, triton.next_power_of_2(groups))
    if m:
        _quantize_groups_kernel[(m, triton.cdiv(groups, per_program))](
            x, codes, scale, m, k, x.stride(0), GROUP=group, GROUPS_PER_PROGRAM=per_program, FP8_MAX_=FP8_MAX,
            INV_FP8_MAX_=INV_FP8_MAX, MIN_SCALE_=MIN_SCALE, num_warps=4, **pdl_args(x))
    return codes, scale


@triton.jit(do_not_specialize=["M"])
def _fp8_block_gemm_kernel(
    xq_ptr, sx_ptr, w_ptr, sw_ptr, b_ptr, out_ptr, part_ptr,
    M, N, K, stride_xm, stride_sxm, stride_sxk, stride_wn, stride_swn, stride_om, kb_per_split,
    STATIC_KB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    WEIGHT_BLOCK_N: tl.constexpr, TO_WORKSPACE: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
    IMPRECISE_ACC: tl.constexpr,
):
    # Grid (M tiles, N tiles, K splits); BLOCK_K is the weight's block_k (one scale pair per step), and a
    # program's BLOCK_N columns lie in one weight block row (BLOCK_N divides WEIGHT_BLOCK_N or equals it).
    pdl_prologue(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past the end re-read the last valid row (dropped at the store), so loads stay unmasked but for K.
    rows_m = tl.minimum(offs_m, M - 1).to(tl.int64)
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    w_block_row = (pid_n * BLOCK_N) // WEIGHT_BLOCK_N
    kb_lo = pid_k * trip_count(STATIC_KB, kb_per_split)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for it in range(trip_count(STATIC_KB, kb_per_split)):
        kb = kb_lo + it
        k = kb * BLOCK_K + offs_k
        k_in = k < K
        x = tl.load(xq_ptr + rows_m[:, None] * stride_xm + k[None, :], mask=k_in[None, :], other=0.0)
        # The weight as its transpose, [BLOCK_K, BLOCK_N], K contiguous: the B operand FP8 dots take.
        wt = tl.load(w_ptr + rows_n[None, :] * stride_wn + k[:, None], mask=k_in[:, None], other=0.0)
        # A split's last steps may lie past K (kb_per_split rounds up): their loads are masked to zeros.
        sx = tl.load(sx_ptr + rows_m * stride_sxm + kb * stride_sxk, mask=kb * BLOCK_K < K, other=0.0)
        sw = tl.load(sw_ptr + w_block_row * stride_swn + kb, mask=kb * BLOCK_K < K, other=0.0)
        acc += tl.dot(x, wt, max_num_imprecise_acc=IMPRECISE_ACC) * (sx[:, None] * sw)
    store_tile(acc, out_ptr, part_ptr, b_ptr, offs_m, offs_n, M, N, stride_om, pid_k, TO_WORKSPACE, HAS_BIAS)


def fp8_block_gemm(codes: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   block: tuple[int, int], bias: torch.Tensor | None, out_dtype: torch.dtype,
                   split_k: int | None = None, config: BlockGemmConfig | None = None) -> torch.Tensor:
    """Block-scaled (codes * scale) @ (weight * weight_scale)^T (+ bias), in out_dtype. ``split_k``
    overrides the split of K, ``config`` the launch shape (tests, sweeps)."""
    # codes: [M, K] fp8; scale: [M, cdiv(K, bk)] fp32; weight: [N, K] fp8; weight_scale: [cdiv(N, bn),
    # cdiv(K, bk)] fp32 -> [M, N]
    m, k = codes.shape
    n = weight.shape[0]
    block_n, block_k = block
    out = torch.empty((m, n), dtype=out_dtype, device=codes.device)
    if m == 0:
        return out
    num_kb = triton.cdiv(k, block_k)
    cfg = config or block_gemm_config(m, block)
    block_m, tile_n = cfg.block_m, cfg.block_n
    if block_n % tile_n:
        raise ValueError(f"{tile_n} columns a program do not divide the weight's {block_n}-row blocks")
    split = split_k or cfg.split_k
    if not split:
        programs = triton.cdiv(m, block_m) * triton.cdiv(n, tile_n)
        split = split_for_gemv(programs, k, block_k, sm_count(codes.device)) if m <= SKINNY_MAX_M else 1
    split = max(1, min(split, num_kb))
    kb_per_split = triton.cdiv(num_kb, split)
    split = triton.cdiv(num_kb, kb_per_split)  # no split left without blocks
    part = torch.empty((split, m, n), dtype=torch.float32, device=codes.device) if split > 1 else out
    _fp8_block_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, tile_n), split)](
        codes, scale, weight, weight_scale, bias if bias is not None else out, out, part,
        m, n, k, codes.stride(0), scale.stride(0), scale.stride(1), weight.stride(0), weight_scale.stride(0),
        out.stride(0),
        kb_per_split, STATIC_KB=static_iters(codes.is_cuda, kb_per_split), BLOCK_M=block_m, BLOCK_N=tile_n,
        BLOCK_K=block_k, WEIGHT_BLOCK_N=block_n, TO_WORKSPACE=split > 1, HAS_BIAS=bias is not None,
        IMPRECISE_ACC=min(IMPRECISE_ACC_K, block_k), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_args(codes),
    )
    if split > 1:
        reduce_splits(part, bias, out)
    return out


@functools.cache
def cublas_block_scaling(device: torch.device) -> bool:
    """Whether this torch / cuBLASLt runs block-scaled FP8 GEMMs (CUDA 12.9+ on Hopper): tried once."""
    a = torch.ones((128, 128), dtype=torch.float8_e4m3fn, device=device)
    try:
        two = torch.full((1, 1), 2.0, device=device)
        out = cublas_block_gemm(a, torch.ones((128, 1), device=device), a, two, None, torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return bool((out == 256.0).all())


def cublas_block_gemm(codes: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor,
                      weight_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
                      ) -> torch.Tensor:
    """fp8_block_gemm for 128 x 128 weight tiles through cuBLASLt (torch._scaled_mm's DeepSeek recipe: x's
    scales M-major, as quantize_groups_fp8 leaves them, the weight's as the transpose of its [N / 128,
    K / 128] grid); M a multiple of CUBLAS_ROW_MULTIPLE."""
    bias16 = bias.to(torch.bfloat16) if bias is not None else None
    out = torch._scaled_mm(codes, weight.t(), scale_a=scale.t().contiguous().t(), scale_b=weight_scale.t(),
                           bias=bias16, out_dtype=torch.bfloat16)
    return out.to(out_dtype)


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     block: tuple[int, int], bias: torch.Tensor | None = None) -> torch.Tensor:
    """plait.layers.fp8_block.fp8_block_linear_ref on CUDA: x quantised per token and K group, the GEMM."""
    # x: [..., K] bf16/fp16 -> [..., N]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, (n, k) = x2.shape[0], weight.shape
    if (m > SKINNY_MAX_M and block == CUBLAS_BLOCK and scaled_mm_usable(n, k)
            and (k // block[1]) % CUBLAS_SCALE_GROUPS_MULTIPLE == 0 and x2.is_cuda
            and cublas_block_scaling(x2.device)):
        pad = -m % CUBLAS_ROW_MULTIPLE  # zero rows: codes 0, dropped from the output
        padded = torch.cat([x2, x2.new_zeros((pad, k))]) if pad else x2
        codes, scale = quantize_groups_fp8(padded, block[1])
        out = cublas_block_gemm(codes, scale, weight, weight_scale, bias, x.dtype)[:m]
    else:
        codes, scale = quantize_groups_fp8(x2, block[1])
        out = fp8_block_gemm(codes, scale, weight, weight_scale, block, bias, x.dtype)
    return out.view(*x.shape[:-1], n)
