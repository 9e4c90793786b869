"""Issue 4's bf16 agreement test on the CPU: two correct attention orders, and a wrong one, in plait's engine.

The GPU test (tests/test_gpu_engine.py::test_triton_agrees_with_torch_ref_in_bf16) runs the Triton backend
against torch_ref on a random Llama in bf16 against a 90% bar (64 prompts identical for 32 tokens); on the
fp32 tests' model (4 layers, embeddings x100) an H200 measured 83% / 59% (head dims 64 / 128), on the one it
has used since 2026-12-01 (``--layers 1 --embed-scales 1000 --qk-scales 2``) 100% / 97%. This reproduces
its mechanism on the CPU with the same config, prompts, budget and arrivals, in plait's own bf16 engine,
so that a change to the test's model can be weighed without a GPU:

- the reference is torch_ref as it is;
- the stand-in for a second correct kernel is torch_ref with its softmax probabilities rounded to bf16
  before P @ V, as flash attention rounds them;
- the wrong kernel is torch_ref with its softmax scale multiplied by ``--bug-scale``.

The CPU's bf16 lm_head writes bf16 logits (torch has no fp32-output bf16 matmul on the CPU), whose exact
ties would fork any two runs; the GPU writes fp32 logits, so here the lm_head runs in fp32 too.
For each embedding scale (the test's EMBED_SCALE: larger makes each token's own embedding dominate its
residual stream) it reports how often each variant agrees with the reference, and the reference's logit
gap (in logit std) at each first fork: the GPU test fails a fork whose gap exceeds its NEAR_TIE.

    PYTHONPATH=. python benchmarks/bf16_agreement_standin.py --head-dim 128 \\
        --out benchmarks/results/bf16_agreement_standin_cpu_d128.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from plait.attention import torch_ref

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_gpu_engine as gpu_test  # noqa: E402  (the GPU test's own config, prompts and engine)

PROBS = "probs = torch.exp(scores - row_lse.unsqueeze(-1))"
ATTENDS = ("_attend_padded", "_attend_per_row")


def _edited(fn, old: str, new: str):
    """``fn`` recompiled in torch_ref's namespace with ``old`` replaced by ``new`` in its source."""
    source = textwrap.dedent(inspect.getsource(fn))
    assert old in source, f"{old!r} is no longer in torch_ref.{fn.__name__}"
    namespace = dict(vars(torch_ref))
    exec("from __future__ import annotations\n" + source.replace(old, new), namespace)
    return namespace[fn.__name__]


def _variants(bug_scale: float) -> dict[str, dict[str, object]]:
    original = {name: getattr(torch_ref.TorchRefBackend, name) for name in ATTENDS}
    return {
        "reference": original,
        "probs_in_bf16": {n: _edited(f, PROBS, PROBS + ".bfloat16().float()") for n, f in original.items()},
        "wrong_scale": {n: _edited(f, "* scale", f"* (scale * {bug_scale})") for n, f in original.items()},
    }


def _fp32_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden.float(), weight.float())


def _use_fp32_logits() -> None:
    for module in list(sys.modules.values()):
        if module is not None and module.__name__.startswith("plait") and hasattr(module, "logits_fp32"):
            module.logits_fp32 = _fp32_logits


def _run(model: str, prompts: list[list[int]], attends: dict[str, object], embed_scale: float,
         qk_scale: float, with_logits: bool):
    for name, fn in attends.items():
        setattr(torch_ref.TorchRefBackend, name, fn)
    engine = gpu_test._engine(model, "bfloat16", embed_scale, attention_backend="torch_ref",
                              max_num_batched_tokens=gpu_test.BUDGET)
    gpu_test.sharpen_attention(engine, qk_scale)
    if with_logits:
        return gpu_test._greedy_with_logits(engine, prompts)
    return gpu_test._greedy(engine, prompts, 2), None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--embed-scales", default="100,1000")
    parser.add_argument("--qk-scales", default="1", help="q and k projections times this (scores: squared)")
    parser.add_argument("--bug-scale", type=float, default=2.0)
    parser.add_argument("--layers", type=int, default=4, help="the test's config has 4")
    parser.add_argument("--heads", type=int, default=16, help="query heads (4 kv)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    _use_fp32_logits()
    variants = _variants(args.bug_scale)
    model = gpu_test._config(Path(tempfile.mkdtemp()), args.head_dim)
    config = Path(model) / "config.json"
    shape = {"num_hidden_layers": args.layers, "num_attention_heads": args.heads,
             "hidden_size": args.heads * args.head_dim}
    config.write_text(json.dumps({**json.loads(config.read_text()), **shape}))
    prompts = gpu_test._prompts(args.head_dim)[: args.num_prompts]
    rows = []
    grid = [(float(e), float(q)) for e in args.embed_scales.split(",") for q in args.qk_scales.split(",")]
    for scale, qk in tqdm(grid, desc="embedding x qk scales"):
        start = time.time()
        ref, logits = _run(model, prompts, variants["reference"], scale, qk, with_logits=True)
        row: dict[str, object] = {"embed_scale": scale, "qk_scale": qk}
        for name in ("probs_in_bf16", "wrong_scale"):
            got, _ = _run(model, prompts, variants[name], scale, qk, with_logits=False)
            gaps = sorted(round(g, 4) for g in gpu_test.fork_gaps(got, ref, logits))
            row[name] = {"agreement": gpu_test._agreement(got, ref)[0], "fork_gaps": gaps,
                         "forks_past_near_tie": sum(g > gpu_test.NEAR_TIE for g in gaps)}
        row["distinct_tokens"] = len({t for answer in ref for t in answer})
        row["seconds"] = round(time.time() - start, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"what": " ".join(__doc__.split("\n\n")[0].split()), "head_dim": args.head_dim,
              "layers": args.layers, "heads": args.heads, "num_prompts": len(prompts),
              "new_tokens": gpu_test.NEW_TOKENS, "near_tie": gpu_test.NEAR_TIE,
              "bug": f"softmax scale x{args.bug_scale}", "device": "CPU (2 cores), bf16, plait torch_ref",
              "command": " ".join(["python", *sys.argv]), "rows": rows}
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
