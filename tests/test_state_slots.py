"""State slots: the pool, and the scheduler taking a slot at admission and freeing it on finish,
abort and preemption (invariant 9), with admission waiting, FCFS, when none is free."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler import Checker, Scenario, complete_step, make_request, scenarios

from plait.config import EngineConfig
from plait.engine.kv_cache import KVCacheManager
from plait.engine.request import FinishReason, RequestStatus
from plait.engine.scheduler import Scheduler
from plait.engine.state_slots import NO_STATE_SLOT, PAD_STATE_SLOT, StateSlotPool

# -- the pool -------------------------------------------------------------------------------------


def test_pool_hands_out_each_slot_once_and_never_the_pad_slot():
    pool = StateSlotPool(3)
    slots = [pool.allocate() for _ in range(3)]
    assert sorted(slots) == [1, 2, 3] and PAD_STATE_SLOT not in slots
    assert pool.num_free == 0 and pool.num_used == 3 and pool.num_tensor_rows == 4
    with pytest.raises(RuntimeError):
        pool.allocate()
    pool.free(slots[1])
    assert pool.allocate() == slots[1], "the slot just freed is reused first"
    with pytest.raises(RuntimeError):
        pool.free(PAD_STATE_SLOT)
    pool.free(slots[0])
    with pytest.raises(RuntimeError):
        pool.free(slots[0])


def test_pool_needs_a_slot():
    with pytest.raises(ValueError):
        StateSlotPool(0)


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_capacity_knob_is_validated(value):
    with pytest.raises(ValueError, match="max_num_state_slots"):
        EngineConfig(max_num_state_slots=value)


# -- the scheduler --------------------------------------------------------------------------------


def _scheduler(num_slots: int, num_blocks: int = 256, **kw) -> tuple[Scheduler, StateSlotPool]:
    cfg = EngineConfig(block_size=4, **kw)
    pool = StateSlotPool(num_slots)
    return Scheduler(cfg, KVCacheManager(num_blocks, cfg.block_size), pool), pool


def test_slot_taken_at_admission_and_freed_on_finish():
    sched, pool = _scheduler(2)
    r = make_request(0, 5, 2)
    sched.add(r)
    assert r.state_slot == NO_STATE_SLOT
    plan = sched.schedule()
    assert r.state_slot != NO_STATE_SLOT and pool.num_used == 1
    slot = r.state_slot
    complete_step(sched, plan)
    assert r.state_slot == slot, "a slot never moves while its request runs"
    complete_step(sched, sched.schedule())
    assert r.is_finished and r.state_slot == NO_STATE_SLOT and pool.num_used == 0


def test_abort_frees_the_slot_of_running_and_waiting_requests():
    sched, pool = _scheduler(1)
    running, waiting = make_request(0, 5, 9), make_request(1, 5, 9)
    sched.add(running)
    sched.add(waiting)
    complete_step(sched, sched.schedule())
    assert running.status is RequestStatus.RUNNING and waiting.status is RequestStatus.WAITING
    sched.finish(waiting, FinishReason.ABORT)
    assert pool.num_used == 1
    sched.finish(running, FinishReason.ABORT)
    assert pool.num_used == 0 and running.state_slot == NO_STATE_SLOT


def test_admission_waits_for_a_slot_in_arrival_order():
    sched, pool = _scheduler(2, max_num_batched_tokens=256)
    first, second = make_request(0, 4, 1), make_request(1, 4, 5)
    blocked, later_short = make_request(2, 30, 5), make_request(3, 1, 5)
    for r in (first, second, blocked, later_short):
        sched.add(r)
    plan = sched.schedule()
    assert [row.request for row in plan.rows] == [first, second], "budget was there; the slots were not"
    assert list(sched.waiting) == [blocked, later_short]
    complete_step(sched, plan)  # first finishes (1 token) and frees its slot
    plan = sched.schedule()
    admitted = [row.request for row in plan.rows if row.is_first_chunk]
    assert admitted == [blocked], "the freed slot goes to the oldest waiting request"
    assert later_short.state_slot == NO_STATE_SLOT and pool.num_free == 0


def test_preemption_frees_the_slot_and_restarts_as_a_first_chunk():
    # Two requests, 6 usable blocks of 4 tokens: they outgrow the pool while decoding.
    sched, pool = _scheduler(2, num_blocks=7, max_num_batched_tokens=64)
    old, new = make_request(0, 8, 12), make_request(1, 8, 12)
    sched.add(old)
    sched.add(new)
    for _ in range(12):
        plan = sched.schedule()
        if plan.preempted:
            break
        complete_step(sched, plan)
    assert plan.preempted == [new]
    assert new.state_slot == NO_STATE_SLOT and pool.num_used == 1
    complete_step(sched, plan)
    while new.status is RequestStatus.WAITING:
        complete_step(sched, sched.schedule())
        if old.is_finished:
            break
    plan = sched.schedule()
    row = next(r for r in plan.rows if r.request is new)
    assert row.is_first_chunk and row.start == 0 and new.state_slot != NO_STATE_SLOT


class SlotChecker(Checker):
    """The scheduler property run (test_scheduler) with a slot pool, plus the slot invariants."""

    def __init__(self, sc: Scenario, num_slots: int) -> None:
        super().__init__(sc)
        self.pool = StateSlotPool(num_slots)
        self.sched = Scheduler(self.cfg, self.kv, self.pool)
        self.slot_of: dict[int, int] = {}  # id(request) -> slot while it runs

    def check_state(self) -> None:
        super().check_state()
        running = self.sched.running
        slots = [r.state_slot for r in running]
        assert all(1 <= s <= self.pool.capacity for s in slots)
        assert len(set(slots)) == len(slots), "two running requests share a slot"
        assert self.pool.num_used == len(slots)
        for r in running:
            assert self.slot_of.setdefault(id(r), r.state_slot) == r.state_slot, "a slot moved"
        for r in self.requests:
            if r.status is not RequestStatus.RUNNING:
                assert r.state_slot == NO_STATE_SLOT
                self.slot_of.pop(id(r), None)

    def check_idle(self) -> None:
        super().check_idle()
        assert self.pool.num_free == self.pool.capacity


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.integers(1, 4))
def test_slot_invariants_hold_at_every_step(sc: Scenario, num_slots: int) -> None:
    SlotChecker(sc, num_slots).run()
