"""The default model (SmolLM2-135M-Instruct, GGUF) against HF transformers, greedy fp32, token for token."""

from __future__ import annotations

import pytest
import torch

from plait import LLM, SamplingParams

NEW_TOKENS = 64
CHATS = [
    "What is the capital of France?",
    "Write a haiku about a river in winter.",
    "Explain what a hash table is in two sentences.",
    "List three fruits that are red.",
    "How do I reverse a list in Python?",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue? Answer briefly.",
    "Give me a name for a grey cat.",
    "What is 17 times 3?",
    "Summarise the plot of Romeo and Juliet in one sentence.",
    "Write a short limerick about a programmer.",
    "What should I pack for a day hike?",
]


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_batched_tokens=256)


def test_greedy_matches_hf_on_chat_prompts(llm):
    from transformers import AutoModelForCausalLM

    from plait.loader.gguf import default_model_path

    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    conversations = [[{"role": "user", "content": c}] for c in CHATS]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    outputs = llm.chat(conversations, params, use_tqdm=False)  # all submitted at once

    eos = sorted(llm.engine.eos_token_ids)
    for conv, out in zip(conversations, outputs):
        prompt_ids = llm.apply_chat_template(conv)
        assert out.prompt_token_ids == prompt_ids
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              eos_token_id=eos, pad_token_id=eos[0])[0, len(prompt_ids):].tolist()
        got = out.outputs[0].token_ids
        assert got == ref, f"prompt {conv[0]['content']!r}: plait {got} != HF {ref}"
        text = llm.get_tokenizer().decode([t for t in ref if t not in eos], skip_special_tokens=True)
        assert out.outputs[0].text == text
        assert out.outputs[0].finish_reason == ("stop" if ref[-1] in eos else "length")
    assert llm.engine.is_idle_and_clean()
