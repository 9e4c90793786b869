"""W1-style offline throughput of a hybrid (Mamba2 + attention) model, and where the GPU time goes.

256 requests, prompts uniform 100..1024 tokens (shared/bench/workloads.py, seed 1), 512 output
tokens each, greedy, EOS ignored, all submitted at once; random weights of the config. A short
warm-up (seed 2 prompts) compiles the Triton kernels first. Then a profiled slice of a mixed run
attributes device time to kernel families (Mamba scan / step / conv / norm, GEMMs, the rest).

    PYTHONPATH=. python benchmarks/hybrid_throughput.py --config benchmarks/configs/bamba-1b
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import torch

from plait.bench.shared import device_name
from plait.config import EngineConfig
from plait.engine.engine import LLMEngine
from plait.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[1]
# Where shared/bench (the workloads' prompt generator) may sit: beside or inside the checkout.
WORKLOADS_DIRS = (REPO / "shared" / "bench", REPO.parent / "shared" / "bench", Path("/work/shared/bench"))
# Kernel-name substrings -> family, first match wins (Triton kernels keep their Python names).
KERNEL_FAMILIES = (
    ("mamba_scan", ("_scan_kernel",)),
    ("mamba_step", ("_step_kernel",)),
    ("mamba_conv", ("_conv_kernel", "_conv_state_kernel")),
    ("mamba_gated_norm", ("_gated_norm_kernel",)),
    ("gemm", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "splitk")),
    ("copies_and_gathers", ("copy", "gather", "index", "scatter", "cat")),
)


def load_workloads(path: Path):
    spec = importlib.util.spec_from_file_location("workloads", path / "workloads.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(engine: LLMEngine, prompts: list[list[int]], output_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    engine.timeline.clear()
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=f"h{time.monotonic_ns()}-{i}")
    while engine.has_unfinished_requests():
        engine.step()
    _sync()
    total = time.perf_counter() - start
    steps = engine.timeline
    decode_only = [s for s in steps if s.num_prefill_tokens == 0]
    return {
        "total_s": total, "output_tok_per_s": len(prompts) * output_tokens / total, "steps": len(steps),
        "prefill_tokens": sum(s.num_prefill_tokens for s in steps),
        "steps_with_prefill_s": sum(s.duration_s for s in steps if s.num_prefill_tokens),
        "decode_only_steps": len(decode_only),
        "decode_only_steps_s": sum(s.duration_s for s in decode_only),
        "decode_only_step_ms_mean": 1e3 * sum(s.duration_s for s in decode_only) / max(1, len(decode_only)),
        "decode_only_rows_mean": sum(s.num_rows for s in decode_only) / max(1, len(decode_only)),
    }


def profile(engine: LLMEngine, prompts: list[list[int]], output_tokens: int, num_steps: int) -> dict:
    """Device time by kernel family over ``num_steps`` steps once prompts and decodes are mixed."""
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=f"prof-{i}")
    for _ in range(4):  # into the mixed regime: some requests decode while others prefill
        engine.step()
    _sync()
    kinds = torch.profiler.ProfilerActivity
    activity = kinds.CUDA if torch.cuda.is_available() else kinds.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        start = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        _sync()
        wall = time.perf_counter() - start
    for request_id in [f"prof-{i}" for i in range(len(prompts))]:
        engine.abort_request(request_id)
    families: dict[str, float] = {}
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0.0)
        if us <= 0:
            continue
        name = evt.key.lower()
        family = next((f for f, keys in KERNEL_FAMILIES if any(k in name for k in keys)), "other")
        families[family] = families.get(family, 0.0) + us / 1e3
    busy = sum(families.values())
    return {"steps": num_steps, "wall_ms": 1e3 * wall, "device_busy_ms": busy,
            "host_gap_ms": 1e3 * wall - busy, "device_ms_by_family": dict(sorted(families.items(),
                                                                              key=lambda kv: -kv[1]))}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="benchmarks/configs/bamba-1b")
    parser.add_argument("--workloads", default=None,
                        help="folder holding shared/bench/workloads.py (default: the first of "
                             f"{[str(d) for d in WORKLOADS_DIRS]} that exists)")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--min-prompt", type=int, default=100)
    parser.add_argument("--max-prompt", type=int, default=1024)
    parser.add_argument("--output", type=int, default=512)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--warmup-requests", type=int, default=16)
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results/hybrid_throughput.json")
    args = parser.parse_args()

    found = [d for d in WORKLOADS_DIRS if (d / "workloads.py").is_file()]
    if args.workloads is None and not found:
        raise SystemExit("shared/bench/workloads.py not found; pass --workloads")
    workloads = load_workloads(Path(args.workloads) if args.workloads else found[0])
    engine = LLMEngine(EngineConfig(model=args.config, load_format="dummy", max_num_seqs=args.requests,
                                    max_num_batched_tokens=args.budget,
                                    max_model_len=args.max_prompt + args.output + 1))
    engine.record_timeline = True
    vocab = engine.model_config.vocab_size
    runner = engine.runner
    result = {
        "device": device_name(), "config": args.config,
        "architecture": engine.model_config.architecture,
        "num_kv_cache_layers": len(runner.kv_caches), "num_mamba_layers": len(runner.recurrent_states or []),
        "state_slots": runner.num_state_slots, "kv_blocks": runner.num_kv_blocks,
        "state_gib": sum(s.conv.numel() * s.conv.element_size() + s.ssm.numel() * s.ssm.element_size()
                         for s in runner.recurrent_states or []) / 2**30,
        "attention_backend": runner.attn_backend.name, "requests": args.requests,
        "prompt_tokens": [args.min_prompt, args.max_prompt], "output_tokens": args.output,
        "max_num_batched_tokens": args.budget,
    }
    warm = workloads.random_prompts(args.warmup_requests, args.min_prompt, args.max_prompt, vocab, seed=2)
    result["warmup"] = run(engine, warm, 16)
    timed = workloads.random_prompts(args.requests, args.min_prompt, args.max_prompt, vocab, seed=1)
    result["timed"] = run(engine, timed, args.output)
    print(json.dumps(result["timed"], indent=2), flush=True)
    result["profile"] = profile(engine, timed[:64], args.output, args.profile_steps)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
