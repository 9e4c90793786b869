"""Serving metrics as `vllm bench serve` defines them: TTFT, TPOT, ITL, E2E latency, throughput, goodput.

Per request the client records when it sent the request, when each token chunk arrived, and the token
counts the server reported. From those:

- TTFT: send to the first token chunk.
- ITL: every gap between two successive token chunks of one request; all requests' gaps are pooled.
- TPOT: per request, (E2E - TTFT) / (output tokens - 1), for requests with more than one token.
- E2E latency: send to the last token chunk.
- throughput: completed requests, output tokens and all tokens, each over the benchmark's duration.
- goodput: completed requests that meet every SLO given (TTFT, TPOT, E2E; a request of one token
  has TPOT 0 here), over the duration.

Summaries are mean, median, standard deviation and chosen percentiles (numpy's linear
interpolation), in milliseconds; an empty list summarises as 0, as vLLM does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

MS_PER_S = 1000.0
DEFAULT_PERCENTILES: tuple[float, ...] = (90.0, 99.0)  # the median is always reported
# Metrics an SLO may be set on (`--goodput ttft:1000 tpot:50`), in milliseconds.
GOODPUT_METRICS: tuple[str, ...] = ("ttft", "tpot", "e2el")
LATENCY_METRICS: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")
# Width of the buckets in which the peak output rate is counted (vLLM's: one second).
PEAK_BUCKET_S = 1.0


@dataclass
class RequestResult:
    """What the client saw of one request; times in seconds on the benchmark's clock."""

    success: bool = False
    start_time: float = 0.0  # when the request was sent
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between successive token chunks
    latency: float = 0.0  # E2E: sent to the last token chunk
    prompt_len: int = 0  # as the server reported it (usage.prompt_tokens), else as sent
    output_tokens: int = 0  # as the server reported it (usage.completion_tokens); 0 = not reported
    error: str = ""
    response_id: str | None = None  # the id the server gave its answer (its chunks' "id")

    @property
    def num_output_tokens(self) -> int:
        """Reported output tokens, or the number of token chunks when the server reported none."""
        return self.output_tokens or (len(self.itl) + 1 if self.success else 0)

    @property
    def chunk_times(self) -> list[float]:
        """When each token chunk arrived."""
        if not self.success:
            return []
        times = [self.start_time + self.ttft]
        for gap in self.itl:
            times.append(times[-1] + gap)
        return times

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (tokens - 1); None for a request of fewer than two tokens."""
        n = self.num_output_tokens
        if not self.success or n <= 1:
            return None
        return (self.latency - self.ttft) / (n - 1)


def percentile_key(p: float) -> str:
    """'p99' for 99, 'p99.9' for 99.9 (vLLM's key names)."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def summarize(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean / median / std / percentiles of ``values_s`` (seconds) as ``{stat}_{name}_ms`` keys."""
    xs = np.asarray(values_s if len(values_s) else [0.0], dtype=np.float64) * MS_PER_S
    out = {f"mean_{name}_ms": float(np.mean(xs)), f"median_{name}_ms": float(np.median(xs)),
           f"std_{name}_ms": float(np.std(xs))}
    for p in percentiles:
        out[f"{percentile_key(p)}_{name}_ms"] = float(np.percentile(xs, p))
    return out


def parse_goodput(specs: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:1000", "tpot:50"]`` -> ``{"ttft": 1000.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for spec in specs or ():
        name, sep, value = spec.partition(":")
        name = name.strip().lower()
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"goodput SLO {spec!r} must be NAME:MILLISECONDS with NAME one of "
                             f"{', '.join(GOODPUT_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"goodput SLO {spec!r}: {value!r} is not a number of milliseconds") from None
        if not ms > 0 or math.isinf(ms):
            raise ValueError(f"goodput SLO {spec!r}: the limit must be a positive number of milliseconds")
        slos[name] = ms
    return slos


def meets_slos(result: RequestResult, slos: dict[str, float]) -> bool:
    """Whether a completed request meets every SLO (a request of one token has TPOT 0)."""
    measured = {"ttft": result.ttft, "tpot": result.tpot or 0.0, "e2el": result.latency}
    return all(measured[name] <= ms / MS_PER_S for name, ms in slos.items())


def peak_output_rate(results: Sequence[RequestResult]) -> tuple[float, int]:
    """(most token chunks in one second-long bucket, most requests in flight at once)."""
    done = [r for r in results if r.success]
    if not done:
        return 0.0, 0
    t0 = min(r.start_time for r in done)
    counts: dict[int, int] = {}
    for r in done:
        for t in r.chunk_times:
            bucket = int((t - t0) // PEAK_BUCKET_S)
            counts[bucket] = counts.get(bucket, 0) + 1
    # In flight over half-open [start, end): an end at the same instant as a start comes first.
    events = sorted([(r.start_time, 1) for r in done] + [(r.start_time + r.latency, -1) for r in done])
    in_flight = peak = 0
    for _, delta in events:
        in_flight += delta
        peak = max(peak, in_flight)
    return float(max(counts.values())), peak


def calculate_metrics(results: Sequence[RequestResult], duration_s: float,
                      percentiles: Sequence[float] = DEFAULT_PERCENTILES,
                      goodput: dict[str, float] | None = None) -> dict[str, float | int | None]:
    """Every `vllm bench serve` metric of a run that took ``duration_s`` (flat dict, vLLM's key names)."""
    if not duration_s > 0:
        raise ValueError(f"the benchmark duration must be positive, got {duration_s}")
    done = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.num_output_tokens for r in done)
    good = sum(meets_slos(r, goodput) for r in done) if goodput else 0
    tpots = [t for t in (r.tpot for r in done) if t is not None]
    itls = [gap for r in done for gap in r.itl]
    peak_rate, peak_in_flight = peak_output_rate(done)
    metrics: dict[str, float | int | None] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "request_goodput": good / duration_s if goodput else None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "max_output_tokens_per_s": peak_rate,
        "max_concurrent_requests": peak_in_flight,
    }
    metrics.update(summarize("ttft", [r.ttft for r in done], percentiles))
    metrics.update(summarize("tpot", tpots, percentiles))
    metrics.update(summarize("itl", itls, percentiles))
    metrics.update(summarize("e2el", [r.latency for r in done], percentiles))
    return metrics
