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
