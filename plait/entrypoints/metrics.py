"""The server's Prometheus metrics, named as vLLM's: the registry and its metrics, a collector of the engine's
stats, and the tracker that follows one HTTP request's engine requests."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import prometheus_client as prom
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from plait.engine.engine import StepStats
from plait.entrypoints.async_engine import EngineStats, RequestStream
from plait.entrypoints.metrics_reader import (
    E2E_BUCKETS_S,
    FINISH_REASONS,
    ITL_BUCKETS_S,
    REQUEST_TOKEN_BUCKETS,
    TTFT_BUCKETS_S,
)
from plait.entrypoints.stat_logger import TokenTotals
from plait.outputs import PoolingRequestOutput, RequestOutput
from plait.sampling_params import SamplingParams

# The label every vllm:* metric carries: the (first) served model name.
MODEL_NAME_LABEL = "model_name"
STEP_TOKEN_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's, for a request's n
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")  # vllm:engine_sleep_state's, by sleep level
STEP_DURATION_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ServerMetrics:
    """Prometheus metrics in a registry of their own, so servers in one process do not collide.

    Where vLLM (v1) has a metric for the same thing, it has vLLM's name, type and ``model_name`` label
    (the first served model name, as vLLM's), so dashboards and alerts built for vLLM read plait as
    they are; what vLLM lacks is named ``plait_*`` and has no label.
    """

    def __init__(self, stats: Callable[[], EngineStats], model_name: str,
                 cache_config: dict[str, str] | None = None) -> None:
        self.registry = prom.CollectorRegistry()
        self.model_name = model_name
        r = self.registry
        model = [MODEL_NAME_LABEL]
        if cache_config:
            # vLLM's info gauge: value 1, the KV cache's configuration in its labels (routers read the cache's
            # capacity from num_gpu_blocks x block_size).
            info = prom.Gauge("vllm:cache_config_info", "Information of the engine's KV cache configuration",
                              list(cache_config), registry=r)
            info.labels(**cache_config).set(1)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> prom.Histogram:
            return prom.Histogram(name, doc, buckets=buckets, registry=r)

        def vllm_histogram(name: str, doc: str, buckets: Sequence[float]) -> prom.Histogram:
            return prom.Histogram(name, doc, model, buckets=buckets, registry=r).labels(model_name)

        def vllm_counter(name: str, doc: str) -> prom.Counter:
            return prom.Counter(name, doc, model, registry=r).labels(model_name)

        self._request_success = prom.Counter(
            "vllm:request_success", "Engine requests (one per choice) finished, by finish reason",
            [MODEL_NAME_LABEL, "finished_reason"], registry=r)
        for reason in FINISH_REASONS:
            self._request_success.labels(model_name, reason)  # every series exists from the first scrape
        self.prompt_tokens = vllm_counter("vllm:prompt_tokens", "Prompt tokens of admitted requests")
        self.generation_tokens = vllm_counter("vllm:generation_tokens", "Generated tokens")
        self.ttft = vllm_histogram("vllm:time_to_first_token_seconds", "Time from arrival to the first token",
                                   TTFT_BUCKETS_S)
        self.itl = vllm_histogram("vllm:inter_token_latency_seconds", "Time between two tokens of a request",
                                  ITL_BUCKETS_S)
        self.e2e = vllm_histogram("vllm:e2e_request_latency_seconds", "Time from arrival to the last token",
                                  E2E_BUCKETS_S)
        self.tpot = vllm_histogram("vllm:request_time_per_output_token_seconds",
                                   "A finished request's decode time over its tokens after the first",
                                   ITL_BUCKETS_S)
        # vLLM's per-request phases: waiting (arrival to first admission), prefill (to the first token),
        # decode (to the last), inference (admission to the last); and each request's token counts.
        self.queue_time = vllm_histogram("vllm:request_queue_time_seconds",
                                         "Time from arrival to the first step that schedules the request",
                                         E2E_BUCKETS_S)
        self.prefill_time = vllm_histogram("vllm:request_prefill_time_seconds",
                                           "Time from the first scheduling to the first token", E2E_BUCKETS_S)
        self.decode_time = vllm_histogram("vllm:request_decode_time_seconds",
                                          "Time from the first token to the last", E2E_BUCKETS_S)
        self.inference_time = vllm_histogram("vllm:request_inference_time_seconds",
                                             "Time from the first scheduling to the last token",
                                             E2E_BUCKETS_S)
        self.request_prompt_tokens = vllm_histogram("vllm:request_prompt_tokens",
                                                    "Prompt tokens of a request", REQUEST_TOKEN_BUCKETS)
        self.request_generation_tokens = vllm_histogram("vllm:request_generation_tokens",
                                                        "Tokens a request generated", REQUEST_TOKEN_BUCKETS)
        # A prompt's sampling parameters, and the most tokens any of its n sequences generated.
        self.params_n = vllm_histogram("vllm:request_params_n", "A prompt's n (sequences asked for)",
                                       REQUEST_N_BUCKETS)
        self.params_max_tokens = vllm_histogram("vllm:request_params_max_tokens", "A prompt's max_tokens",
                                                REQUEST_TOKEN_BUCKETS)
        self.max_num_generation_tokens = vllm_histogram(
            "vllm:request_max_num_generation_tokens",
            "The most tokens one of a prompt's n sequences generated", REQUEST_TOKEN_BUCKETS)
        self.iteration_tokens = vllm_histogram("vllm:iteration_tokens_total",
                                               "Tokens (prompt and decode) computed per engine step",
                                               STEP_TOKEN_BUCKETS)
        self.preemptions = vllm_counter("vllm:num_preemptions", "Requests preempted by recompute")
        self.step_prefill = histogram("plait_step_prefill_tokens", "Prompt tokens computed per engine step",
                                      STEP_TOKEN_BUCKETS)
        self.step_decode = histogram("plait_step_decode_tokens", "Decode tokens computed per engine step",
                                     STEP_TOKEN_BUCKETS)
        self.step_duration = histogram("plait_step_duration_seconds", "Wall time of one engine step",
                                       STEP_DURATION_BUCKETS_S)
        self.totals = TokenTotals()  # what the periodic stats lines report (StatLogger)
        r.register(_EngineStatsCollector(stats, model_name))

    def request_finished(self, reason: str, count: int = 1) -> None:
        self._request_success.labels(self.model_name, reason).inc(count)

    def observe_step(self, stats: StepStats) -> None:
        """Called on the engine's loop thread after every step (prometheus_client is thread-safe)."""
        self.step_prefill.observe(stats.num_prefill_tokens)
        self.step_decode.observe(stats.num_decode_tokens)
        self.iteration_tokens.observe(stats.num_prefill_tokens + stats.num_decode_tokens)
        self.step_duration.observe(stats.duration_s)
        self.totals.prompt += stats.num_prefill_tokens
        if stats.num_preempted:
            self.preemptions.inc(stats.num_preempted)

    def render(self) -> bytes:
        return prom.generate_latest(self.registry)


class _EngineStatsCollector(Collector):
    """Engine state read at scrape time from the snapshot the loop thread publishes."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self._stats = stats
        self._model_name = model_name

    def collect(self) -> Iterable[Metric]:
        s = self._stats()
        vllm_gauges = {
            "vllm:num_requests_running": ("Requests holding KV blocks", s.num_running),
            "vllm:num_requests_waiting": ("Requests queued for admission", s.num_waiting),
            "vllm:kv_cache_usage_perc": ("Fraction of usable KV blocks held by requests (0-1)", s.kv_usage),
        }
        yield from self._labelled(GaugeMetricFamily, vllm_gauges)
        vllm_counters = {
            "vllm:prefix_cache_queries": ("Prompt tokens looked up in the prefix cache",
                                          s.prefix_cache_queries),
            "vllm:prefix_cache_hits": ("Prompt tokens found in the prefix cache", s.prefix_cache_hits),
        }
        if s.external_prefix_cache_queries is not None:  # as vLLM, only where KV offloading is on
            vllm_counters.update({
                "vllm:external_prefix_cache_queries": ("Prompt tokens looked up in the KV offloading tier",
                                                       s.external_prefix_cache_queries),
                "vllm:external_prefix_cache_hits": ("Prompt tokens copied back from the KV offloading tier",
                                                    s.external_prefix_cache_hits),
            })
        if s.spec_num_drafts is not None:  # as vLLM, only where speculative decoding is on
            vllm_counters.update({
                "vllm:spec_decode_num_drafts": ("Rows that carried draft tokens", s.spec_num_drafts),
                "vllm:spec_decode_num_draft_tokens": ("Draft tokens scored", s.spec_num_draft_tokens),
                "vllm:spec_decode_num_accepted_tokens": ("Draft tokens kept", s.spec_num_accepted_tokens),
            })
        yield from self._labelled(CounterMetricFamily, vllm_counters)
        if s.sleep_level is not None:  # vLLM's, where sleep mode is on: 1 on the state the engine is in
            state = GaugeMetricFamily("vllm:engine_sleep_state",
                                      "Engine sleep state: awake, weights_offloaded (level 1) or discard_all "
                                      "(level 2)", labels=[MODEL_NAME_LABEL, "sleep_state"])
            for level, name in enumerate(SLEEP_STATES):
                state.add_metric([self._model_name, name], float(s.sleep_level == level))
            yield state
        if s.max_loras is not None:
            # vLLM's: the adapters in use (what LoRA-aware routers read), valued at the time it was read.
            info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests",
                                     labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
            adapters = [",".join(s.waiting_loras), ",".join(s.running_loras)]
            info.add_metric([str(s.max_loras), *adapters], time.time())
            yield info
        if s.spec_num_drafts is not None:
            per_position = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                               "Draft tokens kept at each draft position",
                                               labels=[MODEL_NAME_LABEL, "position"])
            for position, value in enumerate(s.spec_accepted_per_position):
                per_position.add_metric([self._model_name, str(position)], value)
            yield per_position
        gauges = {
            "plait_kv_cache_used_blocks": ("KV blocks held by requests", s.kv_blocks_used),
            "plait_prefix_cache_blocks": ("KV blocks findable by prefix hash (held or free-but-cached)",
                                          s.prefix_cache_blocks),
            "plait_prefix_cache_hit_rate": ("Share of looked-up prompt tokens found in the cache (0-1)",
                                            s.prefix_cache_hits / s.prefix_cache_queries
                                            if s.prefix_cache_queries else 0.0),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "plait_engine_steps": ("Engine steps run", s.num_steps),
            "plait_engine_failed_steps": ("Engine steps that raised", s.num_failed_steps),
            "plait_prefix_cache_evicted_blocks": ("Cached blocks evicted for new allocations",
                                                  s.prefix_cache_evicted_blocks),
        }
        if s.external_prefix_cache_queries is not None:
            counters["plait_kv_offloaded_blocks"] = ("Evicted KV blocks copied to host memory",
                                                     s.kv_offloaded_blocks)
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)

    def _labelled(self, family: type, metrics: dict[str, tuple[str, float]]) -> Iterable[Metric]:
        """Each of ``metrics`` (name -> (doc, value)) as a ``family`` with vLLM's model_name label."""
        for name, (doc, value) in metrics.items():
            metric = family(name, doc, labels=[MODEL_NAME_LABEL])
            metric.add_metric([self._model_name], value)
            yield metric


class RequestTracker:
    """Per-HTTP-request latency and token accounting, fed by the outputs as they are consumed."""

    def __init__(self, metrics: ServerMetrics, arrival: float, stream: RequestStream,
                 params: SamplingParams | None = None) -> None:
        """``params``: the sampling parameters every prompt of the request shares, whose n sequences are the
        stream's consecutive children (prompt by prompt), for vLLM's per-prompt parameter histograms."""
        self._m = metrics
        self._arrival = arrival
        self._stream = stream
        n = len(stream.request_ids)
        self._last: list[float | None] = [None] * n
        self._done = [False] * n
        self._closed = False
        metrics.prompt_tokens.inc(sum(len(p) for p in stream.prompt_token_ids))
        self._group = params.n if params is not None else 0  # 0: no per-prompt histograms
        self._generated = [0] * n
        if params is not None:
            for _ in range(n // params.n):
                metrics.params_n.observe(params.n)
                if params.max_tokens is not None:
                    metrics.params_max_tokens.observe(params.max_tokens)

    def observe(self, index: int, out: RequestOutput | PoolingRequestOutput) -> None:
        now = out.metrics.get("now") or time.monotonic()
        if isinstance(out, PoolingRequestOutput):  # one output, the embedding: its first and last
            self._m.ttft.observe(max(0.0, now - self._arrival))
            self._done[index] = True
            self._m.e2e.observe(max(0.0, now - self._arrival))
            self._m.request_finished("stop")
            return
        completion = out.outputs[0]
        self._m.generation_tokens.inc(len(completion.delta_token_ids))
        self._m.totals.generation += len(completion.delta_token_ids)
        self._generated[index] += len(completion.delta_token_ids)  # what every kind of output agrees on
        # A final-only output stands for every step that gave its request tokens: each is observed as the
        # output it was not sent as would have been.
        for when in out.metrics.get("output_times") or (now,):
            last = self._last[index]
            if last is None:
                self._m.ttft.observe(max(0.0, when - self._arrival))
            else:
                self._m.itl.observe(max(0.0, when - last))
            self._last[index] = when
        if out.finished and not self._done[index]:
            self._done[index] = True
            self._m.e2e.observe(max(0.0, now - self._arrival))
            self._m.request_finished(completion.finish_reason or "stop")
            self._observe_phases(index, out, now)

    def _observe_phases(self, index: int, out: RequestOutput, now: float) -> None:
        """vLLM's per-request phase and token histograms, from the engine's timestamps of a finished one."""
        m, scheduled = out.metrics, out.metrics.get("first_scheduled_time")
        first_token = m.get("first_token_time")
        if scheduled is not None:
            self._m.queue_time.observe(max(0.0, scheduled - m["arrival_time"]))
            self._m.inference_time.observe(max(0.0, now - scheduled))
            if first_token is not None:
                self._m.prefill_time.observe(max(0.0, first_token - scheduled))
        num_tokens = self._generated[index]
        if first_token is not None:
            self._m.decode_time.observe(max(0.0, now - first_token))
            if num_tokens > 1:  # vLLM's TPOT: one sample per request, as `vllm bench serve` defines it
                self._m.tpot.observe(max(0.0, now - first_token) / (num_tokens - 1))
        self._m.request_prompt_tokens.observe(len(out.prompt_token_ids))
        self._m.request_generation_tokens.observe(num_tokens)
        if self._group:
            first = index - index % self._group  # the prompt's sequences: [first, first + n)
            if all(self._done[first: first + self._group]):
                self._m.max_num_generation_tokens.observe(max(self._generated[first: first + self._group]))

    def close(self, error: bool = False) -> None:
        """Count every child that did not finish as aborted (client gone) or failed (idempotent)."""
        if self._closed:
            return
        self._closed = True
        reason = "error" if error else "abort"
        unfinished = self._done.count(False)
        if unfinished:
            self._m.request_finished(reason, unfinished)


