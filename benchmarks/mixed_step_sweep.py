"""The room mixed steps live in (GPU): what W4 gives at each cap on prompt tokens beside decodes.

    PYTHONPATH=. python benchmarks/mixed_step_sweep.py --config ../shared/bench/models/llama-8b \
        --out sweep.json

One engine (random weights, graphs captured up to the largest cap) runs a shortened W4 once per
variant: four streams decode, a long prompt arrives when each has --arrive-after tokens. Variants:
``mixed`` at each --caps value, and ``prefill_first`` at each --first-budgets value. Reported per
variant, by shared/bench/w4_metrics.py: the long request's TTFT, steady and window p99 ITL. Token
times are taken as the synchronous engine's step() hands them over (no async API, no HTTP).

Beside them: the step time of every step that carried prompt tokens beside decodes, by its prompt
tokens; cuBLAS time of the model's projections by row count M (does a step of 4 + 256 rows pay for a
third 128-row tile?); and a profile of one eager mixed step, kernel by kernel.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from plait.bench.shared import find_shared, load_shared_module
from plait.config import EngineConfig
from plait.engine.engine import LLMEngine
from plait.sampling_params import SamplingParams

GEMM_ROWS = (4, 64, 128, 192, 252, 256, 260, 320, 384, 448, 512, 640, 768, 1024, 2048, 4096)
PROFILE_TOP = 12


def run_variant(engine: LLMEngine, workloads, w4_metrics, policy: str, cap: int, budget: int,
                args: argparse.Namespace, seed: int) -> dict:
    cfg = engine.config  # the scheduler reads these each step
    cfg.scheduling_policy, cfg.max_num_batched_tokens = policy, budget
    cfg.max_prefill_tokens_beside_decodes, cfg.prefill_drain_steps = cap, 0  # the cap alone
    vocab = engine.model_config.vocab_size
    streams = workloads.random_prompts(4, 128, 128, vocab, seed)
    (long_prompt,) = workloads.random_prompts(1, args.long_len, args.long_len, vocab, seed + 1000)
    sp = SamplingParams(temperature=0.0, max_tokens=args.stream_len, ignore_eos=True)
    lp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ids = [engine.add_request(p, sp) for p in streams]
    times: dict[str, list[float]] = {i: [] for i in ids}
    long_id, arrival = None, None
    engine.timeline.clear()
    engine.record_timeline = True
    t_start = time.perf_counter()
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            times.setdefault(out.request_id, []).extend(now for _ in out.outputs[0].delta_token_ids)
        if long_id is None and all(len(times[i]) >= args.arrive_after for i in ids):
            arrival = time.perf_counter()
            long_id = engine.add_request(long_prompt, lp)
    t_end = time.perf_counter()
    engine.record_timeline = False
    long_times = times[long_id]
    n_out = sum(len(v) for v in times.values())
    streams = {i: times[i] for i in ids}
    metrics = w4_metrics(streams, arrival, long_times[0], long_times, t_start, t_end, n_out)
    mixed_steps = [(s.num_prefill_tokens, s.num_decode_tokens, s.duration_s * 1e3, s.used_cuda_graph)
                   for s in engine.timeline if s.num_prefill_tokens and s.num_decode_tokens]
    return {"policy": policy, "cap": cap, "budget": budget, "metrics": metrics, "mixed_steps": mixed_steps}


def gemm_sweep(engine: LLMEngine) -> dict:
    from triton.testing import do_bench

    c = engine.model_config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    h, inter = c.hidden_size, c.intermediate_size
    shapes = {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * inter, h), "down": (h, inter)}
    weights = {k: torch.randn(n, k_, device="cuda", dtype=torch.bfloat16) for k, (n, k_) in shapes.items()}
    rows = []
    for m in GEMM_ROWS:
        per = {}
        for name, w in weights.items():
            x = torch.randn(m, w.shape[1], device="cuda", dtype=torch.bfloat16)
            per[name] = do_bench(lambda x=x, w=w: F.linear(x, w), warmup=25, rep=100, return_mode="median")
        layer_ms = sum(per.values())
        flops = 2 * m * sum(n * k for n, k in shapes.values())
        rows.append({"m": m, "ms": per, "layer_ms": layer_ms, "model_ms": layer_ms * c.num_hidden_layers,
                     "tflops": flops / layer_ms / 1e9})
        print(f"M={m:5d}: layer {layer_ms * 1e3:7.1f} us, model {layer_ms * c.num_hidden_layers:6.2f} ms, "
              f"{flops / layer_ms / 1e9:6.1f} TFLOP/s  "
              + " ".join(f"{k} {v * 1e3:.1f}" for k, v in per.items()))
    return {"shapes": shapes, "rows": rows}


def profile_mixed_step(engine: LLMEngine, workloads, prompt_tokens: int, context: int, seed: int) -> dict:
    """Kernel times of eager steps of 4 decodes + ``prompt_tokens`` tokens of a prompt at ``context``."""
    from torch.profiler import ProfilerActivity, profile

    cfg = engine.config
    cfg.scheduling_policy, cfg.max_prefill_tokens_beside_decodes = "mixed", prompt_tokens
    vocab = engine.model_config.vocab_size
    sp = SamplingParams(temperature=0.0, max_tokens=4096, ignore_eos=True)
    ids = [engine.add_request(p, sp) for p in workloads.random_prompts(4, 128, 128, vocab, seed)]
    for _ in range(8):
        engine.step()
    (long_prompt,) = workloads.random_prompts(1, context + 8 * prompt_tokens, context + 8 * prompt_tokens,
                                              vocab, seed + 1000)
    long_id = engine.add_request(long_prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    long_request = engine._tracked[long_id].request
    while long_request.num_computed_tokens < context:
        engine.step()
    graphs, engine.runner.graphs = engine.runner.graphs, None  # eager: every kernel shows
    try:
        engine.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                engine.step()
            torch.cuda.synchronize()
    finally:
        engine.runner.graphs = graphs
    for rid in [*ids, long_id]:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in events) / 3 / 1e3
    top = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:PROFILE_TOP]
    print(f"eager mixed step, 4 decodes + {prompt_tokens} prompt tokens at context ~{context}: "
          f"{total:.2f} ms of device time")
    rows = []
    for e in top:
        ms = e.self_device_time_total / 3 / 1e3
        print(f"  {ms:7.3f} ms x{e.count / 3:<4.0f} {e.key[:100]}")
        rows.append({"kernel": e.key, "ms": ms, "calls": e.count / 3})
    return {"prompt_tokens": prompt_tokens, "context": context, "device_ms": total, "top": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="../shared/bench/models/llama-8b")
    parser.add_argument("--caps", default="128,256,384,512,768,1024")
    parser.add_argument("--first-budgets", default="2048,8192")
    parser.add_argument("--long-len", type=int, default=4096)
    parser.add_argument("--stream-len", type=int, default=320)
    parser.add_argument("--arrive-after", type=int, default=64)
    parser.add_argument("--no-gemm", action="store_true")
    parser.add_argument("--no-variants", action="store_true", help="only the profiles and the GEMM sweep")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    shared = find_shared(None)
    workloads = load_shared_module(shared, "workloads.py")
    w4_metrics = load_shared_module(shared, "w4_metrics.py").w4_metrics
    caps = [int(c) for c in args.caps.split(",")]
    budgets = [int(b) for b in args.first_budgets.split(",")]
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=args.config, load_format="dummy", max_model_len=8192,
                                    max_num_batched_tokens=max(budgets), max_num_seqs=256,
                                    max_prefill_tokens_beside_decodes=max(caps), enable_prefix_caching=False))
    print(f"engine ready in {time.perf_counter() - t0:.1f} s")
    result: dict = {"device": torch.cuda.get_device_name(), "config": args.config, "variants": []}
    variants = [("mixed", c, max(budgets)) for c in caps] + [("prefill_first", 0, b) for b in budgets]
    if not args.no_variants:  # warm-up
        run_variant(engine, workloads, w4_metrics, "mixed", max(caps), max(budgets), args, seed=2)
    for policy, cap, budget in tqdm([] if args.no_variants else variants, desc="variants"):
        variant = run_variant(engine, workloads, w4_metrics, policy, cap, budget, args, seed=1)
        result["variants"].append(variant)
    print("policy        cap  budget  TTFT ms  steady p99  window p99  ratio  mixed-step ms by prompt tokens")
    for v in result["variants"]:
        m = v["metrics"]
        by_p: dict[int, list[float]] = {}
        for p, _, ms, _ in v["mixed_steps"]:
            by_p.setdefault(p, []).append(ms)
        steps = " ".join(f"{p}:{np.median(ms):.1f}" for p, ms in sorted(by_p.items())[-3:])
        print(f"{v['policy']:<13}{v['cap']:>4}{v['budget']:>8}{m['ttft_long_ms']:>9.1f}"
              f"{m['steady_itl_p99_ms']:>12.2f}{(m['window_itl_p99_ms'] or 0):>12.2f}"
              f"{(m.get('p99_itl_window_over_steady') or 0):>7.2f}  {steps}")
    result["profiles"] = [profile_mixed_step(engine, workloads, p, 2048, seed=3) for p in (256, 512)]
    if not args.no_gemm:
        result["gemm"] = gemm_sweep(engine)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
