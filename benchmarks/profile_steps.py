"""Where a step's GPU time goes: torch.profiler over eager steps of a random-weight model (GPU).

    PYTHONPATH=. python benchmarks/profile_steps.py --config shared/bench/models/llama-8b --out prof.json

Profiles four step kinds, eager (so every kernel shows; graphs hide them): a prefill step of the
full token budget, a mixed step (decode rows beside prompt chunks), a decode step of --rows rows at
--context tokens, and a batch-1 decode step.
Prints the top kernels of each by device time.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from plait.config import EngineConfig
from plait.engine.engine import LLMEngine
from plait.sampling_params import SamplingParams

TOP_KERNELS = 14


def _profile(engine: LLMEngine, label: str, steps: int) -> dict:
    for _ in range(2):
        engine.step()  # warm: compile every kernel this step shape uses
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    return _summarise(prof, label, steps)


def profile_workload(config: str, name: str, budget: int, steps: int) -> list[dict]:
    """Eager profiles of the first ``steps`` steps of an offline workload (its prompt-carrying steps)."""
    from plait.bench.shared import find_shared, load_shared_module

    workloads = load_shared_module(find_shared(None, required="workloads.py"), "workloads.py")
    _, num, lo, hi, output_len = workloads.OFFLINE[name]
    vocab = json.loads((Path(config) / "config.json").read_text())["vocab_size"]
    engine = LLMEngine(EngineConfig(model=config, load_format="dummy", enforce_eager=True,
                                    max_num_batched_tokens=budget, max_model_len=hi + output_len,
                                    max_prefill_tokens_beside_decodes=0, enable_prefix_caching=False))
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    engine.record_timeline = True
    for warm in (True, False):  # the first pass compiles every kernel these step shapes use
        for p in workloads.random_prompts(num, lo, hi, vocab, 2 if warm else 1):
            engine.add_request(p, params)
        results = []
        for i in range(steps):
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                engine.step()
                torch.cuda.synchronize()
            if not warm:
                s = engine.timeline[-1]
                label = f"{name} step {i} ({s.num_prefill_tokens} prompt + {s.num_decode_tokens} decode)"
                results.append(_summarise(prof, label, 1))
        for request in list(engine.scheduler.running) + list(engine.scheduler.waiting):
            engine.abort_request(request.request_id)
        engine.step()
    return results


def _summarise(prof, label: str, steps: int) -> dict:
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in events)
    top = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:TOP_KERNELS]
    print(f"\n{label}: {total / steps / 1e3:.3f} ms of device time per step")
    rows = []
    for e in top:
        share = e.self_device_time_total / total
        calls = e.count / steps
        print(f"  {e.self_device_time_total / steps / 1e3:8.3f} ms {share:6.1%} x{calls:<5.0f} {e.key[:90]}")
        rows.append({"kernel": e.key, "ms_per_step": e.self_device_time_total / steps / 1e3, "share": share,
                     "calls_per_step": calls})
    return {"label": label, "device_ms_per_step": total / steps / 1e3, "top": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="shared/bench/models/llama-8b")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--context", type=int, default=640)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--out", default=None)
    parser.add_argument("--workload", default=None,
                        help="profile this offline workload's first steps instead")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if args.workload:
        results = profile_workload(args.config, args.workload, args.budget, args.steps)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2))
        return
    vocab = json.loads((Path(args.config) / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    engine = LLMEngine(EngineConfig(model=args.config, load_format="dummy", enforce_eager=True,
                                    max_num_batched_tokens=args.budget, max_num_seqs=args.rows,
                                    max_model_len=4096, enable_prefix_caching=False))
    # Long enough that no request finishes before every prompt is in: the decode step has --rows rows.
    params = SamplingParams(temperature=0.0, max_tokens=1024, ignore_eos=True)
    results = []
    # Prefill: prompts of 512 tokens, so each step carries budget/512 of them.
    for _ in range(4 * args.budget // 512):
        engine.add_request(torch.randint(10, vocab, (512,), generator=g).tolist(), params)
    results.append(_profile(engine, f"prefill step ({args.budget} tokens)", 2))
    for request in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        engine.abort_request(request.request_id)
    engine.step()
    for _ in range(args.rows):
        engine.add_request(torch.randint(10, vocab, (args.context,), generator=g).tolist(), params)
    mixed_profiled = False
    while any(r.is_prefilling for r in engine.scheduler.running + list(engine.scheduler.waiting)):
        decodes = sum(not r.is_prefilling for r in engine.scheduler.running)
        if not mixed_profiled and decodes >= args.rows // 2:
            results.append(_profile(engine, f"mixed step ({decodes}+ decode rows beside prompt chunks)", 2))
            mixed_profiled = True
        engine.step()
    results.append(_profile(engine, f"decode step ({args.rows} rows, context ~{args.context})", 5))
    for request in list(engine.scheduler.running):
        engine.abort_request(request.request_id)
    engine.step()
    engine.add_request(torch.randint(10, vocab, (args.context,), generator=g).tolist(), params)
    engine.step()
    results.append(_profile(engine, "decode step (1 row)", 10))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
