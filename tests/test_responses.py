"""The Responses API's pieces without a server (plait/entrypoints/responses.py): input items as chat messages,
and an answer's output items and stream events, the same whatever pieces the output comes in."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("fastapi")

from plait.entrypoints.reasoning_parsers import get_reasoning_parser  # noqa: E402
from plait.entrypoints.responses import (  # noqa: E402
    OutputBuilder,
    ResponsesRequest,
    ResponseStore,
    StoredResponse,
    conversation_messages,
)
from plait.entrypoints.server import _ChoiceReader  # noqa: E402
from plait.entrypoints.tool_parsers import get_tool_parser  # noqa: E402
from plait.entrypoints.tools import ToolCallStream  # noqa: E402
from plait.outputs import CompletionOutput, RequestOutput  # noqa: E402

NUM_SPLITS = 20  # random splittings of each output
MAX_PIECE = 5  # characters per engine output at most
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
CALLED = ("function_call", ("get_weather", '{"city": "Paris"}'), "completed")  # the item CALL becomes
# (reasoning parser, tool parser, output, finish reason, the items: (type, text or (name, arguments), status))
CASES = [
    (None, None, "Hello there.", "stop", [("message", "Hello there.", "completed")]),
    (None, None, "", "stop", [("message", "", "completed")]),  # no output at all: an empty message
    (None, None, "Cut sho", "length", [("message", "Cut sho", "incomplete")]),
    (None, None, '{"a": ', "error", [("message", '{"a": ', "completed")]),  # a grammar that cannot go on
    (None, "hermes", f"Checking.\n{CALL}", "stop",
     [("message", "Checking.", "completed"), CALLED]),
    (None, "hermes", CALL, "stop", [CALLED]),
    ("qwen3", None, "<think>\nHmm.\n</think>\n\nHi!", "stop",
     [("reasoning", "\nHmm.\n", "completed"), ("message", "\n\nHi!", "completed")]),
    ("qwen3", None, "<think>\nStill thinking", "length", [("reasoning", "\nStill thinking", "incomplete")]),
    ("qwen3", "hermes", f"<think>Call it.</think>{CALL}", "stop",
     [("reasoning", "Call it.", "completed"), CALLED]),
]
STATUS = {"stop": "completed", "length": "incomplete", "error": "failed"}


def _reader(reasoning: str | None, tools: str | None) -> _ChoiceReader:
    tool_stream = ToolCallStream(get_tool_parser(tools)()) if tools else None
    parser = get_reasoning_parser(reasoning)() if reasoning else None
    return _ChoiceReader(tool_stream, parser)


def _outputs(text: str, pieces: list[int], finish_reason: str) -> list[RequestOutput]:
    """The engine's outputs of ``text`` in pieces of these lengths, one token each."""
    outputs, done = [], 0
    for n in pieces:
        piece, done = text[done:done + n], done + n
        finished = done >= len(text)
        completion = CompletionOutput(0, text[:done], list(range(done)), finish_reason if finished else None,
                                      delta_text=piece, delta_token_ids=[done])
        outputs.append(RequestOutput("r", None, [1], [completion], finished))
    return outputs


def _splits(text: str, rng: random.Random) -> list[int]:
    pieces = []
    while sum(pieces) < len(text):
        pieces.append(rng.randint(1, MAX_PIECE))
    return pieces or [0]


def _summary(builder: OutputBuilder) -> list[tuple]:
    summary = []
    for item in builder.items:
        if item.type == "function_call":
            summary.append((item.type, (item.name, item.arguments), item.status))
        else:
            summary.append((item.type, "".join(part.text for part in item.content), item.status))
    return summary


def _check_events(events: list[dict], builder: OutputBuilder) -> None:
    """Every item is added once, then done once, its deltas between; the done event carries the item."""
    added, done = {}, {}
    for position, event in enumerate(events):
        index = event.get("output_index")
        if event["type"] == "response.output_item.added":
            assert index not in added and index == len(added)
            added[index] = position
        elif event["type"] == "response.output_item.done":
            assert index in added and index not in done
            done[index] = position
            assert event["item"] == builder.items[index].model_dump(mode="json")
        elif index is not None:
            assert index in added and index not in done, event
    assert sorted(added) == sorted(done) == list(range(len(builder.items)))


@pytest.mark.parametrize("reasoning,tools,text,finish_reason,items", CASES)
def test_output_items_are_the_same_in_any_pieces(reasoning, tools, text, finish_reason, items):
    rng = random.Random(len(text))
    for pieces in [[len(text) or 0], *(_splits(text, rng) for _ in range(NUM_SPLITS))]:
        builder = OutputBuilder(_reader(reasoning, tools))
        events = [event for out in _outputs(text, pieces, finish_reason) for event in builder.feed(out)]
        assert _summary(builder) == items, pieces
        assert builder.status == STATUS[finish_reason] and builder.output_tokens == len(pieces)
        _check_events(events, builder)
        texts = "".join(e.get("delta", "") for e in events if e["type"].endswith("text.delta"))
        assert texts == "".join(t for kind, t, _ in items if kind != "function_call")


def test_input_items_become_chat_messages():
    """Messages (developer as system, text parts joined); function calls join the assistant message before
    them; their outputs are tool messages; reasoning items are left out."""
    body = ResponsesRequest.model_validate({"input": [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                        {"type": "input_text", "text": "in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
    ]})
    messages = [m.as_template_message() for m in conversation_messages(body.input_items())]
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
        {"role": "tool", "content": "Sunny", "tool_call_id": "c1"},
    ]


def test_the_store_forgets_the_least_recently_used():
    store = ResponseStore(capacity=2)
    responses = [ResponsesRequest.model_validate({"input": "x"}) for _ in range(3)]  # stand-ins
    for i, body in enumerate(responses):
        stored = StoredResponse(response=type("R", (), {"id": f"resp_{i}"})(), items=body.input_items())
        store.put(stored)  # type: ignore[arg-type]
        if i == 1:
            assert store.get("resp_0") is not None  # used: now the most recent
    assert store.get("resp_1") is None and store.get("resp_0") is not None and len(store) == 2
