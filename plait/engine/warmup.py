"""Start-up warm-up: requests shaped like a server's first ones, run before the engine is handed out.

Triton compiles a kernel for each combination of compile-time arguments the first time a launch meets it
(hundreds of milliseconds each on an empty cache, as on a fresh machine or container). The profiling forward
and the CUDA-graph captures meet many of them, but not all: on an H200 the first requests of a fresh
Llama-8B server still built seven (the lm_head's GEMV for a few rows, the argmax, the step-input kernel, and
the sampler's race kernel for top-p, top-k and min-p), 2.6 s between them, a 1.25 s step for the first
sampled batch (benchmarks/results/first_requests_h200/). So the engine drives the mixes real traffic brings
through its own scheduler once, on made-up token ids (a long prompt beside decoding streams, a burst of long
prompts, prefix-cache hits, each sampling option alone and together, a prompt at the context limit), and then
forgets them (LLMEngine.forget_warm_up): no request, cached block or counter of the warm-up survives it.

Every size is bounded by the engine's context length and KV cache, so the mixes run on any model and
configuration; a request the model refuses (an id it reserves for images, say) is skipped with a warning,
never an error: the warm-up saves time, and serving never depends on it.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from plait.sampling_params import SamplingParams

if TYPE_CHECKING:
    from plait.engine.engine import LLMEngine

logger = logging.getLogger(__name__)

REQUEST_ID_PREFIX = "plait-warm-up"
# Made-up prompts take ids from this range (clipped to the vocabulary): clear of the low ids where most
# tokenizers keep their special tokens and of the high ones where Llama 3 and Qwen keep theirs.
TOKEN_ID_LOW, TOKEN_ID_HIGH = 1000, 30000
NUM_STREAMS = 4  # decoding requests that the long prompts arrive beside
STREAM_PROMPT_TOKENS = 96
STREAM_OUTPUT_TOKENS = 48
LONG_PROMPT_ARRIVES_AFTER = 8  # steps of the streams before the long prompt comes
# Prompt lengths of the mixes, each clipped to what the context and cache allow: one long prompt beside the
# streams (chunks over a growing context), then a burst of several at once (eager steps of many rows).
LONG_PROMPT_TOKENS = 3000
BURST_PROMPT_TOKENS = (6000, 2500, 1800, 600, 300)
PREFIX_TOKENS = 2048  # a prompt's first blocks that later prompts repeat (prefix-cache hits)
OWN_TOKENS = 160  # what each of those adds after the shared part
SAMPLED_PROMPT_TOKENS = 64
SAMPLED_OUTPUT_TOKENS = 8
# The share of the KV cache one mix may fill (so no mix preempts on a small cache), and of that the streams'.
MAX_CACHE_SHARE = 0.5
STREAMS_SHARE = 0.25
# Every sampling option with its own device path; random draws seeded, so the engine's own stream of
# unseeded draws is untouched and a seeded user's tokens stay what they were without a warm-up.
SAMPLING_OPTIONS: tuple[dict, ...] = (
    dict(temperature=0.8, top_p=0.9, seed=1),
    dict(temperature=1.0, top_k=40, seed=2),
    dict(temperature=0.7, min_p=0.05, seed=3),
    dict(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1, seed=4),
    dict(temperature=0.0, logprobs=5),
    dict(temperature=0.0, prompt_logprobs=2),
    dict(temperature=0.0, min_tokens=4),
)
TOKEN_SEED = 0  # made-up prompts are the same at every start


@dataclass
class WarmUpReport:
    """What the warm-up ran (LLMEngine.warm_up_report)."""

    seconds: float = 0.0
    requests: int = 0
    steps: int = 0  # forwards launched
    skipped: int = 0  # requests the model refused


Arrivals = dict[int, list[tuple[list[int], SamplingParams]]]  # requests to add before step i


class _Driver:
    """Adds made-up requests to the engine and steps it until they finish."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        vocab = engine.model_config.vocab_size
        self.low = min(TOKEN_ID_LOW, vocab // 4)
        self.high = max(min(TOKEN_ID_HIGH, vocab), self.low + 1)
        self.max_len = engine.max_model_len
        self.block_size = engine.config.block_size
        self.mix_blocks = int(engine.kv_cache.num_usable_blocks * MAX_CACHE_SHARE)  # one mix's share
        self.report = WarmUpReport()
        self._rng = random.Random(TOKEN_SEED)

    def tokens(self, n: int) -> list[int]:
        """n made-up prompt ids (random: no two prompts share a first block by accident)."""
        return [self._rng.randrange(self.low, self.high) for _ in range(max(n, 0))]

    def prompts(self, wanted: Sequence[int], params: Sequence[SamplingParams] | SamplingParams,
                share: float = 1.0) -> list[tuple[list[int], SamplingParams]]:
        """Made-up prompts of about the ``wanted`` lengths, each within the context and all of them (with
        their outputs) within ``share`` of the mix's KV blocks; those that do not fit are left out."""
        if isinstance(params, SamplingParams):
            params = [params] * len(wanted)
        room = int(self.mix_blocks * share)
        made = []
        for n, p in zip(wanted, params):
            n = min(n, self.max_len - p.max_tokens - 1, room * self.block_size - p.max_tokens)
            if n < 1:
                break
            room -= -(-(n + p.max_tokens) // self.block_size)
            made.append((self.tokens(n), p))
        return made

    def add(self, prompt: list[int], params: SamplingParams) -> None:
        request_id = f"{REQUEST_ID_PREFIX}-{self.report.requests + self.report.skipped}"
        try:
            self.engine.add_request(prompt, params, request_id=request_id)
        except (ValueError, TypeError) as err:
            self.report.skipped += 1
            logger.warning("warm-up request skipped (%d prompt tokens): %s", len(prompt), err)
            return
        self.report.requests += 1

    def run(self, arrivals: Arrivals) -> None:
        drive(self.engine, arrivals, self.add)


def drive(engine: LLMEngine, arrivals: Arrivals, add: Callable[[list[int], SamplingParams], None],
          step: Callable[[], object] | None = None) -> None:
    """Step ``engine`` until every request is done, ``add``-ing ``arrivals[i]`` before step i (``step``:
    how one step is taken, engine.step by default; none is taken while nothing is queued or running)."""
    take_step = step or engine.step
    index, last_arrival = 0, max(arrivals, default=0)
    while index <= last_arrival or engine.has_unfinished_requests():
        for prompt, params in arrivals.get(index, ()):
            add(prompt, params)
        if engine.has_unfinished_requests():
            take_step()
        index += 1


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _mixes(d: _Driver) -> Iterator[Arrivals]:
    """The request mixes, each as arrivals by step index."""
    out = SAMPLED_OUTPUT_TOKENS
    stream_lengths = [STREAM_PROMPT_TOKENS + i for i in range(NUM_STREAMS)]
    # A long prompt arriving beside decoding streams: chunks over a growing cached context.
    yield {0: d.prompts(stream_lengths, _greedy(STREAM_OUTPUT_TOKENS), STREAMS_SHARE),
           LONG_PROMPT_ARRIVES_AFTER: d.prompts([LONG_PROMPT_TOKENS], _greedy(out), 1 - STREAMS_SHARE)}
    # A burst of long prompts beside the streams: eager steps of many prompt rows, split K/V.
    yield {0: d.prompts(stream_lengths, _greedy(STREAM_OUTPUT_TOKENS), STREAMS_SHARE),
           LONG_PROMPT_ARRIVES_AFTER: d.prompts(BURST_PROMPT_TOKENS, _greedy(out), 1 - STREAMS_SHARE)}
    # Prefix-cache hits: later prompts whose first chunk starts after the cached blocks of the first.
    first = d.prompts([PREFIX_TOKENS + OWN_TOKENS], _greedy(out), 1 / 3)
    if first:
        prompt = first[0][0]
        shared = prompt[: max(len(prompt) - OWN_TOKENS, len(prompt) // 2)]
        own = min(OWN_TOKENS, d.max_len - len(shared) - out - 1)
        yield {0: first}
        yield {0: [(shared + d.tokens(max(own - i, 0)), _greedy(out)) for i in range(2)]}
    # Sampling options alone (a batch of one kind) and together (rows of every kind in one batch), but
    # logprobs beyond what the engine allows (--max-logprobs).
    limit = d.engine.max_logprobs
    options = [SamplingParams(max_tokens=out, ignore_eos=True, **kw) for kw in SAMPLING_OPTIONS
               if max(kw.get("logprobs", 0), kw.get("prompt_logprobs", 0)) <= limit]
    for params in options:
        yield {0: d.prompts([SAMPLED_PROMPT_TOKENS], params)}
    yield {0: d.prompts([SAMPLED_PROMPT_TOKENS] * len(options), options)}
    # A prompt at the context limit (or what the cache holds): the longest context a step attends over.
    yield {0: d.prompts([d.max_len], _greedy(out))}


def warm_up(engine: LLMEngine) -> WarmUpReport:
    """Run the warm-up mixes through ``engine`` (idle: no request of its own yet); the caller then makes
    the engine forget them (LLMEngine.forget_warm_up)."""
    if engine.has_unfinished_requests():
        raise ValueError("warm_up needs an idle engine")
    start, first_step = time.perf_counter(), engine.num_steps
    driver = _Driver(engine)
    for arrivals in _mixes(driver):
        driver.run(arrivals)
    driver.report.seconds = time.perf_counter() - start
    driver.report.steps = engine.num_steps - first_step
    return driver.report
