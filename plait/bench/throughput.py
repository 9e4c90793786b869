"""`plait bench throughput`: offline workloads W1-W3 with random weights, beside the GPU's limits; or, with
--model, `vllm bench throughput`'s run of random or ShareGPT prompts on any model."""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from plait.bench.shared import device_name, find_shared, load_shared_module, run_isolated, write_json
from plait.config import EngineConfig
from plait.sampling_params import RequestOutputKind

if TYPE_CHECKING:  # torch and the engine load only when the benchmark runs, not with the CLI
    from plait.engine.engine import LLMEngine

TIMED_SEED, WARMUP_SEED = 1, 2  # WORKLOADS.md: warm up on other tokens so no prefix cache helps
# vLLM 0.26 on one H200 (WORKLOADS.md): output tok/s for W1/W2, ms per token for W3.
VLLM_H200 = {"W1": 29295.0, "W2": 9992.0, "W3": 4.69}
OFFLINE_PREFILL_CAP = 0  # max_prefill_tokens_beside_decodes for offline workloads: no cap
# --output-kind: the outputs the timed loop reads (vLLM's LLM.generate, which its benchmark runs, reads final
# ones only; "cumulative" is every request's output every step, as this benchmark read them before).
OUTPUT_KINDS = {"final_only": RequestOutputKind.FINAL_ONLY, "cumulative": RequestOutputKind.CUMULATIVE}
# `vllm bench throughput`'s defaults.
VLLM_INPUT_LEN, VLLM_OUTPUT_LEN, VLLM_NUM_PROMPTS = 1024, 128, 1000


def measure_roofline(shared: Path) -> dict:
    """Run shared/bench/roofline.py in a child process (it takes GBs while it runs) and parse it."""
    out = subprocess.run(
        [sys.executable, str(shared / "roofline.py")], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _engine(model_dir: Path, max_model_len: int, args: argparse.Namespace) -> LLMEngine:
    from plait.engine.engine import LLMEngine

    config = EngineConfig(
        model=str(model_dir),
        load_format="dummy",
        max_model_len=max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager,
        max_prefill_tokens_beside_decodes=args.max_prefill_tokens_beside_decodes,
        attention_backend=args.attention_backend,
        enable_prefix_caching=False,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
    )
    return LLMEngine(config)


def _run(engine: LLMEngine, prompts: list[list[int]], output_len: int, desc: str, args: argparse.Namespace
         ) -> tuple[float, int, float]:
    """(seconds, output tokens, seconds of them spent adding the requests) of one timed call."""
    import torch
    from tqdm import tqdm

    from plait.sampling_params import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            min_p=args.min_p, max_tokens=output_len, ignore_eos=True,
                            output_kind=OUTPUT_KINDS[args.output_kind])
    start = time.perf_counter()
    for p in prompts:
        engine.add_request(p, params)
    added = time.perf_counter()
    produced = 0
    with tqdm(total=len(prompts) * output_len, desc=desc, unit="tok", leave=False) as bar:
        while engine.has_unfinished_requests():
            # One bar update a step: per output (256 a step) the bar alone cost W1 ~0.2 s of its 4.5.
            # (Each output's delta is what is new to this reader: under final-only, the whole output.)
            new = sum(len(out.outputs[0].delta_token_ids) for out in engine.step())
            produced += new
            bar.update(new)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, produced, added - start


@contextmanager
def gc_pauses() -> Iterator[list[float]]:
    """Seconds of each Python garbage collection inside the block (they stall the host between steps)."""
    pauses: list[float] = []
    started: list[float] = []

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append(time.perf_counter() - started.pop())

    gc.callbacks.append(callback)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(callback)


@contextmanager
def triton_compiles() -> Iterator[list[str]]:
    """The Triton kernels compiled inside the block, by name: a timed run should compile none."""
    names: list[str] = []
    try:
        import triton

        runtime = triton.knobs.runtime
    except (ImportError, AttributeError):  # no triton, or one without knobs: nothing to count
        yield names
        return
    previous = runtime.jit_post_compile_hook

    def hook(**kwargs: object) -> None:
        names.append(kwargs["fn"].name)
        if previous is not None:
            previous(**kwargs)

    runtime.jit_post_compile_hook = hook
    try:
        yield names
    finally:
        runtime.jit_post_compile_hook = previous


def _prompt_steps(timeline: list) -> list[dict]:
    """The steps that carried prompt tokens (they run eager offline): where a slow one shows."""
    return [{"prompt_tokens": s.num_prefill_tokens, "decode_tokens": s.num_decode_tokens,
             "ms": round(s.duration_s * 1e3, 2), "graph": s.used_cuda_graph}
            for s in timeline if s.num_prefill_tokens]


def expert_sizes(moe) -> tuple[int, int]:
    """(bytes, weights) of a FusedMoE's parameters: MXFP4 codes pack two weights a byte, and their scales
    (buffers) are read with them."""
    from plait.layers.moe import MXFP4_WEIGHTS

    params = list(moe.parameters())
    read = sum(p.numel() * p.element_size() for p in params)
    numel = sum(p.numel() for p in params)
    if moe.weight_format == MXFP4_WEIGHTS:
        packed = moe.gate_up_proj.numel() + moe.down_proj.numel()
        read += moe.gate_up_scale.numel() + moe.down_scale.numel()
        numel += packed  # each byte is two weights
    return read, numel


def floor_seconds(engine: LLMEngine, prompts: list[list[int]], output_len: int, roof: dict) -> dict:
    """The physical floor of the workload on this GPU: every decode step reads all weights once plus
    the K/V of every running sequence at the measured read bandwidth; every prompt token costs its
    matmul FLOPs at the measured bf16 rate. (A lower bound: no engine overlaps them perfectly.) Under
    tensor parallelism the ranks read and multiply their slices at once: the floor is the driver's slice
    (the largest: it alone holds the LM head) on one GPU, and the all-reduces between them are not in it.

    A MoE model's step reads only the experts its rows are routed to: with the routing of random weights
    spread evenly, an expert is missed by every one of B rows' top-k picks with probability (1 - k/E)^B
    (B: the requests, all running at once offline); a prompt token multiplies by its k experts only."""
    from plait.layers.moe import FusedMoE

    model = engine.runner.model
    c = engine.model_config
    # FP8 layers (quantization="fp8") hold 1-byte weights plus an fp32 scale per row, read with them.
    scales = [b for name, b in model.named_buffers() if name.endswith("weight_scale")]
    weight_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *scales])
    embed = model.model.embed_tokens.weight
    embed_bytes, embed_numel = embed.numel() * embed.element_size(), embed.numel()
    if c.tie_word_embeddings:
        embed_bytes = embed_numel = 0  # the table is read whole as the lm_head
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    expert_params = [p for m in moes for p in m.parameters()]
    sizes = [expert_sizes(m) for m in moes]
    expert_bytes, expert_numel = sum(read for read, _ in sizes), sum(numel for _, numel in sizes)
    # MXFP4 experts' scales are buffers read with their codes: what expert_sizes counts beyond the params
    weight_bytes += expert_bytes - sum(p.numel() * p.element_size() for p in expert_params)
    untouched = idle = 0.0
    if c.moe is not None:
        idle = 1.0 - c.moe.top_k / c.moe.num_experts  # an expert's share a token does not multiply by
        untouched = idle ** min(len(prompts), engine.config.max_num_seqs)
    step_bytes = weight_bytes - expert_bytes * untouched
    read_per_step = step_bytes - embed_bytes
    kv_per_token = engine.runner._bytes_per_block() / engine.config.block_size
    bw = roof["read_GBps"] * 1e9
    decode = (
        sum(read_per_step + kv_per_token * sum(len(p) + i for p in prompts) for i in range(output_len)) / bw
    )
    dense_numel = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in expert_params)
    matmul_params = dense_numel + expert_numel * (1.0 - idle) - embed_numel
    prefill = 2 * matmul_params * sum(len(p) for p in prompts) / (roof["bf16_TFLOPs"] * 1e12)
    return {
        "decode_read_s": decode,
        "prefill_matmul_s": prefill,
        "total_s": decode + prefill,
        "weight_read_floor_ms_per_step": step_bytes / bw * 1e3,
        "expert_share_untouched_per_step": untouched,
    }


def run_workload(name: str, shared: Path, roof: dict | None, args: argparse.Namespace) -> dict:
    import torch

    workloads = load_shared_module(shared, "workloads.py")
    model_name, num, lo, hi, output_len = workloads.OFFLINE[name]
    model_dir = Path(args.config) if args.config else shared / "models" / model_name
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    engine = _engine(model_dir, hi + output_len, args)
    warm = workloads.random_prompts(num, lo, hi, vocab, WARMUP_SEED)
    timed = workloads.random_prompts(num, lo, hi, vocab, TIMED_SEED)
    _run(engine, warm, output_len, f"{name} warm-up", args)
    engine.runner.breakdown.reset()
    engine.timeline.clear()
    engine.record_timeline = True
    with triton_compiles() as compiled, gc_pauses() as pauses:
        seconds, produced, add_s = _run(engine, timed, output_len, name, args)
    engine.record_timeline = False
    result = {
        "workload": name,
        "device": device_name(),
        "model": str(args.config) if args.config else model_name,
        "requests": num,
        "prompt_len": [lo, hi],
        "output_len": output_len,
        "output_tokens": produced,
        "seconds": seconds,
        "output_tok_per_s": produced / seconds,
        "add_requests_s": add_s,
        "gc_pauses": {"count": len(pauses), "seconds": sum(pauses), "max_s": max(pauses, default=0.0)},
        "ms_per_token": seconds / output_len * 1e3 if num == 1 else None,
        "num_kv_blocks": engine.runner.num_kv_blocks,
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "max_prefill_tokens_beside_decodes": engine.config.max_prefill_tokens_beside_decodes,
        "attention_backend": engine.runner.attn_backend.name,
        "quantization": engine.runner.quantization,
        "kv_cache_dtype": engine.config.kv_cache_dtype,
        "tensor_parallel_size": engine.config.tensor_parallel_size,
        "enable_expert_parallel": engine.config.enable_expert_parallel,
        "sampling": {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                     "min_p": args.min_p},
        "output_kind": args.output_kind,
        "cuda_graphs": engine.runner.graphs is not None,
        "step_breakdown": engine.runner.breakdown.as_dict(),
        "prompt_steps": _prompt_steps(engine.timeline),
        "triton_compiles_in_timed_run": compiled,
    }
    if roof is not None:
        floor = floor_seconds(engine, timed, output_len, roof)
        result["floor"] = floor
        result["ratio_to_floor"] = seconds / floor["total_s"]
        if num == 1:
            result["ratio_to_weight_read_floor"] = (
                result["ms_per_token"] / floor["weight_read_floor_ms_per_step"]
            )
    # vLLM's numbers are for the workload's model: another architecture (--config of a MoE, say) has none.
    own = json.loads((shared / "models" / model_name / "config.json").read_text())["architectures"]
    same_model = json.loads((model_dir / "config.json").read_text())["architectures"] == own
    # ... and are for one GPU: a split model has no peer number here.
    peer = VLLM_H200[name] if same_model and args.tensor_parallel_size == 1 else None
    result["vllm_h200"] = peer
    result["ratio_to_vllm_h200"] = None if peer is None else (
        (peer / result["ms_per_token"]) if num == 1 else result["output_tok_per_s"] / peer
    )
    # The runner and its graphs reference each other: collect the cycle, or the next workload's engine
    # finds this one's KV cache still holding the GPU.
    engine.shutdown()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def run_model(args: argparse.Namespace) -> dict:
    """`vllm bench throughput`'s run: --num-prompts requests (random ids of --input-len tokens asking for
    --output-len, each within --random-range-ratio; or ShareGPT conversations) added at once to an engine of
    --model, timed from the first add to the last token. Its JSON has vLLM's keys."""
    import torch
    from tqdm import tqdm

    from plait.bench.datasets import (
        SHAREGPT_MAX_TOTAL_TOKENS,
        LengthRange,
        random_requests,
        read_sharegpt,
        sharegpt_requests,
        token_counter,
    )
    from plait.engine.engine import LLMEngine
    from plait.sampling_params import SamplingParams

    inputs = LengthRange.around(args.input_len, args.random_range_ratio)
    outputs = LengthRange.around(args.output_len, args.random_range_ratio)
    # ShareGPT's requests fit vLLM's 2,048 tokens, or the model's context where it is shorter.
    longest = args.max_model_len or (None if args.dataset_name == "sharegpt" else inputs.high + outputs.high)
    engine = LLMEngine(EngineConfig(
        model=args.model, load_format=args.load_format, dtype=args.dtype, max_model_len=longest,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager, attention_backend=args.attention_backend,
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        tensor_parallel_size=args.tensor_parallel_size, seed=args.seed,
        enable_expert_parallel=args.enable_expert_parallel, speculative_config=args.speculative_config))
    if args.dataset_name == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path")
        if engine.tokenizer is None:
            raise ValueError(f"--dataset-name sharegpt counts tokens with the model's tokenizer: "
                             f"{args.model} has none")
        limit = min(SHAREGPT_MAX_TOTAL_TOKENS, engine.max_model_len)
        samples = sharegpt_requests(read_sharegpt(args.dataset_path), args.num_prompts, args.seed,
                                    token_counter(engine.tokenizer), max_total_tokens=limit)
    else:
        if args.dataset_path:
            raise ValueError("--dataset-path is for --dataset-name sharegpt")
        vocab = engine.model_config.vocab_size
        samples = random_requests(args.num_prompts, vocab, args.seed, f"1:{inputs}", str(outputs))
    start = time.perf_counter()
    for sample in samples:
        params = SamplingParams(temperature=args.temperature, max_tokens=sample.output_len, ignore_eos=True,
                                detokenize=not args.disable_detokenize,
                                output_kind=OUTPUT_KINDS[args.output_kind])
        engine.add_request(sample.prompt, params)
    prompt_tokens = output_tokens = 0
    with tqdm(total=sum(s.output_len for s in samples), desc="throughput", unit="tok") as bar:
        while engine.has_unfinished_requests():
            for out in engine.step():
                new = len(out.outputs[0].delta_token_ids)
                output_tokens += new
                bar.update(new)
                if out.finished:
                    prompt_tokens += len(out.prompt_token_ids)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    total = prompt_tokens + output_tokens
    engine.shutdown()
    result = {"elapsed_time": elapsed, "num_requests": len(samples), "total_num_tokens": total,
              "requests_per_second": len(samples) / elapsed, "tokens_per_second": total / elapsed,
              "output_tokens": output_tokens, "output_tokens_per_second": output_tokens / elapsed,
              "model": args.model, "dataset": args.dataset_name,
              "device": device_name()}
    if engine.drafter is not None:
        result["spec_decode"] = engine.spec_stats.summary()
    return result


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "throughput", help="offline workloads W1-W3 (random weights) and the GPU's limits"
    )
    p.add_argument("--workloads", default="W1,W2,W3")
    p.add_argument(
        "--shared", default=None, help="the shared benchmark folder (default: found near the repo)"
    )
    p.add_argument("--out", default=None, help="write the JSON result here")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="step token budget (default: the engine's offline default for the device, as vLLM's)")
    # Offline, every request arrives at once and no stream waits on another: big prompt chunks next to
    # the decodes keep the GPU busiest (on an H200: W1 31.8k tok/s uncapped, 20.5k at 256; W2 10.3k and 9.1k).
    # The engine's offline default is the same; serving caps them, to protect running streams' ITL.
    p.add_argument("--max-prefill-tokens-beside-decodes", type=int, default=OFFLINE_PREFILL_CAP,
                   help=f"0 = no cap (default {OFFLINE_PREFILL_CAP}: offline)")
    p.add_argument("--attention-backend", default=None)
    # WORKLOADS.md's workloads decode greedily (the peers' numbers are greedy); served traffic mostly
    # samples, which takes the sampler's other path.
    p.add_argument("--temperature", type=float, default=0.0, help="(default 0: greedy, as WORKLOADS.md)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="(default 0: off)")
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--output-kind", choices=sorted(OUTPUT_KINDS), default="final_only",
                   help="the outputs the loop reads: final_only (default; vLLM's LLM.generate asks for "
                        "them) or cumulative (one a step for every request)")
    p.add_argument("--quantization", default=None,
                   help="'fp8': FP8 weights (vLLM's peer numbers are bf16; the floors count the bytes read); "
                        "a GPTQ / AWQ config (--config benchmarks/configs/llama-8b-gptq) needs none")
    p.add_argument("--config", default=None,
                   help="a model folder to run the workloads on instead of theirs (e.g. a block-FP8 config: "
                        "benchmarks/configs/llama-8b-fp8-block)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="'fp8': FP8 K/V (default: auto, the model's dtype)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model across this many GPUs (default 1); the floors are then one rank's")
    p.add_argument("--enable-expert-parallel", "-ep", action="store_true",
                   help="a MoE model's experts dealt out whole over the tensor-parallel GPUs (vLLM's)")
    p.add_argument("--no-roofline", action="store_true", help="skip measuring the GPU's limits")
    p.add_argument("--in-process", action="store_true",
                   help="run the workloads one after another in this process (default: each in a fresh one)")
    adhoc = p.add_argument_group("vLLM's run on any model (`vllm bench throughput`'s flags)")
    adhoc.add_argument("--model", default=None, help="run this model's benchmark instead of the workloads")
    adhoc.add_argument("--input-len", type=int, default=VLLM_INPUT_LEN, help="random prompts' tokens")
    adhoc.add_argument("--output-len", type=int, default=VLLM_OUTPUT_LEN, help="random requests' outputs")
    adhoc.add_argument("--random-range-ratio", type=float, default=0.0,
                       help="each length uniform within this ratio of its --*-len (default 0: exactly)")
    adhoc.add_argument("--num-prompts", type=int, default=VLLM_NUM_PROMPTS)
    adhoc.add_argument("--dataset-name", choices=("random", "sharegpt"), default="random")
    adhoc.add_argument("--dataset-path", default=None, help="sharegpt: the conversations' JSON")
    adhoc.add_argument("--load-format", default="auto", help="'dummy': random weights (default: auto)")
    adhoc.add_argument("--dtype", default="auto")
    adhoc.add_argument("--max-model-len", type=int, default=None,
                       help="(default: the longest random request, or the model's own for ShareGPT)")
    adhoc.add_argument("--seed", type=int, default=0)
    adhoc.add_argument("--speculative-config", default=None,
                       help="as vLLM's, a JSON object: n-gram or draft-model speculative decoding")
    adhoc.add_argument("--disable-detokenize", action="store_true",
                       help="token ids only, no output text (as vLLM's: no detokenizing in the timing)")
    adhoc.add_argument("--output-json", default=None, help="write the result JSON here (vLLM's keys)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    import torch

    if args.model is not None:
        result = run_model(args)
        print(f"Throughput: {result['requests_per_second']:.2f} requests/s, "
              f"{result['tokens_per_second']:.2f} total tokens/s, "
              f"{result['output_tokens_per_second']:.2f} output tokens/s")
        if args.output_json:
            write_json(args.output_json, result, indent=2)
        return 0

    shared = find_shared(args.shared, required="workloads.py")
    roof = None if args.no_roofline or not torch.cuda.is_available() else measure_roofline(shared)
    names = [w.strip() for w in args.workloads.split(",")]
    if args.in_process:
        results = [run_workload(name, shared, roof, args) for name in names]
    else:
        results = [run_isolated(run_workload, name, shared, roof, args) for name in names]
    device = results[0]["device"] if results else "cpu"
    report = {"device": device, "torch": torch.__version__, "roofline": roof, "isolated": not args.in_process,
              "workloads": results}
    if args.out:
        write_json(args.out, report, indent=2)
    print(format_table(report))
    return 0


def format_table(report: dict) -> str:
    """The report as the lines the command prints: "vs floor" is the whole run against its KV + weight-read
    and prefill floor, "vs weight-read floor" a batch-1 token against one read of the weights (W3's goal);
    "-" where the run has no such number (no roofline measured, more than one request)."""
    lines = [
        f"device: {report['device']}",
        "workload | tok/s | ms/tok | vs vLLM H200 | vs floor | vs weight-read floor | graph replay | "
        "host s (sched/prep/launch/sample/post) | gpu fwd s (graph steps + eager steps, count) | wall s",
    ]
    for r in report["workloads"]:
        b = r["step_breakdown"]
        host = "/".join(
            f"{b['host_s'][k]:.2f}" for k in ("schedule", "prepare", "launch", "sample", "postprocess")
        )
        rate = b["graph_replay_rate_of_single_token_steps"]
        lines.append(
            f"{r['workload']} | {r['output_tok_per_s']:.0f} | {r['ms_per_token'] or 0:.2f} | "
            f"{_ratio(r['ratio_to_vllm_h200'])} | {_ratio(r.get('ratio_to_floor'))} | "
            f"{_ratio(r.get('ratio_to_weight_read_floor'))} | "
            f"{'-' if rate is None else f'{rate:.0%}'} | {host} | "
            f"{b['gpu_forward_graph_s']:.2f} ({b['graph_steps']}) + "
            f"{b['gpu_forward_s'] - b['gpu_forward_graph_s']:.2f} ({b['steps'] - b['graph_steps']}) | "
            f"{b['wall_s']:.2f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="plait bench")
    add_parser(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args()
    sys.exit(ns.func(ns))


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"
