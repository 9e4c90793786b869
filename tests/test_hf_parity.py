"""Invariant 3: every supported family matches HF transformers (fp32 CPU): logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy_reference, random_prompts, run_greedy

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
        ref_ids, ref_logits = hf_greedy_reference(hf, prompt, outputs[i], MAX_TOKENS)
        assert outputs[i] == ref_ids, f"{family} prompt {i}: greedy tokens differ from HF"
        got = torch.stack(logits[i])
        assert got.shape == ref_logits.shape
        torch.testing.assert_close(got, ref_logits, atol=LOGITS_ATOL, rtol=0)
    assert engine.is_idle_and_clean()


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_prompt_logprobs_match_hf(tiny_llama, prefix_caching):
    """prompt_logprobs: each prompt token's logprob given the tokens before it, and the top-n there, as
    HF's log_softmax gives them; prompts split over several chunks, and (with prefix caching on) a
    second request sharing a cached prefix still gets every position."""
    from transformers import AutoModelForCausalLM

    from plait.sampling_params import SamplingParams

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    shared = random_prompts(1, 40, 40, seed=3)[0]
    prompts = [shared + [5, 6, 7], random_prompts(1, 70, 70, seed=4)[0], shared + [9], [11]]
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), max_num_batched_tokens=32, block_size=8,
                                    enable_prefix_caching=prefix_caching))
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    finals = {}
    for i, prompt in enumerate(prompts):  # one after another, so later ones could hit the cache
        engine.add_request(prompt, params, request_id=str(i))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
    for i, prompt in enumerate(prompts):
        got = finals[str(i)].prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)  # [L, V]
        for pos in range(1, len(prompt)):
            entry, row = got[pos], ref[pos - 1]
            assert entry.token_id == prompt[pos]
            assert abs(entry.logprob - row[prompt[pos]].item()) < LOGITS_ATOL, (i, pos)
            top = torch.topk(row, 3)
            assert list(entry.top) == top.indices.tolist(), (i, pos)
            torch.testing.assert_close(torch.tensor(list(entry.top.values())), top.values,
                                       atol=LOGITS_ATOL, rtol=0)
    assert engine.is_idle_and_clean()
