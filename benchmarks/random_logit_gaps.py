"""How often a random-weight Llama's top two logits nearly tie, whatever its weights' scale: the share of
positions whose top-2 gap is under 0.01 logit standard deviations (issue 4's bf16 agreement test forks at gaps
of 0.0004-0.0114 std) with every non-norm weight scaled by 1 or 8 and the embeddings by 1 or 100.

    PYTHONPATH=. python benchmarks/random_logit_gaps.py --out benchmarks/results/random_logit_gaps_cpu.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

NEAR_TIE_STD = 0.01
VOCAB = 8192


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    # The GPU agreement test's shape at head dim 64 (tests/test_gpu_engine.py::_config), fp32.
    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                      num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=512,
                      tie_word_embeddings=False)
    base = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(10, VOCAB, (8, 128))
    rows = []
    for scale, embed in [(1, 1), (1, 100), (8, 1), (8, 100)]:
        model = LlamaForCausalLM(cfg).eval()
        model.load_state_dict(base.state_dict())
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" not in name:
                    p.mul_(scale)
            model.model.embed_tokens.weight.mul_(embed)
            logits = model(ids).logits.reshape(-1, VOCAB)
        top = logits.topk(2, dim=-1).values
        gap = (top[:, 0] - top[:, 1]) / logits.std(dim=-1)
        rows.append({"non_norm_weight_scale": scale, "embedding_scale": embed,
                     "near_tie_share": round(float((gap < NEAR_TIE_STD).float().mean()), 4),
                     "median_gap_std": round(float(gap.median()), 4)})
        print(rows[-1])
    result = {"what": " ".join(__doc__.split("\n\n")[0].split()), "positions": ids.numel(), "rows": rows}
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
