"""Tool-call parsing (plait/entrypoints/tool_parsers.py, tools.py) on strings: whole outputs, and the same
outputs streamed in random pieces, which must give the same content and calls."""

from __future__ import annotations

import json
import random

import pytest

from plait.entrypoints.tool_parsers import (
    TOOL_PARSERS,
    ParsedToolCall,
    ToolOutputParser,
    collect,
    get_tool_parser,
    parse_whole,
)
from plait.entrypoints.tools import (
    TOOL_CALL_ID_PREFIX,
    NamedToolOutput,
    RequiredToolsOutput,
    ToolCallStream,
    required_tools_schema,
)

NUM_SPLITS = 40  # random splittings of each output
MAX_PIECE = 6  # characters per streamed piece at most

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TIME = '{"name": "get_time", "arguments": {}}'
# (parser, output, content, [(name, arguments)])
CASES = [
    ("hermes", "Just text, no call.", "Just text, no call.", []),
    ("hermes", f"<tool_call>\n{WEATHER}\n</tool_call>", "", [("get_weather", {"city": "Paris"})]),
    ("hermes", f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>", "\n",
     [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("hermes", f"Let me check.\n<tool_call>{WEATHER}</tool_call>", "Let me check.\n",
     [("get_weather", {"city": "Paris"})]),
    # a malformed call is content, tags and all; the good one beside it is still a call
    ("hermes", f'<tool_call>{{"name": oops}}</tool_call> <tool_call>{TIME}</tool_call>',
     '<tool_call>{"name": oops}</tool_call> ', [("get_time", {})]),
    ("hermes", f"<tool_call>{WEATHER}", "", [("get_weather", {"city": "Paris"})]),  # stopped before the close
    ("hermes", '<tool_call>{"name": "get_weather", "argu', '<tool_call>{"name": "get_weather", "argu', []),
    ("hermes", "a < b and <tool_ca", "a < b and <tool_ca", []),  # a tag's start that never became one
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
     [("get_weather", {"city": "Paris"})]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "get_time", "parameters": {}}', "",
     [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("llama3_json", "Paris is sunny {today}.", "Paris is sunny {today}.", []),
    ("llama3_json", '{"city": "Paris"}', '{"city": "Paris"}', []),  # JSON, but no call
    ("llama3_json", '{"name": "get_weather", "param', '{"name": "get_weather", "param', []),
    ("granite", f"<|tool_call|>[{WEATHER}, {TIME}]", "",
     [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("granite", f"<tool_call>[{WEATHER}]", "", [("get_weather", {"city": "Paris"})]),  # the tag as text
    ("granite", f"[{TIME}]", "", [("get_time", {})]),  # no tag
    ("granite", "It is [sunny] today.", "It is [sunny] today.", []),
    ("granite", f"<|tool_call|>[{WEATHER}, {{\"name\": 3}}]", ' {"name": 3}]',
     [("get_weather", {"city": "Paris"})]),  # a malformed call after a good one is content
    ("phi4_mini_json", f"functools[{WEATHER}, {TIME}]", "",
     [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("phi4_mini_json", f"[{WEATHER}]", f"[{WEATHER}]", []),  # without the word: content, as vLLM's
    ("phi4_mini_json", "functional programming", "functional programming", []),
    ("phi4_mini_json", "func", "func", []),  # the start of the word, never finished
    ("pythonic", '[get_weather(city="Paris", days=[1, 2]), get_time()]', "",
     [("get_weather", {"city": "Paris", "days": [1, 2]}), ("get_time", {})]),
    ("pythonic", ' [f(a=None, b=True, c={"k": 1.5})]', "", [("f", {"a": None, "b": True, "c": {"k": 1.5}})]),
    ("pythonic", "The answer is 4.", "The answer is 4.", []),
    ("pythonic", "[1, 2, 3]", "[1, 2, 3]", []),  # a list, but not of calls
    ("pythonic", '[f("positional")]', '[f("positional")]', []),
    ("pythonic", "[f(x=y)]", "[f(x=y)]", []),  # not a literal
    ("pythonic", '[get_weather(city="Par', '[get_weather(city="Par', []),  # cut short: content
    ("pythonic", "[f()] and more", "[f()] and more", []),  # text after the list: no call, whole or streamed
]


def _calls(calls: list[ParsedToolCall]) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


def _streamed(parser: ToolOutputParser, text: str, seed: int) -> tuple[str, list[ParsedToolCall]]:
    rng = random.Random(seed)
    events, start = [], 0
    while start < len(text):
        size = rng.randint(1, MAX_PIECE)
        events += parser.feed(text[start:start + size])
        start += size
    events += parser.feed("", final=True)
    return collect(events)


@pytest.mark.parametrize("name,text,content,calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_parsers_read_calls_and_content_whole_and_streamed(name, text, content, calls):
    parser = get_tool_parser(name)
    whole = parse_whole(parser(), text)
    assert whole[0] == content and _calls(whole[1]) == calls
    for seed in range(NUM_SPLITS):
        assert _streamed(parser(), text, seed) == whole, seed


def test_streaming_holds_back_only_what_may_be_a_call():
    parser = get_tool_parser("hermes")()
    assert parser.feed("Sure <tool") == ["Sure "]  # "<tool" may begin a tag
    assert parser.feed("_call>{") == []  # inside a call: nothing decided until it closes
    events = parser.feed('"name": "f", "arguments": {"a": 1}}</tool_call>')
    assert _calls(collect(events)[1]) == [("f", {"a": 1})]
    assert TOOL_PARSERS.keys() >= {"hermes", "llama3_json", "granite", "phi4_mini_json", "pythonic"}
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'"):
        get_tool_parser("nope")


def test_required_and_named_outputs():
    text = ('[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
            '{"name": "get_time", "parameters": {}}]')
    assert _calls(parse_whole(RequiredToolsOutput(), text)[1]) == [("get_weather", {"city": "Paris"}),
                                                                     ("get_time", {})]
    for seed in range(NUM_SPLITS):
        assert _streamed(RequiredToolsOutput(), text, seed) == parse_whole(RequiredToolsOutput(), text)
    cut = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_ti'
    content, calls = parse_whole(RequiredToolsOutput(), cut)  # cut short by max_tokens: the rest is content
    assert _calls(calls) == [("get_weather", {"city": "Paris"})] and content.strip() == '{"name": "get_ti'
    named = NamedToolOutput("get_weather")
    assert collect(named.feed('{"city": ') + named.feed('"Paris"}', final=True))[1] == [
        ParsedToolCall("get_weather", '{"city": "Paris"}')]


def test_tool_call_stream_trims_content_gives_ids_and_honours_parallel_false():
    stream = ToolCallStream(get_tool_parser("hermes")(), max_calls=1)
    pieces = ["  Let me", " check. \n", f"<tool_call>{WEATHER}</tool_call>\n",
              f"<tool_call>{TIME}</tool_call>"]
    content, deltas = zip(*(stream.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)))
    assert "".join(content) == "Let me check."  # leading and trailing whitespace gone, inner kept
    (call,) = [d for ds in deltas for d in ds]  # the second call dropped: parallel_tool_calls false
    assert call.index == 0 and call.name == "get_weather" and call.id.startswith(TOOL_CALL_ID_PREFIX)
    assert stream.finish_reason("stop") == "tool_calls" and stream.finish_reason("length") == "length"
    named = ToolCallStream(NamedToolOutput("get_weather"))
    named.feed("{}", final=True)
    assert named.finish_reason("stop") == "stop"  # a named tool_choice keeps "stop", as OpenAI and vLLM
    plain = ToolCallStream(get_tool_parser("hermes")())
    assert plain.feed("no call", final=True) == ("no call", []) and plain.finish_reason("stop") == "stop"


def test_required_schema_as_vllm():
    params = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}},
              "$defs": {"P": {"type": "string"}}}
    schema = required_tools_schema({"f": params, "g": None}, parallel=False)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert schema["$defs"] == {"P": {"type": "string"}} and "$defs" in params  # hoisted from a copy
    f, g = schema["items"]["anyOf"]
    assert f["properties"]["name"] == {"type": "string", "enum": ["f"]} and "$defs" not in f["properties"]
    assert g["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert "maxItems" not in required_tools_schema({"f": None}, parallel=True)
    other = {"$defs": {"P": {"type": "integer"}}}
    with pytest.raises(ValueError, match="differently"):
        required_tools_schema({"f": params, "g": other}, parallel=True)


def test_messages_pass_tool_calls_to_templates_with_arguments_as_objects():
    pytest.importorskip("pydantic")  # the server's request models (not on every machine the engine runs on)
    from plait.entrypoints.protocol import ChatMessage

    message = ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]})
    rendered = message.as_template_message()
    assert rendered["content"] == ""
    assert [c["function"]["arguments"] for c in rendered["tool_calls"]] == [{"a": 1}, "not json"]
    tool = ChatMessage.model_validate({"role": "tool", "tool_call_id": "c1", "content": "42"})
    assert tool.as_template_message() == {"role": "tool", "content": "42", "tool_call_id": "c1"}
