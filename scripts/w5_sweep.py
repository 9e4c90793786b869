"""W5, the serving sweep: `plait serve` once per scheduling policy, W5's Poisson load at each request
rate through `plait bench serve`'s client, one table per policy and a plot of p99 TTFT / p99 ITL.

    PYTHONPATH=. .venv/bin/python scripts/w5_sweep.py --out benchmarks/results/w5 -- \\
        --model ../shared/bench/models/llama-8b --load-format dummy

Arguments after ``--`` go to `plait serve` (engine knobs). Each rate gets prompts of its own (seed +
the rate's index), the same under every policy, so no prompt is served twice by a server's prefix
cache. Writes, in --out: w5.json (every rate's metrics), w5.md (the tables), w5.png, a detailed
result per policy and rate, each server's log, and with --step-timelines each server's step timeline.
Policies may be swept by separate commands into one --out: the tables and the plot cover every policy
swept there with the same settings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from plait.bench.datasets import W5_OUTPUT_LENS, W5_PROMPT_MIX, random_requests
from plait.bench.metrics import parse_goodput
from plait.bench.serve_client import ServeBenchConfig, is_healthy, run_benchmark
from plait.config import SCHEDULING_POLICIES

REPO = Path(__file__).resolve().parents[1]
W5_RATES = "1,2,4,8,16"
W5_NUM_PROMPTS = 200
W5_GOODPUT = ("ttft:1000", "tpot:50")  # WORKLOADS.md: TTFT <= 1 s and TPOT <= 50 ms
BANNER = re.compile(r"serving '.*' on (http://\S+) \(OpenAI API")
POLL_S = 0.2
STOP_TIMEOUT_S = 30.0
# (column title, metric key, format) of the markdown tables.
COLUMNS = (
    ("rate (req/s)", "request_rate", "{:g}"), ("done", "completed", "{}"), ("failed", "failed", "{}"),
    ("req/s", "request_throughput", "{:.2f}"), ("goodput (req/s)", "request_goodput", "{:.2f}"),
    ("output tok/s", "output_throughput", "{:.1f}"),
    ("TTFT p50 (ms)", "median_ttft_ms", "{:.1f}"), ("TTFT p99 (ms)", "p99_ttft_ms", "{:.1f}"),
    ("TPOT p50 (ms)", "median_tpot_ms", "{:.1f}"), ("TPOT p99 (ms)", "p99_tpot_ms", "{:.1f}"),
    ("ITL p50 (ms)", "median_itl_ms", "{:.1f}"), ("ITL p99 (ms)", "p99_itl_ms", "{:.1f}"),
    ("E2E p50 (ms)", "median_e2el_ms", "{:.0f}"), ("E2E p99 (ms)", "p99_e2el_ms", "{:.0f}"),
)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    argv = sys.argv[1:] if argv is None else argv
    serve_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, serve_args = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for the results")
    p.add_argument("--rates", default=W5_RATES, help=f"request rates, req/s (default: {W5_RATES})")
    p.add_argument("--policies", default=",".join(SCHEDULING_POLICIES))
    p.add_argument("--num-prompts", type=int, default=W5_NUM_PROMPTS)
    p.add_argument("--prompt-mix", default=W5_PROMPT_MIX)
    p.add_argument("--output-len", default=W5_OUTPUT_LENS)
    p.add_argument("--vocab-size", type=int, default=None,
                   help="random token ids are drawn below this "
                        "(default: the vocab_size in --model's config.json)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", nargs="+", default=list(W5_GOODPUT), metavar="NAME:MS")
    p.add_argument("--num-warmups", type=int, default=1, help="unmeasured requests after each server start")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for /health")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--step-timelines", action="store_true",
                   help="each server writes its step timeline (timeline_<policy>.json in --out, on the "
                        "clock of each rate's started_monotonic)")
    args = p.parse_args(argv)
    if "--scheduling-policy" in serve_args or "--port" in serve_args:
        p.error("the sweep sets --scheduling-policy and --port itself: use --policies")
    return args, serve_args


def _serve_flag(serve_args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(serve_args):
        if arg == flag and i + 1 < len(serve_args):
            return serve_args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def vocab_size(args: argparse.Namespace, serve_args: list[str]) -> int:
    if args.vocab_size is not None:
        return args.vocab_size
    model = _serve_flag(serve_args, "--model")
    config = Path(model) / "config.json" if model else None
    if config is None or not config.is_file():
        raise SystemExit("w5_sweep: pass --vocab-size (no --model folder with a config.json to read it from)")
    return int(json.loads(config.read_text())["vocab_size"])


def start_server(serve_args: list[str], policy: str, host: str, log_path: Path, timeout_s: float
                 ) -> tuple[subprocess.Popen, str]:
    """`plait serve` on a free port; returns once /health answers."""
    cmd = [sys.executable, "-m", "plait.entrypoints.cli", "serve", "--host", host, "--port", "0",
           "--scheduling-policy", policy, "--log-level", "warning", *serve_args]
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    log = open(log_path, "w")  # noqa: SIM115 - the server writes to it for as long as it runs
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    log.close()
    deadline = time.monotonic() + timeout_s
    url = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"w5_sweep: `plait serve` exited with {proc.returncode}; see {log_path}")
        if url is None:
            match = BANNER.search(log_path.read_text(errors="replace"))
            url = match.group(1) if match else None
        if url is not None and is_healthy(url):
            return proc, url
        time.sleep(POLL_S)
    stop_server(proc)
    raise SystemExit(f"w5_sweep: the server did not become healthy in {timeout_s:.0f} s; see {log_path}")


def stop_server(proc: subprocess.Popen) -> None:
    """Ctrl-C (a graceful shutdown), then kill if it does not end."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def sweep_policy(policy: str, args: argparse.Namespace, serve_args: list[str], vocab: int,
                 rates: list[float], out: Path) -> list[dict[str, Any]]:
    log = out / f"server_{policy}.log"
    if args.step_timelines:
        serve_args = [*serve_args, "--step-timeline-file", str((out / f"timeline_{policy}.json").resolve())]
    proc, url = start_server(serve_args, policy, args.host, log, args.startup_timeout)
    rows = []
    try:
        for i, rate in enumerate(rates):
            samples = random_requests(args.num_prompts, vocab, args.seed + i, args.prompt_mix,
                                      args.output_len)
            config = ServeBenchConfig(base_url=url, request_rate=rate, arrival="poisson", seed=args.seed + i,
                                      goodput=parse_goodput(args.goodput),
                                      num_warmups=args.num_warmups if i == 0 else 0,
                                      show_progress=not args.disable_tqdm)
            print(f"w5_sweep: {policy}, {rate:g} req/s, {len(samples)} requests", flush=True)
            started = time.monotonic()  # the server's step timeline is on this clock
            run = asyncio.run(run_benchmark(samples, config))
            (out / f"{policy}_rate{rate:g}.json").write_text(json.dumps({**run.to_json(),
                                                                         "started_monotonic": started}))
            rows.append({**run.metrics, "request_rate": rate})
    finally:
        stop_server(proc)
    return rows


def markdown(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> str:
    lines = [f"# W5 sweep: {args.num_prompts} requests per rate, prompts {args.prompt_mix}, "
             f"outputs {args.output_len}, goodput {' '.join(args.goodput)}", ""]
    for policy, rows in results.items():
        lines += [f"## scheduling_policy={policy}", "",
                  "| " + " | ".join(title for title, _, _ in COLUMNS) + " |",
                  "|" + "---|" * len(COLUMNS)]
        for row in rows:
            cells = [fmt.format(row[key]) if row.get(key) is not None else "-" for _, key, fmt in COLUMNS]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def combined(out: Path, settings: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Every policy swept into ``out`` with the same settings, this run's and earlier runs' (so each
    policy may run as a command of its own), in SCHEDULING_POLICIES order."""
    results = {}
    for policy in SCHEDULING_POLICIES:
        path = out / f"w5_{policy}.json"
        if not path.is_file():
            continue
        saved = json.loads(path.read_text())
        if saved["settings"] != settings:
            print(f"w5_sweep: leaving out {path}: it was swept with other settings", file=sys.stderr)
            continue
        results[policy] = saved["rows"]
    return results


def main(argv: list[str] | None = None) -> int:
    args, serve_args = parse_args(argv)
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    if not rates or not all(r > 0 and not math.isinf(r) for r in rates):
        raise SystemExit(f"w5_sweep: --rates must be positive finite numbers, got {args.rates!r}")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies or not set(policies) <= set(SCHEDULING_POLICIES):
        raise SystemExit(f"w5_sweep: --policies must name some of {SCHEDULING_POLICIES}, "
                         f"got {args.policies!r}")
    vocab = vocab_size(args, serve_args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {"serve_args": serve_args, "num_prompts": args.num_prompts, "prompt_mix": args.prompt_mix,
                "output_len": args.output_len, "vocab_size": vocab, "seed": args.seed,
                "goodput": args.goodput, "rates": rates}
    failed = 0
    for policy in policies:
        rows = sweep_policy(policy, args, serve_args, vocab, rates, out)
        failed += sum(row["failed"] for row in rows)
        (out / f"w5_{policy}.json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=1))
    results = combined(out, settings)
    (out / "w5.json").write_text(json.dumps({"workload": "W5", **settings, "policies": results}, indent=1))
    (out / "w5.md").write_text(markdown(results, args))
    print(markdown(results, args))
    try:
        from plait.bench.plots import plot_sweep

        print(f"plot: {plot_sweep(results, out / 'w5.png')}")
    except ValueError as err:  # no matplotlib: the tables are still written
        print(f"w5_sweep: no plot: {err}", file=sys.stderr)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
