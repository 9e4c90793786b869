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


# --------------------------------------------------------------------------- guided choice

CHOICES = ["positive", "negative", "neutral", "neutral-ish", " maybe so"]


def test_guided_choice_outputs_exactly_one_choice(llm):
    """Greedy, sampled and seeded requests, beside unconstrained ones in the same batches, each answer
    exactly one of the choices (a choice that prefixes another included) and stops there."""
    tokenizer = llm.get_tokenizer()
    encoded = [tokenizer.encode(c, add_special_tokens=False) for c in CHOICES]
    assert encoded[3][: len(encoded[2])] == encoded[2], "the test wants a choice that prefixes another"
    prompts = [f"Review {i}: {text} Sentiment:" for i, text in enumerate(
        ["I loved it", "boring and long", "it was fine", "hmm", "great cast, weak plot", "no idea"])]
    guided = [SamplingParams(max_tokens=16, temperature=t, seed=s, guided_choice=CHOICES)
              for t, s in ((0.0, None), (1.0, None), (1.5, 7))]
    free = SamplingParams(max_tokens=8, temperature=0.0)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts[:2], free)]
    seen = set()
    for params in guided:
        outs = llm.generate(prompts + prompts[:2], [params] * len(prompts) + [free, free])
        for o in outs[: len(prompts)]:
            c = o.outputs[0]
            assert c.text in CHOICES and c.finish_reason == "stop", (c.text, c.finish_reason)
            assert c.token_ids == encoded[CHOICES.index(c.text)] or (
                c.token_ids[:-1] == encoded[CHOICES.index(c.text)]
                and c.token_ids[-1] in llm.engine.eos_token_ids)
            seen.add(c.text)
        assert [o.outputs[0].token_ids for o in outs[len(prompts):]] == alone  # neighbours unconstrained
    assert len(seen) >= 2, seen  # sampling at 1.5 reaches more than one choice


def test_guided_choice_forced_through_a_shared_prefix(llm):
    """Where one choice prefixes another, the shorter may end with EOS or the longer go on: banning EOS
    (min_tokens) forces the longer one, token for token."""
    tokenizer = llm.get_tokenizer()
    longer = tokenizer.encode("neutral-ish", add_special_tokens=False)
    params = SamplingParams(max_tokens=16, temperature=0.0, guided_choice=["neutral", "neutral-ish"],
                            min_tokens=len(longer))
    out = llm.generate(["Sentiment:"], params)[0].outputs[0]
    assert out.text == "neutral-ish" and out.token_ids == longer and out.finish_reason == "stop"


def test_guided_choice_is_refused_with_allowed_token_ids_or_empty():
    with pytest.raises(ValueError, match="cannot be combined"):
        SamplingParams(guided_choice=["a"], allowed_token_ids=[1])
    with pytest.raises(ValueError, match="at least one"):
        SamplingParams(guided_choice=[])
    with pytest.raises(ValueError, match="at least one"):
        SamplingParams(guided_choice=["a", ""])
    with pytest.raises(ValueError, match="list of str"):
        SamplingParams(guided_choice="abc")
