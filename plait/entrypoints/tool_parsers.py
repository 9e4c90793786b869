"""Tool-call parsers: a model's output read as content and tool calls, whole or as it streams."""

from __future__ import annotations

import ast
import json
import math
import random
import re
import string
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from plait.entrypoints.parser_registry import ParserRegistry

# Hermes' tags around each call (Qwen2.5, Qwen3, Hermes 2 Pro and later).
HERMES_CALL_OPEN = "<tool_call>"
HERMES_CALL_CLOSE = "</tool_call>"
# Where Llama 3.x may begin its calls (a special token, so gone from the text unless special tokens are kept).
LLAMA_PYTHON_TAG = "<|python_tag|>"
LLAMA_CALL_SEPARATOR = ";"
# Granite 3.x: a special token before its JSON array of calls (or the tag as plain text).
GRANITE_CALL_TOKENS = ("<|tool_call|>", "<tool_call>")
# OLMo 3's block of pythonic calls, one a line (plain text, not special tokens).
OLMO3_CALLS_OPEN = "<function_calls>"
OLMO3_CALLS_CLOSE = "</function_calls>"
# JSON's literals, which models write in pythonic calls too, as Python's.
JSON_LITERAL_NAMES: dict[str, Any] = {"null": None, "true": True, "false": False}
# Phi-4-mini: the word before its JSON array of calls.
PHI4_MINI_CALL_PREFIX = "functools"
# Mistral: a special token before its calls; tokenizers v11 on write each call as name[ARGS]{...} (an id after
# [CALL_ID] may come between), earlier ones one JSON array after the token.
MISTRAL_TOOL_CALLS = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"
MISTRAL_CALL_ID = "[CALL_ID]"
# Mistral's tool call ids (mistral_common's rule, vLLM's ids): 9 letters or digits.
MISTRAL_CALL_ID_CHARS = string.ascii_letters + string.digits
MISTRAL_CALL_ID_LENGTH = 9
# Qwen3-Coder's XML-like calls (inside Hermes' <tool_call> tags):
# <function=NAME><parameter=KEY>VALUE</parameter>...</function>.
QWEN3_CODER_FUNCTION_OPEN = "<function="
QWEN3_CODER_FUNCTION_CLOSE = "</function>"
QWEN3_CODER_PARAMETER_OPEN = "<parameter="
QWEN3_CODER_PARAMETER_CLOSE = "</parameter>"
SEED_OSS_CALL_OPEN = "<seed:tool_call>"
SEED_OSS_CALL_CLOSE = "</seed:tool_call>"
# What may end a Qwen3-Coder parameter's value: its close tag, or (the close left out) the next parameter or
# the function's end, whichever comes first (vLLM's reading).
QWEN3_CODER_VALUE_ENDS = (QWEN3_CODER_PARAMETER_CLOSE, QWEN3_CODER_PARAMETER_OPEN, QWEN3_CODER_FUNCTION_CLOSE)
# Characters no function name has (vLLM's qwen3_coder check against template text and prose read as a call,
# and brackets, which would be Mistral's tags).
NAME_FORBIDDEN_CHARS = frozenset('{}<>[]"\' \t\n\r')
# What decoding JSON the model wrote may raise: malformed, or nested deeper than Python recurses.
JSON_ERRORS = (json.JSONDecodeError, RecursionError)
# The keys a call's arguments come under: Hermes writes "arguments", Llama 3 "parameters"; both are read.
ARGUMENT_KEYS = ("arguments", "parameters")
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCallStart:
    """A new tool call; its arguments follow as ToolCallArguments. ``id``: the call's id where the format
    has its own kind (Mistral's); None leaves it to the caller."""

    name: str
    id: str | None = None


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

    def _decided_until(self, tags: tuple[str, ...], final: bool) -> int:
        """Where the first of ``tags`` from pos begins, else where the text stops being decided (the end,
        less an end that may still become a tag)."""
        found = [at for at in (self.text.find(tag, self.pos) for tag in tags) if at >= 0]
        if found:
            return min(found)
        held = 0 if final else max(partial_tag_length(self.text, tag, self.pos) for tag in tags)
        return len(self.text) - held

    def _take_content(self, tags: tuple[str, ...], events: list[ToolEvent], final: bool) -> bool:
        """Content up to the first of ``tags`` (or up to text that may still become one); whether a tag is
        next."""
        start = self._decided_until(tags, final)
        if start > self.pos:
            events.append(self.text[self.pos:start])
        self.pos = start
        return any(self.text.startswith(tag, start) for tag in tags)


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
    """A model family's tool-call format, chosen by name (vLLM's --tool-call-parser).

    ``functions``: the request's tools, each function's name to its parameters' JSON schema (None where it
    declares none), for formats whose arguments are typed by them (qwen3_coder); the others ignore it.
    """

    name = ""
    # Whether the format's markers are special tokens, which the detokenizer drops under the request's
    # skip_special_tokens (true by default): as vLLM's adjust_request does for such parsers, a request with
    # tools (tool_choice not "none") is then detokenized with them (skip_special_tokens false).
    MARKERS_ARE_SPECIAL_TOKENS = False

    def __init__(self, functions: Mapping[str, dict[str, Any] | None] | None = None) -> None:
        super().__init__()
        self.functions = dict(functions or {})

    @classmethod
    def skip_special_tokens(cls, requested: bool, tools_in_play: bool) -> bool:
        """The skip_special_tokens to detokenize a request's output with, where it asked for ``requested``:
        false where tools are in play (given, tool_choice not "none") and the format's markers are special
        tokens, so that the parser sees them (vLLM's adjust_request)."""
        return requested and not (cls.MARKERS_ARE_SPECIAL_TOKENS and tools_in_play)


# Built in below; a --tool-parser-plugin file adds its own (or replaces one) with the same decorator.
TOOL_PARSERS: ParserRegistry[type[ToolParser]] = ParserRegistry("tool call parser", ToolParser)


def register_tool_parser(cls: type[ToolParser]) -> type[ToolParser]:
    """Class decorator: makes the parser available under its ``name`` (a name taken before becomes its)."""
    return TOOL_PARSERS.register(cls)


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered under ``name``; a ValueError naming the known ones otherwise."""
    return TOOL_PARSERS.lookup(name)


# -- Hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call> ------------------------------


@register_tool_parser
class HermesToolParser(ToolParser):
    """Each call inside <tool_call></tool_call>, as many as the model writes, text outside them being
    content. A call whose JSON does not parse is content, tags and all; an unclosed last call counts if
    its JSON is whole (the model may stop before the closing tag). Subclasses name other tags
    (``CALL_OPEN``, ``CALL_CLOSE``) or read another body (``_read_body``)."""

    name = "hermes"
    CALL_OPEN, CALL_CLOSE = HERMES_CALL_OPEN, HERMES_CALL_CLOSE

    def _scan(self, final: bool) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        while self.pos < len(self.text):
            if self.text.startswith(self.CALL_OPEN, self.pos):
                if not self._take_call(events, final):
                    break
            elif not self._take_content((self.CALL_OPEN,), events, final):
                break
        return events

    def _take_call(self, events: list[ToolEvent], final: bool) -> bool:
        """The call whose tag is at pos, once closed (or the output ended); whether it was taken."""
        body_start = self.pos + len(self.CALL_OPEN)
        close = self.text.find(self.CALL_CLOSE, body_start)
        if close < 0 and not final:
            return False
        body_end = close if close >= 0 else len(self.text)
        end = close + len(self.CALL_CLOSE) if close >= 0 else len(self.text)
        call = self._read_body(self.text[body_start:body_end])
        events.extend(call if call is not None else [self.text[self.pos:end]])
        self.pos = end
        return True

    def _read_body(self, body: str) -> list[ToolEvent] | None:
        """The events of the text between the tags; None where it is no call (so content)."""
        try:
            return call_events(json.loads(body))
        except JSON_ERRORS:
            return None


@register_tool_parser
class Ernie45ToolParser(HermesToolParser):
    """ERNIE 4.5 (vLLM's "ernie45": ERNIE-4.5-21B-A3B-Thinking): Hermes' calls,
    ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, a block each, after its reasoning and
    any answer (whose ``<response>`` tags the ernie45 reasoning parser takes off). Text outside the calls is
    content here; vLLM's keeps only the text before the first call, less its trailing newlines, which is
    what the chat stream's trimming leaves of it for such outputs."""

    name = "ernie45"


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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # a ToolParser's functions
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
    keyword arguments of literal values (JSON's null / true / false too, as vLLM's),
    ``[get_weather(city="Paris"), get_time()]``. Any other output, or a list that is not only such calls, is
    content. Output that begins with "[" is held to its end: only the whole output can say it is nothing but
    calls."""

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
    (yet). JSON's null, true and false count as literals (models copy them from the tools' schemas; vLLM's
    pythonic parsers read them too)."""
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
            arguments = {kw.arg: ast.literal_eval(_JsonNames().visit(kw.value))
                         for kw in node.keywords if kw.arg is not None}
            # allow_nan off: 1e999 is inf, which JSON cannot hold (vLLM refuses such a call too)
            text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
        if len(arguments) != len(node.keywords):
            return None  # **kwargs
        events += [ToolCallStart(node.func.id), ToolCallArguments(text)]
    return events


class _JsonNames(ast.NodeTransformer):
    """JSON's literal names in an argument's expression made the Python constants they mean."""

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id not in JSON_LITERAL_NAMES:
            return node  # any other name is no literal: literal_eval refuses it
        return ast.copy_location(ast.Constant(JSON_LITERAL_NAMES[node.id]), node)


# -- OLMo 3: <function_calls>get_weather(city="Paris")\nget_time()</function_calls> --------------------


@register_tool_parser
class Olmo3ToolParser(HermesToolParser):
    """OLMo 3 (vLLM's "olmo3": Olmo-3 Instruct and Think): the calls in one block between <function_calls>
    and </function_calls>, one pythonic call a line, ``get_weather(city="Paris")``, keyword arguments of
    literal values (Python's, or JSON's null / true / false). As vLLM's, the lines are read as the items of
    one list, so a block is calls only if every line is one; else it is content, tags and all (vLLM's
    latest keeps the good lines' calls). A block the output ends in before its close counts if it is
    whole. Text outside the block is content (vLLM's whole-output read drops it once there are calls), and
    output without the tags has no calls (as vLLM streams it; its whole-output read tries bare lines too)."""

    name = "olmo3"
    CALL_OPEN, CALL_CLOSE = OLMO3_CALLS_OPEN, OLMO3_CALLS_CLOSE

    def _read_body(self, body: str) -> list[ToolEvent] | None:
        lines = [line.strip() for line in body.splitlines() if line.strip()]
        return _pythonic_calls(f"[{', '.join(lines)}]") if lines else None  # an empty block is no call


# -- Mistral: [TOOL_CALLS]get_weather[ARGS]{...}, or [TOOL_CALLS][{"name": ..., "arguments": {...}}] -----


class _NotACall(Exception):
    """What follows a call's opening marker does not fit the format: the marker is content."""


class _Undecided(Exception):
    """The call read so far may still become one (or not): wait for more text."""


def mistral_tool_call_id() -> str:
    """A Mistral tool call id, as vLLM makes them: 9 random letters or digits."""
    return "".join(random.choices(MISTRAL_CALL_ID_CHARS, k=MISTRAL_CALL_ID_LENGTH))


def _is_function_name(name: str) -> bool:
    return bool(name) and not NAME_FORBIDDEN_CHARS.intersection(name)


@register_tool_parser
class MistralToolParser(ToolParser):
    """Mistral (vLLM's "mistral": Mistral-7B-Instruct-v0.3, Mistral-Small-3.x, Mistral-Nemo, Magistral):
    text before [TOOL_CALLS] is content; after it, tokenizers v11 on (Mistral-Small-3.2, Magistral) write one
    call, ``name[ARGS]{...}`` (``name{...}`` where [ARGS] is not in the text; an id after [CALL_ID] is
    skipped), and [TOOL_CALLS] again before each further call; earlier ones one JSON array of
    ``{"name": ..., "arguments": {...}}``. Both are read, told apart by the "[" that opens the array.

    [TOOL_CALLS] is a special token, so the parser needs special tokens kept in the text (vLLM's
    adjust_request; ``skip_special_tokens``). A call whose name or JSON does not fit, or an array with any
    item that is not a call, is content, [TOOL_CALLS] and all; text after a call up to the next [TOOL_CALLS]
    is content too. Calls get Mistral's 9-character ids.
    """

    name = "mistral"
    MARKERS_ARE_SPECIAL_TOKENS = True

    def _scan(self, final: bool) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        while self.pos < len(self.text):
            if self.text.startswith(MISTRAL_TOOL_CALLS, self.pos):
                if not self._take_calls(events, final):
                    break
            elif not self._take_content((MISTRAL_TOOL_CALLS,), events, final):
                break
        return events

    def _take_calls(self, events: list[ToolEvent], final: bool) -> bool:
        """The call(s) after the [TOOL_CALLS] at pos, once decided (False: not yet). They are read only up to
        the next [TOOL_CALLS], so fed whole or in pieces the parser sees the same text."""
        start = self.pos + len(MISTRAL_TOOL_CALLS)
        next_tag = self.text.find(MISTRAL_TOOL_CALLS, start)
        segment = self.text[start:next_tag if next_tag >= 0 else len(self.text)]
        whole = next_tag >= 0 or final  # the segment can grow no more
        at = _skip_whitespace(segment, 0)
        try:
            if at == len(segment) and not whole:
                raise _Undecided
            read = self._read_array if segment.startswith("[", at) else self._read_named
            calls, end = read(segment, at, whole)
        except _Undecided:
            return False
        except _NotACall:  # the tag is content, and what follows it up to the next tag
            events.append(MISTRAL_TOOL_CALLS)
            self.pos = start
            return True
        events.extend(calls)
        self.pos = start + end
        return True

    @staticmethod
    def _decode(segment: str, at: int, whole: bool) -> tuple[Any, int]:
        try:
            return _DECODER.raw_decode(segment, at)
        except JSON_ERRORS:
            raise _NotACall if whole else _Undecided from None

    @classmethod
    def _read_array(cls, segment: str, at: int, whole: bool) -> tuple[list[ToolEvent], int]:
        """Calls before v11, a JSON array: their events and where it ends."""
        value, end = cls._decode(segment, at, whole)
        if not isinstance(value, list):
            raise _NotACall
        events: list[ToolEvent] = []
        for item in value:
            call = call_events(item, ("arguments",))
            if call is None:
                raise _NotACall
            start, arguments = call
            assert isinstance(start, ToolCallStart)
            events += [ToolCallStart(start.name, mistral_tool_call_id()), arguments]
        return events, end

    @classmethod
    def _read_named(cls, segment: str, at: int, whole: bool) -> tuple[list[ToolEvent], int]:
        """A v11+ call, ``name[ARGS]{...}``: its events and where it ends."""
        brace = segment.find("{", at)
        if brace < 0:
            raise _NotACall if whole else _Undecided
        name = segment[at:brace].split(MISTRAL_CALL_ID)[0].replace(MISTRAL_ARGS, "").strip()
        if not _is_function_name(name):
            raise _NotACall
        arguments, end = cls._decode(segment, brace, whole)
        call = call_events({"name": name, "arguments": arguments}, ("arguments",))
        if call is None:
            raise _NotACall
        return [ToolCallStart(name, mistral_tool_call_id()), call[1]], end


# -- Qwen3-Coder: <tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call> -------


@register_tool_parser
class Qwen3CoderToolParser(ToolParser):
    """Qwen3-Coder (vLLM's "qwen3_coder"): each call

        <tool_call>
        <function=NAME>
        <parameter=KEY>
        VALUE
        </parameter>
        ...
        </function>
        </tool_call>

    (or from <function= on, without <tool_call>), text outside calls being content. A value is the text
    between its tags, less one newline at each end; it ends at the first </parameter>, or where that is left
    out at the next <parameter= or </function> (vLLM's first reading; so a value cannot hold those tags'
    text, which its later parser looks past). As vLLM, it is typed by the parameter's schema in the
    request's tools (``functions``): strings stay text, integers, numbers and booleans are read as such,
    objects and arrays as JSON (or Python literals), "null" as null where the type is not a string or
    allows null; a value that does not read, or a parameter the schema does not declare, stays a string.
    </function> and </tool_call> may be left out where the output ends (text after a </function> without
    </tool_call> is content). A call that does not fit the format (no <function= after <tool_call>, a bad
    name, text between parameters) is content, tags and all.
    """

    name = "qwen3_coder"
    # The tags around a call (Seed-OSS names them its own way).
    CALL_OPEN, CALL_CLOSE = HERMES_CALL_OPEN, HERMES_CALL_CLOSE
    OPENERS = (CALL_OPEN, QWEN3_CODER_FUNCTION_OPEN)

    def _scan(self, final: bool) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        while self.pos < len(self.text):
            opener = next((tag for tag in self.OPENERS if self.text.startswith(tag, self.pos)), None)
            if opener is not None:
                try:
                    name, arguments, end = self._read_call(final)
                except _Undecided:
                    break
                except _NotACall:
                    events.append(opener)
                    self.pos += len(opener)
                    continue
                events += [ToolCallStart(name), ToolCallArguments(json.dumps(arguments, ensure_ascii=False))]
                self.pos = end
            elif not self._take_content(self.OPENERS, events, final):
                break
        return events

    def _expect(self, at: int, tag: str, final: bool) -> bool:
        """Whether ``tag`` is at ``at``; _Undecided where the text so far ends in its beginning."""
        if self.text.startswith(tag, at):
            return True
        if not final and tag.startswith(self.text[at:]):
            raise _Undecided
        return False

    def _read_call(self, final: bool) -> tuple[str, dict[str, Any], int]:
        """The call at pos: its name, typed arguments and end."""
        at = self.pos
        if self.text.startswith(self.CALL_OPEN, at):
            at = _skip_whitespace(self.text, at + len(self.CALL_OPEN))
            if not self._expect(at, QWEN3_CODER_FUNCTION_OPEN, final):
                raise _NotACall
        name, at = self._read_tag_name(at + len(QWEN3_CODER_FUNCTION_OPEN), final)
        if not _is_function_name(name):
            raise _NotACall
        properties = self._properties(name)
        arguments: dict[str, Any] = {}
        while True:
            at = _skip_whitespace(self.text, at)
            if at == len(self.text):
                if final:
                    return name, arguments, at  # the output ended inside the call
                raise _Undecided
            if self._expect(at, QWEN3_CODER_PARAMETER_OPEN, final):
                key, at = self._read_tag_name(at + len(QWEN3_CODER_PARAMETER_OPEN), final)
                if not key or NAME_FORBIDDEN_CHARS.intersection(key.replace(" ", "")):
                    raise _NotACall
                value, at = self._read_value(at, final)
                arguments[key] = typed_parameter(value, properties.get(key))
            elif self._expect(at, QWEN3_CODER_FUNCTION_CLOSE, final):
                return name, arguments, self._read_close(at + len(QWEN3_CODER_FUNCTION_CLOSE), final)
            elif self._expect(at, self.CALL_CLOSE, final):  # </function> left out
                return name, arguments, at + len(self.CALL_CLOSE)
            else:
                raise _NotACall

    def _read_tag_name(self, at: int, final: bool) -> tuple[str, int]:
        """The name of a <function= or <parameter= tag, up to its ">", and where the tag ends."""
        close = self.text.find(">", at)
        if close < 0:
            if final or "\n" in self.text[at:] or "<" in self.text[at:]:
                raise _NotACall
            raise _Undecided
        return self.text[at:close], close + 1

    def _read_value(self, at: int, final: bool) -> tuple[str, int]:
        """A parameter's value from ``at`` (its tag's end) and where reading goes on."""
        found = [(end, tag) for tag in QWEN3_CODER_VALUE_ENDS if (end := self.text.find(tag, at)) >= 0]
        if found:
            end, tag = min(found)
            after = end + len(tag) if tag == QWEN3_CODER_PARAMETER_CLOSE else end
        elif final:
            end = after = len(self.text)  # the output ended inside the value
        else:
            raise _Undecided
        value = self.text[at:end]
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        return value, after

    def _read_close(self, at: int, final: bool) -> int:
        """Where a call whose </function> ends at ``at`` ends: after a </tool_call> that follows it, else at
        ``at`` (the output ends there, or the close was left out: what follows is content)."""
        close = _skip_whitespace(self.text, at)
        if close == len(self.text) and not final:
            raise _Undecided
        if self._expect(close, self.CALL_CLOSE, final):
            return close + len(self.CALL_CLOSE)
        return at

    def _properties(self, name: str) -> dict[str, Any]:
        """The function's parameters' properties in the request's tools ({}: not there, or none declared)."""
        parameters = self.functions.get(name)
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        return properties if isinstance(properties, dict) else {}


@register_tool_parser
class Qwen3XmlToolParser(Qwen3CoderToolParser):
    """vLLM's "qwen3_xml": the same calls as "qwen3_coder" (Qwen3-Coder's and Qwen3-2507's format), which vLLM
    reads with another parser; here the same one, so either name serves them."""

    name = "qwen3_xml"


@register_tool_parser
class SeedOssToolParser(Qwen3CoderToolParser):
    """Seed-OSS (vLLM's "seed_oss"): Qwen3-Coder's calls between <seed:tool_call> and </seed:tool_call>."""

    name = "seed_oss"
    CALL_OPEN, CALL_CLOSE = SEED_OSS_CALL_OPEN, SEED_OSS_CALL_CLOSE
    OPENERS = (CALL_OPEN, QWEN3_CODER_FUNCTION_OPEN)


# The JSON-schema types whose values are text (vLLM's list, with its aliases).
_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_NULL_WORDS = ("null", "none")


def _schema_type(schema: dict[str, Any]) -> tuple[str, bool]:
    """A parameter's type as vLLM's qwen3_coder picks it (the first that is not "null" of a list or an
    anyOf; "string" where none is given) and whether null is allowed."""
    options: list[Any] = []
    if "type" in schema:
        options = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    elif isinstance(schema.get("anyOf"), list):
        options = [o["type"] for o in schema["anyOf"] if isinstance(o, dict) and "type" in o]
    names = [str(option).strip().lower() for option in options]
    chosen = next((n for n in names if n != "null"), "null" if names else "string")
    return chosen, "null" in names


def _is_json_value(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return False
    return True


def _literal(text: str) -> Any:
    """``text`` as a Python literal; ValueError if it is not one (or not one JSON can hold)."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as err:
        raise ValueError(text) from err
    if not _is_json_value(value):
        raise ValueError(text)
    return value


def typed_parameter(value: str, schema: Any) -> Any:
    """A Qwen3-Coder parameter's text as the type its schema declares (vLLM's _convert_param_value): the
    text itself for a string, a parameter not in the schema or a value that does not read as its type."""
    if not isinstance(schema, dict):
        return value  # not declared: the text as it is
    kind, nullable = _schema_type(schema)
    if nullable and value.lower() in _NULL_WORDS:
        return None
    if kind in _STRING_TYPES:
        return value
    if value.lower() in _NULL_WORDS:
        return None
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
        except ValueError:
            return value
        if not math.isfinite(number):
            return value
        return int(number) if number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"  # anything else is false, as vLLM reads it
    container = kind in ("object", "array", "arr") or kind.startswith(("dict", "list"))
    if container:
        try:
            parsed = json.loads(value)
        except JSON_ERRORS:
            pass
        else:
            if isinstance(parsed, str):  # JSON holding a Python literal's text (some templates write that)
                try:
                    return _literal(parsed)
                except ValueError:
                    pass
            return parsed if _is_json_value(parsed) else value
    try:
        parsed = _literal(value)
    except ValueError:
        return value
    if container and isinstance(parsed, str):
        try:
            return _literal(parsed)
        except ValueError:
            pass
    return parsed


# -- gpt-oss: harmony messages to a function recipient -----------------------------------------------


# OpenAI's harmony format (gpt-oss): each message is a header (its role after <|start|>, its channel after
# <|channel|>: analysis, final or commentary), <|message|>, its text and an end token; all special tokens.
HARMONY_START = "<|start|>"
HARMONY_CHANNEL = "<|channel|>"
HARMONY_HEADER_STARTS = (HARMONY_START, HARMONY_CHANNEL)
HARMONY_MESSAGE = "<|message|>"
# <|return|> and <|call|> end the turn (the generation config's EOS: the detokenized output usually lacks
# them); <|end|> ends a message that another follows.
HARMONY_ENDS = ("<|end|>", "<|return|>", "<|call|>")
# A call's recipient in its header, before or after its channel: "to=functions.get_weather".
HARMONY_FUNCTION_RECIPIENT = re.compile(r"\bto=functions\.([^\s<]+)")


@register_tool_parser
class OpenAIToolParser(ToolParser):
    """gpt-oss (vLLM's "openai"): a harmony message whose header names a function recipient
    (``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``, the recipient
    also before the channel) is a call of NAME, its body the arguments, streamed as they come. Everything
    else is content as it stands: behind the openai_gptoss reasoning parser, the final and commentary
    messages' text; without it, the raw harmony output. A header that never reaches its <|message|> is
    content."""

    name = "openai"
    MARKERS_ARE_SPECIAL_TOKENS = True

    def __init__(self, functions: Mapping[str, dict[str, Any] | None] | None = None) -> None:
        super().__init__(functions)
        self.in_call = False  # reading a call's arguments

    def _scan(self, final: bool) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        while self.pos < len(self.text):
            if self.in_call:
                if not self._take_arguments(events, final):
                    break
            elif self.text.startswith(HARMONY_HEADER_STARTS, self.pos):
                if not self._take_header(events, final):
                    break
            elif not self._take_content(HARMONY_HEADER_STARTS, events, final):
                break
        return events

    def _take_header(self, events: list[ToolEvent], final: bool) -> bool:
        """The header at pos, once its <|message|> came: a call's starts the call, any other is content."""
        at = self.text.find(HARMONY_MESSAGE, self.pos)
        if at < 0:
            if final:
                events.extend(self._rest_as_content())
            return False
        end = at + len(HARMONY_MESSAGE)
        recipient = HARMONY_FUNCTION_RECIPIENT.search(self.text, self.pos, at)
        if recipient is None:
            events.append(self.text[self.pos:end])
        else:
            events.append(ToolCallStart(recipient[1]))
            self.in_call = True
        self.pos = end
        return True

    def _take_arguments(self, events: list[ToolEvent], final: bool) -> bool:
        """The call's arguments up to its end token (dropped), or up to text that may become one; whether
        the call ended."""
        stop = self._decided_until(HARMONY_ENDS, final)
        if stop > self.pos:
            events.append(ToolCallArguments(self.text[self.pos:stop]))
        end_token = next((end for end in HARMONY_ENDS if self.text.startswith(end, stop)), None)
        if end_token is None:
            self.pos = stop
            return False
        self.pos, self.in_call = stop + len(end_token), False
        return True
