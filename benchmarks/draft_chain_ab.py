"""A/B/C on one engine: how much of a draft model's forwards the host overlaps with staging.

DraftModelDrafter launches the first one-token draft forward before it collects the catch-up forward (the
first draft is a pending input, read on the device), and leaves the last draft forward in flight while the
target stages the step that verifies its drafts (which reads the last drafts on the device). Variants:
"deferred" (both, the default), "chained" (the last draft forward collected before the verify step is
staged), "waits" (that, and the host waits for the catch-up's ids before it stages the first one-token
forward: the drafter before either change). They rotate on the same engine (same weights, graphs and
caches), so that the host's and GPU's drift between runs falls on all. With random weights no draft is
kept, so a step's time is the draft's forwards plus the verify.

    PYTHONPATH=. python benchmarks/draft_chain_ab.py --model shared/bench/models/llama-8b \\
        --draft-model benchmarks/configs/llama-1b --load-format dummy --out /tmp/draft_chain_ab.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm import tqdm

from plait.bench.shared import device_name, write_json
from plait.config import EngineConfig
from plait.engine.engine import LLMEngine
from plait.sampling_params import SamplingParams

VARIANTS = ("deferred", "chained", "waits")


def waiting_catch_up(drafter):
    """``drafter._catch_up`` that waits for the last catch-up forward's ids before it returns."""
    catch_up = drafter._catch_up

    def wrapped(shadows):
        drafts, step = catch_up(shadows)
        if step.copied is not None:
            step.copied.synchronize()
        return drafts, step

    return wrapped


def ms_per_step(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, tag: str) -> float:
    """Mean wall ms of the engine's steps while ``prompts`` decode together (their prefill steps excluded)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=f"{tag}-{i}")
    engine.step()  # the prompts' prefill (and the drafter's first catch-up)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    steps, start = engine.num_steps, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return 1000 * (time.perf_counter() - start) / (engine.num_steps - steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--draft-model", required=True)
    parser.add_argument("--method", default="draft_model", choices=["draft_model", "eagle", "eagle3"],
                        help="what --draft-model is: an EAGLE head has no waiting catch-up variant")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--batches", default="1,4", help="comma-separated requests decoding at once")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3, help="rotations of the variants per batch size")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, the first the reference (default: {','.join(VARIANTS)})")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    spec = {"method": args.method, "model": args.draft_model,
            "num_speculative_tokens": args.num_speculative_tokens}
    engine = LLMEngine(EngineConfig(model=args.model, load_format=args.load_format, seed=0,
                                    max_model_len=args.max_model_len, enable_prefix_caching=False,
                                    speculative_config=spec))
    drafter = engine.drafter
    head = args.method != "draft_model"
    chained = None if head else drafter._catch_up
    waits = None if head else waiting_catch_up(drafter)
    defers = drafter.defers_last_draft
    variants = args.variants.split(",")
    if head and "waits" in variants:
        raise SystemExit("--variants: an EAGLE head has no waiting catch-up; give deferred,chained")
    g = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    results = {}
    batches = [int(b) for b in args.batches.split(",")]
    with tqdm(total=len(batches) * (1 + args.rounds) * len(variants), desc="runs") as bar:
        for batch in batches:
            times = {v: [] for v in variants}
            for r in range(-1, args.rounds):  # round -1 warms every path up and is not kept
                order = variants[r % len(variants):] + variants[: r % len(variants)]  # each leads in turn
                for variant in order:
                    if not head:
                        drafter._catch_up = waits if variant == "waits" else chained
                    drafter.defers_last_draft = defers and variant == "deferred"
                    prompts = [torch.randint(10, vocab, (256,), generator=g).tolist() for _ in range(batch)]
                    ms = ms_per_step(engine, prompts, args.max_tokens, f"b{batch}-r{r}-{variant}")
                    if r >= 0:
                        times[variant].append(round(ms, 3))
                    bar.update()
            medians = {v: statistics.median(t) for v, t in times.items()}
            results[f"batch {batch}"] = {
                "ms_per_step": times,
                "median_ms": {v: round(m, 3) for v, m in medians.items()},
                f"over_{variants[0]}": {v: round(m / medians[variants[0]], 3) for v, m in medians.items()},
            }
    if not head:
        drafter._catch_up = chained
    drafter.defers_last_draft = defers
    result = {
        "what": "a draft model's last draft forward left in flight while the verify step is staged "
                "(deferred), collected first (chained), and that with the catch-up forward waited for before "
                "the first one-token forward is staged (waits), rotated on one engine; greedy, random token "
                "prompts of 256, random weights (nothing kept), ms a decode step",
        "command": "python benchmarks/draft_chain_ab.py " + " ".join(
            f"--{a.replace('_', '-')} {v}" for a, v in vars(args).items() if a != "out"),
        "device": device_name(), "torch": torch.__version__, "results": results,
    }
    write_json(args.out, result)
    for name, r in results.items():
        print(name, r["median_ms"], r[f"over_{variants[0]}"])


if __name__ == "__main__":
    main()
