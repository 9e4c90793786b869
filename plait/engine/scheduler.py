"""The scheduler: decides which requests run how many tokens in the next step. No torch."""

from __future__ import annotations

import itertools
import time
from bisect import insort
from collections import deque
from dataclasses import dataclass, field

from plait.config import NO_CHUNK_CAP, EngineConfig
from plait.engine.drafter import Drafter
from plait.engine.kv_cache import KVCacheManager
from plait.engine.request import FinishReason, Request, RequestStatus
from plait.engine.state_slots import NO_STATE_SLOT, StateSlotPool
from plait.lora.slots import NO_LORA_SLOT, LoRASlotPool


@dataclass(frozen=True)
class ScheduledRow:
    """One request's part of a step. Snapshot taken by the scheduler before the step runs."""

    request: Request
    start: int  # num_computed_tokens before this step: the position of the row's first token
    num_new_tokens: int
    is_prefill: bool  # request.is_prefilling when scheduled (progress-based, never query length)
    # A row samples iff it reaches the end of the request's known tokens when scheduled: a chunk
    # that completes the prompt, or a decode. A chunk that stops short has no next token, and an
    # embedding request's last chunk is pooled instead (ModelRunner._pool).
    samples: bool
    # Speculative decoding: the draft tokens a decode row computes after its one known (or pending) token,
    # counted in num_new_tokens. The row samples at each of its 1 + len(draft_token_ids) tokens, and the
    # engine keeps the samples up to the first that differs from its draft (LLMEngine._verify).
    draft_token_ids: tuple[int, ...] = ()

    @property
    def is_first_chunk(self) -> bool:
        return self.start == 0


@dataclass
class StepPlan:
    """What one step computes. Built by Scheduler.schedule(), read by the runner and the engine."""

    rows: list[ScheduledRow] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)  # requests sent back to waiting this step

    @property
    def num_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.rows)

    @property
    def num_decode_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.rows if not r.is_prefill)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decode_tokens

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(r.draft_token_ids) for r in self.rows)

    @property
    def is_empty(self) -> bool:
        return not self.rows


class Scheduler:
    """Each step: running decodes reserve their tokens first (FCFS), then prefill chunks spend
    the rest of the budget (partial prefills, then waiting requests in arrival order).

    ``prefill_first`` swaps the two, for comparison. Running requests that need a KV block when
    none is free preempt the newest running request by recompute; it goes to the front of the
    waiting queue, so it is the next to resume and nothing starves.

    Under ``priority`` (vLLM's policy), both queues are kept in (priority, arrival) order, lower values
    first: waiting requests are admitted in that order, running ones get the step's budget in it, and the
    victim of a preemption is the last (the lowest priority, newest), which re-enters the waiting queue at
    its place. A waiting request that finds no free KV blocks preempts running requests of strictly lower
    priority for them, where theirs would be enough; equal priorities never preempt each other there.

    For models with recurrent layers, ``state_slots`` is the slot pool: a request takes a slot when
    it is admitted (admission waits, FCFS, while none is free) and gives it back when it finishes,
    is aborted or is preempted.

    With LoRA, ``lora_slots`` is the adapters' slot pool: a request with an adapter takes its slot at
    admission (loaded by the runner if the slot held another adapter) and gives it back as a state slot.
    While every slot serves other adapters' running requests it waits, and so do later requests with
    adapters; later ones without an adapter may be admitted past it, as in vLLM.

    With ``drafter`` (speculative decoding), a running decode whose last token is on the host gets the
    drafter's tokens after it, as far as the budget, its max_tokens and free KV blocks allow (drafts never
    preempt anyone); the engine rolls ``num_computed_tokens`` back past the drafts it rejects.

    Under ``max_long_partial_prefills`` (vLLM's, below max_num_partial_prefills), a waiting prompt longer than
    long_prefill_token_threshold is passed over while that many long prompts are mid-way through, so the
    shorter prompts behind it start first; it keeps its place at the front.

    With ``whole_prompts`` (an encoder's bidirectional attention), a prompt is admitted only where it fits
    the step whole, never chunked; the runner makes the budget hold any prompt of max_model_len tokens.

    A request's ``attention_spans`` (Gemma 3's images, whose tokens attend to each other both ways) are never
    split: a chunk that would end inside one ends before it, and a chunk that starts at (or, after a prefix
    cache hit, inside) one takes it to its end, past the cap beside decodes if need be (within the step's
    budget, so the cap cannot starve it), or waits. While a running prompt waits at a span for the budget
    that decodes hold, nobody new is admitted, so the decodes drain and it runs. The engine refuses a span
    longer than ``max_span_tokens``.
    """

    def __init__(self, config: EngineConfig, kv_cache: KVCacheManager,
                 state_slots: StateSlotPool | None = None, lora_slots: LoRASlotPool | None = None,
                 drafter: Drafter | None = None, whole_prompts: bool = False) -> None:
        # The engine hands over a config with its budget chosen for the device; a scheduler built alone
        # (tests, tools) takes the CPU default.
        self.config = config.with_token_budget("cpu")
        self.kv_cache = kv_cache
        self.state_slots = state_slots
        self.lora_slots = lora_slots
        self.drafter = drafter
        self.whole_prompts = whole_prompts
        self.by_priority = self.config.serves_by_priority
        self._arrivals = itertools.count()
        self.waiting: deque[Request] = deque()  # in service order: arrival, or (priority, arrival)
        # In admission order (the last one is the newest), or in (priority, arrival) order under priority:
        # either way, the last one is the first to be preempted.
        self.running: list[Request] = []

    # -- queue management -------------------------------------------------------------------

    def add(self, request: Request) -> None:
        request.arrival_index = next(self._arrivals)
        if self.by_priority:
            insort(self.waiting, request, key=_service_order)
        else:
            self.waiting.append(request)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Retire a request (done or aborted) and return its blocks."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self.kv_cache.free(request)
        self._free_state_slot(request)
        self._free_lora_slot(request)
        if self.drafter is not None:
            self.drafter.forget(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    @property
    def max_span_tokens(self) -> int:
        """The longest attention span a step can hold: the budget, or the per-request chunk cap."""
        cap = self.config.long_prefill_token_threshold
        budget = self.config.max_num_batched_tokens
        return budget if cap == NO_CHUNK_CAP else min(budget, cap)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def prompt_backlog(self) -> int:
        """Prompt tokens (re-prefilled outputs of preempted requests too) not yet in the KV cache that some
        request waits behind: all but those of the last prompt in service order (running prompts are served
        before waiting ones). A lone prompt delays no other request's first token, so it leaves the cap beside
        decodes where it was and rides in decode-sized chunks; a burst raises it (prefill_cap)."""
        remaining = [r.num_prefill_tokens - r.num_computed_tokens
                     for queue in (self.running, self.waiting) for r in queue if r.is_prefilling]
        return sum(remaining[:-1])

    # -- one step ---------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        step = _StepBuilder(self.config)
        if not self.config.prefills_first:
            # The backlog as the step starts: a decode that preempts a request below must not raise the cap
            # with the preempted tokens (the pool is short of blocks then, not of prompt room).
            backlog = self.prompt_backlog()
            self._schedule_decodes(step)
            step.cap_prefill_beside_decodes(backlog)
            self._schedule_running_prefills(step)
            self._schedule_waiting(step)
        else:
            self._schedule_running_prefills(step)
            self._schedule_waiting(step)
            self._schedule_decodes(step)
        return step.plan

    def advance(self, plan: StepPlan) -> None:
        """Record that the plan was launched: every row's tokens are (or will be, in stream order)
        in the KV cache. Full blocks become findable by the prefix cache once their tokens are known
        on the host (``KVCacheManager.cache_full_blocks``, called when a step is collected)."""
        for row in plan.rows:
            row.request.num_computed_tokens = row.start + row.num_new_tokens

    def _schedule_decodes(self, step: _StepBuilder) -> None:
        for request in list(self.running):
            if request.is_prefilling or request.status is not RequestStatus.RUNNING:
                continue
            if request.awaits_final_token:
                continue  # finishes when its last sampled token reaches the host
            if not step.has_room():
                return
            num_new = step.chunk_size(request)
            drafts = self._drafts(step, request, num_new)
            if drafts and self.kv_cache.allocate(request, num_new + len(drafts)):
                step.add(request, num_new, drafts)
            else:
                self._schedule_running(step, request, num_new)

    def _drafts(self, step: _StepBuilder, request: Request, num_new: int) -> tuple[int, ...]:
        """The drafter's tokens for a decode row: none where its sampling needs the last token on the host (a
        grammar, a guided choice), and never past the step's budget or the request's max_tokens (the row's
        last sample is one more)."""
        if self.drafter is None or request.needs_last_token:
            return ()
        room = min(step.token_budget - num_new, request.max_tokens - request.num_output_tokens - 1)
        return self.drafter.propose(request, room)

    def _schedule_running_prefills(self, step: _StepBuilder) -> None:
        for request in list(self.running):
            if not request.is_prefilling or request.status is not RequestStatus.RUNNING:
                continue
            step.count_partial_prefill(request, +1)  # mid-prompt already, whether or not it runs now
            if not step.has_room():
                continue
            num_new = step.chunk_size(request)
            if num_new == 0:  # at an attention span the step has no room for: decodes drain first
                step.waits_at_span = True
                continue
            if self._schedule_running(step, request, num_new) and num_new == request.num_remaining_tokens:
                step.count_partial_prefill(request, -1)

    def _schedule_waiting(self, step: _StepBuilder) -> None:
        if step.plan.preempted or step.waits_at_span:
            # A running prompt waiting at an attention span for room that decodes hold would starve if more
            # were admitted (they become decodes). Or KV blocks ran out this step.
            # Re-admitting the victim now (it is at the front) would only
            # restart it from scratch and, under prefill_first, take the budget from the decodes that
            # could run: a request that preempts itself would loop forever without progress.
            return
        # Where a request waits for a LoRA slot, later requests without an adapter may pass it (as in vLLM,
        # so base traffic is not held up by slots), but none with an adapter: among those FCFS holds, and a
        # stream of requests for the adapters in the slots cannot starve it.
        waiting_for_slot = False
        index = 0
        while index < len(self.waiting) and step.has_room():
            request = self.waiting[index]
            if request in step.plan.preempted:
                return  # preempted for a higher-priority request just now: restarting it would undo that
            if request.lora is not None and (waiting_for_slot or not self._lora_slot_available(request)):
                waiting_for_slot = True
                index += 1
                continue
            if request.num_pending_tokens:
                # Preempted while its last sample was in flight: it resumes once that token is known,
                # since a prompt is prefilled from host token ids. FCFS: nobody overtakes it.
                return
            request.num_cached_tokens = self.kv_cache.match_prefix(request)
            num_new = step.chunk_size(request)
            if num_new == 0:  # its first chunk starts at an attention span the step has no room for
                self._unadmit(request)
                return
            completes_prompt = num_new == request.num_remaining_tokens
            if not completes_prompt and step.long_prefills_full(request):
                # max_long_partial_prefills: the shorter prompts behind a long one may start before it.
                self._unadmit(request)
                index += 1
                continue
            fits = completes_prompt or (not self.whole_prompts
                                        and step.num_partial_prefills < self.config.max_num_partial_prefills)
            if not (fits and self._state_slot_available() and self._admission_blocks(step, request, num_new)):
                # FCFS: a later request never overtakes one that is merely waiting its turn.
                self._unadmit(request)
                return
            self.kv_cache.record_admission(request)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            del self.waiting[index]
            if self.state_slots is not None:
                request.state_slot = self.state_slots.allocate()
            if request.lora is not None:
                request.lora_slot = self.lora_slots.take(request.lora.request.lora_int_id)
            request.status = RequestStatus.RUNNING
            if self.by_priority:
                insort(self.running, request, key=_service_order)
            else:
                self.running.append(request)
            step.add(request, num_new)
            if not completes_prompt:
                step.count_partial_prefill(request, +1)

    def _unadmit(self, request: Request) -> None:
        """Let go of the cached prefix a waiting request matched: waiting requests never pin blocks."""
        self.kv_cache.free(request)
        request.num_computed_tokens = 0

    def _admission_blocks(self, step: _StepBuilder, request: Request, num_new: int) -> bool:
        """KV blocks for a waiting request's first chunk. Under priority, where none are free, running
        requests of strictly lower priority are preempted for them (the lowest first), but only where all
        of theirs would be enough: preemptions that could not admit it would be wasted work."""
        if self.kv_cache.allocate(request, num_new):
            return True
        if not self.by_priority:
            return False
        victims = [r for r in self.running if r.priority > request.priority]
        held = sum(1 for r in victims for b in r.block_ids if self.kv_cache.ref_count(b) == 1)
        if self.kv_cache.num_free_blocks + held < self.kv_cache.num_blocks_needed(request, num_new):
            return False
        for victim in reversed(victims):
            self._preempt(victim, step)
            if self.kv_cache.allocate(request, num_new):
                return True
        return False

    def _schedule_running(self, step: _StepBuilder, request: Request, num_new: int) -> bool:
        """Give a running request blocks for ``num_new`` tokens, preempting the newest running
        requests until they fit. False if ``request`` itself had to be preempted."""
        while not self.kv_cache.allocate(request, num_new):
            victim = self.running[-1]
            self._preempt(victim, step)
            if victim is request:
                return False
        step.add(request, num_new)
        return True

    def _preempt(self, request: Request, step: _StepBuilder) -> None:
        step.remove(request)
        self.running.remove(request)
        self.kv_cache.free(request)
        # Its recurrent state is dropped with its KV: it restarts as a first chunk, from zero state.
        self._free_state_slot(request)
        self._free_lora_slot(request)
        request.num_computed_tokens = 0
        request.num_prefill_tokens = request.num_tokens  # outputs so far, pending too, are re-prefilled
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        if self.by_priority:
            insort(self.waiting, request, key=_service_order)
        else:
            self.waiting.appendleft(request)
        step.plan.preempted.append(request)

    def _state_slot_available(self) -> bool:
        return self.state_slots is None or self.state_slots.num_free > 0

    def _free_state_slot(self, request: Request) -> None:
        if request.state_slot != NO_STATE_SLOT:
            self.state_slots.free(request.state_slot)
            request.state_slot = NO_STATE_SLOT

    def _lora_slot_available(self, request: Request) -> bool:
        if request.lora is None:
            return True
        if self.lora_slots is None:
            raise RuntimeError(f"request {request.request_id} has a LoRA adapter, but LoRA is not enabled")
        return self.lora_slots.can_take(request.lora.request.lora_int_id)

    def _free_lora_slot(self, request: Request) -> None:
        if request.lora_slot != NO_LORA_SLOT:
            self.lora_slots.give_back(request.lora_slot)
            request.lora_slot = NO_LORA_SLOT


def _service_order(request: Request) -> tuple[int, int]:
    """The priority policy's order: lower priority values first, then earlier arrivals."""
    return request.priority, request.arrival_index


# A step with decodes has its prompt tokens trimmed so that the step's token count is a multiple of this:
# the row tile of the GEMMs. cuBLAS on an H200 ran a Llama-8B step of 260 rows 9% slower than one of
# 256 (7.17 vs 6.59 ms of matmuls; benchmarks/results/mixed_step_costs_h200.json), since 4 rows past a
# tile cost a whole tile; CUDA-graph shapes of mixed steps are sized in the same multiples.
STEP_TOKEN_ALIGNMENT = 128


def aligned_prefill_cap(decode_tokens: int, cap: int) -> int:
    """Prompt tokens beside ``decode_tokens`` decode tokens: ``cap``, trimmed so that the step ends on a
    multiple of STEP_TOKEN_ALIGNMENT where that keeps at least half of the cap."""
    aligned = (decode_tokens + cap) // STEP_TOKEN_ALIGNMENT * STEP_TOKEN_ALIGNMENT - decode_tokens
    return aligned if 2 * aligned >= cap else cap


def prefill_cap(config: EngineConfig, backlog: int) -> int:
    """Prompt tokens a step may carry beside decodes under ``mixed`` (NO_CHUNK_CAP: no cap), with
    ``backlog`` prompt tokens queued ahead of the last prompt (Scheduler.prompt_backlog):
    max_prefill_tokens_beside_decodes, raised to drain a pile-up."""
    cap = config.max_prefill_tokens_beside_decodes
    if cap == NO_CHUNK_CAP or config.prefill_drain_steps == 0:
        return cap
    return max(cap, -(-backlog // config.prefill_drain_steps))


class _StepBuilder:
    """The plan being built, with the budgets it has left."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.plan = StepPlan()
        self.token_budget = config.max_num_batched_tokens
        # Prompt tokens the step may still take: the whole budget, until decodes cap it. Kept apart from
        # token_budget so that a decode preempted later gives its token back to the step, not to prompts.
        self.prefill_budget = config.max_num_batched_tokens
        self.num_partial_prefills = 0
        self.num_long_partial_prefills = 0  # of those, prompts over long_prefill_token_threshold
        self.waits_at_span = False  # a running prompt could not take its next attention span this step

    def is_long(self, request: Request) -> bool:
        """A prompt (with re-prefilled outputs) over long_prefill_token_threshold, for
        max_long_partial_prefills; none is long where the threshold is unset."""
        threshold = self.config.long_prefill_token_threshold
        return threshold != NO_CHUNK_CAP and request.num_prefill_tokens > threshold

    def count_partial_prefill(self, request: Request, delta: int) -> None:
        self.num_partial_prefills += delta
        if self.is_long(request):
            self.num_long_partial_prefills += delta

    def long_prefills_full(self, request: Request) -> bool:
        """Whether ``request`` is long and the step already holds as many long partial prefills as allowed,
        where that limit is below max_num_partial_prefills (at it, every prompt waits its turn, FCFS)."""
        limit = self.config.long_partial_prefills_limit
        return (limit < self.config.max_num_partial_prefills and self.is_long(request)
                and self.num_long_partial_prefills >= limit)

    def has_room(self) -> bool:
        return (self.token_budget > 0 and self.prefill_budget > 0
                and len(self.plan.rows) < self.config.max_num_seqs)

    def cap_prefill_beside_decodes(self, backlog: int) -> None:
        """Once decodes are in the step, prompt chunks get at most prefill_cap(config, backlog), aligned
        (aligned_prefill_cap) so that the step's matmuls fill whole row tiles."""
        cap = prefill_cap(self.config, backlog)
        if cap != NO_CHUNK_CAP and self.plan.rows:
            self.prefill_budget = min(self.prefill_budget, aligned_prefill_cap(self.plan.num_tokens, cap))

    def chunk_size(self, request: Request) -> int:
        """The tokens ``request`` may compute in this step; 0 where its next chunk must take an attention
        span whole and the step has no room for it."""
        size = min(request.num_remaining_tokens, self.token_budget)
        if self.config.long_prefill_token_threshold != NO_CHUNK_CAP:
            size = min(size, self.config.long_prefill_token_threshold)
        if request.is_prefilling:
            capped = min(size, self.prefill_budget)
            return _whole_spans(request, capped, size) if request.attention_spans else capped
        return size

    def add(self, request: Request, num_new: int, drafts: tuple[int, ...] = ()) -> None:
        samples = num_new == request.num_remaining_tokens and request.pooling_params is None
        row = ScheduledRow(request, request.num_computed_tokens, num_new + len(drafts), request.is_prefilling,
                           samples=samples, draft_token_ids=drafts)
        self.plan.rows.append(row)
        self.token_budget -= row.num_new_tokens
        self.prefill_budget -= row.num_new_tokens if row.is_prefill else 0

    def remove(self, request: Request) -> None:
        for i, row in enumerate(self.plan.rows):
            if row.request is request:
                self.token_budget += row.num_new_tokens
                self.prefill_budget += row.num_new_tokens if row.is_prefill else 0
                del self.plan.rows[i]
                return


def _whole_spans(request: Request, size: int, room: int) -> int:
    """A prompt chunk of ``size`` tokens from request.num_computed_tokens made to split none of its attention
    spans: cut before a span it would end inside, or stretched to the end of one it starts at or inside (up
    to ``room``, the step's budget without the cap beside decodes; 0 where that is too little)."""
    start = request.num_computed_tokens
    end = start + size
    for first, last in request.attention_spans:  # [first, last), in order
        if first < end < last:
            if first > start:
                return first - start
            return last - start if last - start <= room else 0
    return size
