"""The Responses API (/v1/responses), as vLLM serves it: each request runs as the chat completion of its
conversation, and its answer is read back as output items."""

from __future__ import annotations

import itertools
import json
import time
import typing
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from plait.entrypoints.async_engine import RequestStream, RequestTimeoutError
from plait.entrypoints.errors import APIError, bad_request, error_type
from plait.entrypoints.metrics import RequestTracker
from plait.entrypoints.protocol import (
    MAX_STOP_STRINGS,
    ChatCompletionRequest,
    ChatLogprobEntry,
    ChatMessage,
    DeltaToolCall,
    Int,
    NumLogprobs,
    PositiveInt,
    ProtocolError,
    ReasoningEffort,
    _asks_for,
    _RequestModel,
)
from plait.entrypoints.server import (
    _ENGINE_ERROR_STATUS,
    _ENGINE_ERRORS,
    _ERROR_RESPONSES,
    CLIENT_CLOSED_REQUEST,
    OpenAIServer,
    _chat_delta,
    _ChoiceReader,
    _new_logprobs,
)
from plait.lora.request import LoRARequest
from plait.outputs import RequestOutput
from plait.sampling_params import TRUNCATE_TO_CONTEXT, SamplingParams

# Ids as OpenAI's and vLLM's: a prefix per kind of object, then a random hex string (a response's:
# RESPONSE_ID_PREFIX, ServerConfig.response_id_prefix).
MESSAGE_ID_PREFIX = "msg_"
REASONING_ID_PREFIX = "rs_"
FUNCTION_CALL_ID_PREFIX = "fc_"
# Responses kept for GET and previous_response_id (store, OpenAI's default true), in memory: beyond this many,
# the least recently used is forgotten. vLLM keeps every one (and warns of the leak).
MAX_STORED_RESPONSES = 1024
# The one include value this server can fill: the output text's logprobs (top_logprobs alternatives each).
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Content parts that hold text: a message's input_text, an earlier answer's output_text (and chat's "text").
TEXT_PART_TYPES = ("input_text", "output_text", "text")
IMAGE_PART_TYPE = "input_image"
# The function tools the model calls; built-in tools (web_search, file_search, code_interpreter, ...) run on
# OpenAI's side, which this server is not.
FUNCTION_TOOL = "function"
# text.format types: plain text, any JSON object, or JSON matching a schema.
TEXT_FORMAT_TYPES = ("text", "json_object", "json_schema")
# The name a json_schema text format gets where it gives none (chat's response_format needs one).
DEFAULT_SCHEMA_NAME = "response"
# Chat templates know system, not developer, which OpenAI ranks alike.
DEVELOPER_ROLE = "developer"
SYSTEM_ROLE = "system"
ASSISTANT_ROLE = "assistant"
TOOL_ROLE = "tool"
# reasoning.effort "none" turns thinking off where the chat template has the switch (vLLM's mapping).
NO_REASONING_EFFORT = "none"
THINKING_OFF = {"enable_thinking": False}
# OpenAI's reason for an answer cut short (max_output_tokens, or the end of the context).
INCOMPLETE_REASON = "max_output_tokens"
# The error code of a response that failed while generating (an engine error, or a grammar that cannot go on).
SERVER_ERROR_CODE = "server_error"
# vLLM's words for cancelling a response that is not running in the background (here, every one).
CANCEL_MESSAGE = "Cannot cancel a synchronous response."
# Fields of OpenAI's Responses API that this server cannot honour, with what they ask for: a request that asks
# for one gets a 400 naming it (metadata, user, service_tier, prompt_cache_key, safety_identifier,
# stream_options and text.verbosity change nothing here and are accepted).
UNSUPPORTED_FIELDS: dict[str, str] = {
    "background": "background responses; send the request without it",
    "prompt": "prompt templates",
    "conversation": "conversations; chain responses with previous_response_id",
}
# What a chat completion's errors name, as the Responses API names it.
_RESPONSES_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text",
                     "logprobs": "include"}
# The event a stream ends with, by the response's status.
_TERMINAL_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete",
                    "failed": "response.failed"}

ItemStatus = Literal["in_progress", "completed", "incomplete"]
ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed"]
# A stream event: its type and fields (the stream numbers it).
Event = dict[str, Any]


def _random_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


# -- requests ------------------------------------------------------------------------------------


class ContentPart(_RequestModel):
    """A part of a message's content: text, or (for an image model) an ``input_image`` given inline."""

    type: str
    text: str | None = None
    image_url: str | None = None  # input_image's: a data URL (plait fetches nothing)

    def as_chat_part(self) -> dict[str, Any]:
        """The part as chat completions take it (an image_url part, or text)."""
        if self.type == IMAGE_PART_TYPE:
            if self.image_url is None:
                raise ProtocolError("an input_image part needs its image_url (a data URL); file_id is not "
                                    "supported by this server", "input")
            return {"type": "image_url", "image_url": {"url": self.image_url}}
        return {"type": "text", "text": self.as_text()}

    def as_text(self) -> str:
        if self.type not in TEXT_PART_TYPES or self.text is None:
            raise ProtocolError(f"input content of type '{self.type}' is not supported here (text: "
                                f"{', '.join(TEXT_PART_TYPES[:2])}; an image model's messages: "
                                f"{IMAGE_PART_TYPE})", "input")
        return self.text


def _chat_content(content: str | list[ContentPart]) -> str | list[dict[str, Any]]:
    """A message's content for chat: its text joined, or its parts where it holds an image."""
    if isinstance(content, str) or all(part.type != IMAGE_PART_TYPE for part in content):
        return _text_of(content)
    return [part.as_chat_part() for part in content]


def _text_of(content: str | list[ContentPart]) -> str:
    # Parts joined as chat joins them for the template.
    return content if isinstance(content, str) else "".join(part.as_text() for part in content)


class InputMessage(_RequestModel):
    """A message: the user's, the system's or developer's, or an earlier answer (its output_text)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]


class InputFunctionCall(_RequestModel):
    """A function call an earlier answer made."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text


class InputFunctionCallOutput(_RequestModel):
    """A function call's result."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]


class InputReasoning(_RequestModel):
    """An earlier answer's reasoning: accepted and left out, as chat templates leave earlier turns' out."""

    type: Literal["reasoning"]


class InputOther(_RequestModel):
    """Any other item (item_reference, built-in tools' calls...): refused, naming its type."""

    type: str


_ITEM_KINDS = ("message", "function_call", "function_call_output", "reasoning")


def _item_kind(value: Any) -> str | None:
    """Which model an input item is: by its type (an easy input message may leave it out)."""
    kind = (value.get("type") or "message") if isinstance(value, dict) else getattr(value, "type", None)
    if not isinstance(kind, str):
        return None  # not an item at all: pydantic says so
    return kind if kind in _ITEM_KINDS else "other"


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[InputFunctionCall, Tag("function_call")]
    | Annotated[InputFunctionCallOutput, Tag("function_call_output")]
    | Annotated[InputReasoning, Tag("reasoning")]
    | Annotated[InputOther, Tag("other")],
    Discriminator(_item_kind, custom_error_type="input_item",
                  custom_error_message="an input item is an object: a message or an item with a type")]
_INPUT_ITEM: TypeAdapter[Any] = TypeAdapter(InputItem)


def conversation_messages(items: Sequence[Any]) -> list[ChatMessage]:
    """Input items as chat messages: a function call joins the assistant message before it (the answer that
    made it, as chat has it), and its output is a tool message."""
    messages: list[ChatMessage] = []
    for item in items:
        if isinstance(item, InputMessage):
            role = SYSTEM_ROLE if item.role == DEVELOPER_ROLE else item.role
            content = _chat_content(item.content)
            messages.append(ChatMessage.model_validate({"role": role, "content": content}))
        elif isinstance(item, InputFunctionCall):
            call = {"id": item.call_id, "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last.role == ASSISTANT_ROLE:
                calls = [c.model_dump() for c in last.tool_calls or ()]
                messages[-1] = ChatMessage.model_validate({**last.model_dump(), "tool_calls": [*calls, call]})
            else:
                messages.append(ChatMessage.model_validate({"role": ASSISTANT_ROLE, "tool_calls": [call]}))
        elif isinstance(item, InputFunctionCallOutput):
            content = _text_of(item.output)
            messages.append(ChatMessage(role=TOOL_ROLE, tool_call_id=item.call_id, content=content))
        elif isinstance(item, InputOther):
            raise ProtocolError(f"input items of type '{item.type}' are not supported by this server (only "
                                f"{', '.join(_ITEM_KINDS)})", "input")
    return messages


class ResponsesTool(_RequestModel):
    """A tool, in the Responses API's flat form (chat's nested one is read too, as vLLM reads it)."""

    type: str
    name: Annotated[str, Field(min_length=1)] | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted; only named and "required" tool choices enforce the schema

    @model_validator(mode="before")
    @classmethod
    def _flatten(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("function"), dict) and "name" not in data:
            return {"type": data.get("type"), **data["function"]}
        return data

    def check_supported(self) -> None:
        if self.type != FUNCTION_TOOL:
            raise ProtocolError(f"tools of type '{self.type}' are not supported by this server (only "
                                f"function tools; built-in tools run on OpenAI's side)", "tools")
        if self.name is None:
            raise ProtocolError("a function tool needs a name", "tools")

    def echo(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)

    def as_chat_tool(self) -> dict[str, Any]:
        fields = {"name": self.name, "description": self.description, "parameters": self.parameters,
                  "strict": self.strict}
        return {"type": FUNCTION_TOOL, "function": {k: v for k, v in fields.items() if v is not None}}


class ResponsesToolChoice(_RequestModel):
    """tool_choice naming a function: {"type": "function", "name": ...}."""

    type: str
    name: str | None = None

    def check_supported(self) -> None:
        if self.type != FUNCTION_TOOL or self.name is None:
            raise ProtocolError(f"tool_choice of type '{self.type}' is not supported by this server (only "
                                f"\"none\", \"auto\", \"required\" or {{\"type\": \"function\", "
                                f"\"name\": ...}})", "tool_choice")


class TextFormat(_RequestModel):
    type: str
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # "schema" would shadow BaseModel's
    strict: bool | None = None  # the schema is always enforced

    def as_response_format(self) -> dict[str, Any] | None:
        """Chat's response_format for it (None: plain text)."""
        if self.type not in TEXT_FORMAT_TYPES:
            raise ProtocolError(f"text.format type {self.type!r} is not supported (only "
                                f"{', '.join(TEXT_FORMAT_TYPES)})", "text")
        if self.type == "json_schema":
            if self.schema_ is None:
                raise ProtocolError("text.format of type json_schema needs a schema", "text")
            return {"type": self.type, "json_schema": {"name": self.name or DEFAULT_SCHEMA_NAME,
                                                       "schema": self.schema_, "strict": self.strict}}
        return None if self.type == "text" else {"type": self.type}


class TextConfig(_RequestModel):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted; changes nothing here


class ReasoningConfig(_RequestModel):
    # "none" turns thinking off (chat_template_kwargs enable_thinking false); "low", "medium" and "high" are
    # the chat template's reasoning_effort (gpt-oss's reads it); other values change nothing here.
    effort: str | None = None
    summary: str | None = None  # accepted; the reasoning comes whole, never summarised
    generate_summary: str | None = None


class ResponsesRequest(_RequestModel):
    """POST /v1/responses: OpenAI's fields, with vLLM's sampling extensions."""

    # Extra fields are kept (and otherwise ignored) only so that check_supported can see them.
    model_config = ConfigDict(extra="allow")

    input: str | list[InputItem]
    model: str | None = None
    instructions: str | None = None  # a system message first (not carried on by previous_response_id)
    max_output_tokens: PositiveInt | None = None  # None: to the end of the context, as chat
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice | None = None  # None: "auto"
    parallel_tool_calls: bool | None = None  # None: true
    max_tool_calls: PositiveInt | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None
    top_logprobs: NumLogprobs | None = None
    store: bool = True
    stream: bool = False
    previous_response_id: str | None = None
    # "auto" keeps the conversation's last tokens that leave room for the answer (vLLM's truncation).
    truncation: Literal["auto", "disabled"] | None = None
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None
    user: str | None = None
    service_tier: str | None = None
    # vLLM's extensions, as chat completions take them.
    top_k: Annotated[Int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    seed: Int | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Int = 0
    cache_salt: Annotated[str, Field(min_length=1)] | None = None  # as the chat request's

    def check_supported(self) -> None:
        """Reject what is well-typed but that this server cannot honour."""
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED_FIELDS and _asks_for(name, value):
                what = UNSUPPORTED_FIELDS[name]
                raise ProtocolError(f"{name} is not supported by this server ({what})", name)
        for value in self.include or ():
            if value != LOGPROBS_INCLUDE:
                raise ProtocolError(f"include value {value!r} is not supported by this server (only "
                                    f"{LOGPROBS_INCLUDE!r})", "include")
        for tool in self.tools or ():
            tool.check_supported()
        if isinstance(self.tool_choice, ResponsesToolChoice):
            self.tool_choice.check_supported()

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())

    def input_items(self) -> list[Any]:
        if isinstance(self.input, str):
            return [InputMessage(role="user", content=self.input)]
        return list(self.input)

    def chat_request(self, items: Sequence[Any]) -> ChatCompletionRequest:
        """The chat completion this request runs: the conversation's items as messages, the instructions
        first."""
        messages = conversation_messages(items)
        if self.instructions:
            messages.insert(0, ChatMessage(role=SYSTEM_ROLE, content=self.instructions))
        if not messages:
            raise ProtocolError("input holds no message", "input")
        choice = self.tool_choice
        if isinstance(choice, ResponsesToolChoice):
            choice = {"type": FUNCTION_TOOL, "function": {"name": choice.name}}
        elif choice in ("auto", "none") and not self.tools:
            choice = None  # asks for nothing (chat refuses a tool_choice without tools)
        text_format = self.text.format if self.text is not None else None
        effort = self.reasoning.effort if self.reasoning is not None else None
        fields = {
            "model": self.model, "messages": messages, "max_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "seed": self.seed, "stop": self.stop, "repetition_penalty": self.repetition_penalty,
            "ignore_eos": self.ignore_eos, "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output, "stream": self.stream,
            "tools": [tool.as_chat_tool() for tool in self.tools] if self.tools else None,
            "tool_choice": choice, "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": text_format.as_response_format() if text_format is not None else None,
            "logprobs": self.wants_logprobs,
            "top_logprobs": self.top_logprobs if self.wants_logprobs else None,
            "truncate_prompt_tokens": TRUNCATE_TO_CONTEXT if self.truncation == "auto" else None,
            "chat_template_kwargs": THINKING_OFF if effort == NO_REASONING_EFFORT else None,
            "reasoning_effort": effort if effort in typing.get_args(ReasoningEffort) else None,
            "user": self.user, "priority": self.priority, "cache_salt": self.cache_salt,
        }
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as err:  # what the types above already rule out, but for a chat-only rule
            raise ProtocolError(f"invalid request: {err.errors()[0].get('msg', '')}", "input") from err

    def echoed_tool_choice(self) -> str | dict[str, Any]:
        choice = self.tool_choice
        if isinstance(choice, ResponsesToolChoice):
            return choice.model_dump(exclude_none=True)
        return choice or "auto"


# -- responses -----------------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[ChatLogprobEntry] = Field(default_factory=list)  # with include's LOGPROBS_INCLUDE


class OutputMessage(BaseModel):
    id: str = Field(default_factory=lambda: _random_id(MESSAGE_ID_PREFIX))
    type: Literal["message"] = "message"
    role: Literal["assistant"] = ASSISTANT_ROLE
    status: ItemStatus = "in_progress"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class OutputReasoning(BaseModel):
    """The model's reasoning (vLLM's reasoning item: the text itself in content, no summary)."""

    id: str = Field(default_factory=lambda: _random_id(REASONING_ID_PREFIX))
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: ItemStatus = "in_progress"


class OutputFunctionCall(BaseModel):
    id: str = Field(default_factory=lambda: _random_id(FUNCTION_CALL_ID_PREFIX))
    type: Literal["function_call"] = "function_call"
    call_id: str  # what the call's function_call_output names
    name: str
    arguments: str = ""  # JSON text
    status: ItemStatus = "in_progress"


OutputItem = Annotated[OutputMessage | OutputReasoning | OutputFunctionCall, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens found in the prefix cache


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # tokens generated before the answer began (under --reasoning-parser)


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: str = INCOMPLETE_REASON


class ResponseError(BaseModel):
    code: str
    message: str


class ResponsesResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: ResponseStatus
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: str = "auto"
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_logprobs: int | None = None
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    background: bool = False


def _status(finish_reason: str | None) -> ResponseStatus:
    if finish_reason == "length":
        return "incomplete"
    return "failed" if finish_reason == "error" else "completed"


# -- the answer as output items ----------------------------------------------------------------


def _event(type_: str, **fields: Any) -> Event:
    return {"type": type_, **fields}


def _dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")


class OutputBuilder:
    """One answer's output items, built from its engine outputs as they come, and the stream events that tell
    each step in OpenAI's order (an item added, its part added, deltas, the text done, the part done, the item
    done). The chat path reads the output (reasoning split off, tool calls parsed), so the text is chat's.

    Reasoning comes first and ends where the answer begins; the message opens at the first text and stays
    open to the end (text that follows calls, such as a cut-short call's, joins it); a call ends where the
    next begins.
    """

    def __init__(self, reader: _ChoiceReader,
                 logprobs: Callable[[Sequence[Any]], list[ChatLogprobEntry]] | None = None) -> None:
        self.reader = reader
        self.items: list[OutputMessage | OutputReasoning | OutputFunctionCall] = []
        self._logprobs = logprobs  # the output text's logprobs, where asked for
        self._pending_logprobs: list[ChatLogprobEntry] = []  # of tokens no text delta has carried yet
        self._reasoning: int | None = None  # index of the open reasoning item
        self._message: int | None = None
        self._call: int | None = None
        self._answered = False  # text or a call has begun
        self.output_tokens = 0
        self.reasoning_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    @property
    def status(self) -> ResponseStatus:
        return _status(self.finish_reason)

    def feed(self, out: RequestOutput) -> list[Event]:
        """The events this output adds (the last one closes every item)."""
        completion = out.outputs[0]
        self.cached_tokens = out.num_cached_tokens
        self.output_tokens += len(completion.delta_token_ids)
        if self._logprobs is not None and completion.logprobs is not None:
            self._pending_logprobs += self._logprobs(_new_logprobs(completion))
        delta, finish_reason = _chat_delta(completion, self.reader)
        events: list[Event] = []
        if delta is not None:
            if delta.reasoning:
                events += self._add_reasoning(delta.reasoning)
            if delta.content:
                events += self._add_text(delta.content)
            for call in delta.tool_calls or ():
                events += self._add_call(call)
        thinking = self.reader.reasoning is not None and self.reader.reasoning.thinks
        if thinking and not self._answered:
            self.reasoning_tokens += len(completion.delta_token_ids)
        if out.finished:
            self.finish_reason, self.stop_reason = finish_reason, completion.stop_reason
            events += self._finish()
        return events

    def _add(self, item: OutputMessage | OutputReasoning | OutputFunctionCall) -> tuple[int, list[Event]]:
        self.items.append(item)
        index = len(self.items) - 1
        return index, [_event("response.output_item.added", output_index=index, item=_dump(item))]

    def _part_event(self, type_: str, index: int, part: BaseModel) -> Event:
        return _event(type_, item_id=self.items[index].id, output_index=index, content_index=0,
                      part=_dump(part))

    def _add_reasoning(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self._reasoning is None:
            self._reasoning, events = self._add(OutputReasoning())
            events.append(self._part_event("response.content_part.added", self._reasoning, ReasoningText()))
            self._item(self._reasoning, OutputReasoning).content.append(ReasoningText())
        index = self._reasoning
        self._item(index, OutputReasoning).content[0].text += text
        events.append(_event("response.reasoning_text.delta", item_id=self.items[index].id,
                             output_index=index, content_index=0, delta=text))
        return events

    def _add_text(self, text: str) -> list[Event]:
        self._answered = True
        events = self._close_reasoning()
        if self._message is None:
            self._message, added = self._add(OutputMessage())
            events += added
            events.append(self._part_event("response.content_part.added", self._message, OutputText()))
            self._item(self._message, OutputMessage).content.append(OutputText())
        index = self._message
        part = self._item(index, OutputMessage).content[0]
        part.text += text
        logprobs, self._pending_logprobs = self._pending_logprobs, []
        part.logprobs += logprobs
        events.append(_event("response.output_text.delta", item_id=self.items[index].id, output_index=index,
                             content_index=0, delta=text, logprobs=[_dump(entry) for entry in logprobs]))
        return events

    def _add_call(self, call: DeltaToolCall) -> list[Event]:
        self._answered = True
        events = self._close_reasoning()
        if call.id is not None:  # a new call (its first delta has its id and name)
            events += self._close_call("completed")
            self._call, added = self._add(OutputFunctionCall(call_id=call.id, name=call.function.name or ""))
            events += added
        arguments = call.function.arguments
        if arguments and self._call is not None:
            self._item(self._call, OutputFunctionCall).arguments += arguments
            events.append(_event("response.function_call_arguments.delta", item_id=self.items[self._call].id,
                                 output_index=self._call, delta=arguments))
        return events

    def _close_reasoning(self, status: ItemStatus = "completed") -> list[Event]:
        index, self._reasoning = self._reasoning, None
        if index is None:
            return []
        item = self._item(index, OutputReasoning)
        item.status = status
        part = item.content[0]
        return [_event("response.reasoning_text.done", item_id=item.id, output_index=index, content_index=0,
                       text=part.text),
                self._part_event("response.content_part.done", index, part),
                _event("response.output_item.done", output_index=index, item=_dump(item))]

    def _close_call(self, status: ItemStatus) -> list[Event]:
        index, self._call = self._call, None
        if index is None:
            return []
        item = self._item(index, OutputFunctionCall)
        item.status = status
        return [_event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                       arguments=item.arguments),
                _event("response.output_item.done", output_index=index, item=_dump(item))]

    def _close_message(self, status: ItemStatus) -> list[Event]:
        index, self._message = self._message, None
        if index is None:
            return []
        item = self._item(index, OutputMessage)
        item.status = status
        part = item.content[0]
        part.logprobs += self._pending_logprobs  # the tokens after the last text (its end, a call's)
        self._pending_logprobs = []
        return [_event("response.output_text.done", item_id=item.id, output_index=index, content_index=0,
                       text=part.text, logprobs=[_dump(entry) for entry in part.logprobs]),
                self._part_event("response.content_part.done", index, part),
                _event("response.output_item.done", output_index=index, item=_dump(item))]

    def _finish(self) -> list[Event]:
        """Close the open items, in their order; an answer with no item at all is an empty message."""
        events: list[Event] = []
        if not self.items:
            self._message, events = self._add(OutputMessage())
            events.append(self._part_event("response.content_part.added", self._message, OutputText()))
            self._item(self._message, OutputMessage).content.append(OutputText())
        status: ItemStatus = "incomplete" if self.status == "incomplete" else "completed"
        closers = {self._reasoning: self._close_reasoning, self._message: self._close_message,
                   self._call: self._close_call}
        for index in sorted(i for i in closers if i is not None):
            events += closers[index](status)
        return events

    def _item(self, index: int, kind: type[Any]) -> Any:
        item = self.items[index]
        assert isinstance(item, kind)
        return item


# -- the store -----------------------------------------------------------------------------------


@dataclass
class StoredResponse:
    response: ResponsesResponse
    items: list[Any]  # the conversation: its input items (previous ones first), then the output's


class ResponseStore:
    """Stored responses by id, in memory (the server's event loop alone touches it); beyond ``capacity`` the
    least recently used is forgotten."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, stored: StoredResponse) -> None:
        self._entries[stored.response.id] = stored
        self._entries.move_to_end(stored.response.id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._entries.get(response_id)
        if stored is not None:
            self._entries.move_to_end(response_id)
        return stored


def _not_found(response_id: str, param: str | None = None) -> APIError:
    # vLLM's words and status (OpenAI's error JSON)
    return APIError(404, f"Response with id '{response_id}' not found.", param=param)


@contextmanager
def _named_as_responses() -> Iterator[None]:
    """Errors of the chat path, naming the Responses API's fields (input, max_output_tokens, text...)."""
    try:
        yield
    except ProtocolError as err:
        raise _responses_error(bad_request(err, "input", "text")) from err
    except APIError as err:
        raise _responses_error(err) from None


def _responses_error(err: APIError) -> APIError:
    err.param = _RESPONSES_PARAMS.get(err.param or "", err.param)
    return err


# -- the endpoints -------------------------------------------------------------------------------


class ResponsesAPI:
    """POST /v1/responses, GET /v1/responses/{id} and POST /v1/responses/{id}/cancel on an OpenAIServer."""

    def __init__(self, server: OpenAIServer, max_stored: int = MAX_STORED_RESPONSES) -> None:
        self.server = server
        self.store = ResponseStore(max_stored)

    def add_routes(self, app: FastAPI) -> None:
        @app.post("/v1/responses", response_model=ResponsesResponse, responses=_ERROR_RESPONSES)
        async def create_response(body: ResponsesRequest, raw: Request) -> Response:
            return await self.create(body, raw)

        @app.get("/v1/responses/{response_id}", response_model=ResponsesResponse, responses=_ERROR_RESPONSES)
        async def retrieve_response(response_id: str) -> Response:
            return _json(self.retrieve(response_id))

        @app.post("/v1/responses/{response_id}/cancel", response_model=ResponsesResponse,
                  responses=_ERROR_RESPONSES)
        async def cancel_response(response_id: str) -> Response:
            return _json(self.cancel(response_id))

    def retrieve(self, response_id: str) -> ResponsesResponse:
        stored = self.store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        return stored.response

    def cancel(self, response_id: str) -> ResponsesResponse:
        """vLLM's: only a background response can be cancelled, and this server runs none, so a stored one
        (finished) gets vLLM's 400."""
        self.retrieve(response_id)
        raise APIError(400, CANCEL_MESSAGE)

    async def create(self, body: ResponsesRequest, raw: Request) -> Response:
        server = self.server
        server.check_generates("Responses API")
        lora = server._check_model(body.model)
        arrival = time.monotonic()
        with _named_as_responses():
            body.check_supported()
            items = body.input_items()
            if body.previous_response_id is not None:
                previous = self.store.get(body.previous_response_id)
                if previous is None:
                    raise _not_found(body.previous_response_id, "previous_response_id")
                items = [*previous.items, *items]
            chat = body.chat_request(items)
            params, readers, stream = await server._start_chat(chat, lora, "input")
        tracker = RequestTracker(server.metrics, arrival, stream, params)
        reader = readers[0]
        if reader.tools is not None and body.max_tool_calls is not None:
            limit = reader.tools.max_calls
            reader.tools.max_calls = body.max_tool_calls if limit is None else min(limit, body.max_tool_calls)
        logprobs = None
        if chat.logprobs:
            as_ids, num_top = server._tokens_as_ids(chat), chat.top_logprobs or 0
            logprobs = lambda entries: server._chat_logprobs(entries, num_top, as_ids).content or []
        builder = OutputBuilder(reader, logprobs)
        response = self._shell(body, params, lora)
        if body.stream:
            events = self._events(body, response, items, stream, tracker, builder)
            return server._streamed_response(events, stream, tracker)
        try:
            done = await server._unless_disconnected(raw, self._run(stream, tracker, builder))
        finally:
            stream.abort()  # no-op unless something above failed
        if done is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return _json(self._finished(body, response, items, stream, builder))

    def _shell(self, body: ResponsesRequest, params: SamplingParams, lora: LoRARequest | None
               ) -> ResponsesResponse:
        """The response as it starts: what the request asked for, no output yet."""
        return ResponsesResponse(
            id=_random_id(self.server.config.response_id_prefix), status="in_progress",
            instructions=body.instructions,
            max_output_tokens=params.max_tokens, max_tool_calls=body.max_tool_calls,
            model=self.server._reported_model(lora),
            parallel_tool_calls=body.parallel_tool_calls is not False,
            previous_response_id=body.previous_response_id,
            reasoning=body.reasoning.model_dump() if body.reasoning is not None else None,
            service_tier=body.service_tier or "auto", store=body.store, temperature=params.temperature,
            text=body.text.model_dump(by_alias=True, exclude_none=True) if body.text is not None else
            {"format": {"type": "text"}},
            tool_choice=body.echoed_tool_choice(), tools=[tool.echo() for tool in body.tools or ()],
            top_logprobs=body.top_logprobs, top_p=params.top_p, truncation=body.truncation or "disabled",
            user=body.user, metadata=body.metadata or {})

    async def _run(self, stream: RequestStream, tracker: RequestTracker, builder: OutputBuilder) -> bool:
        """Run a non-streamed request to its end, feeding the builder as the stream goes (so streamed and not,
        the output is read alike)."""
        error = False
        try:
            async with stream:
                async for index, out in stream:
                    tracker.observe(index, out)
                    builder.feed(out)
        except _ENGINE_ERRORS as err:
            error = not isinstance(err, RequestTimeoutError)  # a timeout is an abort, not a failure
            raise
        finally:
            tracker.close(error)
        return True

    def _finished(self, body: ResponsesRequest, response: ResponsesResponse, items: list[Any],
                  stream: RequestStream, builder: OutputBuilder) -> ResponsesResponse:
        """The finished response, stored where the request asks."""
        input_tokens = len(stream.prompt_token_ids[0])
        usage = ResponseUsage(
            input_tokens=input_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=builder.cached_tokens),
            output_tokens=builder.output_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=builder.reasoning_tokens),
            total_tokens=input_tokens + builder.output_tokens)
        status = builder.status
        error = None
        if status == "failed":  # a grammar that cannot go on: chat's finish_reason "error"
            message = str(builder.stop_reason or "generation failed")
            error = ResponseError(code=SERVER_ERROR_CODE, message=message)
        final = response.model_copy(update={
            "status": status, "output": builder.items, "usage": usage, "error": error,
            "incomplete_details": IncompleteDetails() if status == "incomplete" else None})
        if body.store:
            output = [_INPUT_ITEM.validate_python(_dump(item)) for item in builder.items]
            self.store.put(StoredResponse(final, [*items, *output]))
        return final

    async def _events(self, body: ResponsesRequest, response: ResponsesResponse, items: list[Any],
                      stream: RequestStream, tracker: RequestTracker, builder: OutputBuilder
                      ) -> AsyncIterator[str]:
        """The SSE stream: OpenAI's named events, numbered in order, ending with the finished response
        (there is no [DONE], as in OpenAI's and vLLM's)."""
        numbers = itertools.count()

        def sse(event: Event) -> str:
            event["sequence_number"] = next(numbers)
            return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

        yield sse(_event("response.created", response=_dump(response)))
        yield sse(_event("response.in_progress", response=_dump(response)))
        error = False
        try:
            async with stream:
                async for index, out in stream:
                    tracker.observe(index, out)
                    for event in builder.feed(out):
                        yield sse(event)
        except _ENGINE_ERRORS as err:
            error = not isinstance(err, RequestTimeoutError)
            status = _ENGINE_ERROR_STATUS[type(err)]
            self.server.log_error_stack(status, err)
            yield sse(_event("error", code=error_type(status), message=str(err), param=None))
            failure = ResponseError(code=SERVER_ERROR_CODE, message=str(err))
            failed = response.model_copy(update={"status": "failed", "output": builder.items,
                                                 "error": failure})
            yield sse(_event("response.failed", response=_dump(failed)))
            return
        finally:
            tracker.close(error)
        final = self._finished(body, response, items, stream, builder)
        yield sse(_event(_TERMINAL_EVENTS[final.status], response=_dump(final)))


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")
