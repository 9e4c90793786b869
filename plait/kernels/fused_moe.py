"""fused_moe: a sparse MoE block's routed experts in two grouped Triton GEMMs, with its torch reference."""

# Every token picks top_k of E experts; expert e is a gated MLP, w13[e] ([2I, H]: gate rows, then up
# rows) and w2[e] ([H, I]). The T * k (token, slot) pairs, "entries" (entry id = token * k + slot), are
# grouped by expert with moe_align (torch ops, no host sync): each expert's group is padded to a multiple of
# block_m, so every block of block_m sorted entries belongs to one expert. Then three launches:
#   1. _moe_gemm_kernel (GATE_UP): per block and column tile, x[entry // k] @ w13[e]^T for the gate and the
#      up columns at once, then act(gate, up) in the epilogue, rounded where torch rounds -> inter [T*k, I];
#   2. _moe_gemm_kernel: inter[entry] @ w2[e]^T, the fp32 accumulator times the entry's routing
#      weight, rounded once -> per-slot outputs [T*k, H];
#   3. _moe_sum_kernel: each token's k slot rows summed in slot order in fp32 -> [T, H].
# act is "silu" (Mixtral, Qwen-MoE: silu(gate) * up) or "swiglu_oai" (OpenAI's gpt-oss: swiglu_oai_ref),
# a constexpr of the kernels; or "relu2_no_mul" (NemotronH's ungated experts: relu(up)^2), whose w13[e] is
# [I, H], the up rows alone: GEMM 1 then reads one row block (GATED false) and squares its relu. gpt-oss's
# experts also have biases, w13_bias [E, 2I] (gate, then up, as w13's rows) and w2_bias [E, H]: each GEMM's
# epilogue adds its expert's bias to the fp32 sums, before the activation (1) or the routing weight (2),
# rounded as transformers' GptOssExperts rounds (see _epilogue).
# Rows are indexed by entry id, so no scatter needs atomics and every result is deterministic. Every buffer's
# shape is a function of (T, k, E, H, I) and the grid is sized for the worst routing (programs past the real
# padded length return at once): CUDA-graph capturable. fused_moe_ref is HF transformers 5's MixtralExperts
# loop in torch: the CPU path and the tests' oracle.
#
# Block-wise FP8 experts (W8A8, as plait.layers.fp8_block serves dense layers): w13 / w2 float8_e4m3fn codes
# with one fp32 scale per [bn, bk] tile of each expert (w13_scale [E, 2I / bn, cdiv(H, bk)], w2_scale
# [E, cdiv(H, bn), cdiv(I, bk)]). Each GEMM's input is quantised per row and per group of bk along K
# (quantize_groups_fp8: x before GEMM 1, h before GEMM 2), and the kernels walk K one bk block at a time,
# scaling each block's sum of code products by the row's and the tile's scales into an fp32 accumulator;
# every rounding to x's dtype stays where it is for 16-bit weights.
#
# MXFP4 experts (W4A16, as gpt-oss's checkpoints hold them; plait.layers.mxfp4): w13 / w2 uint8, two E2M1
# codes a byte (the low nibble first) along K, one E8M0 scale byte per 32 of K (w13_scale [E, 2I, H / 32],
# w2_scale [E, H, I / 32]). Each K step of the kernels loads its [BLOCK_N, BLOCK_K / 32, 16] bytes (one
# 32-value group's 16 bytes contiguous) and its [BLOCK_N, BLOCK_K / 32, 1] scale bytes and decodes them in
# registers to x's dtype (_mxfp4_tile), then takes the 16-bit weights' dot or fp32 lanes. Every FP4 value
# times a power of two is exact in fp32 and bf16, so with the same tiles the kernels compute on exactly
# dequantize_mxfp4's weights: the same results, bit for bit, as on those weights in 16 bits.
#
# Integer experts (W4A16 / W8A16: GPTQ, AWQ, compressed-tensors checkpoints; plait.layers.wna16's layout,
# stacked): w13 int32 [E, H / pack, 2I] and w2 [E, I / pack, H], pack = 32 // bits codes a word along K, N
# contiguous; w13_scale [E, G_H, 2I] / w2_scale [E, G_I, H] and as shaped w13_zeros / w2_zeros, one scale
# and zero point per group_rows = K / G inputs and column. Each K step loads [BLOCK_K / pack, 1, BLOCK_N]
# words (a word's codes share a group) and the step's scales and zeros (one row where the step lies in one
# group, else one a word row), and dequantises them as plait.kernels.wna16_gemm does (_dequantize:
# (code - zero) * scale in fp32, rounded to x's dtype, K-major: tl.dot's B operand as it is): the weights
# of plait.layers.wna16.dequantize bit for bit, so everything after is the 16-bit experts' arithmetic.
#
# Expert parallelism (local_experts: plait.layers.moe.LocalExperts): w13 / w2 hold a rank's experts alone,
# and topk_ids are global. The ids become indices into the held experts, those of experts held elsewhere
# one past them (the "dropped" id, E): moe_align sorts dropped entries after every group and leaves them
# out, so no GEMM block holds them; a GEMV program of one returns at once; the slot sum skips their rows,
# which nothing wrote. Each rank's output is then its experts' share, which the ranks' all-reduce sums.

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

from plait.kernels.activation import silu_rounded
from plait.kernels.fp8_block_gemm import IMPRECISE_ACC_K, quantize_groups_fp8
from plait.kernels.interpreter import static_iters, trip_count
from plait.kernels.pdl import pdl_args, pdl_prologue
from plait.kernels.wna16_gemm import _dequantize
from plait.layers.fp8_block import check_block, dequantize_blocks, quantize_groups
from plait.layers.moe import (  # the names fused_moe takes (layers.moe: importable without triton)
    ACTIVATIONS,
    GATED_ACTIVATIONS,
    GPT_OSS_SWIGLU_ALPHA,
    GPT_OSS_SWIGLU_LIMIT,
    RELU2_NO_MUL,
    SILU,
    SWIGLU_OAI,
    LocalExperts,
    check_groups,
    check_noaux_tc,
    up_halves,
)
from plait.layers.mxfp4 import BLOCK_VALUES, CODES_PER_BYTE, MXFP4_DTYPE, dequantize_mxfp4
from plait.layers.wna16 import SUPPORTED_BITS, WORD_BITS, dequantize

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ID_DTYPES = (torch.int32, torch.int64)
FP8_DTYPE = torch.float8_e4m3fn  # block-wise FP8 experts' codes
INT_CODES_DTYPE = torch.int32  # integer experts' words of codes
_WORD_BITS = tl.constexpr(WORD_BITS)
# MXFP4 experts: a scale group's bytes (BLOCK_VALUES values, plait.layers.mxfp4).
MXFP4_GROUP_BYTES = BLOCK_VALUES // CODES_PER_BYTE
# The kernels' ACTIVATION constexpr for each of plait.layers.moe's ACTIVATIONS.
_SILU_ID = tl.constexpr(0)
_SWIGLU_OAI_ID = tl.constexpr(1)
_RELU2_NO_MUL_ID = tl.constexpr(2)
_ACTIVATION_IDS = {SILU: _SILU_ID.value, SWIGLU_OAI: _SWIGLU_OAI_ID.value,
                   RELU2_NO_MUL: _RELU2_NO_MUL_ID.value}
# MXFP4 decoding (_mxfp4_tile). An E2M1 code's sign bit (3) goes to fp32's sign bit (31), its two exponent
# bits and one mantissa bit (0..2) to fp32's two lowest exponent bits and top mantissa bit (22..24): read as
# fp32, that is the code's value times 2^-126 (E2M1's exponent bias is 1, fp32's 127), its 0.5 (exponent 0,
# mantissa 1) landing on fp32's subnormal 2^-127, so one product by 2^126 gives every code's value exactly.
_FP4_FP32_BITS = tl.constexpr(-(1 << 31) | (0x7 << 22))  # bits 31 and 22..24, as an int32
_LO_NIBBLE_TO_TOP = tl.constexpr(28)  # left shifts taking a byte's low / high nibble to bits 28..31
_HI_NIBBLE_TO_TOP = tl.constexpr(24)
_TOP_TO_FP32 = tl.constexpr(6)  # bits 28..30 down to 22..24 (an arithmetic shift: bit 31 stays)
_FP4_UNSCALE = tl.constexpr(2.0**126)
_FP32_MANTISSA_BITS = tl.constexpr(23)
# An E8M0 byte e >= 1 (bias 127, as fp32's exponent) is the fp32 with exponent field e; 0 (2^-127) is fp32's
# subnormal.
_E8M0_ZERO_BITS = tl.constexpr(1 << 22)
_MX_GROUP = tl.constexpr(BLOCK_VALUES)
_MX_GROUP_BYTES = tl.constexpr(MXFP4_GROUP_BYTES)
_MX_PACK = tl.constexpr(CODES_PER_BYTE)

# -- tile sizes ---------------------------------------------------------------------------------------------
# Decode-sized batches: an expert gets few rows, so 16-row blocks (tl.dot's smallest M) waste little padding.
DECODE_BLOCK_M = 16
# Prompt-sized batches: 64-row blocks (the M of one Hopper warpgroup MMA) read a weight tile once per 64 rows.
PROMPT_BLOCK_M = 64
# Average rows per expert (T * k / E) up to which a batch counts as decode-sized: below it a 64-row block
# would be mostly padding, and the step is bound by reading the routed experts' weights anyway.
DECODE_ROWS_PER_EXPERT = 16
# Average rows per expert from which wider column tiles pay (fewer re-reads of x, more work per program):
# at 64 (Qwen3-30B-A3B, T = 1,024) 64 x 128 tiles took 0.588 ms against 0.748 with 64 x 64 (H200).
WIDE_N_ROWS_PER_EXPERT = 32
DECODE_BLOCK_N = 64  # enough column tiles that the few routed experts' weights stream from most SMs
PROMPT_BLOCK_N = 128
# Warps for PROMPT_BLOCK_N tiles: GEMM 1's two 64 x 128 fp32 accumulators (gate and up) take 131
# registers a thread at 8 warps, every one of the 255 a thread may have at 4 (ptxas -v, sm_90a).
WIDE_TILE_WARPS = 8
# K step of 16-bit inputs, the same at every T (see "Batch invariance" below): 4 stages of 64-row x tiles
# and two 128-column weight tiles (gate and up) are 160 KB of shared memory, within Hopper's 227 KB.
BLOCK_K_16BIT = 64
GPU_STAGES = 4
GPU_WARPS = 4
# fp32 (IEEE dots, 4-byte tiles: half the elements fit in the same shared memory).
FP32_BLOCK_M = 16
FP32_BLOCK_N = 64
FP32_BLOCK_K = 32
FP32_STAGES = 2
# The CPU interpreter runs each program in Python: small tiles, nothing to pipeline.
CPU_BLOCK_M = 16
CPU_BLOCK_N = 32
CPU_BLOCK_K = 32
CPU_STAGES = 1
# Column tiles of one weight tile's neighbouring row blocks run together, so they share it through L2.
GROUP_M = 8
MIN_DOT = 16  # tl.dot's smallest M, N and K
SUM_BLOCK_H = 1024  # hidden columns a slot-sum program adds: 4 warps x 32 threads x 8 values
# Entries (T * k) up to which fused_moe skips the alignment: a program per entry and column tile reads its
# expert's weight rows directly (a batched GEMV), so a decode step pays for no sort and no padded block. Few
# entries rarely share an expert, so the grouped GEMM's one read of a weight tile per block would save little.
# Qwen3-30B-A3B layer on an H200 (benchmarks/results/fused_moe_h200.json): the GEMV path against the grouped
# GEMM 0.025 / 0.078 ms at 8 entries, 0.227 / 0.260 at 128, 0.383 / 0.341 at 256.
GEMV_MAX_ENTRIES = 128
# Tiles from a sweep of 54 (T = 1..32): within 4% of each T's best up to 128 entries, one K order for all.
GEMV_BLOCK_N = 8  # weight rows a GEMV program reads (of the gate and of the up half each, for GEMM 1)
GEMV_BLOCK_K = 256  # 16-bit inputs: 512-byte row segments
# MXFP4 weights: 256-byte row segments, so that GEMV_BLOCK_N rows are still one 16-byte load a thread on
# GEMV_WARPS warps (untimed; 256 would halve the loads' width).
MXFP4_GEMV_BLOCK_K = 512
# MXFP4 experts leave the GEMV sooner: its decoding is bound by the CUDA cores, and the grouped GEMM decodes
# each weight tile once per block of rows. gpt-oss-20b's layer on an H200 (mxfp4_moe_*gpt-oss-20b_h200.json):
# GEMV / grouped 0.182 / 0.281 ms at 16 entries, 0.678 / 0.512 at 64 (32 itself untimed).
MXFP4_GEMV_MAX_ENTRIES = 32
# MXFP4 prompt-sized tiles, from the same sweep (16-bit weights keep theirs): 64 x 64 on 4 warps from 64 rows
# an expert (128 rows: 1.235 ms against 1.458 for the 16-bit choice), 128 x 128 on 8 warps and 3 stages from
# 256 (512 rows: 3.62 ms against 4.72); the thresholds lie between the swept sizes, untimed.
MXFP4_MID_ROWS_PER_EXPERT = 64
MXFP4_LARGE_ROWS_PER_EXPERT = 256
MXFP4_LARGE_BLOCK_M = 128
MXFP4_LARGE_STAGES = 3
GEMV_WARPS = 4
GEMV_STAGES = 2
# Integer experts' GEMV tiles: their words run along N (N contiguous), so a program reads 32 columns (a
# 128-byte line a word row) of 128 K a step: Qwen3-30B-A3B's decode step then has 192 / 512 programs per GEMM
# at one token (132 SMs), 167 registers a thread with no spills (ptxas, sm_90a); untimed.
INT_GEMV_BLOCK_N = 32
INT_GEMV_BLOCK_K = 128
# A router program's warps: one token's row of up to 512 experts, 4 values a thread at most.
ROUTE_WARPS = 4
# The kernels' DROPPED_ID where no entry is dropped (every routed expert held here): no id equals it.
NO_DROPPED_ID = tl.constexpr(-1)


@dataclass(frozen=True)
class MoeConfig:
    block_m: int  # sorted entries a program takes (moe_align pads each expert's group to a multiple of it)
    block_n: int  # output columns a program takes (GEMM 1: of the gate and of the up half each)
    block_k: int  # K elements a loop step takes
    group_m: int = GROUP_M  # row blocks whose column tiles run together (L2 reuse of the weight tiles)
    num_warps: int = GPU_WARPS
    num_stages: int = GPU_STAGES  # software-pipelining depth of the K loop


@dataclass(frozen=True)
class MoeAlignment:
    # The flattened entry ids (token * k + slot) grouped by expert in increasing expert order, each
    # expert's entries in increasing id order, each group padded with pad_entry(T, k) to a multiple of
    # block_m; positions past num_padded hold it too. [max_padded] int32
    sorted_ids: torch.Tensor
    # The expert of each block of block_m sorted entries; blocks at or past num_padded hold E - 1 (a valid
    # id, never read: the kernels return before looking). [max_padded // block_m] int32
    expert_ids: torch.Tensor
    # How many of sorted_ids are in use: the sum of the padded group sizes, on the device. [1] int32
    num_padded: torch.Tensor


@dataclass(frozen=True)
class _ExpertMlp:
    # What the epilogues add to the two GEMMs.
    activation: str = SILU  # one of ACTIVATIONS
    w13_bias: torch.Tensor | None = None  # [E, 2I]: each expert's gate biases, then its up biases
    w2_bias: torch.Tensor | None = None  # [E, H]
    swiglu_alpha: float = GPT_OSS_SWIGLU_ALPHA  # swiglu_oai only
    swiglu_limit: float = GPT_OSS_SWIGLU_LIMIT


def pad_entry(num_tokens: int, top_k: int) -> int:
    """The sentinel in sorted_ids for padding: one past the last entry id, so `entry < T * k` tells real
    entries from padding (and the kernels store nothing for it)."""
    return num_tokens * top_k


def max_padded(num_entries: int, num_experts: int, block_m: int) -> int:
    """The longest sorted_ids any routing of num_entries entries can need: every expert that gets an entry
    (at most min(E, entries) of them) wastes at most block_m - 1 slots of padding. Host ints only, so a
    CUDA graph's buffers do not depend on the routing."""
    padded = num_entries + min(num_experts, num_entries) * (block_m - 1)
    return triton.cdiv(padded, block_m) * block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, dropped: bool = False) -> MoeAlignment:
    """Group the T * k entries by expert, each group padded to a multiple of block_m (see MoeAlignment).

    Sync-free torch ops only (every shape a function of T, k, E, block_m), so it can be captured in a CUDA
    graph. Ids must lie in [0, E): that is not checked (it would need a host sync); on CUDA an id past E
    trips an indexing device-side assert. dropped: ids may also be E, entries routed to experts held by
    another rank (LocalExperts.local_ids): they sort after every group and are left out of sorted_ids, so no
    block holds them and nothing computes them."""
    # topk_ids: [T, k] int32 / int64
    num_entries = topk_ids.numel()
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()  # [T*k]; scatter and gather indices must be int64
    padded_len = max_padded(num_entries, num_experts, block_m)
    # A stable sort keeps each expert's entries in flattened (token-major) order, so where a token's entry
    # lands within its expert's group never depends on what the other tokens picked, only on how many
    # earlier entries picked the same expert.
    experts, order = torch.sort(flat, stable=True)  # [T*k] each
    # Each expert's first position among the sorted entries, and so its count: no atomics, no bincount
    # (whose output size is read from the data: a host sync).
    first_sorted = torch.searchsorted(experts, torch.arange(num_experts + 1, device=device))  # [E + 1]
    counts = first_sorted.diff()  # [E]
    padded_counts = (counts + (block_m - 1)) // block_m * block_m  # [E]
    group_end = torch.cumsum(padded_counts, 0)  # [E]: where each expert's padded group ends
    group_start = group_end - padded_counts  # [E]
    rank = torch.arange(num_entries, device=device) - first_sorted[experts]  # position within its group
    if dropped:
        # Dropped entries (id E) all go to one slot past the end, cut off below (which of them lands there
        # last does not matter).
        slots = torch.where(experts < num_experts, group_start[experts.clamp(max=num_experts - 1)] + rank,
                            padded_len)
    else:
        slots = group_start[experts] + rank
    sorted_ids = torch.full((padded_len + int(dropped),), pad_entry(*topk_ids.shape), dtype=torch.int32,
                            device=device)
    sorted_ids.scatter_(0, slots, order.to(torch.int32))
    sorted_ids = sorted_ids[:padded_len]
    block_starts = torch.arange(0, padded_len, block_m, device=device)  # [num_blocks]
    # The expert whose group holds each block's first slot: groups are [start, end), and empty experts'
    # (start == end) are skipped by right=True. Blocks past every group would get E: clamped to a valid id.
    expert_ids = torch.searchsorted(group_end, block_starts, right=True, out_int32=True)
    expert_ids.clamp_(max=num_experts - 1)
    num_padded = group_end[-1:].to(torch.int32)
    return MoeAlignment(sorted_ids=sorted_ids, expert_ids=expert_ids, num_padded=num_padded)


# -- batch invariance --------------------------------------------------------------------------------------
# A row's dot products never mix with other rows', so what a token gets depends on the batch only through
# the config. Fixed for every T: block_k (a function of the dtype alone) and so the K loop's order and
# steps, the fp32 epilogues, and the slot sum's order (slot 0 first, in fp32). Changing with T: block_m
# (DECODE_BLOCK_M vs PROMPT_BLOCK_M), and block_n, warps and stages. On a GPU block_m can change the MMA
# instruction (mma.sync for 16 rows, wgmma for 64 on Hopper), whose accumulation inside one K step may
# differ in the last bit; block_n, warps and stages do not change a row's order of summation. So within one
# block_m regime a token's output is bitwise independent of the batch; across regimes it may move by
# fp32 roundoff before the final rounding. FP8 experts step K by the weight's block_k whatever the config,
# and quantise each row of x and h on its own: the same holds for them.
def moe_config(num_tokens: int, top_k: int, num_experts: int, hidden: int, intermediate: int,
               dtype: torch.dtype, on_cuda: bool = True, mxfp4: bool = False) -> MoeConfig:
    """Launch shape for a batch of num_tokens, from the average rows an expert gets (T * k / E); hidden and
    intermediate are not read yet (kept so that a tuned table can key on the layer's shape). Column and K
    tiles wider than the layer are capped at the launch. on_cuda=False: the CPU interpreter's small tiles.
    mxfp4: MXFP4 experts, whose prompt-sized tiles were swept apart (MXFP4_MID_ROWS_PER_EXPERT)."""
    if not on_cuda:
        return MoeConfig(CPU_BLOCK_M, CPU_BLOCK_N, CPU_BLOCK_K, group_m=1, num_warps=GPU_WARPS,
                         num_stages=CPU_STAGES)
    rows_per_expert = num_tokens * top_k / num_experts
    if dtype == torch.float32:
        return MoeConfig(FP32_BLOCK_M, FP32_BLOCK_N, FP32_BLOCK_K, num_stages=FP32_STAGES)
    if rows_per_expert <= DECODE_ROWS_PER_EXPERT:
        return MoeConfig(DECODE_BLOCK_M, DECODE_BLOCK_N, BLOCK_K_16BIT)
    if mxfp4 and rows_per_expert >= MXFP4_LARGE_ROWS_PER_EXPERT:
        return MoeConfig(MXFP4_LARGE_BLOCK_M, PROMPT_BLOCK_N, BLOCK_K_16BIT, num_warps=WIDE_TILE_WARPS,
                         num_stages=MXFP4_LARGE_STAGES)
    if mxfp4 and rows_per_expert >= MXFP4_MID_ROWS_PER_EXPERT:
        return MoeConfig(PROMPT_BLOCK_M, DECODE_BLOCK_N, BLOCK_K_16BIT)
    if rows_per_expert >= WIDE_N_ROWS_PER_EXPERT:
        return MoeConfig(PROMPT_BLOCK_M, PROMPT_BLOCK_N, BLOCK_K_16BIT, num_warps=WIDE_TILE_WARPS)
    return MoeConfig(PROMPT_BLOCK_M, DECODE_BLOCK_N, BLOCK_K_16BIT)


@triton.jit
def _dot(a, b, acc, DOT_PRECISION: tl.constexpr, IN_FP32: tl.constexpr):
    # IN_FP32: Triton 3.6's interpreter multiplies bf16 tiles as their raw uint16 bits (np.matmul on its
    # storage type), so there bf16 operands are widened first; exact, as their products are in fp32.
    if IN_FP32:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _mxfp4_ptrs(w_ptr, s_ptr, rows, stride_wn, stride_sn, stride_sk, BLOCK_K: tl.constexpr,
                K_MAJOR: tl.constexpr):
    """K step 0 of MXFP4 weight rows (rows: [BLOCK_N] int64; w_ptr, s_ptr: the expert's bytes and scales):
    bytes [BLOCK_N, G, 16] (G = BLOCK_K / 32 groups), each group's 16 contiguous (one 16-byte load; rows
    are a multiple of 16 bytes, as K is of 32), and the groups' scale bytes [BLOCK_N, G, 1], broadcast in
    the bytes' layout; K_MAJOR: [G, 16, BLOCK_N] and [G, 1, BLOCK_N] (see _mxfp4_tile)."""
    groups = tl.arange(0, BLOCK_K // _MX_GROUP)
    group_bytes = tl.arange(0, _MX_GROUP_BYTES)
    if K_MAJOR:
        w_ptrs = (w_ptr + rows[None, None, :] * stride_wn + groups[:, None, None] * _MX_GROUP_BYTES
                  + group_bytes[None, :, None])
        s_ptrs = s_ptr + rows[None, None, :] * stride_sn + groups[:, None, None] * stride_sk
    else:
        w_ptrs = (w_ptr + rows[:, None, None] * stride_wn + groups[None, :, None] * _MX_GROUP_BYTES
                  + group_bytes[None, None, :])
        s_ptrs = s_ptr + rows[:, None, None] * stride_sn + groups[None, :, None] * stride_sk
    return w_ptrs, s_ptrs


@triton.jit
def _fp4_values(top, scale):
    """fp32 values of the E2M1 codes in bits 28..31 of ``top`` (int32; bits below 28 are dropped) times
    ``scale`` (fp32 powers of two): exact (inf past fp32's range)."""
    # Down with the sign copied: sign on bit 31, the rest on 22..24 (_FP4_FP32_BITS drops the copies).
    bits = (top >> _TOP_TO_FP32) & _FP4_FP32_BITS
    return bits.to(tl.float32, bitcast=True) * _FP4_UNSCALE * scale


@triton.jit
def _mxfp4_tile(w_ptrs, scale, k_left, EVEN_K: tl.constexpr, out_ty: tl.constexpr, K_MAJOR: tl.constexpr):
    """One K step's MXFP4 weights (_mxfp4_ptrs' bytes, ``scale`` their loaded E8M0 bytes) as values in
    out_ty, [BLOCK_N, BLOCK_K] (K in order) or K_MAJOR [BLOCK_K, BLOCK_N] (tl.dot's B operand); groups from
    k_left on (past K, unless EVEN_K) are zeros. Integer ops, two fp32 products and the conversion: exact in
    fp32 and bf16, dequantize_mxfp4's values bit for bit (E8M0 bytes over 252 overflow as there; 255, NaN
    to OCP, is inf here)."""
    b = _load_groups(w_ptrs, k_left, EVEN_K, 0 if K_MAJOR else 1).to(tl.int32)
    e = scale.to(tl.int32)
    s = tl.where(e == 0, _E8M0_ZERO_BITS, e << _FP32_MANTISSA_BITS).to(tl.float32, bitcast=True)
    lo = _fp4_values(b << _LO_NIBBLE_TO_TOP, s).to(out_ty)  # each byte's first value
    hi = _fp4_values(b << _HI_NIBBLE_TO_TOP, s).to(out_ty)
    if K_MAJOR:
        # [G, 16, BLOCK_N, 2] -> [G, 16, 2, BLOCK_N] -> [BLOCK_K, BLOCK_N]. (Not a [BLOCK_N, BLOCK_K] tile
        # transposed: the interpreter's np.matmul sums a transposed view's products in another order than
        # a contiguous tile's, as the 16-bit weights' are.)
        w = tl.permute(tl.join(lo, hi), 0, 1, 3, 2)
        w = tl.reshape(w, (w.shape[0] * w.shape[1] * w.shape[2], w.shape[3]))
    else:
        w = tl.interleave(lo, hi)  # [BLOCK_N, G, 32]
        w = tl.reshape(w, (w.shape[0], w.shape[1] * w.shape[2]))
    return w


@triton.jit
def _int_ptrs(w_ptr, s_ptr, z_ptr, rows, stride_wk, stride_sn, BITS: tl.constexpr, BLOCK_K: tl.constexpr):
    """K step 0 of integer weight columns (rows: [BLOCK_N] int64 output columns; w_ptr, s_ptr, z_ptr: the
    expert's words [K / pack, N], scales and zeros [G, N], N contiguous; stride_wk: a word row's stride):
    words [BLOCK_K / pack, 1, BLOCK_N] (each thread holding whole words, unpacked in place: see
    plait.kernels.wna16_gemm), group 0's scales and zeros [1, 1, BLOCK_N]."""
    offs_w = tl.arange(0, BLOCK_K // (_WORD_BITS // BITS))
    w_ptrs = w_ptr + offs_w[:, None, None] * stride_wk + rows[None, None, :]
    return w_ptrs, s_ptr + rows[None, None, :] * stride_sn, z_ptr + rows[None, None, :] * stride_sn


@triton.jit
def _int_tile(w_ptrs, s_ptrs, z_ptrs, k0, K, stride_sg, out_ty: tl.constexpr, BITS: tl.constexpr,
              GROUP_ROWS: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, HALF: tl.constexpr,
              INTERPRETED_BF16: tl.constexpr):
    """The integer weights of the K step from k0 (_int_ptrs' pointers, advanced to it; groups stride_sg
    apart) as [BLOCK_K, BLOCK_N] values in out_ty, K-major: plait.layers.wna16.dequantize's, bit for bit.
    Past K (unless EVEN_K) the words are zeros, whose finite weights meet x's zeros there."""
    PACK: tl.constexpr = _WORD_BITS // BITS
    offs_w = tl.arange(0, BLOCK_K // PACK)
    if EVEN_K:
        words = tl.load(w_ptrs)
    else:
        words = tl.load(w_ptrs, mask=(k0 + offs_w * PACK < K)[:, None, None], other=0)
    if GROUP_ROWS % BLOCK_K == 0:
        g = k0 // GROUP_ROWS  # the step lies in one group: one row of scales and zeros
    else:
        # Groups narrower than the step (or K, one group, not whole steps): each word row's own.
        g = tl.minimum((k0 + offs_w * PACK) // GROUP_ROWS, K // GROUP_ROWS - 1)[:, None, None]
    scale = tl.load(s_ptrs + g * stride_sg)
    zero = tl.load(z_ptrs + g * stride_sg)
    return _dequantize(words, scale, zero, out_ty, BITS, PACK, HALF, INTERPRETED_BF16)


@triton.jit
def _load_groups(ptrs, k_left, EVEN_K: tl.constexpr, G_AXIS: tl.constexpr):
    """_mxfp4_ptrs' bytes or scales (groups along G_AXIS); unless EVEN_K, groups from k_left on are zeros
    (K is a multiple of 32: a group is all in or all out)."""
    if EVEN_K:
        v = tl.load(ptrs)
    else:
        groups = tl.arange(0, ptrs.shape[G_AXIS]) * _MX_GROUP < k_left
        if G_AXIS == 0:
            g_in = groups[:, None, None]
        else:
            g_in = groups[None, :, None]
        v = tl.load(ptrs, mask=g_in, other=0)
    return v


# The entry count changes every step; specialising on it (== 1, divisible by 16) would compile new binaries
# mid-run.
@triton.jit(do_not_specialize=["num_entries"])
def _moe_gemm_kernel(
    a_ptr, w_ptr, out_ptr, topk_w_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    num_entries, N, K, stride_am, stride_we, stride_wn, stride_om, up_rows, k_iters,
    sa_ptr, sw_ptr, stride_sam, stride_sak, stride_swe, stride_swn, stride_swk,
    b_ptr, stride_be, alpha, limit, z_ptr,
    A_ROW_DIV: tl.constexpr, STATIC_K_ITERS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, GATE_UP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BF16_DOT_IN_FP32: tl.constexpr, PRECISE: tl.constexpr, PDL: tl.constexpr,
    W8A8: tl.constexpr = False, WEIGHT_BLOCK_N: tl.constexpr = 1, IMPRECISE_ACC: tl.constexpr = 0,
    HAS_BIAS: tl.constexpr = False, ACTIVATION: tl.constexpr = _SILU_ID, W_MXFP4: tl.constexpr = False,
    W_INT: tl.constexpr = False, BITS: tl.constexpr = 4, GROUP_ROWS: tl.constexpr = 1,
    HALF_DEQUANT: tl.constexpr = False, GATED: tl.constexpr = True,
):
    # acc[entry, n] = sum_k a[entry // A_ROW_DIV, k] * w[expert, n, k] for the block's sorted entries.
    # GATE_UP (GEMM 1): out = act(acc, acc of weight row up_rows + n), rounded as torch rounds each step
    # (GATED false: w holds the up rows alone, out = act(acc));
    # else (GEMM 2): out = acc * topk_w[entry], in fp32 before its one rounding. HAS_BIAS: b[expert, row]
    # (row n, and up_rows + n for the up half) joins acc in the epilogue (see _epilogue).
    # W8A8: a and w are FP8 codes; a's row r has scale sa[r, kb] for K block kb (BLOCK_K is the weight's bk)
    # and weight row n of expert e scale sw[e, n // WEIGHT_BLOCK_N, kb]; a program's BLOCK_N columns (of the
    # gate and of the up half each) lie in one tile row, so each K step takes one FP8 dot, scaled into acc.
    # W_MXFP4: w holds two E2M1 codes a byte (w's strides in bytes), sw its E8M0 bytes, [E, N, K / 32]
    # (BLOCK_K a multiple of 32); each K step's weights are decoded to a's dtype (_mxfp4_tile) for the dot,
    # with the scales loaded a step ahead.
    # W_INT: w holds words of BITS-bit codes [E, K / pack, N] (stride_wn: a word row's stride), sw the
    # scales and z the zero points [E, G, N] (stride_swn along N, stride_swk a group's), GROUP_ROWS inputs
    # a group; each K step's weights are dequantised to a's dtype (_int_tile; HALF_DEQUANT: in fp16) for
    # the dot.
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_m = tl.num_programs(0) // num_pid_n
    # Grouped order: GROUP_M row blocks sweep the column tiles together (row-fastest within a group), so a
    # weight tile of an expert with several blocks is read from HBM about once.
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    # The grid covers the worst routing; this step's blocks end at num_padded.
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    entries = tl.load(sorted_ids_ptr + offs_m)
    real = entries < num_entries
    # Padding rows re-read the last entry's row (dropped at the store), so loads need no row mask.
    entries_in = tl.minimum(entries, num_entries - 1).to(tl.int64)
    a_rows = entries_in // A_ROW_DIV
    # int64: expert * stride_we passes 2^31 for large experts (Mixtral-8x7B: 7 * 28672 * 4096).
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # columns past N re-read the last row, dropped too
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    if W_MXFP4:  # bytes [G, 16, BLOCK_N] and scales [G, 1, BLOCK_N] (G = BLOCK_K / 32), K_MAJOR
        w_ptrs, s_ptrs = _mxfp4_ptrs(w_ptr + expert * stride_we, sw_ptr + expert * stride_swe, w_rows,
                                     stride_wn, stride_swn, stride_swk, BLOCK_K, K_MAJOR=True)
        up_s_off = up_rows.to(tl.int64) * stride_swn
        s_step = (BLOCK_K // _MX_GROUP) * stride_swk
        # The scales' loads (a byte a thread) stay in the loop where the software pipeliner leaves them
        # (cp.async copies 4 bytes or more): each step loads the next one's, its latency under this step.
        scale_g = _load_groups(s_ptrs, K, False, 0)
        if GATE_UP:
            scale_u = _load_groups(s_ptrs + up_s_off, K, False, 0)
    elif W_INT:
        w_ptrs, s_ptrs, z_ptrs = _int_ptrs(w_ptr + expert * stride_we, sw_ptr + expert * stride_swe,
                                           z_ptr + expert * stride_swe, w_rows, stride_wn, stride_swn, BITS,
                                           BLOCK_K)
        up_s_off = up_rows.to(tl.int64) * stride_swn
    else:
        # The weight as its transpose, [BLOCK_K, BLOCK_N], K contiguous: tl.dot's B operand.
        w_ptrs = w_ptr + expert * stride_we + w_rows[None, :] * stride_wn + offs_k[:, None]
    if W_INT:
        up_off = up_rows.to(tl.int64)  # the up columns: N is contiguous
    else:
        up_off = up_rows.to(tl.int64) * stride_wn
    if W8A8:
        sa_ptrs = sa_ptr + a_rows * stride_sam  # [BLOCK_M]: the rows' scales of K block 0
        sw_g_ptr = sw_ptr + expert * stride_swe + ((pid_n * BLOCK_N) // WEIGHT_BLOCK_N) * stride_swn
        # The up rows start on a tile row (I % bn == 0): row up_rows + n is in tile (up_rows + n) // bn.
        sw_u_ptr = sw_ptr + expert * stride_swe + ((up_rows + pid_n * BLOCK_N) // WEIGHT_BLOCK_N) * stride_swn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for it in range(trip_count(STATIC_K_ITERS, k_iters)):
        if EVEN_K:
            a = tl.load(a_ptrs)
        else:
            k_in = offs_k < K - it * BLOCK_K
            a = tl.load(a_ptrs, mask=k_in[None, :], other=0.0)
        if W_MXFP4:
            s_ptrs += s_step
            next_g = _load_groups(s_ptrs, K - (it + 1) * BLOCK_K, False, 0)
            w = _mxfp4_tile(w_ptrs, scale_g, K - it * BLOCK_K, EVEN_K, a.dtype, K_MAJOR=True)
            scale_g = next_g
        elif W_INT:
            w = _int_tile(w_ptrs, s_ptrs, z_ptrs, it * BLOCK_K, K, stride_swk, a.dtype, BITS, GROUP_ROWS,
                          BLOCK_K, EVEN_K, HALF_DEQUANT, BF16_DOT_IN_FP32)
        elif EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=k_in[:, None], other=0.0)
        if W8A8:
            sa = tl.load(sa_ptrs + it * stride_sak)  # fp32 [BLOCK_M]
            sw_g = tl.load(sw_g_ptr + it * stride_swk)
            acc_g += tl.dot(a, w, max_num_imprecise_acc=IMPRECISE_ACC) * (sa[:, None] * sw_g)
        else:
            acc_g = _dot(a, w, acc_g, DOT_PRECISION, BF16_DOT_IN_FP32)
        if GATE_UP and GATED:
            if W_MXFP4:
                next_u = _load_groups(s_ptrs + up_s_off, K - (it + 1) * BLOCK_K, False, 0)
                w_up = _mxfp4_tile(w_ptrs + up_off, scale_u, K - it * BLOCK_K, EVEN_K, a.dtype,
                                   K_MAJOR=True)
                scale_u = next_u
            elif W_INT:
                w_up = _int_tile(w_ptrs + up_off, s_ptrs + up_s_off, z_ptrs + up_s_off, it * BLOCK_K, K,
                                 stride_swk, a.dtype, BITS, GROUP_ROWS, BLOCK_K, EVEN_K, HALF_DEQUANT,
                                 BF16_DOT_IN_FP32)
            elif EVEN_K:
                w_up = tl.load(w_ptrs + up_off)
            else:
                w_up = tl.load(w_ptrs + up_off, mask=k_in[:, None], other=0.0)
            if W8A8:
                sw_u = tl.load(sw_u_ptr + it * stride_swk)
                acc_u += tl.dot(a, w_up, max_num_imprecise_acc=IMPRECISE_ACC) * (sa[:, None] * sw_u)
            else:
                acc_u = _dot(a, w_up, acc_u, DOT_PRECISION, BF16_DOT_IN_FP32)
        a_ptrs += BLOCK_K
        if W_MXFP4:
            w_ptrs += BLOCK_K // _MX_PACK
        elif W_INT:
            w_ptrs += (BLOCK_K // (_WORD_BITS // BITS)) * stride_wn
        else:
            w_ptrs += BLOCK_K
    b_row = b_ptr + expert * stride_be
    b_g = _bias(b_row, w_rows, HAS_BIAS)[None, :]  # [1, BLOCK_N]
    b_u = _bias(b_row + up_rows, w_rows, (HAS_BIAS and GATE_UP) and GATED)[None, :]
    if GATE_UP:
        weight = acc_g  # unread
    else:
        weight = tl.load(topk_w_ptr + entries_in)[:, None]  # fp32 [BLOCK_M, 1]
    y = _epilogue(acc_g, acc_u, weight, b_g, b_u, alpha, limit, out_ptr.dtype.element_ty, GATE_UP, HAS_BIAS,
                  ACTIVATION, PRECISE)
    out_ptrs = out_ptr + entries_in[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, y, mask=real[:, None] & (offs_n < N)[None, :])


@triton.jit
def _bias(b_row, rows, HAS_BIAS: tl.constexpr):
    """The bias of (clamped, in-range) rows in fp32; zeros, never read, without one."""
    if HAS_BIAS:
        b = tl.load(b_row + rows).to(tl.float32)
    else:
        b = tl.zeros(rows.shape, dtype=tl.float32)
    return b


@triton.jit
def _rounded(v, out_ty: tl.constexpr):
    """fp32 v rounded to out_ty (a torch op's output in the model's dtype), handed back in fp32."""
    return v.to(out_ty).to(tl.float32)


@triton.jit
def _epilogue(acc_g, acc_u, weight, b_g, b_u, alpha, limit, out_ty: tl.constexpr, GATE_UP: tl.constexpr,
              HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, PRECISE: tl.constexpr):
    """Both GEMMs' fp32 sums to their outputs in out_ty, rounded where the reference rounds.
    GATE_UP: gate and up as F.linear's outputs, plus their biases (a second rounding, as transformers'
    `x @ W + b` rounds), then the activation, each op rounded as torch's is (relu2_no_mul: acc_g is the up
    projection, acc_u unread). Else, without a bias, the sum
    times the routing weight (``weight``, fp32, broadcast to it), rounded once (the reference also rounds
    F.linear's output first); with one, GptOssExperts' roundings: the matmul, the bias sum, the product."""
    if GATE_UP:
        gate = _rounded(acc_g, out_ty)
        up = _rounded(acc_u, out_ty)
        if HAS_BIAS:
            gate = _rounded(gate + b_g, out_ty)
            up = _rounded(up + b_u, out_ty)
        if ACTIVATION == _SWIGLU_OAI_ID:
            y = _swiglu_oai_rounded(gate, up, alpha, limit, out_ty, PRECISE)
        elif ACTIVATION == _RELU2_NO_MUL_ID:
            # transformers' ReLUSquaredActivation: relu (exact), then square, rounded once
            r = tl.maximum(gate, 0.0, propagate_nan=tl.PropagateNan.ALL)
            y = (r * r).to(out_ty)
        else:
            y = (silu_rounded(gate, out_ty, PRECISE) * up).to(out_ty)
    elif HAS_BIAS:
        y = (_rounded(_rounded(acc_g, out_ty) + b_g, out_ty) * weight).to(out_ty)
    else:
        y = (acc_g * weight).to(out_ty)
    return y


@triton.jit
def _swiglu_oai_rounded(gate, up, alpha, limit, out_ty: tl.constexpr, PRECISE: tl.constexpr):
    """swiglu_oai_ref of fp32 gate and up (values of out_ty), each op rounded to out_ty as torch's is."""
    # NaNs pass through the clamps, as through torch.clamp.
    gate = tl.minimum(gate, limit, propagate_nan=tl.PropagateNan.ALL)
    up = tl.clamp(up, -limit, limit, propagate_nan=tl.PropagateNan.ALL)
    z = _rounded(gate * alpha, out_ty)
    if PRECISE:
        e = libdevice.exp(-z)  # CUDA's expf, as torch's sigmoid kernel uses
    else:
        e = tl.exp(-z)  # the interpreter has no libdevice
    glu = _rounded(gate * _rounded(1.0 / (1.0 + e), out_ty), out_ty)
    return (_rounded(up + 1.0, out_ty) * glu).to(out_ty)


@triton.jit
def _mxfp4_lanes(w_ptrs, s_ptrs, k_left, EVEN_K: tl.constexpr, x_ty: tl.constexpr):
    """_mxfp4_tile's [BLOCK_N, BLOCK_K] weights in fp32 as the GEMV widens weights of x's dtype (x_ty): fp32
    and bf16 hold every decoded value exactly, so those are the fp32 values themselves (no round trip
    through bf16); fp16's narrower range may round them, as dequantize_mxfp4 to fp16 does: rounded to it."""
    scale = _load_groups(s_ptrs, k_left, EVEN_K, 1)
    if x_ty == tl.float16:
        w = _mxfp4_tile(w_ptrs, scale, k_left, EVEN_K, tl.float16, K_MAJOR=False).to(tl.float32)
    else:
        w = _mxfp4_tile(w_ptrs, scale, k_left, EVEN_K, tl.float32, K_MAJOR=False)
    return w


# The entry count changes every step: no specialisation on it (see _moe_gemm_kernel).
@triton.jit(do_not_specialize=["num_entries"])
def _moe_gemv_kernel(
    a_ptr, w_ptr, out_ptr, topk_w_ptr, ids_ptr, num_entries, N, K, stride_am, stride_we, stride_wn, stride_om,
    up_rows, k_iters, sa_ptr, sw_ptr, stride_sam, stride_sak, stride_swe, stride_swn, stride_swk, b_ptr,
    stride_be, alpha, limit, z_ptr, A_ROW_DIV: tl.constexpr, STATIC_K_ITERS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, GATE_UP: tl.constexpr,
    PRECISE: tl.constexpr, PDL: tl.constexpr, W8A8: tl.constexpr = False, WEIGHT_BLOCK_N: tl.constexpr = 1,
    HAS_BIAS: tl.constexpr = False, ACTIVATION: tl.constexpr = _SILU_ID, W_MXFP4: tl.constexpr = False,
    DROPPED_ID: tl.constexpr = NO_DROPPED_ID, W_INT: tl.constexpr = False, BITS: tl.constexpr = 4,
    GROUP_ROWS: tl.constexpr = 1, HALF_DEQUANT: tl.constexpr = False, INTERPRETED_BF16: tl.constexpr = False,
    GATED: tl.constexpr = True,
):
    # _moe_gemm_kernel's result for one entry (grid: entries x column tiles) without the alignment: the
    # entry's expert comes straight from topk_ids. Products add up along K in fp32 lanes, reduced at the end;
    # the same _epilogue (biases, activation, roundings) then. An entry whose id is DROPPED_ID (expert
    # parallelism: an expert held elsewhere) returns at once: no weight read, no row stored.
    # W8A8 (see _moe_gemm_kernel; BLOCK_K is the weight's bk, BLOCK_N divides bn): each K block's products
    # of codes are reduced at once and scaled by the entry row's and the tile's scales into fp32 [BLOCK_N].
    # W_MXFP4 (see _moe_gemm_kernel): each K step's weights decoded (_mxfp4_lanes) into the same fp32 lanes.
    # W_INT (see _moe_gemm_kernel): each K step's weights dequantised K-major (_int_tile, rounded to x's
    # dtype as the reference's are) into fp32 lanes [BLOCK_K, BLOCK_N], reduced along K at the end.
    pdl_prologue(PDL)
    entry = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + entry).to(tl.int64)
    if DROPPED_ID != NO_DROPPED_ID:
        if expert == DROPPED_ID:
            return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # columns past N re-read the last row, never stored
    a_row = entry // A_ROW_DIV
    a_ptrs = a_ptr + a_row * stride_am + offs_k  # [BLOCK_K]
    if W_MXFP4:
        w_ptrs, s_ptrs = _mxfp4_ptrs(w_ptr + expert * stride_we, sw_ptr + expert * stride_swe, w_rows,
                                     stride_wn, stride_swn, stride_swk, BLOCK_K, K_MAJOR=False)
        up_s_off = up_rows.to(tl.int64) * stride_swn
    elif W_INT:
        w_ptrs, s_ptrs, z_ptrs = _int_ptrs(w_ptr + expert * stride_we, sw_ptr + expert * stride_swe,
                                           z_ptr + expert * stride_swe, w_rows, stride_wn, stride_swn, BITS,
                                           BLOCK_K)
        up_s_off = up_rows.to(tl.int64) * stride_swn
    else:
        # [BLOCK_N, BLOCK_K]
        w_ptrs = w_ptr + expert * stride_we + w_rows[:, None] * stride_wn + offs_k[None, :]
    if W_INT:
        up_off = up_rows.to(tl.int64)  # the up columns: N is contiguous
    else:
        up_off = up_rows.to(tl.int64) * stride_wn
    if W8A8:
        sa_ptrs = sa_ptr + a_row * stride_sam  # the entry row's scale of K block 0
        first_n = tl.program_id(1) * BLOCK_N
        sw_g_ptr = sw_ptr + expert * stride_swe + (first_n // WEIGHT_BLOCK_N) * stride_swn
        sw_u_ptr = sw_ptr + expert * stride_swe + ((up_rows + first_n) // WEIGHT_BLOCK_N) * stride_swn
        acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    elif W_INT:
        acc_g = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    else:
        acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for it in range(trip_count(STATIC_K_ITERS, k_iters)):
        if EVEN_K:
            a = tl.load(a_ptrs).to(tl.float32)
        else:
            k_in = offs_k < K - it * BLOCK_K
            a = tl.load(a_ptrs, mask=k_in, other=0.0).to(tl.float32)
        if W_MXFP4:
            w = _mxfp4_lanes(w_ptrs, s_ptrs, K - it * BLOCK_K, EVEN_K, a_ptr.dtype.element_ty)
        elif W_INT:
            w = _int_tile(w_ptrs, s_ptrs, z_ptrs, it * BLOCK_K, K, stride_swk, a_ptr.dtype.element_ty, BITS,
                          GROUP_ROWS, BLOCK_K, EVEN_K, HALF_DEQUANT, INTERPRETED_BF16)
        elif EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=k_in[None, :], other=0.0)
        if W8A8:
            sa = tl.load(sa_ptrs + it * stride_sak)
            sw_g = tl.load(sw_g_ptr + it * stride_swk)
            acc_g += tl.sum(w.to(tl.float32) * a[None, :], 1) * (sa * sw_g)
        elif W_INT:
            acc_g += w.to(tl.float32) * a[:, None]
        else:
            acc_g += w.to(tl.float32) * a[None, :]
        if GATE_UP and GATED:
            if W_MXFP4:
                w_up = _mxfp4_lanes(w_ptrs + up_off, s_ptrs + up_s_off, K - it * BLOCK_K, EVEN_K,
                                    a_ptr.dtype.element_ty)
            elif W_INT:
                w_up = _int_tile(w_ptrs + up_off, s_ptrs + up_s_off, z_ptrs + up_s_off, it * BLOCK_K, K,
                                 stride_swk, a_ptr.dtype.element_ty, BITS, GROUP_ROWS, BLOCK_K, EVEN_K,
                                 HALF_DEQUANT, INTERPRETED_BF16)
            elif EVEN_K:
                w_up = tl.load(w_ptrs + up_off)
            else:
                w_up = tl.load(w_ptrs + up_off, mask=k_in[None, :], other=0.0)
            if W8A8:
                sw_u = tl.load(sw_u_ptr + it * stride_swk)
                acc_u += tl.sum(w_up.to(tl.float32) * a[None, :], 1) * (sa * sw_u)
            elif W_INT:
                acc_u += w_up.to(tl.float32) * a[:, None]
            else:
                acc_u += w_up.to(tl.float32) * a[None, :]
        a_ptrs += BLOCK_K
        if W_MXFP4:
            w_ptrs += BLOCK_K // _MX_PACK
            s_ptrs += (BLOCK_K // _MX_GROUP) * stride_swk
        elif W_INT:
            w_ptrs += (BLOCK_K // (_WORD_BITS // BITS)) * stride_wn
        else:
            w_ptrs += BLOCK_K
    if W_INT:  # the fp32 lanes [BLOCK_K, BLOCK_N], reduced once
        acc_g = tl.sum(acc_g, 0)
        if GATE_UP and GATED:
            acc_u = tl.sum(acc_u, 0)
    elif not W8A8:  # the fp32 lanes, reduced once
        acc_g = tl.sum(acc_g, 1)
        if GATE_UP and GATED:
            acc_u = tl.sum(acc_u, 1)
    weight = acc_g if GATE_UP else tl.load(topk_w_ptr + entry)
    b_row = b_ptr + expert * stride_be
    b_g = _bias(b_row, w_rows, HAS_BIAS)  # [BLOCK_N]
    b_u = _bias(b_row + up_rows, w_rows, (HAS_BIAS and GATE_UP) and GATED)
    y = _epilogue(acc_g, acc_u, weight, b_g, b_u, alpha, limit, out_ptr.dtype.element_ty, GATE_UP, HAS_BIAS,
                  ACTIVATION, PRECISE)
    tl.store(out_ptr + entry * stride_om + offs_n, y, mask=offs_n < N)


# The routers _route_kernel runs in one launch per token row, each beside its torch reference in
# plait.layers.moe: route (softmax top-k: moe_route), route_group_limited (DeepSeek-V2's softmax greedy and
# group-limited greedy: moe_route_group_limited) and route_noaux_tc (DeepSeek-V3's, GLM-4.5's, NemotronH's:
# moe_route_noaux_tc). A row's experts are laid out [groups, experts a group] in registers, the reference's
# view(T, n_group, E / n_group) of them, each dimension padded to a power of two; one group (n_group 1)
# is a [1, E] row and skips the group choice. Reductions over the whole row take axis=None: a reshape the
# compiler may reorder (can_reorder), so the 2D layout stays as it is.
#
# transformers' renormalisation divides by sum + 1e-20 (a guard against 0 / 0); the kernel adds it too. For
# softmax scores it cannot change the sum: the chosen experts include the best one (its group scores best,
# so it is kept), whose probability is at least 1 / E, and 1e-20 is far below half an fp32 ulp of anything
# that large (2^-9 * 2^-24 ~ 1e-10 at E = 512), so route's plain sum (no guard) is the same number. Sigmoid
# scores can be small enough for it to count: a sum below about 2e-13 (1e-20 * 2^24; every chosen logit below
# about -31).
RENORMALIZE_EPS = tl.constexpr(1e-20)


@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.exp(x)  # CUDA's expf, as torch's softmax and sigmoid use (tl.exp: ex2.approx)
    return tl.exp(x)  # the interpreter has no libdevice


@triton.jit
def _softmax(logits, PRECISE: tl.constexpr):
    # logits: [BLOCK_G, BLOCK_PG] fp32, -inf at padding -> probabilities over the whole row, 0 at padding.
    # div_rn: IEEE division, as torch's (Triton's fp32 `/` is approximate).
    e = _exp(logits - tl.max(logits, axis=None), PRECISE)
    return tl.math.div_rn(e, tl.sum(e, axis=None))


@triton.jit
def _sigmoid(logits, PRECISE: tl.constexpr):
    # logits: [BLOCK_G, BLOCK_PG] fp32 -> 1 / (1 + exp(-x)), as torch's sigmoid (0 at -inf padding)
    return tl.math.div_rn(1.0, 1.0 + _exp(-logits, PRECISE))


@triton.jit
def _kept_groups(choice, member, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                 BLOCK_PG: tl.constexpr, TOP2_SUM: tl.constexpr):
    # choice: [BLOCK_G, BLOCK_PG] scores to choose by, -inf at padding; member: [1, BLOCK_PG] index within a
    # group -> [BLOCK_G, 1] bool: the TOPK_GROUP best groups (the lowest first among equals), each scored by
    # its best expert, or (TOP2_SUM) by its best two: the first best taken out, the next best added, so that a
    # group whose best is there twice scores it twice, as topk(2) does.
    score = tl.max(choice, 1)  # [BLOCK_G]
    if TOP2_SUM:
        first = tl.min(tl.where(choice == score[:, None], member, BLOCK_PG), 1)  # [BLOCK_G]
        score = score + tl.max(tl.where(member == first[:, None], float("-inf"), choice), 1)
    groups = tl.arange(0, BLOCK_G)
    score = tl.where(groups < N_GROUP, score, float("-inf"))
    kept = groups < 0  # [BLOCK_G]: none yet
    for _ in tl.static_range(TOPK_GROUP):
        best = tl.max(score, 0)
        pick = tl.min(tl.where(score == best, groups, BLOCK_G), 0)
        kept = kept | (groups == pick)
        score = tl.where(groups == pick, float("-inf"), score)
    return kept[:, None]


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, per_group, stride_l, scaling,
                  TOP_K: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                  BLOCK_PG: tl.constexpr, BLOCK_TOP: tl.constexpr, NOAUX_TC: tl.constexpr,
                  RENORMALIZE: tl.constexpr, PRECISE: tl.constexpr, PDL: tl.constexpr):
    # One token (see the comment above): scores in fp32 (softmax; NOAUX_TC: sigmoid, and the correction
    # bias added for choosing), the TOPK_GROUP best of N_GROUP groups kept (N_GROUP > 1), then the TOP_K
    # best experts among theirs in descending order of choice (the lowest id first among equals). Their
    # weights: their scores (NOAUX_TC: unbiased), renormalised to sum to one if asked, times scaling.
    pdl_prologue(PDL)
    token = tl.program_id(0).to(tl.int64)
    group = tl.arange(0, BLOCK_G)[:, None]  # [BLOCK_G, 1]
    member = tl.arange(0, BLOCK_PG)[None, :]  # [1, BLOCK_PG]
    valid = (group < N_GROUP) & (member < per_group)  # [BLOCK_G, BLOCK_PG]
    no_expert: tl.constexpr = BLOCK_G * BLOCK_PG  # padding's id: past every real one, never picked
    expert = tl.where(valid, group * per_group + member, no_expert)  # [BLOCK_G, BLOCK_PG] int32 ids
    row_ptr = logits_ptr + token * stride_l
    logits = tl.load(row_ptr + expert, mask=valid, other=float("-inf")).to(tl.float32)
    if NOAUX_TC:
        choice = _sigmoid(logits, PRECISE) + tl.load(bias_ptr + expert, mask=valid, other=0.0)
    else:
        choice = _softmax(logits, PRECISE)
    choice = tl.where(valid, choice, float("-inf"))
    if N_GROUP > 1:
        kept = _kept_groups(choice, member, N_GROUP, TOPK_GROUP, BLOCK_G, BLOCK_PG, NOAUX_TC)
        # The others' experts as the references mask them: -inf (noaux_tc), a zero score (group-limited:
        # the weight of one chosen all the same).
        choice = tl.where(valid & (kept == 0), float("-inf") if NOAUX_TC else 0.0, choice)
    slots = tl.arange(0, BLOCK_TOP)
    top_w = tl.zeros((BLOCK_TOP,), dtype=tl.float32)
    top_i = tl.zeros((BLOCK_TOP,), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(choice, axis=None)
        pick = tl.min(tl.where(choice == best, expert, no_expert), axis=None)
        top_w = tl.where(slots == j, best, top_w)
        top_i = tl.where(slots == j, pick, top_i)
        choice = tl.where(expert == pick, float("-inf"), choice)
    keep = slots < TOP_K
    if NOAUX_TC:  # the weights are the unbiased scores: the chosen logits' sigmoids again, the same numbers
        top_w = _sigmoid(tl.load(row_ptr + top_i, mask=keep, other=float("-inf")).to(tl.float32), PRECISE)
    if RENORMALIZE:
        top_w = tl.math.div_rn(top_w, tl.sum(top_w, 0) + RENORMALIZE_EPS)
    top_w = top_w * scaling
    tl.store(weights_ptr + token * TOP_K + slots, top_w, mask=keep)
    tl.store(ids_ptr + token * TOP_K + slots, top_i, mask=keep)


def _launch_route(router_logits: torch.Tensor, top_k: int, renormalize: bool, n_group: int, topk_group: int,
                  routed_scaling_factor: float, correction_bias: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """_route_kernel over every token row: noaux_tc where correction_bias is given, softmax otherwise."""
    # router_logits: [T, E]; correction_bias: [E] -> (weights [T, k] fp32, ids [T, k] int32)
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    noaux_tc = correction_bias is not None
    # the bias pointer is read only under NOAUX_TC: the logits stand in for it otherwise
    bias = correction_bias.float().contiguous() if noaux_tc else router_logits
    per_group = num_experts // n_group
    _route_kernel[(num_tokens,)](
        router_logits, bias, weights, ids, per_group, router_logits.stride(0), float(routed_scaling_factor),
        TOP_K=top_k, N_GROUP=n_group, TOPK_GROUP=topk_group, BLOCK_G=triton.next_power_of_2(n_group),
        BLOCK_PG=triton.next_power_of_2(per_group), BLOCK_TOP=triton.next_power_of_2(top_k),
        NOAUX_TC=noaux_tc, RENORMALIZE=renormalize, PRECISE=router_logits.is_cuda, num_warps=ROUTE_WARPS,
        **pdl_args(router_logits))
    return weights, ids


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """plait.layers.moe.route in one launch: (weights [T, k] fp32, ids [T, k] int32), each token's in
    descending order of probability (the lowest id first among equals)."""
    # router_logits: [T, E]
    return _launch_route(router_logits, top_k, renormalize, 1, 1, 1.0, None)


def moe_route_group_limited(router_logits: torch.Tensor, top_k: int, renormalize: bool, n_group: int,
                            topk_group: int, routed_scaling_factor: float
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """plait.layers.moe.route_group_limited (DeepSeek-V2's greedy at n_group 1, group-limited greedy above)
    in one launch: (weights [T, k] fp32, ids [T, k] int32), in descending order of score."""
    # router_logits: [T, E]
    check_groups(router_logits.shape[1], top_k, n_group, topk_group)
    return _launch_route(router_logits, top_k, renormalize, n_group, topk_group, routed_scaling_factor, None)


def moe_route_noaux_tc(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                       correction_bias: torch.Tensor, n_group: int, topk_group: int,
                       routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """plait.layers.moe.route_noaux_tc in one launch: (weights [T, k] fp32, ids [T, k] int32), in
    descending order of biased score."""
    # router_logits: [T, E]; correction_bias: [E]
    check_noaux_tc(router_logits.shape[1], top_k, n_group, topk_group)
    return _launch_route(router_logits, top_k, renormalize, n_group, topk_group, routed_scaling_factor,
                         correction_bias)


@triton.jit
def _moe_sum_kernel(y_ptr, out_ptr, ids_ptr, H, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
                    DROPPED_ID: tl.constexpr = NO_DROPPED_ID):
    # out[t] = sum over slots j of y[t * TOP_K + j], in slot order, in fp32: fixed order, no atomics. Slots
    # whose id (ids: [T * TOP_K], by entry) is DROPPED_ID were never computed: their rows are not read
    # (they add 0, which leaves the fp32 sum of the others exact).
    pdl_prologue(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        entry = token * TOP_K + j
        keep = mask
        if DROPPED_ID != NO_DROPPED_ID:
            keep = mask & (tl.load(ids_ptr + entry) != DROPPED_ID)
        acc += tl.load(y_ptr + entry * H + cols, mask=keep, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
           topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
           w2_scale: torch.Tensor | None = None, block: tuple[int, int] | None = None,
           mlp: _ExpertMlp | None = None, w13_zeros: torch.Tensor | None = None,
           w2_zeros: torch.Tensor | None = None, bits: int | None = None) -> tuple[int, int] | None:
    """ValueError for arguments fused_moe does not take; FP8 weights' (bn, bk), None for 16/32-bit, MXFP4
    and integer ones."""
    if is_integer(w13):
        _check_integer(x, w13, w2, (w13_scale, w13_zeros), (w2_scale, w2_zeros), bits, block, mlp)
        _check_routing(x, topk_weights, topk_ids)
        return None
    if w13_zeros is not None or w2_zeros is not None or bits is not None:
        raise ValueError(f"w13_zeros, w2_zeros and bits are for integer ({INT_CODES_DTYPE}) experts, not "
                         f"{w13.dtype}")
    _check_shapes(x, w13, w2, topk_weights, topk_ids, up_halves(SILU if mlp is None else mlp.activation))
    fp8 = w13.dtype == FP8_DTYPE or w2.dtype == FP8_DTYPE
    if mlp is not None:
        _check_mlp(mlp, x, w13, fp8)
    if is_mxfp4(w13):
        _check_mxfp4(x, w13, w13_scale, w2_scale, block)
        return None
    if not fp8:
        if w13_scale is not None or w2_scale is not None or block is not None:
            raise ValueError(f"w13_scale, w2_scale and block are for {FP8_DTYPE} and {MXFP4_DTYPE} (MXFP4) "
                             f"experts, not {w13.dtype}")
        return None
    return _check_fp8(w13, w13_scale, w2_scale, block)


def is_integer(w13: torch.Tensor) -> bool:
    """Whether fused_moe takes these experts as integer codes (GPTQ / AWQ / compressed-tensors: int32 words,
    with scales, zeros and bits)."""
    return w13.dtype == INT_CODES_DTYPE


def _check_integer(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   up: tuple[torch.Tensor | None, torch.Tensor | None],
                   down: tuple[torch.Tensor | None, torch.Tensor | None], bits: int | None,
                   block: tuple[int, int] | None, mlp: _ExpertMlp | None) -> None:
    """Integer experts' arguments: up and down are (scale, zeros) of w13 and w2."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"integer experts need bits in {list(SUPPORTED_BITS)}, got {bits}")
    if block is not None:
        raise ValueError(f"block {block} is for FP8 experts: integer experts are scaled per group of inputs")
    if mlp is not None and (mlp.w13_bias is not None or mlp.w2_bias is not None or mlp.activation != SILU):
        raise ValueError(f"integer experts take neither biases nor {SWIGLU_OAI!r} or {RELU2_NO_MUL!r} (not "
                         "implemented)")
    pack = WORD_BITS // bits
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"x must be [T, H] in one of {FLOAT_DTYPES}, w13 [E, H / pack, 2I] and w2 "
                         f"[E, I / pack, H]; got {x.dtype} {tuple(x.shape)}, {tuple(w13.shape)}, "
                         f"{tuple(w2.shape)}")
    (e, h_words, two_i), hidden = w13.shape, x.shape[1]
    inter = two_i // 2
    if w2.dtype != INT_CODES_DTYPE or two_i % 2 or h_words * pack != hidden or tuple(w2.shape) != (
            e, inter // pack, hidden) or inter % pack:
        raise ValueError(f"x {tuple(x.shape)}, w13 {tuple(w13.shape)} and w2 {w2.dtype} {tuple(w2.shape)} "
                         f"do not agree (want int32 w13 [E, {hidden} / {pack}, 2I] and w2 [E, I / {pack}, "
                         f"{hidden}])")
    for name, (scale, zeros), k, n in (("w13", up, hidden, two_i), ("w2", down, inter, hidden)):
        groups = 0 if scale is None else scale.shape[1]
        if (scale is None or zeros is None or scale.dim() != 3 or scale.shape[0] != e or scale.shape[2] != n
                or groups == 0 or k % groups or (k // groups) % pack or zeros.shape != scale.shape
                or zeros.is_floating_point() or not scale.is_floating_point()):
            got = "None" if scale is None or zeros is None else f"{list(scale.shape)}, {list(zeros.shape)}"
            raise ValueError(f"integer experts need {name}_scale (float) and {name}_zeros (integers), both "
                             f"[E={e}, G, {n}] with G groups of whole {pack}-code words of {k} inputs; got "
                             f"{got}")


def _check_routing(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> None:
    t = x.shape[0]
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids and topk_weights must both be [T={t}, k], got {tuple(topk_ids.shape)} "
                         f"and {tuple(topk_weights.shape)}")
    if topk_ids.dtype not in ID_DTYPES:
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights must be float32, got {topk_weights.dtype}")


def is_mxfp4(w13: torch.Tensor) -> bool:
    """Whether fused_moe takes these experts as MXFP4 (packed E2M1 codes, w13_scale and w2_scale E8M0)."""
    return w13.dtype == MXFP4_DTYPE


def _check_shapes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, halves: int = 2) -> None:
    # halves: w13's row blocks of I (up_halves: gate and up, or up alone)
    rows = "2I" if halves == 2 else "I"
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"x must be [T, H], w13 [E, {rows}, H], w2 [E, H, I]; got {tuple(x.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    h, (e, two_i, h13) = x.shape[1], w13.shape
    mxfp4 = w13.dtype == MXFP4_DTYPE or w2.dtype == MXFP4_DTYPE
    pack = CODES_PER_BYTE if mxfp4 else 1  # values a stored element along K
    if two_i % halves:
        raise ValueError(f"w13 needs gate rows then as many up rows, got {two_i} rows")
    if h13 * pack != h or w2.shape[:2] != (e, h) or w2.shape[2] * pack != two_i // halves:
        packed = " / 2 (two MXFP4 codes a byte)" if mxfp4 else ""
        raise ValueError(f"x {tuple(x.shape)}, w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not agree "
                         f"(want w13 [E, {rows}, {h}{packed}] and w2 [E, {h}, I{packed}])")
    fp8 = w13.dtype == FP8_DTYPE or w2.dtype == FP8_DTYPE
    if fp8 or mxfp4:
        codes = FP8_DTYPE if fp8 else MXFP4_DTYPE
        if x.dtype not in FLOAT_DTYPES or w13.dtype != codes or w2.dtype != codes:
            raise ValueError(f"{'FP8' if fp8 else 'MXFP4'} experts need both w13 and w2 in {codes} and x in "
                             f"one of {FLOAT_DTYPES}, got {w13.dtype}, {w2.dtype} and {x.dtype}")
    elif x.dtype not in FLOAT_DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"x, w13 and w2 must share one of {FLOAT_DTYPES}, got {x.dtype}, {w13.dtype}, "
                         f"{w2.dtype}")
    _check_routing(x, topk_weights, topk_ids)


def _check_mlp(mlp: _ExpertMlp, x: torch.Tensor, w13: torch.Tensor, fp8: bool) -> None:
    if mlp.activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {mlp.activation!r}")
    has_bias = mlp.w13_bias is not None or mlp.w2_bias is not None
    if fp8 and (has_bias or mlp.activation != SILU):
        raise ValueError(f"{FP8_DTYPE} experts take neither biases nor {SWIGLU_OAI!r} or {RELU2_NO_MUL!r} "
                         "(not implemented)")
    if is_mxfp4(w13) and mlp.activation not in GATED_ACTIVATIONS:
        raise ValueError(f"MXFP4 experts with {mlp.activation!r} are not implemented")
    (num_experts, two_i, _), hidden = w13.shape, x.shape[1]
    for name, bias, want in (("w13_bias", mlp.w13_bias, (num_experts, two_i)),
                             ("w2_bias", mlp.w2_bias, (num_experts, hidden))):
        if bias is not None and (tuple(bias.shape) != want or bias.dtype != x.dtype
                                 or bias.device != w13.device):
            raise ValueError(f"{name} must be {x.dtype} {list(want)} on {w13.device}, got {bias.dtype} "
                             f"{list(bias.shape)} on {bias.device}")


def _check_fp8(w13: torch.Tensor, w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None,
               block: tuple[int, int] | None) -> tuple[int, int]:
    e, two_i, h = w13.shape
    if w13_scale is None or w2_scale is None or block is None:
        raise ValueError("FP8 experts need w13_scale, w2_scale and block")
    bn, bk = check_block(tuple(block))
    inter = two_i // 2
    if inter % bn:
        raise ValueError(f"the intermediate size {inter} must be a multiple of the {bn}-row weight blocks, "
                         f"so that w13's up half starts on a tile row")
    for name, scale, want in (("w13_scale", w13_scale, (e, two_i // bn, triton.cdiv(h, bk))),
                              ("w2_scale", w2_scale, (e, triton.cdiv(h, bn), triton.cdiv(inter, bk)))):
        if scale.dtype != torch.float32 or tuple(scale.shape) != want or scale.device != w13.device:
            raise ValueError(f"{name} must be float32 {list(want)} (E, cdiv(rows, {bn}), cdiv(cols, {bk})) "
                             f"on {w13.device}, got {scale.dtype} {list(scale.shape)} on {scale.device}")
    return bn, bk


def _check_mxfp4(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor | None,
                 w2_scale: torch.Tensor | None, block: tuple[int, int] | None) -> None:
    (e, two_i, _), hidden = w13.shape, x.shape[1]
    inter = two_i // 2
    if block is not None:
        raise ValueError(f"block {block} is for FP8 experts: MXFP4 experts are scaled per {BLOCK_VALUES} "
                         "values along K")
    if hidden % BLOCK_VALUES or inter % BLOCK_VALUES:
        raise ValueError(f"MXFP4 experts need the hidden size ({hidden}) and the intermediate size ({inter}) "
                         f"to be multiples of {BLOCK_VALUES}, the values a scale covers")
    for name, scale, want in (("w13_scale", w13_scale, (e, two_i, hidden // BLOCK_VALUES)),
                              ("w2_scale", w2_scale, (e, hidden, inter // BLOCK_VALUES))):
        if (scale is None or scale.dtype != MXFP4_DTYPE or tuple(scale.shape) != want
                or scale.device != w13.device):
            got = "None" if scale is None else f"{scale.dtype} {list(scale.shape)} on {scale.device}"
            raise ValueError(f"MXFP4 experts need {name} {MXFP4_DTYPE} {list(want)} (E8M0 bytes, one per "
                             f"{BLOCK_VALUES} values along K) on {w13.device}, got {got}")


def dequantize_mxfp4_experts(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 experts [E, rows, K / 2] (or one expert's [rows, K / 2]) with their scales [E, rows, K / 32]
    ([rows, K / 32]) as values [E, rows, K] ([rows, K]) in dtype (plait.layers.mxfp4.dequantize_mxfp4 of each
    row's bytes as [K / 32, 16])."""
    return dequantize_mxfp4(w.reshape(*scale.shape, MXFP4_GROUP_BYTES), scale, dtype)


def _group_dequantized(v: torch.Tensor, group: int) -> torch.Tensor:
    """v quantised per row and group of ``group`` columns (quantize_groups), as fp32 values."""
    codes, scale = quantize_groups(v, group)
    return codes.float() * scale.repeat_interleave(group, dim=1)[:, : v.shape[1]]


def swiglu_oai_ref(gate: torch.Tensor, up: torch.Tensor, alpha: float = GPT_OSS_SWIGLU_ALPHA,
                   limit: float = GPT_OSS_SWIGLU_LIMIT) -> torch.Tensor:
    """gpt-oss's activation, transformers' GptOssExperts._apply_gate on the de-interleaved gate and up
    halves, op for op (each rounded to their dtype): gate capped at limit, up clamped to [-limit, limit],
    (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, *, w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None, block: tuple[int, int] | None = None,
                  w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                  activation: str = SILU, swiglu_alpha: float = GPT_OSS_SWIGLU_ALPHA,
                  swiglu_limit: float = GPT_OSS_SWIGLU_LIMIT, local_experts: LocalExperts | None = None,
                  w13_zeros: torch.Tensor | None = None, w2_zeros: torch.Tensor | None = None,
                  bits: int | None = None) -> torch.Tensor:
    """HF transformers 5's MixtralExperts.forward, in its order of operations (host syncs: the CPU path).
    activation "relu2_no_mul": NemotronHExperts.forward (w13 [E, I, H], the up rows alone; relu(up)^2).

    local_experts (expert parallelism): topk_ids are global ids among local_experts.total, w13 and w2 (and
    their biases and scales) hold experts local_experts.first.. alone; entries routed to the others add
    nothing (HF's loop skips the one-hot class past the held experts, as its expert-parallel experts do).

    With biases (w13_bias [E, 2I]: gate, then up; w2_bias [E, H]) and / or activation "swiglu_oai"
    (swiglu_oai_ref with swiglu_alpha and swiglu_limit): GptOssExperts.forward on w13 de-interleaved into
    gate rows, then up rows, in its order of operations and roundings: each matmul in x's dtype, its bias
    added in that dtype, the activation op by op, the routing weight (fp32) times the down projection.

    Block-wise FP8 experts (w13, w2 float8_e4m3fn with per-[bn, bk]-tile fp32 scales w13_scale
    [E, 2I / bn, cdiv(H, bk)] and w2_scale [E, cdiv(H, bn), cdiv(I, bk)], block = (bn, bk)), in the same
    loop, fp32 arithmetic on dequantised values, rounded to x's dtype where fused_moe rounds:
      1. x quantised per token and group of bk (quantize_groups), dequantised: xq;
      2. gate, up = xq @ w13[e]^T in fp32, each rounded to x's dtype; h = silu(gate) * up in x's dtype;
      3. h quantised per entry row and group of bk, dequantised: hq;
      4. y = hq @ w2[e]^T in fp32, times the routing weight, rounded once; each token's k slot outputs summed
         in slot order in fp32, rounded.

    MXFP4 experts (w13 uint8 [E, 2I, H / 2], w2 uint8 [E, H, I / 2], two E2M1 codes a byte, the low nibble
    first; w13_scale uint8 [E, 2I, H / 32], w2_scale uint8 [E, H, I / 32], E8M0): each routed expert
    dequantised to x's dtype (dequantize_mxfp4_experts; exact) when its turn comes, then as 16-bit experts.

    Integer experts (GPTQ / AWQ / compressed-tensors, W4A16 / W8A16; plait.layers.wna16's layout, stacked:
    w13 int32 [E, H / pack, 2I], w2 [E, I / pack, H], pack = 32 // bits codes a word along K; w13_scale and
    w13_zeros [E, G_H, 2I], w2_scale and w2_zeros [E, G_I, H]): each routed expert dequantised to x's dtype
    (plait.layers.wna16.dequantize: (code - zero) * scale in fp32, rounded once) when its turn comes, then
    as 16-bit experts."""
    # x: [T, H]; w13: [E, 2I, H]; w2: [E, H, I]; topk_weights: [T, k] fp32; topk_ids: [T, k] -> [T, H]
    mlp = _ExpertMlp(activation=activation, w13_bias=w13_bias, w2_bias=w2_bias, swiglu_alpha=swiglu_alpha,
                     swiglu_limit=swiglu_limit)
    fp8_block = _check(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block, mlp, w13_zeros,
                       w2_zeros, bits)
    topk_ids, _ = _held_ids(topk_ids, local_experts, w13)
    if fp8_block is not None:
        return _fp8_moe_ref(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, fp8_block)
    mxfp4, integer = is_mxfp4(w13), is_integer(w13)
    out = torch.zeros_like(x)
    for expert, k_pos, token_idx in _routed_entries(topk_ids, w13.shape[0]):
        w13_e, w2_e = w13[expert], w2[expert]
        if mxfp4:  # only the routed experts, as each comes: a decode step routes to few of them
            w13_e = dequantize_mxfp4_experts(w13_e, w13_scale[expert], x.dtype)
            w2_e = dequantize_mxfp4_experts(w2_e, w2_scale[expert], x.dtype)
        elif integer:  # [2I, H] and [H, I]
            w13_e = dequantize(w13_e, w13_scale[expert], w13_zeros[expert], bits, x.dtype)
            w2_e = dequantize(w2_e, w2_scale[expert], w2_zeros[expert], bits, x.dtype)
        gate_up = F.linear(x[token_idx], w13_e)
        if w13_bias is not None:  # added apart (not F.linear's fused bias): rounded twice, as `x @ W + b`
            gate_up = gate_up + w13_bias[expert]
        h = F.linear(_activation_ref(gate_up, mlp), w2_e)
        if w2_bias is not None:
            h = h + w2_bias[expert]
        h = h * topk_weights[token_idx, k_pos, None]
        out.index_add_(0, token_idx, h.to(out.dtype))
    return out


def _activation_ref(gate_up: torch.Tensor, mlp: _ExpertMlp) -> torch.Tensor:
    """The activation of GEMM 1's rows [n, 2I] (gate, then up; relu2_no_mul: [n, I], up alone) -> [n, I]."""
    if mlp.activation == RELU2_NO_MUL:  # transformers' ReLUSquaredActivation
        return torch.square(F.relu(gate_up))
    gate, up = gate_up.chunk(2, dim=-1)
    if mlp.activation == SWIGLU_OAI:
        return swiglu_oai_ref(gate, up, mlp.swiglu_alpha, mlp.swiglu_limit)
    return F.silu(gate) * up


def _routed_entries(topk_ids: torch.Tensor, num_experts: int
                    ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(expert, slots, tokens) for each expert some token picked, in increasing expert order; its entries by
    slot, then by token, as HF's loop takes them from its [E + 1, k, T] one-hot mask (whose class E, entries
    routed to experts held elsewhere, it skips)."""
    expert_mask = F.one_hot(topk_ids.long(), num_classes=num_experts + 1).permute(2, 1, 0)
    hit = (expert_mask.sum(dim=(-1, -2)) > 0).nonzero()
    for expert in hit[:, 0].tolist():
        if expert != num_experts:
            k_pos, token_idx = torch.where(expert_mask[expert])
            yield expert, k_pos, token_idx


def _fp8_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor,
                 block: tuple[int, int]) -> torch.Tensor:
    """fused_moe_ref's FP8 steps 1-4 (see there), in HF's loop over the experts."""
    (num_tokens, hidden), (num_experts, two_i, _) = x.shape, w13.shape
    top_k, inter, bk = topk_ids.shape[1], two_i // 2, block[1]
    if num_tokens == 0 or hidden == 0 or inter == 0:
        return torch.zeros_like(x)
    xq = _group_dequantized(x, bk)  # [T, H] fp32
    slots = torch.zeros((num_tokens, top_k, hidden), dtype=x.dtype, device=x.device)  # weighted outputs
    for expert, k_pos, token_idx in _routed_entries(topk_ids, num_experts):
        w13_e = dequantize_blocks(w13[expert], w13_scale[expert], block, torch.float32)
        w2_e = dequantize_blocks(w2[expert], w2_scale[expert], block, torch.float32)
        gate, up = F.linear(xq[token_idx], w13_e).to(x.dtype).chunk(2, dim=-1)
        h = F.silu(gate) * up  # [n, I] in x's dtype
        y = F.linear(_group_dequantized(h, bk), w2_e) * topk_weights[token_idx, k_pos, None]
        slots[token_idx, k_pos] = y.to(x.dtype)
    out = slots[:, 0].float()
    for j in range(1, top_k):
        out = out + slots[:, j].float()
    return out.to(x.dtype)


@dataclass(frozen=True)
class _Fp8Operands:
    a_scale: torch.Tensor  # [rows, cdiv(K, bk)] fp32, any strides (quantize_groups_fp8's are M-major)
    w_scale: torch.Tensor  # [E, cdiv(N, bn), cdiv(K, bk)] fp32, any strides
    block: tuple[int, int]  # (bn, bk)


@dataclass(frozen=True)
class _IntOperands:
    scale: torch.Tensor  # [E, G, N], N contiguous
    zeros: torch.Tensor  # [E, G, N], scale's strides
    bits: int

    def constexprs(self, a: torch.Tensor, k: int, interpreted_bf16: bool = False) -> dict:
        """The kernels' integer-weight constexprs for inputs ``a`` of width ``k`` (interpreted_bf16: the
        GEMV's INTERPRETED_BF16, which the GEMM reads from BF16_DOT_IN_FP32)."""
        half = a.dtype == torch.float16 and self.scale.dtype == torch.float16
        out = dict(W_INT=True, BITS=self.bits, GROUP_ROWS=k // self.scale.shape[1], HALF_DEQUANT=half)
        return out | (dict(INTERPRETED_BF16=True) if interpreted_bf16 else {})


def _scale_args(fp8: _Fp8Operands | None, mx_scale: torch.Tensor | None, dummy: torch.Tensor,
                integer: _IntOperands | None = None) -> tuple:
    """The kernels' scale pointers and strides (sa, sw, sa's 2 strides, sw's 3: expert, N, K): FP8's,
    MXFP4's E8M0 bytes or integer weights' scales ([E, G, N]: the group's stride is K's) as sw (sa unread),
    or unread placeholders."""
    if integer is not None:
        scale = integer.scale
        return (dummy, scale, 0, 0, scale.stride(0), scale.stride(2), scale.stride(1))
    if mx_scale is not None:
        return (dummy, mx_scale, 0, 0, *mx_scale.stride())
    if fp8 is None:
        return (dummy, dummy, 0, 0, 0, 0, 0)
    return (fp8.a_scale, fp8.w_scale, *fp8.a_scale.stride(), *fp8.w_scale.stride())


def _epilogue_args(mlp: _ExpertMlp, gate_up: bool, dummy: torch.Tensor) -> tuple[tuple, dict]:
    """The kernels' epilogue arguments for GEMM 1 (gate_up) or 2: (bias pointer, its row stride, alpha,
    limit) and the constexprs HAS_BIAS, ACTIVATION and GATED (GEMM 2's always SiLU's and true: one binary
    for every activation)."""
    bias = mlp.w13_bias if gate_up else mlp.w2_bias
    act = _ACTIVATION_IDS[mlp.activation] if gate_up else _ACTIVATION_IDS[SILU]
    gated = not gate_up or mlp.activation in GATED_ACTIVATIONS
    runtime = (dummy, 0) if bias is None else (bias, bias.stride(0))
    return (*runtime, mlp.swiglu_alpha, mlp.swiglu_limit), dict(HAS_BIAS=bias is not None, ACTIVATION=act,
                                                                GATED=gated)


def _launch_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, topk_w: torch.Tensor,
                 align: MoeAlignment, n: int, a_row_div: int, cfg: MoeConfig, gate_up: bool,
                 fp8: _Fp8Operands | None = None, mlp: _ExpertMlp = _ExpertMlp(),
                 mx_scale: torch.Tensor | None = None, integer: _IntOperands | None = None) -> None:
    # a: [rows, K]; w: [E, N (2N for gate_up), K] (MXFP4: K / 2 bytes, mx_scale [E, N, K / 32]; integer:
    # int32 [E, K / pack, N]); out: [T*k, N], rows by entry id
    k = a.shape[1]
    block_n = min(cfg.block_n, max(MIN_DOT, triton.next_power_of_2(n)))
    block_k = min(cfg.block_k, max(MIN_DOT, triton.next_power_of_2(k)))  # K's alone: same at every T
    if fp8 is not None:
        block_n = min(block_n, fp8.block[0])  # within one tile row (powers of two: divides bn)
        block_k = fp8.block[1]  # one weight tile (and one input group) a step
    if mx_scale is not None and block_k % BLOCK_VALUES:
        raise ValueError(f"MXFP4 experts need K steps of whole {BLOCK_VALUES}-value groups: config block_k "
                         f"{cfg.block_k} (a multiple of {BLOCK_VALUES})")
    k_iters = triton.cdiv(k, block_k)
    num_blocks = align.expert_ids.shape[0]
    grid = (num_blocks * triton.cdiv(n, block_n),)
    epilogue, epilogue_constexprs = _epilogue_args(mlp, gate_up, topk_w)
    _moe_gemm_kernel[grid](
        a, w, out, topk_w, align.sorted_ids, align.expert_ids, align.num_padded,
        out.shape[0], n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0), n, k_iters,
        *_scale_args(fp8, mx_scale, topk_w, integer), *epilogue, _zeros_arg(integer, topk_w),
        A_ROW_DIV=a_row_div, STATIC_K_ITERS=static_iters(a.is_cuda, k_iters), BLOCK_M=cfg.block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=cfg.group_m, EVEN_K=k % block_k == 0, GATE_UP=gate_up,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BF16_DOT_IN_FP32=a.dtype == torch.bfloat16 and not a.is_cuda,
        PRECISE=a.is_cuda, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(a),
        **epilogue_constexprs,
        **({} if fp8 is None else dict(W8A8=True, WEIGHT_BLOCK_N=fp8.block[0],
                                       IMPRECISE_ACC=min(IMPRECISE_ACC_K, block_k))),
        **({} if mx_scale is None else dict(W_MXFP4=True)),
        **({} if integer is None else integer.constexprs(a, k)),
    )


def _zeros_arg(integer: _IntOperands | None, dummy: torch.Tensor) -> torch.Tensor:
    """The kernels' z_ptr: integer weights' zero points, else an unread placeholder."""
    return dummy if integer is None else integer.zeros


def _launch_gemv(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, topk_w: torch.Tensor,
                 topk_ids: torch.Tensor, n: int, a_row_div: int, gate_up: bool,
                 fp8: _Fp8Operands | None = None, mlp: _ExpertMlp = _ExpertMlp(),
                 mx_scale: torch.Tensor | None = None, dropped_id: int | None = None,
                 integer: _IntOperands | None = None) -> None:
    # a: [rows, K]; w: [E, N (2N for gate_up), K] (MXFP4: K / 2 bytes, mx_scale [E, N, K / 32]; integer:
    # int32 [E, K / pack, N]); out: [T*k, N], rows by entry id (but dropped_id's entries: not written)
    k, on_cuda = a.shape[1], a.is_cuda
    # The interpreter runs each program in Python: few, wide ones there (CPU_BLOCK_K: one MXFP4 group).
    gemv_n, gemv_k = GEMV_BLOCK_N, GEMV_BLOCK_K if mx_scale is None else MXFP4_GEMV_BLOCK_K
    if integer is not None:
        gemv_n, gemv_k = INT_GEMV_BLOCK_N, INT_GEMV_BLOCK_K
    tile_n, tile_k = (gemv_n, gemv_k) if on_cuda else (CPU_BLOCK_N, CPU_BLOCK_K)
    block_k = min(tile_k, max(MIN_DOT, triton.next_power_of_2(k)))
    block_n = min(tile_n, max(MIN_DOT, triton.next_power_of_2(n)))
    if fp8 is not None:
        block_n = min(block_n, fp8.block[0])
        block_k = fp8.block[1]
    k_iters = triton.cdiv(k, block_k)
    epilogue, epilogue_constexprs = _epilogue_args(mlp, gate_up, topk_w)
    _moe_gemv_kernel[(out.shape[0], triton.cdiv(n, block_n))](
        a, w, out, topk_w, topk_ids, out.shape[0], n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        n, k_iters, *_scale_args(fp8, mx_scale, topk_w, integer), *epilogue, _zeros_arg(integer, topk_w),
        A_ROW_DIV=a_row_div,
        STATIC_K_ITERS=static_iters(on_cuda, k_iters), BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=k % block_k == 0, GATE_UP=gate_up, PRECISE=on_cuda,
        num_warps=GEMV_WARPS, num_stages=GEMV_STAGES if on_cuda else CPU_STAGES, **pdl_args(a),
        **epilogue_constexprs,
        **({} if fp8 is None else dict(W8A8=True, WEIGHT_BLOCK_N=fp8.block[0])),
        **({} if mx_scale is None else dict(W_MXFP4=True)),
        **({} if integer is None else integer.constexprs(a, k, not on_cuda and a.dtype == torch.bfloat16)),
        **_dropped_args(dropped_id),
    )


def _dropped_args(dropped_id: int | None) -> dict:
    """The kernels' DROPPED_ID constexpr: left at its default (nothing dropped) unless there is one."""
    return {} if dropped_id is None else dict(DROPPED_ID=dropped_id)


def _held_ids(topk_ids: torch.Tensor, local_experts: LocalExperts | None, w13: torch.Tensor
              ) -> tuple[torch.Tensor, int | None]:
    """topk_ids as indices into w13's experts, and the id that marks entries routed to experts held
    elsewhere (None: every routed expert is held here)."""
    if local_experts is None:
        return topk_ids, None
    if local_experts.count != w13.shape[0]:
        raise ValueError(f"local_experts holds {local_experts.count} experts, w13 {w13.shape[0]}")
    return local_experts.local_ids(topk_ids), local_experts.count


def _unit_stride(bias: torch.Tensor | None) -> torch.Tensor | None:
    """bias with unit stride along its last dimension, as the kernels index it (a copy only if not)."""
    return bias if bias is None or bias.stride(-1) == 1 else bias.contiguous()


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config: MoeConfig | None = None, gemv: bool | None = None, *,
              w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              block: tuple[int, int] | None = None, w13_bias: torch.Tensor | None = None,
              w2_bias: torch.Tensor | None = None, activation: str = SILU,
              swiglu_alpha: float = GPT_OSS_SWIGLU_ALPHA, swiglu_limit: float = GPT_OSS_SWIGLU_LIMIT,
              local_experts: LocalExperts | None = None, w13_zeros: torch.Tensor | None = None,
              w2_zeros: torch.Tensor | None = None, bits: int | None = None) -> torch.Tensor:
    """fused_moe_ref in Triton: no host syncs, no atomics, CUDA-graph capturable; config overrides
    moe_config's pick of grouped-GEMM tiles, gemv the choice of the alignment-free path for few entries
    (None: up to GEMV_MAX_ENTRIES; tests and sweeps force either). w13_bias, w2_bias, activation, the
    swiglu parameters and local_experts as fused_moe_ref takes them, on every path (16/32-bit, FP8 and
    MXFP4 experts).

    local_experts (expert parallelism): entries routed to experts not held here are never computed: their
    ids become the held count (LocalExperts.local_ids), which moe_align leaves out of every block, the GEMV
    returns on at once, and the slot sum skips; a token none of whose experts is held gets zeros.

    Rounding differs from the reference where the reference rounds more: without w2_bias the down
    projection's fp32 sum is multiplied by the routing weight before its one rounding (with it, the kernel
    rounds the sum, the biased sum and the product, as the reference does), and the k slots are summed in
    fp32 in slot order (the reference adds each expert's rows into the output in x's dtype, expert by
    expert). Elementwise functions may differ in their last fp32 bit (exp; the interpreter's, libdevice's
    and torch's CPU kernels are not the same code); in 16-bit dtypes that is rounded away but where it
    flips a rounding.

    Block-wise FP8 experts: w13 / w2 float8_e4m3fn with w13_scale, w2_scale and block = (bn, bk) as
    fused_moe_ref takes them (I a multiple of bn); x (bf16 / fp16; fp32 too) is quantised per token and
    group of bk, so is h, both by quantize_groups_fp8, bit for bit as the reference; the reference rounds
    where this does, so only the order of fp32 sums (and on Hopper the FP8 dots' accumulation) differs.

    MXFP4 experts (W4A16): w13, w2, w13_scale and w2_scale uint8 as fused_moe_ref takes them (H and I
    multiples of 32, block None, config.block_k a multiple of 32), decoded to x's dtype in the kernels' K
    loops: the results, bit for bit, of these kernels with the same tiles on dequantize_mxfp4_experts'
    weights (the GEMV path on the GPU takes MXFP4_GEMV_BLOCK_K steps where 16-bit weights take
    GEMV_BLOCK_K: there only the order of the fp32 sums differs).

    Integer experts (W4A16 / W8A16): w13, w2, their scales, w13_zeros, w2_zeros and bits as fused_moe_ref
    takes them, dequantised in the kernels' K loops to the reference's weights bit for bit; only the order
    of the fp32 sums differs from the 16-bit kernels' on those weights (the GEMV's lanes are K-major)."""
    # x: [T, H]; w13: [E, 2I, H]; w2: [E, H, I]; topk_weights: [T, k] fp32; topk_ids: [T, k] -> [T, H]
    mlp = _ExpertMlp(activation=activation, w13_bias=_unit_stride(w13_bias), w2_bias=_unit_stride(w2_bias),
                     swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
    fp8_block = _check(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block, mlp, w13_zeros,
                       w2_zeros, bits)
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("w13 and w2 need unit stride along their last (input; integer: output) dimension")
    topk_ids, dropped_id = _held_ids(topk_ids, local_experts, w13)
    integer = is_integer(w13)
    (num_tokens, hidden), num_experts = x.shape, w13.shape[0]
    two_i = w13.shape[2] if integer else w13.shape[1]
    top_k, inter = topk_ids.shape[1], two_i // up_halves(activation)
    # Each held expert gets about T * k / (all routed experts) rows: what moe_config's tiles follow.
    routed_experts = num_experts if local_experts is None else local_experts.total
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if num_tokens == 0 or hidden == 0:
        return out
    if inter == 0:  # experts of width 0 add nothing
        return out.zero_()
    mxfp4 = is_mxfp4(w13)
    cfg = config or moe_config(num_tokens, top_k, routed_experts, hidden, inter, x.dtype, on_cuda=x.is_cuda,
                               mxfp4=mxfp4)
    x = x if x.stride(-1) == 1 else x.contiguous()  # rows may be strided: the kernel takes stride(0)
    topk_w = topk_weights.reshape(-1).contiguous()  # [T*k], by entry id
    num_entries = num_tokens * top_k
    h = torch.empty((num_entries, inter), dtype=x.dtype, device=x.device)  # silu(gate) * up, by entry
    y = torch.empty((num_entries, hidden), dtype=x.dtype, device=x.device)  # weighted expert outputs
    fp8_up = fp8_down = None
    mx_up, mx_down = (w13_scale, w2_scale) if mxfp4 else (None, None)  # E8M0 bytes
    int_up = int_down = None
    if integer:
        int_up, int_down = _int_operands(w13_scale, w13_zeros, bits), _int_operands(w2_scale, w2_zeros, bits)
    a_up = x
    if fp8_block is not None:
        a_up, x_scale = quantize_groups_fp8(x, fp8_block[1])  # codes [T, H], scales [T, cdiv(H, bk)]
        fp8_up = _Fp8Operands(x_scale, w13_scale, fp8_block)
    gemv_max = MXFP4_GEMV_MAX_ENTRIES if mxfp4 else GEMV_MAX_ENTRIES
    use_gemv = gemv if gemv is not None else (config is None and num_entries <= gemv_max)
    flat_ids = topk_ids.reshape(-1).contiguous()  # [T*k], by entry id
    if use_gemv:
        _launch_gemv(a_up, w13, h, topk_w, flat_ids, inter, top_k, gate_up=True, fp8=fp8_up, mlp=mlp,
                     mx_scale=mx_up, dropped_id=dropped_id, integer=int_up)
    else:
        align = moe_align(topk_ids, num_experts, cfg.block_m, dropped=dropped_id is not None)
        _launch_gemm(a_up, w13, h, topk_w, align, inter, top_k, cfg, gate_up=True, fp8=fp8_up, mlp=mlp,
                     mx_scale=mx_up, integer=int_up)
    a_down = h
    if fp8_block is not None:
        a_down, h_scale = quantize_groups_fp8(h, fp8_block[1])  # codes [T*k, I], scales [T*k, cdiv(I, bk)]
        fp8_down = _Fp8Operands(h_scale, w2_scale, fp8_block)
    if use_gemv:
        _launch_gemv(a_down, w2, y, topk_w, flat_ids, hidden, 1, gate_up=False, fp8=fp8_down, mlp=mlp,
                     mx_scale=mx_down, dropped_id=dropped_id, integer=int_down)
    else:
        _launch_gemm(a_down, w2, y, topk_w, align, hidden, 1, cfg, gate_up=False, fp8=fp8_down, mlp=mlp,
                     mx_scale=mx_down, integer=int_down)
    block_h = min(SUM_BLOCK_H, triton.next_power_of_2(hidden))
    _moe_sum_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        y, out, flat_ids, hidden, TOP_K=top_k, BLOCK_H=block_h, num_warps=4, **pdl_args(y),
        **_dropped_args(dropped_id))
    return out


def _int_operands(scale: torch.Tensor, zeros: torch.Tensor, bits: int) -> _IntOperands:
    """Integer experts' scales and zeros as the kernels index them: N contiguous, one set of strides."""
    scale, zeros = scale.contiguous(), zeros.contiguous()
    return _IntOperands(scale, zeros, bits)
