"""How long `plait serve` takes from its start to its first 200 on /health, for one or more trees, alternated.

    python benchmarks/serve_startup.py --trees . ../other-checkout --runs 4 --out result.json

Each run starts `python -m plait.entrypoints.cli serve ARGS` in the tree (its own plait first on sys.path),
polls /health every 20 ms, then stops it with SIGINT. Runs of the trees alternate, so a drift of the machine
hits each alike; the medians are the numbers to compare.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

POLL_S = 0.02
PROBE_TIMEOUT_S = 0.5
START_LIMIT_S = 300.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def time_to_healthy(tree: Path, serve_args: list[str]) -> float:
    """Seconds from starting `plait serve` in ``tree`` to its first 200 on /health."""
    import httpx

    port = _free_port()
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "plait.entrypoints.cli", "serve", "--port", str(port),
                             *serve_args], cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.monotonic() - started < START_LIMIT_S:
            if proc.poll() is not None:
                raise RuntimeError(f"plait serve in {tree} exited with {proc.returncode} before answering")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=PROBE_TIMEOUT_S).status_code == 200:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            time.sleep(POLL_S)
        raise RuntimeError(f"plait serve in {tree} did not answer within {START_LIMIT_S:.0f} s")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs="+", type=Path, default=[Path(".")], help="checkouts of plait")
    parser.add_argument("--runs", type=int, default=4, help="starts of each tree")
    parser.add_argument("--out", type=Path, default=None, help="write the result JSON here")
    parser.add_argument("serve_args", nargs="*", help="after --: flags for plait serve (default: none)")
    args = parser.parse_args()
    seconds: dict[str, list[float]] = {str(tree): [] for tree in args.trees}
    for _ in range(args.runs):
        for tree in args.trees:
            seconds[str(tree)].append(round(time_to_healthy(tree.resolve(), args.serve_args), 3))
    result = {"what": __doc__.split("\n\n")[0], "serve_args": args.serve_args, "seconds": seconds,
              "median_s": {tree: statistics.median(runs) for tree, runs in seconds.items()}}
    print(json.dumps(result["median_s"]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
