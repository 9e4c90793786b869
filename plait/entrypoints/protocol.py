"""Pydantic models of the OpenAI-compatible API: requests (strictly typed), responses and errors."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from plait.sampling_params import MAX_LOGPROBS, PENALTY_BOUND, SamplingParams

# Sequences one request may ask for (n), and in all (prompts x n): a single HTTP request must not be
# able to fill the engine on its own.
MAX_N = 16
MAX_SEQUENCES_PER_REQUEST = 64
# Stop strings are checked against the text after every token, so their number is bounded.
MAX_STOP_STRINGS = 16
# OpenAI's default temperature / top_p when a request does not say.
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0




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
NumLogprobs = Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)]
PositiveInt = Annotated[Int, Field(ge=1)]


class ProtocolError(ValueError):
    """A request that is well-typed but cannot be served; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class _RequestModel(BaseModel):
    # Strict: "5" is not an int and true is not a number; a wrong type is a 400, never a guess.
    # Unknown fields are ignored, as OpenAI clients send fields this server has no use for.
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_RequestModel):
    include_usage: bool = False


class _SamplingRequest(_RequestModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None  # None: the served model
    max_tokens: PositiveInt | None = None  # None: up to the end of the context
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
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def check_supported(self) -> None:
        """Reject fields that are well-typed but that this server cannot honour."""
        if self.logit_bias:
            raise ProtocolError("logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise ProtocolError("stream_options can only be set when stream is true", "stream_options")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The engine's SamplingParams; raises ValueError naming the bad field."""
        return SamplingParams(
            n=self.n,
            temperature=DEFAULT_TEMPERATURE if self.temperature is None else self.temperature,
            top_p=DEFAULT_TOP_P if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


class CompletionRequest(_SamplingRequest):
    # One prompt (text or token ids) or a batch of them.
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    logprobs: NumLogprobs | None = None  # top-n logprobs per token
    echo: bool = False
    best_of: Annotated[Int, Field(ge=1, le=MAX_N)] | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise ProtocolError("echo is not supported", "echo")
        if self.suffix:
            raise ProtocolError("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise ProtocolError("best_of is not supported (it must be unset or equal to n)", "best_of")

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: a single text or token-id prompt is a batch of one."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p or isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ContentPart(_RequestModel):
    type: Literal["text"]
    text: str


class ChatMessage(_RequestModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def as_template_message(self) -> dict[str, str]:
        """The message as the chat template expects it: text parts joined, no content as ""."""
        content = self.content
        if content is None:
            content = ""
        elif isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: PositiveInt | None = None  # OpenAI's newer name for max_tokens; wins if both set
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    add_generation_prompt: bool = True  # vLLM extension

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise ProtocolError("top_logprobs requires logprobs to be true", "top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# -- responses ---------------------------------------------------------------------------------


def _now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM extension: the stop string or token id that ended it


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
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


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "plait"
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
