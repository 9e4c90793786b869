"""The plait CLI end to end: generate and one-shot chat with the default model, clear errors, and parsing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _plait(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "plait.entrypoints.cli", *args], capture_output=True,
                          text=True, input=stdin, env=env, timeout=300)


def _plait_main(capsys, *args: str) -> subprocess.CompletedProcess:
    """`plait ARGS` through the CLI's main() in this process, its exit status and output as _plait gives them:
    a fresh process per command would spend ~10 s starting up (imports, the model read again)."""
    from plait.entrypoints.cli import main

    capsys.readouterr()  # only this command's output
    status = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), status, out, err)


def test_generate_and_chat_with_default_model(capsys):
    from plait import LLM, SamplingParams

    llm = LLM()
    expected = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                        SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0].outputs[0].text
    del llm
    res = _plait_main(capsys, "chat", "What is the capital of France?", "--max-tokens", "12")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == expected.strip()

    # A real `python -m plait.entrypoints.cli` process (its entry point, exit status, stdin and stdout).
    res = _plait("chat", "--max-tokens", "8", stdin="Name a colour.\n/exit\n")  # interactive
    assert res.returncode == 0, res.stderr
    assert "you> " in res.stdout and len(res.stdout.split("you> ")[1].strip()) > 0

    res = _plait_main(capsys, "generate", "The capital of France is", "--max-tokens", "5",
                      "--max-num-batched-tokens", "4")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip()


def test_cli_errors_are_clear(tmp_path):
    res = _plait("generate", "hi", "--model", str(tmp_path / "missing.gguf"))
    assert res.returncode == 2 and "does not exist" in res.stderr
    res = _plait("generate", "hi", "--temperature", "-2")
    assert res.returncode == 2 and "temperature" in res.stderr


def test_serve_takes_the_model_as_positional_or_flag(capsys):
    from plait.entrypoints.cli import _engine_config, parse_args

    assert _engine_config(parse_args(["serve", "m.gguf"])).model == "m.gguf"  # as `vllm serve MODEL`
    assert _engine_config(parse_args(["serve", "--model", "m.gguf"])).model == "m.gguf"
    assert parse_args(["serve", "m.gguf", "--model", "m.gguf", "--port", "0"]).model == "m.gguf"  # agreeing
    assert parse_args(["serve"]).model is None  # the default model
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["serve", "a.gguf", "--model", "b.gguf"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "'a.gguf'" in err and "'b.gguf'" in err


def test_seed_and_dtype_aliases_are_engine_flags():
    from plait.entrypoints.cli import _engine_config, parse_args

    for command in (["serve"], ["generate", "hi"], ["chat", "hi"]):
        config = _engine_config(parse_args([*command, "--seed", "7", "--dtype", "half"]))
        assert (config.seed, config.dtype) == (7, "float16")
    assert _engine_config(parse_args(["serve", "--dtype", "float"])).dtype == "float32"
    # `bench w4 --seed` keeps seeding its prompts; the engine keeps its default seed there.
    args = parse_args(["bench", "w4", "--seed", "3"])
    assert args.seed == 3 and _engine_config(args).seed == 0


def test_worker_extension_cls_is_vllms_flag():
    from plait.entrypoints.cli import _engine_config, parse_args

    args = parse_args(["serve", "m", "--worker-extension-cls", "trainer.sync:WeightSync"])
    assert _engine_config(args).worker_extension_cls == "trainer.sync:WeightSync"
    assert _engine_config(parse_args(["serve", "m"])).worker_extension_cls is None


def test_enable_expert_parallel_is_vllms_flag():
    """vLLM's --enable-expert-parallel (and its -ep) beside --tensor-parallel-size; without a split across
    GPUs it has nothing to deal out, and is refused."""
    from plait.entrypoints.cli import _engine_config, parse_args

    for flag in ("--enable-expert-parallel", "-ep"):
        config = _engine_config(parse_args(["serve", "m", "-tp", "2", flag]))
        assert config.enable_expert_parallel and config.tensor_parallel_size == 2
    for flags in (["-tp", "2"], ["--no-enable-expert-parallel"]):
        assert not _engine_config(parse_args(["serve", "m", *flags])).enable_expert_parallel
    with pytest.raises(ValueError, match="enable_expert_parallel .* needs tensor_parallel_size > 1"):
        _engine_config(parse_args(["generate", "hi", "-ep"]))


def test_max_model_len_takes_vllms_human_readable_sizes(capsys):
    """As vLLM's --max-model-len: k/m/g/t are powers of 1,000 (decimals allowed), K/M/G/T of 1,024 (whole
    numbers); anything else is refused by the parser, naming the value."""
    from plait.entrypoints.cli import _engine_config, parse_args

    for value, tokens in (("32768", 32768), ("32k", 32000), ("32K", 32768), ("25.6k", 25600), ("1M", 2**20)):
        assert _engine_config(parse_args(["serve", "--max-model-len", value])).max_model_len == tokens
    for bad in ("2.5K", "32kb", "lots"):
        with pytest.raises(SystemExit):
            parse_args(["serve", "--max-model-len", bad])
        assert repr(bad) in capsys.readouterr().err


def test_hf_overrides_is_vllms_json_flag():
    from plait.config import merge_objects
    from plait.entrypoints.cli import _engine_config, parse_args

    flag = '{"architectures": ["Qwen3ForSequenceClassification"], "rope_scaling": {"factor": 2.0}}'
    config = _engine_config(parse_args(["serve", "m", "--hf-overrides", flag]))
    assert config.hf_overrides == {"architectures": ["Qwen3ForSequenceClassification"],
                                   "rope_scaling": {"factor": 2.0}}
    # Nested objects merge key by key; anything else is replaced.
    merged = merge_objects({"architectures": ["Qwen3ForCausalLM"], "rope_scaling": {"type": "yarn"},
                                 "vocab_size": 9}, config.hf_overrides)
    assert merged == {"architectures": ["Qwen3ForSequenceClassification"],
                      "rope_scaling": {"type": "yarn", "factor": 2.0}, "vocab_size": 9}
    assert _engine_config(parse_args(["serve", "m"])).hf_overrides is None
    limits = parse_args(["serve", "m", "--limit-mm-per-prompt", '{"image": 2}'])
    assert _engine_config(limits).limit_mm_per_prompt == {"image": 2}
    with pytest.raises(ValueError, match="'image',\\) alone"):
        _engine_config(parse_args(["serve", "m", "--limit-mm-per-prompt", '{"video": 1}']))
    with pytest.raises(ValueError, match="hf_overrides is not valid JSON"):
        _engine_config(parse_args(["serve", "m", "--hf-overrides", "{nope"]))
