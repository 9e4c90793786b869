"""Decode-sized matmuls (M <= 16 rows) in Triton that stream the weight at close to HBM bandwidth."""

# At batch 1 a decode step is the time to read every weight once; cuBLAS reads at ~81% of HBM
# bandwidth for M = 1 (shared GPU-NOTES.md). Each program here owns BLOCK_N weight rows and one
# slice of K (split-K when N alone gives too few programs), loads [BLOCK_N, BLOCK_K] tiles with
# wide coalesced loads along K, and either multiplies-and-accumulates on CUDA cores (small M:
# per-lane partial sums, reduced once after the loop, tiles double-buffered in registers) or feeds
# tensor cores through tl.dot with x padded to 16 rows (loads pipelined by num_stages). Split-K
# partials go to an fp32 workspace reduced by a second launch in a fixed order, so results are
# deterministic. No host syncs and shape-determined allocations: CUDA-graph capturable. Configs
# come from a table plus a heuristic, never launch-time autotuning.

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from plait.kernels.activation import silu_and_mul_ref, silu_rounded
from plait.kernels.interpreter import static_iters, trip_count
from plait.kernels.pdl import pdl_args, pdl_prologue

# Largest row count routed here; beyond it the matmul is no longer bound by reading the weight.
SKINNY_MAX_M = 16
# tl.dot needs at least 16 rows, so the tensor-core variant pads x to this many.
DOT_BLOCK_M = 16
# Programs the heuristic aims for per SM: enough loads in flight to cover HBM latency.
PROGRAMS_PER_SM = 3
# SM count assumed off-GPU (the interpreter), where it only shapes the heuristic's choice.
DEFAULT_NUM_SMS = 132
# Upper bound on the CUDA-core accumulator, BLOCK_M * BLOCK_N * BLOCK_K fp32 values per program
# (x2 for gate/up): 32 registers a thread at 4 warps, which with the double-buffered tiles keeps a
# program near 100 registers (ptxas for sm_90), so 4-5 programs fit on an SM.
FMA_ACC_ELEMENTS = 4096
MAX_FMA_BLOCK_N = 32
MIN_BLOCK_K = 16  # tl.dot's smallest K
# Split-K is never finer than this many K elements per program.
MIN_K_PER_SPLIT = 512
MAX_SPLIT_K = 16
REDUCE_BLOCK = 1024
# PLAIT_GEMV_EARLY_WEIGHTS=0 makes the CUDA-core GEMV wait for its predecessor before its first weight
# load (A/B comparisons).
EARLY_WEIGHTS_ENV = "PLAIT_GEMV_EARLY_WEIGHTS"
_early_weights = os.environ.get(EARLY_WEIGHTS_ENV, "1") != "0"


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int  # weight rows per program (for gate/up: rows of each half)
    block_k: int  # K elements per loop step
    split_k: int = 1  # programs along K; > 1 adds a reduction launch over an fp32 workspace
    use_dot: bool = False  # tensor cores on x padded to 16 rows, else CUDA-core multiply-accumulate
    num_warps: int = 4
    num_stages: int = 2  # software-pipelining depth of the K loop (used by the tl.dot variant)
    prefetch: int = 1  # CUDA-core variant: K steps whose tiles are in flight ahead of the FMAs (1..3)


def _fma(block_n: int, block_k: int, num_warps: int, prefetch: int = 1) -> SkinnyConfig:
    return SkinnyConfig(block_n=block_n, block_k=block_k, split_k=1, use_dot=False, num_warps=num_warps,
                        num_stages=1, prefetch=prefetch)


def _dot(block_n: int, block_k: int, split_k: int, num_stages: int) -> SkinnyConfig:
    return SkinnyConfig(block_n=block_n, block_k=block_k, split_k=split_k, use_dot=True, num_warps=4,
                        num_stages=num_stages)


# Shapes where the skinny GEMM measured faster than cuBLAS, keyed by (M bucket, N, K), with the best
# config found. (The lm_heads, where it also won at M=16, now take fp32-output GEMMs: logits_fp32.)
# config found (H200, benchmarks/results/dense_kernels_h200.json). plait.layers.linear sends a matmul
# here only for these keys (unless PLAIT_SKINNY_GEMM=1 forces it for all, with heuristic_config()).
# M bucket = next power of two of M (1, 2, 4, 8, 16). benchmarks/kernels/dense_bench.py prints lines
# to paste here.
SKINNY_CONFIGS: dict[tuple[int, int, int], SkinnyConfig] = {
    # llama-8b qkv, down and gate/up at batch 1: inside the PDL chain (cuBLAS stays out of it), W3 took
    # 4.50 ms a token against 4.59 with cuBLAS for qkv and down (w3_skinny_qkv_down_h200.json); then
    # gate/up here (8 rows, 128-wide K steps, two steps in flight) and down on 4-row blocks: 4.26
    # against 4.35, alternated one process a run on one H200 (w3_gemv_configs_h200.json). Chosen by
    # whole W3 runs, not kernel timings: a 32-layer GEMV chain favoured other picks (o on 4-row blocks,
    # qkv with three steps in flight) that each cost W3 0.03-0.06 ms.
    (1, 6144, 4096): _fma(block_n=8, block_k=256, num_warps=4),
    (1, 4096, 14336): _fma(block_n=4, block_k=512, num_warps=4),
    (1, 28672, 4096): _fma(block_n=8, block_k=128, num_warps=4, prefetch=2),
    # llama-8b o: 2839 vs cuBLAS 2524 GB/s
    (1, 4096, 4096): _fma(block_n=8, block_k=512, num_warps=4),
    # qwen3-0.6b qkv: 1632 vs cuBLAS 1506 GB/s
    (1, 4096, 1024): _fma(block_n=8, block_k=1024, num_warps=8),
    # qwen3-0.6b o: 983 / 969 / 693 vs cuBLAS 327 / 329 / 513 GB/s
    (1, 1024, 2048): _fma(block_n=2, block_k=512, num_warps=4),
    (2, 1024, 2048): _fma(block_n=2, block_k=512, num_warps=4),
    (4, 1024, 2048): _dot(block_n=32, block_k=128, split_k=4, num_stages=4),
    # qwen3-0.6b down: 1214 / 1174 / 925 / 939 / 959 vs cuBLAS 860 / 819 / 818 / 817 / 824 GB/s
    (1, 1024, 3072): _fma(block_n=2, block_k=512, num_warps=4),
    (2, 1024, 3072): _fma(block_n=2, block_k=512, num_warps=4),
    (4, 1024, 3072): _dot(block_n=32, block_k=256, split_k=4, num_stages=3),
    (8, 1024, 3072): _dot(block_n=32, block_k=128, split_k=4, num_stages=4),
    (16, 1024, 3072): _dot(block_n=32, block_k=128, split_k=4, num_stages=4),
    # smollm3-3b qkv, o at 1 / 4 rows and down at 1 / 4 / 16 rows: 5.1, 4.2 / 5.8 and 15.6 / 16.4 / 16.3 us
    # against cuBLAS's 6.4, 6.0 / 6.1 and 17.2 / 17.2 / 17.0 (dense_kernels_smollm3_h200.json); its gate/up
    # stays on cuBLAS (25.1 us against 26.1 at best).
    (1, 3072, 2048): _fma(block_n=4, block_k=512, num_warps=4),
    (1, 2048, 2048): _fma(block_n=4, block_k=512, num_warps=4),
    (4, 2048, 2048): _dot(block_n=64, block_k=128, split_k=4, num_stages=4),
    (1, 2048, 11008): SkinnyConfig(block_n=8, block_k=512, split_k=2, use_dot=False, num_warps=4,
                                   num_stages=1),
    (4, 2048, 11008): _dot(block_n=32, block_k=128, split_k=8, num_stages=4),
    (16, 2048, 11008): _dot(block_n=32, block_k=128, split_k=8, num_stages=4),
}
# The fused gate/up + SiLU kernel never beat cuBLAS followed by the Triton silu_and_mul on the H200
# (e.g. llama-8b M=8: 59.6 vs 58.1 us), so no shape is listed and the MLP keeps the two launches.
GATE_UP_CONFIGS: dict[tuple[int, int, int], SkinnyConfig] = {}
# lm_heads (fp32 logits, plait.layers.linear.logits_fp32): this config won at every M of both
# vocabularies measured, within 0.2% of cuBLAS's bf16 GEMV or faster at Llama-8B's.
LOGITS_CONFIG = _dot(block_n=64, block_k=128, split_k=1, num_stages=4)


def measured_faster(m: int, n: int, k: int, gate_up: bool = False) -> bool:
    """Whether this shape is one where the skinny kernel beat cuBLAS when measured."""
    return (m_bucket(m), n, k) in (GATE_UP_CONFIGS if gate_up else SKINNY_CONFIGS)


def skinny_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return F.linear(x, weight, bias)


def skinny_gate_up_silu_ref(x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
    return silu_and_mul_ref(F.linear(x, w_gate_up))


def m_bucket(m: int) -> int:
    return triton.next_power_of_2(max(m, 1))


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device`` (DEFAULT_NUM_SMS off the GPU, where only heuristics read it)."""
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def split_for(programs: int, k: int, block_k: int, num_sms: int = DEFAULT_NUM_SMS) -> int:
    """Smallest power-of-two split of K that gives PROGRAMS_PER_SM programs per SM, within limits."""
    target = PROGRAMS_PER_SM * num_sms
    split = 1
    while (programs * split < target and split < MAX_SPLIT_K
           and k // (2 * split) >= max(MIN_K_PER_SPLIT, block_k)):
        split *= 2
    return split


@functools.cache  # pure in its ints; called on every launch of a shape the tables do not hold
def heuristic_config(m: int, n: int, k: int, num_sms: int = DEFAULT_NUM_SMS, halves: int = 1) -> SkinnyConfig:
    """A reasonable config for an (M, N, K) not in the tables; halves=2 for the fused gate/up kernel.

    M <= 2: CUDA-core accumulation (no padding waste), 512-wide K steps, the widest row block that
    still gives PROGRAMS_PER_SM programs per SM. M > 2: tl.dot on 16-row tiles, 32 weight rows x
    128 K per stage, 4 stages. Either way split-K fills the GPU where N alone cannot.
    """
    bm = m_bucket(m)
    k_pow2 = max(MIN_BLOCK_K, triton.next_power_of_2(k))  # no K step wider than K itself
    if bm <= 2:
        block_k = min(512, k_pow2)
        block_n = max(1, min(MAX_FMA_BLOCK_N, FMA_ACC_ELEMENTS // (bm * block_k * halves)))
        while block_n > 1 and triton.cdiv(n, block_n) < PROGRAMS_PER_SM * num_sms:
            block_n //= 2
        cfg = dict(block_n=block_n, block_k=block_k, use_dot=False, num_warps=4, num_stages=1)
    else:
        block_n, block_k = 32, min(128, k_pow2)
        cfg = dict(block_n=block_n, block_k=block_k, use_dot=True, num_warps=4, num_stages=4)
    return SkinnyConfig(split_k=split_for(triton.cdiv(n, block_n), k, block_k, num_sms), **cfg)


def get_config(m: int, n: int, k: int, device: torch.device, gate_up: bool = False) -> SkinnyConfig:
    table = GATE_UP_CONFIGS if gate_up else SKINNY_CONFIGS
    cfg = table.get((m_bucket(m), n, k))
    if cfg is None:
        cfg = heuristic_config(m, n, k, sm_count(device), halves=2 if gate_up else 1)
    return cfg


@triton.jit
def _mac(acc, x, w, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # x: [BLOCK_M, BLOCK_K]; w: [BLOCK_N, BLOCK_K]
    # (if/else rather than an early return: Triton generates code after a constexpr-if return too.)
    if USE_DOT:
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    else:
        # acc: [BLOCK_M, BLOCK_N, BLOCK_K]: lanes accumulate independently; reduced once after the loop.
        acc = acc + x[:, None, :].to(tl.float32) * w[None, :, :].to(tl.float32)
    return acc


@triton.jit
def _load_step(x_ptrs, w_ptrs, up_off, step, k_lo, offs_k, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
               GATE_UP: tl.constexpr):
    """x, gate-or-plain and up weight tiles of K step `step` (w_up is w when there is no up half)."""
    shift = step * BLOCK_K
    if EVEN_K:
        x = tl.load(x_ptrs + shift)
        w = tl.load(w_ptrs + shift)
        if GATE_UP:
            w_up = tl.load(w_ptrs + up_off + shift)
        else:
            w_up = w
    else:
        k_mask = (k_lo + shift + offs_k) < K
        x = tl.load(x_ptrs + shift, mask=k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs + shift, mask=k_mask[None, :], other=0.0)
        if GATE_UP:
            w_up = tl.load(w_ptrs + up_off + shift, mask=k_mask[None, :], other=0.0)
        else:
            w_up = w
    return x, w, w_up


@triton.jit
def _finish(acc, USE_DOT: tl.constexpr):
    if USE_DOT:
        out = acc
    else:
        out = tl.sum(acc, axis=2)
    return out


@triton.jit
def _epilogue(acc_g, acc_u, b_ptr, offs_n, n_mask, out_dtype: tl.constexpr,
              HAS_BIAS: tl.constexpr, GATE_UP: tl.constexpr, PRECISE: tl.constexpr):
    """fp32 sums -> output values; the gate/up form rounds where the unfused torch path does."""
    if GATE_UP:
        gate = acc_g.to(out_dtype).to(tl.float32)  # F.linear's output rounding
        up = acc_u.to(out_dtype).to(tl.float32)
        y = (silu_rounded(gate, out_dtype, PRECISE) * up).to(out_dtype)
    else:
        if HAS_BIAS:
            acc_g += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        y = acc_g.to(out_dtype)
    return y


@triton.jit
def program_tile(M, N, k_iters, STATIC_K_ITERS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """A GEMV program's place: (pid_n, pid_k, offs_n, offs_m, offs_k, rows_n, rows_m, k_lo) for grid
    (weight-row blocks, K splits), each split k_iters steps of BLOCK_K.

    Rows past the end (rows_n, rows_m) re-read the last valid row instead of being masked, so weight
    and x loads stay unpredicated along K; those results are dropped at the store."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    rows_m = tl.minimum(offs_m, M - 1)
    k_lo = pid_k * (trip_count(STATIC_K_ITERS, k_iters) * BLOCK_K)
    return pid_n, pid_k, offs_n, offs_m, offs_k, rows_n, rows_m, k_lo


# M (the step's row count) changes from step to step; specialising on M == 16 would compile a second
# binary mid-run (see plait.kernels.paged_attention on per-step arguments).
@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, res_ptr, ss_out_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, stride_rm, up_rows, k_iters,
    STATIC_K_ITERS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    TO_WORKSPACE: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    GATE_UP: tl.constexpr, PRECISE: tl.constexpr, PDL: tl.constexpr, EARLY_W: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr, PREFETCH: tl.constexpr,
):
    # out[m, n] = sum_k x[m, k] * w[n, k]; GATE_UP: out[m, n] = silu(gate[m, n]) * up[m, n] with the
    # up row of output n at weight row up_rows + n.
    # ADD_RESIDUAL: out = round(round(x @ w^T) + res), as torch's residual add, plus this program's sum
    # of out^2 per row into ss_out[m, program]: what the next RMSNorm needs, so that norm can ride on a
    # later kernel (silu_and_mul) instead of taking a launch of its own.
    if not EARLY_W:
        pdl_prologue(PDL)
    pid_n, pid_k, offs_n, offs_m, offs_k, rows_n, rows_m, k_lo = program_tile(
        M, N, k_iters, STATIC_K_ITERS, BLOCK_M, BLOCK_N, BLOCK_K)
    w_ptrs = w_ptr + rows_n[:, None] * stride_wn + (k_lo + offs_k)[None, :]
    x_ptrs = x_ptr + rows_m[:, None] * stride_xm + (k_lo + offs_k)[None, :]
    up_off = up_rows * stride_wn
    if USE_DOT:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = acc_g
    if USE_DOT:
        # num_stages pipelines these loads through shared memory (cp.async).
        for it in range(trip_count(STATIC_K_ITERS, k_iters)):
            x, w, w_up = _load_step(x_ptrs, w_ptrs, up_off, it, k_lo, offs_k, K, BLOCK_K, EVEN_K, GATE_UP)
            acc_g = _mac(acc_g, x, w, USE_DOT, DOT_PRECISION)
            if GATE_UP:
                acc_u = _mac(acc_u, x, w_up, USE_DOT, DOT_PRECISION)
    else:
        # Triton does not pipeline loads that feed no tl.dot, so double-buffer in registers: the next
        # step's tiles are requested before this step's FMAs wait on theirs (the last step re-reads
        # its own tiles, from cache, to keep the loop uniform).
        if EARLY_W:
            # Weights are never written by an earlier kernel, so the first tile is requested before
            # the PDL wait: its HBM latency overlaps the predecessor's tail instead of following it.
            _, w, w_up = _load_step(x_ptrs, w_ptrs, up_off, 0, k_lo, offs_k, K, BLOCK_K, EVEN_K, GATE_UP)
            pdl_prologue(PDL)
            x, _, _ = _load_step(x_ptrs, w_ptrs, up_off, 0, k_lo, offs_k, K, BLOCK_K, EVEN_K, False)
        else:
            x, w, w_up = _load_step(x_ptrs, w_ptrs, up_off, 0, k_lo, offs_k, K, BLOCK_K, EVEN_K, GATE_UP)
        # Past the PDL wait, requested before the loop and used after it: its latency hides behind the
        # weight stream instead of adding to the kernel's tail.
        if ADD_RESIDUAL:
            res = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :],
                          mask=(offs_m < M)[:, None] & (offs_n < N)[None, :], other=0.0)
        last = trip_count(STATIC_K_ITERS, k_iters) - 1
        if PREFETCH == 1:
            for it in range(trip_count(STATIC_K_ITERS, k_iters)):
                x_n, w_n, w_up_n = _load_step(x_ptrs, w_ptrs, up_off, tl.minimum(it + 1, last), k_lo, offs_k,
                                              K, BLOCK_K, EVEN_K, GATE_UP)
                acc_g = _mac(acc_g, x, w, USE_DOT, DOT_PRECISION)
                if GATE_UP:
                    acc_u = _mac(acc_u, x, w_up, USE_DOT, DOT_PRECISION)
                x, w, w_up = x_n, w_n, w_up_n
        else:
            # Deeper ring: the tiles of the next PREFETCH steps are in flight while this step's FMAs run.
            x1, w1, w_up1 = _load_step(x_ptrs, w_ptrs, up_off, tl.minimum(1, last), k_lo, offs_k, K,
                                       BLOCK_K, EVEN_K, GATE_UP)
            x2, w2, w_up2 = x1, w1, w_up1
            if PREFETCH == 3:
                x2, w2, w_up2 = _load_step(x_ptrs, w_ptrs, up_off, tl.minimum(2, last), k_lo, offs_k, K,
                                           BLOCK_K, EVEN_K, GATE_UP)
            for it in range(trip_count(STATIC_K_ITERS, k_iters)):
                x_n, w_n, w_up_n = _load_step(x_ptrs, w_ptrs, up_off, tl.minimum(it + PREFETCH, last), k_lo,
                                              offs_k, K, BLOCK_K, EVEN_K, GATE_UP)
                acc_g = _mac(acc_g, x, w, USE_DOT, DOT_PRECISION)
                if GATE_UP:
                    acc_u = _mac(acc_u, x, w_up, USE_DOT, DOT_PRECISION)
                if PREFETCH == 3:
                    x, w, w_up = x1, w1, w_up1
                    x1, w1, w_up1 = x2, w2, w_up2
                    x2, w2, w_up2 = x_n, w_n, w_up_n
                else:
                    x, w, w_up = x1, w1, w_up1
                    x1, w1, w_up1 = x_n, w_n, w_up_n
    sum_g = _finish(acc_g, USE_DOT)
    sum_u = _finish(acc_u, USE_DOT)
    n_mask = offs_n < N
    mask = (offs_m < M)[:, None] & n_mask[None, :]
    if not TO_WORKSPACE:
        y = _epilogue(sum_g, sum_u, b_ptr, offs_n, n_mask, out_ptr.dtype.element_ty,
                      HAS_BIAS, GATE_UP, PRECISE)
        if ADD_RESIDUAL:
            y = (y.to(tl.float32) + res.to(tl.float32)).to(out_ptr.dtype.element_ty)
            y32 = tl.where(mask, y.to(tl.float32), 0.0)
            tl.store(ss_out_ptr + offs_m * tl.num_programs(0) + pid_n, tl.sum(y32 * y32, axis=1),
                     mask=offs_m < M)
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y, mask=mask)
    else:
        # part: [split_k, M, N] fp32, or [split_k, M, 2N] (gate then up) for GATE_UP.
        width = 2 * N if GATE_UP else N
        part = part_ptr + pid_k * M * width + offs_m[:, None] * width + offs_n[None, :]
        tl.store(part, sum_g, mask=mask)
        if GATE_UP:
            tl.store(part + N, sum_u, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _split_k_reduce_kernel(
    part_ptr, b_ptr, out_ptr, M, N, stride_om,
    SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, GATE_UP: tl.constexpr,
    PRECISE: tl.constexpr, PDL: tl.constexpr,
):
    # Sums the split-K partials in a fixed order (deterministic), then the same epilogue as an unsplit launch.
    pdl_prologue(PDL)
    m = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n_mask = offs_n < N
    width = 2 * N if GATE_UP else N
    acc_g = tl.zeros((1, BLOCK), dtype=tl.float32)
    acc_u = tl.zeros((1, BLOCK), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        row = part_ptr + (s * M + m) * width + offs_n
        acc_g += tl.load(row, mask=n_mask, other=0.0)[None, :]
        if GATE_UP:
            acc_u += tl.load(row + N, mask=n_mask, other=0.0)[None, :]
    y = _epilogue(acc_g, acc_u, b_ptr, offs_n, n_mask, out_ptr.dtype.element_ty, HAS_BIAS, GATE_UP, PRECISE)
    tl.store(out_ptr + m * stride_om + offs_n[None, :], y, mask=n_mask[None, :])


def _launch(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int, cfg: SkinnyConfig,
            gate_up: bool, out_dtype: torch.dtype | None = None, residual: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    # x2: [M, K]; weight: [N, K] (or [2N, K] for gate_up) -> out: [M, N] in out_dtype (default x's),
    # and with a residual the [M, programs] sum-of-squares partials of out.
    m, k = x2.shape
    if residual is not None and (cfg.use_dot or cfg.split_k > 1 or gate_up):
        raise ValueError(f"a residual add needs an unsplit CUDA-core config, got {cfg}")
    out = torch.empty((m, n), dtype=out_dtype or x2.dtype, device=x2.device)
    programs_n = triton.cdiv(n, cfg.block_n)
    sum_sq = (torch.empty((m, programs_n), dtype=torch.float32, device=x2.device)
              if residual is not None else out)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    even_k = k_per_split * cfg.split_k == k
    block_m = DOT_BLOCK_M if cfg.use_dot else m_bucket(m)
    width = 2 * n if gate_up else n
    part = (torch.empty((cfg.split_k, m, width), dtype=torch.float32, device=x2.device)
            if cfg.split_k > 1 else out)
    bias_arg = bias if bias is not None else out
    precise = x2.is_cuda
    grid = (programs_n, cfg.split_k)
    res = residual if residual is not None else out
    _skinny_kernel[grid](
        x2, weight, bias_arg, out, part, res, sum_sq, m, n, k, x2.stride(0), weight.stride(0),
        out.stride(0), res.stride(0), n, k_per_split // cfg.block_k,
        STATIC_K_ITERS=static_iters(x2.is_cuda, k_per_split // cfg.block_k),
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        TO_WORKSPACE=cfg.split_k > 1,
        USE_DOT=cfg.use_dot, DOT_PRECISION="ieee" if x2.dtype == torch.float32 else "tf32",
        EVEN_K=even_k, HAS_BIAS=bias is not None, GATE_UP=gate_up, PRECISE=precise,
        EARLY_W=_early_weights and not cfg.use_dot,
        ADD_RESIDUAL=residual is not None, PREFETCH=cfg.prefetch,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(x2),
    )
    if cfg.split_k > 1:
        reduce_splits(part, bias, out, gate_up)
    return out, (sum_sq if residual is not None else None)


def reduce_splits(part: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, gate_up: bool = False
                  ) -> None:
    """out = the split-K partials summed in a fixed order, plus bias, rounded as an unsplit launch would."""
    # part: [split_k, M, N] fp32 ([split_k, M, 2N] gate then up for gate_up); out: [M, N]
    split_k, m = part.shape[:2]
    n = out.shape[1]
    block = min(REDUCE_BLOCK, triton.next_power_of_2(n))
    _split_k_reduce_kernel[(m, triton.cdiv(n, block))](
        part, bias if bias is not None else out, out, m, n, out.stride(0), SPLIT_K=split_k, BLOCK=block,
        HAS_BIAS=bias is not None, GATE_UP=gate_up, PRECISE=part.is_cuda, num_warps=4, **pdl_args(part),
    )


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"weight must be [N, K] with unit stride along K, got {tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[1] or x.dtype != weight.dtype:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not match weight {tuple(weight.shape)} "
                         f"{weight.dtype}")


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias) for at most SKINNY_MAX_M rows; config overrides the table/heuristic;
    out_dtype (e.g. fp32 logits) is what the fp32 accumulator is rounded to (default: x's dtype)."""
    # x: [..., K]; weight: [N, K]; bias: [N] -> [..., N]
    _check(x, weight)
    x2 = _rows(x)
    m, n = x2.shape[0], weight.shape[0]
    if m == 0 or m > SKINNY_MAX_M:
        raise ValueError(f"skinny_linear takes 1..{SKINNY_MAX_M} rows, got {m}")
    cfg = config or get_config(m, n, x2.shape[1], x2.device)
    return _launch(x2, weight, bias, n, cfg, gate_up=False, out_dtype=out_dtype)[0].view(*x.shape[:-1], n)


def skinny_gate_up_silu(
    x: torch.Tensor, w_gate_up: torch.Tensor, config: SkinnyConfig | None = None
) -> torch.Tensor:
    """silu(x @ w_gate[:I].T) * (x @ w_gate_up[I:].T), rounded where the unfused path rounds."""
    # x: [..., K]; w_gate_up: [2I, K] (gate rows then up rows) -> [..., I]
    _check(x, w_gate_up)
    if w_gate_up.shape[0] % 2:
        raise ValueError(f"w_gate_up needs gate rows then as many up rows, got {w_gate_up.shape[0]} rows")
    x2 = _rows(x)
    m, inter = x2.shape[0], w_gate_up.shape[0] // 2
    if m == 0 or m > SKINNY_MAX_M:
        raise ValueError(f"skinny_gate_up_silu takes 1..{SKINNY_MAX_M} rows, got {m}")
    cfg = config or get_config(m, inter, x2.shape[1], x2.device, gate_up=True)
    return _launch(x2, w_gate_up, None, inter, cfg, gate_up=True)[0].view(*x.shape[:-1], inter)


def skinny_linear_add_ref(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ weight.T + residual, each row's sum of squares as [M, 1]) the way torch rounds them."""
    h = F.linear(x, weight) + residual
    return h, h.float().pow(2).sum(-1, keepdim=True)


def skinny_linear_add(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, config: SkinnyConfig | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ weight.T + residual, its rows' sum-of-squares partials) in one launch: a decoder's output
    projection and the pre-norm residual add, leaving what a later kernel needs to apply the next
    RMSNorm as a row scale (plait.layers.norm.RowNorm). The partials are [M, programs] fp32, summed by
    the consumer in a fixed order."""
    # x: [M, K]; weight: [N, K]; residual: [M, N] -> ([M, N], [M, programs])
    _check(x, weight)
    x2 = _rows(x)
    m, n = x2.shape[0], weight.shape[0]
    if residual.shape != (m, n) or residual.stride(-1) != 1 or residual.dtype != x.dtype:
        raise ValueError(f"residual must be [{m}, {n}] {x.dtype} with unit stride, got "
                         f"{tuple(residual.shape)} {residual.dtype}")
    cfg = config or get_config(m, n, x2.shape[1], x2.device)
    return _launch(x2, weight, None, n, cfg, gate_up=False, residual=residual)


def fusable_config(m: int, n: int, k: int, device: torch.device) -> bool:
    """Whether the (M, N, K) matmul's config can take a residual add (unsplit, CUDA cores)."""
    cfg = get_config(m, n, k, device)
    return not cfg.use_dot and cfg.split_k == 1
