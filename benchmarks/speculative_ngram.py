"""Speculative decoding (n-gram, or a draft model) against plain decoding: the same requests and knobs.

For each ``--num-speculative-tokens`` k (0: speculation off) a fresh engine serves every workload's
prompts, ``--batch`` at a time, greedily; the JSON gives output tok/s, steps, the drafts kept, and whether
each output equals the one without speculation (it must: a kept draft is the token the model chose).

    .venv/bin/python benchmarks/speculative_ngram.py --out benchmarks/results/speculative_ngram_cpu.json
    PYTHONPATH=. python benchmarks/speculative_ngram.py --model shared/bench/models/llama-8b \\
        --load-format dummy --batch 1 --out /tmp/spec_gpu.json
    PYTHONPATH=. python benchmarks/speculative_ngram.py --model shared/bench/models/llama-8b \\
        --draft-model benchmarks/configs/llama-1b --load-format dummy --out /tmp/spec_draft_gpu.json

``--draft-model PATH``: drafts from that model (vLLM's "draft_model" method, loaded as the target is,
random weights under ``--load-format dummy``) instead of n-gram lookups. With random weights nothing is
kept, so the run measures what drafting costs a step (``host_ms_per_step``'s "draft": the draft model's
forwards); ``projected`` (given where under 10% of drafts were kept) turns that into the speedup a real
pair would get at a few acceptance rates.

Workloads for a model with a tokenizer (the default: SmolLM2-135M-Instruct, chat template):
``copy`` asks for a passage back word for word, ``edit`` for a function with one change (most of the
answer is in the prompt: code editing, quoting), ``chat`` asks open questions (drafts rarely kept: what
speculation costs where it does not help). A model without a tokenizer (random weights) gets token-id
prompts instead: ``repeat`` (a random passage twice) and ``random``; its outputs say nothing about real
acceptance, only what a step that verifies drafts costs.

``--replay`` runs each k > 0 a second time with plait.engine.drafter.ReplayDrafter: the drafts are k=0's
own outputs, all kept where the numerics match, so that row is the ceiling any drafter could reach and
ms_per_step is what a step verifying k drafts costs.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from tqdm import tqdm

from plait.bench.shared import run_isolated
from plait.config import EngineConfig
from plait.engine.drafter import ReplayDrafter
from plait.engine.engine import LLMEngine
from plait.sampling_params import SamplingParams

PASSAGES = [
    "The committee met on Tuesday to review the budget. After a long discussion, it approved the new "
    "library, the repairs to the bridge on Mill Street, and a study of traffic near the school.",
    "To install the package, create a virtual environment, activate it, and run pip install with the "
    "requirements file. Then copy the example configuration and edit the database settings.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. It happens in the "
    "chloroplasts of plant cells, where chlorophyll absorbs mostly red and blue light.",
    "Dear Ms. Patel, thank you for your order of twelve blue notebooks. They will ship on Monday, and "
    "you will receive a tracking number by email as soon as the parcel leaves our warehouse.",
]
FUNCTIONS = [
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
    "    return total / len(values)\n",
    "def count_words(text):\n    counts = {}\n    for word in text.split():\n        word = word.lower()\n"
    "        counts[word] = counts.get(word, 0) + 1\n    return counts\n",
    "def clamp(x, low, high):\n    if x < low:\n        return low\n    if x > high:\n        return high\n"
    "    return x\n",
    "def read_lines(path):\n    with open(path) as f:\n        lines = f.readlines()\n"
    "    return [line.strip() for line in lines if line.strip()]\n",
]
QUESTIONS = [
    "Why is the sky blue? Answer in three sentences.",
    "Give me three tips for sleeping better.",
    "What are the main differences between a list and a tuple in Python?",
    "Describe a sunset over the sea.",
]


def text_workloads() -> dict[str, list[list[dict]]]:
    """Workload -> chat conversations."""
    user = lambda text: [{"role": "user", "content": text}]
    return {
        "copy": [user(f"Repeat the following text exactly, word for word:\n\n{p}") for p in PASSAGES],
        "edit": [user(f"Rename the function to `{f.split('(')[0][4:]}_v2` and change nothing else. "
                      f"Answer with the code only.\n\n{f}") for f in FUNCTIONS],
        "chat": [user(q) for q in QUESTIONS],
    }


def token_workloads(vocab: int, seed: int) -> dict[str, list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    passage = lambda n: torch.randint(10, vocab, (n,), generator=g).tolist()
    return {"repeat": [(lambda p: p + p)(passage(256)) for _ in range(4)],
            "random": [passage(512) for _ in range(4)]}


def make_engine(args: argparse.Namespace, k: int) -> LLMEngine:
    if not k:
        spec = None
    elif args.method == "mtp":  # the target checkpoint's own MTP layer
        spec = {"method": "mtp", "num_speculative_tokens": k}
    elif args.draft_model:
        spec = {"model": args.draft_model, "num_speculative_tokens": k}
        if args.method:
            spec["method"] = args.method
    else:
        spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": args.prompt_lookup_max,
                "prompt_lookup_min": args.prompt_lookup_min}
    return LLMEngine(EngineConfig(model=args.model, load_format=args.load_format, seed=0, dtype=args.dtype,
                                  max_model_len=args.max_model_len, enable_prefix_caching=False,
                                  speculative_config=spec))


def prompts_of(engine: LLMEngine, args: argparse.Namespace) -> dict[str, list]:
    if engine.tokenizer is None:
        return token_workloads(engine.model_config.vocab_size, seed=1)
    from plait.entrypoints.llm import apply_chat_template

    return {name: [apply_chat_template(engine.tokenizer, c) for c in convs]
            for name, convs in text_workloads().items()}


def serve(engine: LLMEngine, prompts: list, args: argparse.Namespace, bar: tqdm, tag: str) -> list[list[int]]:
    """Greedy outputs of ``prompts``, ``args.batch`` requests at a time; prompt i's request id is tag-i."""
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=engine.tokenizer is None)
    outputs: dict[str, list[int]] = {}
    ids = []
    for lo in range(0, len(prompts), args.batch):
        ids += [engine.add_request(p, params, request_id=f"{tag}-{lo + j}")
                for j, p in enumerate(prompts[lo: lo + args.batch])]
        while engine.has_unfinished_requests():
            for out in engine.step():
                bar.update(len(out.outputs[0].delta_token_ids))
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids
    return [outputs[i] for i in ids]


def step_times(engine: LLMEngine) -> dict:
    """Where a step's time goes: mean wall ms of steps with and without drafts (the engine's timeline),
    and the forwards' device time and each host phase, ms a step (the runner's breakdown)."""
    with_drafts = [s.duration_s for s in engine.timeline if s.num_draft_tokens]
    without = [s.duration_s for s in engine.timeline if not s.num_draft_tokens]
    mean_ms = lambda xs: round(1000 * sum(xs) / len(xs), 3) if xs else None
    b = engine.runner.breakdown
    b.resolve()
    steps = max(b.steps, 1)
    times = {"step_ms_with_drafts": mean_ms(with_drafts), "step_ms_without_drafts": mean_ms(without),
             "gpu_forward_ms_per_step": round(1000 * b.gpu_forward_s / steps, 3),
             "host_ms_per_step": {k: round(1000 * v / steps, 3) for k, v in b.host_s.items()}}
    draft_runner = getattr(engine.drafter, "runner", None)
    if draft_runner is not None:  # a draft model's forwards: how many a step, and their device time
        d = draft_runner.breakdown
        d.resolve()
        times["draft_forwards_per_step"] = round(engine.drafter.num_forwards / steps, 3)
        times["draft_graph_forwards_per_step"] = round(d.graph_steps / steps, 3)
        times["draft_gpu_forward_ms_per_step"] = round(1000 * d.gpu_forward_s / steps, 3)
        # The draft runner's own host phases (prepare: staging; sample: sampling and the wait for its ids).
        times["draft_host_ms_per_step"] = {k: round(1000 * v / steps, 3) for k, v in d.host_s.items() if v}
    return times


def run_k(args: argparse.Namespace, k: int, replay: dict[str, list[list[int]]] | None = None) -> dict:
    """Each workload's numbers with k drafts a step (0: off); with ``replay`` (k=0's outputs by workload),
    drafted by ReplayDrafter from them."""
    engine = make_engine(args, k)
    if replay is not None:
        reference = {f"{name}-{i}": out for name, outs in replay.items() for i, out in enumerate(outs)}
        engine.drafter = engine.scheduler.drafter = ReplayDrafter(engine.config.speculative_config, reference)
    workloads = prompts_of(engine, args)
    # One prompt of each workload first: kernels compiled, every prompt shape's graph replayed once (on an
    # H200 the first workload otherwise ran its plain steps 1.54 ms apart against 1.13 in the others).
    firsts = [prompts[0] for prompts in workloads.values()]
    with tqdm(total=args.max_tokens * len(firsts), desc=f"k={k} warm-up", leave=False) as bar:
        serve(engine, firsts, args, bar, "warm-up")
    results = {}
    for name, prompts in workloads.items():
        spec_before = (engine.spec_stats.num_drafts, engine.spec_stats.num_draft_tokens,
                       engine.spec_stats.num_accepted_tokens)
        steps_before = engine.num_steps
        engine.runner.breakdown.reset()  # its graph_steps count from zero: the workload's own
        draft_runner = getattr(engine.drafter, "runner", None)  # a draft model's
        if draft_runner is not None:
            draft_runner.breakdown.reset()
            engine.drafter.num_forwards = 0
        engine.timeline.clear()
        engine.record_timeline = True
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        with tqdm(total=args.max_tokens * len(prompts), desc=f"k={k} {name}", unit="tok") as bar:
            start = time.perf_counter()
            outputs = serve(engine, prompts, args, bar, name)
            elapsed = time.perf_counter() - start
        tokens = sum(len(o) for o in outputs)
        spec = engine.spec_stats
        drafts, drafted, accepted = (now - then for now, then in zip(
            (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens), spec_before))
        steps = engine.num_steps - steps_before
        results[name] = {
            "cuda_graph_steps": engine.runner.breakdown.graph_steps,
            "seconds": round(elapsed, 3), "output_tokens": tokens, "out_tok_s": round(tokens / elapsed, 2),
            "steps": steps, "ms_per_step": round(1000 * elapsed / steps, 3),
            "draft_rows": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
            "outputs": outputs,
            **step_times(engine),
        }
    del engine
    return results


# Acceptance rates at which a draft model's measured step cost is turned into a projected speedup.
PROJECTED_ACCEPTANCE = (0.5, 0.7, 0.8, 0.9)


def projected(k: int, ms_per_step: float, plain_ms_per_step: float) -> dict:
    """Where (almost) no draft is kept, a step's time is what drafting k tokens and verifying them costs,
    against a plain step: ``step_cost_ratio``. A pair whose drafts are each kept with probability a (i.i.d.)
    makes (1 - a^(k+1)) / (1 - a) tokens a step, so its speedup is that over the cost ratio (the catch-up
    forward's few extra tokens a step not counted). Derived from this run's times, not measured."""
    ratio = ms_per_step / plain_ms_per_step
    tokens = lambda a: (1 - a ** (k + 1)) / (1 - a)
    return {"step_cost_ratio": round(ratio, 3),
            "speedup_at_acceptance": {str(a): round(tokens(a) / ratio, 3) for a in PROJECTED_ACCEPTANCE}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="(default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default=None, help="(default: bfloat16 on GPU, float32 on CPU)")
    parser.add_argument("--num-speculative-tokens", default="0,2,4",
                        help="comma-separated k to run; 0 is plain decoding, the reference (default: 0,2,4)")
    parser.add_argument("--draft-model", default=None,
                        help="draft with this model instead of n-gram lookups (same load format as --model)")
    parser.add_argument("--method", default=None, choices=["draft_model", "eagle", "eagle3", "mtp"],
                        help="what --draft-model is (default: draft_model): an EAGLE-1 / EAGLE-3 head; "
                             "mtp: the target's own MTP layer (GLM-4.5, DeepSeek-V3; no --draft-model)")
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1, help="requests served at once (default: 1)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--replay", action="store_true",
                        help="also run each k > 0 with k=0's outputs as drafts: the ceiling, and a verify "
                             "step's cost")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--plot", type=Path, default=None, help="a PNG of out tok/s by workload and k")
    args = parser.parse_args()
    ks = [int(k) for k in args.num_speculative_tokens.split(",")]
    if ks[0] != 0:
        ks = [0, *ks]
    # On a GPU each engine in a process of its own: numbers independent of what ran before, memory too.
    run = (lambda *a: run_isolated(run_k, *a)) if torch.cuda.is_available() else run_k
    runs = {str(k): run(args, k) for k in ks}
    base = runs["0"]
    if args.replay:
        reference = {name: r["outputs"] for name, r in base.items()}
        runs.update({f"{k} replayed": run(args, k, reference) for k in ks if k})
    table = {}
    for k, res in runs.items():
        for name, r in res.items():
            r["identical_to_plain"] = r["outputs"] == base[name]["outputs"]
            r["speedup_vs_plain"] = round(r["out_tok_s"] / base[name]["out_tok_s"], 3)
            table.setdefault(name, {})[f"k={k}"] = {key: v for key, v in r.items() if key != "outputs"}
            drafts_by_model = args.draft_model or args.method == "mtp"
            if drafts_by_model and k != "0" and "replayed" not in k and (r["acceptance_rate"] or 0) < 0.1:
                table[name][f"k={k}"]["projected"] = projected(int(k), r["ms_per_step"],
                                                               base[name]["ms_per_step"])
            if not r["identical_to_plain"]:  # where the outputs part: bf16 rounding of another batch shape
                forks = [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
                         for x, y in zip(r["outputs"], base[name]["outputs"]) if x != y]
                table[name][f"k={k}"]["first_forks"] = forks
    method = f"{args.method or 'draft-model'} ({args.draft_model})" if args.draft_model else "n-gram"
    if args.method == "mtp":
        method = "MTP (the target's own layer)"
    cpu = platform.processor() or platform.machine()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({cpu})"
    result = {
        "what": f"greedy outputs of the same requests with {method} speculative decoding (k drafts a step) "
                "and without (k=0), one engine per k, same knobs; speedup_vs_plain = out tok/s over k=0's",
        "command": "python benchmarks/speculative_ngram.py " + " ".join(
            f"--{a.replace('_', '-')} {v}" for a, v in vars(args).items() if v is not None and a != "out"),
        "device": device, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "model": args.model or "SmolLM2-135M-Instruct (bundled GGUF)", "load_format": args.load_format,
        "batch": args.batch, "max_tokens": args.max_tokens,
        "prompt_lookup": [args.prompt_lookup_min, args.prompt_lookup_max],
        "workloads": table,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for name, row in table.items():
        print(name, {k: (r["out_tok_s"], r["speedup_vs_plain"], r["acceptance_rate"], r["identical_to_plain"])
                     for k, r in row.items()})
    if args.plot is not None:
        plot(table, args.plot, device)


def plot(table: dict, path: Path, device: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(table)
    ks = list(next(iter(table.values())))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(ks)
    for j, k in enumerate(ks):
        xs = [i + (j - (len(ks) - 1) / 2) * width for i in range(len(names))]
        bars = ax.bar(xs, [table[n][k]["out_tok_s"] for n in names], width, label=k)
        for x, n, b in zip(xs, names, bars):
            rate = table[n][k]["acceptance_rate"]
            if rate is not None:
                ax.annotate(f"{rate:.0%}", (x, b.get_height()), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("output tok/s")
    ax.set_title(f"n-gram speculative decoding (labels: drafts kept), {device}", fontsize=9)
    ax.legend(title="drafts a step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
