"""The default model (SmolLM2-135M-Instruct, GGUF) against HF transformers, greedy fp32, token for token."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
import torch
from conftest import PERSON, PHONE

from plait import LLM, SamplingParams, StructuredOutputsParams

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


def test_greedy_matches_hf_on_chat_prompts(llm, hf_gguf_model):
    conversations = [[{"role": "user", "content": c}] for c in CHATS]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    outputs = llm.chat(conversations, params, use_tqdm=False)  # all submitted at once

    eos = sorted(llm.engine.eos_token_ids)
    for conv, out in zip(conversations, outputs):
        prompt_ids = llm.apply_chat_template(conv)
        assert out.prompt_token_ids == prompt_ids
        got = out.outputs[0].token_ids
        # HF's greedy generation (max_new_tokens=NEW_TOKENS, stopping at EOS) is `got` exactly when `got`
        # ends where generation ends (at its first EOS, else after NEW_TOKENS) and each of its tokens is
        # HF's argmax after the prompt and the tokens before it: one teacher-forced forward gives every
        # argmax (a token-by-token hf.generate per prompt took ~40 s of the suite).
        first_eos = next((k for k, t in enumerate(got) if t in eos), None)
        end = NEW_TOKENS if first_eos is None else first_eos + 1
        assert len(got) == end, f"prompt {conv[0]['content']!r}: plait stopped after {len(got)} tokens"
        with torch.no_grad():
            logits = hf_gguf_model(torch.tensor([prompt_ids + got])).logits[0, len(prompt_ids) - 1: -1]
        ref = logits.argmax(-1).tolist()
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


# --------------------------------------------------------------------------- structured outputs

needs_llguidance = pytest.mark.skipif(importlib.util.find_spec("llguidance") is None,
                                      reason="llguidance is not installed")
PERSON_CHAT = [{"role": "user", "content": "Describe a person as JSON: name, age and favourite color."}]


def _is_person(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"name", "age", "color"} and isinstance(value["name"], str)
            and isinstance(value["age"], int) and value["color"] in ("red", "green", "blue"))


@needs_llguidance
def test_json_schema_outputs_satisfy_the_schema_beside_an_unconstrained_request(llm):
    """Greedy and sampled (seeded, and n > 1: each sequence its own matcher) outputs parse and satisfy the
    schema; an unconstrained greedy request in the same batches produces what it produces alone."""
    structured = StructuredOutputsParams(json=PERSON)
    free = SamplingParams(temperature=0.0, max_tokens=24)
    alone = llm.chat([PERSON_CHAT], free, use_tqdm=False)[0].outputs[0].token_ids
    constrained = [SamplingParams(temperature=t, seed=11, n=n, max_tokens=48, structured_outputs=structured)
                   for t, n in ((0.0, 1), (1.0, 2))]
    outs = llm.chat([PERSON_CHAT] * 3, [*constrained, free], use_tqdm=False)
    completions = [c for o in outs[:2] for c in o.outputs]
    assert len(completions) == 3
    for c in completions:
        assert c.finish_reason == "stop" and _is_person(c.text), (c.text, c.finish_reason)
    assert outs[2].outputs[0].token_ids == alone
    assert llm.engine.is_idle_and_clean()


@needs_llguidance
def test_regex_json_object_lark_and_gbnf_outputs_match(llm):
    kinds = {
        "regex": (StructuredOutputsParams(regex=PHONE), lambda t: re.fullmatch(PHONE, t)),
        "json_object": (StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
                        lambda t: isinstance(json.loads(t), dict) and " " not in t),
        "lark": (StructuredOutputsParams(grammar='start: ("yes" | "no") ", " NUM\nNUM: /[0-9]{1,2}/'),
                 lambda t: re.fullmatch(r"(yes|no), [0-9]{1,2}", t)),
        "gbnf": (StructuredOutputsParams(grammar='root ::= ("red" | "blue") " " [0-9] [0-9]?'),
                 lambda t: re.fullmatch(r"(red|blue) [0-9]{1,2}", t)),
    }
    prompts = {"regex": "Call me at",
               "json_object": 'Point as JSON: {"x": 1, "y": 2}. Another point as JSON:',
               "lark": "Is water wet? Answer and rate 0-99:",
               "gbnf": "A colour and a number:"}
    params = [SamplingParams(temperature=t, seed=3, max_tokens=48, structured_outputs=spec)
              for spec, _ in kinds.values() for t in (0.0, 1.0)]
    outs = llm.generate([prompts[k] for k in kinds for _ in range(2)], params, use_tqdm=False)
    for i, (kind, (_, matches)) in enumerate(kinds.items()):
        for out in outs[2 * i: 2 * i + 2]:  # greedy, then sampled
            c = out.outputs[0]
            assert c.finish_reason == "stop" and matches(c.text), (kind, c.text, c.finish_reason)


WEATHER_PROMPT = ('Q: weather in Paris?\nA: <function=get_weather>{"city": "Paris"}</function>\n'
                  'Q: weather in Oslo?\nA:')
WEATHER_CALL = {"type": "object", "properties": {"city": {"type": "string"},
                                                 "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"], "additionalProperties": False}


@needs_llguidance
def test_a_structural_tag_forces_the_schema_after_the_trigger(llm):
    """vLLM's structural tag, as its JSON text: greedy, the model writes the free text it writes
    unconstrained, then the trigger, and from there JSON of the structure's schema (which its own greedy JSON
    is not: no "unit") in compact form, then the end."""
    tag = {"type": "structural_tag", "triggers": ["<function="],
           "structures": [{"begin": "<function=get_weather>", "schema": WEATHER_CALL, "end": "</function>"}]}
    structured = StructuredOutputsParams(structural_tag=json.dumps(tag), disable_any_whitespace=True)
    free, constrained = (SamplingParams(temperature=0.0, max_tokens=24, stop=["\n"], structured_outputs=s)
                         for s in (None, structured))
    outs = [o.outputs[0] for o in llm.generate([WEATHER_PROMPT] * 2, [free, constrained], use_tqdm=False)]
    call = re.compile(r"(.*)<function=get_weather>(.*)</function>", re.DOTALL)
    unforced, forced = call.fullmatch(outs[0].text), call.fullmatch(outs[1].text)
    assert unforced and "unit" not in json.loads(unforced[2]), outs[0].text  # what it writes freely
    assert forced and outs[1].finish_reason == "stop", (outs[1].text, outs[1].finish_reason)
    assert forced[1] == unforced[1]  # the free text before the trigger is the model's own
    call_args = json.loads(forced[2])
    assert set(call_args) == {"city", "unit"} and isinstance(call_args["city"], str), forced[2]
    assert call_args["unit"] in ("celsius", "fahrenheit") and " " not in forced[2]
    assert llm.engine.is_idle_and_clean()


@needs_llguidance
@pytest.mark.parametrize("spec,words", [
    (dict(json={"type": "object", "properties": {"a": {"type": "integer", "minimum": "x"}}}), "minimum"),
    (dict(regex="[0-9"), "unclosed character class"),
])
def test_bad_schema_or_regex_is_refused_at_add_request(llm, spec, words):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**spec))
    with pytest.raises(ValueError, match=words):
        llm.engine.add_request("Hi", params)
    assert llm.engine.is_idle_and_clean()


@needs_llguidance
def test_steps_after_grammar_or_penalty_rows_overlap_their_forward_and_sample_as_without_overlap(llm):
    """A row's next mask (a grammar's, a guided choice's, a bad word's) or penalty depends on the token
    just sampled, so the next step launches its forward first and samples once that token is collected:
    with the mask a token behind, a digit could go where "-" goes. Every output, sampled and seeded
    ones too, equals the run without overlap (async_scheduling=False)."""
    phone = StructuredOutputsParams(regex=PHONE)
    person = StructuredOutputsParams(json=PERSON)
    batch = [
        ("My number is", SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=phone)),
        ("Describe a person as JSON:", SamplingParams(temperature=1.0, seed=7, max_tokens=40,
                                                       structured_outputs=person)),
        ("Pick a colour:", SamplingParams(temperature=0.8, seed=3, max_tokens=8, guided_choice=CHOICES)),
        ("Count: one, two,", SamplingParams(temperature=0.9, seed=5, max_tokens=20, presence_penalty=0.8,
                                            frequency_penalty=0.4, repetition_penalty=1.3)),
        ("The capital of France is", SamplingParams(temperature=0.0, max_tokens=16,
                                                    bad_words=["Paris", " Paris is"])),
        ("Write one sentence about the sea:", SamplingParams(temperature=1.0, seed=9, max_tokens=20)),
    ]
    engine = llm.engine
    assert engine.config.async_scheduling
    launches = []
    launch = engine.runner.launch

    def spy(plan, prev, sample=True):
        launches.append((sample, prev is not None and prev.needs_last_tokens))
        return launch(plan, prev, sample)

    engine.runner.launch = spy
    try:
        overlapped = _run_batch(engine, batch)
    finally:
        del engine.runner.launch
    # Every step after one with such rows sampled late; none other did.
    assert all(sample is not late for sample, late in launches), launches
    assert sum(not sample for sample, _ in launches) >= 8
    assert re.fullmatch(PHONE, overlapped[0].text)
    assert _is_person(overlapped[1].text) and overlapped[2].text in CHOICES
    serial = LLM(max_num_batched_tokens=256, async_scheduling=False)
    expected = _run_batch(serial.engine, batch)
    assert [o.token_ids for o in overlapped] == [o.token_ids for o in expected]
    assert [o.finish_reason for o in overlapped] == [o.finish_reason for o in expected]
    assert engine.is_idle_and_clean()


def _run_batch(engine, batch):
    ids = [engine.add_request(prompt, params) for prompt, params in batch]
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0]
    return [finished[i] for i in ids]


@needs_llguidance
def test_a_failing_grammar_finishes_its_request_with_error_and_others_go_on(llm):
    """min_tokens bans EOS where the grammar allows nothing else: the forced token fails the grammar, and
    that request alone ends, with finish_reason "error" and the reason in stop_reason."""
    broken = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=2,
                            structured_outputs=StructuredOutputsParams(regex="a{0}"))
    free = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(["Hello", "Hello"], [broken, free], use_tqdm=False)
    failed = outs[0].outputs[0]
    assert failed.finish_reason == "error" and "structured output failed" in failed.stop_reason
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 6
    assert llm.engine.is_idle_and_clean()


def _contains(ids: list[int], seq: tuple[int, ...]) -> bool:
    return any(tuple(ids[i: i + len(seq)]) == seq for i in range(len(ids) - len(seq) + 1))


def test_bad_words_are_never_generated_and_neighbours_are_unchanged(llm):
    """vLLM's bad_words: words the free output uses (one of one token, one of several) never appear, in
    any of the tokenizations the engine bans, greedy or sampled; an unconstrained request in the same
    batch answers as it does alone."""
    prompts = ["The capital of France is", "Write one sentence about the sea:"]
    free = SamplingParams(max_tokens=24, temperature=0.0)
    outs = [o.outputs[0] for o in llm.generate(prompts, free)]
    words = sorted({w.strip(".,:;!?\"'") for o in outs for w in o.text.split()}, key=len)
    banned = [w for w in words if w][-2:]  # the two longest: usually several tokens each
    tokenizer = llm.get_tokenizer()
    sequences = {tuple(tokenizer.encode(p + w, add_special_tokens=False)) for w in banned for p in ("", " ")}
    assert any(len(s) > 1 for s in sequences), "the test wants a word of several tokens"
    assert any(_contains(o.token_ids, s) for o in outs for s in sequences)  # the free output has them
    for params in (SamplingParams(max_tokens=24, temperature=0.0, bad_words=banned),
                   SamplingParams(max_tokens=24, temperature=1.0, seed=3, bad_words=banned)):
        got = llm.generate(prompts + prompts[:1], [params, params, free])
        for o in got[:2]:
            out = o.outputs[0]
            assert not any(_contains(out.token_ids, s) for s in sequences), (out.text, banned)
        assert got[2].outputs[0].token_ids == outs[0].token_ids


def test_bad_words_are_checked():
    for bad, match in (("word", "list of str"), (["ok", " "], "blank"), (["w"] * 129, "at most 128")):
        with pytest.raises(ValueError, match=match):
            SamplingParams(bad_words=bad)
    assert SamplingParams(bad_words=[]).bad_words is None
