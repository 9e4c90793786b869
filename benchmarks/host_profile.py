"""Where the host's time goes in decode steps: cProfile over an engine's steps (GPU or CPU).

    PYTHONPATH=. python benchmarks/host_profile.py --model shared/bench/models/llama-8b --load-format dummy \\
        --batch 1 --out /tmp/host_profile.json
    PYTHONPATH=. python benchmarks/host_profile.py --model shared/bench/models/llama-8b --load-format dummy \\
        --batch 1 --out /tmp/host_profile_draft.json \\
        --speculative-config '{"model": "benchmarks/configs/llama-1b", "num_speculative_tokens": 3}'

``--batch`` requests of random token prompts decode together; once they are all past their prompts, the next
``--steps`` steps run under cProfile. The JSON holds the functions with the most time of their own, and the
cumulative time of the step's parts (per step). cProfile slows Python code by itself (its hooks), so compare
shares within one run, not its totals with unprofiled runs.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time

import torch

from plait.bench.shared import device_name, write_json
from plait.config import EngineConfig
from plait.engine.engine import LLMEngine
from plait.sampling_params import SamplingParams

# The step's parts whose cumulative time the result lists: (file suffix, function name).
PARTS = (
    ("engine/engine.py", "step"),
    ("engine/scheduler.py", "schedule"),
    ("engine/draft_model.py", "prepare"),
    ("runner/model_runner.py", "launch"),
    ("runner/forward_batch.py", "build_step_arrays"),
    ("runner/cuda_graphs.py", "pad"),
    ("runner/input_buffers.py", "stage"),
    ("runner/input_buffers.py", "_fill"),
    ("runner/input_buffers.py", "_copy_and_land"),
    ("runner/input_buffers.py", "views"),
    ("runner/cuda_graphs.py", "replay"),
    ("runner/model_runner.py", "_sample"),
    ("runner/model_runner.py", "collect"),
    ("engine/engine.py", "_postprocess"),
)
TOP = 40


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="(default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--speculative-config", type=json.loads, default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, load_format=args.load_format, seed=0,
                                    max_model_len=args.max_model_len, enable_prefix_caching=False,
                                    speculative_config=args.speculative_config))
    g = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.steps * 2 + 64, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(torch.randint(10, vocab, (args.prompt_len,), generator=g).tolist(), params,
                           request_id=str(i))
    while any(r.is_prefilling for r in engine.scheduler.running) or engine.num_waiting:
        engine.step()
    for _ in range(20):  # every decode shape warm
        engine.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(args.steps):
        engine.step()
    profiler.disable()
    wall = time.perf_counter() - start
    stats = pstats.Stats(profiler)
    rows = []
    for (path, line, name), (_, calls, own, cumulative, _) in stats.stats.items():
        rows.append({"function": f"{path.split('site-packages/')[-1].split('plait/')[-1]}:{line}({name})",
                     "calls": calls, "own_ms_per_step": 1000 * own / args.steps,
                     "cumulative_ms_per_step": 1000 * cumulative / args.steps, "path": path, "name": name})
    parts = {}
    for suffix, name in PARTS:
        hits = [r for r in rows if r["path"].endswith(suffix) and r["name"] == name]
        if hits:
            parts[f"{suffix}:{name}"] = round(sum(r["cumulative_ms_per_step"] for r in hits), 4)
    top = sorted(rows, key=lambda r: -r["own_ms_per_step"])[:TOP]
    result = {
        "what": f"cProfile over {args.steps} decode steps, {args.batch} rows, ms a step (profiled: Python "
                "code runs slower under cProfile's hooks)",
        "command": "python benchmarks/host_profile.py " + " ".join(
            f"--{a.replace('_', '-')} {json.dumps(v) if isinstance(v, dict) else v}"
            for a, v in vars(args).items() if v is not None and a != "out"),
        "device": device_name(), "torch": torch.__version__,
        "wall_ms_per_step_profiled": round(1000 * wall / args.steps, 3),
        "parts_cumulative_ms_per_step": parts,
        "top_own_time": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                          if k not in ("path", "name")} for r in top],
    }
    write_json(args.out, result)
    print(f"{result['wall_ms_per_step_profiled']} ms a step (profiled)")
    for k, v in parts.items():
        print(f"  {k}: {v}")
    for r in result["top_own_time"][:25]:
        print(f"  {r['own_ms_per_step']:.4f} own, {r['cumulative_ms_per_step']:.4f} cum, {r['calls']:>6}  "
              f"{r['function']}")


if __name__ == "__main__":
    main()
