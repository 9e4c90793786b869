"""vLLM's offline API on the default model: the engine seed, LLM.chat's template options, default params."""

from __future__ import annotations

import pytest

from plait import LLM, SamplingParams
from plait.generation_config import GenerationDefaults

PROMPTS = ["The capital of France is", "Once upon a time", "My favourite colour is", "Rivers flow"]
# Random sampling with no per-request seed: only the engine seed decides the tokens.
RANDOM = SamplingParams(temperature=1.0, max_tokens=8)
CONVERSATION = [{"role": "user", "content": "Name a river."}, {"role": "assistant", "content": "The Nile"}]
END_OF_TURN = "<|im_end|>"  # the SmolLM2 chat template's end-of-turn token


def _samples(llm: LLM) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, RANDOM, use_tqdm=False)]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(seed=0)


def test_same_engine_seed_same_samples(llm):
    first = _samples(llm)
    assert _samples(LLM(seed=0)) == first  # a fresh engine with the same seed replays the stream
    # 32 tokens at temperature 1 from a 49k vocabulary: another seed cannot match them all by chance.
    assert _samples(LLM(seed=1)) != first
    assert _samples(llm) != first  # and the stream goes on: a second batch is not the first again


def test_chat_continues_the_final_message(llm):
    params = SamplingParams(temperature=0.0, max_tokens=4)
    out = llm.chat(CONVERSATION, params, use_tqdm=False, add_generation_prompt=False,
                   continue_final_message=True)[0]
    assert out.prompt.endswith("<|im_start|>assistant\nThe Nile")  # no end of turn after it
    assert out.prompt_token_ids == llm.get_tokenizer().encode(out.prompt, add_special_tokens=False)
    closed = llm.chat(CONVERSATION, params, use_tqdm=False, add_generation_prompt=False)[0]
    assert closed.prompt.endswith(f"The Nile{END_OF_TURN}\n")
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt"):
        llm.chat(CONVERSATION, params, use_tqdm=False, continue_final_message=True)


def test_chat_passes_template_and_its_kwargs(llm):
    params = SamplingParams(temperature=0.0, max_tokens=1)
    template = "{{ greeting }}: {% for m in messages %}{{ m['content'] }}{% endfor %}"
    out = llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False, chat_template=template,
                   chat_template_kwargs={"greeting": "Hello"})[0]
    assert out.prompt == "Hello: hi"
    tools = [{"type": "function", "function": {"name": "get_weather"}}]  # the template's tools, as vLLM's
    listed = "{% for t in tools %}{{ t['function']['name'] }} {% endfor %}{{ messages[0]['content'] }}"
    out = llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False, chat_template=listed,
                   tools=tools)[0]
    assert out.prompt == "get_weather hi"
    default = llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False)[0]
    assert default.prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_gguf_model_keeps_the_default_sampling_params(llm):
    """A GGUF file carries no generation_config.json: nothing changes (as vLLM reads none for it)."""
    assert llm.engine.generation_defaults == GenerationDefaults()
    assert llm.get_default_sampling_params() == SamplingParams()
