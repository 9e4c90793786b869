"""Per-request sampling parameters, with vLLM-compatible field names, defaults and validation."""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

# vLLM's logprobs_mode: what a sampled token's logprobs hold. "raw": from the model's logits, before any
# processing; "processed": from the logits the token was drawn from (after the allowed-token and grammar
# masks, bad words, logit bias, min_tokens and penalties; for sampled rows also temperature and the top-k,
# top-p and min-p cuts, cut ids at -inf). "_logprobs": log-softmaxed; "_logits": the values themselves.
RAW_LOGPROBS = "raw_logprobs"
PROCESSED_LOGPROBS = "processed_logprobs"
RAW_LOGITS = "raw_logits"
PROCESSED_LOGITS = "processed_logits"
LOGPROBS_MODES = (RAW_LOGPROBS, PROCESSED_LOGPROBS, RAW_LOGITS, PROCESSED_LOGITS)
LOGITS_MODES = (RAW_LOGITS, PROCESSED_LOGITS)

# top_k value meaning "no top-k filtering". vLLM also accepts -1 for this; it is normalised to 0.
TOP_K_DISABLED = 0
_VLLM_TOP_K_DISABLED = -1

# Temperatures below this are treated as greedy decoding (same threshold as vLLM's _SAMPLING_EPS).
GREEDY_TEMPERATURE_EPS = 1e-5

# The OpenAI API allows at most 20 top logprobs per position; vLLM's default cap (--max-logprobs) is the
# same, and so is plait's (EngineConfig.max_logprobs, which the engine checks requests against).
MAX_LOGPROBS = 20

# OpenAI-style presence/frequency penalties are bounded to [-2, 2].
PENALTY_BOUND = 2.0

# OpenAI's logit_bias values lie in [-100, 100] (a bias of +-100 already bans or forces a token).
LOGIT_BIAS_BOUND = 100.0
# Entries one request may bring: the sampler builds index lists of them every step. vLLM's GPU model
# runner caps both at 1024 (MAX_NUM_LOGIT_BIAS_TOKENS, MAX_NUM_ALLOWED_TOKEN_IDS); OpenAI's logit_bias
# takes at most 300, so every OpenAI or vLLM request fits.
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_ALLOWED_TOKEN_IDS = 1024
# Choices of one guided_choice request: each is tokenized at admission and matched on the host every step.
MAX_GUIDED_CHOICES = 256
# Words one bad_words request may ban (vLLM's bound on a request's bad words).
MAX_BAD_WORDS = 128
# truncate_prompt_tokens' value for "as many of the prompt's last tokens as the context leaves room for"
# (vLLM's -1).
TRUNCATE_TO_CONTEXT = -1
# The constraint kinds of StructuredOutputsParams, exactly one of which a request sets.
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "grammar", "choice", "json_object", "structural_tag")


class RequestOutputKind(enum.IntEnum):
    """Which outputs a request's consumer gets (vLLM's, same values). CUMULATIVE: one each step that gives
    the request tokens, its text and token ids the whole output so far (``delta_*`` the step's own).
    DELTA: as often, but text, token ids and logprobs only what is new (nothing re-copied each step).
    FINAL_ONLY: one output, when the request finishes, whole (its ``delta_*`` the whole output too, new to
    its reader): a consumer that reads only the end is not woken every step."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def _check_int(name: str, value: Any, *, optional: bool = False) -> None:
    # bool is a subclass of int, but max_tokens=True is certainly a caller bug.
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        kind = "an int or None" if optional else "an int"
        raise ValueError(f"{name} must be {kind}, got {_describe(value)}")


def _check_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {_describe(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _check_bias(token_id: int, value: Any) -> float:
    value = _check_float("logit_bias value", value)
    if not -LOGIT_BIAS_BOUND <= value <= LOGIT_BIAS_BOUND:
        bounds = f"[-{LOGIT_BIAS_BOUND:g}, {LOGIT_BIAS_BOUND:g}]"
        raise ValueError(f"logit_bias values must be in {bounds}, got {value:g} for token id {token_id}")
    return value


def _str_list(name: str, value: Any, limit: int, noun: str) -> list[str]:
    """``value``, a list or tuple of at most ``limit`` strings, as a list."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{name} must be a list of str, got {_describe(value)}")
    if len(value) > limit:
        raise ValueError(f"{name} must have at most {limit} {noun}, got {len(value)}")
    return list(value)


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {_describe(value)}")


@dataclass
class StructuredOutputsParams:
    """vLLM's StructuredOutputsParams: the output must match one constraint, compiled by llguidance
    (plait/engine/grammar.py) except ``choice``, which SamplingParams.guided_choice serves (by a grammar too
    where it waits for SamplingParams.reasoning_end)."""

    json: dict[str, Any] | str | None = None  # a JSON schema (a dict, or its JSON text)
    regex: str | None = None  # the whole output matches it (Rust regex syntax, as llguidance reads it)
    # A context-free grammar: Lark as llguidance reads it, or llama.cpp's GBNF (text with "::=").
    grammar: str | None = None
    choice: list[str] | None = None  # exactly one of these strings (as SamplingParams.guided_choice)
    json_object: bool = False  # any JSON object
    # vLLM's: no whitespace between JSON tokens (json, json_object, structural_tag's schemas), where by
    # default any is allowed.
    disable_any_whitespace: bool = False
    # vLLM's structural tag (its JSON text, or the object): {"structures": [{"begin": ..., "schema": {...},
    # "end": ...}, ...], "triggers": [...]}. The output is free text, except that wherever it writes a
    # trigger, it goes on with the rest of one structure's begin, JSON matching that structure's schema, and
    # its end, then free text again. Held as that object once checked (xgrammar's and llguidance's rules, as
    # vLLM enforces them): at least one structure, non-empty triggers none of which starts another, and
    # every begin starting with a trigger.
    structural_tag: dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        if self.json is not None:
            self.json = self._normalise_schema(self.json)
        if self.structural_tag is not None:
            self.structural_tag = _normalise_structural_tag(self.structural_tag)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs {name} must be a non-empty str, got {_describe(value)}")
        if self.choice is not None:
            self.choice = SamplingParams._normalise_guided_choice(self.choice)
        _check_bool("structured_outputs json_object", self.json_object)
        _check_bool("structured_outputs disable_any_whitespace", self.disable_any_whitespace)
        kinds = self.kinds()
        if len(kinds) != 1:
            got = " and ".join(kinds) if kinds else "none"
            raise ValueError(f"structured_outputs must set exactly one of "
                             f"{', '.join(STRUCTURED_OUTPUT_KINDS)}; got {got}")

    def kinds(self) -> list[str]:
        """The constraint kinds set (json_object only when true)."""
        return [name for name in STRUCTURED_OUTPUT_KINDS if getattr(self, name) not in (None, False)]

    @property
    def kind(self) -> str:
        """The one constraint kind set."""
        return self.kinds()[0]

    @staticmethod
    def _normalise_schema(schema: Any) -> dict[str, Any]:
        if isinstance(schema, str):
            schema = _loads(schema, "structured_outputs json")
        if not isinstance(schema, dict):
            raise ValueError(f"structured_outputs json must be a JSON schema object, got {_describe(schema)}")
        return schema

    @classmethod
    def from_mapping(cls, value: Mapping[str, Any]) -> StructuredOutputsParams:
        """From a dict of the same fields (vLLM's LLM API accepts its own class only; a dict is handier)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"structured_outputs has unknown field(s) {', '.join(unknown)}")
        return cls(**value)


def _loads(text: str, name: str) -> Any:
    """JSON text a request gave for ``name``, or a ValueError naming it."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{name} is not valid JSON: {err}") from err


def _normalise_structural_tag(tag: Any) -> dict[str, Any]:
    """vLLM's structural tag (JSON text or the object) as {"structures": [...], "triggers": [...]}, each
    structure {"begin", "schema", "end"}; a ValueError names what is wrong. The checks are those vLLM's
    backends make: its pydantic model's types (begin, end and triggers strings), llguidance's (at least one
    structure, with a schema; no empty trigger) and xgrammar's (no trigger a prefix of another, every begin
    starting with a trigger)."""
    name = "structured_outputs structural_tag"
    if isinstance(tag, str):
        tag = _loads(tag, name)
    if not isinstance(tag, Mapping):
        raise ValueError(f"{name} must be an object with structures and triggers, got {_describe(tag)}")
    if tag.get("type", "structural_tag") != "structural_tag":
        raise ValueError(f"{name} type must be 'structural_tag', got {tag['type']!r}")
    if "structures" not in tag and "format" in tag:
        raise ValueError(f"{name}: the format form (xgrammar's structural tag format) is not supported by "
                         f"this server; give structures and triggers")
    for key in ("structures", "triggers"):
        if key not in tag:
            raise ValueError(f"{name} needs {key}")
    structures, triggers = tag["structures"], tag["triggers"]
    if not isinstance(structures, list) or not structures:
        raise ValueError(f"{name} structures must be a non-empty list, got {_describe(structures)}")
    if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError(f"{name} triggers must be a list of non-empty str, got {_describe(triggers)}")
    # xgrammar's check, as it makes it: sorted, a trigger that starts another starts the one after it (a
    # duplicate starts its twin).
    ordered = sorted(triggers)
    for shorter, longer in zip(ordered, ordered[1:]):
        if longer.startswith(shorter):
            raise ValueError(f"{name} triggers should not be mutually inclusive, but {shorter!r} is a prefix "
                             f"of {longer!r}")
    checked = []
    for i, structure in enumerate(structures):
        where = f"{name} structures[{i}]"
        if not isinstance(structure, Mapping):
            raise ValueError(f"{where} must be an object with begin, schema and end, got "
                             f"{_describe(structure)}")
        for key in ("begin", "end"):
            if not isinstance(structure.get(key), str):
                raise ValueError(f"{where} {key} must be a str, got {_describe(structure.get(key))}")
        schema = structure.get("schema")
        if not isinstance(schema, dict):
            raise ValueError(f"{where} schema must be a JSON schema object, got {_describe(schema)}")
        checked.append({"begin": structure["begin"], "schema": schema, "end": structure["end"]})
    tag = {"structures": checked, "triggers": triggers}
    for i, trigger in enumerate(structural_tag_triggers(tag)):
        if trigger is None:  # xgrammar's words
            raise ValueError(f"{name} structures[{i}] begin {checked[i]['begin']!r} does not match any "
                             f"trigger (it must start with one of the triggers)")
    return tag


def structural_tag_triggers(tag: Mapping[str, Any]) -> list[str | None]:
    """The trigger each structure's begin starts with (at most one does, none being a prefix of another),
    None where none does; in time linear in the structures, not their product with the triggers."""
    triggers = set(tag["triggers"])
    lengths = sorted({len(t) for t in triggers})
    return [next((s["begin"][:n] for n in lengths if s["begin"][:n] in triggers), None)
            for s in tag["structures"]]


@dataclass
class SamplingParams:
    """Sampling parameters for one request; see vLLM's SamplingParams for the meaning of each field."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_DISABLED
    min_p: float = 0.0
    seed: int | None = None
    # None means "up to max_model_len"; the engine resolves it.
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Number of top logprobs to return per sampled token (the sampled token's own logprob is always
    # returned when this is not None).
    logprobs: int | None = None
    # Logprobs of the prompt's own tokens (each given the tokens before it) with this many top
    # alternatives per position; the first prompt token has none. As vLLM, such a request computes
    # its whole prompt: no prefix-cache hit.
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    # vLLM's: whether a slow tokenizer's decode spaces out special tokens. plait detokenizes with fast
    # (tokenizers) tokenizers, whose decode has no such choice, as vLLM's fast-tokenizer path has none: the
    # text is the same either way. Accepted, so vLLM code that sets it runs.
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's detokenize: False leaves the output's text empty (token ids only), sparing the host the
    # detokenizer's work; stop strings need the text, so they need it True.
    detokenize: bool = True
    # Token id -> bias added to its logit before sampling (OpenAI's and vLLM's logit_bias); {} means None.
    logit_bias: dict[int, float] | None = None
    # vLLM's allowed_token_ids: only these ids may be sampled (None: any).
    allowed_token_ids: list[int] | None = None
    # vLLM's guided choice (structured_outputs choice): the output is exactly one of these strings,
    # each as the tokenizer encodes it on its own.
    guided_choice: list[str] | None = None
    # vLLM's structured outputs (JSON schema, JSON object, regex, grammar, choice, structural tag); a choice
    # is served as guided_choice, the others by a grammar the engine compiles with llguidance at add_request
    # (a choice too where it must wait for reasoning_end).
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's bad_words: none of these words is generated. Each is tokenized on its own, with and without a
    # leading space; a word's last token is banned wherever the output so far ends with its other tokens
    # (a one-token word: everywhere).
    bad_words: list[str] | None = None
    # The text that ends the model's reasoning (a reasoning parser's end tag, such as "</think>"): the
    # structured output or guided choice applies only once the output's last tokens are this text as the
    # tokenizer encodes it, so the model reasons freely first, as vLLM under --reasoning-parser. None: from
    # the first token.
    reasoning_end: str | None = None
    # vLLM's truncate_prompt_tokens: k keeps only the prompt's last k tokens (left truncation), -1 as many
    # as leave room for max_tokens (for one token where max_tokens is None); None keeps the whole prompt.
    # The engine truncates at add_request (it knows max_model_len); usage, echo and prompt_logprobs then
    # count and show the truncated prompt.
    truncate_prompt_tokens: int | None = None
    # vLLM's output_kind: every step's output, cumulative (the default) or as deltas, or only the final one
    # (what LLM.generate and the server's non-streamed requests ask for).
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # vLLM's extra_args: the request's own settings for custom logits processors (plait.logits_processor),
    # which read them; nothing in plait does. The server's vllm_xargs.
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")

        self.temperature = _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

        self.top_p = _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p:g}")

        _check_int("top_k", self.top_k)
        if self.top_k == _VLLM_TOP_K_DISABLED:
            self.top_k = TOP_K_DISABLED
        if self.top_k < 0:
            disabled = f"{TOP_K_DISABLED} or {_VLLM_TOP_K_DISABLED} to disable"
            raise ValueError(f"top_k must be >= 1 ({disabled}), got {self.top_k}")

        self.min_p = _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p:g}")

        _check_int("seed", self.seed, optional=True)

        _check_int("max_tokens", self.max_tokens, optional=True)
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")

        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)

        _check_bool("ignore_eos", self.ignore_eos)
        _check_bool("skip_special_tokens", self.skip_special_tokens)
        _check_bool("spaces_between_special_tokens", self.spaces_between_special_tokens)
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        _check_bool("detokenize", self.detokenize)
        if self.extra_args is not None and (not isinstance(self.extra_args, dict)
                                            or not all(isinstance(k, str) for k in self.extra_args)):
            raise ValueError(f"extra_args must be a dict with string keys, got {_describe(self.extra_args)}")
        if isinstance(self.output_kind, bool) or self.output_kind not in tuple(RequestOutputKind):
            kinds = ", ".join(f"{k.name} ({k.value})" for k in RequestOutputKind)
            raise ValueError(f"output_kind must be one of {kinds}, got {_describe(self.output_kind)}")
        self.output_kind = RequestOutputKind(self.output_kind)
        if not self.detokenize and self.stop:
            raise ValueError("stop strings need the output's text: detokenize must be true to use stop")

        for name in ("logprobs", "prompt_logprobs"):  # the upper bound is the engine's max_logprobs
            value = getattr(self, name)
            _check_int(name, value, optional=True)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be at least 0, got {value}")

        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -PENALTY_BOUND <= value <= PENALTY_BOUND:
                raise ValueError(f"{name} must be in [-{PENALTY_BOUND:g}, {PENALTY_BOUND:g}], got {value:g}")
            setattr(self, name, value)

        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty:g}")

        # Ids are checked against the model's vocabulary by the engine, which knows it.
        self.logit_bias = self._normalise_logit_bias(self.logit_bias)
        self.allowed_token_ids = self._normalise_allowed_token_ids(self.allowed_token_ids)
        self.guided_choice = self._normalise_guided_choice(self.guided_choice)
        self._resolve_structured_outputs()
        self.bad_words = self._normalise_bad_words(self.bad_words)
        end = self.reasoning_end
        if end is not None and (not isinstance(end, str) or not end):
            raise ValueError(f"reasoning_end must be a non-empty str or None, got {_describe(end)}")
        if self.guided_choice is not None and self.allowed_token_ids is not None:
            raise ValueError("guided_choice and allowed_token_ids cannot be combined")
        if self.structured_outputs is not None and self.allowed_token_ids is not None:
            raise ValueError("structured_outputs and allowed_token_ids cannot be combined")
        self._check_truncate_prompt_tokens()

    def _check_truncate_prompt_tokens(self) -> None:
        k = self.truncate_prompt_tokens
        _check_int("truncate_prompt_tokens", k, optional=True)
        if k is not None and k < 1 and k != TRUNCATE_TO_CONTEXT:
            # vLLM's words (its SamplingParams), with what -1 means
            raise ValueError(f"truncate_prompt_tokens must be >= 1, or -1 for as many as the context "
                             f"leaves room for; got {k}")

    def _resolve_structured_outputs(self) -> None:
        """Take a dict as StructuredOutputsParams, and serve its choice as guided_choice (which a copy made
        with dataclasses.replace already holds, so an equal guided_choice is no conflict)."""
        structured = self.structured_outputs
        if isinstance(structured, Mapping):
            structured = self.structured_outputs = StructuredOutputsParams.from_mapping(structured)
        if structured is None:
            return
        if not isinstance(structured, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams or a dict, "
                             f"got {_describe(structured)}")
        if structured.choice is None:
            if self.guided_choice is not None:
                raise ValueError("guided_choice and structured_outputs cannot both be set")
            return
        if self.guided_choice is not None and self.guided_choice != structured.choice:
            raise ValueError("guided_choice and structured_outputs.choice cannot both be set")
        self.guided_choice = list(structured.choice)

    @property
    def grammar_spec(self) -> StructuredOutputsParams | None:
        """The structured output a grammar serves: json, regex, grammar, json_object, structural_tag, and a
        choice that waits for the reasoning's end (only a grammar can wait); None for the other choices."""
        if self.guided_choice is None:
            return self.structured_outputs
        return StructuredOutputsParams(choice=self.guided_choice) if self.reasoning_end is not None else None

    @property
    def host_choices(self) -> list[str] | None:
        """guided_choice where the engine matches it on the host (not where a grammar serves it)."""
        return self.guided_choice if self.reasoning_end is None else None

    @staticmethod
    def _normalise_stop(stop: Any) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        elif isinstance(stop, (list, tuple)):
            stop = list(stop)
        else:
            raise ValueError(f"stop must be a str, a list of str or None, got {_describe(stop)}")
        for s in stop:
            if not isinstance(s, str):
                raise ValueError(f"stop must contain only strings, got {_describe(s)}")
            if not s:
                raise ValueError("stop must not contain an empty string, got ''")
        return stop

    @staticmethod
    def _normalise_stop_token_ids(ids: Any) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of int, got {_describe(ids)}")
        for t in ids:
            _check_int("stop_token_ids element", t)
            if t < 0:
                raise ValueError(f"stop_token_ids must be non-negative token ids, got {t}")
        return list(ids)

    @staticmethod
    def _normalise_logit_bias(bias: Any) -> dict[int, float] | None:
        if bias is None:
            return None
        if not isinstance(bias, Mapping):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {_describe(bias)}")
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias must have at most {MAX_LOGIT_BIAS_ENTRIES} entries, "
                             f"got {len(bias)}")
        normalised: dict[int, float] = {}
        for token_id, value in bias.items():
            _check_int("logit_bias token id", token_id)
            if token_id < 0:
                raise ValueError(f"logit_bias token ids must be non-negative, got {token_id}")
            normalised[token_id] = _check_bias(token_id, value)
        # Empty asks for nothing, so the sampler only has to look for None.
        return normalised or None

    @staticmethod
    def _normalise_guided_choice(choices: Any) -> list[str] | None:
        if choices is None:
            return None
        choices = _str_list("guided_choice", choices, MAX_GUIDED_CHOICES, "choices")
        if not choices or not all(choices):
            raise ValueError("guided_choice must hold at least one choice, and no empty string")
        return choices

    @staticmethod
    def _normalise_bad_words(words: Any) -> list[str] | None:
        if words is None:
            return None
        words = _str_list("bad_words", words, MAX_BAD_WORDS, "words")
        if not all(w.strip() for w in words):
            raise ValueError("bad_words must not hold an empty or blank word")
        return words or None

    @staticmethod
    def _normalise_allowed_token_ids(ids: Any) -> list[int] | None:
        if ids is None:
            return None
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"allowed_token_ids must be a list of int, got {_describe(ids)}")
        if not ids:
            # As vLLM: an empty list would allow nothing at all.
            raise ValueError("allowed_token_ids must not be empty (None allows every token)")
        if len(ids) > MAX_ALLOWED_TOKEN_IDS:
            raise ValueError(f"allowed_token_ids must have at most {MAX_ALLOWED_TOKEN_IDS} ids, "
                             f"got {len(ids)}")
        for t in ids:
            _check_int("allowed_token_ids element", t)
            if t < 0:
                raise ValueError(f"allowed_token_ids must be non-negative token ids, got {t}")
        return list(ids)

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature ~ 0)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS


# Each beam search step asks for 2 x beam_width candidates per beam (vLLM's), within the logprobs cap.
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams: ``LLM.beam_search`` keeps the ``beam_width`` most likely sequences of up to
    ``max_tokens`` tokens, ranked at the end by cumulative logprob over length ** ``length_penalty``.

    ``temperature`` is accepted for vLLM's signature only: candidates are the raw logprobs' top
    2 x beam_width, so it changes nothing (vLLM's can add one sampled candidate per beam)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        _check_int("beam_width", self.beam_width)
        if not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be in [1, {MAX_BEAM_WIDTH}], got {self.beam_width}")
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        _check_bool("ignore_eos", self.ignore_eos)
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        self.temperature = _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        self.length_penalty = _check_float("length_penalty", self.length_penalty)
