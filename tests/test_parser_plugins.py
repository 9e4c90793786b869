"""--tool-parser-plugin and --reasoning-parser-plugin (vLLM's): a user's Python file registers parsers that
--tool-call-parser and --reasoning-parser then name; a missing file, one that fails and an unknown name stop
`plait serve` before the model loads; the plugin's parsers read answers in the server's process, and in each
data-parallel replica's."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
from conftest import ROOT, plait_serve_process

from plait.entrypoints import cli
from plait.entrypoints.reasoning_parsers import REASONING_PARSERS, get_reasoning_parser, split_reasoning
from plait.entrypoints.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    collect,
    get_tool_parser,
    parse_whole,
    register_tool_parser,
)

# A user's plugins: tool calls as `CALL name {json}` lines (any other line is content), README's example,
# and reasoning between [[think]] and [[/think]], on unless the request's chat_template_kwargs turn it off.
README_PLUGIN = re.compile(r"```python\n(# call_lines\.py: .*?)```", re.DOTALL)
REASONING_PLUGIN = '''
from plait.entrypoints.reasoning_parsers import ReasoningParser, register_reasoning_parser


@register_reasoning_parser
class BracketThinkReasoningParser(ReasoningParser):
    name = "bracket_think"
    START = "[[think]]"
    END = "[[/think]]"

    @classmethod
    def thinking_on(cls, chat_template_kwargs):
        return chat_template_kwargs.get("thinking", True)
'''
OUTPUT = 'Checking.\nCALL get_weather {"city": "Paris"}\nnot a call\nCALL get_time {"timezone": "CET"}'
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "CET"})]
# The output forced on the tiny random model (a structured output), without the content line between the
# calls, which the message's content would join to "Checking.".
OUTPUT_REGEX = ('Checking\\.\nCALL get_weather \\{"city": "Paris"\\}\nCALL get_time \\{"timezone": "CET"\\}')
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
         for name, _ in CALLS]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
CLIENT_TIMEOUT_S = 60.0


@pytest.fixture(autouse=True)
def registries():
    """The registries as they were: a test's plugin parsers leave with it."""
    saved = [(registry, dict(registry)) for registry in (TOOL_PARSERS, REASONING_PARSERS)]
    yield
    for registry, entries in saved:
        registry.clear()
        registry.update(entries)


@pytest.fixture
def plugins(tmp_path) -> tuple[Path, Path]:
    """The tool parser plugin (README's example) and the reasoning parser one, as files."""
    tools, reasoning = tmp_path / "call_lines.py", tmp_path / "bracket_think.py"
    tools.write_text(README_PLUGIN.search((ROOT / "README.md").read_text()).group(1))
    reasoning.write_text(REASONING_PLUGIN)
    return tools, reasoning


def _plugin_args(plugins: tuple[Path, Path]) -> list[str]:
    tools, reasoning = plugins
    return ["--tool-parser-plugin", str(tools), "--tool-call-parser", "call_lines",
            "--enable-auto-tool-choice", "--reasoning-parser-plugin", str(reasoning), "--reasoning-parser",
            "bracket_think"]


def _served_args(model: Path, plugins: tuple[Path, Path]) -> list[str]:
    """The tiny model, in a small KV cache, served with the plugins' parsers."""
    return ["--model", str(model), "--max-model-len", "128", "--num-kv-blocks", "64", *_plugin_args(plugins)]


def test_plugin_parsers_load_through_the_cli_and_read_whole_or_streamed(plugins):
    """The command line's flags run the files (once each, however often named) and their parsers read an
    output as the built-in ones do: whole, or fed in pieces, the same content and calls."""
    args = cli.parse_args(["serve", *_plugin_args(plugins)])
    cli._load_parsers(args)
    tools, reasoning = get_tool_parser("call_lines"), get_reasoning_parser("bracket_think")
    cli._load_parsers(args)
    assert (get_tool_parser("call_lines"), get_reasoning_parser("bracket_think")) == (tools, reasoning)
    assert tools.__module__ == "plait_parser_plugin_call_lines"
    content, calls = parse_whole(tools(), OUTPUT)
    assert content == "Checking.\nnot a call\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
    pieces = tools()
    events = [event for i in range(0, len(OUTPUT), 3) for event in pieces.feed(OUTPUT[i:i + 3])]
    assert collect(events + pieces.feed("", final=True)) == (content, calls)
    assert split_reasoning(reasoning(), "[[think]]plan[[/think]]answer") == ("plan", "answer")
    assert split_reasoning(reasoning({"thinking": False}), "answer") == (None, "answer")


# Each kind's flags, what errors call it, and its plugin's parser (plugins' index, the name it registers).
KINDS = {"tool": ("--tool-parser-plugin", "--tool-call-parser", "tool call parser", 0, "call_lines"),
         "reasoning": ("--reasoning-parser-plugin", "--reasoning-parser", "reasoning parser", 1,
                       "bracket_think")}
FAILURE = "no parsers today"


@pytest.mark.parametrize("command", ["serve", "run-batch"])
@pytest.mark.parametrize("problem", ["missing", "raises", "unknown name"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_bad_plugin_or_name_stops_the_command_before_the_model_loads(tmp_path, capsys, plugins, kind,
                                                                       problem, command):
    """A plugin file that does not exist, one that raises (where, and what), and a name no parser has after
    the plugin ran (the known ones listed, the plugin's among them): `plait serve` and `plait run-batch` say
    so and exit 2, with a model that does not exist either, which they would have named had they got that
    far."""
    flag, name_flag, what, index, registered = KINDS[kind]
    broken = tmp_path / "broken.py"
    broken.write_text(f"import json\n\nraise RuntimeError({FAILURE!r})\n")
    files = {"missing": tmp_path / "absent.py", "raises": broken, "unknown name": plugins[index]}
    requests = tmp_path / "requests.jsonl"
    requests.write_text("")
    command_args = {"serve": ["serve"], "run-batch": ["run-batch", "-i", str(requests), "-o", "-"]}[command]
    model = tmp_path / "no-model"
    assert cli.main([*command_args, "--model", str(model), flag, str(files[problem]), name_flag, "nope"]) == 2
    err = capsys.readouterr().err
    expected = {"missing": f"the {what} plugin '{files['missing']}' does not exist",
                "raises": f"the {what} plugin '{broken}' failed to load (line 3): RuntimeError: {FAILURE}",
                "unknown name": f"unknown {what} 'nope'; known: "}[problem]
    assert expected in err and "no-model" not in err, err
    assert problem != "unknown name" or registered in err


def test_a_plugin_parser_replaces_a_built_in_of_its_name_and_a_nameless_one_is_refused(tmp_path, caplog):
    """vLLM's register_module(force=True): a plugin's parser of a built-in's name is that name's from then on
    (a warning says so); a class without a name of its own, or that is no ToolParser, is refused by name."""
    path = tmp_path / "own_hermes.py"
    path.write_text("from plait.entrypoints.tool_parsers import HermesToolParser, register_tool_parser\n\n\n"
                    "@register_tool_parser\nclass StricterHermes(HermesToolParser):\n    name = 'hermes'\n")
    with caplog.at_level(logging.WARNING):
        TOOL_PARSERS.load("hermes", str(path))
    assert get_tool_parser("hermes").__qualname__ == "StricterHermes"
    assert "tool call parser 'hermes' is now plait_parser_plugin_own_hermes.StricterHermes" in caplog.text
    with pytest.raises(ValueError, match="StricterStill needs a name of its own"):
        register_tool_parser(type("StricterStill", (HermesToolParser,), {}))
    with pytest.raises(TypeError, match="must be a subclass of ToolParser"):
        register_tool_parser(str)


def _accumulate(stream) -> tuple[str, str, list[tuple[str, dict]], str | None]:
    """A streamed choice's reasoning, content, calls and finish reason, as clients add them up."""
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in stream:
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning") or ""
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"name": None, "arguments": ""})
                call["name"] = call["name"] or tc.function.name
                call["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return reasoning, content, [(c["name"], json.loads(c["arguments"])) for c in calls.values()], finish


def test_plugin_parsers_read_a_servers_answers(tiny_model, plugins):
    """A server configured from the command line's plugin flags (in this process, as `plait serve` without
    an engine process) answers the openai client with the plugin's parsers: tool_choice "auto" reads its
    CALL lines as tool calls, whole and streamed; its reasoning parser, thinking by default, takes an answer
    that never closes [[think]] as all reasoning."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("llguidance")  # the output is forced by a structured output
    from plait.engine.engine import LLMEngine
    from plait.entrypoints.server import BackgroundServer, OpenAIServer, ServerConfig

    args = cli.parse_args(["serve", *_served_args(tiny_model, plugins), "--log-level", "warning"])
    cli._load_parsers(args)
    config = ServerConfig(**cli._request_handling_config(args))
    with BackgroundServer(OpenAIServer(LLMEngine(cli._engine_config(args)), config)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=CLIENT_TIMEOUT_S)
        ask = dict(model="tiny-model", messages=MESSAGES, tools=TOOLS, max_tokens=40, temperature=0.0,
                   extra_body={"guided_regex": OUTPUT_REGEX, "chat_template_kwargs": {"thinking": False}})
        choice = client.chat.completions.create(**ask).choices[0]
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
        assert (choice.message.content, calls, choice.finish_reason) == ("Checking.", CALLS, "tool_calls")
        assert _accumulate(client.chat.completions.create(**ask, stream=True)) == ("", "Checking.", CALLS,
                                                                                   "tool_calls")
        thought = client.chat.completions.create(model="tiny-model", messages=MESSAGES, max_tokens=4,
                                                 extra_body={"ignore_eos": True}).choices[0].message
        assert thought.model_extra["reasoning"] and thought.content is None


def test_data_parallel_replicas_run_the_plugin(tmp_path, tiny_model, plugins):
    """`plait serve --data-parallel-size 2 --tool-parser-plugin ...`: a replica is a process of its own, which
    runs the plugin too (its config is remade there), so the answers that reach the client through the front
    carry the plugin's tool calls, whole and streamed."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("llguidance")
    args = [*_served_args(tiny_model, plugins), "--no-engine-process", "--data-parallel-size", "2"]
    with plait_serve_process(tmp_path, args) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=CLIENT_TIMEOUT_S)
        ask = dict(model="tiny-model", messages=MESSAGES, tools=TOOLS, max_tokens=40, temperature=0.0,
                   extra_body={"guided_regex": OUTPUT_REGEX, "chat_template_kwargs": {"thinking": False}})
        message = client.chat.completions.create(**ask).choices[0].message
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == CALLS
        assert _accumulate(client.chat.completions.create(**ask, stream=True))[2] == CALLS
