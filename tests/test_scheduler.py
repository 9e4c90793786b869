"""Scheduler properties: budget, decode-first, chunk cap, first-chunk/sampling, FCFS, blocks, liveness."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plait.config import EngineConfig
from plait.engine.kv_cache import PAD_BLOCK_ID, KVCacheManager, cdiv
from plait.engine.request import FinishReason, Request, RequestStatus
from plait.engine.scheduler import Scheduler, StepPlan, aligned_prefill_cap, prefill_cap
from plait.sampling_params import SamplingParams

PARAMS = SamplingParams()


def make_request(i: int, prompt_len: int, max_tokens: int, priority: int = 0) -> Request:
    prompt = [100 + (7 * i + j) % 900 for j in range(prompt_len)]
    return Request(f"r{i}", prompt, PARAMS, max_tokens=max_tokens, priority=priority)


def is_long(cfg: EngineConfig, request: Request) -> bool:
    """A prompt that max_long_partial_prefills limits: over long_prefill_token_threshold, where one is set."""
    return 0 < cfg.long_prefill_token_threshold < request.num_prefill_tokens


def fake_token(request: Request) -> int:
    return 5000 + len(request.output_token_ids)


def complete_step(sched: Scheduler, plan: StepPlan) -> list[Request]:
    """What the engine does after the model ran: advance, append one token per sampling row, retire."""
    sampling = [row.request for row in plan.rows if row.samples]
    sched.advance(plan)
    done = []
    for request in sampling:
        request.output_token_ids.append(fake_token(request))
        if len(request.output_token_ids) >= request.max_tokens:
            sched.finish(request, FinishReason.LENGTH)
            done.append(request)
    return done


def describe(plan: StepPlan) -> list[tuple[str, int, int, bool, bool]]:
    return [(r.request.request_id, r.start, r.num_new_tokens, r.is_prefill, r.samples) for r in plan.rows]


# -- the simulated engine loop, checked at every step -------------------------------------------


@dataclass
class Scenario:
    config: EngineConfig
    num_blocks: int
    requests: list[tuple[int, int, int]]  # (prompt_len, max_tokens, arrival_step), in arrival order
    aborts: list[tuple[int, int]] = field(default_factory=list)  # (request index, step)
    priorities: list[int] = field(default_factory=list)  # one per request under "priority", else none


@st.composite
def scenarios(draw) -> Scenario:
    block_size = draw(st.integers(1, 32))
    threshold = draw(st.one_of(st.just(0), st.integers(1, 64)))
    max_partial = draw(st.integers(1, 4))
    config = EngineConfig(
        max_num_batched_tokens=draw(st.one_of(st.integers(1, 16), st.integers(1, 600))),
        max_num_seqs=draw(st.integers(1, 16)),
        long_prefill_token_threshold=threshold,
        max_prefill_tokens_beside_decodes=draw(st.one_of(st.just(0), st.integers(1, 64))),
        prefill_drain_steps=draw(st.one_of(st.just(0), st.integers(1, 8))),
        max_num_partial_prefills=max_partial,
        # A limit on long ones needs the threshold that says which prompts are long.
        max_long_partial_prefills=draw(st.one_of(st.none(), st.integers(1, max_partial)))
        if threshold else None,
        scheduling_policy=draw(st.sampled_from(["mixed", "prefill_first", "priority"])),
        block_size=block_size,
    )
    prompt_len = st.one_of(st.integers(1, 3), st.integers(1, 40), st.integers(1, 300))
    arrival = st.integers(0, 30)
    specs = draw(st.lists(st.tuples(prompt_len, st.integers(1, 20), arrival), min_size=1, max_size=10))
    specs.sort(key=lambda s: s[2])  # arrival order == index order
    largest = max(cdiv(p + m, block_size) for p, m, _ in specs)
    total = sum(cdiv(p + m, block_size) for p, m, _ in specs)
    # Mostly tight pools (preemption), sometimes roomy ones.
    extra = draw(st.one_of(st.integers(0, 3), st.integers(0, max(0, total - largest))))
    aborts = draw(st.lists(st.tuples(st.integers(0, len(specs) - 1), st.integers(0, 80)), max_size=3))
    priorities = []
    if config.serves_by_priority:
        priorities = draw(st.lists(st.integers(-2, 2), min_size=len(specs), max_size=len(specs)))
    return Scenario(config, 1 + largest + extra, specs, aborts, priorities)


def step_bound(sc: Scenario) -> int:
    """Steps within which every request must finish. Under ``mixed`` each step computes a token of
    real progress, so about the total work; under ``prefill_first`` a prompt that cannot fit beside
    the running decodes is recomputed once per decode token it lets through."""
    total_work = sum(p + m for p, m, _ in sc.requests)
    last_arrival = sc.requests[-1][2]
    if sc.config.scheduling_policy == "mixed":
        return last_arrival + 2 * total_work + 10
    if sc.config.serves_by_priority:  # each admission of a higher priority may restart every lower one
        return last_arrival + 2 * total_work * (1 + len(sc.requests)) + 10
    return last_arrival + total_work * (2 + len(sc.requests) + sum(m for _, m, _ in sc.requests))


class Checker:
    """Runs the engine loop over a Scenario and checks every invariant at every step."""

    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        self.cfg = sc.config
        self.bs = sc.config.block_size
        self.kv = KVCacheManager(sc.num_blocks, self.bs)
        self.sched = Scheduler(self.cfg, self.kv)
        priorities = sc.priorities or [0] * len(sc.requests)
        self.requests = [make_request(i, p, m, priorities[i]) for i, (p, m, _) in enumerate(sc.requests)]
        self.aborted: set[int] = set()

    def run(self) -> int:
        sc, sched = self.sc, self.sched
        bound = step_bound(sc)
        added = 0
        step = 0
        while True:
            while added < len(self.requests) and sc.requests[added][2] <= step:
                sched.add(self.requests[added])
                added += 1
            for i, at in sc.aborts:
                if at == step and i < added and not self.requests[i].is_finished:
                    sched.finish(self.requests[i], FinishReason.ABORT)
                    self.aborted.add(i)
            if added == len(self.requests) and sched.num_unfinished == 0:
                break
            assert step < bound, f"not finished after {step} steps: starvation or livelock"
            self.one_step()
            step += 1
        self.check_idle()
        return step

    def one_step(self) -> None:
        sched, cfg = self.sched, self.cfg
        running_before = list(sched.running)
        waiting_before = list(sched.waiting)
        decodes_before = [r for r in running_before if not r.is_prefilling]
        computed_before = {id(r): r.num_computed_tokens for r in running_before + list(sched.waiting)}
        num_unfinished = sched.num_unfinished
        backlog = sched.prompt_backlog()
        # Independently: the prompt tokens still to compute that the last prompt in service order waits
        # behind (running prompts are served before waiting ones).
        in_line = [r.num_prefill_tokens - r.num_computed_tokens
                   for r in running_before + waiting_before if r.is_prefilling]
        assert backlog == sum(in_line[:-1])

        plan = sched.schedule()
        rows = plan.rows
        preempted = {id(r) for r in plan.preempted}

        # A plan is empty only when there is nothing to do (the pool fits any single request).
        assert rows or num_unfinished == 0, f"empty plan with {num_unfinished} unfinished requests"
        # Budget and rows.
        assert plan.num_tokens <= cfg.max_num_batched_tokens
        assert len(rows) <= cfg.max_num_seqs
        cap = prefill_cap(cfg, backlog)
        assert cap >= cfg.max_prefill_tokens_beside_decodes or not cfg.max_prefill_tokens_beside_decodes
        if not cfg.prefills_first and cap and plan.num_decode_tokens:
            assert plan.num_prefill_tokens <= cap, "prompt tokens beside decodes over the cap"
        assert len({id(r.request) for r in rows}) == len(rows), "a request appears twice in one plan"
        for row in rows:
            req = row.request
            assert row.num_new_tokens >= 1
            assert req.status is RequestStatus.RUNNING and id(req) not in {id(r) for r in sched.waiting}
            if cfg.long_prefill_token_threshold:
                assert row.num_new_tokens <= cfg.long_prefill_token_threshold
            expected_start = 0 if id(req) in preempted else computed_before[id(req)]
            assert row.start == expected_start
            assert row.is_first_chunk == (row.start == 0) == (expected_start == 0)
            known = len(req.prompt_token_ids) + len(req.output_token_ids)
            assert row.start + row.num_new_tokens <= known, "scheduled past the known tokens"
            assert row.samples == (row.start + row.num_new_tokens == known)
            if row.start + row.num_new_tokens < len(req.prompt_token_ids):
                assert not row.samples, "a chunk that does not finish the prompt must not sample"
            if row.start == 0:
                assert row.is_prefill, "a first chunk (of any length, even 1 token) is a prefill"
            if not row.is_prefill:
                assert row.num_new_tokens == 1 and row.start == known - 1 and row.samples
            # Block table covers every token this row writes.
            assert len(req.block_ids) == cdiv(row.start + row.num_new_tokens, self.bs)

        # Row order by policy.
        kinds = [r.is_prefill for r in rows]
        if not cfg.prefills_first:
            assert kinds == sorted(kinds), f"decode rows must precede prefill rows: {describe(plan)}"
            if any(kinds) and len(rows) < cfg.max_num_seqs:
                scheduled = {id(r.request) for r in rows}
                starved = [d.request_id for d in decodes_before
                           if d.status is RequestStatus.RUNNING and id(d) not in scheduled]
                assert not starved, f"decodes {starved} starved by prefills: {describe(plan)}"
        else:
            assert kinds == sorted(kinds, reverse=True), f"prefill rows must come first: {describe(plan)}"

        # Preemption victims are the newest running requests: a suffix of the running list.
        victims = [i for i, r in enumerate(running_before) if id(r) in preempted]
        assert victims == list(range(len(running_before) - len(victims), len(running_before)))
        for r in plan.preempted:
            assert r.num_preemptions >= 1
            if r.status is RequestStatus.WAITING:
                assert r.block_ids == [] and r.num_computed_tokens == 0

        # FCFS: admissions are a prefix of the waiting queue (whose order check_state checks: preempted
        # requests first, then fresh ones by arrival, or by (priority, arrival)); none in a step that
        # preempted a running request, but under priority, where a strictly higher priority took its blocks.
        # Under max_long_partial_prefills, long prompts may be passed over while long partial prefills are
        # full: those running before the step (a victim of this step's preemptions too) that this step does
        # not complete, and those admitted before it in this step.
        admitted = [r.request for r in rows if r.start == 0]
        completes = {id(row.request) for row in rows
                     if row.start + row.num_new_tokens >= row.request.num_prefill_tokens}
        long_running = sum(1 for r in running_before
                           if r.is_prefilling and is_long(cfg, r) and id(r) not in completes)
        in_order = []
        for r in waiting_before[: waiting_before.index(admitted[-1]) + 1] if admitted else []:
            if r in admitted:
                in_order.append(r)
                long_running += is_long(cfg, r) and id(r) not in completes
            else:
                limit = cfg.long_partial_prefills_limit
                assert is_long(cfg, r) and long_running >= limit < cfg.max_num_partial_prefills, (
                    f"{r.request_id} was passed over by {[a.request_id for a in admitted]}")
        assert admitted == in_order, (
            f"admitted {[r.request_id for r in admitted]} out of queue order "
            f"{[r.request_id for r in waiting_before]}")
        assert not any(id(r.request) in preempted for r in rows), "a request preempted this step runs in it"
        if any(id(r) in preempted for r in running_before):
            lowest_admitted = max((r.priority for r in admitted), default=None)
            assert not admitted or (cfg.serves_by_priority and all(
                r.priority > lowest_admitted for r in plan.preempted)), (
                "a request preempted this step was re-admitted (or overtaken) at once")

        complete_step(self.sched, plan)
        self.check_state()

    def check_state(self) -> None:
        sched, kv, cfg = self.sched, self.kv, self.cfg
        held: list[int] = []
        for r in sched.running:
            assert r.status is RequestStatus.RUNNING
            assert 1 <= r.num_computed_tokens <= r.num_tokens - 1
            assert len(r.block_ids) == cdiv(r.num_computed_tokens, self.bs)
            held += r.block_ids
        assert all(PAD_BLOCK_ID < b < kv.num_blocks for b in held)
        assert len(set(held)) == len(held), "a block is held by two requests"
        assert kv.num_free_blocks + len(held) == kv.num_usable_blocks
        # Waiting: no blocks, no progress; preempted ones at the front, fresh ones in arrival order (under
        # priority, both queues in (priority, arrival) order).
        waiting = list(sched.waiting)
        for r in waiting:
            assert r.status is RequestStatus.WAITING and r.block_ids == [] and r.num_computed_tokens == 0
        if cfg.serves_by_priority:
            for queue in (waiting, sched.running):
                keys = [(r.priority, r.arrival_index) for r in queue]
                assert keys == sorted(keys), f"queue out of (priority, arrival) order: {keys}"
            waiting = []  # the FCFS checks below do not apply
        fresh = [r.arrival_index for r in waiting if r.num_preemptions == 0]
        assert fresh == sorted(fresh)
        flags = [r.num_preemptions > 0 for r in waiting]
        assert flags == sorted(flags, reverse=True), "a preempted request is queued behind a fresh one"
        # Requests part-way through their known tokens (beyond the last one) are partial prefills.
        partial = [r for r in sched.running if r.is_prefilling]
        assert len(partial) <= cfg.max_num_partial_prefills
        assert sum(is_long(cfg, r) for r in partial) <= cfg.long_partial_prefills_limit
        for r in self.requests:
            if r.is_finished:
                assert r.block_ids == []

    def check_idle(self) -> None:
        sched, kv = self.sched, self.kv
        assert not sched.running and not sched.waiting
        assert kv.num_free_blocks == kv.num_usable_blocks
        for i, r in enumerate(self.requests):
            if i in self.aborted:
                assert r.finish_reason is FinishReason.ABORT
            else:
                assert r.finish_reason is FinishReason.LENGTH
                assert r.output_token_ids == [5000 + k for k in range(r.max_tokens)]
        # Every usable block is really back in the pool: one request can take them all.
        probe = make_request(999, 1, 1)
        assert kv.allocate(probe, kv.num_usable_blocks * self.bs)
        assert sorted(probe.block_ids) == list(range(1, kv.num_blocks))
        kv.free(probe)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_scheduler_invariants_hold_at_every_step(sc: Scenario) -> None:
    Checker(sc).run()


# -- deterministic cases ---------------------------------------------------------------------------


def _scheduler(num_blocks: int = 512, **kw) -> tuple[Scheduler, KVCacheManager]:
    cfg = EngineConfig(**kw)
    kv = KVCacheManager(num_blocks, cfg.block_size)
    return Scheduler(cfg, kv), kv


def _start_decoding(sched: Scheduler, requests: list[Request]) -> None:
    """Prefill ``requests`` (one step, they must fit) so each is decoding afterwards."""
    for r in requests:
        sched.add(r)
    plan = sched.schedule()
    assert [r.request for r in plan.rows] == requests and all(r.samples for r in plan.rows)
    complete_step(sched, plan)
    assert all(not r.is_prefilling for r in requests)


def test_mixed_reserves_decode_tokens_before_a_long_prompt():
    sched, _ = _scheduler(max_num_batched_tokens=4, scheduling_policy="mixed", block_size=4)
    decoders = [make_request(i, 1, 10) for i in range(3)]
    _start_decoding(sched, decoders)
    long = make_request(3, 100, 5)
    sched.add(long)
    plan = sched.schedule()
    assert describe(plan) == [("r0", 1, 1, False, True), ("r1", 1, 1, False, True),
                              ("r2", 1, 1, False, True), ("r3", 0, 1, True, False)]
    assert plan.num_decode_tokens == 3 and plan.num_prefill_tokens == 1


def test_prefill_first_puts_prefill_rows_first():
    kw = dict(max_num_batched_tokens=10, long_prefill_token_threshold=6, block_size=4)
    for policy, expected in [
        ("prefill_first", [("r3", 0, 6, True, False), ("r0", 1, 1, False, True),
                           ("r1", 1, 1, False, True), ("r2", 1, 1, False, True)]),
        ("mixed", [("r0", 1, 1, False, True), ("r1", 1, 1, False, True),
                   ("r2", 1, 1, False, True), ("r3", 0, 6, True, False)]),
    ]:
        sched, _ = _scheduler(scheduling_policy=policy, **kw)
        _start_decoding(sched, [make_request(i, 1, 10) for i in range(3)])
        sched.add(make_request(3, 100, 5))
        assert describe(sched.schedule()) == expected, policy


def test_prefill_first_can_starve_decodes_mixed_cannot():
    for policy, decoded in [("prefill_first", False), ("mixed", True)]:
        sched, _ = _scheduler(max_num_batched_tokens=8, scheduling_policy=policy, block_size=4)
        _start_decoding(sched, [make_request(0, 2, 10)])
        sched.add(make_request(1, 100, 5))
        plan = sched.schedule()
        assert any(r.request.request_id == "r0" for r in plan.rows) == decoded, describe(plan)
        assert plan.num_tokens == 8


@pytest.mark.parametrize("prompt_len", [1, 2, 3])
def test_short_new_prompts_are_first_chunks_and_sample(prompt_len):
    """Hazard 1: a new 1-3 token prompt looks like a (speculative) decode by length; it is not."""
    sched, _ = _scheduler(max_num_batched_tokens=64, block_size=2)
    _start_decoding(sched, [make_request(0, 5, 10)])
    new = make_request(1, prompt_len, 3)
    sched.add(new)
    plan = sched.schedule()
    old_row, new_row = plan.rows
    assert (old_row.is_first_chunk, old_row.is_prefill) == (False, False)
    assert new_row.request is new
    assert new_row.is_first_chunk and new_row.start == 0 and new_row.is_prefill
    assert new_row.num_new_tokens == prompt_len and new_row.samples
    complete_step(sched, plan)
    plan = sched.schedule()
    row = next(r for r in plan.rows if r.request is new)
    assert (row.start, row.num_new_tokens, row.is_first_chunk, row.is_prefill, row.samples) == (
        prompt_len, 1, False, False, True)


def test_chunked_prompt_samples_only_on_its_last_chunk():
    sched, _ = _scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=4, block_size=3)
    r = make_request(0, 10, 2)
    sched.add(r)
    seen = []
    while not r.is_finished:
        plan = sched.schedule()
        seen.append(describe(plan)[0][1:])
        complete_step(sched, plan)
    # 4 + 4 + 2 prompt tokens: only the chunk that ends the prompt samples; then one decode.
    assert seen == [(0, 4, True, False), (4, 4, True, False), (8, 2, True, True), (10, 1, False, True)]


def test_preemption_takes_the_newest_and_it_resumes_first():
    # Pool of 2 usable 4-token blocks: two 4-token prompts fill it; the first decode needs a third.
    sched, kv = _scheduler(num_blocks=3, max_num_batched_tokens=64, block_size=4)
    a, b = make_request(0, 4, 3), make_request(1, 4, 3)
    _start_decoding(sched, [a, b])
    late = make_request(2, 1, 1)
    sched.add(late)
    b_blocks = list(b.block_ids)
    plan = sched.schedule()
    assert plan.preempted == [b]
    assert describe(plan) == [("r0", 4, 1, False, True)]
    assert a.block_ids[1:] == b_blocks  # the victim's block went to the survivor
    assert (b.status, b.num_computed_tokens, b.block_ids, b.num_preemptions) == (
        RequestStatus.WAITING, 0, [], 1)
    assert list(sched.waiting) == [b, late]  # back at the FRONT, ahead of a later arrival
    complete_step(sched, plan)
    # a decodes to the end; b waits (its 5 known tokens need 2 blocks) and late waits behind it.
    while not a.is_finished:
        plan = sched.schedule()
        assert [r.request for r in plan.rows] == [a]
        complete_step(sched, plan)
    plan = sched.schedule()
    # b re-prefills its prompt and its one output, as a first chunk that samples; it takes both
    # blocks, so late (arrived after b's first admission) still waits behind it.
    assert describe(plan) == [("r1", 0, 5, True, True)]
    assert b.token_ids(0, 5) == b.prompt_token_ids + [5000]
    complete_step(sched, plan)
    assert list(sched.waiting) == [late]
    while sched.num_unfinished:
        complete_step(sched, sched.schedule())
    assert b.output_token_ids == [5000, 5001, 5002] and late.output_token_ids == [5000]
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_preemption_of_a_running_prefill_frees_its_row_budget():
    # prefill_first: the old request's decode (scheduled last) preempts the just-admitted newest one.
    sched, kv = _scheduler(num_blocks=4, max_num_batched_tokens=64, block_size=4,
                           scheduling_policy="prefill_first")
    a = make_request(0, 8, 3)
    _start_decoding(sched, [a])
    b = make_request(1, 4, 2)
    sched.add(b)
    plan = sched.schedule()
    assert plan.preempted == [b] and describe(plan) == [("r0", 8, 1, False, True)]
    assert plan.num_tokens == 1 and list(sched.waiting) == [b] and kv.num_free_blocks == 0


def test_max_num_partial_prefills_and_fcfs():
    sched, _ = _scheduler(max_num_batched_tokens=100, long_prefill_token_threshold=4,
                          max_num_partial_prefills=2, block_size=4)
    reqs = [make_request(i, 20, 2) for i in range(3)] + [make_request(3, 2, 2)]
    for r in reqs:
        sched.add(r)
    plan = sched.schedule()
    # r2 would be a third partial prefill; r3 (one chunk) may not overtake it.
    assert describe(plan) == [("r0", 0, 4, True, False), ("r1", 0, 4, True, False)]
    complete_step(sched, plan)
    plan = sched.schedule()
    assert describe(plan) == [("r0", 4, 4, True, False), ("r1", 4, 4, True, False)]


def test_partial_prefill_limit_lets_a_completing_chunk_through():
    sched, _ = _scheduler(max_num_batched_tokens=100, long_prefill_token_threshold=4,
                          max_num_partial_prefills=1, block_size=4)
    reqs = [make_request(0, 20, 2), make_request(1, 3, 2), make_request(2, 20, 2)]
    for r in reqs:
        sched.add(r)
    plan = sched.schedule()
    # r1 finishes its prompt in this chunk, so it is not a partial prefill; r2 would be one.
    assert describe(plan) == [("r0", 0, 4, True, False), ("r1", 0, 3, True, True)]


def test_max_num_seqs_and_abort_return_blocks():
    sched, kv = _scheduler(max_num_batched_tokens=100, max_num_seqs=2, block_size=4)
    reqs = [make_request(i, 5, 3) for i in range(3)]
    for r in reqs:
        sched.add(r)
    plan = sched.schedule()
    assert [r.request for r in plan.rows] == reqs[:2]
    complete_step(sched, plan)
    sched.finish(reqs[0], FinishReason.ABORT)
    sched.finish(reqs[2], FinishReason.ABORT)  # still waiting: holds nothing, leaves the queue
    assert reqs[0].block_ids == [] and not sched.waiting and sched.running == [reqs[1]]
    assert kv.num_free_blocks == kv.num_usable_blocks - 2
    plan = sched.schedule()
    assert describe(plan) == [("r1", 5, 1, False, True)]


def test_partial_prefill_limit_counts_a_prompt_one_token_short():
    sched, _ = _scheduler(max_num_batched_tokens=4, long_prefill_token_threshold=4,
                          max_num_partial_prefills=1, block_size=4, scheduling_policy="prefill_first")
    a, b = make_request(0, 5, 4), make_request(1, 10, 4)
    sched.add(a)
    sched.add(b)
    for _ in range(3):
        complete_step(sched, sched.schedule())
        mid_prompt = [r for r in sched.running if r.num_computed_tokens < r.num_prompt_tokens]
        assert len(mid_prompt) <= 1, [r.request_id for r in mid_prompt]


def test_prefill_first_does_not_livelock_when_a_prompt_cannot_fit_beside_a_decode():
    # 8 blocks of 16: a (48-token prompt, decoding) and b (100-token prompt) each fit, not together.
    # b fills the pool, preempts itself; re-admitted in the same step it restarted from 0 forever
    # while a, a decode behind b's chunks under prefill_first, never ran.
    sched, kv = _scheduler(num_blocks=9, max_num_batched_tokens=32, block_size=16,
                           scheduling_policy="prefill_first")
    a, b = make_request(0, 48, 20), make_request(1, 100, 4)
    sched.add(a)
    sched.add(b)
    for _ in range(300):
        if not sched.num_unfinished:
            break
        complete_step(sched, sched.schedule())
    assert sched.num_unfinished == 0, (len(a.output_token_ids), len(b.output_token_ids), b.num_preemptions)
    assert len(a.output_token_ids) == 20 and len(b.output_token_ids) == 4
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_prompt_backlog_raises_the_cap_beside_decodes():
    """A pile of prompt tokens drains in about prefill_drain_steps steps: the cap beside decodes rises
    to backlog / prefill_drain_steps, never below max_prefill_tokens_beside_decodes; 0 keeps it fixed.
    The backlog is what the last prompt in line waits behind, so a lone prompt never raises it."""
    kw = dict(max_num_batched_tokens=512, max_prefill_tokens_beside_decodes=8, block_size=4)
    for drain, want in ((4, 50), (0, 8), (100, 8)):  # r3 waits behind 200: 200/4 = 50; fixed; 2 < 8
        sched, _ = _scheduler(prefill_drain_steps=drain, **kw)
        _start_decoding(sched, [make_request(0, 2, 10)])
        for i, n in ((1, 120), (2, 80), (3, 40)):
            sched.add(make_request(i, n, 5))
        assert sched.prompt_backlog() == 200
        plan = sched.schedule()
        assert plan.num_decode_tokens == 1 and plan.num_prefill_tokens == want
    # Only what is not yet computed counts, the running prompt's too.
    sched, _ = _scheduler(prefill_drain_steps=4, **kw)
    _start_decoding(sched, [make_request(0, 2, 10)])
    sched.add(make_request(1, 120, 5))
    sched.add(make_request(2, 40, 5))
    sched.advance(sched.schedule())  # 30 of r1's 120 tokens (120 / 4) are computed
    assert sched.prompt_backlog() == 90
    # A lone long prompt beside decodes (W4): nobody waits behind it, so it rides in capped chunks.
    sched, _ = _scheduler(prefill_drain_steps=4, **kw)
    _start_decoding(sched, [make_request(0, 2, 10)])
    sched.add(make_request(1, 400, 5))
    assert sched.prompt_backlog() == 0
    assert sched.schedule().num_prefill_tokens == 8


def test_prompts_beside_decodes_are_capped_but_always_progress():
    """Under mixed, a step with decode rows carries at most max_prefill_tokens_beside_decodes prompt
    tokens, so a long prompt is spread over decode-sized steps; a step without decodes takes the full
    budget; and when decodes alone nearly fill the budget the prompt still gets what is left."""
    sched, _ = _scheduler(max_num_batched_tokens=64, max_prefill_tokens_beside_decodes=8, block_size=4)
    long = make_request(1, 100, 5)
    sched.add(long)
    assert describe(sched.schedule()) == [("r1", 0, 64, True, False)]  # no decodes: the whole budget
    sched, _ = _scheduler(max_num_batched_tokens=64, max_prefill_tokens_beside_decodes=8, block_size=4)
    _start_decoding(sched, [make_request(0, 2, 10)])
    sched.add(make_request(1, 100, 5))
    assert describe(sched.schedule()) == [("r0", 2, 1, False, True), ("r1", 0, 8, True, False)]
    sched, _ = _scheduler(max_num_batched_tokens=4, max_prefill_tokens_beside_decodes=8, block_size=4)
    _start_decoding(sched, [make_request(i, 1, 10) for i in range(3)])
    sched.add(make_request(3, 100, 5))
    assert describe(sched.schedule())[-1] == ("r3", 0, 1, True, False)


def test_prompt_tokens_beside_decodes_end_the_step_on_a_row_tile():
    """The cap beside decodes is trimmed so the step's tokens fill whole GEMM row tiles (4 rows past a
    tile cost a whole tile), unless that would keep less than half of the cap."""
    assert aligned_prefill_cap(4, 256) == 252
    assert aligned_prefill_cap(3, 256) == 253
    assert aligned_prefill_cap(200, 256) == 184  # 384 in all
    assert aligned_prefill_cap(0, 256) == 256
    assert aligned_prefill_cap(4, 32) == 32  # trimming to a tile would take all of it
    assert aligned_prefill_cap(100, 100) == 100  # 128 - 100 = 28 < half
    kw = dict(max_num_batched_tokens=2048, max_prefill_tokens_beside_decodes=256, prefill_drain_steps=0)
    sched, _ = _scheduler(block_size=16, num_blocks=512, **kw)
    _start_decoding(sched, [make_request(i, 2, 100) for i in range(4)])
    sched.add(make_request(9, 4096, 5))
    plan = sched.schedule()
    assert (plan.num_decode_tokens, plan.num_prefill_tokens) == (4, 252)


def test_a_preemption_in_the_step_does_not_raise_the_cap_beside_decodes(monkeypatch):
    """The cap beside decodes follows the backlog as the step starts: the tokens of a request that a decode
    preempts in the same step (the pool is short of blocks, not of prompt room) do not raise it. Found by
    test_scheduler_invariants_hold_at_every_step, whose checker takes the cap from the backlog before the
    step."""
    from plait.engine import scheduler as scheduler_module

    # 3 usable 4-token blocks: a (4 tokens, 1 block) and b (8 tokens, 2 blocks) decode; a's first decode
    # needs a fourth block, so b is preempted.
    sched, _ = _scheduler(num_blocks=4, max_num_batched_tokens=64, block_size=4,
                          max_prefill_tokens_beside_decodes=1, prefill_drain_steps=4)
    a, b = make_request(0, 4, 5), make_request(1, 8, 5)
    _start_decoding(sched, [a, b])
    sched.add(make_request(2, 8, 1))
    sched.add(make_request(3, 1, 1))  # r2's 8 tokens are queued ahead of it
    backlog = sched.prompt_backlog()
    capped = []
    cap = scheduler_module._StepBuilder.cap_prefill_beside_decodes
    monkeypatch.setattr(scheduler_module._StepBuilder, "cap_prefill_beside_decodes",
                        lambda step, given: (capped.append(given), cap(step, given))[1])
    plan = sched.schedule()
    assert plan.preempted == [b] and sched.prompt_backlog() == backlog + 9  # b's 8 + 1 tokens wait again
    assert capped == [backlog] == [8]


# -- the priority policy -----------------------------------------------------------------------------


def test_priority_admits_by_priority_then_arrival():
    """vLLM's priority policy: lower values first, arrival order among equals, whatever the arrival order."""
    sched, _ = _scheduler(max_num_batched_tokens=8, scheduling_policy="priority", max_num_partial_prefills=1)
    requests = [make_request(i, 8, 1, priority=p) for i, p in enumerate([2, 0, 1, 0, -1])]
    for r in requests:
        sched.add(r)
    order = []
    while sched.num_unfinished:
        plan = sched.schedule()
        order += [row.request.request_id for row in plan.rows if row.start == 0]
        complete_step(sched, plan)
    assert order == ["r4", "r1", "r3", "r2", "r0"]


def test_fcfs_is_mixed_and_ignores_priorities_order():
    """vLLM's default name, "fcfs", composes steps as "mixed" and serves requests in arrival order."""
    sched, _ = _scheduler(max_num_batched_tokens=8, scheduling_policy="fcfs", max_num_partial_prefills=1)
    assert not sched.config.prefills_first and not sched.by_priority
    requests = [make_request(i, 8, 1, priority=p) for i, p in enumerate([2, 0, 1])]
    for r in requests:
        sched.add(r)
    assert list(sched.waiting) == requests


def test_priority_preempts_the_lowest_priority_not_the_newest():
    """A decode that needs a block takes it from the running request of lowest priority (the newest among
    equals), which re-enters the waiting queue at its (priority, arrival) place, not at the front."""
    sched, _ = _scheduler(num_blocks=5, max_num_batched_tokens=64, block_size=4, scheduling_policy="priority")
    low, high, mid = make_request(0, 4, 3, priority=5), make_request(1, 4, 3), make_request(2, 4, 3, 1)
    for r in (low, high, mid):
        sched.add(r)
    plan = sched.schedule()
    assert [row.request for row in plan.rows] == [high, mid, low]  # the step's rows in service order
    complete_step(sched, plan)
    waiting = make_request(3, 1, 1, priority=3)
    sched.add(waiting)
    plan = sched.schedule()  # each decode needs a second block: high takes the free one, mid's preempts
    assert plan.preempted == [low]  # the oldest, yet the lowest priority
    assert [row.request for row in plan.rows] == [high, mid]
    assert list(sched.waiting) == [waiting, low]  # priority 3 before 5: the victim does not jump the queue


def test_priority_admission_preempts_strictly_lower_priorities_for_blocks():
    """A waiting request that finds no free blocks takes them from running requests of strictly lower
    priority, the lowest first, as few as it needs; one of equal priority waits its turn instead."""
    sched, _ = _scheduler(num_blocks=4, max_num_batched_tokens=64, block_size=8, scheduling_policy="priority",
                           max_prefill_tokens_beside_decodes=0)
    a, b, c = make_request(0, 6, 3, priority=1), make_request(1, 6, 3, priority=2), make_request(2, 6, 3, 2)
    _start_decoding(sched, [a, b, c])  # 3 blocks full, each with room for its two decodes
    same = make_request(3, 5, 1, priority=2)
    sched.add(same)
    plan = sched.schedule()
    assert not plan.preempted and same.status is RequestStatus.WAITING  # equal priority: no preemption
    complete_step(sched, plan)
    urgent = make_request(4, 5, 1, priority=0)
    sched.add(urgent)
    plan = sched.schedule()
    assert plan.preempted == [c]  # one block frees enough: b (also priority 2) keeps running
    assert [row.request for row in plan.rows] == [a, b, urgent]
    assert list(sched.waiting) == [c, same]  # c arrived before same: it resumes first at priority 2
    assert urgent.status is RequestStatus.RUNNING and sched.running == [urgent, a, b]


def test_priority_admission_never_preempts_in_vain():
    """Where all the lower priorities' blocks would not make room, nobody is preempted for the request."""
    sched, _ = _scheduler(num_blocks=4, max_num_batched_tokens=64, block_size=8, scheduling_policy="priority",
                           max_prefill_tokens_beside_decodes=0, max_num_partial_prefills=1)
    a, b = make_request(0, 6, 3, priority=0), make_request(1, 6, 3, priority=1)
    _start_decoding(sched, [a, b])
    big = make_request(2, 24, 1, priority=0)  # 3 blocks; free 1 + b's 1 = 2
    sched.add(big)
    plan = sched.schedule()
    assert not plan.preempted and [row.request for row in plan.rows] == [a, b]
    assert big.status is RequestStatus.WAITING and big.block_ids == []
