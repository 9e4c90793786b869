"""Benchmark pictures (PNG): TTFT CDF, per-stream ITL over time, throughput over time, the W5 sweep, first
requests with and without the start-up warm-up.

matplotlib is imported only when a plot is asked for (it is in the `bench` and `test` extras).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from plait.bench.metrics import MS_PER_S, RequestResult

DPI = 120
# Throughput-over-time buckets: about this many across the run, never narrower than MIN_BUCKET_S.
NUM_TIME_BUCKETS = 40
MIN_BUCKET_S = 0.05
SERVE_PLOTS = ("ttft_cdf.png", "itl_over_time.png", "throughput_over_time.png")
LEGEND_HEADROOM = 12  # log-scale bar charts: room above the tallest bar, as a factor of it


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend, or a ValueError saying how to install it."""
    try:
        import matplotlib
    except ImportError as err:
        raise ValueError(f"plots need matplotlib: pip install 'plait[bench]' ({err})") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    pyplot().close(fig)
    return path


def plot_ttft_cdf(results: Sequence[RequestResult], path: str | Path) -> Path:
    plt = pyplot()
    ttfts = np.sort([r.ttft * MS_PER_S for r in results if r.success])
    fig, ax = plt.subplots(figsize=(6, 4))
    if len(ttfts):
        ax.step(ttfts, np.arange(1, len(ttfts) + 1) / len(ttfts), where="post")
    ax.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="Time to first token, CDF",
           ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    return save(fig, path)


def plot_itl_over_time(results: Sequence[RequestResult], path: str | Path) -> Path:
    """Every stream's inter-token gaps, each at the time its later chunk arrived."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    for r in results:
        times = r.chunk_times
        if len(times) > 1:
            ax.plot(times[1:], np.asarray(r.itl) * MS_PER_S, linewidth=0.7, alpha=0.6)
    ax.set(xlabel="time since start (s)", ylabel="inter-token latency (ms)",
           title="ITL over time, one line per stream")
    ax.grid(alpha=0.3)
    return save(fig, path)


def _bucket_width(end_s: float) -> float:
    return max(MIN_BUCKET_S, end_s / NUM_TIME_BUCKETS)


def plot_throughput_over_time(results: Sequence[RequestResult], path: str | Path) -> Path:
    """Token chunks per second and requests in flight, in buckets across the run."""
    plt = pyplot()
    done = [r for r in results if r.success]
    end = max((r.start_time + r.latency for r in done), default=0.0)
    width = _bucket_width(end)
    edges = np.arange(0.0, end + width, width)
    if len(edges) < 2:
        edges = np.array([0.0, width])
    chunks = np.concatenate([np.asarray(r.chunk_times) for r in done]) if done else np.array([])
    counts, _ = np.histogram(chunks, bins=edges)
    mids = (edges[:-1] + edges[1:]) / 2
    in_flight = [sum(r.start_time <= t < r.start_time + r.latency for r in done) for t in mids]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(mids, counts / width, label="output tokens/s", color="tab:blue")
    ax.set(xlabel="time since start (s)", ylabel="output tokens/s", title="Throughput over time")
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot(mids, in_flight, label="requests in flight", color="tab:orange", linestyle="--")
    ax2.set_ylabel("requests in flight")
    ax.legend(loc="upper left")
    ax2.legend(loc="upper right")
    return save(fig, path)


def plot_serve(results: Sequence[RequestResult], out_dir: str | Path) -> list[Path]:
    """The three `plait bench serve --plot` pictures, in ``out_dir``."""
    out = Path(out_dir)
    ttft, itl, throughput = SERVE_PLOTS
    return [plot_ttft_cdf(results, out / ttft), plot_itl_over_time(results, out / itl),
            plot_throughput_over_time(results, out / throughput)]


def plot_sweep(rows: dict[str, list[dict[str, Any]]], path: str | Path) -> Path:
    """p99 TTFT and p99 ITL against request rate, one line per policy (rows: policy -> per-rate metrics)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for policy, runs in rows.items():
        rates = [r["request_rate"] for r in runs]
        axes[0].plot(rates, [r["p99_ttft_ms"] for r in runs], marker="o", label=policy)
        axes[1].plot(rates, [r["p99_itl_ms"] for r in runs], marker="o", label=policy)
    rates = sorted({r["request_rate"] for runs in rows.values() for r in runs})
    for ax, name in zip(axes, ("p99 TTFT (ms)", "p99 ITL (ms)")):
        ax.set(xlabel="request rate (req/s)", ylabel=name, title=f"{name} against request rate")
        ax.set_xscale("log", base=2)
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.grid(alpha=0.3)
        ax.legend()
    return save(fig, path)


def plot_stream_itls(panels: dict[str, tuple[list[list[float]], dict[str, float]]], path: str | Path) -> Path:
    """Side by side, one panel per run: each stream's gaps between tokens against time, with the
    run's marks (panels: name -> (each stream's token times in seconds, {label: time})."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4), squeeze=False, sharey=True)
    for ax, (name, (streams, marks)) in zip(axes[0], panels.items()):
        for i, times in enumerate(streams):
            if len(times) > 1:
                ax.plot(times[1:], np.diff(times) * MS_PER_S, linewidth=0.7, label=f"stream {i}")
        for label, t in marks.items():
            ax.axvline(t, linestyle="--", linewidth=1, color="gray")
            ax.annotate(label, (t, 1), xycoords=("data", "axes fraction"), rotation=90, va="top",
                        ha="right", fontsize="x-small")
        ax.set(xlabel="time since start (s)", ylabel="inter-token latency (ms)", title=name)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize="small")
    return save(fig, path)


def plot_first_requests(runs: dict[str, dict[str, Any]], path: str | Path) -> Path:
    """Each request mix's slowest step in its first pass (log scale), one bar per run (runs: name ->
    benchmarks/first_requests.py's result), with each run's compiles after start-up in the legend."""
    plt = pyplot()
    first_pass = {name: [p for p in run["phases"] if p["phase"].endswith("(pass 1)")]
                  for name, run in runs.items()}
    phases = [p["phase"].removesuffix(" (pass 1)") for p in next(iter(first_pass.values()))]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(runs)
    x = np.arange(len(phases))
    for k, (name, run) in enumerate(runs.items()):
        label = (f"{name}: {run['compiles_after_startup']} compiles after start-up, "
                 f"{run['compile_ms_after_startup'] / MS_PER_S:.1f} s")
        ax.bar(x + (k - (len(runs) - 1) / 2) * width, [p["max_step_ms"] for p in first_pass[name]], width,
               label=label)
    ax.set_xticks(x, phases, rotation=20, ha="right")
    ax.set_yscale("log")
    tallest = max(p["max_step_ms"] for passes in first_pass.values() for p in passes)
    ax.set_ylim(top=tallest * LEGEND_HEADROOM)  # the legend above the bars, not over them
    ax.set(ylabel="slowest step of the mix's first pass (ms)",
           title="A fresh machine's first requests (empty Triton cache)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    return save(fig, path)
