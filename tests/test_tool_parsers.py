"""Tool-call parsing (plait/entrypoints/tool_parsers.py, tools.py) on strings: whole outputs, and the same
outputs streamed in random pieces, which must give the same content and calls."""

from __future__ import annotations

import json
import random

import pytest

from plait.entrypoints.tool_parsers import (
    TOOL_PARSERS,
    ParsedToolCall,
    ToolCallStart,
    ToolOutputParser,
    collect,
    get_tool_parser,
    parse_whole,
    typed_parameter,
)
from plait.entrypoints.tools import (
    TOOL_CALL_ID_PREFIX,
    NamedToolOutput,
    RequiredToolsOutput,
    ToolCallStream,
    required_tools_schema,
)

NUM_SPLITS = 40  # random splittings of each output
CHARACTERS = None  # a _streamed seed that feeds the output a character at a time
SPLITS = (CHARACTERS, *range(NUM_SPLITS))
MAX_PIECE = 6  # characters per streamed piece at most

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TIME = '{"name": "get_time", "arguments": {}}'
# Qwen3-Coder's calls, as its template shows them to the model.
CODER_WEATHER = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                 "</tool_call>")
CODER_TIME = "<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
CODER_PARAMETER = "<parameter=a>\n1\n</parameter>\n"
# OLMo 3's pythonic calls, as vLLM's olmo3 tests write them (Python's literals, or JSON's).
OLMO_WEATHER = "get_weather(city='San Francisco', metric='celsius')"
OLMO_WEATHER_ARGUMENTS = {"city": "San Francisco", "metric": "celsius"}
OLMO_USER = ("register_user(name='John Doe', age=37, address={'city': 'San Francisco', 'state': 'CA'}, "
             "role=None, passed_test=True, aliases=['John', 'Johnny'])")
OLMO_USER_JSON = OLMO_USER.replace("None", "null").replace("True", "true")
OLMO_USER_ARGUMENTS = {"name": "John Doe", "age": 37, "address": {"city": "San Francisco", "state": "CA"},
                       "role": None, "passed_test": True, "aliases": ["John", "Johnny"]}
OLMO_ESCAPED = r"""get_weather(city='Martha\'s Vineyard', metric='\"cool units\"')"""
# ERNIE-4.5-21B-A3B-Thinking's calls, as vLLM's ernie45 tests write them.
ERNIE_TEMPERATURE = ('<tool_call>\n{"name": "get_current_temperature", '
                     '"arguments": {"location": "Beijing"}}\n</tool_call>\n')
ERNIE_UNIT = ('<tool_call>\n{"name": "get_temperature_unit", '
              '"arguments": {"location": "Guangzhou", "unit": "c"}}\n</tool_call>\n')
ERNIE_PREAMBLE = "I need to call two tools to handle these two issues separately.\n</think>\n\n"
ERNIE_CALLS = [("get_current_temperature", {"location": "Beijing"}),
               ("get_temperature_unit", {"location": "Guangzhou", "unit": "c"})]
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
    # Mistral, tokenizer v11 on (Mistral-Small-3.2, Magistral): [TOOL_CALLS] before each call, name[ARGS]{...}
    ("mistral", 'Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
     "Let me check.", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Paris"}', "",
     [("get_weather", {"city": "Paris"})]),  # no [ARGS] in the text
    ("mistral", '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"zone": "CET"}', "",
     [("get_time", {"zone": "CET"})]),  # a call id before the arguments is skipped
    # before v11 (Mistral-7B-Instruct-v0.3): one JSON array after the token
    ("mistral", f"[TOOL_CALLS] [{WEATHER}, {TIME}]", "",
     [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("mistral", '[TOOL_CALLS][{"name": "get_time"}]', "", [("get_time", {})]),  # no arguments: {}
    ("mistral", f"Just text, [no call] {WEATHER}", f"Just text, [no call] {WEATHER}", []),  # no token
    # malformed calls are content, [TOOL_CALLS] and all; a good call beside one is still a call
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": oops}[TOOL_CALLS]get_time[ARGS]{}',
     '[TOOL_CALLS]get_weather[ARGS]{"city": oops}', [("get_time", {})]),
    ("mistral", "[TOOL_CALLS]I cannot call {anything}.", "[TOOL_CALLS]I cannot call {anything}.", []),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]["Paris"]', '[TOOL_CALLS]get_weather[ARGS]["Paris"]', []),
    ("mistral", f'[TOOL_CALLS][{WEATHER}, {{"city": "Rome"}}]',
     f'[TOOL_CALLS][{WEATHER}, {{"city": "Rome"}}]', []),  # an item that is no call: all content
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Par', '[TOOL_CALLS]get_weather[ARGS]{"city": "Par',
     []),  # cut short
    ("mistral", "[TOOL_CALLS]", "[TOOL_CALLS]", []),
    ("mistral", "a [TOOL_CA", "a [TOOL_CA", []),  # the token's start that never became it
    ("mistral", '[TOOL_CALLS]get_time[ARGS]{} Done.', " Done.", [("get_time", {})]),  # text after a call
    # Qwen3-Coder; no tools given: every value a string
    ("qwen3_coder", f"Let me check.\n{CODER_WEATHER}\n{CODER_TIME}", "Let me check.\n\n",
     [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("qwen3_coder", "<tool_call><function=f><parameter=a>1</parameter><parameter=b>\n\ntwo\n\n</parameter>"
                    "</function></tool_call>", "", [("f", {"a": "1", "b": "\ntwo\n"})]),  # a newline off each
    ("qwen3_coder", "<function=f>\n<parameter=code>\nif a < b:\n    x = {}\n</parameter>\n</function>", "",
     [("f", {"code": "if a < b:\n    x = {}"})]),  # no <tool_call>, as vLLM reads it too
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=a>\nx\n<parameter=b>\ny\n</function>\n"
                    "</tool_call>", "", [("f", {"a": "x", "b": "y"})]),  # no </parameter>: a tag ends it
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=a>\nx", "", [("f", {"a": "x"})]),  # cut short
    # vLLM's qwen3_xml names the same format
    ("qwen3_xml", f"Let me check.\n{CODER_WEATHER}\n{CODER_TIME}", "Let me check.\n\n",
     [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("qwen3_coder", "<tool_call>\n<function=f>\n</function>\nDone.", "\nDone.",
     [("f", {})]),  # </tool_call> left out: what follows </function> is content
    # malformed calls are content, tags and all
    ("qwen3_coder", f'<tool_call>{TIME}</tool_call> {CODER_TIME}', f'<tool_call>{TIME}</tool_call> ',
     [("get_time", {})]),  # Hermes' JSON is not this format
    ("qwen3_coder", f"<tool_call>\n<function=f>\nsome text\n{CODER_PARAMETER}</function>\n</tool_call>",
     f"<tool_call>\n<function=f>\nsome text\n{CODER_PARAMETER}</function>\n</tool_call>", []),
    ("qwen3_coder", "Write <function={{ name }}> here.", "Write <function={{ name }}> here.", []),
    ("qwen3_coder", "<tool_call>\n<function=get_wea", "<tool_call>\n<function=get_wea", []),
    ("qwen3_coder", "a <tool_ca", "a <tool_ca", []),
    # Seed-OSS: Qwen3-Coder's calls in its own tags; Qwen3-Coder's tags are text to it
    ("seed_oss", "Checking.<seed:tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                 "</function>\n</seed:tool_call>", "Checking.", [("get_weather", {"city": "Paris"})]),
    ("seed_oss", "<seed:tool_call><function=f></function></seed:tool_call> done <tool_call>x</tool_call>",
     " done <tool_call>x</tool_call>", [("f", {})]),
    ("seed_oss", "a <seed:tool_ca", "a <seed:tool_ca", []),
    # gpt-oss (vLLM's openai): harmony messages to a function recipient, the recipient before or after the
    # channel; the rest is content as it stands (the reasoning parser's content, or raw harmony)
    ("openai", 'Checking.<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
               '<|message|>{"city": "Paris"}<|call|>', "Checking.", [("get_weather", {"city": "Paris"})]),
    ("openai", '<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}<|call|>'
               '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
               '{"city": "Paris"}', "", [("get_time", {}), ("get_weather", {"city": "Paris"})]),
    ("openai", "<|channel|>final<|message|>Hi<|return|>", "<|channel|>final<|message|>Hi<|return|>", []),
    ("openai", "a <|chan", "a <|chan", []),
    # a call's header cut short before its <|message|>
    ("openai", "<|channel|>commentary to=functions.f", "<|channel|>commentary to=functions.f", []),
    # OLMo 3 (vLLM's olmo3, its tests' outputs): one pythonic call a line inside <function_calls>
    ("olmo3", "How can I help you today?", "How can I help you today?", []),
    ("olmo3", f"<function_calls>{OLMO_WEATHER}</function_calls>", "",
     [("get_weather", OLMO_WEATHER_ARGUMENTS)]),
    ("olmo3", f"<function_calls>{OLMO_USER}</function_calls>", "", [("register_user", OLMO_USER_ARGUMENTS)]),
    ("olmo3", f"<function_calls>{OLMO_USER_JSON}</function_calls>", "",
     [("register_user", OLMO_USER_ARGUMENTS)]),  # null / true / false as JSON writes them
    ("olmo3", "<function_calls>get_weather()</function_calls>", "", [("get_weather", {})]),
    ("olmo3", "<function_calls>do_something_cool(additional_data={})\ndo_something_cool(steps=[])"
              "</function_calls>", "", [("do_something_cool", {"additional_data": {}}),
                                       ("do_something_cool", {"steps": []})]),
    ("olmo3", f"<function_calls>{OLMO_ESCAPED}</function_calls>", "",
     [("get_weather", {"city": "Martha's Vineyard", "metric": '"cool units"'})]),
    ("olmo3", f"<function_calls>{OLMO_WEATHER}\n{OLMO_USER}</function_calls>", "",
     [("get_weather", OLMO_WEATHER_ARGUMENTS), ("register_user", OLMO_USER_ARGUMENTS)]),
    ("olmo3", f"Let me check.\n<function_calls>\n{OLMO_WEATHER}\n</function_calls>", "Let me check.\n",
     [("get_weather", OLMO_WEATHER_ARGUMENTS)]),  # text outside the block is content
    ("olmo3", "<function_calls>get_time()", "", [("get_time", {})]),  # stopped before the close
    # a block that is not all calls is content, tags and all
    ("olmo3", "<function_calls>foo(x=1])</function_calls>", "<function_calls>foo(x=1])</function_calls>", []),
    ("olmo3", f"<function_calls>bad(x=b'z')\n{OLMO_WEATHER}</function_calls>",
     f"<function_calls>bad(x=b'z')\n{OLMO_WEATHER}</function_calls>", []),  # bytes: no JSON value
    ("olmo3", f"<function_calls>calc(x=1e999)\n{OLMO_WEATHER}</function_calls>",
     f"<function_calls>calc(x=1e999)\n{OLMO_WEATHER}</function_calls>", []),  # inf: no JSON value
    ("olmo3", "<function_calls>Sunny, 20 degrees.</function_calls>",
     "<function_calls>Sunny, 20 degrees.</function_calls>", []),
    ("olmo3", "<function_calls></function_calls>", "<function_calls></function_calls>", []),
    ("olmo3", "<function_calls>get_weather(city='Par", "<function_calls>get_weather(city='Par",
     []),  # cut short
    ("olmo3", OLMO_WEATHER, OLMO_WEATHER, []),  # without the tags: content, as vLLM streams it
    ("olmo3", "a <function_ca", "a <function_ca", []),
    # ERNIE 4.5 (vLLM's ernie45, its tests' outputs): Hermes' calls
    ("ernie45", "This is a test", "This is a test", []),
    ("ernie45", ERNIE_TEMPERATURE, "\n", ERNIE_CALLS[:1]),
    ("ernie45", ERNIE_TEMPERATURE + ERNIE_UNIT, "\n\n", ERNIE_CALLS),
    ("ernie45", ERNIE_PREAMBLE + ERNIE_TEMPERATURE + ERNIE_UNIT, ERNIE_PREAMBLE + "\n\n", ERNIE_CALLS),
    ("ernie45", '<tool_call>\n{"name": "f", "arguments": oops}\n</tool_call>',
     '<tool_call>\n{"name": "f", "arguments": oops}\n</tool_call>', []),  # malformed: content
]


def _calls(calls: list[ParsedToolCall]) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


def _streamed(parser: ToolOutputParser, text: str, seed: int | None
              ) -> tuple[str, list[ParsedToolCall]]:
    rng = random.Random(seed)
    events, start = [], 0
    while start < len(text):
        size = 1 if seed is CHARACTERS else rng.randint(1, MAX_PIECE)
        events += parser.feed(text[start:start + size])
        start += size
    events += parser.feed("", final=True)
    return collect(events)


@pytest.mark.parametrize("name,text,content,calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_parsers_read_calls_and_content_whole_and_streamed(name, text, content, calls):
    parser = get_tool_parser(name)
    whole = parse_whole(parser(), text)
    assert whole[0] == content and _calls(whole[1]) == calls
    for seed in SPLITS:
        assert _streamed(parser(), text, seed) == whole, seed


def _check_whole_and_streamed(make_parser, text: str) -> tuple[str, list[ParsedToolCall]]:
    whole = parse_whole(make_parser(), text)
    for seed in SPLITS:
        assert _streamed(make_parser(), text, seed) == whole, (seed, text)
    return whole


# Qwen3-Coder's arguments typed by the request's tools, as vLLM's qwen3_coder types them.
CODER_FUNCTIONS = {"f": {"type": "object", "properties": {
    "n": {"type": "integer"}, "x": {"type": "number"}, "whole": {"type": "number"}, "ok": {"type": "boolean"},
    "obj": {"type": "object"}, "items": {"type": "array"}, "py": {"type": "array"}, "s": {"type": "string"},
    "maybe": {"type": ["integer", "null"]}, "any": {"anyOf": [{"type": "null"}, {"type": "integer"}]},
    "nullable_s": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "bad_n": {"type": "integer"},
    "choice": {"enum": ["a", "b"]}}}}
# (parameter, its text, its value): a parameter given twice keeps its last value, as vLLM's dict does.
CODER_VALUES = [("n", "42", 42), ("x", "2.5", 2.5), ("whole", "3.0", 3), ("ok", "True", True),
                ("ok", "no", False), ("obj", '{"k": [1, null]}', {"k": [1, None]}),
                ("items", '["a", 1]', ["a", 1]), ("py", "['a', None]", ["a", None]), ("s", " 007 ", " 007 "),
                ("s", "null", "null"), ("maybe", "null", None), ("any", "7", 7), ("nullable_s", "None", None),
                ("bad_n", "many", "many"), ("choice", "a", "a"), ("undeclared", "5", "5"),
                ("x", "inf", "inf")]


def test_qwen3_coder_types_arguments_by_the_tools_schemas():
    body = "".join(f"<parameter={key}>\n{text}\n</parameter>\n" for key, text, _ in CODER_VALUES)
    text = f"On it.\n<tool_call>\n<function=f>\n{body}</function>\n</tool_call>"
    parser = get_tool_parser("qwen3_coder")
    content, calls = _check_whole_and_streamed(lambda: parser(CODER_FUNCTIONS), text)
    assert content == "On it.\n"
    assert _calls(calls) == [("f", {key: value for key, _, value in CODER_VALUES})]
    untyped = parse_whole(parser(), text)[1]  # no tools: every value is its text
    assert _calls(untyped) == [("f", {key: text for key, text, _ in CODER_VALUES})]
    assert _calls(parse_whole(parser({"g": None}), text)[1]) == _calls(untyped)  # f is not among the tools
    assert typed_parameter("{'a': (1, 2)}", {"type": "object"}) == {"a": (1, 2)}  # a list once in JSON
    assert typed_parameter('"{\'a\': 1}"', {"type": "object"}) == {"a": 1}  # JSON of a Python literal's text
    assert typed_parameter("{1, 2}", {"type": "object"}) == "{1, 2}"  # a set: no JSON value, so text


def test_mistral_calls_get_mistral_ids_and_ask_for_special_tokens():
    parser = get_tool_parser("mistral")()
    events = parser.feed('[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]get_weather[ARGS]{"a": 1}', final=True)
    ids = [e.id for e in events if isinstance(e, ToolCallStart)]
    assert len(ids) == 2 and len(set(ids)) == 2
    assert all(len(i) == 9 and i.isalnum() and i.isascii() for i in ids)  # vLLM's MistralToolCall ids
    mistral, hermes = get_tool_parser("mistral"), get_tool_parser("hermes")
    # [TOOL_CALLS] is a special token: as vLLM's adjust_request, a request with tools keeps special tokens
    assert mistral.skip_special_tokens(True, tools_in_play=True) is False
    assert mistral.skip_special_tokens(True, tools_in_play=False) is True
    assert hermes.skip_special_tokens(True, tools_in_play=True) is True
    assert hermes.skip_special_tokens(False, tools_in_play=True) is False
    assert all(e.id is None for e in hermes().feed(f"<tool_call>{TIME}</tool_call>", final=True)
               if isinstance(e, ToolCallStart))  # the others leave ids to the stream
    assert get_tool_parser("llama3_json")(CODER_FUNCTIONS).functions == CODER_FUNCTIONS  # all take them


def test_random_outputs_stream_as_they_parse_whole():
    """Outputs made of marker pieces, whole markers, JSON and text in any order: streamed in random pieces,
    the same content and calls as whole, whatever the parser."""
    fragments = {
        "mistral": ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[TOOL_", "[", "]", "f", "g h", "{", "}", '"', ",",
                    '{"a": 1}', " ", "\n", WEATHER, "[{", '"name"', ":"],
        "qwen3_coder": ["<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=",
                        "</parameter>", "<tool", "</", "<", ">", "f", "n", "x y", "1", "\n", " ", "{"],
        "seed_oss": ["<seed:tool_call>", "</seed:tool_call>", "<tool_call>", "<function=", "</function>",
                     "<parameter=", "</parameter>", "<seed:", "</", "<", ">", "f", "x y", "1", "\n"],
        "openai": ["<|start|>assistant", "<|channel|>commentary", " to=functions.f", "<|message|>",
                   "<|call|>", "<|end|>", "<|", "<|ca", "|>", "{", '"a": 1', "}", " ", "x"],
        "olmo3": ["<function_calls>", "</function_calls>", "<function_", "</", "<", "f(", "a=1", ", ", ")",
                  "x=null", "'s'", "\n", " ", "[", "]", "g()"],
        "ernie45": ["<tool_call>", "</tool_call>", "<tool_", "</", "<", "\n", WEATHER, "{", "}", "</think>"],
    }
    rng = random.Random(0)
    for i in range(400):
        name = rng.choice(sorted(fragments))
        text = "".join(rng.choice(fragments[name]) for _ in range(rng.randint(0, 14)))
        parser = get_tool_parser(name)
        whole = parse_whole(parser(CODER_FUNCTIONS), text)
        for seed in range(5):
            assert _streamed(parser(CODER_FUNCTIONS), text, seed) == whole, (i, name, text)


GPT_OSS_OUTPUT = ('<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant'
                  '<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant'
                  '<|channel|>commentary to=functions.get_weather <|constrain|>json'
                  '<|message|>{"city": "Paris"}<|call|>')
# OLMo 3 Think's template opens <think> in the prompt.
OLMO_THINK_PROMPT = "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<think>"
# (reasoning parser, prompt, tool parser, output, reasoning, content stripped, calls)
THROUGH_REASONING = [
    ("openai_gptoss", "<|start|>user<|message|>?<|end|><|start|>assistant", "openai", GPT_OSS_OUTPUT,
     "Need weather.", "Checking.", [("get_weather", {"city": "Paris"})]),
    # ERNIE-4.5-21B-A3B-Thinking: calls after </think>, or after its <response>
    ("ernie45", "", "ernie45", f"Two things.\n</think>\n\n\n{ERNIE_TEMPERATURE}{ERNIE_UNIT}", "Two things.\n",
     "", ERNIE_CALLS),
    ("ernie45", "", "ernie45", f"R\n</think>\n<response>\nLet me check.\n</response>\n\n{ERNIE_TEMPERATURE}",
     "R\n", "Let me check.", ERNIE_CALLS[:1]),
    ("olmo3", OLMO_THINK_PROMPT, "olmo3", "The user wants the weather.\n</think>\n\n<function_calls>"
     f"{OLMO_WEATHER}</function_calls>", "The user wants the weather.\n", "",
     [("get_weather", OLMO_WEATHER_ARGUMENTS)]),
]


def _streamed_through(reasoner, tools: ToolOutputParser, output: str, seed: int | None
                      ) -> tuple[str, str, list[ParsedToolCall]]:
    """An output streamed in random pieces through a reasoning parser, whose content the tool parser reads:
    (reasoning, content, calls)."""
    rng, start, reasoning, events = random.Random(seed), 0, "", []
    while start <= len(output):
        size = 1 if seed is CHARACTERS else rng.randint(1, MAX_PIECE)
        final = start + size > len(output)
        delta = reasoner.feed(output[start:start + size], final=final)
        reasoning += delta.reasoning
        events += tools.feed(delta.content, final=final)
        start += size
    content, calls = collect(events)
    return reasoning, content, calls


@pytest.mark.parametrize("reasoning_name,prompt,tool_name,output,reasoning,content,calls", THROUGH_REASONING,
                         ids=[case[0] for case in THROUGH_REASONING])
def test_calls_pass_through_the_reasoning_parser(reasoning_name, prompt, tool_name, output, reasoning,
                                                 content, calls):
    """Behind a reasoning parser, the tool parser reads calls from the content: the reasoning, the text
    beside the calls and each call apart, whole and however the output streams."""
    from plait.entrypoints.reasoning_parsers import get_reasoning_parser, split_reasoning

    reasoner, tools = get_reasoning_parser(reasoning_name), get_tool_parser(tool_name)
    whole_reasoning, answer = split_reasoning(reasoner(None, prompt), output)
    whole_content, whole_calls = parse_whole(tools(), answer or "")
    assert (whole_reasoning, whole_content.strip(), _calls(whole_calls)) == (reasoning, content, calls)
    for seed in SPLITS:
        streamed = _streamed_through(reasoner(None, prompt), tools(), output, seed)
        assert streamed == (reasoning, whole_content, whole_calls), seed
    assert tools.skip_special_tokens(True, tools_in_play=True) is (tool_name != "openai")


def test_ernie45_content_is_vllms_once_trimmed():
    """vLLM's ernie45 keeps only the text before the first call, less its trailing newlines; here the text
    around the calls is content, which the chat stream trims to the same."""
    stream = ToolCallStream(get_tool_parser("ernie45")())
    content, deltas = stream.feed(ERNIE_PREAMBLE + ERNIE_TEMPERATURE + ERNIE_UNIT, final=True)
    assert content == "I need to call two tools to handle these two issues separately.\n</think>"
    assert [(d.name, json.loads(d.arguments)) for d in deltas] == ERNIE_CALLS


def test_streaming_holds_back_only_what_may_be_a_call():
    parser = get_tool_parser("hermes")()
    assert parser.feed("Sure <tool") == ["Sure "]  # "<tool" may begin a tag
    assert parser.feed("_call>{") == []  # inside a call: nothing decided until it closes
    events = parser.feed('"name": "f", "arguments": {"a": 1}}</tool_call>')
    assert _calls(collect(events)[1]) == [("f", {"a": 1})]
    mistral = get_tool_parser("mistral")()
    assert mistral.feed("Sure [TOOL") == ["Sure "]
    assert mistral.feed("_CALLS]get_weather[ARGS]{") == []  # a call: nothing decided until its JSON is whole
    assert _calls(collect(mistral.feed('"city": "Paris"}'))[1]) == [("get_weather", {"city": "Paris"})]
    coder = get_tool_parser("qwen3_coder")()
    assert coder.feed("Sure <tool_call>\n<function=f>\n<parameter=a>\n") == ["Sure "]
    assert _calls(collect(coder.feed("1\n</parameter>\n</function>\n</tool_call>"))[1]) == [("f", {"a": "1"})]
    olmo = get_tool_parser("olmo3")()
    assert olmo.feed("Sure <function_ca") == ["Sure "]  # may begin the block
    assert olmo.feed("lls>get_time()\n") == []  # inside the block: nothing decided until it closes
    assert _calls(collect(olmo.feed("</function_calls>"))[1]) == [("get_time", {})]
    assert TOOL_PARSERS.keys() >= {"hermes", "llama3_json", "granite", "phi4_mini_json", "pythonic",
                                   "mistral", "qwen3_coder", "olmo3", "ernie45"}
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
