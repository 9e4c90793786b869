"""Tool-call parsers: a model's output read as content and tool calls, whole or as it streams."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# Hermes' tags around each call (Qwen2.5, Qwen3, Hermes 2 Pro and later).
HERMES_CALL_OPEN = "<tool_call>"
HERMES_CALL_CLOSE = "</tool_call>"
# Where Llama 3.x may begin its calls (a special token, so gone from the text unless special tokens are kept).
LLAMA_PYTHON_TAG = "<|python_tag|>"
LLAMA_CALL_SEPARATOR = ";"
# Granite 3.x: a special token before its JSON array of calls (or the tag as plain text).
GRANITE_CALL_TOKENS = ("<|tool_call|>", "<tool_call>")
# Phi-4-mini: the word before its JSON array of calls.
PHI4_MINI_CALL_PREFIX = "functools"
# What decoding JSON the model wrote may raise: malformed, or nested deeper than Python recurses.
JSON_ERRORS = (json.JSONDecodeError, RecursionError)
# The keys a call's arguments come under: Hermes writes "arguments", Llama 3 "parameters"; both are read.
ARGUMENT_KEYS = ("arguments", "parameters")
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCallStart:
    """A new tool call; its arguments follow as ToolCallArguments."""

    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    """Arguments text of the call started last (JSON text; a call's pieces concatenate)."""

    text: str


# What a parser makes of the output: content text (outside any call), or a call's start or arguments.
ToolEvent = str | ToolCallStart | ToolCallArguments


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text


class ToolOutputParser:
    """Reads one choice's output as it grows, and says what each part is once that is decided.

    ``feed`` the new text (``final`` with the last); it returns the events decided so far, holding back
    text that may still turn out to be part of a call. Fed whole or in any pieces, the events concatenate
    to the same content and calls. Subclasses implement ``_scan``, which consumes ``text`` from ``pos``.
    """

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0  # everything before it is decided (and was returned)

    def feed(self, delta: str, final: bool = False) -> list[ToolEvent]:
        self.text += delta
        return self._scan(final)

    def _scan(self, final: bool) -> list[ToolEvent]:
        raise NotImplementedError

    def _rest_as_content(self) -> list[ToolEvent]:
        rest = self.text[self.pos:]
        self.pos = len(self.text)
        return [rest] if rest else []


def parse_whole(parser: ToolOutputParser, text: str) -> tuple[str, list[ParsedToolCall]]:
    """A whole output's content (untrimmed) and tool calls."""
    return collect(parser.feed(text, final=True))


def collect(events: Iterable[ToolEvent]) -> tuple[str, list[ParsedToolCall]]:
    """Events folded into content text and complete calls."""
    content: list[str] = []
    calls: list[ParsedToolCall] = []
    for event in events:
        if isinstance(event, str):
            content.append(event)
        elif isinstance(event, ToolCallStart):
            calls.append(ParsedToolCall(event.name, ""))
        elif calls:
            calls[-1] = ParsedToolCall(calls[-1].name, calls[-1].arguments + event.text)
    return "".join(content), calls


def call_events(value: Any, argument_keys: tuple[str, ...] = ARGUMENT_KEYS) -> list[ToolEvent] | None:
    """A decoded JSON call ``{"name": ..., <argument key>: {...}}`` as events; None if it is not one.

    A call without arguments has ``{}``; arguments that are not an object make it no call (it is content).
    """
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    key = next((k for k in argument_keys if k in value), None)
    arguments = {} if key is None else value[key]
    if not isinstance(arguments, dict):
        return None
    try:
        text = json.dumps(arguments, ensure_ascii=False)
    except RecursionError:  # decoded, yet too deep to encode again: content
        return None
    return [ToolCallStart(value["name"]), ToolCallArguments(text)]


def partial_tag_length(text: str, tag: str, start: int) -> int:
    """Length of the longest end of ``text[start:]`` that begins ``tag`` (so may become it)."""
    for length in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


def _skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


# -- registry ------------------------------------------------------------------------------------


class ToolParser(ToolOutputParser):
    """A model family's tool-call format, chosen by name (vLLM's --tool-call-parser)."""

    name = ""


TOOL_PARSERS: dict[str, type[ToolParser]] = {}


def register_tool_parser(cls: type[ToolParser]) -> type[ToolParser]:
    """Class decorator: makes the parser available under its ``name``."""
    TOOL_PARSERS[cls.name] = cls
    return cls


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered under ``name``; a ValueError naming the known ones otherwise."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]


# -- Hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call> ------------------------------


@register_tool_parser
class HermesToolParser(ToolParser):
    """Each call inside <tool_call></tool_call>, as many as the model writes, text outside them being
    content. A call whose JSON does not parse is content, tags and all; an unclosed last call counts if
    its JSON is whole (the model may stop before the closing tag)."""

    name = "hermes"

    def _scan(self, final: bool) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        while self.pos < len(self.text):
            if self.text.startswith(HERMES_CALL_OPEN, self.pos):
                if not self._take_call(events, final):
                    break
            elif not self._take_content(events, final):
                break
        return events

    def _take_content(self, events: list[ToolEvent], final: bool) -> bool:
        """Content up to the next call's tag (or up to text that may begin one); whether a tag is next."""
        start = self.text.find(HERMES_CALL_OPEN, self.pos)
        if start < 0:
            held = 0 if final else partial_tag_length(self.text, HERMES_CALL_OPEN, self.pos)
            start = len(self.text) - held
        if start > self.pos:
            events.append(self.text[self.pos:start])
        self.pos = start
        return self.text.startswith(HERMES_CALL_OPEN, start)

    def _take_call(self, events: list[ToolEvent], final: bool) -> bool:
        """The call whose tag is at pos, once closed (or the output ended); whether it was taken."""
        body_start = self.pos + len(HERMES_CALL_OPEN)
        close = self.text.find(HERMES_CALL_CLOSE, body_start)
        if close < 0 and not final:
            return False
        body_end = close if close >= 0 else len(self.text)
        end = close + len(HERMES_CALL_CLOSE) if close >= 0 else len(self.text)
        try:
            call = call_events(json.loads(self.text[body_start:body_end]))
        except JSON_ERRORS:
            call = None
        events.extend(call if call is not None else [self.text[self.pos:end]])
        self.pos = end
        return True


# -- JSON calls in a row: Llama 3's, and tool_choice "required"'s array ----------------------------


class JsonCallsParser(ToolOutputParser):
    """Calls as JSON objects one after another: ``{"name": ..., <argument key>: {...}}``, SEPARATOR between
    them, inside OPEN ... CLOSE where those are set, after one of PREFIXES (optional unless PREFIX_REQUIRED).
    Output that does not begin so is content; where it stops fitting, the rest is content (a malformed call
    is never dropped)."""

    OPEN = ""
    SEPARATOR = LLAMA_CALL_SEPARATOR
    CLOSE = ""
    PREFIXES: tuple[str, ...] = ()
    PREFIX_REQUIRED = False
    ARGUMENT_KEYS: tuple[str, ...] = ARGUMENT_KEYS

    def __init__(self) -> None:
        super().__init__()
        self.state = "start"  # start, item (a call next), next (a separator or the close next), done, content

    def _scan(self, final: bool) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        while self.state in ("start", "item", "next"):
            at = _skip_whitespace(self.text, self.pos)
            if at == len(self.text):
                break  # only whitespace so far: nothing decided
            step = {"start": self._start, "item": self._item, "next": self._next}[self.state]
            if not step(at, final, events):
                break
        if self.state == "content":
            events.extend(self._rest_as_content())
        elif self.state == "done":
            self.pos = len(self.text)  # after the close: nothing more is read
        return events

    def _start(self, at: int, final: bool, events: list[ToolEvent]) -> bool:
        rest = self.text[at:]
        if not final and any(len(rest) < len(p) and p.startswith(rest) for p in self.PREFIXES):
            return False  # may be a prefix
        prefix = next((p for p in self.PREFIXES if rest.startswith(p)), None)
        if prefix is not None:
            at = _skip_whitespace(self.text, at + len(prefix))
            if at == len(self.text) and not final:
                return False
        elif self.PREFIX_REQUIRED:
            self.state = "content"
            return True
        opener = self.OPEN or "{"
        if not self.text.startswith(opener, at):
            self.state = "content"
            return True
        self.pos = at + len(self.OPEN)  # no OPEN: the call's own "{" is read as the item
        self.state = "item"
        return True

    def _item(self, at: int, final: bool, events: list[ToolEvent]) -> bool:
        if self.CLOSE and self.text.startswith(self.CLOSE, at):
            self.pos, self.state = at + len(self.CLOSE), "done"
            return True
        try:
            value, end = _DECODER.raw_decode(self.text, at)
        except JSON_ERRORS:
            if not final:
                return False  # a call still being written (or a malformed one: decided at the end)
            self.state = "content"
            return True
        call = call_events(value, self.ARGUMENT_KEYS)
        if call is None:
            self.state = "content"
            return True
        events.extend(call)
        self.pos, self.state = end, "next"
        return True

    def _next(self, at: int, final: bool, events: list[ToolEvent]) -> bool:
        if self.text.startswith(self.SEPARATOR, at):
            self.pos, self.state = at + len(self.SEPARATOR), "item"
        elif self.CLOSE and self.text.startswith(self.CLOSE, at):
            self.pos, self.state = at + len(self.CLOSE), "done"
        else:
            self.state = "content"
        return True


@register_tool_parser
class Llama3JsonToolParser(JsonCallsParser, ToolParser):
    """Llama 3.x JSON tool calling: the output is ``{"name": ..., "parameters": {...}}``, or several
    separated by ";", optionally after <|python_tag|>; any other output is content."""

    name = "llama3_json"
    PREFIXES = (LLAMA_PYTHON_TAG,)


@register_tool_parser
class GraniteToolParser(JsonCallsParser, ToolParser):
    """Granite 3.x (vLLM's "granite"): ``<|tool_call|>[{"name": ..., "arguments": {...}}, ...]``, the tag
    optional; any other output is content."""

    name = "granite"
    PREFIXES = GRANITE_CALL_TOKENS
    OPEN, SEPARATOR, CLOSE = "[", ",", "]"


@register_tool_parser
class Phi4MiniJsonToolParser(JsonCallsParser, ToolParser):
    """Phi-4-mini (vLLM's "phi4_mini_json"): ``functools[{"name": ..., "arguments": {...}}, ...]``; output
    without the word is content."""

    name = "phi4_mini_json"
    PREFIXES = (PHI4_MINI_CALL_PREFIX,)
    PREFIX_REQUIRED = True
    OPEN, SEPARATOR, CLOSE = "[", ",", "]"


# -- Pythonic: [get_weather(city="Paris"), get_time()] --------------------------------------------


@register_tool_parser
class PythonicToolParser(ToolParser):
    """Llama 3.2 / Llama 4 pythonic calls (vLLM's "pythonic"): the output is a Python list of calls with
    keyword arguments of literal values, ``[get_weather(city="Paris"), get_time()]``. Any other output,
    or a list that is not only such calls, is content. Output that begins with "[" is held to its end: only
    the whole output can say it is nothing but calls."""

    name = "pythonic"

    def _scan(self, final: bool) -> list[ToolEvent]:
        text = self.text[self.pos:]
        if not text.strip() or (text.lstrip().startswith("[") and self.pos == 0):
            if not final:
                return []
            calls = _pythonic_calls(text.strip()) if text.strip() else None
            if calls is not None:
                self.pos = len(self.text)
                return calls
        return self._rest_as_content()


def _pythonic_calls(source: str) -> list[ToolEvent] | None:
    """``source`` as the events of a list of calls with literal keyword arguments; None if it is not one
    (yet)."""
    import ast

    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, RecursionError):
        return None
    if not isinstance(tree.body, ast.List):
        return None
    events: list[ToolEvent] = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
            text = json.dumps(arguments, ensure_ascii=False)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
        if len(arguments) != len(node.keywords):
            return None  # **kwargs
        events += [ToolCallStart(node.func.id), ToolCallArguments(text)]
    return events
