"""Drafter: proposes speculative decoding's drafts; NgramDrafter looks a context's last tokens up in it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from plait.config import SpeculativeConfig
from plait.engine.request import Request

if TYPE_CHECKING:
    from plait.engine.kv_offload import KVTransfer
    from plait.engine.scheduler import StepPlan
    from plait.runner.model_runner import InFlightStep

# Room a request's token history starts with, and grows by doubling from.
_INITIAL_CAPACITY = 256
# A draft whose id is still on the device, in ``propose``'s tuple (last only): the step that verifies it reads
# it there (Drafter.in_flight), and ``settle`` puts the id in its place before the step is collected.
PENDING_DRAFT_ID = -1


class _History:
    """A request's known token ids as one growing numpy array, so a lookup costs no list conversion."""

    def __init__(self) -> None:
        self.ids = np.zeros(_INITIAL_CAPACITY, dtype=np.int64)
        self.length = 0

    def sync(self, request: Request) -> np.ndarray:
        """The request's known tokens (prompt + outputs on the host), appending only what is new."""
        known = request.num_known_tokens
        if known < self.length:  # never shrinks in practice; rebuild rather than trust a stale prefix
            self.length = 0
        if known > len(self.ids):
            grown = np.zeros(max(known, 2 * len(self.ids)), dtype=np.int64)
            grown[: self.length] = self.ids[: self.length]
            self.ids = grown
        if known > self.length:
            self.ids[self.length: known] = request.token_ids(self.length, known)
            self.length = known
        return self.ids[:known]


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Prompt lookup: for n from ``max_n`` down to ``min_n``, find the earlier occurrences of the last n
    tokens and return the (at most ``k``) tokens that followed one: the latest followed by k tokens (the
    freshest context), else the earliest (the longest continuation; a loop shorter than k still drafts k
    tokens); [] where no n-gram recurs."""
    # tokens: [L] int64
    length = len(tokens)
    if k <= 0 or length < 2:
        return []
    # Candidates: earlier positions holding the last token (never the last itself); then how far back each
    # agrees with the context's end, one comparison a step over the few candidates. This runs for every
    # decode row every step: a sliding-window comparison per n took ~0.2 ms at a few hundred tokens.
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])  # [C]
    matched = np.ones(len(ends), dtype=np.int64)  # [C]: tokens agreeing, the candidate's own included
    alive = np.ones(len(ends), dtype=bool)
    for j in range(1, min(max_n, length - 1)):  # a candidate ends at L-2 at most: j <= L-2
        alive &= ends >= j
        alive[alive] = tokens[ends[alive] - j] == tokens[length - 1 - j]
        matched += alive
    n = int(matched.max(initial=0))
    if n < min_n:
        return []
    hits = ends[matched >= n]  # every occurrence of the last n tokens, in order
    full = hits[hits + 1 + k <= length]
    start = int(full[-1] if full.size else hits[0]) + 1
    return tokens[start: start + k].tolist()


class Drafter:
    """Speculative decoding's draft proposer, set by the engine from ``EngineConfig.speculative_config``.
    Each step the engine calls ``prepare`` with the running requests before it schedules; the scheduler then
    calls ``propose`` for each running decode it plans, and ``forget`` when a request finishes."""

    # True: drafts need every token of a row on the host, so the engine never launches a step before the one
    # in flight is collected (a row whose last token is still on the device would get none).
    needs_host_tokens = False

    def prepare(self, requests: list[Request]) -> None:
        """Work for the whole step at once, before any ``propose`` (a draft model's batched forwards)."""

    def propose(self, request: Request, limit: int) -> tuple[int, ...]:
        """Up to ``limit`` tokens to follow the request's tokens (pending ones included)."""
        raise NotImplementedError

    def forget(self, request: Request) -> None:
        """Drop what is kept for a finished or aborted request."""

    def in_flight(self) -> InFlightStep | None:
        """The launched step whose sampled ids are the PENDING_DRAFT_IDs of ``propose``'s drafts (keyed by the
        requests they were proposed for), for the step that verifies them to read on the device; None where
        every draft is on the host."""
        return None

    def settle(self, plan: StepPlan | None) -> None:
        """Once the step verifying the drafts is launched (``plan``; None if none was): the pending drafts'
        ids on the host, in the plan's rows and in what ``propose`` returns."""

    def is_clean(self) -> bool:
        """Nothing held for any request (LLMEngine.is_idle_and_clean)."""
        return True

    def transfer_kv(self, transfers: list[KVTransfer]) -> None:
        """The target's prefix-cache copies to and from host memory (KV offloading), made for a drafter's K/V
        kept at the target's block ids (an EAGLE head's), before its next forward; nothing for the others."""

    def close(self) -> None:
        """Let go of what the drafter holds beyond Python objects (a draft model's runner)."""


class NgramDrafter(Drafter):
    """vLLM's "ngram" speculative method (prompt lookup decoding): drafts come from the request's own
    context, so they cost no model. Set by the engine from ``EngineConfig.speculative_config``; called by
    the scheduler for running decodes."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self._histories: dict[Request, _History] = {}

    def propose(self, request: Request, limit: int) -> tuple[int, ...]:
        """Up to min(num_speculative_tokens, ``limit``) tokens to follow the request's tokens. Where its last
        token is still on the device (an overlapped step sampled it), the lookup's first token stands in for
        it and the drafts are the tokens after: a wrong guess only gets the drafts rejected, since a draft is
        kept only where the model sampled it."""
        k = min(self.num_speculative_tokens, limit)
        if k <= 0:
            return ()
        history = self._histories.get(request)
        if history is None:
            history = self._histories[request] = _History()
        tokens = history.sync(request)
        if not request.num_pending_tokens:
            return tuple(ngram_lookup(tokens, self.min_n, self.max_n, k))
        return tuple(ngram_lookup(tokens, self.min_n, self.max_n, k + request.num_pending_tokens)[
            request.num_pending_tokens:])

    def forget(self, request: Request) -> None:
        """Drop a finished or aborted request's history (a preempted one keeps it: its tokens stand)."""
        self._histories.pop(request, None)

    def is_clean(self) -> bool:
        return not self._histories


class ReplayDrafter(NgramDrafter):
    """Drafts the tokens a reference run produced for the same request id (an engine without speculation
    given the same requests): every draft is kept where the model computes what it computed there, so this
    is the ceiling any drafter could reach, and what a step that verifies k drafts costs. For benchmarks and
    tests; not a serving option."""

    def __init__(self, config: SpeculativeConfig, reference: dict[str, list[int]]) -> None:
        super().__init__(config)
        self.reference = reference  # request id -> its output token ids

    def propose(self, request: Request, limit: int) -> tuple[int, ...]:
        k = min(self.num_speculative_tokens, limit)
        done = request.num_output_tokens  # pending ones too: the drafts follow them
        return tuple(self.reference.get(request.request_id, ())[done: done + max(k, 0)])
