"""Tool calling on chat completions: the output tool_choice forces, and a choice's output as tool calls."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from plait.entrypoints.tool_parsers import (
    JsonCallsParser,
    ToolCallArguments,
    ToolCallStart,
    ToolEvent,
    ToolOutputParser,
)

# vLLM's tool call ids: this prefix and a random hex string.
TOOL_CALL_ID_PREFIX = "chatcmpl-tool-"
# What a named function's arguments must be when it declares no parameters: some JSON object.
ANY_ARGUMENTS_SCHEMA: dict[str, Any] = {"type": "object"}
# A "required" call's arguments when its function declares no parameters (vLLM's: an empty object's schema).
NO_PARAMETERS_SCHEMA: dict[str, Any] = {"type": "object", "properties": {}}
# The finish_reason of an answer that ends in tool calls under tool_choice "auto" or "required" (OpenAI's and
# vLLM's; a named tool_choice keeps "stop").
TOOL_CALLS_FINISH_REASON = "tool_calls"


def make_tool_call_id() -> str:
    return f"{TOOL_CALL_ID_PREFIX}{uuid.uuid4().hex}"


# -- tool_choice as a structured output ----------------------------------------------------------


def named_tool_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A named tool_choice's output: that function's arguments, matching its parameters' schema."""
    return parameters if parameters else ANY_ARGUMENTS_SCHEMA


def required_tools_schema(functions: Mapping[str, dict[str, Any] | None], parallel: bool) -> dict[str, Any]:
    """tool_choice "required"'s output, as vLLM's: a JSON array of ``{"name", "parameters"}`` calls, each
    one function's name and its arguments; at least one, and only one unless ``parallel``.

    Each function's ``$defs`` move to the array's root, where its ``#/$defs/...`` references now point;
    two functions defining one name differently is a ValueError.
    """
    defs: dict[str, Any] = {}
    calls = []
    for name, parameters in functions.items():
        parameters = dict(parameters) if parameters else dict(NO_PARAMETERS_SCHEMA)
        for def_name, def_schema in parameters.pop("$defs", {}).items():
            if defs.setdefault(def_name, def_schema) != def_schema:
                raise ValueError(f"tools define '$defs/{def_name}' differently; tool_choice \"required\" "
                                 f"needs one schema per name")
        calls.append({"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                      "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters}})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


# -- the output read back as calls ---------------------------------------------------------------


class NamedToolOutput(ToolOutputParser):
    """A named tool_choice's output: all of it is the one call's arguments, streamed as they come."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.started = False

    def _scan(self, final: bool) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        if not self.started and (self.text or final):  # the call always comes, even empty (cut short)
            events.append(ToolCallStart(self.name))
            self.started = True
        if self.pos < len(self.text):
            events.append(ToolCallArguments(self.text[self.pos:]))
            self.pos = len(self.text)
        return events


class RequiredToolsOutput(JsonCallsParser):
    """tool_choice "required"'s output: ``[{"name": ..., "parameters": {...}}, ...]``, each call out as soon
    as its object is whole; what a cut-short array leaves unparsed is content."""

    OPEN = "["
    SEPARATOR = ","
    CLOSE = "]"
    ARGUMENT_KEYS = ("parameters",)


@dataclass
class ToolCallDelta:
    """A piece of one tool call, as chat chunks carry it: the first of a call has its id and name."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


class _TrimmedContent:
    """Content as it streams, without leading or trailing whitespace: whitespace is held back until text
    follows it, so the pieces concatenate to the whole content, stripped."""

    def __init__(self) -> None:
        self.started = False
        self.held = ""

    def add(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body):]
        return body


class ToolCallStream:
    """One choice's output as it grows, as chat content and tool-call deltas (ids and indexes given here).

    ``max_calls`` (parallel_tool_calls false: 1) drops the calls after that many, as vLLM does.
    """

    def __init__(self, parser: ToolOutputParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.num_calls = 0
        self._content = _TrimmedContent()
        self._dropping = False  # the arguments that come belong to a dropped call

    @property
    def called(self) -> bool:
        return self.num_calls > 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """The content and tool-call deltas that ``delta`` (the output's new text) decides."""
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        for event in self.parser.feed(delta, final):
            if isinstance(event, str):
                content.append(self._content.add(event))
            elif isinstance(event, ToolCallStart):
                self._start_call(event, calls)
            elif not self._dropping:
                self._add_arguments(event.text, calls)
        return "".join(content), calls

    def _start_call(self, start: ToolCallStart, calls: list[ToolCallDelta]) -> None:
        self._dropping = self.max_calls is not None and self.num_calls >= self.max_calls
        if not self._dropping:  # the parser's own kind of id (Mistral's), else vLLM's chatcmpl-tool-...
            calls.append(ToolCallDelta(index=self.num_calls, id=start.id or make_tool_call_id(),
                                       name=start.name))
            self.num_calls += 1

    def _add_arguments(self, text: str, calls: list[ToolCallDelta]) -> None:
        index = self.num_calls - 1
        if calls and calls[-1].index == index:
            calls[-1].arguments += text
        else:
            calls.append(ToolCallDelta(index=index, arguments=text))

    def finish_reason(self, reason: str | None) -> str | None:
        """The choice's finish_reason: "tool_calls" where it stopped after calls, but under a named
        tool_choice (vLLM's, after OpenAI's)."""
        if reason == "stop" and self.called and not isinstance(self.parser, NamedToolOutput):
            return TOOL_CALLS_FINISH_REASON
        return reason
