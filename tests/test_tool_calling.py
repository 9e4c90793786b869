"""Tool calling on /v1/chat/completions end to end: a real server started with --chat-template (a tool-aware
template for the default model, whose own knows no tools) and --tool-call-parser hermes, the openai client.

Tests whose whole output a guided_regex forces serve tiny_default_vocab_model (a random tiny Llama with the
default model's tokenizer and chat template): their answers depend only on the tokenizer and the template,
and it decodes ~20x faster. The others ask the default model itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")  # named and "required" tool choices are structured outputs
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from conftest import idle_serving_engine  # noqa: E402

from plait.entrypoints.llm import apply_chat_template  # noqa: E402
from plait.entrypoints.server import BackgroundServer, OpenAIServer, ServerConfig  # noqa: E402
from plait.entrypoints.tools import TOOL_CALL_ID_PREFIX  # noqa: E402

TEMPLATE = Path(__file__).resolve().parent / "tool_chat_template.jinja"
CLIENT_TIMEOUT_S = 240.0
# Enough for one call to either tool (its strings are bounded by maxLength), not for a long answer.
CALL_MAX_TOKENS = 48
# "required" with parallel calls allowed: the model may start a second call, which this cuts short.
PARALLEL_MAX_TOKENS = 60
CITY_MAX_LENGTH = 20
UNITS = ["celsius", "fahrenheit"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": CITY_MAX_LENGTH},
                                  "unit": {"enum": UNITS}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a timezone",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["timezone"], "properties": {
        "timezone": {"type": "string", "maxLength": CITY_MAX_LENGTH}}}}}
TOOLS = [WEATHER, TIME]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# Tokens a regex-forced answer may take: the random tiny model picks its own (often shorter) tokens of the
# forced text (~60 of HERMES_OUTPUT_REGEX's, ~115 of Qwen3-Coder's), so the bound leaves it room.
FORCED_MAX_TOKENS = 240
# Steers the model into Hermes' format under tool_choice "auto" (the 135M model does not call tools by
# itself): some content, then two calls.
HERMES_OUTPUT_REGEX = ("Checking\\.\n<tool_call>"
                       '\\{"name":"get_weather","arguments":\\{"city":"Paris","unit":"celsius"\\}\\}'
                       "</tool_call>\n<tool_call>"
                       '\\{"name":"get_time","arguments":\\{"timezone":"CET"\\}\\}</tool_call>')


def _serve(engine):
    config = ServerConfig(log_level="warning", chat_template=str(TEMPLATE), enable_auto_tool_choice=True,
                          tool_call_parser="hermes", trust_request_chat_template=True)
    server = OpenAIServer(idle_serving_engine(engine), config)
    with BackgroundServer(server) as url:
        yield server, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                    timeout=CLIENT_TIMEOUT_S)


@pytest.fixture(scope="module")
def served(serving_engine):
    yield from _serve(serving_engine)  # the default model under a 256-token budget


@pytest.fixture(scope="module")
def served_tiny(tiny_serving_engine):
    """The same server over tiny_default_vocab_model, for answers a guided_regex forces whole."""
    yield from _serve(tiny_serving_engine)


def _is_valid_call(name: str, arguments: str) -> bool:
    """Whether a call names one of TOOLS with arguments its parameters' schema allows."""
    args = json.loads(arguments)
    if name == "get_weather":
        return (set(args) == {"city", "unit"} and isinstance(args["city"], str)
                and len(args["city"]) <= CITY_MAX_LENGTH and args["unit"] in UNITS)
    return name == "get_time" and set(args) == {"timezone"} and isinstance(args["timezone"], str)


def _accumulate(stream) -> dict[int, dict]:
    """Each choice's content, tool calls, finish reason and logprob count, from the chunks, as openai SDK
    users accumulate them (a call's first delta has its id and name, the others add to its arguments)."""
    choices: dict[int, dict] = {}
    for chunk in stream:
        for c in chunk.choices:
            choice = choices.setdefault(c.index, {"content": "", "calls": {}, "finish": None, "logprobs": 0})
            choice["content"] += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                call = choice["calls"].setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = call["id"] or tc.id
                call["name"] = call["name"] or tc.function.name
                call["arguments"] += tc.function.arguments or ""
            choice["finish"] = c.finish_reason or choice["finish"]
            choice["logprobs"] += len(c.logprobs.content) if c.logprobs and c.logprobs.content else 0
    return choices


def _calls(message) -> list[tuple[str, str]]:
    return [(call.function.name, call.function.arguments) for call in message.tool_calls or []]


def test_named_tool_choice_calls_that_function(served):
    """The answer is a call to the named function (its arguments match its schema), content null, finish
    "stop" (OpenAI's and vLLM's for a named choice); streamed, the same call in delta.tool_calls."""
    server, client = served
    kwargs = dict(model=server.model_name, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED,
                  max_tokens=CALL_MAX_TOKENS, temperature=0.0)
    r = client.chat.completions.create(**kwargs)
    choice = r.choices[0]
    (call,) = choice.message.tool_calls
    assert choice.message.content is None and choice.finish_reason == "stop"
    assert call.type == "function" and call.id.startswith(TOOL_CALL_ID_PREFIX)
    assert call.function.name == "get_weather" and _is_valid_call("get_weather", call.function.arguments)
    # --chat-template rendered the request's tools into the prompt
    rendered = apply_chat_template(server.tokenizer, MESSAGES, chat_template=TEMPLATE.read_text(),
                                   tools=TOOLS)
    assert r.usage.prompt_tokens == len(rendered)
    (streamed,) = _accumulate(client.chat.completions.create(**kwargs, stream=True)).values()
    assert streamed["content"] == "" and streamed["finish"] == "stop"
    assert [(c["name"], c["arguments"]) for c in streamed["calls"].values()] == _calls(choice.message)
    assert streamed["calls"][0]["id"].startswith(TOOL_CALL_ID_PREFIX)


def test_required_tool_choice_calls_tools(served):
    """"required": at least one call, each to one of the tools with valid arguments, finish "tool_calls";
    parallel_tool_calls false: exactly one; n > 1: each choice its own; logprobs and usage as ever."""
    server, client = served
    r = client.chat.completions.create(model=server.model_name, messages=MESSAGES, tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=False, n=2,
                                       temperature=1.0, seed=7, logprobs=True, max_tokens=CALL_MAX_TOKENS)
    for choice in r.choices:
        (call,) = _calls(choice.message)
        assert _is_valid_call(*call) and choice.finish_reason == "tool_calls"
        assert choice.message.content is None
    assert len({c.message.tool_calls[0].id for c in r.choices}) == 2
    assert sum(len(c.logprobs.content) for c in r.choices) == r.usage.completion_tokens
    stream = client.chat.completions.create(model=server.model_name, messages=MESSAGES, tools=TOOLS,
                                            tool_choice="required", max_tokens=PARALLEL_MAX_TOKENS,
                                            temperature=0.0, stream=True)
    (choice,) = _accumulate(stream).values()
    calls = choice["calls"].values()
    assert calls and all(_is_valid_call(c["name"], c["arguments"]) for c in calls)
    assert choice["finish"] in ("tool_calls", "length")  # a further call may be cut short (its text: content)


def test_a_conversation_with_tool_calls_and_results_renders(served):
    """An assistant message with tool_calls (content null) and the tool's result render under the template
    (arguments as objects, the result in <tool_response>) and get an answer."""
    server, client = served

    def assistant(arguments: str | dict) -> dict:
        function = {"name": "get_weather", "arguments": arguments}
        return {"role": "assistant", "content": None,
                "tool_calls": [{"id": "call-1", "type": "function", "function": function}]}

    result = {"role": "tool", "tool_call_id": "call-1", "content": "18 degrees and sunny"}
    messages = [*MESSAGES, assistant('{"city": "Paris", "unit": "celsius"}'), result]
    r = client.chat.completions.create(model=server.model_name, messages=messages, tools=TOOLS,
                                       tool_choice="none", max_tokens=8, temperature=0.0)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None
    parsed = {**assistant({"city": "Paris", "unit": "celsius"}), "content": ""}  # as templates get it
    as_templates_get_it = [*MESSAGES, parsed, result]
    rendered = apply_chat_template(server.tokenizer, as_templates_get_it, chat_template=TEMPLATE.read_text(),
                                   tools=TOOLS)
    assert r.usage.prompt_tokens == len(rendered)
    assert "<tool_response>\n18 degrees and sunny" in server.tokenizer.decode(rendered)


def test_auto_tool_choice_reads_hermes_calls(served_tiny):
    """tool_choice "auto" (the default with tools) under --tool-call-parser hermes: the output's
    <tool_call> blocks become tool calls, the text before them content, finish "tool_calls"; streamed
    the same (parallel_tool_calls false: the first call only), with text held back while it may be a
    call, and logprobs and usage for every token."""
    server, client = served_tiny
    kwargs = dict(model=server.model_name, messages=MESSAGES, tools=TOOLS, max_tokens=FORCED_MAX_TOKENS,
                  temperature=0.0,
                  extra_body={"guided_regex": HERMES_OUTPUT_REGEX})
    r = client.chat.completions.create(**kwargs)
    choice = r.choices[0]
    assert choice.message.content == "Checking." and choice.finish_reason == "tool_calls"
    assert [(n, json.loads(a)) for n, a in _calls(choice.message)] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "CET"})]
    stream = client.chat.completions.create(**kwargs, stream=True, logprobs=True, parallel_tool_calls=False,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    (streamed,) = _accumulate(chunks).values()
    assert streamed["content"] == "Checking." and streamed["finish"] == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed["calls"].values()] == _calls(choice.message)[:1]
    assert streamed["logprobs"] == chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_a_trusted_request_template_wins_over_the_servers(served):
    server, client = served
    r = client.chat.completions.create(model=server.model_name, messages=MESSAGES, max_tokens=1,
                                       extra_body={"chat_template": "{{ messages[0]['content'] }}"})
    content = server.tokenizer.encode(MESSAGES[0]["content"], add_special_tokens=False)
    assert r.usage.prompt_tokens == len(content)


def test_tokenize_counts_exactly_the_prompt_a_tool_calling_chat_runs(served):
    """vLLM's /tokenize takes chat completions' template fields, tools among them: the ids it returns for a
    chat body are those a chat completion of the same body runs (its usage.prompt_tokens counts them), so a
    client can count a tool-calling prompt before sending it. The tools are rendered whatever tool_choice
    says, as vLLM renders them (without --exclude-tools-when-tool-choice-none)."""
    server, client = served
    url = str(client.base_url).removesuffix("/").removesuffix("/v1")
    prefill = [*MESSAGES, {"role": "assistant", "content": "Let me check"}]
    open_end = dict(continue_final_message=True, add_generation_prompt=False)
    bodies = [
        ({"messages": MESSAGES, "tools": TOOLS}, {}),  # tool_choice "auto", the default with tools
        ({"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none"}, {}),
        ({"messages": prefill, "tools": TOOLS, "chat_template_kwargs": {"unused": 1}, **open_end}, open_end),
    ]
    for body, options in bodies:
        body = {"model": server.model_name, **body}
        tokenized = httpx.post(f"{url}/tokenize", json=body).json()
        chat = httpx.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 1},
                          timeout=CLIENT_TIMEOUT_S)
        assert chat.status_code == 200, chat.text
        assert tokenized["count"] == len(tokenized["tokens"]) == chat.json()["usage"]["prompt_tokens"]
        rendered = apply_chat_template(server.tokenizer, body["messages"], chat_template=TEMPLATE.read_text(),
                                       tools=TOOLS, **options)
        assert tokenized["tokens"] == rendered
    bare = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES}).json()
    assert bare["count"] < tokenized["count"] and "get_weather" not in server.tokenizer.decode(bare["tokens"])


def test_exclude_tools_when_tool_choice_none(served, monkeypatch):
    """vLLM's --exclude-tools-when-tool-choice-none: a request's tool_choice "none" renders no tools, in the
    chat completion and in /tokenize of the same body alike (vLLM's /tokenize, having no tool_choice, would
    still render them); "auto", said or not, still renders them."""
    server, client = served
    monkeypatch.setattr(server.config, "exclude_tools_when_tool_choice_none", True)
    url = str(client.base_url).removesuffix("/").removesuffix("/v1")
    template = TEMPLATE.read_text()
    bare = apply_chat_template(server.tokenizer, MESSAGES, chat_template=template)
    with_tools = apply_chat_template(server.tokenizer, MESSAGES, chat_template=template, tools=TOOLS)
    assert len(bare) < len(with_tools)
    cases = [({"tool_choice": "none"}, bare), ({}, with_tools), ({"tool_choice": "auto"}, with_tools)]
    for choice, rendered in cases:
        body = {"model": server.model_name, "messages": MESSAGES, "tools": TOOLS, **choice}
        assert httpx.post(f"{url}/tokenize", json=body).json()["tokens"] == rendered, choice
        chat = client.chat.completions.create(**body, max_tokens=1)
        assert chat.usage.prompt_tokens == len(rendered), choice


def test_responses_function_call_round_trip(served):
    """The Responses API on the chat path: a named tool_choice's answer is a function_call item, the chat
    completion's call (its name and arguments, a call_id), streamed through the function-call argument events
    (cut short, non-streamed: an incomplete call, its arguments so far); its output in the next turn, after
    previous_response_id, gets the chat completion's answer to the conversation with the assistant's call and
    the tool's result."""
    server, client = served
    tools = [{"type": "function", **tool["function"]} for tool in TOOLS]  # the Responses API's flat form
    kwargs = dict(model=server.model_name, input=MESSAGES[0]["content"], tools=tools,
                  tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=CALL_MAX_TOKENS,
                  temperature=0.0)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        first = stream.get_final_response()
    chat = client.chat.completions.create(model=server.model_name, messages=MESSAGES, tools=TOOLS,
                                          tool_choice=NAMED, max_tokens=CALL_MAX_TOKENS, temperature=0.0)
    (call,) = first.output
    assert call.type == "function_call" and call.status == "completed" and first.status == "completed"
    assert [(call.name, call.arguments)] == _calls(chat.choices[0].message)
    assert call.call_id.startswith(TOOL_CALL_ID_PREFIX) and call.id.startswith("fc_")
    assert first.usage.input_tokens == chat.usage.prompt_tokens
    types = [event.type for event in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert set(types[3:-3]) == {"response.function_call_arguments.delta"}
    assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    assert "".join(e.delta for e in events if e.type.endswith("arguments.delta")) == call.arguments
    cut = client.responses.create(**{**kwargs, "max_output_tokens": 3}, store=False)
    (partial,) = cut.output
    assert cut.status == partial.status == "incomplete" and call.arguments.startswith(partial.arguments)

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}
    second = client.responses.create(model=server.model_name, previous_response_id=first.id, input=[result],
                                     tools=tools, tool_choice="none", max_output_tokens=8, temperature=0.0)
    function = {"name": call.name, "arguments": call.arguments}
    messages = [*MESSAGES, {"role": "assistant", "content": None,
                            "tool_calls": [{"id": call.call_id, "type": "function", "function": function}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "18 degrees and sunny"}]
    chat = client.chat.completions.create(model=server.model_name, messages=messages, tools=TOOLS,
                                          tool_choice="none", max_tokens=8, temperature=0.0)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens


# Outputs steered into Mistral's and Qwen3-Coder's formats (the same two calls as HERMES_OUTPUT_REGEX), and a
# tool whose parameters have types: Qwen3-Coder writes every value as text, typed by the tool's schema.
FORECAST = {"type": "function", "function": {
    "name": "get_forecast", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "hourly": {"type": "boolean"}}}}}
PARSER_OUTPUT_REGEXES = {
    # (tokenizer v11+: each call after its own [TOOL_CALLS])
    "mistral": ('Checking\\.\\[TOOL_CALLS\\]get_weather\\[ARGS\\]\\{"city":"Paris","unit":"celsius"\\}'
                '\\[TOOL_CALLS\\]get_forecast\\[ARGS\\]\\{"city":"Oslo","days":3,"hourly":false\\}'),
    "qwen3_coder": ("Checking\\.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                    "</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
                    "<function=get_forecast>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n3\n"
                    "</parameter>\n<parameter=hourly>\nfalse\n</parameter>\n</function>\n</tool_call>"),
}


@pytest.mark.parametrize("parser", sorted(PARSER_OUTPUT_REGEXES))
def test_auto_tool_choice_reads_mistral_and_qwen3_coder_calls(tiny_serving_engine, parser):
    """--tool-call-parser mistral / qwen3_coder through the server, whole and streamed: the text before the
    calls is content, each call's arguments are JSON (Qwen3-Coder's values typed by the tool's schema: an
    integer, a boolean), and Mistral's calls carry its 9-character ids."""
    engine = idle_serving_engine(tiny_serving_engine)
    config = ServerConfig(log_level="warning", chat_template=str(TEMPLATE), enable_auto_tool_choice=True,
                          tool_call_parser=parser)
    server = OpenAIServer(engine, config)
    want = [("get_weather", {"city": "Paris", "unit": "celsius"}),
            ("get_forecast", {"city": "Oslo", "days": 3, "hourly": False})]
    with BackgroundServer(server) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                               timeout=CLIENT_TIMEOUT_S)
        kwargs = dict(model=server.model_name, messages=MESSAGES, tools=[WEATHER, FORECAST],
                      max_tokens=FORCED_MAX_TOKENS,
                      temperature=0.0, extra_body={"guided_regex": PARSER_OUTPUT_REGEXES[parser]})
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.message.content == "Checking." and choice.finish_reason == "tool_calls"
        assert [(n, json.loads(a)) for n, a in _calls(choice.message)] == want
        ids = [call.id for call in choice.message.tool_calls]
        if parser == "mistral":
            assert all(len(i) == 9 and i.isalnum() for i in ids), ids
        else:
            assert all(i.startswith(TOOL_CALL_ID_PREFIX) for i in ids), ids
        (streamed,) = _accumulate(client.chat.completions.create(**kwargs, stream=True)).values()
        assert streamed["content"] == "Checking." and streamed["finish"] == "tool_calls"
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed["calls"].values()] == want
