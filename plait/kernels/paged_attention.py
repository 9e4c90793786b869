"""paged_attention: one Triton kernel for a whole mixed batch (prefill chunks + decodes) over paged KV.

Layout. q, out: [T, Hq, D] (row r's tokens are ``query_start_loc[r]:query_start_loc[r + 1]``);
k_cache, v_cache: [num_blocks, block_size, Hkv, D]; key position ``p`` of row r lives in block
``block_tables[r, p // block_size]`` at offset ``p % block_size``. Query ``i`` of row r sits at position
``context_len + i`` (``context_len = seq_len - query_len``) and sees keys at positions ``<= its own``
(and, with a sliding window W > 0, ``> its own - W``). With ``key_limits`` ([T], Gemma 3's images) query token
t sees keys up to ``key_limits[t]`` instead of its own position (an image's placeholders see their whole
image); the window's lower bound stays at its own position.

One kernel, its launch shape chosen on the host from host ints only (CUDA-graph safe, no device sync):

- a 2-D grid (query tile, kv head). A query tile packs ``BLOCK_Q`` tokens of one row times the ``GROUP``
  query heads sharing a kv head into ``BLOCK_M = BLOCK_Q * GROUP`` (padded) rows, so each K/V tile is
  read once per group; its row is found by binary search over ``query_start_loc``. K/V are walked in
  tiles of ``TILE_N`` positions, independent of block_size: the block id is gathered per key position.
- split-KV (flash-decoding), for launches with too few query tiles to fill the GPU (small decode
  batches, a prompt chunk of a few hundred tokens over a long context): a third grid dimension cuts each
  query tile's visible K/V tiles into splits, balanced on the device from the row's seq_len (at most
  ``num_splits``, at least ``MIN_SPLIT_TILES`` tiles each). Each split stores a partial output + LSE to
  fp32 scratch and bumps the tile's counter; the last split to arrive combines the partials by their
  LSEs, writes out and resets the counter, so no second launch is needed.

Scores are kept in the log2 domain (log2(e) folded into the scale, exp2 throughout); LSEs returned to
callers are natural logs. With 16-bit inputs P.V can be computed as two 16-bit dots (P = P_hi + P_lo), so
P carries ~16 mantissa bits instead of bf16's 8 (``PLAIT_ATTN_PRECISE_PV``: off, the default; decode; all).

Attention sinks (gpt-oss): one logit per query head, a key of value zero that every query sees. Splits and
tiles never see it; it is added where a query's final output is stored (``_store_out``: by the one program
of an unsplit tile, or by the split that combines the partials), so it counts once per token and head.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from plait.kernels.dispatch import checked_mode
from plait.kernels.pdl import pdl_args, pdl_prologue
from plait.layers.fp8 import FP8_DTYPE

LOG2E = math.log2(math.e)
# ln(2) inside kernels: LSEs are accumulated in the log2 domain and handed out as natural logs.
_LN2 = tl.constexpr(math.log(2.0))
# log2(e) inside kernels: sinks come in natural units and join scores kept in log2 units.
_LOG2E = tl.constexpr(LOG2E)

# ---- Launch heuristics: every tile size / warp count / stage count lives here. ----------------------
# Smallest M, N, K that tl.dot accepts; packed (token x group head) rows are padded up to it.
MIN_DOT = 16
# Query-tile rows (tokens x group heads) for prefill-carrying batches; smaller when every chunk is short.
# Head dim 128 takes 64-row tiles of 4 warps, two programs to a multiprocessor: against 128-row tiles of 8
# warps (one each), Llama-8B's 32 layers on an H200 took 0.32 vs 0.37 ms for a 252-token chunk over an
# empty context, 1.61 vs 1.62 after 2,048 cached, 2.43 vs 2.46 after 3,840, 1.75 vs 1.80 for 124 tokens
# after 3,968, 5.97 vs 6.48 for 16 fresh 512-token prompts, 14.4 vs 14.9 for a fresh 4,096
# (benchmarks/results/chunk_attention_sweep_h200.json, each with this file's split heuristic).
PREFILL_BLOCK_M = {64: 128, 128: 64, 256: 64, 512: 32}
# Key positions per K/V tile: large tiles for decode (bandwidth), square-ish for prefill (tl.dot).
PREFILL_TILE_N = {64: 64, 128: 64, 256: 32, 512: 32}
DECODE_TILE_N = {64: 128, 128: 64, 256: 32, 512: 32}
# Decode over an FP8 cache widens every code before its dot, which bounds the kernel rather than the bytes:
# wider tiles with a stage more in flight measured fastest (Llama-8B heads, 64 rows x 4,160 cached tokens on
# an H200: 0.222 ms a layer, against 0.293 with the bf16 cache's tiles and 0.294 over a bf16 cache;
# benchmarks/results/kv_cache_fp8_h200.json).
FP8_DECODE_TILE_N = {64: 128, 128: 128, 256: 32, 512: 32}
FP8_DECODE_NUM_STAGES = 3
PREFILL_NUM_STAGES = {64: 3, 128: 2, 256: 2, 512: 2}
# Prefill tiles take 8 warps from this many fp32 accumulator elements (BLOCK_M x D) up.
PREFILL_8_WARPS_ACC = 64 * 256
# 2 stages beat 3 at every decode shape measured (H200, 256 rows, contexts 800 / 2048: 3869 vs 3488 and
# 4245 vs 3882 GB/s; benchmarks/results/decode_tune_h200.json).
DECODE_NUM_STAGES = 2
# Decode launches walk a row's kv heads back to back, so together they read each cache block whole.
DECODE_HEADS_FASTEST = True
# Split-KV programs walk a few tiles each; one more stage in flight measured better there (Llama-8B at
# batch 1 on an H200: 4.52 ms a token with 3 stages, 4.68 with 2).
SPLIT_NUM_STAGES = 3
# ... but not for MLA's 576-wide K tiles: 2 stages beat 3 at every split count swept (mla_decode_tune_h200).
SPLIT_NUM_STAGES_EXCEPT = {512: 2}
# fp32 (interpreter tests, GPU debugging) doubles the bytes per tile: keep tiles small and unpipelined.
FP32_MAX_BLOCK_M = 64
FP32_MAX_TILE_N = 32
# Split-KV of decode-only batches: split until about this many programs per multiprocessor are in flight ...
SPLIT_TARGET_PROGRAMS_PER_SM = 4
# ... but give every split at least this many key positions, and never more than this many splits.
MIN_KEYS_PER_SPLIT = 64  # one decode tile: small batches are latency-bound, so spread wide
MAX_KV_SPLITS = 64
# MLA's latent rows (V 512 wide, 16 query heads a program) make each split's partial 16 x 512 fp32, and the
# last split to arrive reads every partial alone: ~1.5-2.5 us a split on an H200, so MLA splits far less.
# (programs per SM, min keys per split) by head dim: at 16 heads, batch 1, the default's 10 splits over 640
# cached tokens took 28.5 us, 4 of 160 keys 19.1; over 4,096, 64 splits 127 us, 16 43.7; 64 rows x 1,024,
# 4 splits 48.2 against 9's 80.6; 128 heads, 8 rows x 2,048: 4 splits 54.8, 9 92.8, 16 139
# (benchmarks/results/mla_decode_tune_h200.json).
DECODE_SPLIT_KNOBS = {512: (1, 256)}
# Split-KV of prefill-carrying batches. A prefill program of 8 warps (BLOCK_M 128) fills a multiprocessor's
# registers, so about one runs per SM at a time; one of 4 warps, two: the split count is the most that
# keeps the programs within one wave. (H200, W4's 256-token chunk after 2048 / 3840 cached, 32 layers, 8
# warps: 2 splits 1.61 / 2.44 ms, 4 splits 2.23 / 3.04, none 2.23 / 3.84,
# benchmarks/results/attention_steps_h200.json; 4 warps: 2 splits 1.61 / 2.43, none 1.92 / 3.30, and 4
# splits best for a 124-token chunk after 3,968, chunk_attention_sweep_h200.json) ...
PREFILL_SPLIT_PROGRAMS_PER_SM = {4: 2, 8: 1}  # by the program's warps
# ... with every split at least this many K/V tiles (checked on the device against each query tile's
# real range, so a graph captured for max_model_len does not split short contexts), ...
PREFILL_MIN_SPLIT_TILES = 4
# ... and the fp32 partials (T x Hq x splits x (D + 1) x 4 bytes) within this much memory.
MAX_SPLIT_SCRATCH_BYTES = 64 << 20
# Multiprocessor count assumed where there is no CUDA device (the Triton interpreter on CPU).
CPU_NUM_SMS = 8
MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension
# V's (and the output's) width; 512 is MLA's latent (K is wider by its rope part: paged_attention).
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256, 512)
# MLA (DeepSeek): the rope columns K has past V's, dotted with q's own (tl.dot's K dimension: >= 16).
SUPPORTED_ROPE_DIMS = (16, 32, 64, 128)
# MLA: query heads a program packs beside each other over the shared latent rows (the launch sees Hq / this
# many "kv heads", each a stride-0 view of the one latent head), so the fp32 accumulator of 512-wide rows
# stays within a program's registers.
MLA_HEADS_PER_PROGRAM = 16

# P.V with P split into two 16-bit terms for 16-bit inputs. Rounding P to bf16 once (8 mantissa bits) is
# the largest error beside torch_ref's fp32 math (QK^T of bf16 inputs is exact in fp32), but any last-bit
# difference grows through bf16 activations, so fidelity buys little agreement: greedy bf16 decoding of a
# random model agreed with torch_ref on 83% / 61% of prompts (head dims 64 / 128) for 32 tokens with
# "off", 88% / 73% with "decode", 84% / 77% with "all" (one H200 run each). The cost: "decode" slowed
# W1's decode steps by 5% (3.91 vs 3.71 s, same H200), "all" W4's 256-token chunks' attention by 25%.
# "off" (the default): P rounded once, as flash attention does; "decode": launches of one-token rows
# only; "all": prompt chunks too.
PRECISE_PV_ENV = "PLAIT_ATTN_PRECISE_PV"
PRECISE_PV_MODES = ("off", "decode", "all")
_precise_pv = checked_mode(os.environ.get(PRECISE_PV_ENV) or "off", PRECISE_PV_MODES, PRECISE_PV_ENV)


def set_precise_pv(mode: str) -> None:
    """Where later launches split P into two terms: "off", "decode" or "all" (tests, benchmarks)."""
    global _precise_pv
    _precise_pv = checked_mode(mode, PRECISE_PV_MODES, "precise P.V mode")


def precise_pv_mode() -> str:
    """Where 16-bit launches split P into two terms (PLAIT_ATTN_PRECISE_PV, or the last set_precise_pv)."""
    return _precise_pv


def _uses_precise_pv(dtype: torch.dtype, max_query_len: int) -> bool:
    if dtype == torch.float32:
        return False  # fp32 inputs already take IEEE dots
    return _precise_pv == "all" or (_precise_pv == "decode" and max_query_len <= 1)


@dataclass(frozen=True)
class LaunchConfig:
    """Compile-time tile shape of one paged_attention call; derived from host ints only."""

    block_m: int  # rows of a query tile: block_q tokens x group heads, padded to a power of two
    block_q: int  # tokens of one row per query tile
    tile_n: int  # key positions per K/V tile
    num_warps: int
    num_stages: int
    num_splits: int  # 1: each program walks its query tile's whole key range; > 1: split-KV
    # Launch order of the unified kernel: a row's kv heads one after another (their K/V rows lie side by
    # side in each cache block), rather than one kv head's rows one after another.
    heads_fastest: bool = False
    # Split-KV: a query tile's key range is cut into at most num_splits parts of at least this many tiles.
    min_split_tiles: int = 1


@dataclass
class PagedAttentionPlan:
    """Everything paged_attention derives on the host for one step: build once, reuse in every layer."""

    config: LaunchConfig
    split_out: torch.Tensor | None = None  # [T, Hq, num_splits, D] fp32: each split's normalised output
    split_lse: torch.Tensor | None = None  # [T, Hq, num_splits] fp32: each split's LSE (log2 domain)
    # [query tiles, Hkv] int32: the splits of a query tile that have stored their partials; zero between
    # launches (the last split resets it), so every layer and every graph replay starts from zero.
    split_counters: torch.Tensor | None = None


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return CPU_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_split_knobs(head_dim: int) -> tuple[int, int]:
    """(programs per SM that decode splits aim for, min keys per split) at ``head_dim`` (V's width)."""
    return DECODE_SPLIT_KNOBS.get(head_dim, (SPLIT_TARGET_PROGRAMS_PER_SM, MIN_KEYS_PER_SPLIT))


def choose_num_splits(
    num_rows: int, num_kv_heads: int, max_seq_len: int, tile_n: int, num_sms: int, *, num_tokens: int = 0,
    max_query_len: int = 1, block_q: int = 1, scratch_bytes_per_split: int = 0, num_warps: int = 8,
    head_dim: int = 128,
) -> int:
    """Splits of each query tile's key range: enough programs to fill the GPU, none shorter than a few
    keys at the longest row. Host ints only (max_seq_len may be an upper bound), so a captured graph
    stays valid.

    Decode-only batches (max_query_len <= 1) count one program per row and kv head. Prefill-carrying
    batches count the fewest query tiles ``num_tokens`` can fill (``block_q`` tokens each: a graph's
    padded rows hold no tokens), and keep the partials within MAX_SPLIT_SCRATCH_BYTES."""
    if max_query_len <= 1:
        programs = max(num_rows * num_kv_heads, 1)
        per_sm, min_keys = decode_split_knobs(head_dim)
        wanted = triton.cdiv(per_sm * num_sms, programs)
        useful = triton.cdiv(max_seq_len, max(min_keys, tile_n))
        return max(1, min(wanted, useful, MAX_KV_SPLITS))
    programs = max(triton.cdiv(num_tokens, block_q) * num_kv_heads, 1)
    wanted = PREFILL_SPLIT_PROGRAMS_PER_SM.get(num_warps, 1) * num_sms // programs
    useful = triton.cdiv(triton.cdiv(max_seq_len, tile_n), PREFILL_MIN_SPLIT_TILES)
    affordable = MAX_SPLIT_SCRATCH_BYTES // max(scratch_bytes_per_split, 1)
    return max(1, min(wanted, useful, affordable, MAX_KV_SPLITS))


def _default_tiles(
    head_dim: int, group: int, dtype: torch.dtype, max_query_len: int, fp8_cache: bool = False,
) -> tuple[int, int, int, int]:
    """(block_m, tile_n, num_warps, num_stages) by head_dim, group size, dtype, batch kind and cache dtype."""
    group_rows = max(MIN_DOT, triton.next_power_of_2(group))
    dim_key = max(head_dim, 64)  # head dims 16 and 32 take the D=64 tiles
    if max_query_len <= 1 and fp8_cache and dtype != torch.float32:
        block_m, tile_n, warps, stages = group_rows, FP8_DECODE_TILE_N[dim_key], 4, FP8_DECODE_NUM_STAGES
    elif max_query_len <= 1:  # decode-only: one token x the group per tile, wide K/V tiles for bandwidth
        block_m, tile_n, warps, stages = group_rows, DECODE_TILE_N[dim_key], 4, DECODE_NUM_STAGES
    else:
        wanted_m = triton.next_power_of_2(max_query_len * group)
        block_m = max(group_rows, min(PREFILL_BLOCK_M[dim_key], wanted_m))
        tile_n, stages = PREFILL_TILE_N[dim_key], PREFILL_NUM_STAGES[dim_key]
        # 8 warps once the fp32 accumulator reaches 16K elements (4 would spill at D=128, M=128).
        warps = 8 if block_m >= 128 or block_m * head_dim >= PREFILL_8_WARPS_ACC else 4
    if dtype == torch.float32:
        block_m = max(group_rows, min(block_m, FP32_MAX_BLOCK_M))
        tile_n, stages = min(tile_n, FP32_MAX_TILE_N), 1
    return block_m, tile_n, warps, stages


def launch_config(
    head_dim: int, group: int, dtype: torch.dtype, max_query_len: int, num_rows: int, num_kv_heads: int,
    max_seq_len: int, num_sms: int, num_kv_splits: int | None = None, tile_n: int | None = None,
    block_m: int | None = None, num_tokens: int | None = None, cache_dtype: torch.dtype | None = None,
) -> LaunchConfig:
    """The heuristic tiles, with overrides: ``num_kv_splits`` (1: split-KV off; > 1: forced, down to one
    K/V tile per split), ``tile_n`` and ``block_m`` (powers of two; tests use small ones to cross many
    tiles cheaply). ``num_tokens`` (default: one per row) sizes prefill splits and their scratch;
    ``cache_dtype`` (default: ``dtype``) picks the FP8 cache's decode tiles."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} not supported; one of {SUPPORTED_HEAD_DIMS}")
    default_m, default_n, warps, stages = _default_tiles(head_dim, group, dtype, max_query_len,
                                                         cache_dtype == FP8_DTYPE)
    block_m, tile_n = block_m or default_m, tile_n or default_n
    pow2 = all(x & (x - 1) == 0 for x in (block_m, tile_n))
    if not pow2 or block_m < max(MIN_DOT, group) or tile_n < MIN_DOT:
        raise ValueError(f"block_m {block_m} / tile_n {tile_n}: powers of two >= {MIN_DOT} and the group")
    is_decode = max_query_len <= 1
    block_q = block_m // group
    num_tokens = num_rows if num_tokens is None else num_tokens
    min_split_tiles = 1
    if num_kv_splits is None:
        num_heads = group * num_kv_heads
        num_kv_splits = choose_num_splits(
            num_rows, num_kv_heads, max_seq_len, tile_n, num_sms, num_tokens=num_tokens,
            max_query_len=max_query_len, block_q=block_q, num_warps=warps,
            scratch_bytes_per_split=num_tokens * num_heads * (head_dim + 1) * torch.float32.itemsize,
            head_dim=head_dim)
        min_split_tiles = (triton.cdiv(decode_split_knobs(head_dim)[1], tile_n) if is_decode
                           else PREFILL_MIN_SPLIT_TILES)
    num_kv_splits = max(1, num_kv_splits)
    if num_kv_splits > 1 and is_decode and dtype != torch.float32:
        stages = max(stages, SPLIT_NUM_STAGES_EXCEPT.get(head_dim, SPLIT_NUM_STAGES))
    return LaunchConfig(block_m=block_m, block_q=block_q, tile_n=tile_n, num_warps=warps,
                        num_stages=stages, num_splits=num_kv_splits,
                        heads_fastest=is_decode and DECODE_HEADS_FASTEST, min_split_tiles=min_split_tiles)


def plan_paged_attention(
    num_tokens: int, num_rows: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    max_query_len: int, max_seq_len: int, device: torch.device, num_kv_splits: int | None = None,
    tile_n: int | None = None, block_m: int | None = None, cache_dtype: torch.dtype | None = None,
) -> PagedAttentionPlan:
    """The launch config and split-KV scratch for a step; shapes come from host ints only. ``dtype`` is q's,
    ``cache_dtype`` the KV cache's (default: q's)."""
    config = launch_config(head_dim, num_heads // num_kv_heads, dtype, max_query_len, num_rows, num_kv_heads,
                           max_seq_len, _num_sms(device), num_kv_splits, tile_n, block_m, num_tokens,
                           cache_dtype)
    plan = PagedAttentionPlan(config)
    if config.num_splits > 1:
        shape = (num_tokens, num_heads, config.num_splits)
        plan.split_out = torch.empty(*shape, head_dim, dtype=torch.float32, device=device)
        plan.split_lse = torch.empty(*shape, dtype=torch.float32, device=device)
        num_tiles = num_tokens // config.block_q + num_rows
        plan.split_counters = torch.zeros(num_tiles, num_kv_heads, dtype=torch.int32, device=device)
    return plan


# ---- Kernels ------------------------------------------------------------------------------------------

# Triton compiles a kernel anew for every combination of "int == 1", "int % 16 == 0" and "pointer 16-byte
# aligned" it meets. Some arguments change from step to step: the row count, the block-table width of an
# eager step, the split count (and so the split scratch's strides), and the alignment of the per-row
# arrays a mixed step slices at its decode/prompt split. An eager step meeting a combination no earlier
# step had stopped for a compile (seen: 640-670 ms in W1's timed run). They are only used for addresses
# and gathers, never for vector loads, so the kernels take them unspecialised.
_SLICED_ROW_ARRAYS = ["query_start_loc_ptr", "seq_lens_ptr", "block_tables_ptr"]
_SPLIT_ARGS = ["num_splits", "stride_so_t", "stride_so_h", "stride_sl_t", "stride_sl_h"]


@triton.jit
def _find_row(query_start_loc_ptr, tile_idx, num_rows, BLOCK_Q: tl.constexpr):
    """Row r owns query tiles [qsl[r] // BLOCK_Q + r, qsl[r + 1] // BLOCK_Q + r + 1), at least
    cdiv(query_len, BLOCK_Q) of them; the owner of ``tile_idx`` is the last row starting at or before it."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_rows
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, q_pe, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head, q_pos, q_lim, q_ok, seq_len,
    qk_scale, tile, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, softcap_log2,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr, SLIDING_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PRECISE_PV: tl.constexpr, MASKED: tl.constexpr, SOFTCAP: tl.constexpr,
    INTERPRETED: tl.constexpr, ROPE_DIM: tl.constexpr, V_FROM_K: tl.constexpr,
):
    """One online-softmax step of q ([BLOCK_M, D]) over K/V tile ``tile`` of one row and kv head.

    ``q_lim`` [BLOCK_M]: the last key position each query sees (its own position, or past it under key
    limits); the window counts back from ``q_pos``. Unmasked tiles (MASKED False) must lie wholly inside every
    valid query's visible range; padding query rows then see finite junk that is never stored."""
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k_pos = tile * TILE_N + offs_n
    k_in = k_pos < seq_len
    # Past seq_len, positions read the pad block and are masked, so no table entry past the row's blocks
    # is read and no cache slot holding junk (even NaN) reaches the sums.
    if MASKED:
        block = tl.load(block_table_ptr + k_pos // BLOCK_SIZE, mask=k_in, other=0).to(tl.int64)
    else:
        block = tl.load(block_table_ptr + k_pos // BLOCK_SIZE).to(tl.int64)
    offset = k_pos % BLOCK_SIZE
    k_off = block * stride_kb + offset * stride_ks + kv_head * stride_kh
    v_off = block * stride_vb + offset * stride_vs + kv_head * stride_vh
    k_ptrs = k_cache_ptr + k_off[:, None] + offs_d[None, :]
    v_ptrs = v_cache_ptr + v_off[:, None] + offs_d[None, :]
    # An FP8 cache's codes are widened to q's dtype (exactly) here; their scales are applied outside.
    if MASKED:
        k = tl.load(k_ptrs, mask=k_in[:, None], other=0.0).to(q.dtype)
    else:
        k = tl.load(k_ptrs).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, TILE_N]
    if ROPE_DIM > 0:  # MLA: the row's rope columns (after the latent's HEAD_DIM) against q's own
        offs_r = tl.arange(0, ROPE_DIM)
        pe_ptrs = k_cache_ptr + k_off[:, None] + HEAD_DIM + offs_r[None, :]
        if MASKED:
            k_pe = tl.load(pe_ptrs, mask=k_in[:, None], other=0.0).to(q.dtype)
        else:
            k_pe = tl.load(pe_ptrs).to(q.dtype)
        s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision=DOT_PRECISION)
    s = s * qk_scale
    if SOFTCAP:  # qk_scale holds 1 / cap: the score becomes cap * tanh(score / cap), in log2 units
        if INTERPRETED:
            s = softcap_log2 * (1.0 - 2.0 / (tl.exp(2.0 * s) + 1.0))  # the interpreter has no libdevice
        else:
            s = softcap_log2 * libdevice.tanh(s)
    if MASKED:
        visible = q_ok[:, None] & k_in[None, :] & (k_pos[None, :] <= q_lim[:, None])
        if SLIDING_WINDOW > 0:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - SLIDING_WINDOW)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:
        # A row with nothing visible yet keeps m = -inf; shifting by 0 avoids -inf - -inf = NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_safe = m_new
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if V_FROM_K:  # MLA: V is the latent K tile itself, already loaded
        v = k
    elif MASKED:
        v = tl.load(v_ptrs, mask=k_in[:, None], other=0.0).to(q.dtype)
    else:
        v = tl.load(v_ptrs).to(q.dtype)
    acc = acc * alpha[:, None]
    p_hi = p.to(v.dtype)
    if PRECISE_PV:
        # What rounding p to 16 bits lost, itself in 16 bits: p_hi + p_lo holds ~16 mantissa bits.
        p_lo = (p - p_hi.to(tl.float32)).to(v.dtype)
        acc = tl.dot(p_lo, v, acc, input_precision=DOT_PRECISION)
    acc = tl.dot(p_hi, v, acc, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attend_tiles(
    acc, m_i, l_i, q, q_pe, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head, q_pos, q_lim, q_ok, seq_len,
    qk_scale,
    tile_lo, tile_hi, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, softcap_log2,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr, SLIDING_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PRECISE_PV: tl.constexpr, INTERPRETED: tl.constexpr, MASKED: tl.constexpr,
    SOFTCAP: tl.constexpr, ROPE_DIM: tl.constexpr, V_FROM_K: tl.constexpr,
):
    """Online softmax over K/V tiles [tile_lo, tile_hi), carrying (acc [BLOCK_M, D], m, l [BLOCK_M]):
    unnormalised, log2 domain. A query that saw no key keeps m = -inf, l = 0, acc = 0."""
    if INTERPRETED:
        # Triton 3.6's interpreter cannot use tensor bounds in range() under numpy 2; a while loop runs
        # the same steps there (on the GPU the for loop is kept: only it is software-pipelined).
        tile = tile_lo
        while tile < tile_hi:
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, q_pe, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head, q_pos, q_lim,
                q_ok, seq_len, qk_scale, tile, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                stride_vh, softcap_log2, BLOCK_SIZE, TILE_N, HEAD_DIM, SLIDING_WINDOW, DOT_PRECISION,
                PRECISE_PV, MASKED, SOFTCAP, INTERPRETED, ROPE_DIM, V_FROM_K)
            tile += 1
    else:
        for tile in range(tile_lo, tile_hi):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, q_pe, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head, q_pos, q_lim,
                q_ok, seq_len, qk_scale, tile, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                stride_vh, softcap_log2, BLOCK_SIZE, TILE_N, HEAD_DIM, SLIDING_WINDOW, DOT_PRECISION,
                PRECISE_PV, MASKED, SOFTCAP, INTERPRETED, ROPE_DIM, V_FROM_K)
    return acc, m_i, l_i


@triton.jit
def _attend_range(
    q, q_pe, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head, q_pos, q_lim, q_ok, seq_len, qk_scale,
    tile_lo, tile_hi, first_q_pos,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, softcap_log2,
    BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, PRECISE_PV: tl.constexpr,
    INTERPRETED: tl.constexpr, SOFTCAP: tl.constexpr, ROPE_DIM: tl.constexpr, V_FROM_K: tl.constexpr,
):
    """Attend q over K/V tiles [tile_lo, tile_hi): tiles wholly at or before ``first_q_pos`` (the first
    query of the tile) skip the masks; the rest, and every tile under a sliding window, are masked."""
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    mid = tile_lo
    if SLIDING_WINDOW == 0:
        mid = tl.minimum(tl.maximum((first_q_pos + 1) // TILE_N, tile_lo), tile_hi)
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, q_pe, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head, q_pos, q_lim, q_ok,
            seq_len, qk_scale, tile_lo, mid, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            softcap_log2, BLOCK_SIZE, TILE_N, HEAD_DIM, SLIDING_WINDOW, DOT_PRECISION, PRECISE_PV,
            INTERPRETED, False, SOFTCAP, ROPE_DIM, V_FROM_K)
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, q_pe, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head, q_pos, q_lim, q_ok,
        seq_len, qk_scale, mid, tile_hi, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        softcap_log2, BLOCK_SIZE, TILE_N, HEAD_DIM, SLIDING_WINDOW, DOT_PRECISION, PRECISE_PV,
        INTERPRETED, True, SOFTCAP, ROPE_DIM, V_FROM_K)
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["num_rows", "stride_bt", *_SPLIT_ARGS],
            do_not_specialize_on_alignment=_SLICED_ROW_ARRAYS)
def _paged_attention_kernel(
    out_ptr, lse_ptr, split_out_ptr, split_lse_ptr, split_counters_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, sinks_ptr, key_limits_ptr, qk_scale, v_scale,
    softcap_log2, num_rows,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_lse_t,
    stride_so_t, stride_so_h, stride_sl_t, stride_sl_h, stride_counter,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt, num_splits,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, SLIDING_WINDOW: tl.constexpr, STORE_LSE: tl.constexpr,
    SPLIT_KV: tl.constexpr, MIN_SPLIT_TILES: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PRECISE_PV: tl.constexpr, INTERPRETED: tl.constexpr, HEADS_FASTEST: tl.constexpr, PDL: tl.constexpr,
    ONE_TOKEN_ROWS: tl.constexpr, METADATA_READY: tl.constexpr, SCALE_V: tl.constexpr,
    FP16_DOTS: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_KEY_LIMITS: tl.constexpr,
    ROPE_DIM: tl.constexpr, V_FROM_K: tl.constexpr,
):
    """Grid (T // BLOCK_Q + R, Hkv[, num_splits]), or (Hkv, T // BLOCK_Q + R[, num_splits]) with
    HEADS_FASTEST: one query tile of one row, all GROUP query heads of one kv head, and with SPLIT_KV
    one split of the keys that tile sees. A decode launch (ONE_TOKEN_ROWS) has R tiles instead, tile r
    holding row r's one token (or none).

    With SPLIT_KV a query tile whose keys make one split is written by that split alone; otherwise each
    of its splits stores its partial and counts itself in, and the last to arrive combines them."""
    # With METADATA_READY the row metadata (query_start_loc, seq_lens) is read before the PDL wait,
    # while the kernel before this one still runs; q and the K/V cache (it writes them) wait for it.
    if not METADATA_READY:
        pdl_prologue(PDL)
    if HEADS_FASTEST:
        kv_head = tl.program_id(0)
        tile_idx = tl.program_id(1)
    else:
        tile_idx = tl.program_id(0)
        kv_head = tl.program_id(1)
    if ONE_TOKEN_ROWS:
        row = tile_idx  # one query tile per row: no search (log2(rows) dependent loads at large batches)
    else:
        row = _find_row(query_start_loc_ptr, tile_idx, num_rows, BLOCK_Q)
    if row < 0:
        if METADATA_READY:
            pdl_prologue(PDL)  # every program waits, so that this grid completes after its predecessor
        return  # a tile before the first row's tokens (a launch over a later part of the step's rows)
    q_start = tl.load(query_start_loc_ptr + row)
    q_len = tl.load(query_start_loc_ptr + row + 1) - q_start
    q_tile = tile_idx - (q_start // BLOCK_Q + row)
    if ONE_TOKEN_ROWS:
        q_tile = 0
    seq_len = tl.load(seq_lens_ptr + row)
    if METADATA_READY:
        pdl_prologue(PDL)
    if q_tile * BLOCK_Q >= q_len:
        return
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_idx = q_tile * BLOCK_Q + offs_m // GROUP  # token within the row's chunk
    head = kv_head * GROUP + offs_m % GROUP
    q_ok = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = context_len + q_idx
    token = (q_start + q_idx).to(tl.int64)
    q_rows = q_ptr + token * stride_qt + head * stride_qh  # [BLOCK_M]
    q = tl.load(q_rows[:, None] + offs_d[None, :], mask=q_ok[:, None], other=0.0)
    q_pe = q  # never read without ROPE_DIM
    if ROPE_DIM > 0:  # MLA: each query row's rope part, after its HEAD_DIM latent columns
        offs_r = tl.arange(0, ROPE_DIM)
        q_pe = tl.load(q_rows[:, None] + HEAD_DIM + offs_r[None, :], mask=q_ok[:, None], other=0.0)
    if FP16_DOTS:
        # bf16 q over an FP8 cache: the dots take q in fp16 and the codes widened to fp16, one hardware
        # conversion per pair of codes, where widening to bf16 goes through fp32 (a Llama-8B decode layer,
        # 64 rows x 4,160 cached tokens on an H200: 0.293 against 0.338 ms). q's bf16 values are exact in
        # fp16 within its range (|q| < 65504), and P keeps 3 more bits than in bf16.
        q = q.to(tl.float16)
        q_pe = q_pe.to(tl.float16)

    # Keys this tile can see: up to its last query's position (or the furthest key limit of its queries),
    # from its first query's window start.
    last_q = tl.minimum((q_tile + 1) * BLOCK_Q, q_len) - 1
    if HAS_KEY_LIMITS:
        q_lim = tl.load(key_limits_ptr + token, mask=q_ok, other=0).to(tl.int32)
        q_lim = tl.maximum(q_lim, q_pos)  # a limit never hides a query's own causal keys
        furthest = tl.maximum(tl.max(tl.where(q_ok, q_lim, 0), 0), context_len + last_q)
        tile_hi = tl.cdiv(tl.minimum(furthest + 1, seq_len), TILE_N)
    else:
        q_lim = q_pos
        tile_hi = tl.cdiv(context_len + last_q + 1, TILE_N)
    tile_lo = 0
    if SLIDING_WINDOW > 0:
        tile_lo = tl.maximum(context_len + q_tile * BLOCK_Q - SLIDING_WINDOW + 1, 0) // TILE_N
    if SPLIT_KV:
        # Balanced on the device: split s takes its share of those tiles, at least MIN_SPLIT_TILES of
        # them (num_splits is a host-side bound, possibly from max_model_len).
        split = tl.program_id(2)
        num_kv_tiles = tile_hi - tile_lo
        used_splits = tl.maximum(tl.minimum(tl.cdiv(num_kv_tiles, MIN_SPLIT_TILES), num_splits), 1)
        per_split = tl.maximum(tl.cdiv(num_kv_tiles, used_splits), 1)
        used_splits = tl.cdiv(num_kv_tiles, per_split)  # the rounding up may leave the last ones empty
        if split >= used_splits:  # no keys here, and the tile's last split does not wait for this one
            return
        # Never negative; saying so spares the K/V address math its signed-division fixups (~40% more
        # integer instructions in the loop at Llama-8B prefill tiles, per the SASS).
        tile_lo = tl.maximum(tile_lo + split * per_split, 0)
        tile_hi = tl.minimum(tile_lo + per_split, tile_hi)

    acc, m_i, l_i = _attend_range(
        q, q_pe, k_cache_ptr, v_cache_ptr, block_tables_ptr + row.to(tl.int64) * stride_bt, kv_head,
        q_pos, q_lim, q_ok, seq_len, qk_scale, tile_lo, tile_hi, context_len + q_tile * BLOCK_Q,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, softcap_log2,
        BLOCK_M, BLOCK_SIZE, TILE_N, HEAD_DIM, SLIDING_WINDOW, DOT_PRECISION, PRECISE_PV, INTERPRETED,
        SOFTCAP, ROPE_DIM, V_FROM_K)

    # A query that saw no key: zeros and lse -inf, never 0/0.
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    if SCALE_V:  # an FP8 cache's V codes stand for code * v_scale (split partials too: they combine linearly)
        out = out * v_scale
    lse2 = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    out_rows = out_ptr + token * stride_ot + head * stride_oh  # [BLOCK_M]
    lse_rows = lse_ptr + token * stride_lse_t + head
    sink_rows = sinks_ptr + head  # [BLOCK_M]: each packed row its own query head's sink
    if SPLIT_KV:
        if used_splits == 1:
            _store_out(out_rows, lse_rows, sink_rows, out, lse2, q_ok, HEAD_DIM, STORE_LSE, HAS_SINKS)
        else:
            split_rows = split_out_ptr + token * stride_so_t + head * stride_so_h  # [BLOCK_M], at split 0
            split_lses = split_lse_ptr + token * stride_sl_t + head * stride_sl_h
            tl.store(split_rows[:, None] + split * HEAD_DIM + offs_d[None, :], out, mask=q_ok[:, None])
            tl.store(split_lses + split, lse2, mask=q_ok)
            # Every thread's stores precede the count: the barrier orders them within the program, the
            # release half of the gpu-scope atomic publishes them to the program that arrives last.
            tl.debug_barrier()
            counter = split_counters_ptr + tile_idx * stride_counter + kv_head
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == used_splits - 1:
                # The acquire half makes the other splits' partials visible; the barrier orders every
                # thread's loads after it.
                tl.debug_barrier()
                final, final_lse = _combine_splits(used_splits, split_rows, split_lses, q_ok, BLOCK_M,
                                                   HEAD_DIM, INTERPRETED)
                _store_out(out_rows, lse_rows, sink_rows, final, final_lse, q_ok, HEAD_DIM, STORE_LSE,
                           HAS_SINKS)
                tl.store(counter, 0)  # every split has counted in: ready for the next launch
    else:
        _store_out(out_rows, lse_rows, sink_rows, out, lse2, q_ok, HEAD_DIM, STORE_LSE, HAS_SINKS)


@triton.jit
def _store_out(out_rows, lse_rows, sink_rows, out, lse2, q_ok, HEAD_DIM: tl.constexpr,
               STORE_LSE: tl.constexpr, HAS_SINKS: tl.constexpr):
    """A query tile's final (out [BLOCK_M, D], lse2 [BLOCK_M], log2 domain) over its keys: with HAS_SINKS,
    first joined by the sink of each row's head (at ``sink_rows``); then out stored in out's dtype at row
    pointers ``out_rows`` and, if asked, lse2 as a natural log. Only final outputs come here, never a
    split's partial: that is what counts each sink once."""
    if HAS_SINKS:
        sink2 = tl.load(sink_rows, mask=q_ok, other=float("-inf")).to(tl.float32) * _LOG2E  # [BLOCK_M]
        out, lse2 = _with_sink(out, lse2, sink2)
    offs_d = tl.arange(0, HEAD_DIM)
    tl.store(out_rows[:, None] + offs_d[None, :], out.to(out_rows.dtype.element_ty), mask=q_ok[:, None])
    if STORE_LSE:
        tl.store(lse_rows, lse2 * _LN2, mask=q_ok)


@triton.jit
def _with_sink(out, lse2, sink2):
    """Normalised attention (out [BLOCK_M, D], lse2 [BLOCK_M]) joined by one more key of score sink2 (log2
    units) and value zero: out scaled by its keys' share of the new total, lse2 = log2(2^lse2 + 2^sink2).
    A row that saw no key (lse2 -inf, out 0) gets out 0 and lse2 = sink2; with neither, lse2 stays -inf."""
    top = tl.maximum(lse2, sink2)
    top = tl.where(top == float("-inf"), 0.0, top)  # never -inf - -inf
    keys = tl.exp2(lse2 - top)
    total = keys + tl.exp2(sink2 - top)
    seen = total > 0
    share = keys / tl.where(seen, total, 1.0)
    lse2 = tl.where(seen, top + tl.log2(tl.where(seen, total, 1.0)), float("-inf"))
    return out * share[:, None], lse2


@triton.jit
def _combine_split(acc, m_i, l_i, s, split_rows, split_lses, q_ok, HEAD_DIM: tl.constexpr):
    """Fold split ``s``'s partial into the running (acc, m, l) of ``_combine_splits``."""
    offs_d = tl.arange(0, HEAD_DIM)
    # Straight from L2 (.cg): other multiprocessors stored these, and this one's L1 may hold stale
    # lines of the same scratch from an earlier layer.
    lse_s = tl.load(split_lses + s, mask=q_ok, other=float("-inf"), cache_modifier=".cg")
    part = tl.load(split_rows[:, None] + s * HEAD_DIM + offs_d[None, :], mask=q_ok[:, None], other=0.0,
                   cache_modifier=".cg")
    m_new = tl.maximum(m_i, lse_s)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    weight = tl.exp2(lse_s - m_safe)  # exactly 0 for a row this split did not see
    acc = acc * alpha[:, None] + part * weight[:, None]
    l_i = l_i * alpha + weight
    return acc, m_new, l_i


@triton.jit
def _combine_splits(used_splits, split_rows, split_lses, q_ok, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
                    INTERPRETED: tl.constexpr):
    """The query tile's partials (split s at ``split_rows + s * HEAD_DIM``, its LSE at ``split_lses + s``)
    merged by their LSEs (log2 domain): (out [BLOCK_M, D], lse2 [BLOCK_M]). A row no split saw gets zeros
    and lse -inf, never NaN."""
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # weights relative to m_i
    if INTERPRETED:  # tensor bounds in range() fail in Triton 3.6's interpreter (see _attend_tiles)
        s = 0
        while s < used_splits:
            acc, m_i, l_i = _combine_split(acc, m_i, l_i, s, split_rows, split_lses, q_ok, HEAD_DIM)
            s += 1
    else:
        # A for loop, so the partials' loads are pipelined rather than one L2 round trip after another.
        for s in range(0, used_splits):
            acc, m_i, l_i = _combine_split(acc, m_i, l_i, s, split_rows, split_lses, q_ok, HEAD_DIM)
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse2 = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    return out, lse2


# ---- Entry point ----------------------------------------------------------------------------------------


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
    max_query_len: int, max_seq_len: int, sliding_window: int = 0, lse: torch.Tensor | None = None,
    plan: PagedAttentionPlan | None = None, num_kv_splits: int | None = None, metadata_ready: bool = False,
    k_scale: float = 1.0, v_scale: float = 1.0, softcap: float = 0.0, sinks: torch.Tensor | None = None,
    key_limits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of every query token of a mixed batch over its row's paged K/V; writes and returns out.

    q, out: [T, Hq, D] (last dim contiguous; out in q's dtype, or fp32 to keep the result unrounded);
    k_cache, v_cache: [num_blocks, block_size, Hkv, D], in q's dtype or FP8 codes standing for code * k_scale
    (v_scale): plait.attention.fp8_kv;
    MLA (DeepSeek's absorbed attention): q and k_cache are wider than v_cache and out by a rope part, D + R
    (SUPPORTED_ROPE_DIMS): a score is q's first D columns against K's plus q's last R against K's. v_cache
    may be a view of k_cache's first D columns (the latent row): its tile is then the K tile already read.
    query_start_loc: [R + 1] int32; seq_lens: [R] int32 (cached context + this step's tokens);
    block_tables: [R, max_blocks] int32; max_query_len / max_seq_len: host-side upper bounds;
    sliding_window: 0 for none, else key p is visible to query position i iff i - W < p <= i;
    softcap: 0 for none, else c: each scaled score s becomes c * tanh(s / c) (Gemma 2);
    sinks: optional [Hq] (fp32 or q's dtype, on q's device): gpt-oss's per-head sink logits, in natural
    units like the scaled (and capped) scores, never scaled or capped themselves: every query sees one more
    key of score sinks[h] and value zero (AttentionBackend.attend);
    key_limits: optional [T] int (on q's device): query t sees keys up to position key_limits[t] (>= its own,
    < its row's seq_len) instead of its own; the window still counts back from its own position;
    lse: optional [T, Hq] fp32 output (natural log, -inf where a query saw no key and no sink).
    plan: from ``plan_paged_attention`` (built here when None); num_kv_splits: override the split
    count when no plan is given (1: never split). metadata_ready: query_start_loc and seq_lens were
    written before the kernel launched just before this one, so under PDL they are read while that
    kernel drains (a step's staged metadata is; a tensor made by the previous kernel is not).
    Never synchronises with the device.
    """
    num_tokens, num_heads, q_width = q.shape
    head_dim = v_cache.shape[3]  # V's width, the output's; q and K may be wider by a rope part (MLA)
    rope_dim = q_width - head_dim
    num_kv_heads = k_cache.shape[2]
    num_rows = seq_lens.shape[0]
    if num_tokens == 0:
        return out
    _check_attention_args(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, lse)
    v_from_k = (v_cache.data_ptr() == k_cache.data_ptr() and v_cache.dtype == k_cache.dtype
                and v_cache.stride()[:3] == k_cache.stride()[:3])
    _check_sinks(sinks, q)
    if plan is None:
        plan = plan_paged_attention(num_tokens, num_rows, num_heads, num_kv_heads, head_dim, q.dtype,
                                    max_query_len, max_seq_len, q.device, num_kv_splits,
                                    cache_dtype=k_cache.dtype)
    cfg = plan.config
    common = dict(
        GROUP=num_heads // num_kv_heads, BLOCK_M=cfg.block_m, TILE_N=cfg.tile_n, HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1], SLIDING_WINDOW=sliding_window,
        # fp32 (tests, debugging) must not silently drop to tf32; 16-bit inputs keep Triton's default.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
        PRECISE_PV=_uses_precise_pv(q.dtype, max_query_len),
        INTERPRETED=bool(triton.knobs.runtime.interpret),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(q),
    )
    cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                     v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0))
    qk_scale = scale * LOG2E * k_scale
    softcap_log2 = 1.0  # never read without SOFTCAP
    if softcap:  # tanh takes the score in natural units, over the cap; the kernel brings it to log2 units
        qk_scale, softcap_log2 = scale * k_scale / softcap, softcap * LOG2E
    lse_arg = lse if lse is not None else out  # never written when STORE_LSE is off
    sinks_arg = sinks if sinks is not None else out  # never read when HAS_SINKS is off
    if key_limits is not None and (key_limits.shape[0] < num_tokens or key_limits.dim() != 1
                                   or key_limits.device != q.device):
        raise ValueError(f"key_limits must be [>= T] = [>= {num_tokens}] on {q.device}, got "
                         f"{tuple(key_limits.shape)} on {key_limits.device}")
    key_limits_arg = key_limits if key_limits is not None else seq_lens  # never read without HAS_KEY_LIMITS
    one_token_rows = max_query_len <= 1
    num_tiles = num_rows if one_token_rows else num_tokens // cfg.block_q + num_rows
    heads_fastest = cfg.heads_fastest and num_tiles <= MAX_GRID_Y
    grid = (num_kv_heads, num_tiles) if heads_fastest else (num_tiles, num_kv_heads)
    split_kv = cfg.num_splits > 1
    if split_kv:
        split_out, split_lse, counters = plan.split_out, plan.split_lse, plan.split_counters
        if (split_out is None or counters is None or split_out.shape[0] < num_tokens
                or split_out.shape[1:] != (num_heads, cfg.num_splits, head_dim)
                or counters.shape[0] < num_tiles or counters.shape[1] != num_kv_heads):
            raise ValueError("plan scratch does not fit this call; plan with the same shapes")
        grid = (*grid, cfg.num_splits)
    else:
        split_out = split_lse = counters = out  # never touched without SPLIT_KV
    _paged_attention_kernel[grid](
        out, lse_arg, split_out, split_lse, counters, q, k_cache, v_cache, query_start_loc, seq_lens,
        block_tables, sinks_arg, key_limits_arg, qk_scale, v_scale, softcap_log2, num_rows, q.stride(0),
        q.stride(1), out.stride(0), out.stride(1),
        lse_arg.stride(0), split_out.stride(0), split_out.stride(1), split_lse.stride(0), split_lse.stride(1),
        counters.stride(0), *cache_strides, cfg.num_splits, BLOCK_Q=cfg.block_q, STORE_LSE=lse is not None,
        SPLIT_KV=split_kv, MIN_SPLIT_TILES=cfg.min_split_tiles, HEADS_FASTEST=heads_fastest,
        ONE_TOKEN_ROWS=one_token_rows, METADATA_READY=metadata_ready, SCALE_V=v_scale != 1.0,
        FP16_DOTS=k_cache.dtype == FP8_DTYPE and q.dtype == torch.bfloat16, SOFTCAP=softcap > 0,
        HAS_SINKS=sinks is not None, HAS_KEY_LIMITS=key_limits is not None, ROPE_DIM=rope_dim,
        V_FROM_K=v_from_k, **common)
    return out


def mla_cache_views(latent_cache: torch.Tensor, num_heads: int, value_width: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """paged_attention's (k_cache, v_cache) over MLA's one-head latent cache [num_blocks, block_size, 1, W]:
    K the rows whole, V their first ``value_width`` columns, both as Hq / MLA_HEADS_PER_PROGRAM "kv heads"
    that are stride-0 views of the one latent head. The kernel packs a kv head's GROUP query heads per
    program, so each program holds MLA_HEADS_PER_PROGRAM (or, where they do not divide Hq, all) heads'
    512-wide accumulators, whatever Hq is (128 in DeepSeek-V3). No copy."""
    per_program = MLA_HEADS_PER_PROGRAM if num_heads % MLA_HEADS_PER_PROGRAM == 0 else num_heads
    k = latent_cache.expand(-1, -1, num_heads // per_program, -1)  # [blocks, bs, Hq / per_program, W]
    return k, k[..., :value_width]


def _check_attention_args(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
    lse: torch.Tensor | None,
) -> None:
    """Shape / layout checks on metadata only (no device reads)."""
    num_tokens, num_heads, q_width = q.shape
    head_dim = v_cache.shape[3]
    rope_dim = q_width - head_dim
    if (out.shape != (num_tokens, num_heads, head_dim) or k_cache.shape[:3] != v_cache.shape[:3]
            or k_cache.shape[3] != q_width or (rope_dim and rope_dim not in SUPPORTED_ROPE_DIMS)):
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, out {tuple(out.shape)}, "
                         f"k cache {tuple(k_cache.shape)}, v cache {tuple(v_cache.shape)} (q and K may be "
                         f"wider than V and out by a rope part of {SUPPORTED_ROPE_DIMS})")
    if num_heads % k_cache.shape[2]:
        raise ValueError(f"{num_heads} query heads do not group over {k_cache.shape[2]} kv heads")
    if q.stride(2) != 1 or out.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("q, out and the caches need a contiguous last (head_dim) dimension")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (q.dtype, FP8_DTYPE):
        raise ValueError(f"the cache ({k_cache.dtype}, {v_cache.dtype}) must be in q's dtype ({q.dtype}) "
                         "or FP8")
    num_rows = seq_lens.shape[0]
    if query_start_loc.shape != (num_rows + 1,) or block_tables.shape[0] != num_rows:
        raise ValueError("query_start_loc must be [R + 1] and block_tables [R, max_blocks]")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    if lse is not None and (lse.shape != (num_tokens, num_heads) or lse.dtype != torch.float32
                            or lse.stride(1) != 1):
        raise ValueError("lse must be a [T, Hq] float32 tensor with contiguous heads")


def _check_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> None:
    """The kernel reads sinks[h] at ``sinks_ptr + h``: one value per query head, contiguous, beside q."""
    if sinks is None:
        return
    if sinks.shape != (q.shape[1],) or sinks.stride(0) != 1 or sinks.device != q.device:
        raise ValueError(f"sinks must be a contiguous [Hq] = [{q.shape[1]}] tensor on {q.device}, "
                         f"got {tuple(sinks.shape)} on {sinks.device}")
    if sinks.dtype not in (torch.float32, q.dtype):
        raise ValueError(f"sinks must be float32 or q's dtype ({q.dtype}), got {sinks.dtype}")


# ---- Torch reference ----------------------------------------------------------------------------------


def paged_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, sliding_window: int = 0,
    k_scale: float = 1.0, v_scale: float = 1.0, softcap: float = 0.0, sinks: torch.Tensor | None = None,
    key_limits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same attention through ``plait.attention.torch_ref`` (fp32 math; reads tensors on the host).

    Returns (out [T, Hq, Dv] in q's dtype, lse [T, Hq] fp32)."""
    from plait.attention.fp8_kv import KVScales
    from plait.attention.torch_ref import TorchRefBackend
    from plait.runner.forward_batch import ForwardBatch

    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    query_lens = [b - a for a, b in zip(qsl[:-1], qsl[1:])]
    device = q.device
    as_int = dict(dtype=torch.int32, device=device)
    batch = ForwardBatch(
        input_ids=torch.zeros(q.shape[0], dtype=torch.int64, device=device),
        positions=torch.tensor([s - n + i for s, n in zip(lens, query_lens) for i in range(n)],
                               dtype=torch.int64, device=device),
        query_start_loc=query_start_loc.to(**as_int),
        context_lens=torch.tensor([s - n for s, n in zip(lens, query_lens)], **as_int),
        seq_lens=seq_lens.to(**as_int),
        is_first_chunk=torch.tensor([s == n for s, n in zip(lens, query_lens)], device=device),
        state_slots=torch.zeros(len(lens), dtype=torch.int64, device=device),
        block_tables=block_tables.to(**as_int),
        slot_mapping=torch.zeros(q.shape[0], dtype=torch.int64, device=device),
        sample_indices=torch.zeros(0, dtype=torch.int64, device=device),
        sample_rows=[],
        num_rows=len(lens),
        num_tokens=q.shape[0],
        query_start_loc_cpu=qsl,
        seq_lens_cpu=lens,
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(lens, default=0),
        key_limits=None if key_limits is None else key_limits.long(),
    )
    # K and V apart: MLA's are of different widths (V a view of K's leading columns)
    return TorchRefBackend()._attend(q, k_cache, v_cache, batch, scale, sliding_window or None,
                                     KVScales(k_scale, v_scale), softcap or None, sinks=sinks)
