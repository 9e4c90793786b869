"""What a fresh machine's first requests wait for: kernel specialisations compiled after start-up.

Starts an engine on an empty Triton cache (a fresh machine, or a new container), then drives request
mixes a server meets (streams decoding, a long prompt arriving beside them, a burst of long prompts,
prefix-cache hits, sampling options, a prompt near the context limit), each twice. Every Triton
specialisation compiled after the engine was handed out is logged with its compile time, and each phase's
wall time and slowest step are recorded, so the first pass against the second shows what the first
requests paid. Run it once with the start-up warm-up and once without (``--no-warm-up``), each in a
fresh process:

    PYTHONPATH=. python benchmarks/first_requests.py --config shared/bench/models/llama-8b --out a.json
    PYTHONPATH=. python benchmarks/first_requests.py --config shared/bench/models/llama-8b --no-warm-up ...

and plot them side by side (each mix's slowest first-pass step):

    PYTHONPATH=. python benchmarks/first_requests.py --plot first.png "without=b.json" "with=a.json"
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# An empty Triton cache before triton is imported: every specialisation this process uses compiles here.
if "--keep-triton-cache" not in sys.argv:
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="plait-triton-")

import torch  # noqa: E402
import triton  # noqa: E402

from plait.bench.shared import device_name, write_json  # noqa: E402
from plait.config import EngineConfig  # noqa: E402
from plait.engine.engine import LLMEngine  # noqa: E402
from plait.engine.warmup import Arrivals, drive  # noqa: E402
from plait.sampling_params import SamplingParams  # noqa: E402


@dataclass
class CompileLog:
    """Triton specialisations compiled while ``phase`` is set (jit hooks, set before and after each)."""

    phase: str = "start-up"
    events: list[dict] = field(default_factory=list)
    _started: dict[str, float] = field(default_factory=dict)

    def before(self, key, repr, fn, **_) -> None:  # noqa: A002 - Triton's hook keywords
        self._started[str(key)] = time.perf_counter()
        return None  # None: compile as usual

    def after(self, key, repr, fn, **_) -> None:  # noqa: A002
        started = self._started.pop(str(key), None)
        ms = (time.perf_counter() - started) * 1e3 if started is not None else float("nan")
        self.events.append({"phase": self.phase, "kernel": fn.name, "ms": round(ms, 1),
                            "signature": repr[:400]})

    def install(self) -> None:
        triton.knobs.runtime.jit_cache_hook = self.before
        triton.knobs.runtime.jit_post_compile_hook = self.after


def _tokens(gen: torch.Generator, n: int, vocab: int) -> list[int]:
    return torch.randint(10, vocab - 10, (n,), generator=gen).tolist()


def _drive(engine: LLMEngine, arrivals: Arrivals, tag: str) -> dict:
    """Run the mix as the warm-up runs its own (plait.engine.warmup.drive); the wall time, the steps and the
    slowest (synchronised, so a step's compile and launch time land in it)."""
    start = time.perf_counter()
    step_ms: list[float] = []
    ids = itertools.count()

    def add(prompt: list[int], params: SamplingParams) -> None:
        engine.add_request(prompt, params, request_id=f"{tag}-{next(ids)}")

    def timed_step() -> None:
        t = time.perf_counter()
        engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        step_ms.append((time.perf_counter() - t) * 1e3)

    drive(engine, arrivals, add, timed_step)
    return {"wall_s": round(time.perf_counter() - start, 3), "steps": len(step_ms),
            "max_step_ms": round(max(step_ms, default=0.0), 1)}




def _phases(vocab: int, max_len: int, seed: int) -> dict[str, Callable[[], Arrivals]]:
    """Request mixes by name, of other sizes than the warm-up's (plait/engine/warmup.py)."""
    gen = torch.Generator().manual_seed(seed)

    def greedy(out: int) -> SamplingParams:
        return SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)

    def prompts(lengths: list[int], out: int) -> list[tuple[list[int], SamplingParams]]:
        return [(_tokens(gen, min(n, max_len - out - 1), vocab), greedy(out)) for n in lengths]

    def streams(k: int, out: int) -> list[tuple[list[int], SamplingParams]]:
        return prompts([100 + 13 * i for i in range(k)], out)

    shared = _tokens(gen, min(2000, max_len // 2), vocab)
    hits = [(shared + _tokens(gen, 200 + 50 * i, vocab), greedy(24)) for i in range(3)]
    sampled = [SamplingParams(max_tokens=12, ignore_eos=True, **kw) for kw in (
        dict(temperature=0.9, top_p=0.95, seed=11), dict(temperature=1.0, top_k=20, seed=12),
        dict(temperature=0.6, min_p=0.1, seed=13),
        dict(temperature=1.0, presence_penalty=0.2, frequency_penalty=0.6, repetition_penalty=1.3, seed=14),
        dict(temperature=0.0, logit_bias={11: 5.0, 12: -100.0}), dict(temperature=0.0, logprobs=3),
        dict(temperature=0.0, prompt_logprobs=1),
        dict(temperature=0.0, allowed_token_ids=list(range(100, 400))))]
    burst = [6000, 2600, 1900, 700, 300, 450]
    return {
        "streams": lambda: {0: streams(6, 48)},
        "long prompt beside streams": lambda: {0: streams(5, 120), 12: prompts([3500], 8)},
        "burst of long prompts": lambda: {0: streams(10, 150), 6: prompts(burst, 16)},
        "prefix-cache hits": lambda: {0: [(shared + _tokens(gen, 300, vocab), greedy(4))], 40: hits},
        "sampling options, together": lambda: {0: [(_tokens(gen, 64, vocab), p) for p in sampled]},
        "sampling options, alone": lambda: {12 * i: [(_tokens(gen, 64, vocab), p)]
                                            for i, p in enumerate(sampled)},
        "prompt near the context limit": lambda: {0: prompts([max_len], 8)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="model folder (random weights: --load-format dummy)")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--no-warm-up", dest="warm_up", action="store_false")
    parser.add_argument("--keep-triton-cache", action="store_true",
                        help="use the machine's Triton cache instead of an empty one")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=2, help="passes over the mixes (default: 2)")
    parser.add_argument("--out", default=None, help="write the result JSON here")
    parser.add_argument("--plot", nargs="+", metavar=("PNG", "RESULT"), default=None,
                        help="instead of running: plot the given results (PNG then NAME=RESULT.json ...)")
    args = parser.parse_args()
    if args.plot:
        _plot(args.plot[0], args.plot[1:])
        return
    if args.out is None or args.config is None:
        parser.error("--config and --out are required unless --plot is given")

    log = CompileLog()
    log.install()
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=args.config, load_format=args.load_format, usage="serve",
                                    max_model_len=args.max_model_len, warm_up=args.warm_up))
    startup_s = time.perf_counter() - t0
    at_start = len(log.events)
    vocab, max_len = engine.model_config.vocab_size, engine.max_model_len
    phases = []
    for round_ in range(1, args.rounds + 1):
        for name, arrivals in _phases(vocab, max_len, seed=round_).items():
            log.phase = f"{name} (pass {round_})"
            before = len(log.events)
            stats = _drive(engine, arrivals(), tag=f"{round_}-{len(phases)}")
            compiled = log.events[before:]
            phases.append({"phase": log.phase, **stats, "compiles": len(compiled),
                           "compile_ms": round(sum(e["ms"] for e in compiled), 1)})
            print(f"{log.phase:45s} {stats['wall_s']:7.2f} s, slowest step {stats['max_step_ms']:7.1f} ms, "
                  f"{len(compiled)} compiles ({phases[-1]['compile_ms']:.0f} ms)", flush=True)
    after = log.events[at_start:]
    result = {
        "what": "Triton specialisations compiled after start-up while a server's request mixes run, on an "
                "empty Triton cache; each phase twice (the second pass on other tokens)",
        "command": "PYTHONPATH=. python benchmarks/first_requests.py " + " ".join(sys.argv[1:]),
        "device": device_name(),
        "torch": torch.__version__, "triton": triton.__version__,
        "warm_up": args.warm_up, "startup_s": round(startup_s, 2),
        "warm_up_s": round(engine.warm_up_report.seconds, 2) if engine.warm_up_report else None,
        "compiles_at_startup": at_start,
        "compile_ms_at_startup": round(sum(e["ms"] for e in log.events[:at_start]), 1),
        "compiles_after_startup": len(after),
        "compile_ms_after_startup": round(sum(e["ms"] for e in after), 1),
        "phases": phases, "compiled_after_startup": after,
    }
    write_json(Path(args.out), result)
    print(f"start-up {startup_s:.1f} s ({at_start} compiles); after it {len(after)} compiles, "
          f"{result['compile_ms_after_startup']:.0f} ms", flush=True)


def _plot(png: str, named_results: list[str]) -> None:
    """--plot PNG NAME=RESULT.json ...: the slowest step of each mix's first pass, run beside run."""
    import json

    from plait.bench.plots import plot_first_requests

    runs = {}
    for item in named_results:
        name, sep, path = item.partition("=")
        if not sep:
            raise SystemExit(f"--plot takes NAME=RESULT.json after the PNG, got {item!r}")
        runs[name] = json.loads(Path(path).read_text())
    if not runs:
        raise SystemExit("--plot needs at least one NAME=RESULT.json")
    print(f"plot: {plot_first_requests(runs, png)}")


if __name__ == "__main__":
    main()
