"""Tests for SamplingParams defaults, normalisation and validation."""

import dataclasses
import json
import math
import re

import pytest

from plait.sampling_params import (
    GREEDY_TEMPERATURE_EPS,
    LOGIT_BIAS_BOUND,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    TOP_K_DISABLED,
    SamplingParams,
    StructuredOutputsParams,
)


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert p.n == 1
    assert p.temperature == 1.0
    assert p.top_p == 1.0
    assert p.top_k == TOP_K_DISABLED == 0
    assert p.min_p == 0.0
    assert p.seed is None
    assert p.max_tokens == 16
    assert p.min_tokens == 0
    assert p.stop == []
    assert p.stop_token_ids == []
    assert p.ignore_eos is False
    assert p.logprobs is None
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.skip_special_tokens is True and p.spaces_between_special_tokens is True
    assert p.include_stop_str_in_output is False
    assert p.detokenize is True
    assert not p.is_greedy


def test_default_lists_are_not_shared() -> None:
    a, b = SamplingParams(), SamplingParams()
    a.stop_token_ids.append(5)
    assert b.stop_token_ids == []


def test_vllm_top_k_minus_one_means_disabled() -> None:
    assert SamplingParams(top_k=-1).top_k == TOP_K_DISABLED
    assert SamplingParams(top_k=0).top_k == TOP_K_DISABLED
    assert SamplingParams(top_k=7).top_k == 7


def test_stop_normalised_to_list() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=["a", "bc"]).stop == ["a", "bc"]
    assert SamplingParams(stop=("x",)).stop == ["x"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


def test_numbers_are_stored_as_floats() -> None:
    p = SamplingParams(temperature=1, top_p=1, presence_penalty=1, repetition_penalty=2)
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert isinstance(p.presence_penalty, float) and isinstance(p.repetition_penalty, float)


@pytest.mark.parametrize(
    ("temperature", "greedy"),
    [
        (0.0, True),
        (0, True),
        (GREEDY_TEMPERATURE_EPS / 2, True),
        (GREEDY_TEMPERATURE_EPS, False),
        (0.7, False),
    ],
)
def test_is_greedy(temperature: float, greedy: bool) -> None:
    assert SamplingParams(temperature=temperature).is_greedy is greedy


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(n=3, temperature=0.0, seed=123, max_tokens=None, min_tokens=5),
        dict(top_p=1e-6, top_k=1, min_p=1.0, logprobs=0, prompt_logprobs=0),
        dict(logprobs=MAX_LOGPROBS, presence_penalty=-2, frequency_penalty=2.0, repetition_penalty=1e-3),
        dict(seed=-5, stop=["\n\n", "END"], stop_token_ids=[0, 2], ignore_eos=True),
        dict(max_tokens=1, min_tokens=1, skip_special_tokens=False, include_stop_str_in_output=True),
        dict(truncate_prompt_tokens=1),
        dict(truncate_prompt_tokens=-1, max_tokens=None),  # vLLM's -1: as many as the context allows
    ],
)
def test_valid_values_construct(kwargs: dict) -> None:
    p = SamplingParams(**kwargs)
    for key, value in kwargs.items():
        if key not in ("stop",):
            assert getattr(p, key) == value


def test_exact_messages() -> None:
    with pytest.raises(ValueError, match=r"^temperature must be >= 0, got -1\.0$"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\], got 0$"):
        SamplingParams(top_p=0)


INVALID = [
    ("n", 0),
    ("n", -1),
    ("n", 1.0),
    ("n", True),
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "0.5"),
    ("temperature", None),
    ("temperature", True),
    ("top_p", 0.0),
    ("top_p", 1.0001),
    ("top_p", -0.5),
    ("top_p", math.nan),
    ("top_k", -2),
    ("top_k", 2.0),
    ("top_k", "5"),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("min_p", math.nan),
    ("seed", 1.5),
    ("seed", "42"),
    ("seed", False),
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", "5"),
    ("max_tokens", 5.0),
    ("max_tokens", True),
    ("min_tokens", -1),
    ("min_tokens", 17),  # > default max_tokens=16
    ("min_tokens", None),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", ["ok", 3]),
    ("stop", 3),
    ("stop_token_ids", [1, -1]),
    ("stop_token_ids", [1, "2"]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", 5),
    ("ignore_eos", 1),
    ("ignore_eos", "yes"),
    ("logprobs", -1),
    ("prompt_logprobs", -1),
    ("prompt_logprobs", 1.5),
    ("logprobs", 2.0),
    ("logprobs", True),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("presence_penalty", math.inf),
    ("frequency_penalty", -3),
    ("frequency_penalty", math.nan),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.nan),
    ("skip_special_tokens", None),
    ("spaces_between_special_tokens", "no"),
    ("include_stop_str_in_output", 0),
    ("truncate_prompt_tokens", 0),
    ("truncate_prompt_tokens", -2),
    ("truncate_prompt_tokens", 5.0),
    ("truncate_prompt_tokens", "5"),
    ("truncate_prompt_tokens", True),
]


@pytest.mark.parametrize(("field", "value"), INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_value_raises_naming_field(field: str, value: object) -> None:
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**{field: value})
    message = str(excinfo.value)
    assert message.startswith(field), message
    if not isinstance(value, (list, str)):
        shown = {repr(value), str(value)} | ({f"{value:g}"} if isinstance(value, float) else set())
        assert any(s in message for s in shown), message


def test_truncate_prompt_tokens_as_vllm() -> None:
    """Off by default; k >= 1 keeps the prompt's last k tokens, -1 as many as fit (the engine knows how
    many); 0 would keep nothing, so it is refused with what the values mean."""
    assert SamplingParams().truncate_prompt_tokens is None
    assert SamplingParams(truncate_prompt_tokens=None).truncate_prompt_tokens is None
    with pytest.raises(ValueError, match=r"^truncate_prompt_tokens must be >= 1, or -1 for as many as the "
                                         r"context leaves room for; got 0$"):
        SamplingParams(truncate_prompt_tokens=0)
    with pytest.raises(ValueError, match=r"^truncate_prompt_tokens must be an int or None, got float 2\.0$"):
        SamplingParams(truncate_prompt_tokens=2.0)


def test_replace_revalidates() -> None:
    p = SamplingParams(temperature=0.5)
    assert dataclasses.replace(p, top_k=-1).top_k == TOP_K_DISABLED
    with pytest.raises(ValueError, match="temperature"):
        dataclasses.replace(p, temperature=-2.0)


def test_logit_bias_and_allowed_token_ids_normalised() -> None:
    p = SamplingParams()
    assert p.logit_bias is None and p.allowed_token_ids is None  # vLLM's defaults
    p = SamplingParams(logit_bias={5: 1, 0: -100, 7: 100.0}, allowed_token_ids=(3, 1, 3))
    assert p.logit_bias == {5: 1.0, 0: -100.0, 7: 100.0} and isinstance(p.logit_bias[5], float)
    assert p.allowed_token_ids == [3, 1, 3]
    assert SamplingParams(logit_bias={}).logit_bias is None  # asks for nothing
    assert dataclasses.replace(p, n=2).logit_bias == p.logit_bias  # fan-out revalidates the same values
    full = SamplingParams(logit_bias=dict.fromkeys(range(MAX_LOGIT_BIAS_ENTRIES), 1.0),
                          allowed_token_ids=list(range(MAX_ALLOWED_TOKEN_IDS)))
    assert len(full.logit_bias) == len(full.allowed_token_ids) == 1024


INVALID_TOKEN_MAPS = [
    ("logit_bias", {-1: 1.0}, "non-negative"),
    ("logit_bias", {True: 1.0}, "must be an int"),
    ("logit_bias", {"5": 1.0}, "must be an int"),
    ("logit_bias", {1.0: 1.0}, "must be an int"),
    ("logit_bias", {5: LOGIT_BIAS_BOUND + 0.5}, "[-100, 100], got 100.5"),
    ("logit_bias", {5: -101}, "got -101"),
    ("logit_bias", {5: math.nan}, "finite"),
    ("logit_bias", {5: math.inf}, "finite"),
    ("logit_bias", {5: "1"}, "a number"),
    ("logit_bias", {5: True}, "a number"),
    ("logit_bias", [(5, 1.0)], "dict"),
    ("logit_bias", dict.fromkeys(range(MAX_LOGIT_BIAS_ENTRIES + 1), 1.0), "at most 1024 entries"),
    ("allowed_token_ids", [], "must not be empty"),
    ("allowed_token_ids", [1, -1], "non-negative"),
    ("allowed_token_ids", [1, "2"], "must be an int"),
    ("allowed_token_ids", [True], "must be an int"),
    ("allowed_token_ids", 5, "list of int"),
    ("allowed_token_ids", {1, 2}, "list of int"),
    ("allowed_token_ids", list(range(MAX_ALLOWED_TOKEN_IDS + 1)), "at most 1024 ids"),
]


@pytest.mark.parametrize(("field", "value", "words"), INVALID_TOKEN_MAPS,
                         ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(INVALID_TOKEN_MAPS)])
def test_bad_logit_bias_and_allowed_token_ids_raise_naming_the_field(field: str, value: object,
                                                                     words: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**{field: value})
    message = str(excinfo.value)
    # The server names the field from the message's first word.
    assert message.split(" ", 1)[0] == field, message
    assert words in message, message


# --------------------------------------------------------------------------- structured outputs

TAG_A = {"begin": "<a>", "schema": {"type": "object"}, "end": "</a>"}
TAG = {"structures": [TAG_A], "triggers": ["<a"]}  # vLLM's structural tag
BAD_STRUCTURED_OUTPUTS = [
    (dict(), "exactly one of json, regex, grammar, choice, json_object, structural_tag; got none"),
    (dict(json_object=False), "got none"),
    (dict(regex="a", grammar="start: 'a'"), "got regex and grammar"),
    (dict(json={"type": "object"}, json_object=True), "got json and json_object"),
    (dict(json="{not json"), "not valid JSON"),
    (dict(json="[1, 2]"), "JSON schema object"),
    (dict(json=5), "JSON schema object"),
    (dict(regex=""), "non-empty str"),
    (dict(grammar=5), "non-empty str"),
    (dict(choice=[]), "at least one"),
    (dict(json_object=1), "must be a bool"),
    # structural tags, as vLLM's backends check them (llguidance's and xgrammar's rules)
    (dict(structural_tag="{not json"), "not valid JSON"),
    (dict(structural_tag=[]), "object with structures and triggers"),
    (dict(structural_tag={"format": {"type": "any_text"}}), "format form"),
    (dict(structural_tag={"type": "json", **TAG}), "type must be 'structural_tag'"),
    (dict(structural_tag={"structures": [TAG_A]}), "needs triggers"),
    (dict(structural_tag={**TAG, "structures": []}), "structures must be a non-empty list"),
    (dict(structural_tag={**TAG, "structures": ["<a>"]}), "structures[0] must be an object"),
    (dict(structural_tag={**TAG, "structures": [{**TAG_A, "end": None}]}), "structures[0] end must be a str"),
    (dict(structural_tag={**TAG, "structures": [{**TAG_A, "schema": "{}"}]}), "JSON schema object"),
    (dict(structural_tag={**TAG, "triggers": ["<b"]}), "begin '<a>' does not match any trigger"),
    (dict(structural_tag={**TAG, "triggers": ["<a", "<a"]}), "'<a' is a prefix of '<a'"),
    (dict(structural_tag={**TAG, "triggers": ["<a", ""]}), "non-empty str"),
    (dict(structural_tag=TAG, json_object=True), "got json_object and structural_tag"),
]


@pytest.mark.parametrize(("kwargs", "words"), BAD_STRUCTURED_OUTPUTS,
                         ids=[str(i) for i in range(len(BAD_STRUCTURED_OUTPUTS))])
def test_structured_outputs_set_exactly_one_valid_constraint(kwargs: dict, words: str) -> None:
    with pytest.raises(ValueError, match=re.escape(words)) as excinfo:
        StructuredOutputsParams(**kwargs)
    # The server names the field from the message's first word.
    assert excinfo.value.args[0].split(" ", 1)[0] in ("structured_outputs", "guided_choice")


def test_structured_outputs_in_sampling_params() -> None:
    schema = {"type": "object"}
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=json.dumps(schema)))
    assert params.structured_outputs.json == schema and params.grammar_spec is params.structured_outputs
    assert SamplingParams(structured_outputs={"regex": "[ab]+"}).structured_outputs.kind == "regex"
    # A structural tag (as vLLM's server passes it on: its JSON text, with its type) is held as the object.
    text = json.dumps({"type": "structural_tag", **TAG})
    tag = SamplingParams(n=2, structured_outputs={"structural_tag": text})
    assert tag.grammar_spec.kind == "structural_tag" and tag.structured_outputs.structural_tag == TAG
    assert dataclasses.replace(tag, n=1).structured_outputs.structural_tag == TAG
    # A choice is served as guided_choice, which a copy (n > 1 fans out with dataclasses.replace) keeps.
    choice = SamplingParams(n=2, structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    assert choice.guided_choice == ["a", "b"] and choice.grammar_spec is None
    assert dataclasses.replace(choice, n=1).guided_choice == ["a", "b"]
    with pytest.raises(ValueError, match="cannot be combined"):
        SamplingParams(structured_outputs={"regex": "a"}, allowed_token_ids=[1])
    with pytest.raises(ValueError, match="cannot be combined"):
        SamplingParams(structured_outputs={"choice": ["a"]}, allowed_token_ids=[1])
    with pytest.raises(ValueError, match="cannot both be set"):
        SamplingParams(guided_choice=["a"], structured_outputs={"choice": ["b"]})
    with pytest.raises(ValueError, match="cannot both be set"):
        SamplingParams(guided_choice=["a"], structured_outputs={"json_object": True})
    with pytest.raises(ValueError, match="unknown field"):
        SamplingParams(structured_outputs={"schema": {}})
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs="json")


def test_detokenize_off_refuses_stop_strings() -> None:
    """vLLM's detokenize=False: token ids only, so stop strings (matched on the text) cannot apply."""
    assert SamplingParams(detokenize=False, stop_token_ids=[5]).stop_token_ids == [5]
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(detokenize=False, stop=["\n"])
    with pytest.raises((TypeError, ValueError), match="detokenize"):
        SamplingParams(detokenize="no")
