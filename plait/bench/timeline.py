"""The engine's step timeline (one StepStats per step): dump to JSON, load, summarise and plot.

The plot shows, per step on a time axis: decode and prefill-chunk tokens stacked (decodes of a
CUDA-graph replay in a darker shade), the step's wall time on a second axis, preemptions as marks,
and below them the rows per step, the requests waiting for admission and the KV blocks in use. It is
the picture of a long prompt being plaited into running decodes. ``plait bench timeline FILE...``
plots files that ``dump``, ``plait serve --step-timeline-file`` or ``plait bench w4`` wrote.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from plait.bench.plots import pyplot, save
from plait.bench.shared import write_json

MS_PER_S = 1000.0
# A panel: the steps (dicts with StepStats' fields, start_time in seconds since the panel's origin)
# and named instants to mark on it (seconds on the same clock).
Panel = tuple[list[dict[str, Any]], dict[str, float]]
MARK_COLORS = ("tab:red", "tab:purple", "tab:brown", "tab:olive")


def to_records(steps: Iterable[Any], origin: float | None = None) -> list[dict[str, Any]]:
    """StepStats (or dicts of their fields) as dicts, start times made relative to ``origin``
    (default: the first step's start)."""
    records = [dataclasses.asdict(s) if dataclasses.is_dataclass(s) else dict(s) for s in steps]
    if records:
        base = records[0]["start_time"] if origin is None else origin
        for r in records:
            r["start_time"] = r["start_time"] - base
    return records


def dump(steps: Iterable[Any], path: str | Path, origin: float | None = None,
         marks: Mapping[str, float] | None = None) -> Path:
    """Write a timeline file: ``{"steps": [...], "marks": {...}}``."""
    return write_json(path, {"steps": to_records(steps, origin), "marks": dict(marks or {})})


def load(path: str | Path) -> dict[str, Panel]:
    """The panels of a timeline file (``dump``'s) or of a ``plait bench w4`` result (one per policy)."""
    doc = json.loads(Path(path).read_text())
    if "steps" in doc:
        return {Path(path).stem: (doc["steps"], doc.get("marks", {}))}
    if "policies" in doc:
        return {name: (run["timeline"], run.get("marks", {})) for name, run in doc["policies"].items()}
    raise ValueError(f"{path} holds no timeline: expected a \"steps\" list or a w4 result's \"policies\"")


def summarize(steps: Sequence[Mapping[str, Any]]) -> dict[str, float | int]:
    """Totals and means over a timeline."""
    n = len(steps)
    durations = [s["duration_s"] for s in steps]
    return {
        "steps": n,
        "mean_step_ms": sum(durations) / n * MS_PER_S if n else 0.0,
        "max_step_ms": max(durations) * MS_PER_S if n else 0.0,
        "prefill_tokens": sum(s["num_prefill_tokens"] for s in steps),
        "decode_tokens": sum(s["num_decode_tokens"] for s in steps),
        "preemptions": sum(s["num_preempted"] for s in steps),
        "cuda_graph_steps": sum(bool(s.get("used_cuda_graph", False)) for s in steps),
        "max_kv_blocks_used": max((s["kv_blocks_used"] for s in steps), default=0),
        "max_waiting": max((s.get("num_waiting", 0) for s in steps), default=0),
    }


def _mark(ax: Any, marks: Mapping[str, float], labelled: bool) -> None:
    for (label, t), color in zip(marks.items(), itertools.cycle(MARK_COLORS)):
        ax.axvline(t, color=color, linestyle="--", linewidth=1, label=label if labelled else None)


def _plot_tokens(ax: Any, steps: Sequence[Mapping[str, Any]], title: str, marks: Mapping[str, float]) -> Any:
    """Stacked tokens per step, with step time on a twin axis (returned)."""
    starts = [s["start_time"] for s in steps]
    widths = [s["duration_s"] for s in steps]
    decode = [s["num_decode_tokens"] for s in steps]
    graph = [bool(s.get("used_cuda_graph", False)) for s in steps]
    prefill = [s["num_prefill_tokens"] for s in steps]
    ax.bar(starts, [d if not g else 0 for d, g in zip(decode, graph)], width=widths, align="edge",
           color="tab:blue", label="decode tokens")
    if any(graph):
        ax.bar(starts, [d if g else 0 for d, g in zip(decode, graph)], width=widths, align="edge",
               color="navy", label="decode tokens (CUDA graph)")
    ax.bar(starts, prefill, bottom=decode, width=widths, align="edge", color="tab:orange",
           label="prefill-chunk tokens")
    ax.set(ylabel="tokens per step", title=title)
    _mark(ax, marks, labelled=True)
    step_ms = ax.twinx()
    step_ms.plot([s + w / 2 for s, w in zip(starts, widths)], [w * MS_PER_S for w in widths],
                 color="black", linewidth=0.7, marker=".", markersize=2, label="step time")
    preempted = [(s + w / 2, w * MS_PER_S) for s, w, st in zip(starts, widths, steps) if st["num_preempted"]]
    if preempted:
        step_ms.scatter(*zip(*preempted), color="red", marker="x", zorder=3, label="preemption")
    step_ms.set_ylabel("step time (ms)")
    step_ms.set_ylim(bottom=0)
    _legend(ax, step_ms)
    return step_ms


def _legend(ax: Any, twin: Any) -> None:
    """One legend for an axis and its twin."""
    handles, labels = ax.get_legend_handles_labels()
    more_handles, more_labels = twin.get_legend_handles_labels()
    ax.legend(handles + more_handles, labels + more_labels, loc="upper right", fontsize="small")


def _plot_rows(ax: Any, steps: Sequence[Mapping[str, Any]], marks: Mapping[str, float]) -> Any:
    """Rows per step and requests waiting for admission, with KV blocks in use on a twin axis (returned)."""
    starts = [s["start_time"] for s in steps]
    _mark(ax, marks, labelled=False)
    ax.step(starts, [s["num_rows"] for s in steps], where="post", color="tab:green", label="rows")
    if any(s.get("num_waiting", 0) for s in steps):  # timelines written before the field have none
        ax.step(starts, [s.get("num_waiting", 0) for s in steps], where="post", color="tab:red",
                linewidth=0.8, label="waiting requests")
    ax.set(xlabel="time since start (s)", ylabel="rows / requests")
    blocks = ax.twinx()
    blocks.step(starts, [s["kv_blocks_used"] for s in steps], where="post", color="tab:gray",
                label="KV blocks")
    blocks.set_ylabel("KV blocks in use")
    blocks.set_ylim(bottom=0)
    _legend(ax, blocks)
    return blocks


def plot_timelines(panels: Mapping[str, Panel], path: str | Path) -> Path:
    """One column per panel (side by side, same time and token scales): tokens and step time above, rows and
    KV blocks below, with each panel's marks as vertical lines."""
    if not panels:
        raise ValueError("there is no timeline to plot")
    plt = pyplot()
    fig, axes = plt.subplots(2, len(panels), figsize=(7 * len(panels), 6.5), squeeze=False,
                             sharex=True, sharey="row", gridspec_kw={"height_ratios": [3, 1]})
    twins: list[tuple[Any, Any]] = []
    for col, (name, (steps, marks)) in enumerate(panels.items()):
        twins.append((_plot_tokens(axes[0][col], steps, name, marks), _plot_rows(axes[1][col], steps, marks)))
    for row in (0, 1):  # the twin axes too share one scale across panels, so panels compare at a glance
        top = max(t[row].get_ylim()[1] for t in twins)
        for t in twins:
            t[row].set_ylim(0, top)
    return save(fig, path)


# -- the command ----------------------------------------------------------------------------------


def window(steps: Sequence[Mapping[str, Any]], start: float, span: float | None = None
           ) -> list[dict[str, Any]]:
    """The steps that start at or after ``start`` (and, with ``span``, before ``start + span``), their start
    times made relative to ``start``: a server's timeline (host clock) cut to one benchmark run."""
    end = math.inf if span is None else start + span
    return [{**s, "start_time": s["start_time"] - start} for s in steps if start <= s["start_time"] < end]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `plait bench timeline`."""
    p = subparsers.add_parser("timeline", help="summarise and plot step timelines (from dump or `bench w4`)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", metavar="file",
                   help="timeline JSONs (timeline.dump, `plait serve --step-timeline-file`) or `plait bench "
                        "w4` results; several are plotted side by side")
    p.add_argument("--plot", default=None, metavar="PNG", help="write the plot here (needs matplotlib)")
    p.add_argument("--start", type=float, nargs="+", default=None, metavar="SECONDS",
                   help="only steps from this time on the file's clock (a server's is its host's "
                        "monotonic clock: w5_sweep records each rate's start on it), shown from 0; one for "
                        "all files or one per file")
    p.add_argument("--span", type=float, default=None, metavar="SECONDS", help="only this long after --start")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    starts = args.start or [None]
    if len(starts) not in (1, len(args.files)):
        raise SystemExit(f"--start: one time for all files or one per file ({len(args.files)}), "
                         f"got {len(starts)}")
    panels: dict[str, Panel] = {}
    for path, start in zip(args.files, starts * len(args.files) if len(starts) == 1 else starts):
        for name, (steps, marks) in load(path).items():
            if start is not None:
                steps, marks = window(steps, start, args.span), {k: t - start for k, t in marks.items()}
            panels[name] = (steps, marks)
    for name, (steps, _) in panels.items():
        print(f"{name}: " + ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                                      for k, v in summarize(steps).items()))
    if args.plot:
        print(f"plot: {plot_timelines(panels, args.plot)}")
    return 0
