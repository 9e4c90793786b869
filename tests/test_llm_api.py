"""vLLM's offline API on the default model: the engine seed, LLM.chat's template options, default params,
truncate_prompt_tokens."""

from __future__ import annotations

import math

import pytest

from plait import LLM, BeamSearchParams, SamplingParams
from plait.entrypoints.llm import apply_chat_template
from plait.generation_config import GenerationDefaults
from plait.sampling_params import RequestOutputKind

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


def test_skip_tokenizer_init_generates_the_same_token_ids_without_a_tokenizer(llm):
    """vLLM's skip_tokenizer_init: no tokenizer is loaded; token-id prompts give the token ids the engine
    with its tokenizer gives, their text empty; a text prompt is refused with what to send instead."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ids = [{"prompt_token_ids": llm.engine.tokenizer.encode(p)} for p in PROMPTS[:2]]
    want = [o.outputs[0].token_ids for o in llm.generate(ids, params, use_tqdm=False)]
    bare = LLM(skip_tokenizer_init=True)
    assert bare.engine.tokenizer is None
    got = bare.generate(ids, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want and all(o.outputs[0].text == "" for o in got)
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        bare.generate(PROMPTS[0], params, use_tqdm=False)


def test_logprobs_mode_reaches_the_sampler_and_prompt_logprobs(llm):
    """LLM(logprobs_mode=...): processed logprobs are those of the distribution drawn from (top-k 2: the two
    kept renormalised, the third best -inf), the prompt's stay the raw model's; a *_logits mode gives logits
    (positive ones too), and beam search, which ranks beams by logprobs, refuses it."""
    params = SamplingParams(temperature=1.0, top_k=2, logprobs=3, prompt_logprobs=1, max_tokens=4, seed=0)
    raw = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    processed = LLM(logprobs_mode="processed_logprobs").generate(PROMPTS[0], params, use_tqdm=False)[0]
    assert processed.outputs[0].token_ids == raw.outputs[0].token_ids
    for mine, theirs in zip(processed.outputs[0].logprobs, raw.outputs[0].logprobs, strict=True):
        kept = list(mine.top.values())
        assert kept[2] == float("-inf") and math.exp(kept[0]) + math.exp(kept[1]) == pytest.approx(1.0)
        assert list(mine.top)[:2] == list(theirs.top)[:2] and mine.logprob >= theirs.logprob
    assert processed.prompt_logprobs == raw.prompt_logprobs
    logits = LLM(logprobs_mode="raw_logits")
    out = logits.generate(PROMPTS[0], params, use_tqdm=False)[0]
    assert any(step.logprob > 0 for step in out.outputs[0].logprobs)
    with pytest.raises(ValueError, match="beam search ranks beams by their logprobs"):
        logits.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=2, max_tokens=2))


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


def test_beam_search_returns_vllms_sequences(llm):
    """vLLM's LLM.beam_search: beam_width sequences, best first, each with its tokens (the prompt's first),
    the logprobs of its own, their sum, and its text (all of its tokens decoded)."""
    prompt = PROMPTS[0]
    prompt_ids = llm.get_tokenizer().encode(prompt)
    (out,) = llm.beam_search(prompt, BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True))
    assert len(out.sequences) == 2
    for sequence in out.sequences:
        assert sequence.tokens[:len(prompt_ids)] == prompt_ids and len(sequence.tokens) == len(prompt_ids) + 3
        assert sequence.cum_logprob == pytest.approx(sum(entry.logprob for entry in sequence.logprobs))
        assert sequence.text == llm.get_tokenizer().decode(sequence.tokens)
        assert sequence.text.startswith(prompt)
    assert out.sequences[0].cum_logprob >= out.sequences[1].cum_logprob


# A context short enough that truncate_prompt_tokens=-1 can be seen cutting a prompt.
SHORT_CONTEXT = 64
LONG_PROMPT = "The capital of France is Paris. " * 4 + "The capital of Italy is"
KEEP = 5


@pytest.fixture(scope="module")
def short_llm() -> LLM:
    return LLM(max_model_len=SHORT_CONTEXT)


def _greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=4, **kwargs)


def test_truncated_generate_equals_generate_on_the_truncated_ids(llm):
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens (left truncation), for text and token-id
    prompts alike; the output's prompt is what the model saw, and a shorter prompt is left whole."""
    ids = llm.get_tokenizer().encode(LONG_PROMPT)
    assert len(ids) > KEEP
    expected = llm.generate({"prompt_token_ids": ids[-KEEP:]}, _greedy(), use_tqdm=False)[0]
    short = "Hi there"
    text, by_ids, whole = llm.generate([LONG_PROMPT, ids, short], _greedy(truncate_prompt_tokens=KEEP),
                                       use_tqdm=False)
    for out in (text, by_ids):
        assert out.prompt_token_ids == ids[-KEEP:]
        assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    assert text.prompt == llm.get_tokenizer().decode(ids[-KEEP:]) and by_ids.prompt is None
    assert whole.prompt == short and whole.prompt_token_ids == llm.get_tokenizer().encode(short)


def test_truncated_chat_keeps_the_end_of_the_conversation(llm):
    """A conversation is truncated as rendered: its last k tokens, shown as the prompt."""
    options = dict(add_generation_prompt=False, continue_final_message=True)
    ids = apply_chat_template(llm.get_tokenizer(), CONVERSATION, **options)
    expected = llm.generate({"prompt_token_ids": ids[-KEEP:]}, _greedy(), use_tqdm=False)[0]
    out = llm.chat(CONVERSATION, _greedy(truncate_prompt_tokens=KEEP), use_tqdm=False, **options)[0]
    assert out.prompt_token_ids == ids[-KEEP:] and out.outputs[0].token_ids == expected.outputs[0].token_ids
    assert out.prompt == llm.get_tokenizer().decode(ids[-KEEP:]) and out.prompt.endswith("The Nile")


def test_truncate_to_the_context_leaves_room_for_max_tokens(short_llm):
    """-1: as many of the last tokens as leave room for max_tokens (for one token where it is None); more
    than the context is vLLM's error."""
    ids = short_llm.get_tokenizer().encode("one two three four five six seven eight nine ten " * 8)
    assert len(ids) > SHORT_CONTEXT
    out = short_llm.generate({"prompt_token_ids": ids}, _greedy(truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-(SHORT_CONTEXT - 4):] and len(out.outputs[0].token_ids) == 4
    unbounded = SamplingParams(temperature=0.0, max_tokens=None, truncate_prompt_tokens=-1)
    out = short_llm.generate({"prompt_token_ids": ids}, unbounded, use_tqdm=False)[0]
    assert len(out.prompt_token_ids) == SHORT_CONTEXT - 1 and len(out.outputs[0].token_ids) == 1
    words = r"^truncate_prompt_tokens value \(65\) is greater than max_model_len \(64\)\. Please, select a "
    with pytest.raises(ValueError, match=words + r"smaller truncation size\.$"):
        short_llm.generate("x", _greedy(truncate_prompt_tokens=SHORT_CONTEXT + 1), use_tqdm=False)


def test_detokenize_off_gives_the_same_tokens_and_no_text(llm):
    """vLLM's SamplingParams.detokenize=False: the same greedy tokens, each output's text left empty."""
    params = SamplingParams(temperature=0.0, max_tokens=8)
    with_text = llm.generate(PROMPTS, params, use_tqdm=False)
    ids_only = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, detokenize=False),
                            use_tqdm=False)
    assert all(out.outputs[0].text for out in with_text)
    assert [o.outputs[0].token_ids for o in ids_only] == [o.outputs[0].token_ids for o in with_text]
    assert all(o.outputs[0].text == "" for o in ids_only)


def _run_alone(engine, prompt: str, params: SamplingParams) -> list:
    request_id = engine.add_request(prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [out for out in engine.step() if out.request_id == request_id]
    return outputs


def test_output_kinds_give_the_same_answer(llm):
    """vLLM's output_kind: every step's whole output so far (CUMULATIVE), each step's new part (DELTA), or one
    final output (FINAL_ONLY), which carries the times of the steps it stands for. Greedy, alone: the same
    answer, logprobs and prompt logprobs every way."""
    base = dict(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    runs = {kind: _run_alone(llm.engine, "The capital of France is", SamplingParams(**base, output_kind=kind))
            for kind in RequestOutputKind}
    cumulative, delta, final = (runs[k] for k in RequestOutputKind)
    whole = cumulative[-1]
    assert len(delta) == len(cumulative) > 1 and len(final) == 1 and final[0].finished
    got = final[0].outputs[0]
    assert (got.text, got.token_ids, got.logprobs, got.finish_reason) == (
        whole.outputs[0].text, whole.outputs[0].token_ids, whole.outputs[0].logprobs, "length")
    assert (got.delta_text, got.delta_token_ids) == (got.text, got.token_ids)  # all new to its reader
    assert final[0].prompt_logprobs == whole.prompt_logprobs
    times = final[0].metrics["output_times"]
    assert len(times) == len(cumulative) and times == sorted(times) and times[-1] == final[0].metrics["now"]
    pieces = [out.outputs[0] for out in delta]
    assert [p.text for p in pieces] == [out.outputs[0].delta_text for out in cumulative]
    assert "".join(p.text for p in pieces) == whole.outputs[0].text
    assert sum((p.token_ids for p in pieces), []) == whole.outputs[0].token_ids
    assert sum((p.logprobs for p in pieces), []) == whole.outputs[0].logprobs
    assert delta[0].prompt_logprobs == whole.prompt_logprobs
    assert all(out.prompt_logprobs is None for out in delta[1:])


def test_generate_reads_final_outputs_and_leaves_the_callers_params_alone(llm):
    params = SamplingParams(temperature=0.0, max_tokens=6, n=2)
    outs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert params.output_kind is RequestOutputKind.CUMULATIVE
    want = [_run_alone(llm.engine, p, SamplingParams(temperature=0.0, max_tokens=6))[-1] for p in PROMPTS[:2]]
    for out, alone in zip(outs, want):
        assert [c.token_ids for c in out.outputs] == [alone.outputs[0].token_ids] * 2
        assert [c.text for c in out.outputs] == [alone.outputs[0].text] * 2


def test_vllms_prompt_dicts_are_the_prompts_they_hold(llm):
    """vLLM's TextPrompt and TokensPrompt (dicts, from plait as from vllm.inputs) answer as the string and the
    token ids they hold, in one batch with them; a dict with neither key is refused by name."""
    from plait import TextPrompt, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=6)
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    outs = llm.generate([PROMPTS[0], TextPrompt(prompt=PROMPTS[0]), ids, TokensPrompt(prompt_token_ids=ids),
                         TokensPrompt(prompt_token_ids=ids, cache_salt="tenant-a")], params, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert [o.prompt_token_ids for o in outs] == [list(ids)] * 5
    with pytest.raises(ValueError, match="'prompt', 'prompt_token_ids' or 'prompt_embeds'"):
        llm.generate({"text": PROMPTS[0]}, params, use_tqdm=False)


def test_chat_takes_text_parts_joined_by_newlines(llm):
    """OpenAI-style text parts in LLM.chat on a text model: the prompt of their text joined by newlines (as
    the server and vLLM's chat parser join them); an image part is refused by name."""
    params = SamplingParams(temperature=0.0, max_tokens=4)
    text_parts = [{"type": "text", "text": "Name a"}, {"type": "text", "text": "river."}]
    parts = [{"role": "user", "content": text_parts}]
    joined = [{"role": "user", "content": "Name a\nriver."}]
    got, want = (llm.chat(c, params, use_tqdm=False)[0] for c in (parts, joined))
    assert got.prompt == want.prompt and got.outputs[0].token_ids == want.outputs[0].token_ids
    with pytest.raises(ValueError, match="takes no images"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], params,
                 use_tqdm=False)


# A template that writes string content as it is and each part of a list of parts in brackets.
PARTS_TEMPLATE = ("{% for message in messages %}<{{ message['role'] }}>{% if message['content'] is string %}"
                  "{{ message['content'] }}{% else %}{% for part in message['content'] %}[{{ part['text'] }}]"
                  "{% endfor %}{% endif %}{% endfor %}{% if add_generation_prompt %}<answer>{% endif %}")


@pytest.mark.parametrize("chosen,rendered", [
    ("auto", "<user>[Name a][river.]<answer>"),  # the template loops over content: it gets the parts
    ("openai", "<user>[Name a][river.]<answer>"),
    ("string", "<user>Name a\nriver.<answer>"),
])
def test_chat_template_content_format_as_vllm(llm, chosen, rendered):
    """LLM.chat's chat_template_content_format, as vLLM's: the template gets a message's parts as a list
    ("openai", which "auto" picks for a template that loops over content) or their text joined ("string")."""
    params = SamplingParams(temperature=0.0, max_tokens=1)
    text_parts = [{"type": "text", "text": "Name a"}, {"type": "text", "text": "river."}]
    parts = [{"role": "user", "content": text_parts}]
    kwargs = dict(use_tqdm=False, chat_template=PARTS_TEMPLATE, chat_template_content_format=chosen)
    assert llm.chat(parts, params, **kwargs)[0].prompt == rendered
    plain = llm.chat([{"role": "user", "content": "hi"}], params, **kwargs)[0]
    assert plain.prompt == ("<user>hi<answer>" if chosen == "string" else "<user>[hi]<answer>")
    with pytest.raises(ValueError, match="content format"):
        llm.chat(parts, params, use_tqdm=False, chat_template_content_format="parts")


def test_get_metrics_reads_vllms_names_for_the_requests_run(tiny_llama):
    """LLM.get_metrics, read as vLLM's reader gives it: token counters, finish reasons, latency and size
    histograms (cumulative buckets ending at +Inf), the engine's gauges and prefix-cache counters."""
    from plait.entrypoints.metrics_reader import Counter, Gauge, Histogram

    llm = LLM(str(tiny_llama), num_kv_blocks=64, block_size=8)
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7], list(range(10, 40)), [9] * 12)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    by_name = {}
    for m in llm.get_metrics():
        by_name.setdefault(m.name, []).append(m)
    labels = by_name["vllm:prompt_tokens"][0].labels
    assert by_name["vllm:prompt_tokens"] == [Counter("vllm:prompt_tokens", labels, 3 + 30 + 12)]
    assert by_name["vllm:generation_tokens"][0].value == sum(len(o.outputs[0].token_ids) for o in outs) == 15
    reasons = {m.labels["finished_reason"]: m.value for m in by_name["vllm:request_success"]}
    assert reasons == {"stop": 0, "length": 3, "abort": 0, "error": 0}
    ttft = by_name["vllm:time_to_first_token_seconds"][0]
    assert isinstance(ttft, Histogram) and ttft.count == 3 and ttft.sum > 0
    counts = list(ttft.buckets.values())
    assert counts == sorted(counts) and list(ttft.buckets)[-1] == "+Inf" and counts[-1] == 3
    sizes = by_name["vllm:request_prompt_tokens"][0]
    assert sizes.sum == 45 and sizes.buckets["10"] == 1 and sizes.buckets["20"] == 2
    assert by_name["vllm:inter_token_latency_seconds"][0].count == 3 * 4
    assert by_name["vllm:num_requests_running"][0] == Gauge("vllm:num_requests_running", ttft.labels, 0.0)
    assert by_name["vllm:prefix_cache_queries"][0].value >= 45
    assert "vllm:spec_decode_num_drafts" not in by_name
    assert ttft.labels["model_name"] == tiny_llama.name
