"""`plait run-batch` against the offline engine loop on the same prompts: what the batch file's path (a JSON
line parsed, POSTed to the server's app in-process, its answer written) costs in throughput (GPU), and what
asking the engine for final outputs only (SamplingParams.output_kind FINAL_ONLY) saves either way.

    PYTHONPATH=. python benchmarks/run_batch_throughput.py --model MODEL_FOLDER --out result.json

One engine (dummy weights, the start-up warm-up on), the paths in turn (the engine loop reading every step's
outputs, as `plait bench throughput` does; the engine loop asking for final outputs, as LLM.generate does;
run-batch's), each on W1's prompts (the shared
workloads' seed 1; W1's shape: 100-1,024 prompt tokens, 512 output tokens, ignore_eos) and then on
``--many`` requests of the same mix, the prefix cache emptied before every timed run. The model folder may
hold a tokenizer, so that both paths detokenize every token as a user's would.
"""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import time
from pathlib import Path

from plait.bench.shared import device_name, find_shared, write_json
from plait.bench.throughput import gc_pauses


def offline(engine, prompts: list[list[int]], output_len: int, final_only: bool = False) -> tuple[float, int]:
    """The engine's own loop: seconds, output tokens."""
    from plait.sampling_params import RequestOutputKind, SamplingParams

    kind = RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.CUMULATIVE
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, output_kind=kind)
    start = time.perf_counter()
    for p in prompts:
        engine.add_request(p, params)
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    return time.perf_counter() - start, tokens


def batch_file(prompts: list[list[int]], output_len: int) -> list[str]:
    body = {"max_tokens": output_len, "temperature": 0, "ignore_eos": True}
    return [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                        "body": body | {"prompt": p}}) for i, p in enumerate(prompts)]


def through_run_batch(engine, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
    """plait run-batch's path on the same engine: seconds (the lines read to the last answer written),
    output tokens (the answers' usage)."""
    from plait.entrypoints.batch_runner import IN_FLIGHT_PER_SEQ, run_batch
    from plait.entrypoints.server import OpenAIServer, ServerConfig

    lines = batch_file(prompts, output_len)

    async def source():
        for line in lines:
            yield line

    server = OpenAIServer(engine, ServerConfig(log_level="warning", disable_log_stats=True))
    out = io.StringIO()
    start = time.perf_counter()
    summary = asyncio.run(run_batch(server, source(), out, IN_FLIGHT_PER_SEQ * engine.config.max_num_seqs,
                                    progress=False))
    seconds = time.perf_counter() - start
    answers = [json.loads(t) for t in out.getvalue().splitlines()]
    assert summary.failed == 0, [a["error"] for a in answers if a["error"]][:3]
    return seconds, sum(a["response"]["body"]["usage"]["completion_tokens"] for a in answers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a model folder (config.json, maybe a tokenizer)")
    parser.add_argument("--many", type=int, default=2048, help="requests of the larger run (W1's mix)")
    parser.add_argument("--requests", type=int, default=None, help="of the first run (default: W1's 256)")
    parser.add_argument("--output-len", type=int, default=None, help="(default: W1's 512)")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each path and size")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import importlib.util
    import sys

    import torch

    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine

    shared = find_shared(required="workloads.py")
    spec = importlib.util.spec_from_file_location("workloads", shared / "workloads.py")
    workloads = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(workloads)
    _, n, lo, hi, output_len = workloads.OFFLINE["W1"]
    n, output_len = args.requests or n, args.output_len or output_len

    engine = LLMEngine(EngineConfig(model=args.model, load_format="dummy"))
    vocab = engine.model_config.vocab_size
    rows = []
    # The loops' own first steps and shapes (seed 2: other prompts than the timed runs').
    warm = workloads.random_prompts(n, lo, hi, vocab, seed=2)
    offline(engine, warm, 64)
    through_run_batch(engine, warm, 64)
    paths = (("offline", offline), ("offline_final_only", lambda *a: offline(*a, final_only=True)),
             ("run_batch", through_run_batch))
    for requests in (n, args.many):
        prompts = workloads.random_prompts(requests, lo, hi, vocab, seed=1)
        row = {"requests": requests, "output_len": output_len}
        for repeat in range(args.repeats):  # interleaved, so a drift of the machine hits every path alike
            for name, fn in paths:
                engine.reset_prefix_cache()
                with gc_pauses() as pauses:
                    seconds, tokens = fn(engine, prompts, output_len)
                    if torch.cuda.is_available():
                        torch.cuda.synchronize()
                row.setdefault(name, []).append({
                    "seconds": round(seconds, 3), "output_tokens": tokens,
                    "output_tok_s": round(tokens / seconds, 1), "gc_pauses": len(pauses),
                    "gc_s": round(sum(pauses), 3)})
                print(f"{requests} requests, {name} #{repeat}: {tokens} tokens in {seconds:.2f} s = "
                      f"{tokens / seconds:,.0f} out tok/s ({len(pauses)} collections, {sum(pauses):.2f} s)",
                      file=sys.stderr, flush=True)
        best = {name: max(r["output_tok_s"] for r in row[name]) for name, _ in paths}
        row["best_output_tok_s"] = best
        for name in ("offline_final_only", "run_batch"):
            row[f"{name}_over_offline"] = round(best[name] / best["offline"], 3)
        rows.append(row)
    write_json(args.out, {"what": __doc__.split("\n\n")[0], "device": device_name(), "model": args.model,
                          "rows": rows})


if __name__ == "__main__":
    main()
