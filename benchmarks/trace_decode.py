"""Where a graph-replayed decode step's time goes, kernel by kernel and gap by gap (GPU).

    PYTHONPATH=. python benchmarks/trace_decode.py --config shared/bench/models/llama-8b --rows 1 \
        --out trace.json

Runs ``--rows`` requests (W3: one, 128 prompt tokens) to steady decoding with CUDA graphs, then
records ``--steps`` steps with the torch profiler (CUPTI sees the kernels inside graph replays) and
reports, per step: device span, the sum of kernel times, the idle time between kernels, the kernels
by total time, and the largest gaps with the kernels on either side. A span much larger than its
kernels' sum means launch latency, not kernel speed, is where the time goes.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from plait.config import EngineConfig
from plait.engine.engine import LLMEngine
from plait.sampling_params import SamplingParams

WARMUP_STEPS = 32
TOP = 16
# A step's lm_head is its longest kernel by far (W3: ~245 us, the next ~60): the mark of a step boundary.
BOUNDARY_KERNEL_US = 150


def kernel_events(prof) -> list[tuple[str, float, float]]:
    """(name, start us, duration us) of every device kernel, in start order."""
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0:
            out.append((e.name, e.time_range.start, e.time_range.elapsed_us()))
    return sorted(out, key=lambda x: x[1])


def summarise(events: list[tuple[str, float, float]], steps: int) -> dict:
    span = events[-1][1] + events[-1][2] - events[0][1]
    busy = sum(d for _, _, d in events)
    by_name: dict[str, list[float]] = defaultdict(list)
    for name, _, dur in events:
        by_name[name].append(dur)
    gaps = []
    end = events[0][1] + events[0][2]
    for (prev, _, _), (name, start, dur) in zip(events, events[1:]):
        gaps.append((start - end, prev, name))
        end = max(end, start + dur)
    idle = sum(g for g, _, _ in gaps if g > 0)
    kernels = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    result = {
        "steps": steps,
        "span_us_per_step": span / steps,
        "kernel_us_per_step": busy / steps,
        "idle_us_per_step": idle / steps,
        "kernels_per_step": len(events) / steps,
        "kernels": [{"name": n, "us_per_step": sum(d) / steps, "calls_per_step": len(d) / steps,
                     "mean_us": sum(d) / len(d)} for n, d in kernels],
        "largest_gaps": [{"us": g, "after": a, "before": b}
                         for g, a, b in sorted(gaps, reverse=True)[:TOP]],
    }
    # Idle time by the kernel that follows it: which launches wait the longest in all.
    idle_before: dict[str, float] = defaultdict(float)
    for g, _, b in gaps:
        idle_before[b] += max(g, 0.0)
    result["idle_before_kernel_us_per_step"] = {
        k: v / steps for k, v in sorted(idle_before.items(), key=lambda kv: -kv[1])[:TOP]}
    return result


def boundary(events: list[tuple[str, float, float]], before: int = 4, after: int = 16) -> list[dict]:
    """The kernels around one step boundary in the middle of the trace (the lm_head, what follows it up
    to the next graph's first kernels), with the idle time before each."""
    marks = [i for i, (_, _, dur) in enumerate(events) if dur > BOUNDARY_KERNEL_US]
    if not marks:
        return []
    i = marks[len(marks) // 2]
    rows, end = [], None
    for name, start, dur in events[max(i - before, 0): i + after]:
        rows.append({"kernel": name, "us": dur, "idle_before_us": None if end is None else start - end})
        end = start + dur
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="shared/bench/models/llama-8b")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=None)
    parser.add_argument("--boundary", action="store_true",
                        help="also list the kernels between two graph replays (lm_head, sampling, copies)")
    args = parser.parse_args()
    vocab = json.loads((Path(args.config) / "config.json").read_text())["vocab_size"]
    engine = LLMEngine(EngineConfig(model=args.config, load_format="dummy", max_model_len=2048,
                                    max_num_seqs=max(args.rows, 8), enable_prefix_caching=False))
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=WARMUP_STEPS + args.steps + 8, ignore_eos=True)
    for _ in range(args.rows):
        engine.add_request(torch.randint(10, vocab, (args.prompt_len,), generator=g).tolist(), params)
    for _ in range(WARMUP_STEPS):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    events = kernel_events(prof)
    result = summarise(events, args.steps)
    if args.boundary:
        result["boundary"] = boundary(events)
    result["rows"] = args.rows
    result["device"] = torch.cuda.get_device_name()
    print(f"{result['device']}, {args.rows} rows: span {result['span_us_per_step']:.1f} us/step, kernels "
          f"{result['kernel_us_per_step']:.1f}, idle {result['idle_us_per_step']:.1f}, "
          f"{result['kernels_per_step']:.0f} kernels/step")
    for k in result["kernels"][:TOP]:
        per_step, calls, mean = k["us_per_step"], k["calls_per_step"], k["mean_us"]
        print(f"  {per_step:8.1f} us x{calls:<4.0f} ({mean:6.2f}) {k['name'][:72]}")
    print("idle before:", {k[:40]: round(v, 1) for k, v in result["idle_before_kernel_us_per_step"].items()})
    for row in result.get("boundary", []):
        idle = "" if row["idle_before_us"] is None else f"idle {row['idle_before_us']:6.1f}"
        print(f"  {idle:12s} {row['us']:7.1f} us  {row['kernel'][:80]}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
