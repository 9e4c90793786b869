"""`plait bench latency`: `vllm bench latency`'s run: one batch of random prompts, end to end, many times.

Each iteration sends ``--batch-size`` prompts of ``--input-len`` random token ids, each asking for exactly
``--output-len`` tokens (EOS ignored; ``--n`` samples each, or a beam search of that width), through the
offline ``LLM`` API, and times the call; ``--num-iters-warmup`` untimed iterations come first. It prints
vLLM's lines ("Avg latency: ... seconds" and the 10/25/50/75/90/99th percentiles) and writes vLLM's JSON keys
(``avg_latency``, ``latencies``, ``percentiles``), so a vLLM command line runs as it is and the numbers
compare. ``--profile`` runs one iteration under the torch profiler instead (its trace in
$PLAIT_TORCH_PROFILER_DIR or $VLLM_TORCH_PROFILER_DIR).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from plait.bench.shared import device_name, write_json

# `vllm bench latency`'s defaults.
VLLM_INPUT_LEN, VLLM_OUTPUT_LEN, VLLM_BATCH_SIZE = 32, 128, 8
VLLM_WARMUP_ITERS, VLLM_ITERS = 10, 30
# vLLM draws its prompts' ids below this (numpy's randint(10000)), clipped here to the vocabulary.
PROMPT_ID_BOUND = 10000
PERCENTILES = (10, 25, 50, 75, 90, 99)


def _llm(args: argparse.Namespace) -> Any:
    from plait.entrypoints.llm import LLM

    # Room for the longest request, as vLLM sizes its engine from --input-len / --output-len.
    max_model_len = args.max_model_len or args.input_len + args.output_len
    return LLM(args.model, load_format=args.load_format, dtype=args.dtype, max_model_len=max_model_len,
               max_num_seqs=max(args.max_num_seqs, args.batch_size * args.n),
               max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager,
               attention_backend=args.attention_backend, quantization=args.quantization,
               kv_cache_dtype=args.kv_cache_dtype, tensor_parallel_size=args.tensor_parallel_size,
               seed=args.seed, speculative_config=args.speculative_config)


def _iteration(llm: Any, args: argparse.Namespace) -> Any:
    """One iteration's work, as vLLM's: the batch's prompts, generated (or beam-searched) to the end."""
    import numpy as np

    from plait.sampling_params import BeamSearchParams, SamplingParams

    vocab = llm.engine.model_config.vocab_size
    rng = np.random.default_rng(args.seed)
    prompts = [{"prompt_token_ids": ids} for ids in
               rng.integers(0, min(PROMPT_ID_BOUND, vocab), size=(args.batch_size, args.input_len)).tolist()]
    if args.use_beam_search:
        params = BeamSearchParams(beam_width=args.n, max_tokens=args.output_len, ignore_eos=True)
        return lambda: llm.beam_search(prompts, params)
    params = SamplingParams(n=args.n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len,
                            detokenize=not args.disable_detokenize)
    return lambda: llm.generate(prompts, params, use_tqdm=False)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build the engine, warm up, time ``--num-iters`` iterations; vLLM's result keys."""
    import numpy as np
    import torch
    from tqdm import tqdm

    if min(args.input_len, args.output_len, args.batch_size, args.n) < 1:
        raise ValueError("--input-len, --output-len, --batch-size and --n must be at least 1")
    if args.num_iters < 1 or args.num_iters_warmup < 0:
        raise ValueError("--num-iters must be at least 1 and --num-iters-warmup at least 0")
    llm = _llm(args)
    work = _iteration(llm, args)

    def timed() -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        work()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - start

    for _ in tqdm(range(args.num_iters_warmup), desc="Warmup iterations"):
        timed()
    latencies = [timed() for _ in tqdm(range(args.num_iters), desc="Profiling iterations")]
    result = {"avg_latency": float(np.mean(latencies)), "latencies": latencies,
              "percentiles": {str(p): float(np.percentile(latencies, p)) for p in PERCENTILES},
              "model": args.model, "batch_size": args.batch_size, "input_len": args.input_len,
              "output_len": args.output_len, "n": args.n, "use_beam_search": args.use_beam_search,
              "device": device_name()}
    if llm.engine.drafter is not None:  # warm-up iterations included
        result["spec_decode"] = llm.engine.spec_stats.summary()
    llm.engine.shutdown()
    return result


def profile(args: argparse.Namespace) -> str:
    """--profile: one iteration under the torch profiler; the trace's path."""
    llm = _llm(args)
    work = _iteration(llm, args)
    llm.start_profile()
    work()
    path = llm.stop_profile()
    llm.engine.shutdown()
    return str(path)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("latency", help="vLLM's latency run: one batch, end to end, many times")
    p.add_argument("--model", default=None, help="(default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--input-len", type=int, default=VLLM_INPUT_LEN)
    p.add_argument("--output-len", type=int, default=VLLM_OUTPUT_LEN)
    p.add_argument("--batch-size", type=int, default=VLLM_BATCH_SIZE)
    p.add_argument("--n", type=int, default=1, help="samples per prompt (with --use-beam-search: beams)")
    p.add_argument("--use-beam-search", action="store_true")
    p.add_argument("--num-iters-warmup", type=int, default=VLLM_WARMUP_ITERS)
    p.add_argument("--num-iters", type=int, default=VLLM_ITERS)
    p.add_argument("--profile", action="store_true",
                   help="run one iteration under the torch profiler (trace in $PLAIT_TORCH_PROFILER_DIR or "
                        "$VLLM_TORCH_PROFILER_DIR) instead of timing")
    p.add_argument("--disable-detokenize", action="store_true",
                   help="token ids only, no output text (as vLLM's: detokenizing is left out of the timing)")
    p.add_argument("--output-json", default=None, help="write the result JSON here (vLLM's keys)")
    engine = p.add_argument_group("engine")
    engine.add_argument("--load-format", default="auto", help="'dummy': random weights (default: auto)")
    engine.add_argument("--dtype", default="auto")
    engine.add_argument("--max-model-len", type=int, default=None,
                        help="(default: --input-len + --output-len)")
    engine.add_argument("--max-num-seqs", type=int, default=256)
    engine.add_argument("--max-num-batched-tokens", type=int, default=None)
    engine.add_argument("--enforce-eager", action="store_true")
    engine.add_argument("--attention-backend", default=None)
    engine.add_argument("--quantization", default=None)
    engine.add_argument("--kv-cache-dtype", default="auto")
    engine.add_argument("--tensor-parallel-size", type=int, default=1)
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument("--speculative-config", default=None,
                        help="as vLLM's, a JSON object: n-gram or draft-model speculative decoding")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.profile:
        print(f"profile trace: {profile(args)}")
        return 0
    result = run(args)
    print(f"Avg latency: {result['avg_latency']} seconds")
    for p, value in result["percentiles"].items():
        print(f"{p}% percentile latency: {value} seconds")
    if args.output_json:
        write_json(args.output_json, result, indent=4)
    return 0
