"""Embedding throughput of a pooling model: plait against HF transformers with the same weights, on the same
device, in the same run, and against the GPU's bf16 matmul limit measured in that run too.

A random base model of the config (HF ``AutoModel``: e.g. a Qwen3Model, as embedding models ship) is saved
once; both read those weights. Every prompt is a random token sequence, pooled LAST and normalised (what
decoder embedding models such as Qwen3-Embedding do). HF runs as sentence-transformers does: prompts sorted
by length, padded batches of ``--hf-batch``, the last real token's state. The JSON gives tokens/s, the
FLOP rate (2 x non-embedding parameters per token, plus causal attention), its share of the measured matmul
peak, plait's speed-up over HF, and the cosine similarity of the two embeddings of every prompt.

    PYTHONPATH=. python benchmarks/embedding_throughput.py --config shared/bench/models/qwen3-0.6b \\
        --out benchmarks/results/embedding_throughput_h200.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from plait import LLM
from plait.bench.shared import find_shared
from plait.bench.throughput import measure_roofline
from plait.pooling_params import PoolingParams


def _prompts(num: int, lengths: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths[0], lengths[1] + 1, (num,), generator=gen).tolist()
    return [torch.randint(10, vocab, (n,), generator=gen).tolist() for n in sizes]


def _flops(prompts: list[list[int]], cfg: dict, non_embedding_params: int) -> float:
    """Matmul FLOPs of embedding every prompt: 2 per parameter per token, and causal attention's QK^T and
    PV (2 x 2 x L^2 / 2 x heads x head_dim per layer)."""
    heads, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    tokens = sum(len(p) for p in prompts)
    attention = sum(2 * len(p) ** 2 for p in prompts) * heads * head_dim * layers
    return 2 * non_embedding_params * tokens + attention


def _hf_embed(model: torch.nn.Module, prompts: list[list[int]], batch: int, device: torch.device
              ) -> tuple[torch.Tensor, float]:
    """HF's embeddings (LAST, normalised) of every prompt, in prompt order, and the seconds they took."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out = torch.empty(len(prompts), model.config.hidden_size)
    _sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        for lo in tqdm(range(0, len(order), batch), desc="transformers", unit="batch"):
            rows = order[lo: lo + batch]
            lens = torch.tensor([len(prompts[i]) for i in rows])
            ids = torch.zeros(len(rows), int(lens.max()), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for k, i in enumerate(rows):
                ids[k, : lens[k]] = torch.tensor(prompts[i])
                mask[k, : lens[k]] = 1
            hidden = model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
            last = hidden[torch.arange(len(rows), device=device), lens.to(device) - 1]
            out[rows] = F.normalize(last.float(), dim=-1).cpu()
    _sync(device)
    return out, time.perf_counter() - start


def _profile(llm: LLM, prompts: list[list[int]]) -> list[dict]:
    """The CUDA kernels that took most of the device time while ``prompts`` were embedded."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.embed(prompts, use_tqdm=False)
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in events)
    return [{"kernel": e.key[:120], "ms": e.device_time_total / 1e3, "share": e.device_time_total / total,
             "calls": e.count} for e in events[:12]]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoConfig, AutoModel

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    cfg = json.loads((Path(args.config) / "config.json").read_text())
    low, high = (int(x) for x in args.lengths.split("-")) if "-" in args.lengths else (int(args.lengths),) * 2
    prompts = _prompts(args.num_prompts, (low, high), cfg["vocab_size"], args.seed)
    warmup = _prompts(args.warmup_prompts, (low, high), cfg["vocab_size"], args.seed + 1)
    roofline = measure_roofline(find_shared(args.shared, "roofline.py")) if device.type == "cuda" else None
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(args.seed)
        hf_config = AutoConfig.from_pretrained(args.config)
        model = AutoModel.from_config(hf_config, dtype=dtype, attn_implementation="sdpa").to(device).eval()
        non_embedding = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
        model.save_pretrained(folder)
        _hf_embed(model, warmup, args.hf_batch, device)
        hf_vectors, hf_s = _hf_embed(model, prompts, args.hf_batch, device)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        llm = LLM(folder, runner="pooling", dtype=args.dtype, device=str(device),
                  max_model_len=max(high, 16), **({"max_num_batched_tokens": args.max_num_batched_tokens}
                                                  if args.max_num_batched_tokens else {}))
        llm.embed(warmup, use_tqdm=False)
        llm.engine.runner.breakdown.reset()
        steps_before = llm.engine.num_steps
        _sync(device)
        start = time.perf_counter()
        outputs = llm.encode(prompts, PoolingParams())
        _sync(device)
        plait_s = time.perf_counter() - start
        breakdown = llm.engine.runner.breakdown.as_dict()
        # Fresh prompts: the warm-up ones would be served from the prefix cache but for their last block.
        fresh = _prompts(args.warmup_prompts, (low, high), cfg["vocab_size"], args.seed + 2)
        kernels = _profile(llm, fresh) if args.profile and device.type == "cuda" else None
    plait_vectors = torch.stack([o.outputs.data for o in outputs])
    cosine = F.cosine_similarity(plait_vectors, hf_vectors)
    tokens = sum(len(p) for p in prompts)
    flops = _flops(prompts, cfg, non_embedding)

    def side(seconds: float) -> dict:
        tflops = flops / seconds / 1e12
        result = {"seconds": seconds, "tokens_per_s": tokens / seconds,
                  "prompts_per_s": len(prompts) / seconds, "tflops": tflops}
        if roofline is not None:
            result["of_bf16_matmul_peak"] = tflops / roofline["bf16_TFLOPs"]
        return result

    return {
        "what": "embedding throughput: plait's pooling runner against HF transformers (AutoModel, sdpa, "
                "length-sorted padded batches), same random weights, LAST pooling, normalised",
        "command": "python benchmarks/embedding_throughput.py " + " ".join(args.argv),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": args.dtype,
        "config": args.config,
        "num_prompts": len(prompts),
        "prompt_lengths": [low, high],
        "tokens": tokens,
        "non_embedding_params": non_embedding,
        "roofline": roofline,
        "plait": side(plait_s) | {"max_num_batched_tokens": llm.engine.config.max_num_batched_tokens,
                                  "steps": llm.engine.num_steps - steps_before,
                                  "step_breakdown": breakdown, "top_kernels": kernels},
        "transformers": side(hf_s) | {"batch": args.hf_batch},
        "plait_over_transformers": hf_s / plait_s,
        "cosine_plait_vs_transformers": {"min": cosine.min().item(), "mean": cosine.mean().item()},
    }


def plot(reports: list[dict], path: str) -> None:
    """Tokens/s of plait and transformers per workload (bars, with plait's speed-up), and each side's share of
    the measured bf16 matmul peak."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{Path(r['config']).name}\n{r['num_prompts']} prompts of {r['prompt_lengths'][0]}"
              + (f"-{r['prompt_lengths'][1]}" if r["prompt_lengths"][1] != r["prompt_lengths"][0] else "")
              + " tokens" for r in reports]
    fig, (ax, share) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    x = range(len(reports))
    for offset, side, color in ((-0.2, "plait", "tab:blue"), (0.2, "transformers", "tab:gray")):
        ax.bar([i + offset for i in x], [r[side]["tokens_per_s"] / 1e3 for r in reports], 0.4, label=side,
               color=color)
        shares = [100 * r[side].get("of_bf16_matmul_peak", 0) for r in reports]
        share.bar([i + offset for i in x], shares, 0.4, color=color)
    for i, r in enumerate(reports):
        ax.annotate(f"{r['plait_over_transformers']:.2f}x", (i - 0.2, r["plait"]["tokens_per_s"] / 1e3),
                    ha="center", va="bottom")
    ax.set_xticks(list(x), labels, fontsize=8)
    short = [f"{Path(r['config']).name}\n{r['prompt_lengths'][0]}-{r['prompt_lengths'][1]} tok"
             for r in reports]
    share.set_xticks(list(x), short, fontsize=8)
    ax.set_ylabel("thousand prompt tokens / s")
    share.set_ylabel("% of the bf16 matmul peak measured in the run")
    ax.legend()
    first = reports[0]
    fig.suptitle(f"Embedding throughput (LAST pooling, same weights), {first['device']}, {first['dtype']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    import sys

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="shared/bench/models/qwen3-0.6b",
                   help="a folder with an HF config.json")
    p.add_argument("--num-prompts", type=int, default=2048)
    p.add_argument("--lengths", default="512", help="every prompt's length, or a uniform range LOW-HIGH")
    p.add_argument("--warmup-prompts", type=int, default=64)
    p.add_argument("--hf-batch", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shared", default=None, help="the shared/bench folder (for roofline.py)")
    p.add_argument("--profile", action="store_true",
                   help="record the top CUDA kernels of the warm-up prompts")
    p.add_argument("--out", default=None)
    p.add_argument("--plot-from", nargs="+", default=None, metavar="JSON",
                   help="plot these result files (to --plot) instead of running")
    p.add_argument("--plot", default=None, help="a PNG of the results")
    args = p.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    if args.plot_from:
        reports = [json.loads(Path(f).read_text()) for f in args.plot_from]
        plot(reports, args.plot or "embedding_throughput.png")
        return {"plotted": args.plot_from}
    report = run(args)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.plot:
        plot([report], args.plot)
    return report


if __name__ == "__main__":
    main()
