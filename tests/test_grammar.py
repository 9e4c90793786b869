"""Grammar and GrammarCompiler against llguidance and the default model's tokenizer (no model weights)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from plait.engine.grammar import GrammarCompiler, mask_words, next_token_bitmasks
from plait.sampling_params import StructuredOutputsParams

pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
EOS = 2  # SmolLM2's <|im_end|>


@pytest.fixture(scope="module")
def tokenizer():
    from plait.loader.gguf import default_model_path
    from plait.loader.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, {EOS})


def _allowed(mask: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")).tolist())


def test_a_schema_allows_only_matching_tokens_and_ends_where_the_json_does(tokenizer, compiler) -> None:
    grammar = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    text = '{"name": "Ada", "age": 36}'
    ids = tokenizer.encode(text, add_special_tokens=False)
    for i, token in enumerate(ids):
        mask = grammar.next_token_bitmask()
        assert mask.dtype == np.int32 and mask.shape == (mask_words(len(tokenizer)),)
        allowed = _allowed(mask)
        assert token in allowed and (EOS in allowed) == (i == len(ids)), (i, tokenizer.decode([token]))
        assert not grammar.is_terminated()
        grammar.consume(token)
        assert grammar.error is None
    assert grammar.is_terminated() and _allowed(grammar.next_token_bitmask()) == {EOS}
    assert json.loads(tokenizer.decode(ids)) == {"name": "Ada", "age": 36}


def test_sequences_of_one_spec_have_their_own_matchers(tokenizer, compiler) -> None:
    """A request's n sequences share the compiled grammar, never its state."""
    spec = StructuredOutputsParams(regex="[0-9]{3}-[0-9]{4}")
    first, second = compiler.compile(spec), compiler.compile(spec)
    for token in tokenizer.encode("123-", add_special_tokens=False):
        first.consume(token)
    dash = tokenizer.encode("-", add_special_tokens=False)[0]
    assert dash not in _allowed(first.next_token_bitmask())
    assert dash not in _allowed(second.next_token_bitmask())  # still at its start: digits only
    assert _allowed(second.next_token_bitmask()) == _allowed(compiler.compile(spec).next_token_bitmask())


def test_a_refused_token_is_an_error_not_an_exception(tokenizer, compiler) -> None:
    grammar = compiler.compile(StructuredOutputsParams(regex="[0-9]+"))
    grammar.consume(tokenizer.encode("x", add_special_tokens=False)[0])
    assert grammar.error is not None and "\n" not in grammar.error


@pytest.mark.parametrize("spec,words", [
    (dict(json={"type": "object", "properties": 5}), "properties must be an object"),
    (dict(json={"type": "bogus"}), "bogus"),
    (dict(regex="[0-9"), "unclosed character class"),
    (dict(grammar="start: missing_rule"), "unknown name"),
    (dict(grammar='root ::= "a" (', ), "GBNF"),
])
def test_bad_specs_are_value_errors_with_llguidance_s_message(compiler, spec, words) -> None:
    kind = next(iter(spec))
    with pytest.raises(ValueError, match=f"structured_outputs {kind} is invalid") as err:
        compiler.compile(StructuredOutputsParams(**spec))
    assert words in str(err.value)


def test_gbnf_and_lark_compile_alike(tokenizer, compiler) -> None:
    lark = compiler.compile(StructuredOutputsParams(grammar='start: "yes" | "no"'))
    gbnf = compiler.compile(StructuredOutputsParams(grammar='root ::= "yes" | "no"'))
    assert _allowed(lark.next_token_bitmask()) == _allowed(gbnf.next_token_bitmask())


def test_without_llguidance_or_a_tokenizer_a_grammar_is_a_clear_value_error(monkeypatch, tokenizer) -> None:
    with pytest.raises(ValueError, match="tokenizer"):
        GrammarCompiler(None, {EOS}).compile(StructuredOutputsParams(json_object=True))
    monkeypatch.setitem(sys.modules, "llguidance", None)  # what `import llguidance` meets where it is missing
    with pytest.raises(ValueError, match="pip install llguidance"):
        GrammarCompiler(tokenizer, {EOS}).compile(StructuredOutputsParams(json_object=True))


def test_a_steps_masks_filled_in_parallel_equal_each_grammars_own(tokenizer, compiler) -> None:
    """next_token_bitmasks fills several rows on llguidance's threads: each row is exactly the mask its
    grammar gives alone, whatever state each is in."""
    from plait.engine.grammar import next_token_bitmasks

    specs = [dict(json=SCHEMA), dict(regex=r"[0-9]{3}-[0-9]{4}"), dict(json_object=True)] * 3
    grammars = [compiler.compile(StructuredOutputsParams(**spec)) for spec in specs]
    prefixes = ['{"name": "A', "55", '{"', '{"name": "Bo", "age": 4', "555-", "{"]
    for grammar, prefix in zip(grammars[3:], prefixes):  # the first three stay at their starts
        for t in tokenizer.encode(prefix, add_special_tokens=False):
            grammar.consume(t)
    assert all(g.error is None for g in grammars)
    together = next_token_bitmasks(grammars)
    assert together.shape == (len(grammars), grammars[0].num_words)
    for row, grammar in zip(together, grammars):
        assert np.array_equal(row, grammar.next_token_bitmask())
    assert len({row.tobytes() for row in together}) > 3
    assert next_token_bitmasks([]).shape[0] == 0


def test_a_grammar_waits_for_the_reasoning_end(tokenizer, compiler) -> None:
    """SamplingParams.reasoning_end (a reasoning parser's end tag): the grammar, a guided choice's too, allows
    every token and consumes none until the output ends with the tag's tokens, then constrains as ever."""
    from plait.sampling_params import SamplingParams

    params = SamplingParams(guided_choice=["yes", "no"], reasoning_end="</think>")
    assert params.host_choices is None and params.grammar_spec.choice == ["yes", "no"]
    end = tokenizer.encode("</think>", add_special_tokens=False)
    waiting, at_once = compiler.compile(params.grammar_spec, end), compiler.compile(params.grammar_spec)
    word = tokenizer.encode(" maybe", add_special_tokens=False)[0]
    for token in [word, *end[:-1], word, *end]:  # half the tag, then the whole tag
        assert not waiting.active and (waiting.next_token_bitmask() == -1).all()
        assert waiting.error is None and not waiting.is_terminated()
        waiting.consume(token)
    assert waiting.active and waiting.error is None and not waiting.is_terminated()
    both = next_token_bitmasks([waiting, at_once, compiler.compile(params.grammar_spec, end)])
    assert (both[0] == both[1]).all() and _allowed(both[0]) != _allowed(both[2])  # the third still waits
    assert (both[2] == -1).all()
    for token in tokenizer.encode("yes", add_special_tokens=False):
        waiting.consume(token)
    assert waiting.is_terminated() and waiting.error is None
    assert SamplingParams(guided_choice=["yes"]).host_choices == ["yes"]  # without reasoning: on the host


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}
STRUCTURAL_TAG = {
    "structures": [{"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"},
                   {"begin": "<function=get_time>", "schema": {"type": "object", "properties": {
                       "tz": {"type": "string"}}, "required": ["tz"]}, "end": "</function>"},
                   {"begin": "<tool_call>", "schema": {"type": "integer"}, "end": "</tool_call>"}],
    "triggers": ["<function=", "<tool_call>"],
}


def _feed(tokenizer, grammar, text: str) -> None:
    for token in tokenizer.encode(text, add_special_tokens=False):
        grammar.consume(token)


def test_a_structural_tag_constrains_only_what_follows_a_trigger(tokenizer, compiler) -> None:
    """vLLM's structural tag: free text, and after a trigger one of its structures' begins, JSON of that
    structure's schema and its end; then free text again, EOS allowed wherever the text is free. A trigger
    written "<...>" is text (as xgrammar reads it), not a special token's name."""
    spec = StructuredOutputsParams(structural_tag=json.dumps({"type": "structural_tag", **STRUCTURAL_TAG}))
    grammar = compiler.compile(spec)
    x = tokenizer.encode("x", add_special_tokens=False)[0]
    assert {x, EOS} <= _allowed(grammar.next_token_bitmask())  # free text, which may end at once
    steps = [("Let me check. ", True), ("<function=", False), ("get_weather>", False),
             ('{"city": "Paris"}', False), ("</function>", True), (" Also <function=get_time>", False),
             ('{"tz":"CET"}</function>', True), ("\nAnd <tool_call>", False), ("42</tool_call>", True),
             (" Done: <function=get_weathe", False), ('r>{ "city" : "Rome" }</function>.', True)]
    for text, free in steps:
        _feed(tokenizer, grammar, text)
        assert grammar.error is None, (text, grammar.error)
        allowed = _allowed(grammar.next_token_bitmask())
        assert (x in allowed) == free and (EOS in allowed) == free, text
        assert not grammar.is_terminated()
    grammar.consume(EOS)
    assert grammar.error is None and grammar.is_terminated()


@pytest.mark.parametrize("after_trigger", [
    '{"town": "Paris"}',  # not the schema's property (additionalProperties is false)
    '{"city": 5}',  # the property, of the wrong type
    "get_other>{}",  # a begin of no structure
    'get_weather>{"city": "Paris"} </function>',  # the end, not text, must follow the JSON
    'get_time>{"tz": "UTC"}</tool_call>',  # another structure's end
])
def test_a_structural_tag_refuses_what_breaks_a_structure(tokenizer, compiler, after_trigger) -> None:
    grammar = compiler.compile(StructuredOutputsParams(structural_tag=STRUCTURAL_TAG))
    prefix = "<function=" if after_trigger[0] in "gt" else "<function=get_weather>"
    _feed(tokenizer, grammar, "Sure: " + prefix)
    assert grammar.error is None
    _feed(tokenizer, grammar, after_trigger)
    assert grammar.error is not None and "\n" not in grammar.error


def test_a_structural_tags_schemas_follow_disable_any_whitespace(tokenizer, compiler) -> None:
    spec = StructuredOutputsParams(structural_tag=STRUCTURAL_TAG, disable_any_whitespace=True)
    compact, spaced = compiler.compile(spec), compiler.compile(spec)
    _feed(tokenizer, compact, '<function=get_weather>{"city":"Oslo"}</function>')
    assert compact.error is None
    _feed(tokenizer, spaced, '<function=get_weather>{"city": "Oslo"}')
    assert spaced.error is not None


def test_a_structural_tags_bad_schema_names_its_structure(compiler) -> None:
    structures = [*STRUCTURAL_TAG["structures"], {"begin": "<tool_call>x", "schema": {"type": "bogus"},
                                                   "end": ""}]
    spec = StructuredOutputsParams(structural_tag={**STRUCTURAL_TAG, "structures": structures})
    words = r"structured_outputs structural_tag is invalid: structures\[3\] schema: Invalid type: bogus$"
    with pytest.raises(ValueError, match=words):
        compiler.compile(spec)
