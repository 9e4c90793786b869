"""Can a random Llama be made decisive enough for issue 4's bf16 agreement bar without blinding the test?

Issue 4 asks that greedy bf16 outputs of a random Llama config agree with the torch_ref backend for 32 tokens
on 90% of 64 prompts. Two correct bf16 computations that differ only in their summation order fork wherever
the top two logits nearly tie (benchmarks/random_logit_gaps.py: 3-4% of a random model's positions). Trained
models are decisive; a random model can be made so by giving its lm_head rows log-normal norms (a few tokens
then dominate every position). This measures, on CPU in bf16 with transformers as the model, for each spread
``sigma`` of those norms:

- agreement between two correct attention implementations (``eager``: bf16 matmuls and a bf16 softmax
  output; ``sdpa``: the fused kernel), the stand-in for triton vs torch_ref;
- agreement between ``sdpa`` and a wrong one (the softmax scale off by ``--bug-scale``, 5% by default),
  which the test exists to catch;
- how many distinct tokens the greedy answers use.

    PYTHONPATH=. python benchmarks/random_decisive_logits.py \
        --out benchmarks/results/random_decisive_logits_cpu.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

VOCAB = 8192
NEW_TOKENS = 32
# tests/test_gpu_engine.py: embeddings scaled so each token's own embedding dominates its residual stream.
EMBED_SCALE = 100.0
BUGGY = "plait_wrong_scale"


def build(head_dim: int, sigma: float) -> LlamaForCausalLM:
    """The GPU agreement test's random Llama (tests/test_gpu_engine.py::_config) with lm_head row norms
    multiplied by exp(sigma * N(0, 1)), in bf16."""
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=16 * head_dim, intermediate_size=2816, num_hidden_layers=4,
                      num_attention_heads=16, num_key_value_heads=4, head_dim=head_dim, vocab_size=VOCAB,
                      max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(EMBED_SCALE)
        norms = torch.exp(sigma * torch.randn(VOCAB, 1, generator=torch.Generator().manual_seed(1)))
        model.lm_head.weight.mul_(norms)
    return model.to(torch.bfloat16)


def greedy(model: LlamaForCausalLM, prompts: list[torch.Tensor], attention: str) -> list[list[int]]:
    model.config._attn_implementation = attention
    answers = []
    for p in prompts:
        out = model.generate(p[None], max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=0)
        answers.append(out[0, len(p):].tolist())
    return answers


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(a, b)) / len(a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--sigmas", default="0,1,1.5")
    parser.add_argument("--bug-scale", type=float, default=1.05)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    def wrong_scale(module, q, k, v, mask, scaling=None, **kw):
        scale = (scaling if scaling is not None else q.shape[-1] ** -0.5) * args.bug_scale
        return sdpa_attention_forward(module, q, k, v, mask, scaling=scale, **kw)

    AttentionInterface.register(BUGGY, wrong_scale)
    g = torch.Generator().manual_seed(args.head_dim)
    lens = torch.randint(1, 400, (args.num_prompts,), generator=g).tolist()
    prompts = [torch.randint(10, VOCAB, (n,), generator=g) for n in lens]
    rows = []
    for sigma in tqdm([float(s) for s in args.sigmas.split(",")], desc="lm_head norm spreads"):
        model = build(args.head_dim, sigma)
        eager, sdpa, wrong = (greedy(model, prompts, a) for a in ("eager", "sdpa", BUGGY))
        rows.append({"lm_head_log_norm_std": sigma,
                     "correct_vs_correct_agreement": agreement(eager, sdpa),
                     "wrong_scale_vs_correct_agreement": agreement(wrong, sdpa),
                     "distinct_tokens": len({t for answer in sdpa for t in answer}),
                     "tokens": NEW_TOKENS * len(prompts)})
        print(rows[-1], flush=True)
    result = {"what": " ".join(__doc__.split("\n\n")[0].split()), "head_dim": args.head_dim,
              "num_prompts": len(prompts), "new_tokens": NEW_TOKENS,
              "bug": f"softmax scale x{args.bug_scale}", "device": "CPU, bf16, transformers", "rows": rows}
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
