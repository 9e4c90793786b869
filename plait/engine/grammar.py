"""Grammar: a sequence's structured output (JSON schema, regex, Lark, GBNF or structural tag), matched by
llguidance."""

from __future__ import annotations

import functools
import logging
import re
from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from plait.runner.sampler import BITMASK_WORD_BITS
from plait.sampling_params import StructuredOutputsParams, structural_tag_triggers

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse: a request's n sequences (and requests repeating a schema) share one
# compile (~1-2 ms, far more for large schemas) and each deep-copies its matcher (~15 us).
COMPILED_GRAMMAR_CACHE_SIZE = 32
# What marks a grammar as llama.cpp's GBNF (vLLM's guided_grammar takes it) rather than Lark.
GBNF_RULE_MARK = "::="
# A JSON object, whatever its properties (response_format {"type": "json_object"}).
ANY_JSON_OBJECT_SCHEMA = {"type": "object"}
# The matcher's own logging is off: its errors reach the caller as ValueError or a finish reason.
LLGUIDANCE_SILENT = 0
# A bitmask word with every bit set: an inactive grammar's row (the model still reasons) allows every id.
ALL_ALLOWED = -1
# Where a Lark grammar's error message names its line and column ("at 7(8): ", "6(36): "), which for a
# structural tag is a line of the grammar plait wrote, not of anything the request holds.
LARK_POSITION = re.compile(r"^(at )?\d+\(\d+\): ")


def _import_llguidance() -> Any:
    # Lazily, so the engine imports and runs without it (the GPU image has no llguidance); only a request
    # that asks for a grammar needs it.
    try:
        import llguidance
        import llguidance.gbnf_to_lark
        import llguidance.hf
    except ImportError as err:
        raise ValueError("structured outputs (json, regex, grammar, json_object, structural_tag, and a "
                         "choice that waits for the reasoning's end) need the llguidance package: pip "
                         "install llguidance") from err
    return llguidance


def mask_words(vocab_size: int) -> int:
    """int32 words of a next-token bitmask over ``vocab_size`` token ids."""
    return (vocab_size + BITMASK_WORD_BITS - 1) // BITMASK_WORD_BITS


class Grammar:
    """One sequence's matcher (made by GrammarCompiler.compile): the next-token bitmask, the sampled
    tokens fed back, and whether only EOS may follow. Never raises for what the tokens do: a token the
    grammar refuses puts it in an error state, which ``error`` reports.

    Given ``after`` (the tokens of a reasoning parser's end tag), it is inactive until the output's last
    tokens are those: every token is allowed and none is fed to the matcher, so the model reasons freely
    and the structured output is its answer, as vLLM enforces it under --reasoning-parser.
    """

    def __init__(self, matcher: Any, vocab_size: int, after: Sequence[int] = ()) -> None:
        self._matcher = matcher
        self.num_words = mask_words(vocab_size)
        self._after = tuple(after)
        self._recent: tuple[int, ...] = ()  # the last tokens while inactive, as many as ``after`` has
        self.active = not self._after

    def next_token_bitmask(self) -> np.ndarray:
        """The ids allowed next, one bit each: int32 [num_words], EOS set where the output may end."""
        return next_token_bitmasks([self])[0]

    def consume(self, token_id: int) -> None:
        """Advance past a sampled token (a refused one leaves the grammar in its error state)."""
        if self.active:
            self._matcher.consume_token(token_id)
            return
        self._recent = (*self._recent, token_id)[-len(self._after):]
        self.active = self._recent == self._after

    @property
    def error(self) -> str | None:
        """Why the grammar failed (a token it refused, a resource limit), in one line; None if it has not."""
        if not self._matcher.is_error():
            return None
        message = self._matcher.get_error().strip().splitlines()
        return message[0] if message else "the grammar failed"

    def is_terminated(self) -> bool:
        """The output is complete: nothing but EOS may follow (after an EOS too)."""
        return self.active and self._matcher.is_stopped()


def next_token_bitmasks(grammars: Sequence[Grammar]) -> np.ndarray:
    """Each grammar's next-token bitmask, int32 [len(grammars), num_words]: a step's rows all at once, on
    llguidance's threads where there are several (a mask takes ~0.1 ms or more, and a step with grammar
    rows waits for every one of them, since it is never overlapped with the step before)."""
    masks = np.zeros((len(grammars), grammars[0].num_words if grammars else 0), dtype=np.int32)
    rows = [(g._matcher, i) for i, g in enumerate(grammars) if g.active]
    masks[[i for i, g in enumerate(grammars) if not g.active]] = ALL_ALLOWED
    if len(rows) == 1:
        matcher, i = rows[0]
        matcher.unsafe_compute_mask_ptr(masks[i].ctypes.data, masks[i].nbytes)
    elif rows:
        _executor().unsafe_compute_mask_ptr(rows, masks.ctypes.data, masks.shape[1] * masks.itemsize,
                                            len(grammars))
    return masks


@functools.cache
def _executor() -> Any:
    return _import_llguidance().LLExecutor()  # its thread pool, made once per process


class GrammarCompiler:
    """Compiles StructuredOutputsParams into Grammars for one engine's tokenizer. The llguidance tokenizer
    is built at the first grammar (~0.5 s for SmolLM2's) and kept for the engine's life."""

    def __init__(self, tokenizer: Any, eos_token_ids: Collection[int]) -> None:
        self._tokenizer = tokenizer
        self._eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer: Any = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()  # llguidance grammar -> unused matcher

    def compile(self, spec: StructuredOutputsParams, after: Sequence[int] = ()) -> Grammar:
        """A fresh Grammar for ``spec``, inactive until the output ends with the tokens ``after``; raises
        ValueError with llguidance's message for a bad schema, regex or grammar, or where llguidance or the
        tokenizer is missing."""
        llguidance = _import_llguidance()
        ll_tokenizer = self._llguidance_tokenizer(llguidance)
        try:
            grammar = _grammar_text(llguidance, spec)
        except (ValueError, TypeError) as err:  # a schema llguidance cannot even read
            raise ValueError(f"structured_outputs {spec.kind} is invalid: {err}") from err
        template = self._compiled.get(grammar)
        if template is None:
            # Runtime errors in one line, without the parser's state (which would echo the schema).
            limits = llguidance.LLParserLimits(verbose_errors=False)
            template = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=LLGUIDANCE_SILENT, limits=limits)
            if template.is_error():
                message = template.get_error().strip()
                if spec.structural_tag is not None:
                    message = _structural_tag_error(llguidance, spec, message)
                raise ValueError(f"structured_outputs {spec.kind} is invalid: {message}")
            self._remember(grammar, template)
        self._compiled.move_to_end(grammar)
        return Grammar(template.deep_copy(), ll_tokenizer.vocab_size, after)

    def _remember(self, grammar: str, matcher: Any) -> None:
        self._compiled[grammar] = matcher
        if len(self._compiled) > COMPILED_GRAMMAR_CACHE_SIZE:
            self._compiled.popitem(last=False)

    def _llguidance_tokenizer(self, llguidance: Any) -> Any:
        if self._ll_tokenizer is None:
            if self._tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer; this model has none")
            # Every EOS id of the engine (generation_config.json may add some) ends a complete output.
            self._ll_tokenizer = llguidance.hf.from_tokenizer(self._tokenizer,
                                                              eos_token=self._eos_token_ids or None)
        return self._ll_tokenizer


def _grammar_text(llguidance: Any, spec: StructuredOutputsParams) -> str:
    """llguidance's grammar for ``spec``: json, regex, grammar, json_object, structural_tag, or a choice
    (which only comes here where it waits for the reasoning's end; otherwise guided_choice serves it on the
    host)."""
    json_options = {"whitespace_flexible": not spec.disable_any_whitespace}
    matcher = llguidance.LLMatcher
    if spec.json is not None or spec.json_object:
        schema = spec.json if spec.json is not None else ANY_JSON_OBJECT_SCHEMA
        return matcher.grammar_from_json_schema(schema, defaults=json_options)
    if spec.regex is not None:
        return matcher.grammar_from_regex(spec.regex)
    if spec.grammar is not None:
        return matcher.grammar_from_lark(_as_lark(llguidance, spec.grammar))
    if spec.structural_tag is not None:
        return matcher.grammar_from_lark(structural_tag_lark(llguidance, spec))
    return llguidance.grammar_from("choice", spec.choice)


def structural_tag_lark(llguidance: Any, spec: StructuredOutputsParams) -> str:
    """The Lark grammar of ``spec``'s structural tag, as llguidance's StructTag writes it: free text (a
    greedy lexeme) and, for each structure, a lazy lexeme of free text ending in its trigger (matched as soon
    as the trigger is written), then the rest of its begin, ``%json`` of its schema and its end; any number
    of those, then free text to the end. Triggers are text, as xgrammar (vLLM's default backend) reads them,
    never special tokens by name (StructTag's default for "<...>", which a trigger such as "<tool_call>"
    would fail to compile against most vocabularies)."""
    tag = spec.structural_tag
    assert isinstance(tag, dict)  # StructuredOutputsParams has checked and normalised it
    tags = [llguidance.StructTag(trigger=trigger, begin=s["begin"], end=s["end"],
                                 grammar=_with_whitespace(s["schema"], not spec.disable_any_whitespace))
            for s, trigger in zip(tag["structures"], structural_tag_triggers(tag))]
    return llguidance.StructTag.to_grammar(tags, assume_special=False)


def _with_whitespace(schema: dict[str, Any], flexible: bool) -> dict[str, Any]:
    """``schema`` with llguidance's whitespace option (what grammar_from_json_schema's defaults set for json),
    unless the schema sets it itself."""
    options = schema.get("x-guidance", {})
    if not isinstance(options, dict):  # not llguidance's options: its compiler says so
        return schema
    return {**schema, "x-guidance": {"whitespace_flexible": flexible, **options}}


def _structural_tag_error(llguidance: Any, spec: StructuredOutputsParams, message: str) -> str:
    """llguidance's error for a structural tag's grammar, in terms of the request: the first structure whose
    schema fails on its own, with its message; otherwise the grammar's message, without the grammar's lines
    (which are plait's, not the request's)."""
    tag = spec.structural_tag
    assert isinstance(tag, dict)
    matcher = llguidance.LLMatcher
    for i, structure in enumerate(tag["structures"]):
        schema = _with_whitespace(structure["schema"], not spec.disable_any_whitespace)
        error = matcher.validate_grammar(matcher.grammar_from_json_schema(schema))
        if error:
            return f"structures[{i}] schema: {error.strip().splitlines()[0]}"
    lines = message.splitlines()
    return LARK_POSITION.sub("", lines[0]) if lines else "the grammar failed"


def _as_lark(llguidance: Any, grammar: str) -> str:
    if GBNF_RULE_MARK not in grammar:
        return grammar
    try:
        return llguidance.gbnf_to_lark.gbnf_to_lark(grammar)
    except Exception as err:  # GbnfToLarkError and whatever its parser trips on: all the grammar's fault
        raise ValueError(f"not valid GBNF: {err}") from err
