"""Tensor parallelism on GPUs (pytest -m gpu, 2 or more GPUs): a bf16 checkpoint split over two GPUs (NCCL,
Triton attention, CUDA graphs with the all-reduces captured, overlapped steps) runs the model one GPU runs."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts, run_greedy

from plait.config import EngineConfig
from plait.engine.engine import LLMEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

NUM_PROMPTS = 32
NEW_TOKENS = 32
# bf16: the split sums o_proj's and down_proj's halves in another order, so logits move by a few bf16 steps
# of the activations; a wrong slice (a head, a column block) moves them by their whole spread.
FIRST_LOGITS_TOL = 0.1  # in logit std
NEAR_TIE = 0.02  # a fork is rounding where the one-GPU logits' top two were this close (logit std)
MIN_AGREEMENT = 0.5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random Llama (GQA: 16 query, 4 KV heads) saved in bf16, its embeddings scaled up so a token's own
    embedding leads the residual stream, as in trained models (tests/test_gpu_engine.py says why)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=16,
                      num_key_value_heads=4, head_dim=128, vocab_size=8192, max_position_embeddings=2048,
                      rope_theta=10000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(100.0)
    folder = tmp_path_factory.mktemp("llama-tp")
    model.to(torch.bfloat16).save_pretrained(folder)
    return folder


def _engine(folder, tp: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(folder), dtype="bfloat16", tensor_parallel_size=tp,
                                  max_model_len=1024, max_num_seqs=64, max_num_batched_tokens=256,
                                  enable_prefix_caching=False, num_kv_blocks=4096))


def test_two_gpus_run_the_one_gpu_model(checkpoint):
    prompts = random_prompts(NUM_PROMPTS, 1, 400, seed=3)
    whole = _engine(checkpoint, 1)
    want, want_logits = run_greedy(whole, prompts, NEW_TOKENS, arrive_every=2, capture_logits=True)
    del whole
    split = _engine(checkpoint, 2)
    try:
        got, got_logits = run_greedy(split, prompts, NEW_TOKENS, arrive_every=2, capture_logits=True)
        b = split.runner.breakdown
        assert b.single_token_steps > 0 and b.graph_single_token_steps == b.single_token_steps
    finally:
        split.shutdown()
    agree, gaps = 0, []
    for i in range(NUM_PROMPTS):
        first_want, first_got = want_logits[i][0], got_logits[i][0]  # the prompt's own logits: same inputs
        assert (first_got - first_want).abs().max() <= FIRST_LOGITS_TOL * first_want.std(), i
        fork = next((j for j, (a, c) in enumerate(zip(got[i], want[i])) if a != c), None)
        if fork is None:
            agree += 1
            continue
        row = want_logits[i][fork]
        gaps.append(float(row[want[i][fork]] - row[got[i][fork]]) / float(row.std()))
    print(f"\ntensor parallel 2 vs 1 GPU, bf16: {agree}/{NUM_PROMPTS} agree over {NEW_TOKENS} tokens; "
          f"fork gaps (logit std) {sorted(round(g, 4) for g in gaps)}")
    assert all(0 <= g <= NEAR_TIE for g in gaps), f"a fork at a confident token: {sorted(gaps)}"
    assert agree >= MIN_AGREEMENT * NUM_PROMPTS
