"""DraftModelDrafter: speculative decoding's drafts, decoded greedily by a smaller model of one vocabulary."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from plait.config import EngineConfig, SpeculativeConfig
from plait.engine.drafter import PENDING_DRAFT_ID, Drafter
from plait.engine.kv_cache import KVCacheManager
from plait.engine.request import Request, RequestStatus
from plait.engine.scheduler import ScheduledRow, StepPlan
from plait.runner.model_runner import InFlightStep, ModelRunner
from plait.runner.sampler import needs_penalties
from plait.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# On a GPU the draft model (weights, profiled step, KV cache) lives in the memory the target's
# gpu_memory_utilization share leaves over, up to this share of the device: the rest is the CUDA context's and
# the allocator's.
DRAFT_GPU_MEMORY_UTILIZATION = 0.98
# Drafts are the draft model's most likely tokens; the target keeps each only where it samples the same
# token there (LLMEngine._verify), so its outputs never depend on them.
DRAFT_SAMPLING = SamplingParams(temperature=0.0, ignore_eos=True)
# _Shadow.drafted_at of a shadow that has not drafted yet (no known count is zero: prompts are not empty).
NEVER_DRAFTED = 0


def draft_engine_config(spec: SpeculativeConfig, target: EngineConfig) -> EngineConfig:
    """The draft model's runner config: the target's device, dtype, rows, token budget, block size and way
    of reading shards; no prefix cache, LoRA, warm-up or speculation of its own (nor the target's
    hf_config_path, which describes the target)."""
    return EngineConfig(
        model=spec.model, load_format=target.load_format, device=target.device, dtype=target.dtype,
        seed=target.seed, max_num_batched_tokens=target.max_num_batched_tokens, usage=target.usage,
        max_num_seqs=target.max_num_seqs, block_size=target.block_size,
        gpu_memory_utilization=DRAFT_GPU_MEMORY_UTILIZATION, max_model_len=spec.max_model_len,
        enable_prefix_caching=False, attention_backend=target.attention_backend,
        enforce_eager=target.enforce_eager, async_scheduling=False, warm_up=False,
        download_dir=target.download_dir, generation_config="vllm",
        # vLLM's load options are its LoadConfig's, shared by the draft model: read its shards the same way.
        safetensors_load_strategy=target.safetensors_load_strategy,
        model_loader_extra_config=target.model_loader_extra_config,
    )


class RunnerDrafter(Drafter):
    """A drafter whose drafts come from a ModelRunner of its own (a draft model, an EAGLE head): its forwards
    launched and counted, and each one's samples taken as the next inputs of the requests they drafted for."""

    needs_host_tokens = True

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.num_forwards = 0  # forwards run, for stats and tests
        self.num_tokens_computed = 0  # tokens those forwards computed
        self._drafts: dict[Request, tuple[int, ...]] = {}  # target request -> what propose gives it
        # The last draft forward, still in flight, and the target request of each of its rows (settle).
        self._in_flight: tuple[InFlightStep, list[Request]] | None = None

    def propose(self, request: Request, limit: int) -> tuple[int, ...]:
        return self._drafts.get(request, ())[: max(limit, 0)]

    def in_flight(self) -> InFlightStep | None:
        """The last draft forward's sampled ids, keyed by the target requests (its rows' in order)."""
        if self._in_flight is None:
            return None
        step, targets = self._in_flight
        return InFlightStep(targets, step.token_ids, step.host_ids, step.copied, step.logprobs, None)

    def close(self) -> None:
        self.runner.close()

    def _settle_in_flight(self, plan: StepPlan | None) -> None:
        """Collect the last draft forward, if still in flight: its ids in place of the PENDING_DRAFT_IDs of
        the drafts and of ``plan``'s rows (the step verifying them, launched reading them on the device)."""
        if self._in_flight is None:
            return
        step, targets = self._in_flight
        self._in_flight = None
        for t, request in zip(self.runner.collect(step).sampled, targets, strict=True):
            t.request.num_pending_tokens = 0  # the last draft is never an input
            self._resolve_pending(request, t.token_id)
        for i, row in enumerate(plan.rows if plan is not None else ()):
            if row.draft_token_ids[-1:] == (PENDING_DRAFT_ID,):
                drafts = self._drafts[row.request][: len(row.draft_token_ids)]
                plan.rows[i] = dataclasses.replace(row, draft_token_ids=drafts)

    def _resolve_pending(self, request: Request, token_id: int) -> None:
        drafts = self._drafts.get(request)
        if drafts is not None and drafts[-1:] == (PENDING_DRAFT_ID,):
            self._drafts[request] = (*drafts[:-1], token_id)

    def _launch(self, plan: StepPlan, prev: InFlightStep | None) -> InFlightStep:
        step = self.runner.launch(plan, prev)
        self.num_forwards += 1
        self.num_tokens_computed += plan.num_tokens
        for row in plan.rows:
            row.request.num_computed_tokens += row.num_new_tokens
        return step

    def _take(self, step: InFlightStep, drafts: dict[Request, list[int]]) -> None:
        """Collect a forward: each sampling request's next draft, now on the host, is its next input."""
        for t in self.runner.collect(step).sampled:
            drafts[t.request].append(t.token_id)
            t.request.output_token_ids.append(t.token_id)
            t.request.num_pending_tokens = 0


@dataclass(eq=False)
class _Shadow:
    """A target request's counterpart in the draft model's cache."""

    request: Request  # same prompt; outputs: the target's, then the draft inputs of the last drafting
    drafted_at: int = NEVER_DRAFTED  # the target's known tokens when it last drafted
    drafts: tuple[int, ...] = ()  # what it drafted then


class DraftModelDrafter(RunnerDrafter):
    """vLLM's "draft_model" speculative method. The draft model runs in its own ModelRunner over its own KV
    cache; each target request has a shadow request there (same prompt, the target's outputs copied in as
    they reach the host), whose blocks come from the draft's own KVCacheManager.

    Each step, ``prepare`` drafts for every running decode at once: one forward over each shadow's tokens the
    draft has not computed (the whole prompt the first time, in chunks of the token budget; then mostly the
    one token the target sampled after the drafts it kept) samples the first draft, and k - 1 one-token
    forwards the rest. The drafts fed back as inputs stay in the shadow until the next step, where those the
    target kept keep their K/V and the rest are dropped: their K/V stays behind ``num_computed_tokens``, to be
    overwritten."""

    def __init__(self, spec: SpeculativeConfig, target: EngineConfig, target_vocab_size: int,
                 target_num_blocks: int, target_max_model_len: int) -> None:
        self.num_speculative_tokens = spec.num_speculative_tokens
        super().__init__(ModelRunner(draft_engine_config(spec, target), max_kv_blocks=target_num_blocks))
        runner = self.runner
        if runner.pooler is not None or runner.num_state_slots or not runner.is_causal:
            arch = runner.model_config.architecture
            raise ValueError(f"the draft model must be a causal attention-only generator; {arch} is not")
        config = runner.config
        # Prefix caching as the target's: a shadow starts from the cached blocks of the prompts before it (a
        # shared system prompt is computed once); only blocks of tokens the target has are ever cached.
        self.kv_cache = KVCacheManager(runner.num_kv_blocks, config.block_size, target.enable_prefix_caching,
                                       target.prefix_caching_hash_algo)
        self.token_budget = config.max_num_batched_tokens
        self.max_len = min(target_max_model_len, runner.max_model_len)
        # Ids at or past the target's vocabulary (a draft with a larger one) are never proposed.
        self.vocab_size = target_vocab_size
        if runner.model_config.vocab_size != target_vocab_size:
            logger.warning("draft model vocabulary %d != the target's %d: drafts are token ids, so only a "
                           "draft with the target's tokenizer proposes tokens worth keeping",
                           runner.model_config.vocab_size, target_vocab_size)
        self._shadows: dict[Request, _Shadow] = {}
        # Ids past the target's vocabulary are dropped from drafts on the host, so the last draft may stay on
        # the device only where the draft's vocabulary is no larger.
        self.defers_last_draft = runner.model_config.vocab_size <= target_vocab_size

    # -- the Drafter interface ----------------------------------------------------------------

    def prepare(self, requests: list[Request]) -> None:
        self.settle(None)  # a step that never launched leaves its last drafts in flight
        self._drafts.clear()
        to_draft: dict[Request, Request] = {}  # shadow request -> its target request
        for request in requests:
            if not self._can_draft(request):
                continue
            shadow = self._shadows.get(request)
            if shadow is not None and shadow.drafted_at == request.num_known_tokens:
                self._drafts[request] = shadow.drafts  # not scheduled since: the same tokens, the same drafts
                continue
            shadow = self._follow(request)
            if self._reserve(shadow):
                to_draft[shadow.request] = request
        if not to_draft:
            return
        shadows = list(to_draft)
        drafts, in_flight = self._catch_up(shadows)
        # The last drafts may stay on the device for the verifying step to read, unless a row's sampling needs
        # them on the host at its staging (penalties count every draft before a position) or one may be past
        # the target's vocabulary (dropped on the host, never an input).
        defer = self.defers_last_draft and not any(needs_penalties(r.sampling_params) for r in requests)
        last = self._decode(shadows, drafts, in_flight, defer)
        pending = last.sample_index if last is not None else {}
        for mirror, request in to_draft.items():
            shadow = self._shadows[request]
            shadow.drafted_at = request.num_known_tokens
            known = self._in_vocabulary(drafts[mirror])
            if mirror in pending:
                known += (PENDING_DRAFT_ID,)
            shadow.drafts = self._drafts[request] = known
        if last is not None:
            self._in_flight = last, [to_draft[r] for r in last.requests]

    def settle(self, plan: StepPlan | None) -> None:
        self._settle_in_flight(plan)

    def _resolve_pending(self, request: Request, token_id: int) -> None:
        # The shadow keeps its drafts for a step that does not schedule the request (prepare reuses them).
        shadow = self._shadows.get(request)
        if shadow is not None and shadow.drafts[-1:] == (PENDING_DRAFT_ID,):
            shadow.drafts = (*shadow.drafts[:-1], token_id)
            if request in self._drafts:
                self._drafts[request] = shadow.drafts

    def forget(self, request: Request) -> None:
        shadow = self._shadows.pop(request, None)
        if shadow is not None:
            self.kv_cache.free(shadow.request)
        self._drafts.pop(request, None)

    def is_clean(self) -> bool:
        """No shadow left and every draft KV block back in its pool."""
        return not self._shadows and self.kv_cache.num_free_blocks == self.kv_cache.num_usable_blocks

    # -- steps --------------------------------------------------------------------------------

    def _can_draft(self, request: Request) -> bool:
        """A running decode with every token on the host, sampled without host-side guidance (as
        Scheduler._drafts asks), room for a draft under max_tokens, and its drafts inside the draft's
        context."""
        return (request.status is RequestStatus.RUNNING and not request.is_prefilling
                and not request.num_pending_tokens and not request.needs_last_token
                and request.num_output_tokens + 1 < request.max_tokens
                and request.num_known_tokens + self.num_speculative_tokens <= self.max_len)

    def _follow(self, request: Request) -> _Shadow:
        """The request's shadow brought up to the target's known tokens: of the draft inputs it last fed,
        those the target kept stay computed; the rest are replaced by what the target sampled instead."""
        shadow = self._shadows.get(request)
        if shadow is None:
            shadow = self._shadows[request] = _Shadow(Request(
                request.request_id, request.prompt_token_ids, DRAFT_SAMPLING, max_tokens=self.max_len))
            shadow.request.status = RequestStatus.RUNNING
        mirror, n_prompt = shadow.request, request.num_prompt_tokens
        if shadow.drafted_at != NEVER_DRAFTED:
            fed = mirror.output_token_ids[shadow.drafted_at - n_prompt:]  # the draft inputs, d1 .. d(k-1)
            kept = request.output_token_ids[shadow.drafted_at - n_prompt:]
            same = next((i for i, (a, b) in enumerate(zip(fed, kept)) if a != b), min(len(fed), len(kept)))
            del mirror.output_token_ids[shadow.drafted_at - n_prompt + same:]
            mirror.num_computed_tokens = min(mirror.num_computed_tokens, shadow.drafted_at + same)
        mirror.output_token_ids += request.output_token_ids[len(mirror.output_token_ids):]
        if not mirror.block_ids:  # a shadow holding no blocks yet starts from the cached prefix, if any
            self.kv_cache.match_prefix(mirror)
        # Now that the shadow holds only the target's tokens (its drafts dropped or kept), its full computed
        # blocks are findable; drafts appended later stay beyond them until the target keeps them.
        self.kv_cache.cache_full_blocks(mirror)
        return shadow

    def _reserve(self, shadow: _Shadow) -> bool:
        """Blocks for every input of this step's draft forwards: the known tokens and k - 1 drafts. Where the
        draft cache is full, shadows of requests no longer running (preempted) give theirs back first; a
        shadow that still does not fit gets no drafts this step."""
        mirror = shadow.request
        needed = mirror.num_known_tokens + self.num_speculative_tokens - 1 - mirror.num_computed_tokens
        if self.kv_cache.allocate(mirror, needed):
            return True
        for request in list(self._shadows):
            if request.status is not RequestStatus.RUNNING:
                self.forget(request)
        return self.kv_cache.allocate(mirror, needed)

    def _catch_up(self, shadows: list[Request]) -> tuple[dict[Request, list[int]], InFlightStep]:
        """Run each shadow's tokens the draft has not computed, within the token budget a forward (a long
        prompt takes several), and sample each one's first draft after its last token. Returns the drafts on
        the host so far and the last forward, still in flight: the first draft of each of its rows is a
        pending token, which the next forward reads on the device (only forwards before the last, where a
        long prompt needs more than one, are waited for)."""
        drafts: dict[Request, list[int]] = {s: [] for s in shadows}
        pending = shadows
        while True:
            plan, budget, rest = StepPlan(), self.token_budget, []
            for s in pending:
                if not budget:
                    rest.append(s)
                    continue
                start = s.num_computed_tokens
                # Never zero: a shadow drafts only where the target's known tokens grew since it last drafted,
                # and _follow leaves those tokens uncomputed.
                n = min(s.num_known_tokens - start, budget)
                done = start + n == s.num_known_tokens
                plan.rows.append(ScheduledRow(s, start, n, is_prefill=s.is_prefilling, samples=done))
                budget -= n
                if not done:
                    rest.append(s)
            step = self._launch(plan, None)
            if not rest:  # every row of the last forward samples
                for row in plan.rows:
                    row.request.num_pending_tokens = 1
                return drafts, step
            self._take(step, drafts)
            pending = rest

    def _decode(self, shadows: list[Request], drafts: dict[Request, list[int]], prev: InFlightStep,
                defer: bool) -> InFlightStep | None:
        """The other k - 1 drafts, one-token forwards whose inputs are the drafts before them. Each forward
        reads a pending input from the forward before it (the catch-up's, then the last one's) on the device,
        so the host stages it while that one runs and collects that one's ids after. With ``defer`` the last
        forward is returned uncollected (its ids are the last drafts), else None."""
        for _ in range(self.num_speculative_tokens - 1):
            plan = StepPlan([ScheduledRow(s, s.num_computed_tokens, 1, is_prefill=False, samples=True)
                             for s in shadows])
            step = self._launch(plan, prev)
            self._take(prev, drafts)
            prev = step
            for s in shadows:
                s.num_pending_tokens = 1
        if defer:
            for s in shadows:
                if s not in prev.sample_index:  # k = 1: its draft came from an earlier catch-up chunk
                    s.output_token_ids.pop()
            return prev
        self._take(prev, drafts)
        for s in shadows:
            s.output_token_ids.pop()  # the last draft is never an input
        return None

    def _in_vocabulary(self, drafts: list[int]) -> tuple[int, ...]:
        for i, token_id in enumerate(drafts):
            if token_id >= self.vocab_size:
                return tuple(drafts[:i])
        return tuple(drafts)
