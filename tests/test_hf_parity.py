"""Invariant 3: every supported family matches HF transformers (fp32 CPU): logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts, run_greedy

from plait.config import EngineConfig
from plait.engine.engine import LLMEngine

LOGITS_ATOL = 1e-4
MAX_TOKENS = 12


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_logits_and_greedy_match_hf(tiny_models, family):
    from transformers import AutoModelForCausalLM

    folder = tiny_models[family]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    # Several prompts at once, some longer than the step budget, so rows mix chunks and decodes.
    prompts = random_prompts(6, 1, 70, seed=7)
    engine = LLMEngine(EngineConfig(model=str(folder), max_num_batched_tokens=48, block_size=8))
    outputs, logits = run_greedy(engine, prompts, MAX_TOKENS, capture_logits=True)

    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            ref_ids = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
            full = torch.tensor([prompt + outputs[i]])
            ref_logits = hf(full).logits[0, len(prompt) - 1 : -1]
        assert outputs[i] == ref_ids, f"{family} prompt {i}: greedy tokens differ from HF"
        got = torch.stack(logits[i])
        assert got.shape == ref_logits.shape
        torch.testing.assert_close(got, ref_logits, atol=LOGITS_ATOL, rtol=0)
    assert engine.is_idle_and_clean()
