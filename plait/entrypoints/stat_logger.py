"""StatLogger: vLLM's periodic log lines of a serving engine (throughputs, queue, KV cache, speculation)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from plait.entrypoints.async_engine import EngineStats

logger = logging.getLogger(__name__)

# vLLM's VLLM_LOG_STATS_INTERVAL: seconds between two log lines while the engine has work.
DEFAULT_LOG_STATS_INTERVAL_S = 10.0


@dataclass
class TokenTotals:
    """Tokens since the server started: prompt tokens computed (set from each step's stats) and tokens
    generated (set as outputs reach their requests). Read and reset only by StatLogger."""

    prompt: int = 0
    generation: int = 0


class StatLogger:
    """Every interval with something to say (tokens moved, or requests running or waiting), one line as
    vLLM's LoggingStatLogger writes it:

        Avg prompt throughput: 512.0 tokens/s, Avg generation throughput: 48.2 tokens/s, Running: 2 reqs,
        Waiting: 0 reqs, GPU KV cache usage: 1.3%, Prefix cache hit rate: 35.0%

    and, under speculative decoding, vLLM's SpecDecoding line for the same interval."""

    def __init__(self, stats: Callable[[], EngineStats], totals: TokenTotals) -> None:
        self._stats = stats
        self._totals = totals
        self._last_totals = TokenTotals()
        self._last = stats()

    def log(self, interval_s: float) -> bool:
        """Log the interval just ended (``interval_s`` long); False where it was idle and said nothing."""
        now, totals = self._stats(), TokenTotals(self._totals.prompt, self._totals.generation)
        prompt = totals.prompt - self._last_totals.prompt
        generation = totals.generation - self._last_totals.generation
        last, self._last, self._last_totals = self._last, now, totals
        if not (prompt or generation or now.num_running or now.num_waiting):
            return False
        queries = now.prefix_cache_queries - last.prefix_cache_queries
        hit_rate = (now.prefix_cache_hits - last.prefix_cache_hits) / queries if queries else 0.0
        external = ""
        if now.external_prefix_cache_queries is not None:  # vLLM's line where a KV connector is on
            asked = now.external_prefix_cache_queries - (last.external_prefix_cache_queries or 0)
            found = now.external_prefix_cache_hits - last.external_prefix_cache_hits
            external = f", External prefix cache hit rate: {100 * found / asked if asked else 0.0:.1f}%"
        logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                    "Running: %d reqs, Waiting: %d reqs, GPU KV cache usage: %.1f%%, "
                    "Prefix cache hit rate: %.1f%%%s", prompt / interval_s, generation / interval_s,
                    now.num_running, now.num_waiting, 100 * now.kv_usage, 100 * hit_rate, external)
        if now.spec_num_drafts is not None:
            self._log_spec(last, now, interval_s)
        return True

    @staticmethod
    def _log_spec(last: EngineStats, now: EngineStats, interval_s: float) -> None:
        drafts = now.spec_num_drafts - (last.spec_num_drafts or 0)
        drafted = now.spec_num_draft_tokens - last.spec_num_draft_tokens
        accepted = now.spec_num_accepted_tokens - last.spec_num_accepted_tokens
        if not drafts:
            return
        before = last.spec_accepted_per_position or (0,) * len(now.spec_accepted_per_position)
        per_position = [(n - b) / drafts for n, b in zip(now.spec_accepted_per_position, before)]
        logger.info("SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f tokens/s, "
                    "Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens, "
                    "Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
                    1 + accepted / drafts, accepted / interval_s, drafted / interval_s, accepted, drafted,
                    ", ".join(f"{r:.3f}" for r in per_position), 100 * accepted / drafted)
