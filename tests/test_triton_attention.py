"""Triton paged_attention (unified kernel and split-KV) and the triton backend against torch_ref.

Without CUDA these run in the Triton interpreter on tiny shapes (fp32, fp16); the ``gpu`` tests sweep
real shapes in bf16/fp16 on CUDA and capture the kernel in a CUDA graph.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")

from plait.attention.base import get_backend  # noqa: E402
from plait.attention.fp8_kv import UNIT_SCALES, KVScales, to_cache  # noqa: E402
from plait.attention.torch_ref import TorchRefBackend  # noqa: E402
from plait.config import EngineConfig  # noqa: E402
from plait.engine.kv_cache import PAD_BLOCK_ID, KVCacheManager, cdiv  # noqa: E402
from plait.engine.request import Request  # noqa: E402
from plait.engine.scheduler import Scheduler  # noqa: E402
from plait.kernels.paged_attention import (  # noqa: E402
    MAX_KV_SPLITS,
    MAX_SPLIT_SCRATCH_BYTES,
    PREFILL_MIN_SPLIT_TILES,
    SPLIT_NUM_STAGES,
    choose_num_splits,
    launch_config,
    paged_attention,
    paged_attention_ref,
    plan_paged_attention,
    precise_pv_mode,
    set_precise_pv,
)
from plait.layers.fp8 import FP8_DTYPE  # noqa: E402
from plait.runner.forward_batch import build_forward_batch  # noqa: E402
from plait.sampling_params import SamplingParams  # noqa: E402

CPU = torch.device("cpu")
HAS_CUDA = torch.cuda.is_available()
# A row padded into a captured batch: one query token, seq_len 1, every table entry the pad block.
PAD_ROW = "pad"


@dataclass
class PagedBatch:
    """Tensors of one paged_attention call, the cache with only live slots set, and a NaN-poisoned twin."""

    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D], junk slots hold finite noise
    v_cache: torch.Tensor
    k_poisoned: torch.Tensor  # the same with every slot no row may read set to NaN
    v_poisoned: torch.Tensor
    query_start_loc: torch.Tensor  # [R + 1] int32
    seq_lens: torch.Tensor  # [R] int32
    block_tables: torch.Tensor  # [R, max_blocks] int32
    max_query_len: int
    max_seq_len: int


def make_batch(specs, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
               device: torch.device, seed: int, spare_blocks: int = 3, table_slack: int = 1) -> PagedBatch:
    """specs: (context_len, query_len) per row, or PAD_ROW. Blocks are shuffled over the pool (block 0 is
    the pad block, never handed out); tables have ``table_slack`` extra PAD columns."""
    g = torch.Generator().manual_seed(seed)
    rows = [(0, 1) if s == PAD_ROW else s for s in specs]
    blocks_per_row = [0 if s == PAD_ROW else cdiv(c + n, block_size) for s, (c, n) in zip(specs, rows)]
    num_blocks = 1 + sum(blocks_per_row) + spare_blocks
    pool = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    width = max(max(blocks_per_row), 1) + table_slack
    tables = []
    for k in blocks_per_row:
        tables.append(pool[:k] + [PAD_BLOCK_ID] * (width - k))
        pool = pool[k:]
    block_tables = torch.tensor(tables, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    live = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for (c, n), table in zip(rows, tables):
        pos = torch.arange(c + n)
        live[torch.tensor(table)[pos // block_size] * block_size + pos % block_size] = True
    k_poisoned, v_poisoned = k_cache.clone(), v_cache.clone()
    k_poisoned.view(-1, num_kv_heads, head_dim)[~live] = float("nan")
    v_poisoned.view(-1, num_kv_heads, head_dim)[~live] = float("nan")
    query_lens = [n for _, n in rows]
    qsl = torch.zeros(len(rows) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens).cumsum(0)
    q = torch.randn(int(qsl[-1]), num_heads, head_dim, generator=g).to(dtype)
    seq_lens = torch.tensor([c + n for c, n in rows], dtype=torch.int32)
    tensors = (q, k_cache, v_cache, k_poisoned, v_poisoned, qsl, seq_lens, block_tables)
    return PagedBatch(*(t.to(device) for t in tensors), max(query_lens), max(c + n for c, n in rows))


def run_kernel(b: PagedBatch, scale: float, window: int = 0, num_kv_splits: int | None = None,
               tile_n: int | None = None, block_m: int | None = None, query_len_slack: int = 0,
               seq_len_slack: int = 0, out_dtype: torch.dtype | None = None, softcap: float = 0.0,
               sinks: torch.Tensor | None = None, kv_scales: KVScales = UNIT_SCALES,
               key_limits: torch.Tensor | None = None):
    """paged_attention on the poisoned cache into NaN-filled out / lse, with upper-bound maxima."""
    out = torch.full_like(b.q, float("nan"), dtype=out_dtype or b.q.dtype)
    lse = torch.full(b.q.shape[:2], float("nan"), device=b.q.device)
    max_q, max_s = b.max_query_len + query_len_slack, b.max_seq_len + seq_len_slack
    (num_tokens, num_heads, head_dim), num_rows = b.q.shape, b.seq_lens.shape[0]
    plan = plan_paged_attention(num_tokens, num_rows, num_heads, b.k_cache.shape[2], head_dim, b.q.dtype,
                                max_q, max_s, b.q.device, num_kv_splits, tile_n, block_m,
                                cache_dtype=b.k_cache.dtype)
    result = paged_attention(b.q, b.k_poisoned, b.v_poisoned, out, b.query_start_loc, b.seq_lens,
                             b.block_tables, scale, max_q, max_s, window, lse, plan=plan, softcap=softcap,
                             sinks=sinks, k_scale=kv_scales.k, v_scale=kv_scales.v, key_limits=key_limits)
    assert result is out
    return out, lse, plan


def reference(b: PagedBatch, scale: float, window: int = 0, softcap: float = 0.0,
              sinks: torch.Tensor | None = None, kv_scales: KVScales = UNIT_SCALES,
              key_limits: torch.Tensor | None = None):
    """torch_ref in fp32 over the clean cache (its masked products would turn the poison into NaN); FP8
    codes go as they are, for torch_ref to scale."""
    k_cache, v_cache = (c if c.dtype == FP8_DTYPE else c.float() for c in (b.k_cache, b.v_cache))
    return paged_attention_ref(b.q.float(), k_cache, v_cache, b.query_start_loc, b.seq_lens, b.block_tables,
                               scale, window, kv_scales.k, kv_scales.v, softcap=softcap, sinks=sinks,
                               key_limits=key_limits)


def assert_matches(out, lse, ref_out, ref_lse, atol: float, rtol: float = 0.0):
    assert torch.isfinite(out).all() and not torch.isnan(lse).any(), "an output element was never written"
    torch.testing.assert_close(out.float(), ref_out, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse, ref_lse, atol=atol, rtol=rtol)


# Every kind of row in one batch (block_size 4): first chunks, a chunk with context crossing block
# boundaries, decodes, a 1-token prompt, rows with no tokens this step, a chunk spanning several
# 16-row query tiles, and a padded graph row.
MIXED = [(0, 5), (7, 4), (9, 1), (0, 1), (3, 1), (5, 0), (2, 23), (0, 0), (37, 1), PAD_ROW]
ATOL = {torch.float32: 2e-5, torch.float16: 3e-3}


@pytest.mark.parametrize(("dtype", "heads"), [
    (torch.float32, (2, 2)), (torch.float32, (4, 2)), (torch.float32, (6, 2)), (torch.float16, (4, 2)),
], ids=["fp32-group1", "fp32-group2", "fp32-group3", "fp16-group2"])
def test_mixed_batch_matches_torch_ref(dtype, heads):
    b = make_batch(MIXED, 4, *heads, 32, dtype, CPU, seed=sum(heads))
    out, lse, plan = run_kernel(b, 0.3, tile_n=16, block_m=16, query_len_slack=3, seq_len_slack=9)
    assert plan.config.num_splits == 1 and plan.config.block_q < 23  # the long chunk spans query tiles
    assert_matches(out, lse, *reference(b, 0.3), ATOL[dtype])


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """The same [num_blocks, block_size, Hkv, D] values stored head-major, as the runner stores them."""
    return cache.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("splits", [1, 3])
def test_head_major_cache_matches_torch_ref(splits):
    # The runner's cache layout ([blocks, Hkv, block_size, D] storage): the kernels go by strides alone.
    specs = MIXED if splits == 1 else [(9, 1), (0, 1), (37, 1), (3, 1)]
    b = make_batch(specs, 4, 4, 2, 32, torch.float32, CPU, seed=11)
    b.k_poisoned, b.v_poisoned = head_major(b.k_poisoned), head_major(b.v_poisoned)
    assert b.k_poisoned.stride(1) == 32 and b.k_poisoned.stride(2) == 4 * 32
    out, lse, plan = run_kernel(b, 0.3, num_kv_splits=splits, tile_n=16, block_m=16)
    assert plan.config.num_splits == splits
    assert_matches(out, lse, *reference(b, 0.3), ATOL[torch.float32])


@pytest.mark.parametrize("window", [1, 6])
def test_sliding_window_matches_torch_ref(window):
    b = make_batch(MIXED, 4, 4, 2, 32, torch.float32, CPU, seed=window)
    out, lse, _ = run_kernel(b, 0.25, window, tile_n=16, block_m=16)
    assert_matches(out, lse, *reference(b, 0.25, window), ATOL[torch.float32])


@pytest.mark.parametrize(("splits", "window"), [(1, 0), (3, 0), (1, 6)])
def test_logit_softcap_matches_torch_ref(splits, window):
    """Gemma 2's soft-capped scores (c * tanh(s / c)) on mixed rows, split and windowed; the scale makes
    scores large enough that the cap changes the answer."""
    specs = MIXED if splits == 1 else DECODES
    b = make_batch(specs, 4, 4, 2, 32, torch.float32, CPU, seed=20 + splits + window)
    out, lse, plan = run_kernel(b, 1.5, window, num_kv_splits=splits, tile_n=16, block_m=16, softcap=5.0)
    assert plan.config.num_splits == splits
    assert_matches(out, lse, *reference(b, 1.5, window, softcap=5.0), ATOL[torch.float32])
    uncapped, _ = reference(b, 1.5, window)
    assert (uncapped - out.float()).abs().max() > 0.1


def test_default_tiles_and_block_size_one():
    """The config chosen for fp32 (no tile override); block_size 1 makes every key its own block."""
    b = make_batch([(0, 3), (6, 20), (40, 1), (2, 1)], 1, 4, 2, 64, torch.float32, CPU, seed=5)
    out, lse, plan = run_kernel(b, 0.125)
    assert plan.config.tile_n == 32 and plan.config.block_m == 64
    assert_matches(out, lse, *reference(b, 0.125), ATOL[torch.float32])


# Decode-only: rows of different lengths, one shorter than a tile, a row without a token, a pad row.
DECODES = [(9, 1), (0, 1), (30, 1), (5, 0), (61, 1), PAD_ROW]


@pytest.mark.parametrize(("dtype", "heads", "splits", "window"), [
    (torch.float32, (6, 2), 2, 0),
    (torch.float32, (2, 1), 6, 0),  # more splits than most rows have tiles: empty splits
    (torch.float32, (4, 2), 3, 7),
    (torch.float16, (6, 2), 4, 0),
])
def test_split_kv_matches_torch_ref(dtype, heads, splits, window):
    b = make_batch(DECODES, 4, *heads, 32, dtype, CPU, seed=splits + window)
    out, lse, plan = run_kernel(b, 0.3, window, num_kv_splits=splits, tile_n=16, seq_len_slack=100)
    assert plan.config.num_splits == splits and plan.split_out.shape == (b.q.shape[0], heads[0], splits, 32)
    assert_matches(out, lse, *reference(b, 0.3, window), ATOL[dtype])


@pytest.fixture
def precise_pv_switch():
    """set_precise_pv for one test; the module's setting is restored after it."""
    before = precise_pv_mode()
    yield set_precise_pv
    set_precise_pv(before)


def unrounded_reference(b: PagedBatch, scale: float, window: int = 0) -> torch.Tensor:
    """torch_ref's fp32 output before any rounding to the inputs' dtype."""
    return paged_attention_ref(b.q.float(), b.k_cache.float(), b.v_cache.float(), b.query_start_loc,
                               b.seq_lens, b.block_tables, scale, window)[0]


@pytest.mark.parametrize("splits", [1, 3])
def test_precise_pv_tracks_fp32_reference(precise_pv_switch, splits):
    """fp16 inputs, fp32 out (the kernel's result before its final rounding): with P split into two fp16
    terms the error is fp32 summation noise (~1e-7 here); P rounded once to fp16 costs ~3e-5 on average.
    The bounds leave ~10x margin on both sides."""
    specs = MIXED if splits == 1 else DECODES
    b = make_batch(specs, 4, 4, 2, 32, torch.float16, CPU, seed=splits)
    ref = unrounded_reference(b, 0.3)
    errors, agree = {}, {}
    # "decode" splits P in decode-only launches alone: the decode batch (run with splits) is precise under
    # it, the mixed batch is not.
    decode_only = splits > 1
    modes = [(True, "all"), (False, "off"), (decode_only, "decode")]
    for precise, mode in modes:
        precise_pv_switch(mode)
        out, _, plan = run_kernel(b, 0.3, num_kv_splits=splits, tile_n=16, block_m=16,
                                  out_dtype=torch.float32)
        assert plan.config.num_splits == splits
        errors[precise] = (out - ref).abs()
        agree[precise] = (out.half() == ref.half()).float().mean()
    assert errors[True].max() < 1e-5
    assert errors[False].mean() > 10 * errors[True].mean()
    # Rounded to fp16, the precise output is the reference's rounding almost everywhere.
    assert agree[True] > 0.98 and agree[False] < 0.95


# Prompt chunks beside decodes over contexts crossing many 16-key tiles (block_size 4): an empty context, a
# 1-token chunk, chunks crossing block boundaries, a chunk spanning several query tiles, a row without
# tokens and a padded graph row.
PREFILL_SPLIT_ROWS = [(61, 1), (0, 9), (45, 1), (38, 7), (0, 1), (5, 0), (13, 22), (70, 3), PAD_ROW]


@pytest.mark.parametrize(("dtype", "heads", "splits", "window"), [
    (torch.float32, (2, 2), 2, 0),
    (torch.float32, (4, 2), 3, 0),
    (torch.float32, (8, 2), 5, 0),
    (torch.float32, (4, 2), 9, 0),  # more splits than any query tile has K/V tiles: empty splits
    (torch.float32, (4, 2), 3, 20),
    (torch.float32, (2, 2), 4, 1),
    (torch.float16, (8, 2), 3, 0),
], ids=["group1", "group2", "group4", "more-splits-than-tiles", "window20", "window1", "fp16-group4"])
def test_prefill_split_kv_matches_torch_ref(dtype, heads, splits, window):
    b = make_batch(PREFILL_SPLIT_ROWS, 4, *heads, 32, dtype, CPU, seed=splits + window)
    out, lse, plan = run_kernel(b, 0.3, window, num_kv_splits=splits, tile_n=16, block_m=16,
                                query_len_slack=5, seq_len_slack=40)
    assert plan.config.num_splits == splits and plan.config.block_q < 22  # the long chunk spans query tiles
    assert plan.split_out.shape == (b.q.shape[0], heads[0], splits, 32)
    assert_matches(out, lse, *reference(b, 0.3, window), ATOL[dtype])


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_fused_reduce_resets_its_counters(kind):
    """The last split of a query tile combines the partials and zeroes the tile's counter, so the same
    plan serves the next layer (and the next graph replay) unchanged: counters are zero after every
    call, a second call gives the same bits, and no partial of an earlier call is read (scratch is
    poisoned with NaN in between)."""
    specs = DECODES if kind == "decode" else PREFILL_SPLIT_ROWS
    b = make_batch(specs, 4, 4, 2, 32, torch.float32, CPU, seed=12)
    out, lse, plan = run_kernel(b, 0.3, num_kv_splits=3, tile_n=16, block_m=16, seq_len_slack=30)
    counters = plan.split_counters
    num_tiles = b.q.shape[0] // plan.config.block_q + b.seq_lens.shape[0]
    assert counters.shape == (num_tiles, 2) and counters.dtype == torch.int32
    assert not counters.any()
    assert_matches(out, lse, *reference(b, 0.3), ATOL[torch.float32])
    plan.split_out.fill_(float("nan"))
    plan.split_lse.fill_(float("nan"))
    again = torch.full_like(out, float("nan"))
    again_lse = torch.full_like(lse, float("nan"))
    paged_attention(b.q, b.k_poisoned, b.v_poisoned, again, b.query_start_loc, b.seq_lens, b.block_tables,
                    0.3, b.max_query_len, b.max_seq_len + 30, lse=again_lse, plan=plan)
    assert torch.equal(again, out) and torch.equal(again_lse, lse)
    assert not counters.any()


def test_prefill_split_heuristic_balances_on_the_device():
    """The heuristic split count is an upper bound from host ints (max_seq_len as a graph would pass it:
    far past the real contexts); on the device every query tile takes at most one split per
    PREFILL_MIN_SPLIT_TILES of its own K/V tiles, so short rows stay whole and long ones split."""
    specs = [(150, 4), (3, 2), (0, 1), (90, 3)]
    b = make_batch(specs, 4, 2, 1, 32, torch.float32, CPU, seed=3)
    out, lse, plan = run_kernel(b, 0.3, tile_n=16, block_m=16, query_len_slack=60, seq_len_slack=500)
    # 10 tokens fill at least 2 query tiles of 8 tokens: 2 programs, wanted CPU_NUM_SMS // 2 = 4.
    assert plan.config.num_splits == 4 and plan.config.min_split_tiles == PREFILL_MIN_SPLIT_TILES
    assert_matches(out, lse, *reference(b, 0.3), ATOL[torch.float32])


def test_split_count_heuristic():
    sms = 132
    # Enough programs to fill the GPU, or contexts too short to split: no split.
    assert choose_num_splits(256, 8, 32768, 64, sms) == 1
    assert choose_num_splits(1, 8, 64, 64, sms) == 1
    # One long row: as many splits as fill the GPU, within the cap and the keys-per-split floor
    # (one 64-key tile: a short context spreads over one tile per split).
    n = choose_num_splits(1, 8, 32768, 64, sms)
    assert 8 * n >= sms and n <= MAX_KV_SPLITS
    assert choose_num_splits(1, 8, 200, 64, sms) == 4
    assert choose_num_splits(1, 8, 1024, 64, sms) == 16
    # Decided from host ints only.
    plan = plan_paged_attention(1, 1, 16, 8, 128, torch.bfloat16, 1, 32768, CPU)
    assert plan.config.num_splits > 1 and plan.split_out.shape == (1, 16, plan.config.num_splits, 128)


def test_mla_decode_splits_less():
    """MLA's latent width (512): one program a multiprocessor and 256 keys a split, since the last split
    combines every 16-head partial alone (DECODE_SPLIT_KNOBS); two stages. Other widths keep theirs."""
    sms = 132
    assert [choose_num_splits(1, 1, n, 32, sms, head_dim=512) for n in (640, 1024, 4096)] == [3, 4, 16]
    assert choose_num_splits(64, 1, 1024, 32, sms, head_dim=512) == 3  # 64 programs: ~1 an SM with 3
    assert choose_num_splits(1, 1, 640, 32, sms, head_dim=128) == 10
    config = launch_config(512, 16, torch.bfloat16, 1, 1, 1, 640, sms)
    assert (config.num_splits, config.min_split_tiles, config.num_stages) == (3, 8, 2)
    config = launch_config(128, 4, torch.bfloat16, 1, 1, 8, 640, sms)
    assert (config.min_split_tiles, config.num_stages) == (1, SPLIT_NUM_STAGES)


def test_prefill_split_count_heuristic():
    """Llama-8B shapes (32 q heads, 8 kv heads, D 128) on 132 SMs."""
    sms, scratch = 132, 32 * 129 * 4  # bytes of partials per token and split

    def splits(num_tokens: int, max_seq_len: int, num_rows: int = 1) -> int:
        block_q = 128 // 4  # BLOCK_M 128 over the group of 4
        return choose_num_splits(num_rows, 8, max_seq_len, 64, sms, num_tokens=num_tokens,
                                 max_query_len=min(num_tokens, 256), block_q=block_q,
                                 scratch_bytes_per_split=num_tokens * scratch)

    # A 256-token chunk: 8 query tiles x 8 kv heads = 64 programs; 2 splits make 128, one wave.
    assert splits(256, 2048 + 256) == 2
    assert splits(256, 8192, num_rows=200) == 2  # a graph: max_model_len, padded rows
    # A 2048-token chunk fills the GPU alone; a short context gives no split PREFILL_MIN_SPLIT_TILES tiles.
    assert splits(2048, 4096) == 1
    assert splits(256, 256) == 1
    assert splits(32, 1 << 17) == sms // 8  # one query tile: 16 splits
    # The partials stay within MAX_SPLIT_SCRATCH_BYTES (with these shapes they need ~17 MB at most).
    assert choose_num_splits(1, 8, 1 << 17, 64, sms, num_tokens=32, max_query_len=32, block_q=32,
                             scratch_bytes_per_split=MAX_SPLIT_SCRATCH_BYTES // 3) == 3
    # Head dim 128 takes 64-row tiles of 4 warps, two programs to an SM: a 252-token chunk's 16 query tiles
    # x 8 kv heads make 128 programs, 2 splits two waves' worth; a 124-token chunk's 64 programs, 4 splits.
    cfg = launch_config(128, 4, torch.bfloat16, 256, 1, 8, 2304, sms, num_tokens=256)
    assert (cfg.block_m, cfg.num_warps, cfg.num_splits, cfg.min_split_tiles) == (
        64, 4, 2, PREFILL_MIN_SPLIT_TILES)
    cfg = launch_config(128, 4, torch.bfloat16, 124, 1, 8, 4092, sms, num_tokens=124)
    assert (cfg.block_m, cfg.num_splits) == (64, 4)
    assert launch_config(128, 4, torch.bfloat16, 4096, 1, 8, 4096, sms, num_tokens=4096).num_splits == 1
    # Forced counts are taken as they are, down to one K/V tile per split.
    cfg = launch_config(128, 4, torch.bfloat16, 256, 1, 8, 2304, sms, num_kv_splits=3, num_tokens=256)
    assert (cfg.num_splits, cfg.min_split_tiles) == (3, 1)
    plan = plan_paged_attention(4, 1, 16, 2, 128, torch.bfloat16, 4, 32768, CPU)  # 2 programs on 8 SMs
    assert plan.config.num_splits > 1 and plan.split_out.shape == (4, 16, plan.config.num_splits, 128)


def _schedule_steps(num_steps: int, block_size: int, prompt_lens: list[int], budget: int, seed: int):
    """(plan, batch) of a few real scheduler steps: first chunks, later chunks, decodes, side by side."""
    rng = random.Random(seed)
    sched = Scheduler(EngineConfig(max_num_batched_tokens=budget, block_size=block_size),
                      KVCacheManager(96, block_size))
    for i, n in enumerate(prompt_lens):
        sched.add(Request(f"p{i}", [rng.randrange(3, 500) for _ in range(n)], SamplingParams(), max_tokens=6))
    for _ in range(num_steps):
        plan = sched.schedule()
        yield plan, build_forward_batch(plan, block_size, CPU)
        sched.advance(plan)
        for row in plan.rows:
            if row.samples:
                row.request.output_token_ids.append(rng.randrange(3, 500))


def test_backend_matches_torch_ref_over_scheduled_steps():
    """store_kv + attend of the triton backend against torch_ref's, step after step of a real schedule;
    split-KV forced on, so every launch takes it (the 45-token prompt's later chunks see two 32-key tiles
    and split). A mixed step whose leading rows are decodes is attended in two launches (decode rows, then
    the chunks), any other step in one."""
    torch.manual_seed(0)
    bs, hq, hkv, d = 4, 4, 2, 32
    triton_backend = get_backend("triton")
    triton_backend.num_kv_splits = 2
    ref_backend = get_backend("torch_ref")
    caches = [torch.zeros(2, 96, bs, hkv, d) for _ in range(2)]
    kinds = set()
    for step, (_, batch) in enumerate(_schedule_steps(7, bs, [9, 1, 45], budget=12, seed=0)):
        q = torch.randn(batch.num_tokens, hq, d)
        kv = torch.randn(batch.num_tokens, 2 * hkv, d)
        k, v = kv[:, :hkv], kv[:, hkv:]  # strided views, as a fused projection hands them over
        outs = []
        for backend, cache in zip((triton_backend, ref_backend), caches):
            backend.store_kv(k, v, cache, batch)
            outs.append(backend.attend(q, cache, batch, 0.2, return_lse=True))
        assert torch.equal(caches[0], caches[1])
        assert_matches(*outs[0], *outs[1], ATOL[torch.float32])
        plans = [v for key, v in batch.backend_state.items() if key[0] == "triton"]
        assert len(plans) == 1
        assert all(part.plan.config.num_splits == 2 for part in plans[0])
        kinds.add(tuple("prompt" if part.max_query_len > 1 else "decode" for part in plans[0]))
        if step == 0:  # a second layer reuses the step's plan and gets the same answer
            assert torch.equal(triton_backend.attend(q, caches[0], batch, 0.2), outs[0][0])
            assert [v for key, v in batch.backend_state.items() if key[0] == "triton"] == plans
    # One-launch steps with prompt chunks, two-launch mixed steps (decodes, then chunks), and decode-only
    # steps all ran.
    assert kinds == {("prompt",), ("decode", "prompt"), ("decode",)}


def test_backend_is_registered_lazily(monkeypatch):
    assert type(get_backend("triton")).__name__ == "TritonBackend"
    # Where triton is missing, asking for the backend names the package instead of a bare KeyError.
    import importlib.util

    from plait.attention import base

    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args):
        return None if name == "triton" else real_find_spec(name, *args)

    monkeypatch.delitem(base._REGISTRY, "triton")
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ImportError, match="'triton' package"):
        get_backend("triton")


# ---- Attention sinks (gpt-oss): one logit per query head, a key of value zero every query sees ---------


SINK_LOW, SINK_HIGH = -2.0, 6.0
# Sinks must move some output by at least this much, or a test of them would pass without them.
SINK_EFFECT = 0.1


def head_sinks(num_heads: int, seed: int, dtype: torch.dtype = torch.float32, device: torch.device = CPU,
               ) -> torch.Tensor:
    """sinks: [Hq], every head's different and shuffled over the heads (so a packed row reading another
    head's sink shows), from below to above a typical row's LSE (scale 0.3 over D 32: a few nats)."""
    g = torch.Generator().manual_seed(seed)
    sinks = torch.linspace(SINK_LOW, SINK_HIGH, num_heads)[torch.randperm(num_heads, generator=g)]
    return sinks.to(dtype=dtype, device=device)


def as_fp8(b: PagedBatch, scales: KVScales) -> PagedBatch:
    """The batch with its caches turned into FP8 codes standing for the same values (NaN where no row may
    read), as plait.attention.fp8_kv stores them."""
    inv_k, inv_v = scales.inverse
    b.k_cache, b.v_cache = to_cache(b.k_cache, FP8_DTYPE, inv_k), to_cache(b.v_cache, FP8_DTYPE, inv_v)
    b.k_poisoned = torch.where(b.k_poisoned.isnan(), torch.nan, b.k_cache.float()).to(FP8_DTYPE)
    b.v_poisoned = torch.where(b.v_poisoned.isnan(), torch.nan, b.v_cache.float()).to(FP8_DTYPE)
    return b


@dataclass(frozen=True)
class SinkCase:
    specs: list
    heads: tuple[int, int]  # (Hq, Hkv)
    splits: int
    dtype: torch.dtype = torch.float32
    window: int = 0
    softcap: float = 0.0
    precise_pv: str = "off"
    fp8_scales: KVScales | None = None  # an FP8 cache with these scales


SINK_CASES = {
    "mixed-group3": SinkCase(MIXED, (6, 2), 1),
    "mixed-window6-softcap": SinkCase(MIXED, (4, 2), 1, window=6, softcap=5.0),  # the sink is never capped
    "decode-fp16": SinkCase(DECODES, (6, 2), 1, torch.float16),
    "decode-split6": SinkCase(DECODES, (4, 2), 6),  # more splits than most rows have tiles: empty splits
    "prefill-split3-group4": SinkCase(PREFILL_SPLIT_ROWS, (8, 2), 3),
    "prefill-split4-window1": SinkCase(PREFILL_SPLIT_ROWS, (2, 2), 4, window=1),  # splits without keys
    "prefill-split3-fp16-precise": SinkCase(PREFILL_SPLIT_ROWS, (4, 2), 3, torch.float16, precise_pv="all"),
    "fp8-decode-split3": SinkCase(DECODES, (4, 2), 3, torch.float16, fp8_scales=KVScales(0.5, 2.0)),
    "fp8-mixed-window6": SinkCase(MIXED, (4, 2), 1, torch.float16, window=6,
                                  fp8_scales=KVScales(0.037, 0.011)),
}


@pytest.mark.parametrize("name", list(SINK_CASES))
def test_sinks_match_torch_ref(precise_pv_switch, name):
    """The kernel with sinks against torch_ref with them, over every row kind, GQA groups, windows, split-KV
    forced on (each sink counted once however many splits a query's keys take), precise P.V and an FP8
    cache; sinks in q's dtype, out and lse both checked."""
    case = SINK_CASES[name]
    precise_pv_switch(case.precise_pv)
    b = make_batch(case.specs, 4, *case.heads, 32, case.dtype, CPU, seed=30 + case.splits + case.window)
    scales = case.fp8_scales or UNIT_SCALES
    if case.fp8_scales is not None:
        b = as_fp8(b, scales)
    sinks = head_sinks(case.heads[0], seed=case.splits, dtype=case.dtype)
    out, lse, plan = run_kernel(b, 0.3, case.window, num_kv_splits=case.splits, tile_n=16, block_m=16,
                                seq_len_slack=20, softcap=case.softcap, sinks=sinks, kv_scales=scales)
    assert plan.config.num_splits == case.splits
    ref_out, ref_lse = reference(b, 0.3, case.window, case.softcap, sinks, scales)
    atol = ATOL[case.dtype] * (1 + scales.v)
    assert_matches(out, lse, ref_out, ref_lse, atol)
    plain_out, _ = reference(b, 0.3, case.window, case.softcap, kv_scales=scales)
    assert (plain_out - ref_out).abs().max() > SINK_EFFECT


# Rows with queries placed before position 0 (seq_len < query_len): no scheduler makes them, but they are
# how a final output that saw no key reaches the kernel (a split without keys is never final). With 32-token
# query tiles the last row's first tile spans two K/V tiles, so under split-KV its keyless queries are
# combined from two partials that saw nothing.
KEYLESS_ROWS = [(-2, 3), (5, 2), (-5, 40)]
KEYLESS_TOKENS = [0, 1, 5, 6, 7, 8, 9]


@pytest.mark.parametrize("splits", [1, 3])
def test_sinks_give_rows_without_keys_zeros_and_the_sink(splits):
    """A query that sees no key attends to its sink alone: out 0 and lse = sinks[h], never NaN (zeros and
    lse -inf without sinks); the other queries match torch_ref."""
    b = make_batch(KEYLESS_ROWS, 4, 4, 2, 32, torch.float32, CPU, seed=4)
    sinks = head_sinks(4, seed=5)
    out, lse, plan = run_kernel(b, 0.3, num_kv_splits=splits, tile_n=16, block_m=64, sinks=sinks)
    assert plan.config.num_splits == splits
    ref_out, ref_lse = reference(b, 0.3, sinks=sinks)
    keyless = KEYLESS_TOKENS
    assert not ref_out[keyless].any() and torch.equal(ref_lse[keyless], sinks.expand(len(keyless), -1))
    assert_matches(out, lse, ref_out, ref_lse, ATOL[torch.float32])
    assert not out[keyless].any()
    out, lse, _ = run_kernel(b, 0.3, num_kv_splits=splits, tile_n=16, block_m=64)
    assert not out[keyless].any() and (lse[keyless] == float("-inf")).all()


def test_backend_sinks_match_torch_ref_through_forward_batch():
    """ForwardBatch.attention hands the sinks to its backend, and the triton backend to each of its
    launches (decode rows, then prompt chunks): out through ForwardBatch.attention and lse through attend,
    against torch_ref's, step after step of a real schedule with split-KV forced on (the 45-token prompt's
    later steps and its decodes see two 32-key tiles and split)."""
    torch.manual_seed(1)
    bs, hq, hkv, d = 4, 4, 2, 32
    triton_backend = get_backend("triton")
    triton_backend.num_kv_splits = 2
    backends = (triton_backend, get_backend("torch_ref"))
    caches = [torch.zeros(2, 96, bs, hkv, d) for _ in backends]
    sinks = head_sinks(hq, seed=6)
    kinds, sink_effect = set(), 0.0
    for _, batch in _schedule_steps(4, bs, [9, 1, 45], budget=24, seed=0):
        q = torch.randn(batch.num_tokens, hq, d)
        kv = torch.randn(batch.num_tokens, 2 * hkv, d)
        k, v = kv[:, :hkv], kv[:, hkv:]
        outs, lses = [], []
        for backend, cache in zip(backends, caches):
            batch.attn_backend, batch.kv_caches = backend, [cache]
            outs.append(batch.attention(0, q, k, v, 0.2, sinks=sinks))
            lses.append(backend.attend(q, cache, batch, 0.2, return_lse=True, sinks=sinks)[1])
        assert_matches(outs[0], lses[0], outs[1], lses[1], ATOL[torch.float32])
        sink_effect = max(sink_effect, (backends[1].attend(q, caches[1], batch, 0.2) - outs[1]).abs().max())
        parts = next(v for key, v in batch.backend_state.items() if key[0] == "triton")
        kinds.add(tuple("prompt" if part.max_query_len > 1 else "decode" for part in parts))
    assert kinds == {("prompt",), ("decode", "prompt"), ("decode",)}
    assert sink_effect > SINK_EFFECT


@pytest.mark.parametrize("path", ["padded", "per_row"])
def test_torch_ref_sinks_match_transformers_eager(monkeypatch, path):
    """torch_ref's sinks against gpt-oss's eager_attention_forward in transformers (the sinks a last column
    of the scores, softmaxed with them, then dropped), on one request's 5-token chunk after 3 cached tokens,
    4 query heads over 2 kv heads, with and without a sliding window. Head 0's sink (+8) takes almost all
    the mass; head 1's (-1e4) must leave attention exactly as it is without sinks."""
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    if path == "per_row":
        monkeypatch.setattr(TorchRefBackend, "max_padded_scores", 0)
    g = torch.Generator().manual_seed(0)
    context, n, hq, hkv, d, bs = 3, 5, 4, 2, 16, 4
    seq, scale = context + n, d**-0.5
    q = torch.randn(n, hq, d, generator=g)
    k, v = torch.randn(2, seq, hkv, d, generator=g)
    # The row's blocks are 1.. in order (block 0 is the pad block).
    num_blocks = cdiv(seq, bs)
    k_cache, v_cache = torch.zeros(2, 1 + num_blocks, bs, hkv, d)
    k_cache.view(-1, hkv, d)[bs : bs + seq], v_cache.view(-1, hkv, d)[bs : bs + seq] = k, v
    paged = (torch.tensor([0, n], dtype=torch.int32), torch.tensor([seq], dtype=torch.int32),
             torch.arange(1, 1 + num_blocks, dtype=torch.int32).view(1, -1))
    sinks = torch.tensor([8.0, -1e4, 0.5, -2.0])
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=hq // hkv, training=False)
    q_pos, k_pos = torch.arange(context, seq).view(-1, 1), torch.arange(seq)
    for window in (0, 3):
        out, lse = paged_attention_ref(q, k_cache, v_cache, *paged, scale, window, sinks=sinks)
        plain_out, plain_lse = paged_attention_ref(q, k_cache, v_cache, *paged, scale, window)
        visible = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
        mask = torch.zeros(n, seq).masked_fill(~visible, float("-inf"))  # [n, seq], additive, as HF's
        want, _ = gpt_oss.eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                  v.transpose(0, 1)[None], mask[None, None], scale)
        torch.testing.assert_close(out, want[0], atol=1e-6, rtol=1e-5)
        # The lse eager's softmax normalises by: the scores with the sink column.
        scores = q.transpose(0, 1) @ k.repeat_interleave(hq // hkv, 1).permute(1, 2, 0) * scale + mask
        with_sink = torch.cat([scores, sinks.view(-1, 1, 1).expand(-1, n, 1)], dim=-1)  # [Hq, n, seq + 1]
        torch.testing.assert_close(lse, torch.logsumexp(with_sink, -1).T, atol=1e-6, rtol=1e-6)
        assert ((plain_lse[:, 0] - lse[:, 0]).exp() < 0.01).all()  # the keys keep under 1% of the mass
        assert torch.equal(out[:, 1], plain_out[:, 1]) and torch.equal(lse[:, 1], plain_lse[:, 1])


# ---- Key limits (Gemma 3's images): a query sees keys up to its limit, past its own position -----------


def span_key_limits(b: PagedBatch, rng: random.Random, max_spans: int = 2) -> torch.Tensor:
    """[T] int64 on the batch's device: each token's own position, except inside a few random spans of each
    row's chunk (an image's placeholders, computed in one chunk), where every token's limit is the span's
    last position."""
    qsl, lens = b.query_start_loc.tolist(), b.seq_lens.tolist()
    limits = []
    for r, seq_len in enumerate(lens):
        n = qsl[r + 1] - qsl[r]
        context = seq_len - n
        row = list(range(context, seq_len))
        for _ in range(rng.randint(0, max_spans) if n > 1 else 0):
            a = rng.randrange(n)
            e = rng.randint(a + 1, n)
            row[a:e] = [context + e - 1] * (e - a)
        limits += row
    return torch.tensor(limits, dtype=torch.int64, device=b.q.device)


# Rows with room for spans: first chunks, later chunks over context, and decodes beside them.
SPAN_ROWS = [(0, 13), (7, 21), (9, 1), (30, 9), (0, 40), (5, 0), (2, 3), PAD_ROW]


@pytest.mark.parametrize(("dtype", "heads", "splits", "window", "softcap"), [
    (torch.float32, (4, 2), 1, 0, 0.0),
    (torch.float32, (6, 2), 3, 0, 0.0),  # split-KV over the tiles the limits add
    (torch.float32, (4, 2), 1, 6, 0.0),  # Gemma 3's sliding layers: the window counts from the query
    (torch.float32, (2, 1), 2, 5, 5.0),
    (torch.float16, (4, 2), 1, 0, 0.0),
])
def test_key_limits_match_torch_ref(dtype, heads, splits, window, softcap):
    """The kernel with per-token key limits against torch_ref with them, every row kind, query tiles cut
    inside spans (block_m 16); the limits change the answer (the kernel did not ignore them)."""
    rng = random.Random(sum(heads) + splits + window)
    b = make_batch(SPAN_ROWS, 4, *heads, 32, dtype, CPU, seed=splits + window)
    limits = span_key_limits(b, rng)
    out, lse, plan = run_kernel(b, 0.3, window, num_kv_splits=splits, tile_n=16, block_m=16,
                                seq_len_slack=9, softcap=softcap, key_limits=limits)
    assert plan.config.num_splits == splits
    ref_out, ref_lse = reference(b, 0.3, window, softcap, key_limits=limits)
    assert_matches(out, lse, ref_out, ref_lse, ATOL[dtype])
    causal_out, _ = reference(b, 0.3, window, softcap)
    assert (causal_out - ref_out).abs().max() > 1e-2


def test_key_limits_in_torch_ref_follow_the_definition():
    """torch_ref's padded and per-row paths with key limits against attention written out from the
    definition: query t sees key p iff p <= limit[t] and (no window or p > pos[t] - W)."""
    b = make_batch([(0, 9), (6, 7)], 4, 2, 2, 16, torch.float32, CPU, seed=3)
    limits = span_key_limits(b, random.Random(4), max_spans=2)
    for backend_max in (TorchRefBackend.max_padded_scores, 0):  # padded, then one row at a time
        ref = TorchRefBackend()
        ref.max_padded_scores = backend_max
        for window in (0, 3):
            qsl, lens = b.query_start_loc.tolist(), b.seq_lens.tolist()
            for r in range(2):
                n, seq_len = qsl[r + 1] - qsl[r], lens[r]
                table = b.block_tables[r].long()
                pos = torch.arange(seq_len)
                k = b.k_cache[table[pos // 4], pos % 4]  # [S, Hkv, D]
                v = b.v_cache[table[pos // 4], pos % 4]
                q = b.q[qsl[r]:qsl[r + 1]]
                q_pos = torch.arange(seq_len - n, seq_len)
                lim = limits[qsl[r]:qsl[r + 1]]
                visible = pos[None] <= lim[:, None]
                if window:
                    visible &= pos[None] > q_pos[:, None] - window
                scores = torch.einsum("qhd,khd->hqk", q, k) * 0.3
                probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
                want = torch.einsum("hqk,khd->qhd", probs, v)
                got = _ref_rows(ref, b, 0.3, window, limits)[qsl[r]:qsl[r + 1]]
                torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def _ref_rows(backend: TorchRefBackend, b: PagedBatch, scale: float, window: int, limits: torch.Tensor):
    """``backend``'s output over the batch with key limits (as paged_attention_ref builds its batch)."""
    from unittest import mock

    with mock.patch("plait.attention.torch_ref.TorchRefBackend", lambda: backend):
        return paged_attention_ref(b.q, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens, b.block_tables,
                                   scale, window, key_limits=limits)[0]


# ---- GPU: real shapes, bf16/fp16, against torch_ref in fp32 ---------------------------------------------

GPU_DTYPES = [torch.bfloat16, torch.float16]
GPU_ATOL = GPU_RTOL = 1.5e-2


def gpu(test):
    """Marks a test as needing CUDA; it skips where there is none."""
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")(test))


def _random_specs(rng: random.Random, num_rows: int, max_context: int, decode_only: bool):
    """Rows of every kind: empty context, 1-token chunks, chunks crossing blocks, long contexts."""
    specs = []
    for _ in range(num_rows):
        kind = rng.random()
        if decode_only or kind < 0.5:
            context = int(2 ** rng.uniform(0, 15)) if rng.random() < 0.9 else rng.randint(0, 16)
            specs.append((min(context, max_context), 1))
        elif kind < 0.7:
            specs.append((0, rng.randint(1, 300)))  # a first chunk
        else:
            specs.append((rng.randint(1, min(max_context, 4096)), rng.randint(1, 200)))  # a later chunk
    return specs


def _gpu_cases() -> list[dict]:
    """Batch sizes 1..256 with contexts up to 32k; head dims, dtypes, groups and block sizes rotate."""
    cases = []
    for i, (rows, max_context) in enumerate([(1, 32768), (3, 32768), (8, 8192), (64, 2048), (256, 600)]):
        for decode_only in (False, True):
            cases.append(dict(rows=rows, max_context=max_context, decode_only=decode_only,
                              head_dim=[64, 128][(i + decode_only) % 2], dtype=GPU_DTYPES[i % 2],
                              group=[1, 2, 4, 8][(i + 2 * decode_only) % 4],
                              block_size=[16, 32][(i // 2) % 2],
                              window=1000 if (i + decode_only) % 3 == 1 else 0, seed=i * 2 + decode_only))
    return cases


def _case_id(case: dict) -> str:
    return "r{rows}-d{head_dim}-g{group}-bs{block_size}-w{window}-dec{decode_only:d}".format(**case)


@pytest.mark.parametrize("case", _gpu_cases(), ids=_case_id)
@pytest.mark.parametrize("splits", [None, 1, 3], ids=["split-auto", "split-off", "split-3"])
@gpu
def test_gpu_sweep_matches_torch_ref(case, splits):
    rng = random.Random(case["seed"])
    specs = _random_specs(rng, case["rows"], case["max_context"], case["decode_only"])
    if case["rows"] > 2:
        specs[-1] = PAD_ROW
    num_kv_heads = 8 if case["group"] < 8 else 4
    b = make_batch(specs, case["block_size"], num_kv_heads * case["group"], num_kv_heads, case["head_dim"],
                   case["dtype"], torch.device("cuda"), case["seed"])
    scale = case["head_dim"] ** -0.5
    out, lse, plan = run_kernel(b, scale, case["window"], num_kv_splits=splits, seq_len_slack=1000)
    if splits is not None:
        assert plan.config.num_splits == splits
    assert_matches(out, lse, *reference(b, scale, case["window"]), atol=GPU_ATOL, rtol=GPU_RTOL)


@pytest.mark.parametrize("decode_only", [False, True])
@pytest.mark.parametrize("splits", [None, 1], ids=["split-auto", "split-off"])
@gpu
def test_gpu_logit_softcap_matches_torch_ref(decode_only, splits):
    """Gemma 2's shapes (head dim 256, group 2, window 4096 on half its layers) with its cap of 50 on the
    scores, bf16, CUDA's tanhf in the kernel."""
    rng = random.Random(40 + decode_only)
    specs = _random_specs(rng, 24, 8192, decode_only)
    b = make_batch(specs, 16, 16, 8, 256, torch.bfloat16, torch.device("cuda"), seed=41)
    b.q.mul_(8.0)  # scores of tens: the cap binds
    scale = 256**-0.5
    for window in (0, 4096):
        out, lse, plan = run_kernel(b, scale, window, num_kv_splits=splits, seq_len_slack=100, softcap=50.0)
        ref_out, ref_lse = reference(b, scale, window, softcap=50.0)
        assert_matches(out, lse, ref_out, ref_lse, atol=GPU_ATOL, rtol=GPU_RTOL)
        assert (reference(b, scale, window)[0] - ref_out).abs().max() > 0.1  # the cap changed the answer


@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("splits", [None, 1, 3], ids=["split-auto", "split-off", "split-3"])
@gpu
def test_gpu_key_limits_match_torch_ref(dtype, splits):
    """Gemma 3's shapes (head dim 256, group 2) with 256-token image spans in prompt chunks beside decodes,
    global and windowed (1024), on the GPU's tiles."""
    rng = random.Random(50 + (splits or 0))
    specs = _random_specs(rng, 24, 8192, decode_only=False) + [(0, 600), (1000, 300)]
    b = make_batch(specs, 16, 16, 8, 256, dtype, torch.device("cuda"), seed=51)
    limits = span_key_limits(b, rng, max_spans=3)
    scale = 256**-0.5
    for window in (0, 1024):
        out, lse, plan = run_kernel(b, scale, window, num_kv_splits=splits, seq_len_slack=100,
                                    key_limits=limits)
        ref_out, ref_lse = reference(b, scale, window, key_limits=limits)
        assert_matches(out, lse, ref_out, ref_lse, atol=GPU_ATOL, rtol=GPU_RTOL)
        assert (reference(b, scale, window)[0] - ref_out).abs().max() > 1e-2  # the limits changed the answer


# Steps replayed through one graph: the same row and token counts, other contexts, chunks and blocks.
GRAPH_STEPS = {
    "decode": [[(100, 1), (3000, 1), PAD_ROW, PAD_ROW], [(5000, 1), (0, 1), (700, 1), PAD_ROW]],
    "mixed": [[(100, 1), (3000, 40), (0, 7), PAD_ROW], [(5000, 1), (0, 16), (700, 31), PAD_ROW]],
}


@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("splits", [None, 1], ids=["split-auto", "split-off"])
@pytest.mark.parametrize("kind", list(GRAPH_STEPS))
@gpu
def test_gpu_cuda_graph_replay_with_new_metadata(dtype, splits, kind):
    """Captured once for max_seq_len = max_model_len with padded rows; replayed after the metadata
    tensors are rewritten in place (other contexts, other blocks): no host sync, right answers."""
    dev = torch.device("cuda")
    bs, hq, hkv, d, max_model_len = 16, 16, 8, 128, 8192
    width = max_model_len // bs
    steps = GRAPH_STEPS[kind]
    max_query_len = 1 if kind == "decode" else 64  # a graph's bound: its prompt-token bucket
    batches = [make_batch(s, bs, hq, hkv, d, dtype, dev, seed=i, table_slack=0) for i, s in enumerate(steps)]
    num_blocks = max(b.k_cache.shape[0] for b in batches)
    caches = [torch.zeros(num_blocks, bs, hkv, d, dtype=dtype, device=dev) for _ in range(2)]
    num_rows = len(steps[0])
    q = torch.empty_like(batches[0].q)
    qsl = torch.empty(num_rows + 1, dtype=torch.int32, device=dev)
    seq_lens = torch.empty(num_rows, dtype=torch.int32, device=dev)
    tables = torch.empty(num_rows, width, dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], device=dev)
    plan = plan_paged_attention(q.shape[0], num_rows, hq, hkv, d, dtype, max_query_len, max_model_len, dev,
                                splits)
    if splits is None:
        assert plan.config.num_splits > 1  # 4 rows (or one 64-token tile) x 8 kv heads never fill a GPU

    def load(b: PagedBatch) -> None:
        for static, new in ((q, b.q), (qsl, b.query_start_loc), (seq_lens, b.seq_lens)):
            static.copy_(new)
        tables.fill_(PAD_BLOCK_ID)
        tables[:, : b.block_tables.shape[1]].copy_(b.block_tables)
        for cache, new in zip(caches, (b.k_poisoned, b.v_poisoned)):
            cache.fill_(float("nan"))
            cache[: new.shape[0]].copy_(new)

    def step() -> None:
        paged_attention(q, caches[0], caches[1], out, qsl, seq_lens, tables, d**-0.5, max_query_len,
                        max_model_len, lse=lse, plan=plan)

    load(batches[0])
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for b in batches:
        load(b)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(out, lse, *reference(b, d**-0.5), atol=GPU_ATOL, rtol=GPU_RTOL)


@pytest.mark.parametrize("decode_only", [False, True], ids=["mixed", "decode"])
@gpu
def test_gpu_precise_pv_tracks_fp32_reference(precise_pv_switch, decode_only):
    """bf16 inputs, fp32 out: P in two bf16 terms cuts the error against torch_ref's fp32 math by far
    more than the 8x asserted (P rounded once to bf16 has 8 mantissa bits, the pair ~16)."""
    rng = random.Random(7)
    specs = _random_specs(rng, 8, 4096, decode_only)
    b = make_batch(specs, 16, 32, 8, 128, torch.bfloat16, torch.device("cuda"), seed=7)
    ref = unrounded_reference(b, 128**-0.5)
    errors = {}
    for mode in ("all", "off"):
        precise_pv_switch(mode)
        out, _, _ = run_kernel(b, 128**-0.5, out_dtype=torch.float32)
        errors[mode] = (out - ref).abs().mean().item()
    assert errors["off"] > 8 * errors["all"], errors


@pytest.mark.parametrize("decode_only", [False, True], ids=["mixed", "decode"])
@pytest.mark.parametrize("splits", [None, 1, 4], ids=["split-auto", "split-off", "split-4"])
@gpu
def test_gpu_sinks_match_torch_ref(decode_only, splits):
    """gpt-oss-20b's attention shapes (head dim 64, 64 query heads over 8 kv heads, every other layer a
    128-token window) with bf16 sinks, contexts up to 4k, split-KV automatic, off and forced."""
    dev = torch.device("cuda")
    rng = random.Random(60 + decode_only)
    specs = _random_specs(rng, 24, 4096, decode_only)
    specs[-1] = PAD_ROW
    b = make_batch(specs, 16, 64, 8, 64, torch.bfloat16, dev, seed=61)
    sinks = head_sinks(64, seed=62, dtype=torch.bfloat16, device=dev)
    scale = 64**-0.5
    for window in (0, 128):
        out, lse, plan = run_kernel(b, scale, window, num_kv_splits=splits, seq_len_slack=100, sinks=sinks)
        if splits is not None:
            assert plan.config.num_splits == splits
        ref_out, ref_lse = reference(b, scale, window, sinks=sinks)
        assert_matches(out, lse, ref_out, ref_lse, atol=GPU_ATOL, rtol=GPU_RTOL)
        assert (reference(b, scale, window)[0] - ref_out).abs().max() > SINK_EFFECT
