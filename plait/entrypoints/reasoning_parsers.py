"""Reasoning parsers: a model's output split into its reasoning and its answer, whole or as it streams."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, NamedTuple

from plait.entrypoints.parser_registry import ParserRegistry
from plait.entrypoints.tool_parsers import (
    HARMONY_CHANNEL,
    HARMONY_ENDS,
    HARMONY_FUNCTION_RECIPIENT,
    HARMONY_MESSAGE,
    HARMONY_START,
    partial_tag_length,
)

# The tags around DeepSeek-R1's, Qwen3's and DeepSeek-V3.1's reasoning (one vocabulary token each there).
THINK_START = "<think>"
THINK_END = "</think>"
# Seed-OSS's.
SEED_OSS_THINK_START = "<seed:think>"
SEED_OSS_THINK_END = "</seed:think>"
# Granite 3.2 / 3.3's phrases around its reasoning (plain text; "Here's" as vLLM also matches).
GRANITE_THOUGHT_STARTS = ("Here is my thought process:", "Here's my thought process:")
GRANITE_RESPONSE_STARTS = ("Here is my response:", "Here's my response:")
# Magistral's (Mistral tokenizer v13): special tokens.
MISTRAL_THINK_START = "[THINK]"
MISTRAL_THINK_END = "[/THINK]"
# ERNIE 4.5 Thinking's answer after </think>, in plain-text tags (its tool calls come outside them).
ERNIE_RESPONSE_START = "<response>"
ERNIE_RESPONSE_END = "</response>"
# Where a parser is in the output: before anything is decided, in the reasoning, in the answer; Mistral's also
# in an answer that may still open its reasoning.
_START, _REASONING, _CONTENT, _BEFORE = "start", "reasoning", "content", "before"
# Where ERNIE's answer is: before its <response> may open, inside it, after its </response>, plain text.
_LEAD, _RESPONSE, _TRAIL, _PLAIN = "lead", "response", "trail", "plain"


class ReasoningDelta(NamedTuple):
    """What one piece of the output adds to the reasoning and to the content."""

    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """One choice's output as it grows, split where its reasoning ends (vLLM's --reasoning-parser).

    ``feed`` the new text (``final`` with the last); it returns the reasoning and content it decides,
    holding back only text that may still become a tag, so fed whole or in any pieces the pieces
    concatenate to the same reasoning and content.

    As vLLM's: a START the output opens with (after whitespace) is dropped, and so is the first START
    inside the reasoning; the reasoning runs to the first END, the content is all after it (a later END is
    text); an output that never writes END is all reasoning (it was cut short while reasoning). Where
    the request turned thinking off (``thinking_on``), or its prompt already closed the reasoning (a
    template that writes ``<think>\\n\\n</think>`` for it), the output is all content.
    """

    name = ""
    START = THINK_START
    END = THINK_END
    # Whether START and END are special tokens, which the detokenizer drops under the request's
    # skip_special_tokens (true by default): the output is then detokenized with them (vLLM's Mistral
    # tokenizer keeps [THINK] and [/THINK] whatever the request says).
    MARKERS_ARE_SPECIAL_TOKENS = False

    def __init__(self, chat_template_kwargs: Mapping[str, Any] | None = None, prompt: str = "") -> None:
        # Whether the output begins in the reasoning at all.
        self.thinks = self.thinking_on(chat_template_kwargs or {}) and not self.reasoning_over(prompt)
        self.phase = _START if self.thinks else _CONTENT
        self._pending = ""  # text fed but not yet returned
        self._start_dropped = False

    @classmethod
    def thinking_on(cls, chat_template_kwargs: Mapping[str, Any]) -> bool:
        """Whether the request lets the model reason (the template variables that switch it)."""
        return True

    @classmethod
    def skip_special_tokens(cls, requested: bool) -> bool:
        """The skip_special_tokens to detokenize a request's output with, where it asked for ``requested``:
        false where the tags are special tokens, so that the parser sees them."""
        return requested and not cls.MARKERS_ARE_SPECIAL_TOKENS

    @property
    def has_reasoning(self) -> bool:
        """Whether the output has reasoning to split off (so far): wherever the request thinks."""
        return self.thinks

    @classmethod
    def reasoning_over(cls, prompt: str) -> bool:
        """Whether the prompt closed the reasoning before the output begins. vLLM looks for the last think
        tag anywhere in the prompt; only its end counts here, so a tag in an earlier turn does not."""
        return prompt.rstrip().endswith(cls.END)

    def feed(self, delta: str, final: bool = False) -> ReasoningDelta:
        self._pending += delta
        reasoning = content = ""
        if self.phase == _START:
            self._take_start(final)
        if self.phase == _REASONING:
            reasoning = self._take_reasoning(final)
        if self.phase == _CONTENT:
            content, self._pending = self._pending, ""
        return ReasoningDelta(reasoning, content)

    def _take_start(self, final: bool) -> None:
        body = self._pending.lstrip()
        if body.startswith(self.START):
            self._pending, self._start_dropped = body[len(self.START):], True
        elif not final and self.START.startswith(body):
            return  # only whitespace, or the beginning of START, so far
        self.phase = _REASONING

    def _take_reasoning(self, final: bool) -> str:
        head = self._drop_first_start()
        end = self._pending.find(self.END)
        if end >= 0:
            reasoning, self._pending = head + self._pending[:end], self._pending[end + len(self.END):]
            self.phase = _CONTENT
            return reasoning
        cut = len(self._pending) - (0 if final else self._held_back())
        reasoning, self._pending = head + self._pending[:cut], self._pending[cut:]
        return reasoning

    def _drop_first_start(self) -> str:
        """Where the first START inside the reasoning comes before any END: drop it (as vLLM's streaming
        does), return the reasoning before it and keep what follows pending."""
        if self._start_dropped:
            return ""
        start, end = self._pending.find(self.START), self._pending.find(self.END)
        if start < 0 or 0 <= end < start:
            return ""
        head, self._pending = self._pending[:start], self._pending[start + len(self.START):]
        self._start_dropped = True
        return head

    def _held_back(self) -> int:
        """Length of the end of the pending text that may still become a tag."""
        held = partial_tag_length(self._pending, self.END, 0)
        if not self._start_dropped:
            held = max(held, partial_tag_length(self._pending, self.START, 0))
        return held


def split_reasoning(parser: ReasoningParser, text: str) -> tuple[str | None, str | None]:
    """A whole output as vLLM's extract_reasoning gives it: (reasoning, content). Reasoning is None where the
    output has none to split off (thinking off; mistral's without [THINK]), else a string, empty too; content
    is None where nothing follows the reasoning."""
    delta = parser.feed(text, final=True)
    if not parser.has_reasoning:
        return None, delta.content
    return delta.reasoning, delta.content or None


# -- registry ------------------------------------------------------------------------------------


# Built in below; a --reasoning-parser-plugin file adds its own (or replaces one) with the same decorator.
REASONING_PARSERS: ParserRegistry[type[ReasoningParser]] = ParserRegistry("reasoning parser", ReasoningParser)


def register_reasoning_parser(cls: type[ReasoningParser]) -> type[ReasoningParser]:
    """Class decorator: makes the parser available under its ``name`` (a name taken before becomes its)."""
    return REASONING_PARSERS.register(cls)


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered under ``name``; a ValueError naming the known ones otherwise."""
    return REASONING_PARSERS.lookup(name)


@register_reasoning_parser
class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 (and QwQ): its template may open <think> in the prompt, so the output may hold only the
    end."""

    name = "deepseek_r1"


@register_reasoning_parser
class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: as deepseek_r1, but ``chat_template_kwargs={"enable_thinking": False}`` makes it all content."""

    name = "qwen3"

    @classmethod
    def thinking_on(cls, chat_template_kwargs: Mapping[str, Any]) -> bool:
        return bool(chat_template_kwargs.get("enable_thinking", True))


@register_reasoning_parser
class DeepSeekV3ReasoningParser(ReasoningParser):
    """DeepSeek-V3.1: reasons only when asked (``thinking`` or ``enable_thinking`` true), then as
    deepseek_r1; otherwise all content."""

    name = "deepseek_v3"

    @classmethod
    def thinking_on(cls, chat_template_kwargs: Mapping[str, Any]) -> bool:
        return bool(chat_template_kwargs.get("thinking")) or bool(chat_template_kwargs.get("enable_thinking"))


@register_reasoning_parser
class SeedOssReasoningParser(ReasoningParser):
    """Seed-OSS: as deepseek_r1 between <seed:think> and </seed:think> (its thinking budget's reflections,
    <seed:cot_budget_reflect>, are reasoning text)."""

    name = "seed_oss"
    START = SEED_OSS_THINK_START
    END = SEED_OSS_THINK_END


@register_reasoning_parser
class Olmo3ReasoningParser(ReasoningParser):
    """OLMo 3 Think (vLLM's "olmo3"): as deepseek_r1 (its template opens <think> in the prompt; the tags are
    plain text there), but reasoning that is empty, ``<think></think>`` or an output opening with
    </think>, is none (reasoning None), as vLLM gives it. An output that never writes </think> is reasoning,
    streamed or whole (vLLM streams it as reasoning; its whole-output read calls it content)."""

    name = "olmo3"

    def __init__(self, chat_template_kwargs: Mapping[str, Any] | None = None, prompt: str = "") -> None:
        super().__init__(chat_template_kwargs, prompt)
        self._reasoned = False  # some reasoning text came

    @property
    def has_reasoning(self) -> bool:
        return self._reasoned

    def feed(self, delta: str, final: bool = False) -> ReasoningDelta:
        piece = super().feed(delta, final)
        self._reasoned |= bool(piece.reasoning)
        return piece


@register_reasoning_parser
class Ernie45ReasoningParser(ReasoningParser):
    """ERNIE 4.5 Thinking (vLLM's "ernie45": ERNIE-4.5-21B-A3B-Thinking): as deepseek_r1 (its template opens
    <think> in the prompt), the answer after </think> unwrapped from its ``<response>\\n...\\n</response>``:
    the newlines after </think> and after </response> go, and the two tags, the text between them kept as
    it is, so ``R\\n</think>\\n\\n<response>\\nA\\n</response>\\n`` is reasoning "R\\n" and content "\\nA\\n".
    Tool calls follow in Hermes' <tool_call> blocks (the ernie45 tool parser reads them), after </think> or
    after </response>. As vLLM streams it, the newlines after </think> go even without <response>; only a
    <response> that opens the answer is a tag (vLLM also looks for one later in a whole output)."""

    name = "ernie45"

    def __init__(self, chat_template_kwargs: Mapping[str, Any] | None = None, prompt: str = "") -> None:
        super().__init__(chat_template_kwargs, prompt)
        self._answer = _LEAD
        self._held = ""  # answer text not yet given out

    def feed(self, delta: str, final: bool = False) -> ReasoningDelta:
        piece = super().feed(delta, final)
        return ReasoningDelta(piece.reasoning, self._unwrap(piece.content, final))

    def _unwrap(self, text: str, final: bool) -> str:
        """The answer's new text less its <response> framing, holding back what may still be a tag."""
        self._held += text
        out: list[str] = []
        while self._held:
            if self._answer in (_LEAD, _TRAIL):
                if not self._take_framing(final):
                    break
            elif self._answer == _RESPONSE:
                if not self._take_response(out, final):
                    break
            else:
                out.append(self._held)
                self._held = ""
        return "".join(out)

    def _take_framing(self, final: bool) -> bool:
        """Newlines before <response> or after </response> dropped, and <response> where it opens the answer;
        whether what follows was decided."""
        self._held = self._held.lstrip("\n")
        if not self._held:
            return False
        if self._answer == _LEAD and self._held.startswith(ERNIE_RESPONSE_START):
            self._held, self._answer = self._held[len(ERNIE_RESPONSE_START):], _RESPONSE
            return True
        if self._answer == _LEAD and not final and ERNIE_RESPONSE_START.startswith(self._held):
            return False  # may still become <response>
        self._answer = _PLAIN
        return True

    def _take_response(self, out: list[str], final: bool) -> bool:
        """The response's text up to </response> (dropped), or up to text that may become it; whether it
        closed."""
        text, self._held, tag = _take_until(self._held, (ERNIE_RESPONSE_END,), final)
        out.append(text)
        if tag is None:
            return False
        self._answer = _TRAIL
        return True


class OpeningReasoningParser(ReasoningParser):
    """The output is content until the model opens its reasoning with one of ``STARTS`` (without one there
    is none: reasoning None); the reasoning runs to the first of ``ENDS`` (or the output's end, cut short),
    and all after it is content, as is text before the opening. With ``DROPS_STRAY_END``, a first end with
    no opening before it is dropped."""

    STARTS: tuple[str, ...] = ()
    ENDS: tuple[str, ...] = ()
    DROPS_STRAY_END = False

    def __init__(self, chat_template_kwargs: Mapping[str, Any] | None = None, prompt: str = "") -> None:
        super().__init__(chat_template_kwargs, prompt)
        if self.thinks:
            self.phase = _BEFORE
        self._opened = False  # a start came
        self._stray_end_dropped = not self.DROPS_STRAY_END

    @classmethod
    def reasoning_over(cls, prompt: str) -> bool:
        return prompt.rstrip().endswith(cls.ENDS)

    @property
    def has_reasoning(self) -> bool:
        return self._opened

    def feed(self, delta: str, final: bool = False) -> ReasoningDelta:
        self._pending += delta
        reasoning: list[str] = []
        content: list[str] = []
        while self._pending:
            if self.phase == _BEFORE:
                if not self._take_before(content, final):
                    break
            elif self.phase == _REASONING:
                if not self._take_in_reasoning(reasoning, final):
                    break
            else:
                content.append(self._pending)
                self._pending = ""
        return ReasoningDelta("".join(reasoning), "".join(content))

    def _take_in_reasoning(self, reasoning: list[str], final: bool) -> bool:
        """Reasoning up to an end (or up to text that may become one); whether the reasoning ended."""
        text, self._pending, tag = _take_until(self._pending, self.ENDS, final)
        reasoning.append(text)
        if tag is None:
            return False
        self.phase = _CONTENT
        return True

    def _take_before(self, content: list[str], final: bool) -> bool:
        """Content up to a start (which opens the reasoning) or a first stray end (dropped, where the parser
        drops one); whether either was taken."""
        tags = self.STARTS + (() if self._stray_end_dropped else self.ENDS)
        text, self._pending, tag = _take_until(self._pending, tags, final)
        content.append(text)
        if tag is None:
            return False
        if tag in self.STARTS:
            self.phase, self._opened = _REASONING, True
        else:
            self._stray_end_dropped = True
        return True


def _take_until(pending: str, tags: tuple[str, ...], final: bool) -> tuple[str, str, str | None]:
    """``pending`` split at the first of ``tags``: (the text before it, the text after it, the tag); without
    one, (all but an end that may still become a tag, that end, None), the whole where ``final``."""
    found = _first_of(pending, tags)
    if found is None:
        cut = len(pending) - (0 if final else _partial_length(pending, tags))
        return pending[:cut], pending[cut:], None
    at, tag = found
    return pending[:at], pending[at + len(tag):], tag


def _first_of(text: str, tags: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest of ``tags`` in ``text`` (where, which), None without one."""
    found = [(at, tag) for tag in tags if (at := text.find(tag)) >= 0]
    return min(found) if found else None


def _partial_length(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that begins one of ``tags``."""
    return max(partial_tag_length(text, tag, 0) for tag in tags)


@register_reasoning_parser
class MistralReasoningParser(OpeningReasoningParser):
    """Magistral (vLLM's "mistral"): reasoning between [THINK] and [/THINK], special tokens of its tokenizer
    (so the output is detokenized with them, ``skip_special_tokens``). As vLLM's, the output is content
    until the model writes [THINK], which begins the reasoning (without it there is none: reasoning None);
    the reasoning runs to the first [/THINK] (or the output's end, cut short), and all after it is content,
    as is text before [THINK] (which a model should not write). A [/THINK] with no [THINK] before it is
    dropped, the first only (vLLM keeps one that a later [THINK] follows; streamed, that cannot be known
    when it comes)."""

    name = "mistral"
    START = MISTRAL_THINK_START
    END = MISTRAL_THINK_END
    STARTS = (MISTRAL_THINK_START,)
    ENDS = (MISTRAL_THINK_END,)
    DROPS_STRAY_END = True
    MARKERS_ARE_SPECIAL_TOKENS = True


@register_reasoning_parser
class GraniteReasoningParser(OpeningReasoningParser):
    """IBM Granite 3.2 / 3.3 (vLLM's "granite"): asked to think (its template's ``thinking`` variable, without
    which the output is all content), it writes "Here is my thought process:", its reasoning, "Here is my
    response:" and the answer, plain text ("Here's" too, as vLLM matches). As vLLM's, text outside that is
    content and an output without the first phrase has no reasoning. One cut short before "Here is my
    response:" is reasoning, streamed or whole (vLLM's whole-output read calls it content, its streaming
    reasoning)."""

    name = "granite"
    STARTS = GRANITE_THOUGHT_STARTS
    ENDS = GRANITE_RESPONSE_STARTS
    START, END = STARTS[0], ENDS[0]  # END: where a structured output begins (the phrase its template asks)

    @classmethod
    def thinking_on(cls, chat_template_kwargs: Mapping[str, Any]) -> bool:
        return bool(chat_template_kwargs.get("thinking"))


# gpt-oss's harmony messages (plait.entrypoints.tool_parsers holds the format's tokens).
HARMONY_REASONING_CHANNEL = "analysis"
# A header naming a function recipient (HARMONY_FUNCTION_RECIPIENT) makes the message a tool call, which
# the "openai" tool parser reads.
HARMONY_TOKEN_PREFIX = "<|"  # every harmony token's start: a header without one is no harmony at all
HARMONY_TOOL_CALL = "tool call"  # the parser's name for such a message's channel
_HARMONY_CHANNEL_NAME = re.compile(re.escape(HARMONY_CHANNEL) + r"\s*(\w+)")


@register_reasoning_parser
class GptOssReasoningParser(ReasoningParser):
    """gpt-oss (vLLM's "openai_gptoss"): the output is harmony messages. The text of analysis-channel messages
    is the reasoning; that of every other message (final, commentary) is the content; headers and end tokens
    are neither. A message to a recipient (a tool call: ``to=functions.NAME`` in its header) is passed to the
    content whole, header and end token included, for the ``openai`` tool parser to read. An output without
    a harmony token (a model not writing harmony) is content, given when it ends."""

    name = "openai_gptoss"
    MARKERS_ARE_SPECIAL_TOKENS = True

    def __init__(self, chat_template_kwargs: Mapping[str, Any] | None = None, prompt: str = "") -> None:
        super().__init__(chat_template_kwargs, prompt)
        self._header = ""  # the current message's header, up to its <|message|>
        self._channel = self._prompt_channel(prompt)  # None: in a header
        self._opened = self._channel == HARMONY_REASONING_CHANNEL

    @property
    def has_reasoning(self) -> bool:
        return self._opened

    @classmethod
    def reasoning_over(cls, prompt: str) -> bool:
        return False  # analysis messages may follow a final one in the same output

    @staticmethod
    def _prompt_channel(prompt: str) -> str | None:
        """The channel of a message the prompt opened (a template may end with ``...<|message|>``)."""
        header = prompt[prompt.rfind(HARMONY_START):] if HARMONY_START in prompt else ""
        if not header.endswith(HARMONY_MESSAGE):
            return None
        return _channel_name(header)

    def feed(self, delta: str, final: bool = False) -> ReasoningDelta:
        self._pending += delta
        reasoning: list[str] = []
        content: list[str] = []
        while self._pending:
            if self._channel is None:
                if not self._take_header(content):
                    break
            else:
                text, end = self._take_body(final)
                (reasoning if self._channel == HARMONY_REASONING_CHANNEL else content).append(text)
                if end is None:
                    break
                if self._channel == HARMONY_TOOL_CALL:  # passed on whole, its end token too
                    content.append(end)
                self._channel = None
        if final and HARMONY_TOKEN_PREFIX not in self._header:
            content.append(self._header)  # an output that is not harmony at all
            self._header = ""
        return ReasoningDelta("".join(reasoning), "".join(content))

    def _take_header(self, content: list[str]) -> bool:
        """The header up to <|message|>, which opens the message's body; whether it came."""
        header = self._header + self._pending
        at = header.find(HARMONY_MESSAGE)
        if at < 0:
            self._header, self._pending = header, ""
            return False
        self._channel = _channel_name(header[:at])
        if HARMONY_FUNCTION_RECIPIENT.search(header[:at]) is not None:
            self._channel = HARMONY_TOOL_CALL
            content.append(header[:at + len(HARMONY_MESSAGE)])
        self._header, self._pending = "", header[at + len(HARMONY_MESSAGE):]
        self._opened |= self._channel == HARMONY_REASONING_CHANNEL
        return True

    def _take_body(self, final: bool) -> tuple[str, str | None]:
        """(the body's text up to its end token, or up to text that may become one; the end token, None
        while the body goes on)."""
        found = [(at, end) for end in HARMONY_ENDS if (at := self._pending.find(end)) >= 0]
        if not found:
            held = 0 if final else max(partial_tag_length(self._pending, end, 0) for end in HARMONY_ENDS)
            cut = len(self._pending) - held
            text, self._pending = self._pending[:cut], self._pending[cut:]
            return text, None
        at, end = min(found)
        text, self._pending = self._pending[:at], self._pending[at + len(end):]
        return text, end


def _channel_name(header: str) -> str:
    """A harmony header's channel; "final" for a header that names none."""
    match = _HARMONY_CHANNEL_NAME.search(header)
    return match[1] if match else "final"
