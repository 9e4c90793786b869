"""Beam search above the engine, as vLLM runs it: each step scores every live beam with a 1-token request."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from plait.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from plait.sampling_params import LOGITS_MODES, BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam, as vLLM's: its tokens (the prompt's first), each generated token's logprobs with the step's
    candidates, their sum, and at the end its text and why it ended."""

    tokens: list[int]
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (an EOS ended it) or "length"
    stop_reason: int | None = None  # the EOS id that ended it


@dataclass
class BeamSearchOutput:
    """The best sequences of one prompt, best first (at most beam_width)."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(tokens: Sequence[int], cumulative_logprob: float, eos_token_ids: Collection[int],
                          length_penalty: float = 1.0) -> float:
    """vLLM's score: the cumulative logprob over length ** length_penalty."""
    # As vLLM's (and transformers' BeamHypotheses before 4.39): the length counts the prompt's tokens too,
    # and not a final EOS.
    seq_len = len(tokens) - (1 if tokens and tokens[-1] in eos_token_ids else 0)
    try:
        return cumulative_logprob / (seq_len ** length_penalty)
    except (OverflowError, ZeroDivisionError):  # length ** penalty beyond a float: the score's limit
        return 0.0 if length_penalty > 0 else -math.inf


def create_sort_beams_key_function(eos_token_ids: Collection[int], length_penalty: float
                                   ) -> Callable[[BeamSearchSequence], float]:
    def sort_beams_key(beam: BeamSearchSequence) -> float:
        return get_beam_search_score(beam.tokens, beam.cum_logprob, eos_token_ids, length_penalty)

    return sort_beams_key


def check_logprobs_mode(logprobs_mode: str) -> None:
    """Beam search ranks beams by summed logprobs: an engine whose logprobs hold logits cannot run it."""
    if logprobs_mode in LOGITS_MODES:
        raise ValueError(f"beam search ranks beams by their logprobs, and this engine's logprobs_mode "
                         f"({logprobs_mode}) returns logits; serve with a *_logprobs mode for it")


def step_params(params: BeamSearchParams) -> SamplingParams:
    """What each beam's request asks for in a step: one token and the top 2 x beam_width raw logprobs (vLLM's
    candidates: enough that beam_width survive however many end in EOS)."""
    return SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * params.beam_width)


class BeamSearch:
    """The search of one prompt: ``pending()`` are the beams to score next, ``advance()`` takes each one's
    next-token logprobs, until ``done``; ``best()`` ranks what was found."""

    def __init__(self, prompt_token_ids: Sequence[int], params: BeamSearchParams,
                 eos_token_ids: Collection[int], max_model_len: int) -> None:
        self.params = params
        self.prompt_len = len(prompt_token_ids)
        self.stops = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.sort_key = create_sort_beams_key_function(frozenset(eos_token_ids), params.length_penalty)
        self.beams = [BeamSearchSequence(list(prompt_token_ids))]
        self.completed: list[BeamSearchSequence] = []
        self.steps_left = min(params.max_tokens, max_model_len - self.prompt_len)

    @property
    def done(self) -> bool:
        return self.steps_left <= 0 or not self.beams

    def pending(self) -> list[list[int]]:
        return [] if self.done else [beam.tokens for beam in self.beams]

    def advance(self, steps: Sequence[TokenLogprobs]) -> None:
        """Extend every beam by each of its candidates: those that are EOS finish a sequence, and the
        beam_width most likely of the others live on (vLLM's: no early stop, every EOS candidate counts)."""
        candidates = []
        for beam, step in zip(self.beams, steps, strict=True):
            for place, (token_id, logprob) in enumerate(step.top.items(), 1):
                chosen = TokenLogprobs(token_id, logprob, step.top, place)
                child = BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [chosen],
                                           beam.cum_logprob + logprob)
                if token_id in self.stops:
                    child.finish_reason, child.stop_reason = "stop", token_id
                    self.completed.append(child)
                else:
                    candidates.append(child)
        # Live beams all have one length, so ranking them by cum_logprob is ranking them by score; a stable
        # sort keeps ties in beam order.
        candidates.sort(key=lambda beam: beam.cum_logprob, reverse=True)
        self.beams = candidates[:self.params.beam_width]
        self.steps_left -= 1

    def best(self) -> list[BeamSearchSequence]:
        """The beam_width best sequences, finished or still live ("length"), by score, best first."""
        for beam in self.beams:
            beam.finish_reason = "length"
        ranked = sorted(self.completed + self.beams, key=self.sort_key, reverse=True)
        return ranked[:self.params.beam_width]


def pending_beams(searches: Sequence[BeamSearch]) -> list[list[list[int]]]:
    return [search.pending() for search in searches]


def advance_all(searches: Sequence[BeamSearch], pending: Sequence[Sequence[list[int]]],
                outputs: Sequence[RequestOutput]) -> None:
    """Give each search its beams' next-token logprobs (``outputs``: every pending beam's, in order)."""
    rest = iter(outputs)
    for search, beams in zip(searches, pending, strict=True):
        scored = [next(rest) for _ in beams]
        if scored and not search.done:  # a search with no room left in the context takes no more tokens
            search.advance([_next_token_logprobs(out) for out in scored])


def _next_token_logprobs(out: RequestOutput) -> TokenLogprobs:
    logprobs = out.outputs[0].logprobs
    assert logprobs, "a beam search step asks for logprobs"
    return logprobs[0]


def served_outputs(search: BeamSearch, decode: Callable[[list[int]], str]) -> list[CompletionOutput]:
    """The best sequences as the server's choices, as vLLM serves them: the generated tokens, a final EOS in
    token_ids only under include_stop_str_in_output and never in the text."""
    outputs = []
    for index, beam in enumerate(search.best()):
        token_ids, logprobs = beam.tokens[search.prompt_len:], beam.logprobs
        stopped = beam.finish_reason == "stop"
        text = decode(token_ids[:-1] if stopped else token_ids)
        if stopped and not search.params.include_stop_str_in_output:
            token_ids, logprobs = token_ids[:-1], logprobs[:-1]
        outputs.append(CompletionOutput(index, text, token_ids, beam.finish_reason, beam.stop_reason,
                                        logprobs, delta_text=text, delta_token_ids=token_ids))
    return outputs
