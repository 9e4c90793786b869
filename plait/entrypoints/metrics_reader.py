"""LLM.get_metrics (vLLM's, read as its vllm.v1.metrics.reader gives them): the offline engine's counters,
gauges, histograms and vectors under vLLM's metric names, with no Prometheus server."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from plait.outputs import RequestOutput

if TYPE_CHECKING:
    from plait.engine.engine import LLMEngine

# Histogram buckets (upper bounds), shared with the server's Prometheus metrics (plait.entrypoints.metrics).
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 240.0, 480.0, 960.0)
# vLLM's 1-2-5 series for a request's token counts.
REQUEST_TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))
FINISH_REASONS = ("stop", "length", "abort", "error")
INF_BUCKET = "+Inf"


@dataclass
class Metric:
    """One series: its name and labels (vLLM's reader's base)."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Vector(Metric):
    """A counter per position (vLLM's spec_decode_num_accepted_tokens_per_pos)."""

    values: list[int]


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int]  # upper bound -> observations at or under it (cumulative, "+Inf" last)


@dataclass
class _Observed:
    """One histogram's observations so far."""

    bounds: Sequence[float]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; the last is +Inf's
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def read(self, name: str, labels: dict[str, str]) -> Histogram:
        cumulative, buckets = 0, {}
        for bound, n in zip([*map(str, self.bounds), INF_BUCKET], self.counts):
            cumulative += n
            buckets[bound] = cumulative
        return Histogram(name, labels, cumulative, self.total, buckets)


class OfflineMetrics:
    """What the offline LLM has finished, observed one final RequestOutput at a time (``observe``), and the
    engine's own counters and state, read at ``read`` (vLLM keeps both in its in-process Prometheus
    registry, which its get_metrics reads)."""

    def __init__(self, model_name: str) -> None:
        self.labels = {"model_name": model_name, "engine": "0"}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.preemptions = 0
        self.success = dict.fromkeys(FINISH_REASONS, 0)
        self.histograms = {
            "vllm:time_to_first_token_seconds": _Observed(TTFT_BUCKETS_S),
            "vllm:inter_token_latency_seconds": _Observed(ITL_BUCKETS_S),
            "vllm:e2e_request_latency_seconds": _Observed(E2E_BUCKETS_S),
            "vllm:request_prompt_tokens": _Observed(REQUEST_TOKEN_BUCKETS),
            "vllm:request_generation_tokens": _Observed(REQUEST_TOKEN_BUCKETS),
        }

    def observe(self, out: RequestOutput) -> None:
        """A finished request's tokens, finish reasons (one per choice) and latencies."""
        generated = sum(len(c.token_ids) for c in out.outputs)
        self.prompt_tokens += len(out.prompt_token_ids or ())
        self.generation_tokens += generated
        for completion in out.outputs:
            reason = completion.finish_reason if completion.finish_reason in self.success else "stop"
            self.success[reason] += 1
        h, m = self.histograms, out.metrics
        h["vllm:request_prompt_tokens"].observe(len(out.prompt_token_ids or ()))
        h["vllm:request_generation_tokens"].observe(generated)
        self.preemptions += m.get("num_preemptions", 0)
        arrival, first = m.get("arrival_time"), m.get("first_token_time")
        if arrival is not None and first is not None:
            h["vllm:time_to_first_token_seconds"].observe(first - arrival)
            h["vllm:e2e_request_latency_seconds"].observe(m.get("now", first) - arrival)
        times = m.get("output_times") or []
        for before, after in zip(times, times[1:]):
            h["vllm:inter_token_latency_seconds"].observe(after - before)

    def read(self, engine: LLMEngine) -> list[Metric]:
        labels = self.labels
        cache, spec = engine.kv_cache, engine.spec_stats
        metrics: list[Metric] = [
            Gauge("vllm:num_requests_running", labels, float(len(engine.scheduler.running))),
            Gauge("vllm:num_requests_waiting", labels, float(engine.num_waiting)),
            Gauge("vllm:kv_cache_usage_perc", labels, cache.usage),
            Counter("vllm:prefix_cache_queries", labels, cache.stats.queries),
            Counter("vllm:prefix_cache_hits", labels, cache.stats.hits),
            Counter("vllm:num_preemptions", labels, self.preemptions),
            Counter("vllm:prompt_tokens", labels, self.prompt_tokens),
            Counter("vllm:generation_tokens", labels, self.generation_tokens),
        ]
        metrics += [Counter("vllm:request_success", labels | {"finished_reason": reason}, n)
                     for reason, n in self.success.items()]
        metrics += [observed.read(name, labels) for name, observed in self.histograms.items()]
        if engine.drafter is not None:
            metrics += [Counter("vllm:spec_decode_num_drafts", labels, spec.num_drafts),
                        Counter("vllm:spec_decode_num_draft_tokens", labels, spec.num_draft_tokens),
                        Counter("vllm:spec_decode_num_accepted_tokens", labels, spec.num_accepted_tokens),
                        Vector("vllm:spec_decode_num_accepted_tokens_per_pos", labels,
                               list(spec.accepted_per_position))]
        return metrics
