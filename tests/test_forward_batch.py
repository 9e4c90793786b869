"""build_forward_batch from StepPlans (hazards 1, 2, 3, 10) and torch_ref paged attention over chunks."""

from __future__ import annotations

import random

import pytest
import torch

from plait.attention.base import get_backend
from plait.config import EngineConfig
from plait.engine.kv_cache import PAD_BLOCK_ID, KVCacheManager, cdiv
from plait.engine.request import FinishReason, Request
from plait.engine.scheduler import ScheduledRow, Scheduler, StepPlan
from plait.runner.forward_batch import ForwardBatch, build_forward_batch
from plait.sampling_params import SamplingParams

CPU = torch.device("cpu")


def make_request(name: str, prompt: list[int], outputs: list[int] = (), computed: int = 0,
                 block_ids: list[int] = (), max_tokens: int = 16) -> Request:
    r = Request(name, list(prompt), SamplingParams(), max_tokens=max_tokens)
    r.output_token_ids = list(outputs)
    r.num_computed_tokens = computed
    r.block_ids = list(block_ids)
    return r


def row(request: Request, num_new: int) -> ScheduledRow:
    """The row the scheduler would make for ``request`` now."""
    return ScheduledRow(request, request.num_computed_tokens, num_new, request.is_prefilling,
                        samples=num_new == request.num_remaining_tokens)


def check_batch(plan: StepPlan, batch: ForwardBatch, block_size: int) -> None:
    """Every field of ``batch`` recomputed from the plan, row by row, the slow and obvious way."""
    rows = plan.rows
    ids, pos, qsl, slots, sample_idx, sample_rows = [], [], [0], [], [], []
    for i, r in enumerate(rows):
        req = r.request
        known = req.prompt_token_ids + req.output_token_ids
        positions = list(range(r.start, r.start + r.num_new_tokens))
        ids += [known[p] for p in positions]
        pos += positions
        slots += [req.block_ids[p // block_size] * block_size + p % block_size for p in positions]
        qsl.append(qsl[-1] + r.num_new_tokens)
        if r.start + r.num_new_tokens == len(known):
            sample_rows.append(i)
            sample_idx.append(qsl[-1] - 1)
        else:
            assert r.start + r.num_new_tokens < len(known)
        if not r.is_prefill:  # hazard 10: a decode's input is its own last known token
            assert batch.input_ids[qsl[i]].item() == known[-1]
    assert batch.input_ids.dtype == torch.int64 and batch.input_ids.tolist() == ids
    assert batch.positions.tolist() == pos
    assert batch.query_start_loc.dtype == torch.int32 and batch.query_start_loc.tolist() == qsl
    assert batch.query_start_loc_cpu == qsl
    assert batch.context_lens.tolist() == [r.request.num_computed_tokens for r in rows]
    seq_lens = [r.request.num_computed_tokens + r.num_new_tokens for r in rows]
    assert batch.seq_lens.tolist() == seq_lens and batch.seq_lens_cpu == seq_lens
    assert batch.is_first_chunk.dtype == torch.int32 and batch.block_tables.dtype == torch.int32
    assert batch.is_first_chunk.tolist() == [r.request.num_computed_tokens == 0 for r in rows]
    assert batch.slot_mapping.dtype == torch.int64 and batch.slot_mapping.tolist() == slots
    width = max(len(r.request.block_ids) for r in rows)
    assert batch.block_tables.dtype == torch.int32
    assert batch.block_tables.tolist() == [
        r.request.block_ids + [PAD_BLOCK_ID] * (width - len(r.request.block_ids)) for r in rows]
    assert batch.sample_indices.dtype == torch.int64
    assert batch.sample_indices.tolist() == sample_idx and batch.sample_rows == sample_rows
    assert batch.num_rows == len(rows) and batch.num_tokens == len(ids)
    assert batch.max_query_len == max(r.num_new_tokens for r in rows)
    assert batch.max_seq_len == max(seq_lens)


def test_mixed_plan_fields_by_hand():
    bs = 4
    decode = make_request("d", [11, 12, 13], outputs=[21, 22], computed=4, block_ids=[7, 3])
    chunk = make_request("c", list(range(30, 40)), block_ids=[5, 9])  # first chunk, stops short
    last = make_request("l", list(range(40, 47)), computed=4, block_ids=[2, 8])  # ends the prompt
    one = make_request("o", [50], block_ids=[6])  # 1-token prompt: a first chunk, not a decode
    plan = StepPlan([row(decode, 1), row(chunk, 6), row(last, 3), row(one, 1)])
    assert [r.is_prefill for r in plan.rows] == [False, True, True, True]
    batch = build_forward_batch(plan, bs, CPU)
    assert batch.input_ids.tolist() == [22, 30, 31, 32, 33, 34, 35, 44, 45, 46, 50]
    assert batch.positions.tolist() == [4, 0, 1, 2, 3, 4, 5, 4, 5, 6, 0]
    assert batch.query_start_loc.tolist() == [0, 1, 7, 10, 11]
    assert batch.context_lens.tolist() == [4, 0, 4, 0]
    assert batch.seq_lens.tolist() == [5, 6, 7, 1]
    assert batch.is_first_chunk.tolist() == [False, True, False, True]
    assert batch.slot_mapping.tolist() == [12, 20, 21, 22, 23, 36, 37, 32, 33, 34, 24]
    assert batch.block_tables.tolist() == [[7, 3], [5, 9], [2, 8], [6, PAD_BLOCK_ID]]
    # Hazards 2 and 3: one index per sampling row, at its last token; none for the short chunk.
    assert batch.sample_rows == [0, 2, 3]
    assert batch.sample_indices.tolist() == [0, 9, 10]
    check_batch(plan, batch, bs)


@pytest.mark.parametrize("prompt_len", [1, 2, 3])
def test_short_new_prompt_is_a_first_chunk_beside_decodes(prompt_len):
    """Hazard 1: a 1-3 token new prompt has the query length of a (speculative) decode."""
    decode = make_request("d", [1, 2, 3, 4], outputs=[9, 8], computed=5, block_ids=[3, 4])
    new = make_request("n", list(range(60, 60 + prompt_len)), block_ids=[5])
    plan = StepPlan([row(decode, 1), row(new, prompt_len)])
    batch = build_forward_batch(plan, 4, CPU)
    assert batch.is_first_chunk.tolist() == [False, True]
    assert batch.context_lens.tolist() == [5, 0]
    assert batch.sample_indices.tolist() == [0, prompt_len]
    assert batch.input_ids.tolist() == [8] + new.prompt_token_ids
    check_batch(plan, batch, 4)


def test_non_terminal_chunks_sample_nothing():
    a = make_request("a", list(range(10, 30)), block_ids=[1, 2, 3])
    b = make_request("b", list(range(30, 50)), computed=8, block_ids=[4, 5, 6])
    plan = StepPlan([row(a, 9), row(b, 4)])
    assert not any(r.samples for r in plan.rows)
    batch = build_forward_batch(plan, 4, CPU)
    assert batch.sample_rows == [] and batch.sample_indices.tolist() == []
    assert batch.sample_indices.dtype == torch.int64
    assert batch.is_first_chunk.tolist() == [True, False]
    check_batch(plan, batch, 4)


def test_decode_after_preemption_uses_the_requests_own_tokens():
    """Hazard 10: after recompute-preemption the outputs are re-prefilled, and the next decode
    reads the request's real last token."""
    cfg = EngineConfig(max_num_batched_tokens=64, block_size=4)
    kv = KVCacheManager(3, 4)  # two usable blocks: a and b fit, a's first decode evicts b
    sched = Scheduler(cfg, kv)
    a = make_request("a", [101, 102, 103, 104], max_tokens=3)
    b = make_request("b", [201, 202, 203, 204], max_tokens=3)
    sched.add(a)
    sched.add(b)
    batches = []
    for _ in range(40):
        if not sched.num_unfinished:
            break
        plan = sched.schedule()
        batch = build_forward_batch(plan, 4, CPU)
        check_batch(plan, batch, 4)
        batches.append((plan, batch))
        sched.advance(plan)
        for i in batch.sample_rows:
            req = plan.rows[i].request
            req.output_token_ids.append(int(req.request_id == "a") * 1000 + 500 + len(req.output_token_ids))
            if len(req.output_token_ids) >= req.max_tokens:
                sched.finish(req, FinishReason.LENGTH)
    assert b.num_preemptions == 1 and not sched.num_unfinished
    b_steps = [(p.rows[i], bt, i) for p, bt in batches for i, r in enumerate(p.rows) if r.request is b]
    # b: prefill, (preempted), re-prefill of prompt + its first output as a first chunk, decode.
    starts = [(r.start, r.num_new_tokens) for r, _, _ in b_steps]
    assert starts == [(0, 4), (0, 5), (5, 1)]
    _, bt, i = b_steps[1]
    q0, q1 = bt.query_start_loc_cpu[i], bt.query_start_loc_cpu[i + 1]
    assert bt.input_ids[q0:q1].tolist() == [201, 202, 203, 204, 500]
    assert bt.is_first_chunk[i].item() and i in bt.sample_rows
    _, bt, i = b_steps[2]
    assert bt.input_ids[bt.query_start_loc_cpu[i]].item() == 501
    assert b.output_token_ids == [500, 501, 502] and a.output_token_ids == [1500, 1501, 1502]


@pytest.mark.parametrize("seed", range(12))
def test_batches_from_random_schedules(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 3, 4, 16])
    cfg = EngineConfig(
        max_num_batched_tokens=rng.choice([1, 3, 8, 32, 200]),
        max_num_seqs=rng.randint(1, 8),
        long_prefill_token_threshold=rng.choice([0, 1, 2, 5, 16]),
        max_num_partial_prefills=rng.randint(1, 3),
        scheduling_policy=rng.choice(["mixed", "prefill_first"]),
        block_size=bs,
    )
    specs = [(rng.choice([1, 2, 3, rng.randint(1, 60)]), rng.randint(1, 6)) for _ in range(rng.randint(1, 8))]
    largest = max(cdiv(p + m, bs) for p, m in specs)
    kv = KVCacheManager(1 + largest + rng.randint(0, 2 * largest), bs)
    sched = Scheduler(cfg, kv)
    requests = [make_request(f"r{i}", [rng.randrange(3, 500) for _ in range(p)], max_tokens=m)
                for i, (p, m) in enumerate(specs)]
    for r in requests:
        sched.add(r)
    for _ in range(5000):
        if not sched.num_unfinished:
            break
        plan = sched.schedule()
        batch = build_forward_batch(plan, bs, CPU)
        check_batch(plan, batch, bs)
        sched.advance(plan)
        for i in batch.sample_rows:
            req = plan.rows[i].request
            req.output_token_ids.append(rng.randrange(3, 500))
            if len(req.output_token_ids) >= req.max_tokens:
                sched.finish(req, FinishReason.LENGTH)
    assert not sched.num_unfinished
    assert all(len(r.output_token_ids) == r.max_tokens for r in requests)


# -- torch_ref attention over the paged cache --------------------------------------------------------

HQ, HKV, HD, BS = 4, 2, 8, 4


def dense_attention(q, k, v, scale, window=None):
    """Causal GQA attention of one request's tokens [L, H, D] over themselves: out, lse."""
    length = q.shape[0]
    k = k.repeat_interleave(HQ // HKV, dim=1)
    v = v.repeat_interleave(HQ // HKV, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    qp, kp = torch.arange(length)[:, None], torch.arange(length)[None, :]
    visible = kp <= qp
    if window is not None:
        visible &= kp > qp - window
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, L]
    out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
    return out, lse.transpose(0, 1)


def run_steps(schedule, seqs, block_ids, num_blocks, scale, window=None):
    """Feed each request's q/k/v through the paged cache in the given steps (lists of (name, n)).

    Returns name -> (out [L, H, D], lse [L, H]) assembled from every step."""
    backend = get_backend("torch_ref")
    cache = torch.zeros(2, num_blocks, BS, HKV, HD)
    reqs = {name: make_request(name, list(range(len(s[0]))), block_ids=block_ids[name])
            for name, s in seqs.items()}
    outs = {name: [] for name in seqs}
    lses = {name: [] for name in seqs}
    for step in schedule:
        plan = StepPlan([row(reqs[name], n) for name, n in step])
        batch = build_forward_batch(plan, BS, CPU)
        parts = [(seqs[r.request.request_id], r.start, r.start + r.num_new_tokens) for r in plan.rows]
        q, k, v = (torch.cat([s[j][a:b] for s, a, b in parts]) for j in range(3))
        backend.store_kv(k, v, cache, batch)
        out, lse = backend.attend(q, cache, batch, scale, sliding_window=window, return_lse=True)
        for i, r in enumerate(plan.rows):
            a, b = batch.query_start_loc_cpu[i], batch.query_start_loc_cpu[i + 1]
            outs[r.request.request_id].append(out[a:b])
            lses[r.request.request_id].append(lse[a:b])
        for r in plan.rows:
            r.request.num_computed_tokens = r.start + r.num_new_tokens
    return {name: (torch.cat(outs[name]), torch.cat(lses[name])) for name in seqs}


@pytest.mark.parametrize("window", [None, 3])
def test_torch_ref_chunked_equals_one_shot_and_dense(window):
    g = torch.Generator().manual_seed(0)
    lens = {"x": 11, "y": 6, "z": 1}
    seqs = {n: tuple(torch.randn(L, h, HD, generator=g) for h in (HQ, HKV, HKV)) for n, L in lens.items()}
    scale = HD**-0.5
    one_shot = run_steps([[("x", 11), ("y", 6), ("z", 1)]], seqs,
                         {"x": [1, 2, 3], "y": [4, 5], "z": [6]}, 8, scale, window)
    # Same tokens in uneven chunks, rows in a different order each step, other blocks entirely.
    chunked = run_steps([[("y", 2), ("x", 5)], [("x", 1), ("z", 1)], [("x", 5), ("y", 4)]], seqs,
                        {"x": [9, 2, 7], "y": [3, 11], "z": [5]}, 12, scale, window)
    for name in lens:
        out_1, lse_1 = one_shot[name]
        out_c, lse_c = chunked[name]
        out_d, lse_d = dense_attention(*seqs[name], scale, window)
        torch.testing.assert_close(out_c, out_1, atol=1e-5, rtol=0)
        torch.testing.assert_close(out_1, out_d, atol=1e-5, rtol=0)
        # return_lse: the log-sum-exp of each query's visible scores, natural log, [T, Hq].
        torch.testing.assert_close(lse_1, lse_d, atol=1e-5, rtol=0)
        torch.testing.assert_close(lse_c, lse_d, atol=1e-5, rtol=0)


def test_torch_ref_padded_path_equals_per_row_path():
    """The batched (padded) and one-row-at-a-time paths of torch_ref agree on a mixed batch."""
    from plait.attention.torch_ref import TorchRefBackend
    from plait.config import EngineConfig
    from plait.engine.kv_cache import KVCacheManager
    from plait.engine.request import Request
    from plait.engine.scheduler import Scheduler
    from plait.sampling_params import SamplingParams

    torch.manual_seed(0)
    bs, hq, hkv, d = 4, 6, 2, 8
    sched = Scheduler(EngineConfig(max_num_batched_tokens=23, block_size=bs), KVCacheManager(64, bs))
    for i, n in enumerate([1, 9, 30, 2]):
        sched.add(Request(f"p{i}", list(range(3, 3 + n)), SamplingParams(), max_tokens=4))
    cache = torch.randn(2, 64, bs, hkv, d)
    for _ in range(4):  # a few steps so rows have cached context and some are decodes
        plan = sched.schedule()
        batch = build_forward_batch(plan, bs, torch.device("cpu"))
        q = torch.randn(batch.num_tokens, hq, d)
        results = []
        for limit in (TorchRefBackend.max_padded_scores, 0):
            backend = TorchRefBackend()
            backend.max_padded_scores = limit
            batch.backend_state.clear()
            for window in (None, 5):
                results.append(backend.attend(q, cache, batch, 0.3, window, return_lse=True))
        for (o1, l1), (o2, l2) in zip(results[:2], results[2:]):
            torch.testing.assert_close(o1, o2, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(l1, l2, atol=1e-5, rtol=1e-5)
        sched.advance(plan)
        for row in plan.rows:
            if row.samples:
                row.request.output_token_ids.append(5)


def test_attention_with_rotary_rotates_then_stores_and_attends():
    """batch.attention(..., rotary=) equals rotating q and k first and attending without it: the same cache
    written, the same output."""
    from plait.layers.rotary import RotaryEmbedding

    torch.manual_seed(1)
    sched = Scheduler(EngineConfig(max_num_batched_tokens=16, block_size=BS), KVCacheManager(16, BS))
    for i, n in enumerate([7, 3]):
        sched.add(make_request(f"p{i}", list(range(3, 3 + n))))
    batch = build_forward_batch(sched.schedule(), BS, CPU)
    rope = RotaryEmbedding(HD, 32, 10000.0)
    q, k, v = (torch.randn(batch.num_tokens, h, HD) for h in (HQ, HKV, HKV))
    batch.attn_backend = get_backend("torch_ref")
    batch.kv_caches = [torch.zeros(2, 16, BS, HKV, HD), torch.zeros(2, 16, BS, HKV, HD)]
    fused = batch.attention(0, q, k, v, 0.3, rotary=rope)
    q_rot, k_rot = rope(batch.positions, q, k)
    apart = batch.attention(1, q_rot, k_rot, v, 0.3)
    assert torch.equal(batch.kv_caches[0], batch.kv_caches[1])
    assert torch.equal(fused, apart)


def _step_arrays(num_tokens: int, num_rows: int, first_id: int):
    """A prompt step of ``num_rows`` rows sharing ``num_tokens`` tokens (ids counting from first_id)."""
    import numpy as np

    from plait.runner.forward_batch import StepArrays

    lens = [num_tokens // num_rows] * num_rows
    lens[-1] += num_tokens - sum(lens)
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    return StepArrays(
        input_ids=np.arange(first_id, first_id + num_tokens, dtype=np.int64),
        positions=np.concatenate([np.arange(n) for n in lens]).astype(np.int64),
        slot_mapping=np.arange(num_tokens, dtype=np.int64) + 32,
        query_start_loc=qsl,
        context_lens=np.zeros(num_rows, dtype=np.int64),
        seq_lens=np.array(lens, dtype=np.int64),
        is_first_chunk=np.ones(num_rows, dtype=np.int64),
        state_slots=np.arange(num_rows, dtype=np.int64),
        block_tables=np.arange(num_rows * 3, dtype=np.int64).reshape(num_rows, 3) + first_id,
        sample_indices=qsl[1:] - 1,
        sample_rows=list(range(num_rows)),
    )


def test_compact_and_full_layouts_share_the_input_buffer():
    """Steps that fit the compact layout stage there (fixed addresses for graphs, a short copy); larger
    ones use the full layout of the same buffer. Alternating them, every step reads its own arrays."""
    import numpy as np

    from plait.runner.input_buffers import InputBuffers, Layout

    layout = Layout(max_tokens=512, max_rows=9, block_table_width=4)
    buffers = InputBuffers(layout, CPU, compact_tokens=16)
    assert buffers.layout_for(16) == Layout(16, 9, 4) and buffers.layout_for(17) == layout
    none = np.zeros(0, dtype=np.int64)
    compact_ptrs = set()
    for step, (tokens, rows) in enumerate([(8, 8), (300, 3), (16, 4), (512, 9), (1, 1)]):
        arrays = _step_arrays(tokens, rows, first_id=1000 * step)
        views = buffers.stage(arrays, none)
        for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens",
                     "state_slots", "block_tables", "sample_indices"):
            assert views[name].tolist() == getattr(arrays, name).tolist(), (step, name)
        if tokens <= 16:
            compact_ptrs.add(views["block_tables"].data_ptr())
    assert len(compact_ptrs) == 1  # a graph captured on the compact layout reads where later steps stage
    with pytest.raises(ValueError, match="exceeds the input buffers"):
        buffers.stage(_step_arrays(513, 2, 0), none)


def test_staged_pending_ids_land_from_the_previous_steps_sampled_ids():
    """A row whose input id is still on the device is staged as a marker and lands as the previous step's
    sampled id at its source index; every other token keeps its own id, and the int32 fields land in
    the mirror."""
    import numpy as np

    from plait.runner.input_buffers import InputBuffers, Layout

    buffers = InputBuffers(Layout(max_tokens=64, max_rows=9, block_table_width=4), CPU)
    arrays = _step_arrays(12, 4, first_id=500)
    arrays.pending_rows = [1, 3]
    prev_ids = torch.tensor([70, 71, 72])
    views = buffers.stage(arrays, np.array([2, 0]), prev_ids)
    want = arrays.input_ids.copy()
    want[arrays.query_start_loc[2] - 1], want[arrays.query_start_loc[4] - 1] = 72, 70
    assert views["input_ids"].tolist() == want.tolist()
    assert views["query_start_loc"].dtype == torch.int32
    assert views["query_start_loc"].tolist() == arrays.query_start_loc.tolist()


def test_a_pending_last_draft_is_a_pending_input_at_its_own_token():
    """A draft model's last draft still on the device (PENDING_DRAFT_ID) makes its row pending at that draft's
    token, its known tokens and other drafts staged as they are; a row with its own last token pending too is
    refused (the drafter only defers where every known token is on the host)."""
    from plait.engine.drafter import PENDING_DRAFT_ID
    from plait.runner.forward_batch import build_step_arrays

    a = make_request("a", [1, 2, 3], outputs=[4], computed=3, block_ids=[0])
    b = make_request("b", [5, 6], outputs=[7], computed=2, block_ids=[1])
    plan = StepPlan([ScheduledRow(a, 3, 3, False, True, draft_token_ids=(40, PENDING_DRAFT_ID)),
                     ScheduledRow(b, 2, 3, False, True, draft_token_ids=(50, 51))])
    arrays = build_step_arrays(plan, block_size=8)
    assert arrays.pending_rows == [0] and arrays.pending_token_indices.tolist() == [2]
    assert arrays.input_ids.tolist()[:2] == [4, 40] and arrays.input_ids.tolist()[3:] == [7, 50, 51]
    a.num_pending_tokens, a.output_token_ids = 1, []  # its last known token in flight as well
    with pytest.raises(ValueError, match="a pending token and a pending draft"):
        build_step_arrays(plan, block_size=8)
