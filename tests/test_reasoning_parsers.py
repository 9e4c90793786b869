"""Reasoning parsers (plait/entrypoints/reasoning_parsers.py) on strings: whole outputs split as vLLM's
extract_reasoning splits them, and the same outputs streamed in random pieces, which must concatenate to the
same reasoning and content."""

from __future__ import annotations

import random

import pytest

from plait.entrypoints.reasoning_parsers import (
    REASONING_PARSERS,
    ReasoningParser,
    get_reasoning_parser,
    split_reasoning,
)

NUM_SPLITS = 60  # random splittings of each output
CHARACTERS = None  # a _streamed seed that feeds the output a character at a time
SPLITS = (CHARACTERS, *range(NUM_SPLITS))
MAX_PIECE = 5  # characters per streamed piece at most
THINKING_OFF = {"enable_thinking": False}
THINKING = {"thinking": True}  # Granite's template variable
# Qwen3's template with enable_thinking false closes the reasoning in the prompt.
CLOSED_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
OPEN_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"

# OLMo 3 Think's template opens <think> in the prompt (its tags are plain text).
OLMO_THINK_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>"
# ERNIE-4.5-21B-A3B-Thinking's answers, as vLLM's ernie45 parsers describe them.
ERNIE_ANSWER = "abc\n</think>\n\n<response>\ndef\n</response>\n"
ERNIE_CALL = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n'

# What Seed-OSS writes into its reasoning as its thinking budget runs down.
SEED_REFLECTION = "<seed:cot_budget_reflect>20 left</seed:cot_budget_reflect>"

# (parser, chat_template_kwargs, prompt, output, reasoning, content) with vLLM's None and "" as it gives them.
# A harmony prompt's end, with its generation prompt (gpt-oss's template).
GPT_OSS_PROMPT = "<|start|>user<|message|>2+2?<|end|><|start|>assistant"
CASES = [
    # the model writes both tags (DeepSeek-R1-0528, Qwen3 before 2507)
    ("deepseek_r1", None, "", "<think>\nAdd them.\n</think>\n\n4", "\nAdd them.\n", "\n\n4"),
    ("qwen3", None, "", "<think>\nAdd them.\n</think>\n\n4", "\nAdd them.\n", "\n\n4"),
    ("deepseek_r1", None, "", "\n <think>R</think>C", "R", "C"),  # whitespace before the tag goes with it
    # the template opened <think> in the prompt: only the end is in the output
    ("deepseek_r1", None, OPEN_PROMPT, "Add them.\n</think>\n\n4", "Add them.\n", "\n\n4"),
    ("qwen3", None, OPEN_PROMPT, "Add them.\n</think>\n\n4", "Add them.\n", "\n\n4"),
    # the end never comes (max_tokens cut the reasoning short): all reasoning
    ("deepseek_r1", None, "", "<think>\nStill thinking", "\nStill thinking", None),
    ("qwen3", None, OPEN_PROMPT, "Still thinking", "Still thinking", None),
    ("qwen3", None, "", "No tags at all.", "No tags at all.", None),
    ("deepseek_r1", None, "", "a <thin and </thi", "a <thin and </thi", None),  # tag beginnings stay text
    # nothing after the end: content null; nothing before it: reasoning ""
    ("qwen3", None, "", "<think>R</think>", "R", None),
    ("deepseek_r1", None, "", "</think>C", "", "C"),
    ("qwen3", None, "", "", "", None),
    # only the first end splits; a later one is the answer's text
    ("deepseek_r1", None, "", "R</think>C</think>D", "R", "C</think>D"),
    # the first <think> inside the reasoning is dropped (as vLLM's streaming drops it), the text around kept
    ("qwen3", None, OPEN_PROMPT, "R<think>S</think>C", "RS", "C"),
    ("qwen3", None, "", "<think>R<think>S</think>C", "R<think>S", "C"),  # only one start tag is dropped
    # Qwen3 with thinking off: all content, as its template closes the reasoning in the prompt
    ("qwen3", THINKING_OFF, CLOSED_PROMPT, "4", None, "4"),
    ("qwen3", THINKING_OFF, "", "<think>R</think>C", None, "<think>R</think>C"),
    ("qwen3", None, CLOSED_PROMPT, "4", None, "4"),  # a prompt that closed it, whatever the variables
    ("deepseek_r1", None, CLOSED_PROMPT, "R</think>C", None, "R</think>C"),
    ("qwen3", THINKING_OFF, CLOSED_PROMPT, "", None, ""),  # no reasoning to split: the content as it is
    # Seed-OSS: its own tags, its thinking budget's reflections part of the reasoning; a prompt that closed
    # the reasoning (its template with a zero budget) leaves the output all content
    ("seed_oss", None, "", f"<seed:think>Add.{SEED_REFLECTION}</seed:think>4", f"Add.{SEED_REFLECTION}", "4"),
    ("seed_oss", None, "", "R</seed:think>C</think>", "R", "C</think>"),
    ("seed_oss", None, "", "a <seed:thi", "a <seed:thi", None),
    ("seed_oss", None, "<seed:bos>assistant\n<seed:think></seed:think>", "4", None, "4"),
    # DeepSeek-V3.1 reasons only when asked ("thinking", or "enable_thinking")
    ("deepseek_v3", None, "", "R</think>C", None, "R</think>C"),
    ("deepseek_v3", {"thinking": True}, "", "R</think>C", "R", "C"),
    ("deepseek_v3", {"enable_thinking": True}, "", "<think>R", "R", None),
    # Magistral (vLLM's mistral, its tests' cases): reasoning only after [THINK], else all content
    ("mistral", None, "", "[THINK]This is a reasoning section[/THINK]This is the rest",
     "This is a reasoning section", "This is the rest"),
    ("mistral", None, "", "[THINK]This\nThat[/THINK]This is the rest\nThat", "This\nThat",
     "This is the rest\nThat"),
    ("mistral", None, "", "[THINK]This is a reasoning section[/THINK]", "This is a reasoning section", None),
    ("mistral", None, "", "[THINK]This is reasoning", "This is reasoning", None),  # cut short while reasoning
    ("mistral", None, "", "This is content", None, "This is content"),
    ("mistral", None, "", "", None, ""),
    # a [/THINK] without [THINK] is dropped (the first); text before [THINK] is content
    ("mistral", None, "", "This is a reasoning section[/THINK]This is the rest", None,
     "This is a reasoning sectionThis is the rest"),
    ("mistral", None, "", "[/THINK]This is the rest", None, "This is the rest"),
    ("mistral", None, "", "a[/THINK]b[/THINK]c", None, "ab[/THINK]c"),
    ("mistral", None, "", "Before\n[THINK]This is a reasoning section[/THINK]\nThis is the rest",
     "This is a reasoning section", "Before\n\nThis is the rest"),
    ("mistral", None, "", "[THINK]a[THINK]b[/THINK]c[/THINK]d", "a[THINK]b", "c[/THINK]d"),  # the first tags
    ("mistral", None, "", "a <think>b</think> [THIN", None, "a <think>b</think> [THIN"),  # others are text
    ("mistral", None, "[INST]Hi[/INST][THINK]\n\n[/THINK]", "[THINK]R[/THINK]C", None,
     "[THINK]R[/THINK]C"),  # a prompt that closed the reasoning: all content
    # IBM Granite 3.2 / 3.3 (vLLM's granite, its tests' cases): plain-text phrases, "Here's" or "Here is"
    ("granite", THINKING, "", "Here's my thought process:This is a reasoning sectionHere's my response:"
     "This is the rest", "This is a reasoning section", "This is the rest"),
    ("granite", THINKING, "", "Here is my thought process:\nI add.\nHere is my response:\n4", "\nI add.\n",
     "\n4"),
    ("granite", THINKING, "", "Here is my thought process:R Here's my response:", "R ", None),
    ("granite", THINKING, "", "This is content", None, "This is content"),
    ("granite", THINKING, "", "", None, ""),
    ("granite", THINKING, "", "Here is my thought process:cut short", "cut short", None),
    ("granite", THINKING, "", "Hi. Here is my thought process:R Here is my response:C", "R ", "Hi. C"),
    # no thought process: the response phrase is text
    ("granite", THINKING, "", "Here is my response:C", None, "Here is my response:C"),
    ("granite", THINKING, "", "Here is my thou", None, "Here is my thou"),
    ("granite", None, "", "Here is my thought process:R Here is my response:C", None,
     "Here is my thought process:R Here is my response:C"),  # not asked to think (its template's thinking)
    # gpt-oss (vLLM's openai_gptoss): harmony messages; the analysis channel's text is the reasoning
    ("openai_gptoss", None, GPT_OSS_PROMPT, "<|channel|>analysis<|message|>Let me think.<|end|>"
     "<|start|>assistant<|channel|>final<|message|>The answer is 4.", "Let me think.", "The answer is 4."),
    ("openai_gptoss", None, GPT_OSS_PROMPT, "<|channel|>analysis<|message|>a<|end|><|start|>assistant"
     "<|channel|>final<|message|>b<|return|>", "a", "b"),
    ("openai_gptoss", None, GPT_OSS_PROMPT, "<|channel|>analysis<|message|>cut short", "cut short", None),
    ("openai_gptoss", None, GPT_OSS_PROMPT, "<|channel|>final<|message|>only <|end|> an answer", None,
     "only  an answer"),
    # two analysis messages around a commentary preamble; a tool call passes to the content whole
    ("openai_gptoss", None, GPT_OSS_PROMPT, "<|channel|>analysis<|message|>x<|end|><|start|>assistant"
     "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>analysis<|message|>y<|end|>"
     "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\": 1}<|call|>",
     "xy", 'Checking.<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>'
     '{"a": 1}<|call|>'),
    ("openai_gptoss", None, GPT_OSS_PROMPT, "plain text, not harmony", None, "plain text, not harmony"),
    ("openai_gptoss", None, GPT_OSS_PROMPT + "<|channel|>final<|message|>", "Answer<|return|>", None,
     "Answer"),
    # OLMo 3 Think (vLLM's olmo3, its tests' cases): empty reasoning is none (None)
    ("olmo3", None, "", "<think></think>No thoughts, head empty!", None, "No thoughts, head empty!"),
    ("olmo3", None, "", "<think>\n</think>\n\nNo thoughts, head empty!", "\n",
     "\n\nNo thoughts, head empty!"),
    ("olmo3", None, "", "<think>This is a reasoning section</think>This is the rest",
     "This is a reasoning section", "This is the rest"),
    ("olmo3", None, "", "<think> Look!\n\nI'm thinking...</think>\nThis is the rest",
     " Look!\n\nI'm thinking...", "\nThis is the rest"),
    ("olmo3", None, "", "<think>\nLook!\nI'm thinking...\n\n</think>\n\n\nThis is the rest",
     "\nLook!\nI'm thinking...\n\n", "\n\n\nThis is the rest"),
    ("olmo3", None, "", "<think>\nLook!\nI'm thinking... </think>\nThis is the rest",
     "\nLook!\nI'm thinking... ", "\nThis is the rest"),
    ("olmo3", None, "", "</think>\n\nNo thoughts, head empty!", None, "\n\nNo thoughts, head empty!"),
    ("olmo3", None, OLMO_THINK_PROMPT, "The user is asking me not to think.</think>No thoughts!",
     "The user is asking me not to think.", "No thoughts!"),
    ("olmo3", None, OLMO_THINK_PROMPT, "Still thinking", "Still thinking", None),  # cut short: reasoning
    ("olmo3", None, "", "R</think>C</think>D", "R", "C</think>D"),  # only the first end splits
    # ERNIE 4.5 Thinking (vLLM's ernie45, its tests' cases and its docstrings' formats): the answer unwrapped
    # from <response>, the newlines framing it dropped
    ("ernie45", None, "", "abc</think>def", "abc", "def"),
    ("ernie45", None, "", "abc", "abc", None),
    ("ernie45", None, "", "abc</think>", "abc", None),
    ("ernie45", None, "", "abc\nABC</think>def\nDEF", "abc\nABC", "def\nDEF"),
    ("ernie45", None, "", ERNIE_ANSWER, "abc\n", "\ndef\n"),
    ("ernie45", None, "", "abc\n</think>\ndef", "abc\n", "def"),
    ("ernie45", None, "", "abc\n</think>\n\n\n" + ERNIE_CALL, "abc\n", ERNIE_CALL),  # calls outside
    ("ernie45", None, "", "R\n</think>\n<response>\nA\n</response>\n\n\n" + ERNIE_CALL, "R\n",
     "\nA\n" + ERNIE_CALL),
    ("ernie45", None, "", "R</think><response>cut short", "R", "cut short"),
    ("ernie45", None, "", "R</think>\n<resp", "R", "<resp"),  # a tag's start that never became one
    ("ernie45", None, "", "R</think>A <response>B</response>", "R", "A <response>B</response>"),  # not first
    ("ernie45", None, "<|im_start|>assistant\n<think>\n\n</think>\n\n", "<response>A</response>", None,
     "A"),  # a prompt that closed the reasoning: all answer
]


def _streamed(parser: ReasoningParser, text: str, seed: int | None) -> tuple[str, str]:
    rng = random.Random(seed)
    reasoning, content, start = [], [], 0
    while start < len(text):
        size = 1 if seed is CHARACTERS else rng.randint(1, MAX_PIECE)
        piece = parser.feed(text[start:start + size])
        reasoning.append(piece.reasoning)
        content.append(piece.content)
        start += size
    last = parser.feed("", final=True)
    return "".join(reasoning) + last.reasoning, "".join(content) + last.content


@pytest.mark.parametrize("name,kwargs,prompt,text,reasoning,content", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_parsers_split_reasoning_whole_and_streamed(name, kwargs, prompt, text, reasoning, content):
    parser = get_reasoning_parser(name)
    assert split_reasoning(parser(kwargs, prompt), text) == (reasoning, content)
    for seed in SPLITS:
        assert _streamed(parser(kwargs, prompt), text, seed) == (reasoning or "", content or ""), seed


def test_random_outputs_stream_as_they_split_whole():
    """Outputs made of tag pieces, whole tags and text, in any order: streamed in random pieces, the same
    reasoning and content as whole, whatever the parser and prompt."""
    fragments = ["<think>", "</think>", "<", "</", "think", ">", "<thi", "a", " ", "\n",
                 "[THINK]", "[/THINK]", "[", "[/", "THINK", "]", "[TH", "<|channel|>analysis", "<|message|>",
                 "<|end|>", "<|start|>assistant<|channel|>final", "<|", "<|mess", "|>",
                 "Here is my thought process:", "Here's my response:", "Here is my ", "Here'", "response:",
                 "<response>", "</response>", "<resp", "</respo"]
    rng = random.Random(0)
    for i in range(300):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(0, 12)))
        name = rng.choice(sorted(REASONING_PARSERS))
        prompt = rng.choice(["", OPEN_PROMPT, CLOSED_PROMPT, GPT_OSS_PROMPT, OLMO_THINK_PROMPT])
        kwargs = THINKING if name in ("deepseek_v3", "granite") else None
        parser = get_reasoning_parser(name)
        reasoning, content = split_reasoning(parser(kwargs, prompt), text)
        whole = (reasoning or "", content or "")
        for seed in range(5):
            assert _streamed(parser(kwargs, prompt), text, seed) == whole, (i, text)


def test_streaming_holds_back_only_what_may_be_a_tag():
    parser = get_reasoning_parser("qwen3")()
    assert parser.feed("  ") == parser.feed("<thi") == ("", "")  # may still be the opening tag
    assert parser.feed("nk>Let me see") == ("Let me see", "")
    assert parser.feed(" </th") == (" ", "")  # "</th" may end the reasoning
    assert parser.feed("ink>\n\n") == ("", "\n\n")
    assert parser.feed("The answer: </think>") == ("", "The answer: </think>")  # the answer holds nothing
    cut = get_reasoning_parser("deepseek_r1")()
    assert cut.feed("a </thi") == ("a ", "") and cut.feed("", final=True) == ("</thi", "")


def test_mistral_streams_content_until_it_thinks_and_asks_for_special_tokens():
    parser = get_reasoning_parser("mistral")()
    assert parser.feed("Hi [TH") == ("", "Hi ")  # "[TH" may begin [THINK]
    assert parser.feed("INK]Let me see [/") == ("Let me see ", "")
    assert parser.feed("THINK]4") == ("", "4") and parser.has_reasoning
    plain = get_reasoning_parser("mistral")()
    assert plain.feed("4 [", final=True) == ("", "4 [") and not plain.has_reasoning
    # [THINK] and [/THINK] are special tokens: the output is detokenized with special tokens kept
    assert get_reasoning_parser("mistral").skip_special_tokens(True) is False
    assert get_reasoning_parser("qwen3").skip_special_tokens(True) is True
    assert get_reasoning_parser("qwen3").skip_special_tokens(False) is False


def test_gpt_oss_streams_each_channel_as_it_comes():
    parser = get_reasoning_parser("openai_gptoss")(None, GPT_OSS_PROMPT)
    assert parser.feed("<|channel|>analy") == ("", "")  # a header shows nothing
    assert parser.feed("sis<|message|>Let me <|e") == ("Let me ", "")  # "<|e" may end the message
    assert parser.feed("nd|><|start|>assistant<|channel|>final<|message|>4") == ("", "4")
    assert parser.has_reasoning and get_reasoning_parser("openai_gptoss").skip_special_tokens(True) is False


def test_ernie45_streams_its_answer_without_its_response_tags():
    parser = get_reasoning_parser("ernie45")()
    assert parser.feed("Let me see.\n</thi") == ("Let me see.\n", "")  # "</thi" may end the reasoning
    assert parser.feed("nk>\n\n<resp") == ("", "")  # newlines after </think> go; "<resp" may be the tag
    assert parser.feed("onse>\nIt is 4.\n</resp") == ("", "\nIt is 4.\n")  # "</resp" may close it
    assert parser.feed("onse>\n", final=True) == ("", "")
    plain = get_reasoning_parser("ernie45")()
    assert plain.feed("R</think>\n4 <", final=True) == ("R", "4 <")


def test_registry_names_vllms_parsers():
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3", "deepseek_v3", "mistral", "seed_oss",
                                      "openai_gptoss", "granite", "olmo3", "ernie45"}
    known = ("known: deepseek_r1, deepseek_v3, ernie45, granite, mistral, olmo3, openai_gptoss, qwen3, "
             "seed_oss")
    with pytest.raises(ValueError, match=f"unknown reasoning parser 'nope'; {known}"):
        get_reasoning_parser("nope")


def test_unknown_parser_names_fail_at_start_up(monkeypatch, capsys):
    pytest.importorskip("fastapi")
    import plait.entrypoints.server as server
    from plait.entrypoints import cli

    with pytest.raises(ValueError, match="unknown reasoning parser 'nope'; known: deepseek_r1"):
        server.ServerConfig(reasoning_parser="nope")
    seen = []
    monkeypatch.setattr(server, "serve", lambda engine_config, config, **_: seen.append(config))
    assert cli.main(["serve", "--reasoning-parser", "qwen3"]) == 0
    assert cli.main(["serve"]) == 0
    assert [c.reasoning_parser for c in seen] == ["qwen3", None]
    # Refused by name once a --reasoning-parser-plugin could have added it, before the model loads.
    assert cli.main(["serve", "--reasoning-parser", "nope"]) == 2
    assert "unknown reasoning parser 'nope'; known: deepseek_r1" in capsys.readouterr().err

