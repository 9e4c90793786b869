"""Pydantic models of the OpenAI-compatible API: requests (strictly typed), responses and errors."""

from __future__ import annotations

import base64
import io
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from plait.entrypoints.tools import named_tool_schema, required_tools_schema
from plait.multimodal.chat import TEXT_PART_SEPARATOR
from plait.pooling_params import score_pairs
from plait.sampling_params import (
    LOGIT_BIAS_BOUND,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_BEAM_WIDTH,
    MAX_GUIDED_CHOICES,
    MAX_LOGIT_BIAS_ENTRIES,
    PENALTY_BOUND,
    TRUNCATE_TO_CONTEXT,
    BeamSearchParams,
    SamplingParams,
    StructuredOutputsParams,
)

# Sequences one request may ask for: n at most OpenAI's own cap, and in all (prompts x n) a bound on
# what one HTTP body can queue; the engine admits them FCFS like any other requests. (Sampling many
# completions of a batch of prompts in one call, as RL rollouts do, is ordinary use: 64 prompts x 8.)
# The ids of stored Responses, as OpenAI's and vLLM's: this prefix, then a random hex string (a data-parallel
# replica's put its own tag between: plait.entrypoints.replica_router).
RESPONSE_ID_PREFIX = "resp_"
MAX_N = 128
MAX_SEQUENCES_PER_REQUEST = 4096
# Stop strings are checked against the text after every token, so their number is bounded.
MAX_STOP_STRINGS = 16
# OpenAI's default temperature / top_p when a request does not say.
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
# What a request that leaves these out gets where the model's generation_config.json does not say either
# (vLLM's _DEFAULT_SAMPLING_PARAMS).
SAMPLING_DEFAULTS: dict[str, Any] = {
    "temperature": DEFAULT_TEMPERATURE, "top_p": DEFAULT_TOP_P, "top_k": 0, "min_p": 0.0,
    "repetition_penalty": 1.0,
}
# OpenAI's and vLLM's max_tokens for /v1/completions that do not say. (Chat has none: it runs to the end
# of the context, as in vLLM.)
DEFAULT_COMPLETION_MAX_TOKENS = 16

# Fields of OpenAI's or vLLM's API that change what the output means and that plait does not implement,
# with what they ask for: a request that asks for one gets a 400 naming it, never plausible output that
# silently ignored it. (Fields plait has no use for but that change nothing, such as user, metadata,
# store or service_tier, are accepted and ignored.)
UNSUPPORTED_FIELDS: dict[str, str] = {
    "functions": "function calling (the legacy API; use tools)",
    "function_call": "function calling; only 'none' is supported",
    "logits_processors": "custom logits processors",
    "prompt_embeds": "prompt embeddings",
}
# Chat's tool fields, which /v1/completions does not serve (as OpenAI's completions have no tools).
# (Completions take prompt_embeds, under --enable-prompt-embeds.)
COMPLETION_UNSUPPORTED_FIELDS: dict[str, str] = {
    **{field: what for field, what in UNSUPPORTED_FIELDS.items() if field != "prompt_embeds"},
    "tools": "tool calling (a /v1/chat/completions feature)",
    "tool_choice": "tool calling (a /v1/chat/completions feature); only 'none' is supported",
}
# The same for the keys of structured_outputs beside its constraint (vLLM's; disable_fallback and the
# backend's name change nothing here and are ignored).
UNSUPPORTED_STRUCTURED_OUTPUTS_FIELDS: dict[str, str] = {
    "whitespace_pattern": "a whitespace pattern",
    "disable_additional_properties": "disabling additional properties",
}
# Fields beam search does not honour (vLLM's silently ignores them): beside use_beam_search, a value of one
# that asks for something is a 400 naming it, never an answer that ignored it. temperature and seed are
# accepted: the search is deterministic (see BeamSearchParams).
BEAM_SEARCH_UNSERVED_FIELDS = (
    "echo", "logprobs", "prompt_logprobs", "stop", "stop_token_ids", "min_tokens", "top_p", "top_k", "min_p",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids",
    "bad_words", "truncate_prompt_tokens",
)
# The values of those fields that ask for nothing, beside null, false and empty ones.
_BEAM_SEARCH_NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "top_p": (1.0,), "top_k": (0, -1), "min_p": (0.0,), "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,), "repetition_penalty": (1.0,), "min_tokens": (0,),
}
# vLLM's words for a streamed beam search on /v1/completions (its chat streams the finished beams instead).
BEAM_SEARCH_STREAM_MESSAGE = "Streaming is not currently supported with beam search"
# The values of tool_choice / function_call that ask for no tool.
_NO_TOOL = "none"
# The role of a chat answer under add_generation_prompt (vLLM's --response-role default).
RESPONSE_ROLE = "assistant"
# The field errors about forced tool calls' schemas name (they are the tools' parameters).
TOOLS_PARAM = "tools"
# response_format types: plain text, any JSON object, JSON matching a schema, or vLLM's structural tag (free
# text with JSON of a schema after each trigger).
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "structural_tag")


def _asks_for(name: str, value: Any) -> bool:
    """Whether an unsupported field's value asks for the feature (null, false, empty and "no" do not)."""
    if value is None or value is False or (isinstance(value, (list, dict, str)) and not value):
        return False
    if name in ("tool_choice", "function_call"):
        return value != _NO_TOOL
    return True


def _integral_float_to_int(value: Any) -> Any:
    # JSON Schema's "integer" includes 5.0, and some JSON encoders write whole numbers that way;
    # 5.5, true and "5" still fail the strict int check that follows.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# An int in a request: strict (no bools, no strings), but 5.0 counts as 5.
Int = Annotated[int, BeforeValidator(_integral_float_to_int)]
# Bounds in the schema mirror SamplingParams' checks, so clients (and fuzzers) can read them from
# /openapi.json; SamplingParams still checks everything again.
TokenId = Annotated[Int, Field(ge=0)]
Penalty = Annotated[float, Field(ge=-PENALTY_BOUND, le=PENALTY_BOUND)]
NumLogprobs = Annotated[Int, Field(ge=0)]  # at most the engine's max_logprobs, which it checks
PositiveInt = Annotated[Int, Field(ge=1)]
# logit_bias keys: JSON object keys are strings, OpenAI's hold token ids. ASCII digits only (int() would
# take " 1", "1_0" and other scripts' digits) and no leading zeros, so two keys never name one id; ten
# digits are more than any vocabulary needs. The engine checks the ids against the vocabulary.
LogitBiasKey = Annotated[str, Field(pattern=r"^(0|[1-9][0-9]{0,9})$")]
LogitBiasValue = Annotated[float, Field(ge=-LOGIT_BIAS_BOUND, le=LOGIT_BIAS_BOUND, allow_inf_nan=False)]
LogitBias = Annotated[dict[LogitBiasKey, LogitBiasValue], Field(max_length=MAX_LOGIT_BIAS_ENTRIES)]
AllowedTokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)]
GuidedChoice = Annotated[list[str], Field(min_length=1, max_length=MAX_GUIDED_CHOICES)]
BadWords = Annotated[list[str], Field(max_length=MAX_BAD_WORDS)]
# A JSON schema: the object, or (as vLLM's guided_json takes it too) its JSON text.
JsonSchema = dict[str, Any] | str
# vLLM's structural tag ({"structures": [...], "triggers": [...]}): its JSON text, as vLLM's structural_tag
# fields take it, or the object; StructuredOutputsParams checks it.
StructuralTag = dict[str, Any] | str


class ProtocolError(ValueError):
    """A request that is well-typed but cannot be served; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def _allows_null(prop: dict[str, Any]) -> bool:
    return prop.get("type") == "null" or any(alt.get("type") == "null" for alt in prop.get("anyOf", ()))


def _request_schema(schema: dict[str, Any]) -> None:
    """The JSON schema says what _null_means_default accepts: null for every optional field.

    Extra fields are accepted (and only looked at for unsupported features), which JSON schema already
    means when additionalProperties is absent; "true" would only invite fuzzers to invent them.
    """
    schema.pop("additionalProperties", None)
    required = set(schema.get("required", ()))
    properties = schema.get("properties", {})
    for name, prop in properties.items():
        if name in required or _allows_null(prop):
            continue
        outer = {k: v for k, v in prop.items() if k in ("title", "default", "description")}
        inner = {k: v for k, v in prop.items() if k not in outer}
        alternatives = inner["anyOf"] if list(inner) == ["anyOf"] else [inner]
        properties[name] = {**outer, "anyOf": [*alternatives, {"type": "null"}]}


def _one_required(*names: str) -> Callable[[dict[str, Any]], None]:
    """_request_schema, and the rule check_supported enforces: the body holds one of ``names`` at least (not
    null), so that clients (and fuzzers' valid cases) see that one of them is required."""
    def schema_of(schema: dict[str, Any]) -> None:
        _request_schema(schema)
        not_null = {"not": {"type": "null"}}
        schema["anyOf"] = [{"required": [name], "properties": {name: not_null}} for name in names]
    return schema_of


_input_or_messages_schema = _one_required("input", "messages")


def _has_default(model: type[BaseModel], name: str) -> bool:
    field = model.model_fields.get(name)
    return field is not None and not field.is_required() and field.default is not None


class _RequestModel(BaseModel):
    # Strict: "5" is not an int and true is not a number; a wrong type is a 400, never a guess.
    # Unknown fields are ignored, as OpenAI clients send fields this server has no use for.
    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra=_request_schema)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # OpenAI's spec marks optional fields nullable, and SDKs of other languages send null for "not
        # set": null takes the field's default. (Required fields still refuse it; a field whose default
        # is None keeps its null, which may mean something: see CompletionRequest.requested_max_tokens.)
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or not _has_default(cls, k)}


class StreamOptions(_RequestModel):
    # As vLLM's: stream_options at all (even {}) asks for the closing usage chunk unless include_usage
    # is false; continuous_usage_stats (with include_usage) puts the usage so far on every chunk.
    include_usage: bool = True
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_RequestModel):
    """response_format's json_schema (OpenAI's): the output is JSON matching ``schema``. It is always
    enforced, so ``strict`` changes nothing."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")  # "schema" would shadow pydantic's BaseModel.schema
    strict: bool | None = None


class StructuralTagStructure(_RequestModel):
    """One structure of a structural_tag response_format (vLLM's): after ``begin`` (which starts with one of
    the triggers), JSON matching ``schema``, then ``end``."""

    begin: str
    # Optional in vLLM's model too, but neither of its backends compiles a structure without one:
    # StructuredOutputsParams refuses it.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    end: str


class ResponseFormat(_RequestModel):
    # Any string, so that an unknown type gets a 400 naming the types served, not a pydantic enum error.
    type: str
    json_schema: JsonSchemaFormat | None = None
    # type structural_tag (vLLM's form of it): the structures, and the triggers that begin them.
    structures: list[StructuralTagStructure] | None = None
    triggers: list[str] | None = None
    # type structural_tag in xgrammar's format form (newer vLLM's), which this server does not serve: kept
    # only to refuse it by name.
    format: Any = None

    def structured_outputs(self) -> dict[str, Any] | None:
        """The StructuredOutputsParams fields it asks for (None: plain text)."""
        if self.type not in RESPONSE_FORMAT_TYPES:
            raise ProtocolError(f"response_format type {self.type!r} is not supported (only "
                                f"{', '.join(RESPONSE_FORMAT_TYPES)})", "response_format")
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":
            if self.json_schema is None:
                raise ProtocolError("response_format of type json_schema needs json_schema: {'name': ..., "
                                    "'schema': {...}}", "response_format")
            return {"json": self.json_schema.schema_}
        if self.type == "structural_tag":
            return {"structural_tag": self._structural_tag()}
        return None

    def _structural_tag(self) -> dict[str, Any]:
        if self.structures is None or self.triggers is None:
            if self.format is not None:
                raise ProtocolError("response_format of type structural_tag in the format form (xgrammar's "
                                    "structural tag format) is not supported by this server; give structures "
                                    "and triggers", "response_format")
            raise ProtocolError("response_format of type structural_tag needs structures: [{'begin': ..., "
                                "'schema': {...}, 'end': ...}] and triggers: [...]", "response_format")
        structures = [{"begin": s.begin, "schema": s.schema_, "end": s.end} for s in self.structures]
        return {"structures": structures, "triggers": self.triggers}


class StructuredOutputsRequest(_RequestModel):
    """vLLM's structured_outputs: one of json, regex, grammar, choice, json_object, structural_tag
    (SamplingParams checks that exactly one is set)."""

    # Extra keys are kept only so that check_supported can refuse the ones that change the output.
    model_config = ConfigDict(extra="allow")

    json_: JsonSchema | None = Field(default=None, alias="json")  # "json" would shadow BaseModel.json
    regex: str | None = None
    grammar: str | None = None  # Lark, or GBNF (text with "::=")
    choice: GuidedChoice | None = None
    json_object: bool | None = None
    structural_tag: StructuralTag | None = None
    disable_any_whitespace: bool = False

    def check_supported(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED_STRUCTURED_OUTPUTS_FIELDS and _asks_for(name, value):
                raise ProtocolError(f"structured_outputs.{name} is not supported by this server "
                                    f"({UNSUPPORTED_STRUCTURED_OUTPUTS_FIELDS[name]})", "structured_outputs")

    def structured_outputs(self) -> dict[str, Any] | None:
        """The StructuredOutputsParams fields it sets (None where it sets no constraint, as {})."""
        fields = {"json": self.json_, "regex": self.regex, "grammar": self.grammar, "choice": self.choice,
                  "json_object": self.json_object, "structural_tag": self.structural_tag}
        fields = {k: v for k, v in fields.items() if v is not None}
        if not fields:
            return None
        return {**fields, "disable_any_whitespace": self.disable_any_whitespace}


@dataclass(frozen=True)
class Admission:
    """How the engine admits a request's children, as its body asks (``admission`` of the request models):
    their rank under the priority policy, and the salt of their prefix-cache blocks."""

    priority: int = 0
    cache_salt: str | None = None


class _SamplingRequest(_RequestModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    # Extra fields are kept (and otherwise ignored) only so that check_supported can see them.
    model_config = ConfigDict(extra="allow")
    # The fields it refuses (check_supported).
    unsupported_fields: ClassVar[dict[str, str]] = UNSUPPORTED_FIELDS

    model: str | None = None  # None: the served model
    max_tokens: PositiveInt | None = None  # chat: None runs to the end of the context; completions: 16
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[Int, Field(ge=-1)] | None = None  # vLLM extension; 0 or -1 = off
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None  # vLLM extension
    seed: Int | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_STRINGS)] | None = None
    n: Int = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None  # vLLM extension
    ignore_eos: bool = False  # vLLM extension
    min_tokens: Int = Field(default=0, ge=0)  # vLLM extension
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # vLLM's; the same text either way (SamplingParams)
    # vLLM's vllm_xargs: the request's settings for custom logits processors (SamplingParams.extra_args).
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: LogitBias | None = None
    allowed_token_ids: AllowedTokenIds | None = None  # vLLM extension: only these ids may be sampled
    bad_words: BadWords | None = None  # vLLM extension: words never generated
    # vLLM extension: each prompt token's logprob and the top-n at its position (non-streamed answers only).
    prompt_logprobs: NumLogprobs | None = None
    # vLLM extension: the output is exactly one of these strings (also as structured_outputs' "choice").
    guided_choice: GuidedChoice | None = None
    # Structured outputs: OpenAI's response_format, and vLLM's guided_* and structured_outputs; a request
    # asks for one of them at most.
    response_format: ResponseFormat | None = None
    guided_json: JsonSchema | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None  # Lark, or GBNF (text with "::=")
    structural_tag: StructuralTag | None = None  # vLLM's older place for it (as guided_*)
    structured_outputs: StructuredOutputsRequest | None = None
    # vLLM extension: keep only the prompt's last k tokens (-1: as many as leave room for max_tokens); each
    # prompt of a batch alone, a chat's rendered prompt as a whole.
    truncate_prompt_tokens: Annotated[Int, Field(ge=TRUNCATE_TO_CONTEXT)] | None = None
    # vLLM's side to truncate from: only its default, the left (keeping the end), is served, so "right" is a
    # 400, never silently the other side.
    truncation_side: Literal["left"] | None = None
    # vLLM extension: logprobs name each token (chosen and alternatives) "token_id:<id>", which identifies
    # tokens whose text alone does not (a piece of a UTF-8 character, two ids of one text); None: the
    # server's --return-tokens-as-token-ids.
    return_tokens_as_token_ids: bool | None = None
    # vLLM extensions: beam search, n beams returned as n choices, ranked by cumulative logprob over length **
    # length_penalty.
    use_beam_search: bool = False
    length_penalty: Annotated[float, Field(allow_inf_nan=False)] = 1.0
    # vLLM extension: under --scheduling-policy priority, lower is served first (any other value is a 400
    # under other policies).
    priority: Int = 0
    # vLLM extension: the prefix cache is salted with this string (a secret per user or tenant, random and
    # long): the request's cached blocks serve only requests with the same salt, so no other user can time
    # cache hits to guess its prompt.
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    # vLLM extension: the response also gives the prompt's and the output's token ids (streamed: the prompt's
    # in the first chunk, each chunk's new ids in it).
    return_token_ids: bool | None = None
    # vLLM extension: the base of the response's id (under an X-Request-Id header, the header's; empty: a
    # fresh one).
    request_id: str | None = None
    user: str | None = None
    # Whether a streamed beam search is served (chat's, as vLLM's: the finished beams in one chunk each).
    streams_beam_search: ClassVar[bool] = True

    @property
    def admission(self) -> Admission:
        return Admission(self.priority, self.cache_salt)

    def check_supported(self) -> None:
        """Reject fields that are well-typed but that this server cannot honour."""
        if self.use_beam_search:
            self._check_beam_search()
        for name, value in (self.model_extra or {}).items():
            if name in self.unsupported_fields and _asks_for(name, value):
                what = self.unsupported_fields[name]
                raise ProtocolError(f"{name} is not supported by this server ({what})", name)
        # As vLLM: an empty stream_options without streaming asks for nothing.
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            raise ProtocolError("stream_options can only be set when stream is true", "stream_options")
        # Streamed chunks have no place for them: vLLM refuses any above 0 and ignores 0, which is refused
        # here too rather than silently ignored.
        if self.prompt_logprobs is not None and self.stream:
            raise ProtocolError("prompt_logprobs is not available when stream is true", "prompt_logprobs")
        if self.structured_outputs is not None:
            self.structured_outputs.check_supported()
        self._structured_request()

    def _check_beam_search(self) -> None:
        if self.stream and not self.streams_beam_search:
            raise ProtocolError(BEAM_SEARCH_STREAM_MESSAGE, "stream")
        if self.n > MAX_BEAM_WIDTH:  # each step asks for 2 x n candidates, within the logprobs cap
            raise ProtocolError(f"n (the beam width) must be at most {MAX_BEAM_WIDTH} with use_beam_search, "
                                f"got {self.n}", "n")
        for name in BEAM_SEARCH_UNSERVED_FIELDS:
            value = getattr(self, name, None)
            if _asks_for(name, value) and value not in _BEAM_SEARCH_NEUTRAL_VALUES.get(name, ()):
                raise ProtocolError(f"{name} is not supported with use_beam_search", name)
        asked = self._structured_request()
        if asked is not None:
            raise ProtocolError(f"{asked[0]} is not supported with use_beam_search", asked[0])

    def beam_search_params(self, max_tokens: int) -> BeamSearchParams:
        """The BeamSearchParams of a use_beam_search request (vLLM's to_beam_search_params): n beams."""
        return BeamSearchParams(beam_width=self.n, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
                                length_penalty=self.length_penalty,
                                include_stop_str_in_output=self.include_stop_str_in_output)

    def _structured_request(self) -> tuple[str, dict[str, Any]] | None:
        """The one structured output the request asks for: (the field that asks, StructuredOutputsParams
        fields), or None. Two fields asking is a ProtocolError naming the first (vLLM refuses it too)."""
        tag = self.structural_tag
        asked: dict[str, dict[str, Any] | None] = {
            "guided_choice": None if self.guided_choice is None else {"choice": self.guided_choice},
            "guided_json": None if self.guided_json is None else {"json": self.guided_json},
            "guided_regex": None if self.guided_regex is None else {"regex": self.guided_regex},
            "guided_grammar": None if self.guided_grammar is None else {"grammar": self.guided_grammar},
            "structural_tag": None if tag is None else {"structural_tag": tag},
            "response_format": self.response_format and self.response_format.structured_outputs(),
            "structured_outputs": self.structured_outputs and self.structured_outputs.structured_outputs(),
        }
        asking = [(name, fields) for name, fields in asked.items() if fields]
        if len(asking) > 1:
            (first, _), (second, _) = asking[:2]
            raise ProtocolError(f"{first} and {second} cannot both be set (a request asks for one structured "
                                f"output at most)", first)
        return asking[0] if asking else None

    @property
    def structured_outputs_param(self) -> str:
        """The field that asks for the request's structured output, which errors about it name (never
        raises: it names the field of an error _structured_request may have raised)."""
        fields = ("guided_choice", "guided_json", "guided_regex", "guided_grammar", "structural_tag",
                  "structured_outputs")
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format"
        return next((name for name in fields if getattr(self, name) is not None), "structured_outputs")

    @property
    def requested_prompt_logprobs(self) -> int | None:
        """How many alternatives the engine computes per prompt position (None: no prompt logprobs)."""
        return self.prompt_logprobs

    @property
    def max_tokens_param(self) -> str:
        """The field that sets the request's max_tokens, which errors about it name."""
        return "max_tokens"

    def include_usage(self, forced: bool = False) -> bool:
        """Whether a stream ends with a usage chunk: as stream_options asks, or always where ``forced``
        (vLLM's --enable-force-include-usage)."""
        return forced or (self.stream_options is not None and self.stream_options.include_usage)

    def continuous_usage(self, forced: bool = False) -> bool:
        # As vLLM: the usage so far on every chunk only where the closing usage chunk comes too.
        options = self.stream_options
        return options is not None and options.continuous_usage_stats and self.include_usage(forced)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """The engine's SamplingParams; raises ValueError naming the bad field.

        ``defaults`` (the model's generation_config.json, by SamplingParams name) fill the fields of
        SAMPLING_DEFAULTS that the request leaves out or sends as null, as vLLM's to_sampling_params.
        """
        defaults = defaults or {}

        def pick(name: str) -> Any:
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, SAMPLING_DEFAULTS[name])

        return SamplingParams(
            n=self.n,
            temperature=pick("temperature"),
            top_p=pick("top_p"),
            top_k=pick("top_k"),
            min_p=pick("min_p"),
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty"),
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            prompt_logprobs=self.requested_prompt_logprobs,
            guided_choice=self.guided_choice,
            structured_outputs=self._structured_outputs_params(),
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            extra_args=self.vllm_xargs,
        )

    def _structured_outputs_params(self) -> StructuredOutputsParams | None:
        asked = self._structured_request()
        if asked is None or asked[0] == "guided_choice":  # guided_choice is SamplingParams' own field
            return None
        return StructuredOutputsParams(**asked[1])


class CompletionRequest(_SamplingRequest):
    model_config = ConfigDict(json_schema_extra=_one_required("prompt", "prompt_embeds"))
    unsupported_fields: ClassVar[dict[str, str]] = COMPLETION_UNSUPPORTED_FIELDS
    streams_beam_search: ClassVar[bool] = False  # vLLM's completions refuse it

    # One prompt (text or token ids) or a batch of them; may be left out where prompt_embeds are given.
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]] | None = None
    # vLLM's (under --enable-prompt-embeds): one or more prompts as embeddings, each a base64 torch.save of a
    # [tokens, hidden] tensor (float32, bfloat16 or float16); they come before the prompt's in the batch.
    prompt_embeds: str | list[str] | None = None
    logprobs: NumLogprobs | None = None  # top-n logprobs per token
    echo: bool = False
    # 0 only with echo (OpenAI's and vLLM's): the prompt alone comes back, with its logprobs where asked.
    max_tokens: Annotated[Int, Field(ge=0)] | None = None
    best_of: Annotated[Int, Field(ge=1, le=MAX_N)] | None = None
    suffix: str | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        # Left out: 16, as OpenAI and vLLM. An explicit null runs to the end of the context, as vLLM
        # does (its own benchmark client sends null to lift the limit).
        if "max_tokens" not in self.model_fields_set:
            return DEFAULT_COMPLETION_MAX_TOKENS
        if self.echo_only:
            return 1  # the engine computes the prompt's logprobs on the way to one token, which is dropped
        return self.max_tokens

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the answer is the prompt alone (what scoring clients ask for)."""
        return self.echo and self.max_tokens == 0

    @property
    def requested_prompt_logprobs(self) -> int | None:
        # echo with logprobs lists the prompt's tokens with their logprobs too (what lm-evaluation-harness
        # scores loglikelihoods with), so the engine computes them, as vLLM does; with prompt_logprobs
        # also set, enough alternatives for both, each answer cut to its own n.
        if not (self.echo and self.logprobs is not None):
            return self.prompt_logprobs
        return max(self.logprobs, self.prompt_logprobs or 0)

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise ProtocolError("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise ProtocolError("best_of is not supported (it must be unset or equal to n)", "best_of")
        if self.max_tokens == 0 and not self.echo:  # (beam search refuses echo)
            message = "max_tokens must be at least 1 (0 only with echo: the prompt alone)"
            raise ProtocolError(message, "max_tokens")
        if self.prompt is None and self.prompt_embeds is None:
            raise ProtocolError("either prompt or prompt_embeds is required", "prompt")
        if self.prompt_embeds is not None and (self.echo or self.use_beam_search):
            raise ProtocolError("prompt_embeds cannot be used with echo or beam search: a prompt of "
                                "embeddings has no tokens", "prompt_embeds")

    def prompts(self) -> list[Any]:
        """The batch of prompts: the prompt_embeds' tensors first, then the prompt's texts or token ids (a
        single one is a batch of one; an empty prompt beside prompt_embeds is none)."""
        embeds = self.prompt_embeds
        batch: list[Any] = [decode_prompt_embeds(e) for e in ([embeds] if isinstance(embeds, str) else
                                                               embeds or [])]
        p = self.prompt
        if p is None or (batch and not p):  # vLLM's clients send prompt="" beside prompt_embeds
            return batch
        if isinstance(p, str):
            return [*batch, p]
        if not p or isinstance(p[0], int):
            return [*batch, list(p)]  # type: ignore[arg-type]
        return [*batch, *p]  # type: ignore[arg-type]


# The dtypes a prompt_embeds tensor may hold (vLLM's).
PROMPT_EMBEDS_DTYPES = ("float32", "bfloat16", "float16")


def decode_prompt_embeds(encoded: str) -> Any:
    """A prompt_embeds item as vLLM sends it: base64 of torch.save(tensor), read with weights_only (no code
    runs) into a [tokens, hidden] host tensor; a leading batch axis of one is dropped."""
    import torch  # the server's process has it; the protocol models import without it

    try:
        raw = base64.b64decode(encoded, validate=True)
        tensor = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except Exception as e:  # a bad base64 or pickle: the client's error, whatever torch raises for it
        raise ProtocolError(f"prompt_embeds is not a base64 torch.save of a tensor ({e})",
                            "prompt_embeds") from e
    dtype = str(getattr(tensor, "dtype", "")).removeprefix("torch.")
    if not isinstance(tensor, torch.Tensor) or dtype not in PROMPT_EMBEDS_DTYPES:
        raise ProtocolError(f"prompt_embeds must hold a tensor of {', '.join(PROMPT_EMBEDS_DTYPES)}",
                            "prompt_embeds")
    tensor = tensor.to_dense()
    if tensor.dim() == 3 and tensor.shape[0] == 1:
        tensor = tensor[0]
    return tensor


class TextContentPart(_RequestModel):
    type: Literal["text"]
    text: str


class ImageURL(_RequestModel):
    # a data URL (data:image/png;base64,...), or a file:// URL under --allowed-local-media-path: plait fetches
    # nothing from the network
    url: str
    detail: Literal["auto", "low", "high"] | None = None  # OpenAI's; an image model sees every image whole


class ImageContentPart(_RequestModel):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextContentPart | ImageContentPart, Field(discriminator="type")]


class FunctionCallParam(_RequestModel):
    name: str
    arguments: str  # JSON text, as the model wrote it

    def as_template_function(self) -> dict[str, Any]:
        """As HF chat templates (and vLLM) pass it: the arguments parsed, where they are a JSON object
        (templates write them with tojson or iterate their items); other text is passed as it is."""
        try:
            arguments = json.loads(self.arguments)
        except (json.JSONDecodeError, RecursionError):  # not JSON, or nested deeper than Python recurses
            arguments = None
        return {"name": self.name, "arguments": arguments if isinstance(arguments, dict) else self.arguments}


class ToolCallParam(_RequestModel):
    """A tool call of an earlier assistant message."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(_RequestModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # an assistant message's calls (its content may be null)
    tool_call_id: str | None = None  # a "tool" message: the call it answers

    def text(self) -> str:
        """The content as a template that takes text gets it, and as vLLM's chat echo repeats it: text parts
        joined by newlines (as vLLM's chat parser joins them), no content as ""."""
        if isinstance(self.content, list):
            return TEXT_PART_SEPARATOR.join(part.text for part in self.content if part.type == "text")
        return self.content or ""

    def as_template_message(self, keep_parts: bool = False) -> dict[str, Any]:
        """The message as the chat template expects it: its ``text()`` (``keep_parts``: the parts as
        OpenAI-style dicts, images included, for plait.multimodal.chat), tool calls with their arguments as
        objects."""
        content: str | list[dict[str, Any]] = self.text()
        if keep_parts and isinstance(self.content, list):
            content = [part.model_dump(exclude_none=True) for part in self.content]
        elif keep_parts and self.content is None:
            # No parts: "" for a template that takes text, [] for one that loops over them (as vLLM's).
            content = []
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": call.id, "type": call.type, "function": call.function.as_template_function()}
                for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(_RequestModel):
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments; None: any (no) arguments
    strict: bool | None = None  # named and "required" tool choices always enforce the schema


class ChatTool(_RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition

    def as_template_tool(self) -> dict[str, Any]:
        """As chat templates receive tools (OpenAI's shape, unset fields left out)."""
        f = self.function
        fields = {"name": f.name, "description": f.description, "parameters": f.parameters,
                  "strict": f.strict}
        return {"type": self.type, "function": {k: v for k, v in fields.items() if v is not None}}


class NamedFunction(_RequestModel):
    name: str


class NamedToolChoice(_RequestModel):
    """tool_choice naming one function: the answer is a call to it."""

    type: Literal["function"] = "function"
    function: NamedFunction


# tool_choice: no call, the model's choice (needs a tool call parser), at least one call, or a named one.
ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


# vLLM's chat reasoning_effort values.
ReasoningEffort = Literal["low", "medium", "high"]


class ChatTemplateRequest(_RequestModel):
    """The fields that make messages a prompt under the chat template: chat completions', which /tokenize
    takes too (as vLLM's TokenizeChatRequest), so it counts exactly the prompt a chat completion runs."""

    add_generation_prompt: bool = True  # vLLM extension
    # vLLM extensions: leave the last message open for the model to continue (an assistant prefill), a
    # Jinja template instead of the model's, and extra variables for the template (e.g. enable_thinking).
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: documents for a template that performs RAG (the template's ``documents``; each a dict, with
    # "title" and "text" as HF templates expect), and OpenAI's reasoning_effort, the template's
    # ``reasoning_effort`` (gpt-oss's reads it); chat_template_kwargs of the same names win over them.
    documents: list[dict[str, str]] | None = None
    reasoning_effort: ReasoningEffort | None = None
    # The functions the model may call, which the template lists whatever tool_choice says, as vLLM does,
    # unless the server has --exclude-tools-when-tool-choice-none and tool_choice is "none".
    tools: list[ChatTool] | None = None
    # Whether and which function the model must call (None: "auto" where tools are given, else "none", as
    # OpenAI and vLLM). Here because "none" may keep the tools out of the prompt (above), which /tokenize
    # must render alike; ChatCompletionRequest serves the rest of it.
    tool_choice: ToolChoice | None = None

    def template_variables(self) -> dict[str, Any]:
        """The template variables the request sets: its documents and reasoning_effort, then its
        chat_template_kwargs."""
        named = {"documents": self.documents, "reasoning_effort": self.reasoning_effort}
        return {**{k: v for k, v in named.items() if v is not None}, **(self.chat_template_kwargs or {})}

    def template_tools(self, exclude_when_none: bool = False) -> list[dict[str, Any]] | None:
        """The tools as the chat template receives them (None: no tools); ``exclude_when_none`` is the
        server's --exclude-tools-when-tool-choice-none, which leaves them out under tool_choice "none"
        (as vLLM, only where the request says "none" itself)."""
        if not self.tools or (exclude_when_none and self.tool_choice == _NO_TOOL):
            return None
        return [tool.as_template_tool() for tool in self.tools]

    def _check_text_or_messages(self, name: str, text: object, messages: object,
                                add_special_tokens: bool | None) -> None:
        """A body of text (field ``name``) or messages, exactly one: the template's own fields and a false
        add_special_tokens (the template writes them) go with messages only."""
        if (text is None) == (messages is None):
            raise ProtocolError(f"give either {name} or messages (one of them)", name)
        if messages is not None and add_special_tokens:
            raise ProtocolError("add_special_tokens is not supported with messages: the chat template "
                                "writes the special tokens", "add_special_tokens")
        used = [field for field in _MESSAGES_ONLY_FIELDS if text is not None and getattr(self, field)]
        if used:
            raise ProtocolError(f"{used[0]} applies to messages only, not to {name}", used[0])
        self._check_template_options()

    def _check_template_options(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise ProtocolError("continue_final_message and add_generation_prompt cannot both be true; set "
                                "add_generation_prompt to false to continue the final message",
                                "continue_final_message")


# The template's fields come first: pydantic merges the bases' model_config in order, and the sampling
# fields' (extra fields kept, for check_supported) must win.
class ChatCompletionRequest(ChatTemplateRequest, _SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: PositiveInt | None = None  # OpenAI's newer name for max_tokens; wins if both set
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    # Tool calling (tools and tool_choice are the template's): parallel_tool_calls false allows one call.
    parallel_tool_calls: bool | None = None
    # vLLM extension: the answer starts with the last message's content where that message's role is the
    # answer's (see echo_text).
    echo: bool = False
    # vLLM extension: false leaves the reasoning (split off by --reasoning-parser) out of the answer.
    include_reasoning: bool = True

    def check_supported(self) -> None:
        self._check_tools()  # before the structured output, which a forced tool call sets
        super().check_supported()
        self._check_template_options()
        if self.top_logprobs and not self.logprobs:
            raise ProtocolError("top_logprobs requires logprobs to be true", "top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def answer_role(self, response_role: str = RESPONSE_ROLE) -> str:
        """The answer's role, as vLLM's: the server's ``response_role`` (--response-role) where the template
        adds a generation prompt, else the last message's own role, since the answer continues it."""
        return response_role if self.add_generation_prompt else self.messages[-1].role

    def echo_text(self, response_role: str = RESPONSE_ROLE) -> str:
        """What echo puts before each choice's content, as vLLM: the last message's content where its role
        is the answer's role (answer_role), so that with continue_final_message the prefilled message
        comes back whole; "" otherwise."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == self.answer_role(response_role) else ""

    # -- tools ----------------------------------------------------------------------------------

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else _NO_TOOL

    @property
    def named_tool(self) -> str | None:
        """The function a named tool_choice calls (None: not named)."""
        choice = self.effective_tool_choice
        return choice.function.name if isinstance(choice, NamedToolChoice) else None

    @property
    def forces_tool_call(self) -> bool:
        """Whether tool_choice forces the answer to be calls (named or "required"), by a structured output."""
        return self.named_tool is not None or self.effective_tool_choice == "required"

    @property
    def max_tool_calls(self) -> int | None:
        return 1 if self.parallel_tool_calls is False else None

    def _check_tools(self) -> None:
        names = [tool.function.name for tool in self.tools or ()]
        if len(set(names)) < len(names):
            twice = next(name for i, name in enumerate(names) if name in names[:i])
            raise ProtocolError(f"tool names must be unique; '{twice}' is given twice", "tools")
        if self.effective_tool_choice != _NO_TOOL and not names:
            # vLLM's words
            raise ProtocolError("When using `tool_choice`, `tools` must be set.", "tool_choice")
        if self.named_tool is not None and self.named_tool not in names:
            raise ProtocolError(f"The tool specified in `tool_choice` ('{self.named_tool}') does not match "
                                f"any of the specified `tools`", "tool_choice")

    def _structured_request(self) -> tuple[str, dict[str, Any]] | None:
        asked = super()._structured_request()
        forced = self._forced_tool_schema()
        if forced is None:
            return asked
        if asked is not None:  # vLLM refuses a named tool_choice beside a structured output too
            raise ProtocolError(f"tool_choice {self._tool_choice_words()} and {asked[0]} cannot both be set "
                                f"(a forced tool call is a structured output)", "tool_choice")
        return TOOLS_PARAM, {"json": forced}

    def _forced_tool_schema(self) -> dict[str, Any] | None:
        functions = {tool.function.name: tool.function.parameters for tool in self.tools or ()}
        try:
            if self.named_tool is not None:
                return named_tool_schema(functions[self.named_tool])
            if self.effective_tool_choice == "required":
                return required_tools_schema(functions, parallel=self.parallel_tool_calls is not False)
        except ValueError as err:
            raise ProtocolError(str(err), TOOLS_PARAM) from err
        return None

    def _tool_choice_words(self) -> str:
        return f"naming '{self.named_tool}'" if self.named_tool is not None else '"required"'

    @property
    def structured_outputs_param(self) -> str:
        return TOOLS_PARAM if self.forces_tool_call else super().structured_outputs_param


# The chat template's fields that a /tokenize prompt (not messages) cannot use.
_MESSAGES_ONLY_FIELDS = ("tools", "tool_choice", "chat_template", "chat_template_kwargs",
                         "continue_final_message", "documents", "reasoning_effort")


class TokenizeRequest(ChatTemplateRequest):
    """vLLM's /tokenize: a prompt, or chat messages under the chat template (exactly one of them), the
    latter with chat completions' template fields (tools too), so a chat body's prompt can be counted.

    Unlike vLLM's, it reads tool_choice too: under --exclude-tools-when-tool-choice-none, "none" leaves the
    tools out here as in the chat completion of the same body (vLLM's /tokenize has no tool_choice and
    renders them, so its count would not be the prompt chat runs)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages (as vLLM)
    return_token_strs: bool = False

    def check_supported(self) -> None:
        self._check_text_or_messages("prompt", self.prompt, self.messages, self.add_special_tokens)


class DetokenizeRequest(_RequestModel):
    model: str | None = None
    tokens: list[TokenId]


# OpenAI's limit on the inputs of one /v1/embeddings request.
MAX_EMBEDDING_INPUTS = 2048


class PoolingBody(_RequestModel):
    """What every pooling endpoint takes beside its inputs (``inputs()``, each run once)."""

    model: str | None = None
    user: str | None = None
    # vLLM extensions: keep each input's last k tokens (-1: as many as the context holds); add the tokenizer's
    # special tokens (a BOS, an EOS) to text inputs.
    truncate_prompt_tokens: Annotated[Int, Field(ge=TRUNCATE_TO_CONTEXT)] | None = None
    add_special_tokens: bool | None = None  # None: true for text inputs, false for messages (as vLLM)
    priority: Int = 0  # vLLM extension, as the sampling requests' field
    request_id: str | None = None  # vLLM extension, as the sampling requests' field

    @property
    def admission(self) -> Admission:
        return Admission(self.priority)

    def inputs(self) -> list[str | list[int]]:
        raise NotImplementedError

    def check_supported(self) -> None:
        """Refuse combinations of fields (ProtocolError, a 400 naming the field)."""




class PoolingInputRequest(PoolingBody, ChatTemplateRequest):
    """What /v1/embeddings, /classify and /pooling take: an input or a batch of them, or (vLLM's chat form)
    messages, rendered under the chat template into one input."""

    model_config = ConfigDict(json_schema_extra=_input_or_messages_schema)

    # One input (text or token ids) or a batch of them, each pooled alone.
    input: str | list[TokenId] | list[str] | list[list[TokenId]] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_generation_prompt: bool = False  # a conversation is pooled as it stands (vLLM's pooling default)

    def check_supported(self) -> None:
        self._check_text_or_messages("input", self.input, self.messages, self.add_special_tokens)

    def inputs(self) -> list[str | list[int]]:
        """The batch of inputs: a single text or token-id input is a batch of one."""
        p = self.input
        if p is None:
            raise ProtocolError("messages are rendered under the chat template, not read as inputs", "input")
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        if not p:
            raise ProtocolError("input is empty: give a text, a list of token ids, or a list of them",
                                "input")
        if len(p) > MAX_EMBEDDING_INPUTS:
            raise ProtocolError(f"input has {len(p)} entries; at most {MAX_EMBEDDING_INPUTS} may be embedded "
                                "in one request", "input")
        return list(p)  # type: ignore[arg-type]


class EmbeddingRequest(PoolingInputRequest):
    """OpenAI's /v1/embeddings body, with vLLM's extensions (an embedding model's server)."""

    # "base64": each embedding's float32 values, little-endian, base64-encoded (the openai client's default).
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = None  # a Matryoshka model's shorter embedding
    normalize: bool | None = None  # vLLM extension: L2-normalise (None: the model's pooler decides)


class ClassificationRequest(PoolingInputRequest):
    """vLLM's /classify body (a classifier's server)."""


class PoolingRequest(PoolingInputRequest):
    """vLLM's /pooling body: each input's pooled output as the model's task makes it (an embedding model's
    vectors, a classifier's class probabilities)."""

    encoding_format: Literal["float", "base64"] = "float"
    # vLLM's: the pooling task (None: the model's own, embed or classify); token_embed / token_classify give
    # one row per input token.
    task: Literal["embed", "classify", "token_embed", "token_classify"] | None = None


class ScoreRequest(PoolingBody):
    """vLLM's /score body (an embedding model's server): how alike text_1's inputs are to text_2's (one text_1
    against every text_2, else in pairs)."""

    text_1: str | Annotated[list[str], Field(max_length=MAX_EMBEDDING_INPUTS)]
    text_2: str | Annotated[list[str], Field(max_length=MAX_EMBEDDING_INPUTS)]

    def sides(self) -> tuple[list[str], list[str]]:
        first = [self.text_1] if isinstance(self.text_1, str) else list(self.text_1)
        second = [self.text_2] if isinstance(self.text_2, str) else list(self.text_2)
        return first, second

    def inputs(self) -> list[str | list[int]]:
        first, second = self.sides()
        try:
            score_pairs(len(first), len(second))
        except ValueError as err:
            raise ProtocolError(str(err), "text_2") from None
        return [*first, *second]


class RerankRequest(PoolingBody):
    """The Jina / Cohere rerank body vLLM serves at /rerank, /v1/rerank and /v2/rerank: the documents ranked
    by how alike each is to the query."""

    query: str
    documents: Annotated[list[str], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    top_n: Int = Field(default=0, ge=0)  # the best n (0: all of them)

    def inputs(self) -> list[str | list[int]]:
        return [self.query, *self.documents]


class LoadLoRAAdapterRequest(_RequestModel):
    """vLLM's /v1/load_lora_adapter: serve the PEFT adapter at lora_path under the model name lora_name."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(_RequestModel):
    """vLLM's /v1/unload_lora_adapter: stop serving the adapter named lora_name."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's; the name alone decides here


# -- responses ---------------------------------------------------------------------------------


def _now() -> int:
    return int(time.time())


class ReloadWeightsRequest(BaseModel):
    """POST /reload_weights (development mode): the checkpoint to load, else the served model's own."""

    path: str | None = None


class CollectiveRpcRequest(BaseModel):
    """POST /collective_rpc (development mode): a worker method run on every rank (LLM.collective_rpc)."""

    method: str
    timeout: float | None = None
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV the prefix cache held


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # Under --enable-prompt-tokens-details (vLLM's), as OpenAI's: how much of the prompt was cached.
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


def _is_none(value: Any) -> bool:
    return value is None


# A response field left out where it is None (as OpenAI and vLLM leave out tool_calls and a delta's unset
# parts, which clients accumulate with +=).
Omitted = Field(default=None, exclude_if=_is_none)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM extension: the stop string or token id that ended it
    # vLLM extension (return_token_ids): the choice's prompt ids (a stream's first chunk of it) and its
    # output's ids (a stream's chunk: those new since the last chunk).
    prompt_token_ids: list[int] | None = Omitted
    token_ids: list[int] | None = Omitted


class PromptLogprob(BaseModel):
    """vLLM's Logprob, as in its prompt_logprobs."""

    logprob: float
    rank: int | None = None  # 1-based: how many ids have a logprob >= its own (1 = the most likely)
    decoded_token: str | None = None


# vLLM's prompt_logprobs: one entry per prompt token, None for the first (it has no context), else the
# prompt token and the top-n at its position by token id (JSON object keys: the ids as strings).
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionResponseChoice(CompletionChoice):
    prompt_logprobs: PromptLogprobs | None = None  # vLLM extension (non-streamed only)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(ChatTokenLogprob):
    top_logprobs: list[ChatTokenLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobEntry] | None = None



class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatResponseMessage(BaseModel):
    role: str = RESPONSE_ROLE  # ChatCompletionRequest.answer_role
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = Omitted


class ReasoningChatResponseMessage(ChatResponseMessage):
    """The message under --reasoning-parser: vLLM's ``reasoning`` beside the answer, null where there is none
    (or the request's include_reasoning is false)."""

    reasoning: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ReasoningChatResponseMessage | ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = Omitted  # vLLM extension (return_token_ids): the output's ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None  # vLLM extension: of the one prompt all choices share
    prompt_token_ids: list[int] | None = Omitted  # vLLM extension (return_token_ids): that prompt's ids


class DeltaFunctionCall(BaseModel):
    name: str | None = Omitted  # in a call's first delta
    arguments: str | None = Omitted  # the next piece of the arguments' JSON text


class DeltaToolCall(BaseModel):
    """A piece of one tool call: the first of a call has its id, type and name, and the ones after add to
    its arguments."""

    index: int
    id: str | None = Omitted
    type: Literal["function"] | None = Omitted
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: str | None = None  # in a choice's first chunk: ChatCompletionRequest.answer_role
    content: str | None = None
    reasoning: str | None = Omitted  # vLLM's: the next piece of the reasoning (--reasoning-parser)
    tool_calls: list[DeltaToolCall] | None = Omitted


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = Omitted  # vLLM extension (return_token_ids): the ids new in this chunk


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = Omitted  # vLLM extension (return_token_ids): in the first chunk


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # a str with encoding_format "base64"


class _PoolingResponse(BaseModel):
    """A pooling endpoint's answer: a list of ``data`` (one per input, in input order) and the usage."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str
    usage: UsageInfo


class EmbeddingResponse(_PoolingResponse):
    data: list[EmbeddingData]


class PoolingData(BaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | list[list[float]] | str  # a str with encoding_format "base64"; a matrix per token


class PoolingResponse(_PoolingResponse):
    data: list[PoolingData]


class ClassificationData(BaseModel):
    index: int
    label: str  # the most probable label's name (the config's id2label)
    probs: list[float]
    num_classes: int


class ClassificationResponse(_PoolingResponse):
    data: list[ClassificationData]


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(_PoolingResponse):
    data: list[ScoreData]


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int  # the document's index in the request
    document: RerankDocument
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]  # best first


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "plait"
    root: str | None = None  # as vLLM's: the base model's source, or a LoRA adapter's folder
    parent: str | None = None  # as vLLM's: a LoRA adapter's base model (its served name); None for a base
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
