"""The model's generation_config.json, read as vLLM reads it: sampling defaults and extra EOS ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from plait import LLM, SamplingParams
from plait.config import EngineConfig
from plait.generation_config import GENERATION_CONFIG_FILE, GenerationDefaults, load_generation_defaults

PROMPT = {"prompt_token_ids": [5, 6, 7, 8, 9]}
TINY = dict(max_model_len=64, block_size=8)
NUM_TOKENS = 8


def _folder(path: Path, generation_config: dict | str | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    if generation_config is not None:
        text = generation_config if isinstance(generation_config, str) else json.dumps(generation_config)
        (path / GENERATION_CONFIG_FILE).write_text(text)
    return path


def _model(tiny_llama: Path, path: Path, generation_config: dict | None = None) -> Path:
    shutil.copytree(tiny_llama, path)
    return _folder(path, generation_config)


def _greedy(llm: LLM, **params) -> tuple[list[int], str]:
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, **params),
                       use_tqdm=False)[0].outputs[0]
    return out.token_ids, out.finish_reason


# -- reading the file ----------------------------------------------------------------------------


def test_sampling_fields_by_vllm_names(tmp_path):
    raw = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.05,
           "max_new_tokens": 256, "max_length": 20, "do_sample": False, "top_a": None, "eos_token_id": 7}
    defaults = load_generation_defaults("auto", _folder(tmp_path, raw))
    # As vLLM's get_diff_sampling_param: these six, max_new_tokens as max_tokens; do_sample is not read.
    assert defaults.sampling == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.0,
                                 "repetition_penalty": 1.05, "max_tokens": 256}
    assert defaults.eos_token_ids == {7} and defaults.max_tokens_cap is None
    # A model's own file only fills in; "vllm" keeps the EOS ids and drops the sampling defaults.
    assert (defaults.max_tokens(None), defaults.max_tokens(1000), defaults.max_tokens(3)) == (256, 1000, 3)
    assert load_generation_defaults("vllm", tmp_path) == GenerationDefaults(eos_token_ids=frozenset({7}))


def test_a_named_folder_caps_max_tokens(tmp_path):
    """As vLLM: the max_new_tokens of a file --generation-config names limits every request."""
    folder = _folder(tmp_path / "elsewhere", {"max_new_tokens": 64, "eos_token_id": [3, 4]})
    defaults = load_generation_defaults(str(folder), tmp_path / "model.gguf")  # a GGUF model too
    assert defaults.eos_token_ids == {3, 4}
    assert (defaults.max_tokens(None), defaults.max_tokens(1000), defaults.max_tokens(3)) == (64, 64, 3)
    with pytest.raises(FileNotFoundError, match="has none"):
        load_generation_defaults(str(tmp_path / "missing"), tmp_path)


def test_no_file_changes_nothing(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    _folder(tmp_path, {"temperature": 0.0})  # beside a GGUF file: not the model's (vLLM reads none either)
    assert load_generation_defaults("auto", gguf) == GenerationDefaults()
    assert load_generation_defaults("auto", _folder(tmp_path / "bare")) == GenerationDefaults()


@pytest.mark.parametrize("text, words", [
    ("{not json", "cannot read"),
    ("[1, 2]", "JSON object"),
    (json.dumps({"top_p": 0.0}), "top_p must be in"),
    (json.dumps({"eos_token_id": "2"}), "eos_token_id"),
    (json.dumps({"eos_token_id": [2, True]}), "eos_token_id"),
])
def test_bad_files_are_refused_at_load(tmp_path, text, words):
    with pytest.raises(ValueError, match=words):
        load_generation_defaults("auto", _folder(tmp_path, text))


def test_engine_config_checks_the_choice():
    assert EngineConfig().generation_config == "auto"
    with pytest.raises(ValueError, match="generation_config"):
        EngineConfig(generation_config="")


# -- the offline API ----------------------------------------------------------------------------


def test_llm_defaults_come_from_the_file(tiny_llama, tmp_path):
    """As vLLM's LLM.get_default_sampling_params: generate and chat without params use the file's."""
    folder = _model(tiny_llama, tmp_path / "model", {"temperature": 0.0, "max_new_tokens": NUM_TOKENS})
    llm = LLM(str(folder), **TINY)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS)
    default = llm.generate(PROMPT, use_tqdm=False)[0].outputs[0]
    assert (default.token_ids, default.finish_reason) == _greedy(llm)
    plain = LLM(str(folder), generation_config="vllm", **TINY)
    assert plain.get_default_sampling_params() == SamplingParams()


def test_generation_config_eos_ids_stop(tiny_llama, tmp_path):
    """Extra eos_token_id ids stop generation (min_tokens and ignore_eos treat them as EOS), as vLLM."""
    tokens, _ = _greedy(LLM(str(tiny_llama), **TINY), ignore_eos=True)
    # The first token that did not come before: with it as an EOS id, the output ends there.
    stop_at = next(i for i in range(1, NUM_TOKENS) if tokens[i] not in tokens[:i])
    folder = _model(tiny_llama, tmp_path / "model", {"eos_token_id": [2, tokens[stop_at]]})
    for source in ("auto", "vllm"):  # "vllm" drops the sampling defaults only
        llm = LLM(str(folder), generation_config=source, **TINY)
        assert _greedy(llm) == (tokens[:stop_at + 1], "stop")
        assert _greedy(llm, ignore_eos=True) == (tokens, "length")
    blocked, _ = _greedy(llm, min_tokens=NUM_TOKENS)  # EOS ids cannot be sampled before min_tokens
    assert len(blocked) == NUM_TOKENS and blocked[stop_at] != tokens[stop_at]


# -- --override-generation-config ---------------------------------------------------------------


def test_override_merges_over_the_file_or_over_none(tmp_path):
    """As vLLM's --override-generation-config: its fields over the model's file (HF names, max_new_tokens as
    max_tokens), or alone under "vllm" and where there is no file; the file's EOS ids stay."""
    folder = _folder(tmp_path / "model", {"temperature": 0.6, "top_p": 0.9, "eos_token_id": 7})
    override = {"temperature": 0.2, "max_new_tokens": 32}
    merged = load_generation_defaults("auto", folder, override)
    assert merged.sampling == {"temperature": 0.2, "top_p": 0.9, "max_tokens": 32}
    assert merged.eos_token_ids == {7} and merged.max_tokens_cap is None  # a default, as the file's
    alone = load_generation_defaults("vllm", folder, override)
    assert alone.sampling == {"temperature": 0.2, "max_tokens": 32} and alone.eos_token_ids == {7}
    assert load_generation_defaults("auto", _folder(tmp_path / "bare"), override).sampling == alone.sampling
    named = load_generation_defaults(str(folder), tmp_path / "model.gguf", {"max_new_tokens": 5})
    assert named.max_tokens(100) == 5  # a named folder's max_new_tokens caps, the override's too


@pytest.mark.parametrize("override, words", [
    ({"temprature": 0.5}, r"\['temprature'\] set no sampling default"),
    ({"do_sample": True}, "set no sampling default"),
    ({"top_p": 2.0}, "--override-generation-config: top_p must be in"),
])
def test_bad_overrides_are_refused_at_load(tmp_path, override, words):
    with pytest.raises(ValueError, match=words):
        load_generation_defaults("auto", _folder(tmp_path), override)


def test_llm_and_cli_take_the_override(tiny_llama, tmp_path):
    from plait.entrypoints.cli import parse_args

    llm = LLM(str(tiny_llama), override_generation_config={"temperature": 0.0, "max_new_tokens": NUM_TOKENS},
              **TINY)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS)
    default = llm.generate(PROMPT, use_tqdm=False)[0].outputs[0]
    assert (default.token_ids, default.finish_reason) == _greedy(llm)
    args = parse_args(["serve", "--override-generation-config", '{"top_k": 5}'])
    assert EngineConfig(override_generation_config=args.override_generation_config
                        ).override_generation_config == {"top_k": 5}
    with pytest.raises(ValueError, match="override_generation_config is not valid JSON"):
        EngineConfig(override_generation_config="{top_k: 5}")
