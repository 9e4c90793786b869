"""--reasoning-parser end to end: a real server (--reasoning-parser qwen3, a Qwen3-style template whose
generation prompt opens <think>, and hermes tool calling), the default model and the openai client.

The 135M model does not reason by itself; one example turn in the conversation makes it write the same
reasoning, </think> and answer (greedy, so every run the same), as a reasoning model would."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")  # structured outputs after the reasoning
openai = pytest.importorskip("openai")

from conftest import idle_serving_engine  # noqa: E402

from plait.entrypoints.llm import apply_chat_template  # noqa: E402
from plait.entrypoints.server import BackgroundServer, OpenAIServer, ServerConfig  # noqa: E402
from plait.entrypoints.tool_parsers import get_tool_parser, parse_whole  # noqa: E402

TEMPLATE = Path(__file__).resolve().parent / "reasoning_chat_template.jinja"
CLIENT_TIMEOUT_S = 240.0
MAX_TOKENS = 48  # the greeting's answers take 15-25 tokens and end with EOS
CALL_MAX_TOKENS = 80  # reasoning and a call: ~55 tokens
THINKING_OFF_MAX_TOKENS = 8
REASONING = "The user greets me.\n"
ANSWER = "\n\nHello!"


def _conversation(reasoning: str, answer: str, question: str = "Hi") -> list[dict]:
    """An example turn (reasoning, then the answer), then the question again."""
    example = {"role": "assistant", "content": f"<think>\n{reasoning}</think>\n\n{answer}"}
    return [{"role": "user", "content": question}, example, {"role": "user", "content": question}]


GREETING = _conversation(REASONING, ANSWER.lstrip())
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 20}}}}}
TIME = {"type": "function", "function": {"name": "get_time",
                                         "parameters": {"type": "object", "properties": {}}}}
# An example whose reasoning holds a whole Hermes call, and whose answer is one: only the answer's is a call.
CALL_IN_REASONING = 'A call looks like <tool_call>{"name": "get_time", "arguments": {}}</tool_call>.\n'
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALLING = _conversation(CALL_IN_REASONING, CALL, "Weather in Paris?")
# Forces the answer to be that call (a structured output, applied after the reasoning).
CALL_REGEX = '<tool_call>\n\\{"name": "get_weather", "arguments": \\{"city": "Paris"\\}\\}\n</tool_call>'


@pytest.fixture(scope="module")
def served(serving_engine):
    engine = idle_serving_engine(serving_engine)  # the default model under a 256-token budget
    config = ServerConfig(log_level="warning", chat_template=str(TEMPLATE), reasoning_parser="qwen3",
                          enable_auto_tool_choice=True, tool_call_parser="hermes")
    server = OpenAIServer(engine, config)
    with BackgroundServer(server) as url:
        yield server, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                    timeout=CLIENT_TIMEOUT_S)


def _ask(served, stream: bool = False, **kwargs):
    server, client = served
    kwargs = {"messages": GREETING, "max_tokens": MAX_TOKENS, "temperature": 0.0, **kwargs}
    return client.chat.completions.create(model=server.model_name, stream=stream, **kwargs)


def _accumulate(chunks) -> dict[int, dict]:
    """Each choice's reasoning, content, tool calls and finish reason from the chunks, as clients add them up;
    and every delta's fields, to check that none mixes what it should not."""
    choices: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk.choices:
            choice = choices.setdefault(c.index, {"reasoning": "", "content": "", "calls": {}, "finish": None,
                                                  "deltas": []})
            reasoning = (c.delta.model_extra or {}).get("reasoning")
            choice["deltas"].append((reasoning, c.delta.content))
            choice["reasoning"] += reasoning or ""
            choice["content"] += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                call = choice["calls"].setdefault(tc.index, {"name": None, "arguments": ""})
                call["name"] = call["name"] or tc.function.name
                call["arguments"] += tc.function.arguments or ""
            choice["finish"] = c.finish_reason or choice["finish"]
    return choices


def test_the_reasoning_is_split_from_the_answer_streamed_or_not(served):
    """vLLM's fields: message.reasoning beside message.content (no reasoning_content, which vLLM no longer
    sends), delta.reasoning beside delta.content; the tags in neither; usage and logprobs count every
    token; n > 1: each choice read by its own parser."""
    server, _ = served
    r = _ask(served, logprobs=True)
    choice = r.choices[0]
    fields = choice.message.model_extra
    assert fields == {"reasoning": REASONING} and choice.message.content == ANSWER
    assert choice.finish_reason == "stop"
    rendered = apply_chat_template(server.tokenizer, GREETING, chat_template=TEMPLATE.read_text())
    assert r.usage.prompt_tokens == len(rendered)
    assert r.usage.completion_tokens == len(choice.logprobs.content)
    tokens = "".join(entry.token for entry in choice.logprobs.content)
    assert tokens == REASONING + "</think>" + ANSWER + "<|im_end|>"  # all generated, the tag and EOS too
    chunks = list(_ask(served, stream=True, n=2, stream_options={"include_usage": True}))
    for streamed in _accumulate(chunks).values():
        assert (streamed["reasoning"], streamed["content"]) == (REASONING, ANSWER)
        assert streamed["finish"] == "stop"
        assert not any(reasoning and content for reasoning, content in streamed["deltas"])
    assert chunks[-1].usage.completion_tokens == 2 * r.usage.completion_tokens


def test_include_reasoning_false_leaves_it_out(served):
    """vLLM's include_reasoning: false drops the reasoning (and, as vLLM, the logprobs, whose tokens would
    show it); the content and the usage stay."""
    full = _ask(served)
    r = _ask(served, logprobs=True, extra_body={"include_reasoning": False})
    assert r.choices[0].message.model_extra == {"reasoning": None}
    assert r.choices[0].message.content == ANSWER and r.choices[0].logprobs is None
    assert r.usage == full.usage
    (streamed,) = _accumulate(_ask(served, stream=True, extra_body={"include_reasoning": False})).values()
    assert streamed["reasoning"] == "" and streamed["content"] == ANSWER


def test_thinking_off_is_all_content(served):
    """chat_template_kwargs={"enable_thinking": False}: the template closes the reasoning in the prompt, so
    the output is all content, reasoning null, streamed or not."""
    thinking_off = {"chat_template_kwargs": {"enable_thinking": False}}
    kwargs = dict(max_tokens=THINKING_OFF_MAX_TOKENS, extra_body=thinking_off)
    r = _ask(served, **kwargs)
    assert r.choices[0].message.model_extra == {"reasoning": None} and r.choices[0].message.content
    (streamed,) = _accumulate(_ask(served, stream=True, **kwargs)).values()
    assert streamed["reasoning"] == "" and streamed["content"] == r.choices[0].message.content


def test_structured_outputs_apply_after_the_reasoning(served):
    """As vLLM: the model reasons freely, and the grammar (regex, choice, JSON schema) constrains what
    follows </think>, which is the content."""
    r = _ask(served, extra_body={"guided_regex": "(Bonjour|Salut)!"})
    message = r.choices[0].message
    assert message.model_extra == {"reasoning": REASONING} and message.content in ("Bonjour!", "Salut!")
    assert r.choices[0].finish_reason == "stop"
    (streamed,) = _accumulate(_ask(served, stream=True, extra_body={"guided_choice": ["Bonjour!", "Salut!"]})
                              ).values()
    assert streamed["reasoning"] == REASONING and streamed["content"] in ("Bonjour!", "Salut!")
    schema = {"type": "object", "additionalProperties": False, "required": ["greeting"],
              "properties": {"greeting": {"type": "string", "maxLength": 12}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "greeting", "schema": schema}}
    r = _ask(served, response_format=fmt)
    assert r.choices[0].message.model_extra == {"reasoning": REASONING}
    assert set(json.loads(r.choices[0].message.content)) == {"greeting"}


def test_tool_calls_are_read_from_the_answer_only(served):
    """A call written in the reasoning stays reasoning; the answer's call is the tool call ("auto" under the
    hermes parser, the answer forced by a regex after the reasoning), streamed or not; a named tool_choice's
    arguments follow the reasoning too."""
    kwargs = dict(messages=CALLING, tools=[WEATHER, TIME], max_tokens=CALL_MAX_TOKENS,
                  extra_body={"guided_regex": CALL_REGEX})
    r = _ask(served, **kwargs)
    choice = r.choices[0]
    reasoning = choice.message.model_extra["reasoning"]
    assert parse_whole(get_tool_parser("hermes")(), reasoning)[1]  # a call the parser would read
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert choice.finish_reason == "tool_calls"
    (streamed,) = _accumulate(_ask(served, stream=True, **kwargs)).values()
    assert streamed["reasoning"] == reasoning and streamed["content"] == ""
    assert [(c["name"], c["arguments"]) for c in streamed["calls"].values()] == [
        ("get_weather", call.function.arguments)]
    assert streamed["finish"] == "tool_calls"
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = _ask(served, messages=CALLING, tools=[WEATHER, TIME], tool_choice=named, max_tokens=CALL_MAX_TOKENS)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].message.model_extra == {"reasoning": reasoning}
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}


def test_responses_carry_the_reasoning_as_a_reasoning_item(served):
    """The Responses API under --reasoning-parser, as vLLM's: a reasoning item (its text in content) before
    the message, the reasoning's tokens counted in usage; streamed, its reasoning_text events first, the
    SDK's stream helper ending with the same items; reasoning.effort "none" turns thinking off."""
    server, client = served
    kwargs = dict(model=server.model_name, input=GREETING, max_output_tokens=MAX_TOKENS, temperature=0.0)
    r = client.responses.create(**kwargs)
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and [c.text for c in reasoning.content] == [REASONING]
    assert reasoning.summary == [] and reasoning.id.startswith("rs_")
    assert message.type == "message" and r.output_text == ANSWER and r.status == "completed"
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    with client.responses.stream(**kwargs) as stream:
        types = [event.type for event in stream]
        final = stream.get_final_response()
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == REASONING and final.output_text == ANSWER
    assert types[2:5] == ["response.output_item.added", "response.content_part.added",
                          "response.reasoning_text.delta"]
    done = types.index("response.reasoning_text.done")
    assert types[done:done + 4] == ["response.reasoning_text.done", "response.content_part.done",
                                    "response.output_item.done", "response.output_item.added"]
    assert "response.reasoning_text.delta" not in types[done:] and types[-1] == "response.completed"
    off = client.responses.create(**{**kwargs, "max_output_tokens": THINKING_OFF_MAX_TOKENS},
                                  reasoning={"effort": "none"}, store=False)
    assert [item.type for item in off.output] == ["message"] and off.output_text
    assert off.usage.output_tokens_details.reasoning_tokens == 0
