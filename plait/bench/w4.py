"""`plait bench w4`: WORKLOADS.md's W4 (the mminf workload) through AsyncLLMEngine, once per policy.

Four streams (128-token prompts, 2,048 output tokens each) decode; when each has produced 64 tokens, a
fifth request arrives with a 4,096-token prompt (128 output tokens). Reported per policy, by
shared/bench/w4_metrics.py (the code that measured the peers): the fifth's TTFT, the streams' ITL
p50/p99 in steady state before it arrives and in the window up to its first token, and output
throughput. A token's time is when the consumer received it from the engine's async API (no HTTP).
Every size is a flag, so a tiny model can run a tiny W4. The prompts come from shared/bench/workloads.py
(seed 2 for the warm-up, seed 1 for the timed run), greedy, EOS ignored.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from plait.bench import timeline as timeline_io
from plait.bench.shared import SHARED_ENV, find_shared, load_shared_module, write_json
from plait.config import STEP_COMPOSITIONS

W4_METRICS_FILE = "w4_metrics.py"
WORKLOADS_FILE = "workloads.py"
TIMED_SEED = 1  # WORKLOADS.md: seed 1 prompts for the timed run, seed 2 for the warm-up
WARMUP_SEED = 2
# The long prompt is drawn with its own seed, so it shares no first block with a stream's prompt
# (a prefix-cache hit would shorten its prefill).
LONG_PROMPT_SEED_OFFSET = 1000
WARMUP_OUTPUT_TOKENS = 8
WARMUP_ARRIVE_AFTER = 4  # stream tokens before the warm-up's long request arrives
WARMUP_IDLE_POLL_S = 0.01
# WORKLOADS.md's goal: window p99 ITL at most 1.5x steady p99 under mixed, and the long request's
# TTFT within 1.2x of prefill_first's, both at once.
GOAL_ITL_RATIO = 1.5
GOAL_TTFT_RATIO = 1.2
LONG_ARRIVES = "long request arrives"
LONG_FIRST_TOKEN = "long request's first token"


@dataclass(frozen=True)
class W4Shape:
    """The workload's sizes (WORKLOADS.md's by default)."""

    num_streams: int = 4
    stream_prompt_len: int = 128
    stream_output_len: int = 2048
    long_prompt_len: int = 4096
    long_output_len: int = 128
    arrive_after: int = 64  # the long request arrives when every stream has this many tokens

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.arrive_after >= self.stream_output_len:
            raise ValueError(f"arrive_after ({self.arrive_after}) must be below stream_output_len "
                             f"({self.stream_output_len}): the streams must still run when the long one "
                             f"arrives")


def make_prompts(workloads: ModuleType, shape: W4Shape, vocab_size: int, seed: int
                 ) -> tuple[list[list[int]], list[int]]:
    """(the streams' prompts, the long prompt), token ids from shared/bench/workloads.py."""
    streams = workloads.random_prompts(shape.num_streams, shape.stream_prompt_len, shape.stream_prompt_len,
                                       vocab_size, seed)
    (long_prompt,) = workloads.random_prompts(1, shape.long_prompt_len, shape.long_prompt_len, vocab_size,
                                              seed + LONG_PROMPT_SEED_OFFSET)
    return streams, long_prompt


# -- one run -------------------------------------------------------------------------------------------


async def _consume(stream: Any, times: list[list[float]], on_token: Any = None) -> None:
    """Record when each token of each of ``stream``'s requests arrives (``times[index]``); call
    ``on_token(index, count)`` after each output."""
    async with stream:
        async for index, out in stream:
            now = time.monotonic()
            times[index].extend(now for _ in out.outputs[0].delta_token_ids)
            if on_token is not None:
                on_token(index, len(times[index]))


async def _warmup(engine: Any, shape: W4Shape, prompts: list[list[int]], long_prompt: list[int]) -> None:
    """The timed run in miniature (other prompts, the long one arriving after a few tokens, the streams
    stopped once it has its tokens), so that every kind of step the timed run takes has run once: a
    kind first met there would pay its first-call costs inside the measured window."""
    warm = dataclasses.replace(shape, arrive_after=min(WARMUP_ARRIVE_AFTER, shape.arrive_after),
                               long_output_len=WARMUP_OUTPUT_TOKENS)
    await _timed(engine, warm, prompts, long_prompt, stop_streams=True)
    # The aborts reach the engine at its next step: wait until they have, so no warm-up step is recorded.
    while await engine.call(lambda e: e.has_unfinished_requests()):
        await asyncio.sleep(WARMUP_IDLE_POLL_S)


async def _timed(engine: Any, shape: W4Shape, prompts: list[list[int]], long_prompt: list[int],
                 stop_streams: bool = False) -> dict[str, Any]:
    """The W4 run itself; times on time.monotonic's clock (the engine's step clock). With
    ``stop_streams`` the streams are aborted once the long request has finished."""
    from plait.sampling_params import SamplingParams

    stream_params = SamplingParams(temperature=0.0, max_tokens=shape.stream_output_len, ignore_eos=True)
    long_params = SamplingParams(temperature=0.0, max_tokens=shape.long_output_len, ignore_eos=True)
    ready = asyncio.Event()
    reached: set[int] = set()

    def on_token(index: int, count: int) -> None:
        if count >= shape.arrive_after:
            reached.add(index)
            if len(reached) == shape.num_streams:
                ready.set()

    t_start = time.monotonic()
    times: list[list[float]] = [[] for _ in prompts]
    # The streams enter the engine together, as concurrent clients' requests reach vLLM's engine core
    # between two steps: their prompts share the first step, so every gap before the long request's
    # arrival is a decode step's (steady state). Added one by one, each stream's prompt would ride in a
    # step of the streams already decoding, and those ~7 ms gaps would raise the "steady" p99 that the
    # window is judged against.
    streams = asyncio.ensure_future(_consume(
        await engine.add([(prompt, stream_params) for prompt in prompts]), times, on_token))
    waiter = asyncio.ensure_future(ready.wait())
    await asyncio.wait([waiter, streams], return_when=asyncio.FIRST_COMPLETED)
    if not ready.is_set():
        waiter.cancel()
        await streams  # raises what ended a stream early
        raise RuntimeError("a stream ended before the long request was due")
    arrival = time.monotonic()
    long_times: list[list[float]] = [[]]
    await _consume(await engine.add([(long_prompt, long_params)]), long_times)
    if stop_streams:
        streams.cancel()  # leaving _consume's `async with` aborts the streams' requests
    with contextlib.suppress(asyncio.CancelledError):
        await streams
    return {"t_start": t_start, "t_end": time.monotonic(), "arrival": arrival, "streams": times,
            "long": long_times[0]}


Prompts = tuple[list[list[int]], list[int]]  # (the streams' prompts, the long prompt)


async def _run_on(engine: Any, shape: W4Shape, prompts: Prompts, warmup_prompts: Prompts | None
                  ) -> tuple[dict[str, Any], list[Any]]:
    from plait.entrypoints.async_engine import AsyncLLMEngine

    steps: list[Any] = []
    recording = False

    def on_step(stats: Any) -> None:  # runs on the engine's loop thread
        if recording:
            steps.append(stats)

    async_engine = AsyncLLMEngine(engine, on_step=on_step)
    async_engine.start()
    try:
        if warmup_prompts is not None:
            await _warmup(async_engine, shape, *warmup_prompts)
        recording = True
        raw = await _timed(async_engine, shape, *prompts)
    finally:
        await async_engine.shutdown()
    return raw, steps


def policy_result(raw: dict[str, Any], steps: list[Any], w4_metrics: Any) -> dict[str, Any]:
    """w4_metrics of one run, plus its marks, token times and timeline (seconds since the run's start)."""
    t0 = raw["t_start"]
    streams = {f"stream{i}": ts for i, ts in enumerate(raw["streams"])}
    n_out = sum(len(ts) for ts in raw["streams"]) + len(raw["long"])
    metrics = w4_metrics(streams, raw["arrival"], raw["long"][0], raw["long"], t0, raw["t_end"], n_out)
    rebase = lambda ts: [t - t0 for t in ts]
    timeline = timeline_io.to_records(steps, origin=t0)
    return {
        "metrics": metrics,
        "num_output_tokens": n_out,
        "duration_s": raw["t_end"] - t0,
        "marks": {LONG_ARRIVES: raw["arrival"] - t0, LONG_FIRST_TOKEN: raw["long"][0] - t0},
        "timeline_summary": timeline_io.summarize(timeline),
        "stream_token_times_s": [rebase(ts) for ts in raw["streams"]],
        "long_token_times_s": rebase(raw["long"]),
        "timeline": timeline,
    }


def compare(policies: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """WORKLOADS.md's goal check, when both policies ran."""
    if not {"mixed", "prefill_first"} <= policies.keys():
        return None
    mixed, first = policies["mixed"]["metrics"], policies["prefill_first"]["metrics"]
    ttft_ratio = mixed["ttft_long_ms"] / first["ttft_long_ms"]
    itl_ratio = mixed.get("p99_itl_window_over_steady")
    met = itl_ratio is not None and itl_ratio <= GOAL_ITL_RATIO and ttft_ratio <= GOAL_TTFT_RATIO
    return {"ttft_long_mixed_over_prefill_first": ttft_ratio, "mixed_window_over_steady_p99_itl": itl_ratio,
            "goal_itl_ratio": GOAL_ITL_RATIO, "goal_ttft_ratio": GOAL_TTFT_RATIO, "goal_met": met}


def run_w4(engine_config_for: Any, policies: list[str], shape: W4Shape, shared: Path,
           seed: int = TIMED_SEED, warmup: bool = True) -> dict[str, Any]:
    """Run W4 once per policy, each on a fresh engine from ``engine_config_for(policy)``."""
    import torch

    from plait.engine.engine import LLMEngine

    w4_metrics = load_shared_module(shared, W4_METRICS_FILE).w4_metrics
    workloads = load_shared_module(shared, WORKLOADS_FILE)
    results: dict[str, dict[str, Any]] = {}
    model = None
    for policy in policies:
        engine = LLMEngine(engine_config_for(policy))
        model = engine.config.model
        _check_fits(engine, shape)
        vocab = engine.model_config.vocab_size
        prompts = make_prompts(workloads, shape, vocab, seed)
        warmup_prompts = make_prompts(workloads, shape, vocab, WARMUP_SEED) if warmup else None
        raw, steps = asyncio.run(_run_on(engine, shape, prompts, warmup_prompts))
        results[policy] = policy_result(raw, steps, w4_metrics)
        del engine
        gc.collect()  # the next policy's engine needs this one's memory
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {"workload": "W4", "model": model, "shape": asdict(shape), "seed": seed, "warmup": warmup,
            "shared": str(shared), "comparison": compare(results), "policies": results}


def _check_fits(engine: Any, shape: W4Shape) -> None:
    for name, prompt, out in (("stream", shape.stream_prompt_len, shape.stream_output_len),
                              ("long", shape.long_prompt_len, shape.long_output_len)):
        if prompt + out > engine.max_model_len:
            raise ValueError(f"the {name} request needs {prompt} + {out} tokens of context, more than "
                             f"max_model_len {engine.max_model_len}")


def summary_text(result: dict[str, Any]) -> str:
    keys = ("ttft_long_ms", "steady_itl_p50_ms", "steady_itl_p99_ms", "window_itl_p50_ms",
            "window_itl_p99_ms", "p99_itl_window_over_steady", "output_tok_s")
    policies = result["policies"]
    lines = [f"{'W4':<28}" + "".join(f"{p:>16}" for p in policies)]
    for key in keys:
        values = [policies[p]["metrics"].get(key) for p in policies]
        lines.append(f"{key:<28}" + "".join(f"{v:>16.2f}" if v is not None else f"{'-':>16}" for v in values))
    if result["comparison"] is not None:
        c = result["comparison"]
        itl_ratio, ttft_ratio = c["mixed_window_over_steady_p99_itl"], c["ttft_long_mixed_over_prefill_first"]
        lines.append(f"goal: mixed window/steady p99 ITL {itl_ratio} <= {GOAL_ITL_RATIO} and long TTFT "
                     f"mixed/prefill_first {ttft_ratio:.3f} <= {GOAL_TTFT_RATIO}: "
                     f"{'met' if c['goal_met'] else 'not met'}")
    return "\n".join(lines)


def plot_w4(result: dict[str, Any], path: str | Path) -> list[Path]:
    """The policies' timelines side by side (``path``), and their streams' ITL (``<path>_itl.png``)."""
    from plait.bench.plots import plot_stream_itls

    policies = result["policies"]
    path = Path(path)
    timeline_png = timeline_io.plot_timelines({p: (r["timeline"], r["marks"]) for p, r in policies.items()},
                                              path)
    itl_png = plot_stream_itls({p: (r["stream_token_times_s"], r["marks"]) for p, r in policies.items()},
                               path.with_name(f"{path.stem}_itl.png"))
    return [timeline_png, itl_png]


# -- the command ------------------------------------------------------------------------------------------


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `plait bench w4`."""
    from plait.entrypoints.cli import _add_engine_args

    p = subparsers.add_parser("w4", help="the mminf workload (W4) through the async engine, per policy",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", dest="model", default=None, metavar="DIR",
                   help="a folder with a config.json (with --load-format dummy: random weights); "
                        "same as --model")
    p.add_argument("--shared", default=None, metavar="DIR",
                   help=f"the shared/bench folder (default: ${SHARED_ENV}, <repo>/shared/bench or "
                        f"<repo>/../shared/bench)")
    shape = p.add_argument_group("workload (WORKLOADS.md's W4 by default)")
    for name, default in asdict(W4Shape()).items():
        shape.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, default=default)
    shape.add_argument("--seed", type=int, default=TIMED_SEED, help="seed of the timed run's prompts")
    shape.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--result-file", default=None, help="write the result JSON here")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="write the timelines side by side here, and the streams' ITL to <PNG stem>_itl.png")
    _add_engine_args(p)  # --scheduling-policy runs that policy alone (default: each in turn)
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    from plait.entrypoints.cli import _engine_config

    # W4 is a serving workload: the engine takes its serving defaults (the token budget), as vLLM's did.
    base = dataclasses.replace(_engine_config(args), usage="serve")  # bad flags fail before anything loads
    policies = [args.scheduling_policy] if args.scheduling_policy else list(STEP_COMPOSITIONS)
    shape = W4Shape(**{name: getattr(args, name) for name in asdict(W4Shape())})
    shared = find_shared(args.shared)
    config_for = lambda policy: dataclasses.replace(base, scheduling_policy=policy)
    result = run_w4(config_for, policies, shape, shared, seed=args.seed, warmup=args.warmup)
    print(summary_text(result))
    if args.result_file:
        write_json(args.result_file, result)
        print(f"result: {args.result_file}")
    if args.plot:
        for path in plot_w4(result, args.plot):
            print(f"plot: {path}")
    return 0
