"""W4A16 / W8A16 matmuls (GPTQ and AWQ checkpoints): 16-bit activations against integer weight codes with
group scales and zero points, dequantised in the K loop and multiplied on tensor cores."""

# A WNA16Linear (plait.layers.wna16) holds its weight in plait's layout (GPTQ's):
#   codes  [K // pack, N] int32, pack = 32 // bits: the code of weight (n, k) is bits bits * (k % pack) and
#          up of word [k // pack, n];
#   scales [G, N] (fp16, bf16 or fp32), zeros [G, N] (uint8 / int16); group_rows = K // G input rows a group;
#   weight(n, k) = (code - zero[g, n]) * scale[g, n], g = k // group_rows, in fp32, rounded to x's dtype.
# One kernel, _wna16_gemm_kernel, computes x @ weight^T on a grid of (BLOCK_M x BLOCK_N output tiles,
# K splits), in two shapes:
#   - decode-sized steps (M <= GEMV_MAX_M): one 16-row tile (x's rows padded to tl.dot's smallest M), the
#     GEMV shape: each program streams BLOCK_N columns of codes over its slice of K, and K is split over
#     programs (split_for) so that enough of them stream the weight at once to fill the GPU;
#   - more rows: 64- or 128-row tiles in grouped order (Triton's matmul tutorial: GROUP_M tiles down M share
#     one column of weight tiles while it is in L2), split only where the tiles alone leave SMs idle.
# Each K step loads a [BLOCK_K // pack, BLOCK_N] tile of words (each word read once, 16 bytes a thread along
# N), unpacks it by shifting each word by the pack positions ([words, pack, BLOCK_N], then reshaped to
# [BLOCK_K, BLOCK_N], rows in K order), dequantises and takes tl.dot into an fp32 accumulator:
#   - in fp32 (the general case): the code OR'd into the mantissa of 2^23 is 2^23 + code, less 2^23 + zero
#     (integers below 2^24: exact) is code - zero, with no int -> float conversion (conversions issue at 16
#     a clock per SM on Hopper by the CUDA guide's throughput table, against 128 FP32 adds); times the scale,
#     rounded once to x's dtype: what plait.layers.wna16.dequantize computes, bit for bit;
#   - in fp16 where x and the scales are fp16 (GPTQ / AWQ's scale dtype): the same with 1024 + code, two
#     weights an instruction (HADD2 / HMUL2), still bit for bit (_dequantize says why).
# Words, scales and zeros are loaded as 3-D [rows, 1, BLOCK_N] tensors so that the unpacking keeps the
# loads' layout (each thread holds all pack codes of its words): unpacked from a 2-D load, Triton laid the
# tile out one element a thread and stored it to shared memory two bytes at a time (sm_90 SASS).
# Scales and zeros are read once per K step: a [BLOCK_N] row where the step lies in one group (BLOCK_K
# divides group_rows, or G == 1), else one row per word row (a word's codes always share a group:
# group_rows is a multiple of pack). Uneven groups (act-order rows of a row-parallel rank, each group padded
# to whole words: plait.layers.wna16.WNA16Linear._pad_groups) come with word_groups [K // pack] int32, each
# word row's group, which every kernel then reads (WORD_GROUPS, a constexpr: the other paths compile as
# they did) instead of computing k // group_rows.
# Split-K partials go to an fp32 workspace [split, M, N] that skinny_gemm.reduce_splits sums in a fixed
# order (deterministic, no atomics) and biases. No host syncs, allocations fixed by the shapes: CUDA-graph
# capturable. plait.layers.wna16.wna16_linear_ref is the torch reference (the tests' oracle); under
# Triton's CPU interpreter bf16 takes INTERPRETED_BF16's work-arounds, so that the weights there are the
# reference's bit for bit too.

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from plait.kernels.interpreter import static_iters, trip_count
from plait.kernels.pdl import pdl_args, pdl_prologue
from plait.kernels.skinny_gemm import reduce_splits, sm_count
from plait.layers.wna16 import SUPPORTED_BITS, WORD_BITS

# Rows up to this take the GEMV shape (one 16-row tile, K split to fill the GPU).
GEMV_MAX_M = 16
# Rows up to this take MID_CONFIG's 64-row tiles, more LARGE_CONFIG's 128-row ones.
MID_MAX_M = 64
DOT_M = 16  # tl.dot's smallest M (and K): decode rows are padded to it
MIN_BLOCK_K = 16
# Split-K targets this many programs per SM in the GEMV shape (4-warp programs whose dequantisation keeps
# the CUDA cores busy, so more than one a SM to hide HBM latency behind another's arithmetic), and one wave
# for the tiled shapes.
GEMV_PROGRAMS_PER_SM = 2
TILED_PROGRAMS_PER_SM = 1
# No split of K is shorter than this many K steps (the workspace round trip costs about one).
MIN_STEPS_PER_SPLIT = 4
MAX_SPLIT_K = 16


@dataclass(frozen=True)
class WNA16Config:
    block_m: int  # rows a program (DOT_M: the GEMV shape)
    block_n: int  # output columns a program (weight columns: BLOCK_N int32 words a word row)
    block_k: int  # K elements a loop step (block_k // pack word rows); a power of two >= 16
    split_k: int = 0  # programs along K; 0 = chosen to fill the GPU (split_for)
    group_m: int = 8  # M tiles that walk one column of N tiles together (L2 reuse of the weight tiles)
    num_warps: int = 4
    num_stages: int = 4  # loads in flight through shared memory


# Defaults until measured: the GEMV shape streams 64 columns x 128 K a step (4 KB of 4-bit words, 8 KB of
# 8-bit ones), four steps in flight; 64 x 128 x 64 tiles for mid-sized steps and 128 x 128 x 64 for
# prompt-sized ones, on 8 warps (Hopper's wgmma). Chosen on sm_90 SASS alone (no GPU timing yet): the
# fewest loop instructions a weight without register spills or two-byte shared-memory stores (64 x 128
# tiles on 4 warps got those).
GEMV_CONFIG = WNA16Config(block_m=DOT_M, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=4)
MID_CONFIG = WNA16Config(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=4)
LARGE_CONFIG = WNA16Config(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)

def split_for(tiles: int, k: int, block_k: int, programs_per_sm: float, num_sms: int) -> int:
    """The largest power-of-two split of K that keeps the launch within programs_per_sm programs per SM,
    each split at least MIN_STEPS_PER_SPLIT K steps."""
    split = 1
    while (tiles * split * 2 <= programs_per_sm * num_sms and split < MAX_SPLIT_K
           and k // (split * 2) >= MIN_STEPS_PER_SPLIT * block_k):
        split *= 2
    return split


@functools.cache  # pure in its ints; called on every launch
def default_config(m: int, n: int, k: int, num_sms: int) -> WNA16Config:
    """GEMV_CONFIG, MID_CONFIG or LARGE_CONFIG by M, the K step no wider than K, and K split to fill the
    GPU (split_for)."""
    cfg = GEMV_CONFIG if m <= GEMV_MAX_M else MID_CONFIG if m <= MID_MAX_M else LARGE_CONFIG
    return _with_split(replace(cfg, block_k=min(cfg.block_k, max(MIN_BLOCK_K, triton.next_power_of_2(k)))),
                       m, n, k, num_sms)


def _with_split(cfg: WNA16Config, m: int, n: int, k: int, num_sms: int) -> WNA16Config:
    if cfg.split_k:
        return cfg
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    per_sm = GEMV_PROGRAMS_PER_SM if cfg.block_m == DOT_M else TILED_PROGRAMS_PER_SM
    return replace(cfg, split_k=split_for(tiles, k, cfg.block_k, per_sm, num_sms))


@triton.jit
def _round(v, dtype: tl.constexpr, INTERPRETED_BF16: tl.constexpr):
    """fp32 v rounded to nearest even in dtype. INTERPRETED_BF16 (bf16 in Triton's CPU interpreter, whose
    conversion to bf16 truncates): rounded on the bits, then converted exactly."""
    if INTERPRETED_BF16:
        bits = v.to(tl.uint32, bitcast=True)
        v = ((bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return v.to(dtype)


@triton.jit
def _dequantize(words, scale, zero, dtype: tl.constexpr, BITS: tl.constexpr, PACK: tl.constexpr,
                HALF: tl.constexpr, INTERPRETED_BF16: tl.constexpr):
    """Weights [WORDS * PACK, BLOCK_N] in dtype, rows in K order, of a tile of words [WORDS, 1, BLOCK_N];
    scale and zero are [1, 1, BLOCK_N] (one group) or [WORDS, 1, BLOCK_N] (each word row's group), in their
    own dtypes. HALF (fp16 x and fp16 scales): the arithmetic in fp16, two weights an instruction."""
    shifts = tl.arange(0, PACK) * BITS
    codes = (words >> shifts[None, :, None]) & ((1 << BITS) - 1)  # [WORDS, PACK, BLOCK_N]
    if HALF:
        # 0x6400 is fp16's 1024, whose mantissa steps by 1: OR'd with a code (< 1024) it is 1024 + code.
        # (1024 + code) - (1024 + zero) is exact (integers below 2048), and the fp16 product rounds the
        # exact (code - zero) * scale once, as the reference's fp32 product (exact: 9 + 11 bits) rounded
        # to fp16 does.
        magic = (codes | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        w = (magic - (zero.to(tl.float16) + 1024.0)) * scale
    else:
        # 0x4B000000 is fp32's 2^23, whose mantissa steps by 1: OR'd with a code it is 2^23 + code,
        # exactly (no int -> float conversion). Less 2^23 + zero (integers below 2^24: exact), that is the
        # reference's int32 code - zero; times the scale in fp32, rounded once to dtype.
        magic = (codes | 0x4B000000).to(tl.float32, bitcast=True)
        w = (magic - (zero.to(tl.float32) + 8388608.0)) * scale.to(tl.float32)
        w = _round(w, dtype, INTERPRETED_BF16)
    return tl.reshape(w, (words.shape[0] * PACK, words.shape[2]))


# M (the step's row count) changes from step to step; specialising on it would compile a binary per
# row count (see plait.kernels.paged_attention on per-step arguments).
@triton.jit(do_not_specialize=["M"])
def _wna16_gemm_kernel(
    x_ptr, c_ptr, s_ptr, z_ptr, wg_ptr, b_ptr, out_ptr, part_ptr,
    M, N, K, G, group_rows, stride_xm, stride_cw, stride_sg, stride_zg, stride_om, k_iters,
    STATIC_K_ITERS: tl.constexpr, BITS: tl.constexpr, PACK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, TILE_IN_GROUP: tl.constexpr,
    EVEN_K: tl.constexpr, TO_WORKSPACE: tl.constexpr, HAS_BIAS: tl.constexpr, HALF: tl.constexpr,
    WORD_GROUPS: tl.constexpr, INTERPRETED_BF16: tl.constexpr, PDL: tl.constexpr,
):
    # out[m, n] = sum_k x[m, k] * weight(n, k) (+ bias[n]); grid (M tiles x N tiles, K splits), each split
    # k_iters steps of BLOCK_K (BLOCK_K // PACK word rows).
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    # Grouped order: GROUP_M consecutive programs take GROUP_M M tiles of one N tile.
    tiles_m = tl.cdiv(M, BLOCK_M)
    per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_w = tl.arange(0, BLOCK_K // PACK)
    # Rows of x past M re-read the last one (dropped at the store); columns past N are masked, which keeps
    # the loads of words, scales and zeros (contiguous along N) vectorised where N is a multiple of 16.
    rows_m = tl.minimum(offs_m, M - 1).to(tl.int64)
    n_in = offs_n < N
    n_in3 = n_in[None, None, :]
    k_lo = pid_k * (trip_count(STATIC_K_ITERS, k_iters) * BLOCK_K)
    x_ptrs = x_ptr + rows_m[:, None] * stride_xm + (k_lo + offs_k)[None, :]  # [BLOCK_M, BLOCK_K]
    # Words, scales and zeros are loaded as [rows, 1, BLOCK_N]: the 3-D layout the loads get (BLOCK_N
    # contiguous, 16 bytes a thread) is then the unpacking's, each thread holding all PACK codes of its
    # words, and the reshape to [BLOCK_K, BLOCK_N] moves no data.
    c_ptrs = c_ptr + (k_lo // PACK + offs_w)[:, None, None] * stride_cw + offs_n[None, None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for it in range(trip_count(STATIC_K_ITERS, k_iters)):
        k0 = k_lo + it * BLOCK_K
        if EVEN_K:
            x = tl.load(x_ptrs + it * BLOCK_K)
            words = tl.load(c_ptrs + it * (BLOCK_K // PACK) * stride_cw, mask=n_in3, other=0)
        else:
            # (A split's last steps may lie past K: K rounds up to whole steps. K % PACK == 0, so a word
            # is in K when its first row is.)
            x = tl.load(x_ptrs + it * BLOCK_K, mask=(k0 + offs_k < K)[None, :], other=0.0)
            words = tl.load(c_ptrs + it * (BLOCK_K // PACK) * stride_cw,
                            mask=(k0 + offs_w * PACK < K)[:, None, None] & n_in3, other=0)
        if TILE_IN_GROUP:
            # The whole step lies in group g: one [BLOCK_N] row of scales and zeros.
            g = tl.minimum(k0 // group_rows, G - 1)
            scale = tl.load(s_ptr + g * stride_sg + offs_n[None, None, :], mask=n_in3, other=0.0)
            zero = tl.load(z_ptr + g * stride_zg + offs_n[None, None, :], mask=n_in3, other=0)
        else:
            # Groups narrower than the step, or uneven: each word row's own (a word's codes share a group).
            if WORD_GROUPS:  # word rows past K read group 0; their words and x are masked to 0
                g = tl.load(wg_ptr + k0 // PACK + offs_w, mask=k0 + offs_w * PACK < K, other=0)[:, None, None]
            else:
                g = tl.minimum((k0 + offs_w * PACK) // group_rows, G - 1)[:, None, None]
            scale = tl.load(s_ptr + g * stride_sg + offs_n[None, None, :], mask=n_in3, other=0.0)
            zero = tl.load(z_ptr + g * stride_zg + offs_n[None, None, :], mask=n_in3, other=0)
        w = _dequantize(words, scale, zero, x_ptr.dtype.element_ty, BITS, PACK, HALF, INTERPRETED_BF16)
        # acc: [BLOCK_M, BLOCK_N] += x: [BLOCK_M, BLOCK_K] @ w: [BLOCK_K, BLOCK_N]
        if INTERPRETED_BF16:
            # The interpreter multiplies bf16 operands as their uint16 bits: the same products in fp32
            # (exact, as on tensor cores: 8-bit mantissas).
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    mask = (offs_m < M)[:, None] & n_in[None, :]
    if TO_WORKSPACE:
        # part: [split, M, N] fp32, summed and biased by reduce_splits.
        tl.store(part_ptr + (pid_k * M + offs_m.to(tl.int64))[:, None] * N + offs_n[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_in, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
                 _round(acc, out_ptr.dtype.element_ty, INTERPRETED_BF16), mask=mask)


@triton.jit
def _code_minus_zero(words, jj: tl.constexpr, zero, BITS: tl.constexpr):
    """(code - zero) * 2^(BITS * jj) in fp32, exactly, for the code in field jj of each word (its field ends
    below the fp32 mantissa's top, bit 23): OR'd in place into the mantissa of 2^23 (one LOP3, no shift),
    read as 2^23 + code * 2^(BITS * jj), less 2^23 + zero * 2^(BITS * jj)."""
    field = words & (((1 << BITS) - 1) << (BITS * jj))
    magic = (field | 0x4B000000).to(tl.float32, bitcast=True)
    return magic - (zero * (1 << (BITS * jj)) + 8388608.0)


@triton.jit
def _wna16_fma_kernel(
    x_ptr, c_ptr, s_ptr, z_ptr, wg_ptr, b_ptr, out_ptr, part_ptr,
    N, K, G, group_rows, stride_cw, stride_sg, stride_zg, k_iters,
    STATIC_K_ITERS: tl.constexpr, BITS: tl.constexpr, PACK: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr, ROW_GROUPS: tl.constexpr, WORD_GROUPS: tl.constexpr, TO_WORKSPACE: tl.constexpr,
    HAS_BIAS: tl.constexpr, INTERPRETED_BF16: tl.constexpr, PDL: tl.constexpr,
):
    # out[n] = sum_k x[k] * (code(k, n) - zero) * scale for one row x, on CUDA cores: no dot, so no layout
    # change of the unpacked codes. Grid (N tiles, K splits); each step takes BLOCK_W word rows (BLOCK_W *
    # PACK inputs), in one group or (ROW_GROUPS) each word row in its own (WORD_GROUPS: read from
    # word_groups, uneven groups; the step may then reach past K, masked). Per code: one LOP3, one FADD, one
    # FFMA (_code_minus_zero; x's entries carry the 2^-(BITS * jj) that undoes its field's place, exactly);
    # each word's sums take their group's scale once, and the word rows are summed at the end.
    pdl_prologue(PDL)
    DIRECT: tl.constexpr = 23 // BITS  # codes of a word whose field ends within the fp32 mantissa
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, BLOCK_W)
    n_in = offs_n < N
    w_lo = pid_k * trip_count(STATIC_K_ITERS, k_iters) * BLOCK_W  # first word row of this split
    c_ptrs = c_ptr + (w_lo + offs_w)[:, None] * stride_cw + offs_n[None, :]  # [BLOCK_W, BLOCK_N]
    acc = tl.zeros((BLOCK_W, BLOCK_N), dtype=tl.float32)
    for it in range(trip_count(STATIC_K_ITERS, k_iters)):
        w0 = w_lo + it * BLOCK_W
        w_in = (w0 + offs_w) * PACK < K
        words = tl.load(c_ptrs + it * BLOCK_W * stride_cw, mask=w_in[:, None] & n_in[None, :], other=0)
        high = words >> (BITS * DIRECT)
        if ROW_GROUPS:
            # The step spans groups: each word row's own scale and zero (cached: rows of a group share them).
            if WORD_GROUPS:
                g2 = tl.load(wg_ptr + w0 + offs_w, mask=w_in, other=0)[:, None]
            else:
                g2 = tl.minimum((w0 + offs_w) * PACK // group_rows, G - 1)[:, None]
            scale = tl.load(s_ptr + g2 * stride_sg + offs_n[None, :], mask=n_in[None, :], other=0.0)
            zero = tl.load(z_ptr + g2 * stride_zg + offs_n[None, :], mask=n_in[None, :], other=0)
            scale, zero = scale.to(tl.float32), zero.to(tl.float32)
        else:
            g = tl.minimum((w0 * PACK) // group_rows, G - 1)
            scale = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_in, other=0.0).to(tl.float32)[None, :]
            zero = tl.load(z_ptr + g * stride_zg + offs_n, mask=n_in, other=0).to(tl.float32)[None, :]
        step = tl.zeros((BLOCK_W, BLOCK_N), dtype=tl.float32)
        for j in tl.static_range(PACK):
            # Codes whose field ends past bit 23 are read from ``high``, the words shifted once for them all.
            jj = j - DIRECT * (j >= DIRECT)  # the field's place in the word it is read from
            if j < DIRECT:
                w = _code_minus_zero(words, jj, zero, BITS)  # [BLOCK_W, BLOCK_N]
            else:
                w = _code_minus_zero(high, jj, zero, BITS)
            # x's inputs (w0 + r) * PACK + j, r < BLOCK_W, times 2^-(BITS * jj): [BLOCK_W]
            x = tl.load(x_ptr + (w0 + offs_w) * PACK + j, mask=w_in, other=0.0).to(tl.float32)
            step += (x * (1.0 / (1 << (BITS * jj))))[:, None] * w
        acc += step * scale
    out = tl.sum(acc, axis=0)  # [BLOCK_N]
    if TO_WORKSPACE:
        tl.store(part_ptr + pid_k * N + offs_n, out, mask=n_in)
    else:
        if HAS_BIAS:
            out += tl.load(b_ptr + offs_n, mask=n_in, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs_n, _round(out, out_ptr.dtype.element_ty, INTERPRETED_BF16), mask=n_in)


@triton.jit
def _dequantize_kernel(c_ptr, s_ptr, z_ptr, wg_ptr, w_ptr, N, K, G, group_rows, stride_cw, stride_sg,
                       stride_zg, BITS: tl.constexpr, PACK: tl.constexpr, BLOCK_W: tl.constexpr,
                       BLOCK_N: tl.constexpr, HALF: tl.constexpr, WORD_GROUPS: tl.constexpr,
                       INTERPRETED_BF16: tl.constexpr):
    # w[k, n] = the weight of codes (k, n): BLOCK_W word rows x BLOCK_N columns a program, unpacked as the
    # GEMM kernel unpacks them (_dequantize), each word row with its group's scale and zero.
    offs_w = tl.program_id(0) * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask3 = ((offs_w * PACK < K)[:, None] & (offs_n < N)[None, :])[:, None, :]
    words = tl.load(c_ptr + offs_w[:, None, None] * stride_cw + offs_n[None, None, :], mask=mask3, other=0)
    if WORD_GROUPS:
        g = tl.load(wg_ptr + offs_w, mask=offs_w * PACK < K, other=0)[:, None, None]
    else:
        g = tl.minimum(offs_w * PACK // group_rows, G - 1)[:, None, None]
    scale = tl.load(s_ptr + g * stride_sg + offs_n[None, None, :], mask=mask3, other=0.0)
    zero = tl.load(z_ptr + g * stride_zg + offs_n[None, None, :], mask=mask3, other=0)
    w = _dequantize(words, scale, zero, w_ptr.dtype.element_ty, BITS, PACK, HALF, INTERPRETED_BF16)
    offs_k = tl.program_id(0) * BLOCK_W * PACK + tl.arange(0, BLOCK_W * PACK)
    tl.store(w_ptr + offs_k[:, None].to(tl.int64) * N + offs_n[None, :], w,
             mask=(offs_k < K)[:, None] & (offs_n < N)[None, :])


def dequantize_kn(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                  dtype: torch.dtype, word_groups: torch.Tensor | None = None) -> torch.Tensor:
    """plait.layers.wna16.dequantize transposed, [K, N] in dtype, in one launch: the weights bit for bit."""
    pack = WORD_BITS // bits
    k, n, groups = codes.shape[0] * pack, codes.shape[1], scales.shape[0]
    w = torch.empty((k, n), dtype=dtype, device=codes.device)
    word_groups = _unit_n(word_groups) if word_groups is not None else None
    _dequantize_kernel[(triton.cdiv(k // pack, DEQUANT_BLOCK_W), triton.cdiv(n, DEQUANT_BLOCK_N))](
        codes, scales, zeros, word_groups if word_groups is not None else codes, w, n, k, groups,
        _group_rows(k, groups, pack, word_groups), codes.stride(0), scales.stride(0), zeros.stride(0),
        BITS=bits, PACK=pack, BLOCK_W=DEQUANT_BLOCK_W, BLOCK_N=DEQUANT_BLOCK_N,
        HALF=dtype == torch.float16 and scales.dtype == torch.float16, WORD_GROUPS=word_groups is not None,
        INTERPRETED_BF16=not codes.is_cuda and dtype == torch.bfloat16, num_warps=4,
    )
    return w


def _group_rows(k: int, groups: int, pack: int, word_groups: torch.Tensor | None) -> int:
    """The kernels' group_rows: K // G, or where word_groups names each word row's group (uneven groups), a
    word row's inputs (which no kernel then divides by)."""
    return k // groups if word_groups is None else pack


def _check(x2: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
           bias: torch.Tensor | None, word_groups: torch.Tensor | None = None) -> int:
    """The group_rows of a valid call (_group_rows), else a ValueError naming what does not fit."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{bits}-bit codes are not supported (bits {list(SUPPORTED_BITS)})")
    if x2.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"x must be bf16 or fp16, got {x2.dtype}")
    pack = WORD_BITS // bits
    k, n, groups = x2.shape[1], codes.shape[1], scales.shape[0]
    if codes.dtype != torch.int32 or codes.shape[0] * pack != k:
        raise ValueError(f"codes {tuple(codes.shape)} {codes.dtype} do not pack x's {k} inputs at {bits} "
                         "bits")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias {tuple(bias.shape)}, expected ({n},)")
    if scales.shape != (groups, n) or zeros.shape != (groups, n) or groups == 0:
        raise ValueError(f"scales {tuple(scales.shape)} and zeros {tuple(zeros.shape)} are not [G, {n}] "
                         "groups")
    if word_groups is not None:
        if word_groups.shape != (k // pack,) or word_groups.dtype != torch.int32:
            raise ValueError(f"word_groups {tuple(word_groups.shape)} {word_groups.dtype}: one int32 group a "
                             f"word row, ({k // pack},)")
        return _group_rows(k, groups, pack, word_groups)
    if k % groups:
        raise ValueError(f"scales {tuple(scales.shape)} and zeros {tuple(zeros.shape)} do not give [G, {n}] "
                         f"groups of {k} inputs")
    group_rows = k // groups
    if group_rows % pack:
        raise ValueError(f"{group_rows}-row groups split words of {pack} codes")
    return group_rows


def _unit_n(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@dataclass(frozen=True)
class FmaConfig:
    block_n: int = 128  # output columns a program
    block_w: int = 16  # word rows a step (block_w * pack inputs, within one group)
    split_k: int = 0  # programs along K; 0 = chosen to fill the GPU (split_for)
    num_warps: int = 4
    num_stages: int = 3


# Rows from this many on: the weights dequantised by one launch into a [K, N] scratch, then cuBLAS. Writing
# and re-reading 16-bit weights costs ~70 us on Llama-8B's gate/up (H200), less than the dequantising
# GEMM's shortfall against cuBLAS from ~256 rows on (188 against 104 + 70 us there; 649 against 364 + 70
# at 1,024).
DEQUANT_MIN_M = 256
DEQUANT_BLOCK_W = 8  # word rows a dequantisation program (64 4-bit inputs)
DEQUANT_BLOCK_N = 128

# Rows up to this take the FMA GEMV (_wna16_fma_kernel): each code unpacked (one LOP3) and multiplied on
# CUDA cores, which beats the dot's padded 16-row tile and its layout change of the unpacked weights at one
# row (Llama-8B's four layers: 88 us against 120 on an H200). Its weights are exact fp32, (code - zero) *
# scale unrounded: the reference's function with weights in fp32 (wna16_linear_ref's exact_weights).
FMA_MAX_M = 1
# 64 word rows a step (512 4-bit inputs, four 128-row groups) on 8 warps: the fastest of a sweep over block_n
# 64-256, block_w 16-64, 4 / 8 warps and 2 / 3 stages on Llama-8B's o, gate/up and down at one row (H200,
# benchmarks/results/wna16_kernels_h200.json); wider steps than one group beat group-sized ones by 15-30%.
FMA_CONFIG = FmaConfig(block_n=64, block_w=64, num_warps=8, num_stages=2)
# Measured FMA configs keyed by (bits, N, K) where they beat FMA_CONFIG (same sweep).
FMA_CONFIGS: dict[tuple[int, int, int], FmaConfig] = {
    (4, 6144, 4096): FmaConfig(block_n=128, block_w=64, num_warps=8, num_stages=2),  # llama-8b qkv
}


def fma_config(m: int, n: int, k: int, groups: int, bits: int,
               config: WNA16Config | FmaConfig | None = None, word_groups: bool = False) -> FmaConfig | None:
    """The FMA GEMV's config where it takes this call (``config`` an FmaConfig, or None and FMA_CONFIGS' or
    FMA_CONFIG usable), else None: the dot kernel's. ``word_groups``: the call comes with them."""
    if isinstance(config, WNA16Config):
        return None
    cfg = config or FMA_CONFIGS.get((bits, n, k), FMA_CONFIG)
    return cfg if fma_usable(m, k, groups, k // groups, bits, cfg, word_groups) else None


def fma_usable(m: int, k: int, groups: int, group_rows: int, bits: int, cfg: FmaConfig = FMA_CONFIG,
               word_groups: bool = False) -> bool:
    """Whether _wna16_fma_kernel takes this call: one row, its steps (block_w words) whole groups or within
    one, and K whole steps; with word_groups (each word row's group read, rows past K masked) any K."""
    if word_groups:
        return 0 < m <= FMA_MAX_M
    step = cfg.block_w * (WORD_BITS // bits)
    aligned = groups == 1 or group_rows % step == 0 or step % group_rows == 0
    return 0 < m <= FMA_MAX_M and aligned and k % step == 0


def _fma_gemv(x2: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
              bias: torch.Tensor | None, out: torch.Tensor, group_rows: int, cfg: FmaConfig,
              word_groups: torch.Tensor | None) -> None:
    (m, k), n, groups = x2.shape, codes.shape[1], scales.shape[0]
    pack = WORD_BITS // bits
    word_rows = k // pack
    steps = triton.cdiv(word_rows, cfg.block_w)
    tiles = triton.cdiv(n, cfg.block_n)
    split = cfg.split_k or split_for(tiles, k, cfg.block_w * pack, GEMV_PROGRAMS_PER_SM, sm_count(x2.device))
    iters = triton.cdiv(steps, max(1, min(split, steps)))
    split = triton.cdiv(steps, iters)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x2.device) if split > 1 else out
    _wna16_fma_kernel[(tiles, split)](
        x2, codes, scales, zeros, word_groups if word_groups is not None else codes,
        bias if bias is not None else out, out, part,
        n, k, groups, group_rows, codes.stride(0), scales.stride(0), zeros.stride(0),
        iters, STATIC_K_ITERS=static_iters(x2.is_cuda, iters), BITS=bits, PACK=pack,
        BLOCK_N=cfg.block_n, BLOCK_W=cfg.block_w,
        ROW_GROUPS=word_groups is not None or (groups > 1 and cfg.block_w * pack > group_rows),
        WORD_GROUPS=word_groups is not None, TO_WORKSPACE=split > 1,
        HAS_BIAS=bias is not None, INTERPRETED_BF16=not x2.is_cuda and x2.dtype == torch.bfloat16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(x2),
    )
    if split > 1:
        reduce_splits(part, bias, out)


def wna16_gemm(x2: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
               bias: torch.Tensor | None = None, config: WNA16Config | FmaConfig | None = None,
               word_groups: torch.Tensor | None = None) -> torch.Tensor:
    """x2 @ dequantize(codes, scales, zeros, bits, x2.dtype, word_groups).T (+ bias) for 2-D x2; ``config``
    overrides the launch shape (tests, sweeps; its split_k 0 is chosen as the default's)."""
    # x2: [M, K] bf16/fp16; codes: [K // pack, N] int32; scales, zeros: [G, N]; word_groups: [K // pack]
    # int32 or None; bias: [N] -> [M, N] x2.dtype
    group_rows = _check(x2, codes, scales, zeros, bits, bias, word_groups)
    x2 = _unit_n(x2)
    codes, scales, zeros = _unit_n(codes), _unit_n(scales), _unit_n(zeros)
    word_groups = _unit_n(word_groups) if word_groups is not None else None
    (m, k), n, groups = x2.shape, codes.shape[1], scales.shape[0]
    out = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    if m == 0 or n == 0:
        return out
    if config is None and m >= DEQUANT_MIN_M:
        # Prompt-sized: the weights dequantised once (the reference's, bit for bit), then cuBLAS.
        w = dequantize_kn(codes, scales, zeros, bits, x2.dtype, word_groups)
        return torch.addmm(bias, x2, w) if bias is not None else torch.mm(x2, w)
    fma = fma_config(m, n, k, groups, bits, config, word_groups is not None)
    if fma is not None:
        _fma_gemv(x2, codes, scales, zeros, bits, bias, out, group_rows, fma, word_groups)
        return out
    if not isinstance(config, WNA16Config):
        cfg = default_config(m, n, k, sm_count(x2.device))
    else:
        cfg = _with_split(config, m, n, k, sm_count(x2.device))
    block_k = cfg.block_k
    # Each split takes whole steps; no split is left without one.
    steps = triton.cdiv(k, block_k)
    iters = triton.cdiv(steps, max(1, min(cfg.split_k, steps)))
    split = triton.cdiv(steps, iters)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x2.device) if split > 1 else out
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    _wna16_gemm_kernel[(tiles, split)](
        x2, codes, scales, zeros, word_groups if word_groups is not None else codes,
        bias if bias is not None else out, out, part,
        m, n, k, groups, group_rows, x2.stride(0), codes.stride(0), scales.stride(0), zeros.stride(0),
        out.stride(0), iters,
        STATIC_K_ITERS=static_iters(x2.is_cuda, iters), BITS=bits, PACK=WORD_BITS // bits,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, GROUP_M=cfg.group_m,
        TILE_IN_GROUP=word_groups is None and (groups == 1 or group_rows % block_k == 0),
        EVEN_K=iters * split * block_k == k, TO_WORKSPACE=split > 1, HAS_BIAS=bias is not None,
        HALF=x2.dtype == torch.float16 and scales.dtype == torch.float16, WORD_GROUPS=word_groups is not None,
        INTERPRETED_BF16=not x2.is_cuda and x2.dtype == torch.bfloat16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(x2),
    )
    if split > 1:
        reduce_splits(part, bias, out)
    return out


def wna16_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                 bias: torch.Tensor | None = None, config: WNA16Config | FmaConfig | None = None,
                 word_groups: torch.Tensor | None = None) -> torch.Tensor:
    """x @ dequantize(codes, scales, zeros, bits, x.dtype, word_groups).T + bias, on CUDA (x: [..., K]
    bf16/fp16 -> [..., N] x.dtype); ``config`` overrides the launch shape (tests, sweeps); ``word_groups``:
    [K // pack] int32, each word row's group (uneven groups), else row k's is k // (K // G)."""
    x2 = x.reshape(-1, x.shape[-1])
    n = codes.shape[1]
    return wna16_gemm(x2, codes, scales, zeros, bits, bias, config, word_groups).view(*x.shape[:-1], n)
