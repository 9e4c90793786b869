"""EagleDrafter: speculative decoding's drafts from an EAGLE head that reads the target's hidden states."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import numpy as np
import torch

from plait.config import EAGLE, EAGLE3, MTP, EngineConfig, SpeculativeConfig
from plait.engine.draft_model import DRAFT_SAMPLING, RunnerDrafter, draft_engine_config
from plait.engine.drafter import PENDING_DRAFT_ID
from plait.engine.kv_cache import KVCacheManager
from plait.engine.kv_offload import KVTransfer
from plait.engine.request import Request, RequestStatus
from plait.engine.scheduler import ScheduledRow, StepPlan
from plait.models.mtp import mtp_head_architecture
from plait.runner.model_runner import InFlightStep, ModelRunner
from plait.runner.sampler import host_to_device, needs_penalties

logger = logging.getLogger(__name__)

# The head's class for each method, whatever its checkpoint's config calls it (EAGLE-1 heads are published as
# plain LlamaForCausalLM configs of one layer).
HEAD_ARCHITECTURES = {EAGLE: "EagleLlamaForCausalLM", EAGLE3: "Eagle3LlamaForCausalLM"}


def eagle_engine_config(spec: SpeculativeConfig, target: EngineConfig, max_model_len: int, num_kv_blocks: int,
                        target_architecture: str) -> EngineConfig:
    """The head's runner config: the draft model's (the target's device, dtype, rows and budget), the
    target's context, and exactly the target's KV block count, since the head's K/V lives at the target's
    block ids. An MTP head is read from the target's checkpoint as the target is (its revision, config
    folder and quantization)."""
    if spec.method == MTP:
        head = mtp_head_architecture(target_architecture)
        same = dict(revision=target.revision, hf_config_path=target.hf_config_path,
                    quantization=target.quantization, rope_scaling=target.rope_scaling,
                    rope_theta=target.rope_theta) if spec.model == target.model else {}
        given = (target.hf_overrides or {}) if same else {}
    else:
        head, same, given = HEAD_ARCHITECTURES[spec.method], {}, {}
    overrides = {**given, "architectures": [head], "max_position_embeddings": max_model_len}
    return dataclasses.replace(draft_engine_config(spec, target), max_model_len=max_model_len,
                               num_kv_blocks=num_kv_blocks, hf_overrides=overrides, **same)


@dataclass(eq=False)
class _Mirror:
    """A target request as the head sees it: its tokens shifted by one (the head's position p takes token
    p + 1 beside the target's feature at p), over the target's own blocks."""

    request: Request  # prompt: the target's tokens 1.. when it was made; outputs: the ones since, then drafts

    def sync(self, target: Request) -> Request:
        """The mirror holding the target's known tokens 1.. (no drafts) over its current blocks."""
        mirror = self.request
        have = mirror.num_known_tokens
        need = target.num_known_tokens - 1
        if need > have:
            mirror.output_token_ids += target.token_ids(have + 1, need + 1)
        mirror.block_ids = target.block_ids  # the same list: blocks the target gains are the head's too
        return mirror


class EagleDrafter(RunnerDrafter):
    """vLLM's "eagle", "eagle3" and "mtp" speculative methods (an MTP layer, plait.models.mtp, drafts as an
    EAGLE-1 head does). The head (plait.models.eagle) runs in its own
    ModelRunner, sharing the target's embedding (and, for EAGLE-1, its LM head), with a KV cache of its one
    layer at the target's block ids: where the target has computed a position (or found it in the prefix
    cache), so has the head, and preemption or prefix caching need nothing of their own.

    Each step, ``prepare`` first catches the head up on every position the last target step kept (prompt
    chunks and decodes alike: position p takes token p + 1 and the target's feature at p, which the target's
    runner tapped: plait.runner.feature_tap), sampling the first draft where a running decode ends; then
    k - 1 one-token forwards draft the rest, each reading the previous forward's output feature. Drafted
    positions write the head's K/V in blocks the target reserves for the step that verifies them; the next
    catch-up overwrites them with the target's features."""

    def __init__(self, spec: SpeculativeConfig, target_config: EngineConfig, target: ModelRunner,
                 kv_cache: KVCacheManager, max_model_len: int) -> None:
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.target = target
        self.kv_cache = kv_cache  # the target's
        self.max_len = max_model_len
        config = eagle_engine_config(spec, target_config, target.max_model_len, target.num_kv_blocks,
                                     target.model_config.architecture)
        # KV offloading: the head's K/V of a block the target's prefix cache sends to host memory goes there
        # too (a host pool of as many blocks), and comes back with it (transfer_kv).
        config.kv_offloading_blocks = target.num_host_kv_blocks or None
        super().__init__(ModelRunner(config, target=target.model))
        self.head = self.runner.model
        head_config, target_model_config = self.runner.model_config, target.model_config
        if head_config.vocab_size != target_model_config.vocab_size:
            raise ValueError(f"the EAGLE head's vocabulary ({head_config.vocab_size}) is not the target's "
                             f"({target_model_config.vocab_size})")
        feature_size = int(head_config.raw.get("target_hidden_size") or head_config.hidden_size)
        if feature_size != target_model_config.hidden_size:
            raise ValueError(f"the EAGLE head reads hidden states of size {feature_size}; the target's are "
                             f"{target_model_config.hidden_size}")
        self._mirrors: dict[Request, _Mirror] = {}
        # Whether the last head forward may stay in flight for the verifying step to read (benchmarks turn it
        # off to measure what it saves). Not under tensor parallelism: the other ranks read a step's pending
        # inputs from the ids the target's driver broadcasts, and the head's are on the driver alone.
        self.defers_last_draft = target.workers is None
        self._target_of: dict[Request, Request] = {}  # mirror -> its target, of the last catch-up
        # The last launched target step and its features [T, F] (settle), for the next prepare's catch-up.
        self._last: tuple[StepPlan, torch.Tensor] | None = None

    # -- the Drafter interface ----------------------------------------------------------------

    def prepare(self, requests: list[Request]) -> None:
        self._settle_in_flight(None)  # a step that never launched leaves its last drafts in flight
        self._drafts.clear()
        last, self._last = self._last, None
        if last is None:
            return
        rows, feature_rows = self._catch_up_rows(*last)
        self._flush_transfers()
        if not rows:
            return
        device = self.runner.device
        index = host_to_device(feature_rows, torch.long, device)
        features = last[1]
        self.head.features_in[: len(feature_rows)].copy_(self.head.combine_features(features[index]))
        step = self._launch(StepPlan(rows), None)
        drafting = [row.request for row in rows if row.samples]
        if not drafting:
            self._take(step, {})
            return
        # Each drafting row's last token: where its next forward's feature comes from.
        ends = np.cumsum([row.num_new_tokens for row in rows])[[i for i, r in enumerate(rows) if r.samples]]
        # The last drafts may stay on the device for the verifying step to read, unless a row's sampling needs
        # them on the host at its staging (penalties count every draft before a position).
        defer = self.defers_last_draft and not any(needs_penalties(r.sampling_params) for r in requests)
        drafts, last = self._decode(drafting, step, ends - 1, defer)
        pending = last.sample_index if last is not None else {}
        for mirror in drafting:
            got = drafts[mirror]
            del mirror.output_token_ids[len(mirror.output_token_ids) - len(got):]  # drafts are no tokens
            last_one = (PENDING_DRAFT_ID,) if mirror in pending else ()
            self._drafts[self._target_of[mirror]] = (*got, *last_one)
        if last is not None:
            self._in_flight = last, [self._target_of[m] for m in last.requests]

    def settle(self, plan: StepPlan | None) -> None:
        self._settle_in_flight(plan)
        if plan is not None and self.target.last_features is not None:
            self._last = plan, self.target.last_features

    def forget(self, request: Request) -> None:
        self._mirrors.pop(request, None)
        self._drafts.pop(request, None)

    def is_clean(self) -> bool:
        return not self._mirrors

    def transfer_kv(self, transfers: list[KVTransfer]) -> None:
        self.runner.transfer_kv(transfers)  # the head's K/V lives at the target's block ids

    def _flush_transfers(self) -> None:
        """The copies the drafts' block allocations asked for (an evicted cached block going to host memory),
        made now, the target's and the head's, before the head's draft forwards write those blocks (the
        engine would make them only before the target's next forward)."""
        transfers = self.kv_cache.take_transfers()
        if transfers:
            self.target.transfer_kv(transfers)
            self.transfer_kv(transfers)

    # -- steps --------------------------------------------------------------------------------

    def _catch_up_rows(self, plan: StepPlan, features: torch.Tensor) -> tuple[list[ScheduledRow], list[int]]:
        """The head's rows for the positions the target step ``plan`` kept, and each token's row in its
        features. A row samples (its first draft) where it ends a running decode that may draft."""
        rows, feature_rows = [], []
        self._target_of.clear()
        at = 0
        for row in plan.rows:
            target, first = row.request, at
            at += row.num_new_tokens
            kept = target.num_computed_tokens - row.start  # rejected drafts are behind num_computed_tokens
            if target.status is not RequestStatus.RUNNING or kept <= 0:
                continue  # finished (its blocks are gone) or preempted since
            mirror = self._mirror(target)
            mirror.num_computed_tokens = row.start
            # Blocks for the positions the drafts and their verification take (the scheduler's own, then).
            k = self.num_speculative_tokens
            drafts = self._can_draft(target) and self.kv_cache.allocate(target, 1 + k)
            rows.append(ScheduledRow(mirror, row.start, kept, is_prefill=target.is_prefilling,
                                     samples=drafts))
            feature_rows.extend(range(first, first + kept))
            self._target_of[mirror] = target
        return rows, feature_rows

    def _mirror(self, target: Request) -> Request:
        mirror = self._mirrors.get(target)
        if mirror is None:
            shifted = Request(target.request_id, target.token_ids(1, target.num_known_tokens), DRAFT_SAMPLING,
                              max_tokens=self.max_len)
            shifted.status = RequestStatus.RUNNING
            mirror = self._mirrors[target] = _Mirror(shifted)
        return mirror.sync(target)

    def _can_draft(self, request: Request) -> bool:
        """A running decode sampled without host-side guidance (as Scheduler._drafts asks), with room for a
        draft under max_tokens and its drafts inside the context."""
        return (request.status is RequestStatus.RUNNING and not request.is_prefilling
                and not request.needs_last_token
                and request.num_output_tokens + 1 < request.max_tokens
                and request.num_known_tokens + self.num_speculative_tokens <= self.max_len)

    def _decode(self, mirrors: list[Request], prev: InFlightStep, feature_rows: np.ndarray, defer: bool
                ) -> tuple[dict[Request, list[int]], InFlightStep | None]:
        """The k - 1 drafts after each mirror's first: one-token forwards, each taking the draft before it
        (read on the device, from the forward before) and that forward's output feature at the row. With
        ``defer`` the last forward is returned uncollected (its ids are the last drafts), else None."""
        drafts: dict[Request, list[int]] = {m: [] for m in mirrors}
        for _ in range(self.num_speculative_tokens - 1):
            index = host_to_device(feature_rows, torch.long, self.runner.device)
            out = self.head.features_out
            self.head.features_in[: len(mirrors)].copy_(out[index])
            for m in mirrors:
                m.num_pending_tokens = 1
            plan = StepPlan([ScheduledRow(m, m.num_computed_tokens, 1, is_prefill=False, samples=True)
                             for m in mirrors])
            step = self._launch(plan, prev)
            self._take(prev, drafts)
            prev, feature_rows = step, np.arange(len(mirrors))
        if defer:
            return drafts, prev
        self._take(prev, drafts)
        return drafts, None
