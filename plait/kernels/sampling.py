"""Top-k / top-p / min-p sampling as an exponential race that never sorts the vocabulary, and greedy
argmax of few wide rows in one launch."""

# Sampling draws argmax_i p_i / E_i over the ids the filters keep, with E_i ~ Exp(1) noise (an
# exponential race: distributed as Categorical(p) over those ids). Each filter keeps a prefix of the
# ids ranked by (logit desc, id asc): top-k its first k, top-p those whose more likely ids hold less
# than top_p of the mass, min-p those at least min_p times as likely as the first. top-k and min-p are
# cuts on a value known after a first pass (the k-th logit, the largest probability), so the race just
# skips the ids below them. top-p needs no sort either: if the race's winner c is kept by top-p, it is
# also the winner among the kept ids, a subset; if not, no id ranked after c is kept, so race again
# among the ids ranked before c. One pass over the row per round, with the mass before c in the same
# pass. A round rejects only when the race lands in the tail top-p cuts (about 1 - top_p of the time),
# so a row usually costs three passes: max and normaliser, the first race, one check. The torch
# reference, race_sample_ref in plait.runner.sampler, sorts.
#
# top-k itself comes in as each row's k-th largest logit (kth) and how many ids equal to it are kept
# (room, the lowest ids first), from torch.topk: a k-th order statistic needs a selection, not a race.

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from plait.kernels.interpreter import static_iters, trip_count
from plait.kernels.pdl import pdl_args, pdl_prologue

# Ids per loop step of the kernel: 4,096 fp32 logits per step keep ~64 loads in flight a warp at 8 warps.
RACE_BLOCK = 4096
RACE_WARPS = 8


@triton.jit
def _top_k_keep(z, valid, kth, room, ties_before, HAS_TOP_K: tl.constexpr):
    """Which ids of this block top-k keeps: above the k-th value, or equal to it within the first `room`
    such ids of the row (ties_before of them lie in earlier blocks)."""
    if HAS_TOP_K:
        tie = (z == kth) & valid
        block_ties = tl.sum(tie.to(tl.int32), axis=0)
        keep = valid & (z > kth)
        if block_ties > 0:  # rare but for the block holding the k-th value: skip the scan elsewhere
            rank = ties_before + tl.cumsum(tie.to(tl.int32), axis=0) - 1
            keep = keep | (tie & (rank < room))
        ties_after = ties_before + block_ties
    else:
        keep = valid
        ties_after = ties_before
    return keep, ties_after


@triton.jit
def _load_block(z_row, ids, V, kth, room, ties_before, HAS_TOP_K: tl.constexpr):
    """One block of a row's logits (-inf past the end) and which of them top-k keeps."""
    valid = ids < V
    z = tl.load(z_row + ids, mask=valid, other=float("-inf"))
    keep, ties = _top_k_keep(z, valid, kth, room, ties_before, HAS_TOP_K)
    return ids, z, keep, ties


@triton.jit
def _race_kernel(
    z_ptr, keys_ptr, rows_ptr, kth_ptr, room_ptr, top_p_ptr, min_p_ptr, out_ptr,
    V, stride_z, n_blocks, STATIC_BLOCKS: tl.constexpr,
    HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr, BLOCK: tl.constexpr,
):
    # z: [R, V] fp32 (logits after processors and temperature); rows: [S] the rows to sample, one
    # program each; keys: [S, 2] int64, the low and high 32 bits of each one's noise key; kth, room,
    # top_p, min_p: [R]; out: [R] int64, written at rows.
    j = tl.program_id(0)
    row = tl.load(rows_ptr + j).to(tl.int64)
    z_row = z_ptr + row * stride_z
    key = (tl.load(keys_ptr + 2 * j).to(tl.uint32), tl.load(keys_ptr + 2 * j + 1).to(tl.uint32))
    kth = tl.load(kth_ptr + row) if HAS_TOP_K else float("-inf")
    room = tl.load(room_ptr + row) if HAS_TOP_K else 0
    # As tensors either way, so that the rounds' loop condition is never a Python constant.
    top_p = tl.load(top_p_ptr + row) if HAS_TOP_P else tl.full((), 1.0, tl.float32)
    min_p = tl.load(min_p_ptr + row) if HAS_MIN_P else tl.full((), 0.0, tl.float32)
    offs = tl.arange(0, BLOCK)

    # Pass 1: the largest kept logit and the normaliser sum(exp(z - max)) over the kept ids, online.
    m_lane = tl.full((BLOCK,), float("-inf"), tl.float32)
    s_lane = tl.zeros((BLOCK,), tl.float32)
    ties = tl.zeros((), tl.int32)
    for blk in range(trip_count(STATIC_BLOCKS, n_blocks)):
        ids, z, keep, ties = _load_block(z_row, blk * BLOCK + offs, V, kth, room, ties, HAS_TOP_K)
        zk = tl.where(keep, z, float("-inf"))
        m_new = tl.maximum(m_lane, zk)
        shift = tl.where(m_new > float("-inf"), m_new, 0.0)  # a lane with nothing kept yet: no -inf - -inf
        s_lane = s_lane * tl.exp(m_lane - shift) + tl.exp(zk - shift)
        m_lane = m_new
    z_max = tl.max(m_lane, axis=0)
    total = tl.sum(s_lane * tl.exp(m_lane - z_max), axis=0)

    # Pass 2: the race over every id top-k keeps (all are ranked before a last place at -inf, id V).
    _, _, c, c_z = _mass_and_race_before(z_row, key, V, kth, room, z_max, min_p, float("-inf"), V,
                                         n_blocks, STATIC_BLOCKS, HAS_TOP_K, BLOCK)
    # Rounds: one pass finds the mass ranked before c (is c kept?) and the race among those ids (the
    # next candidate if it is not).
    if HAS_TOP_P:
        done = top_p >= 1.0
        while not done:
            mass, before, nxt, nxt_z = _mass_and_race_before(
                z_row, key, V, kth, room, z_max, min_p, c_z, c, n_blocks, STATIC_BLOCKS, HAS_TOP_K,
                BLOCK)
            # top_p = 1 keeps every id even where rounding makes the mass before one reach 1; the most
            # likely id always survives top-p.
            done = (top_p >= 1.0) | (mass / total < top_p) | (before == 0)
            if not done:
                c = nxt
                c_z = nxt_z
    tl.store(out_ptr + row, c.to(tl.int64))


@triton.jit
def _mass_and_race_before(z_row, key, V, kth, room, z_max, min_p, bound_z, bound_id, n_blocks,
                          STATIC_BLOCKS: tl.constexpr, HAS_TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """Over the ids top-k keeps ranked before (bound_z, bound_id) by (logit desc, id asc): their mass
    sum(exp(z - z_max)) and how many there are (what top-p needs), and the race's winner among those
    min-p keeps too (argmax of exp(z - z_max) / noise, the first on ties) with its logit."""
    offs = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), -1.0, tl.float32)
    best_id = tl.full((BLOCK,), V, tl.int32)
    mass_lane = tl.zeros((BLOCK,), tl.float32)
    count_lane = tl.zeros((BLOCK,), tl.int32)
    ties = tl.zeros((), tl.int32)
    for blk in range(trip_count(STATIC_BLOCKS, n_blocks)):
        ids, z, keep, ties = _load_block(z_row, blk * BLOCK + offs, V, kth, room, ties, HAS_TOP_K)
        keep = keep & ((z > bound_z) | ((z == bound_z) & (ids < bound_id)))
        e = _hashed_exponential(key, ids)
        p = tl.where(keep, tl.exp(z - z_max), 0.0)
        mass_lane += p
        count_lane += keep.to(tl.int32)
        # min-p is a cut on p alone (the most likely id, p = 1, always passes), so it needs no rounds.
        score = tl.where(keep & (p >= min_p), p / e, -1.0)
        # Strictly greater: within a lane ids only grow, so the first maximum stays.
        better = score > best
        best = tl.where(better, score, best)
        best_id = tl.where(better, ids, best_id)
    top = tl.max(best, axis=0)
    c = tl.min(tl.where(best == top, best_id, V), axis=0)
    c_z = tl.load(z_row + tl.minimum(c, V - 1))
    return tl.sum(mass_lane, axis=0), tl.sum(count_lane, axis=0), c, c_z


def race_sample(z: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor, out: torch.Tensor,
                top_k: tuple[torch.Tensor, torch.Tensor] | None = None, top_p: torch.Tensor | None = None,
                min_p: torch.Tensor | None = None) -> None:
    """Writes out[rows] = the exponential race's winner among the ids top-k, top-p and min-p keep, each
    row's Exp(1) noise hashed from its key and the token ids as the race reads them.

    top_k: (kth, room) from plait.runner.sampler.top_k_cut, None when no row has top-k; top_p, min_p:
    None when no row has one (a row without sets 1.0, 0.0). The torch reference: race_sample_ref over
    the noise hashed_exponential_ref draws from the same keys."""
    # z: [R, V] fp32; keys: [S, 2] int64 in [0, 2**32); rows: [S] int64; kth: [R] fp32; room: [R] int32;
    # top_p, min_p: [R] fp32; out: [R] int64
    if rows.numel() == 0:
        return
    kth, room = top_k if top_k is not None else (z, z)  # unread placeholders when absent
    n_blocks = triton.cdiv(z.shape[1], RACE_BLOCK)
    _race_kernel[(rows.numel(),)](
        z, keys, rows, kth, room, top_p if top_p is not None else z, min_p if min_p is not None else z,
        out, z.shape[1], z.stride(0), n_blocks, static_iters(z.is_cuda, n_blocks),
        HAS_TOP_K=top_k is not None, HAS_TOP_P=top_p is not None, HAS_MIN_P=min_p is not None,
        BLOCK=RACE_BLOCK, num_warps=RACE_WARPS,
    )


# The race's noise: a counter-based hash of (the row's 64-bit key, token id), drawn where the race reads
# it, so no [rows, vocab] noise is written or read and every row's draws depend on its key alone. The
# torch twin, hashed_exponential_ref in plait.runner.sampler, computes the same 32-bit values with int64
# arithmetic.
# Smallest draw: -log(1) = 0 would make p / e infinite.
_TINY = tl.constexpr(1.1754943508222875e-38)


@triton.jit
def _mix32(x):
    # lowbias32 (Wellons): a bijection on 32 bits with good avalanche.
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


@triton.jit
def _hashed_exponential(key, ids):
    """Exp(1) draws for token ``ids`` of the row keyed by ``key`` (its low and high 32 bits)."""
    h = _mix32(_mix32(ids.to(tl.uint32) ^ key[0]) ^ key[1])
    u = ((h >> 8) + 1).to(tl.float32) * (1.0 / 16777216.0)  # (0, 1], exact in fp32
    return tl.maximum(-tl.log(u), _TINY)


# ---- Greedy: the argmax of few wide rows in one launch ------------------------------------------------
# torch's CUDA argmax reduces a row in one thread block (37 us for a 128,256-wide row on an H200), and
# doing it in two torch passes instead took 5 launches (~22 us of a 4.4 ms batch-1 Llama-8B token). Here
# each row is cut into chunks, one program each: a program stores its chunk's maximum and the first id
# holding it, then counts itself in on the row's counter; the program that arrives last combines the
# row's partials (the largest, the lowest id on ties), writes the id and resets the counter for the next
# launch, as split-KV attention does (plait.kernels.paged_attention). The reference is
# logits.argmax(dim=-1), matched exactly, NaN included: torch ranks NaN above every value, so the first
# NaN of a row wins.

# Ids per program: a 128,256-id vocabulary spreads over 126 programs, about one per SM of an H100 / H200
# (132), each reading one tile, so a row costs one load round trip and then the combine's.
ARGMAX_CHUNK = 1024
ARGMAX_BLOCK = 1024  # ids per loop step: 8 a thread at 4 warps (one 16-byte load of bf16, two of fp32)
ARGMAX_WARPS = 4
# Most chunks a row is cut into (vocabularies past 1,048,576 ids get wider chunks): the last program of a
# row loads all its partials in one go.
ARGMAX_MAX_CHUNKS = 1024
# An id past any row: never the lowest among real ones.
_NO_ID = tl.constexpr(2**31 - 1)


@functools.cache
def _argmax_scratch(device: torch.device, max_rows: int, chunks: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """argmax_few_rows' partials and counters for one device and shape, allocated once: every launch,
    and every replay of a CUDA graph that captured one, uses the same. The counters start at zero and
    each row's last program sets its own back to zero."""
    # values: [max_rows, chunks] fp32; ids: [max_rows, chunks] int32; counters: [max_rows] int32
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        # Zeros allocated under capture would be filled only when the graph replays.
        raise RuntimeError("argmax_few_rows: call it once outside CUDA-graph capture first (it allocates "
                           "its counters)")
    return (torch.empty(max_rows, chunks, dtype=torch.float32, device=device),
            torch.empty(max_rows, chunks, dtype=torch.int32, device=device),
            torch.zeros(max_rows, dtype=torch.int32, device=device))


@triton.jit
def _first_max(values, ids):
    """The largest of ``values`` (NaN above everything, as torch.argmax ranks it) and the lowest of
    ``ids`` holding it: (value, id)."""
    # values: [N] fp32; ids: [N] int32 -> (scalar fp32, scalar int32)
    nan = values != values
    top = tl.max(tl.where(nan, float("-inf"), values), axis=0)
    any_nan = tl.max(nan.to(tl.int32), axis=0) > 0
    hit = tl.where(any_nan, nan, values == top)
    return tl.where(any_nan, float("nan"), top), tl.min(tl.where(hit, ids, _NO_ID), axis=0)


@triton.jit
def _argmax_kernel(
    x_ptr, out_ptr, part_val_ptr, part_id_ptr, counters_ptr, V, stride_x, chunks, tiles,
    STATIC_TILES: tl.constexpr, CHUNKS_POW2: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """Grid (S, chunks): chunk ``program_id(1)`` (``tiles`` tiles of BLOCK ids) of row ``program_id(0)``;
    the row's last program to finish writes its argmax."""
    # x: [S, V] float logits, unit stride along V; out: [S] int64; part_val, part_id: [>= S, chunks] fp32 /
    # int32 scratch; counters: [>= S] int32, zero between launches.
    pdl_prologue(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    start = chunk * tiles * BLOCK
    x_row = x_ptr + row.to(tl.int64) * stride_x
    offs = tl.arange(0, BLOCK)
    # Each lane keeps the first of its largest values: only a strictly greater one (or a first NaN)
    # replaces it, and a lane's ids only grow. Lanes start at the chunk's first id, the answer for a chunk
    # of -inf alone (every chunk holds at least one id of the row).
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_id = tl.zeros((BLOCK,), tl.int32) + start
    for t in range(trip_count(STATIC_TILES, tiles)):
        ids = start + t * BLOCK + offs
        x = tl.load(x_row + ids, mask=ids < V, other=float("-inf")).to(tl.float32)
        better = (x > best) | ((x != x) & (best == best))
        best = tl.where(better, x, best)
        best_id = tl.where(better, ids, best_id)
    value, first = _first_max(best, best_id)
    part = row * chunks + chunk
    tl.store(part_val_ptr + part, value)
    tl.store(part_id_ptr + part, first)
    # Every thread's stores precede the count: the barrier orders them within the program, the release
    # half of the gpu-scope atomic publishes them to the program that arrives last.
    tl.debug_barrier()
    counter = counters_ptr + row
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if arrived == chunks - 1:
        # The acquire half makes the other chunks' partials visible; the barrier orders every thread's
        # loads after it. Straight from L2 (.cg): other multiprocessors stored them, and this one's L1 may
        # hold stale lines of the same scratch from an earlier launch.
        tl.debug_barrier()
        c = tl.arange(0, CHUNKS_POW2)
        have = c < chunks
        vals = tl.load(part_val_ptr + row * chunks + c, mask=have, other=float("-inf"), cache_modifier=".cg")
        firsts = tl.load(part_id_ptr + row * chunks + c, mask=have, other=_NO_ID, cache_modifier=".cg")
        _, first = _first_max(vals, firsts)
        tl.store(out_ptr + row, first.to(tl.int64))
        tl.store(counter, 0)  # every chunk has counted in: ready for the next launch


def argmax_few_rows(logits: torch.Tensor, max_rows: int, chunk: int = ARGMAX_CHUNK,
                    block: int = ARGMAX_BLOCK) -> torch.Tensor:
    """logits.argmax(dim=-1) in one launch, each row spread over many programs (for batches too small to
    fill the GPU a row each): the first maximum wins, NaN above all, as in torch.

    max_rows: the most rows any call passes; the partials and counters are cached per (device, max_rows,
    chunks), so the launch allocates nothing but its output, never waits for the device and can be
    captured in a CUDA graph (after one call outside capture). Launches sharing that scratch must not run
    concurrently (one stream). chunk, block: ids per program and per loop step (chunk a multiple of
    block, a power of two; tests use small ones to cross many chunks cheaply)."""
    # logits: [S, V] fp32 / fp16 / bf16, unit stride along V, 0 < S <= max_rows, V > 0 -> [S] int64
    rows, vocab = logits.shape
    if not 0 < rows <= max_rows or vocab == 0 or logits.stride(1) != 1:
        raise ValueError(f"argmax_few_rows: logits {tuple(logits.shape)} (stride {logits.stride()}) needs "
                         f"1..{max_rows} rows, a vocabulary and unit stride along it")
    if block & (block - 1) or chunk % block:
        raise ValueError(f"argmax_few_rows: block {block} must be a power of two dividing chunk {chunk}")
    tiles = max(chunk // block, triton.cdiv(triton.cdiv(vocab, ARGMAX_MAX_CHUNKS), block))  # per chunk
    chunks = triton.cdiv(vocab, tiles * block)
    part_val, part_id, counters = _argmax_scratch(logits.device, max_rows, chunks)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _argmax_kernel[(rows, chunks)](
        logits, out, part_val, part_id, counters, vocab, logits.stride(0), chunks, tiles,
        static_iters(logits.is_cuda, tiles), CHUNKS_POW2=triton.next_power_of_2(chunks), BLOCK=block,
        num_warps=ARGMAX_WARPS, **pdl_args(logits),
    )
    return out
