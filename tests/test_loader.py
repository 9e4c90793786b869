"""Loader tests: GGUF weights and config equal transformers'; tokenizer cache; HF folders; resolve_model."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

# GGUF loading needs the gguf package (installed by the test set-up; absent on some GPU images).
gguf = pytest.importorskip("gguf")
from conftest import add_gguf_shape  # noqa: E402
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.initialization import no_init_weights  # noqa: E402

from plait.loader import tokenizer as tokenizer_mod  # noqa: E402
from plait.loader.gguf import default_model_path, load_gguf, read_gguf_config  # noqa: E402
from plait.loader.hf import ModelSource, load_hf_folder, resolve_model  # noqa: E402
from plait.loader.tokenizer import load_tokenizer, tokenizer_cache_dir  # noqa: E402

CHAT = [{"role": "user", "content": "What is 2+2?"}]
ROUND_TRIP_TEXT = "Hello, world! Ça va? 日本語 1234  two  spaces\n<|im_start|>user"


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def plait_gguf(gguf_path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    return load_gguf(gguf_path)


# --- (a) GGUF weights and config ---------------------------------------------------------------
# The reference is hf_gguf_model (conftest.py): transformers' own GGUF load of the default model.


def test_gguf_state_dict_bit_identical_to_transformers(plait_gguf, hf_gguf_model) -> None:
    config, state_dict = plait_gguf
    reference = hf_gguf_model.state_dict()
    assert config["tie_word_embeddings"] is True
    # Tied: transformers exposes lm_head.weight as an alias of the embedding; plait omits it.
    assert set(reference) - set(state_dict) == {"lm_head.weight"}
    assert set(state_dict) <= set(reference)
    for name, tensor in state_dict.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == reference[name].shape, name
        assert torch.equal(tensor, reference[name]), name
    assert torch.equal(reference["lm_head.weight"], state_dict["model.embed_tokens.weight"])


def test_gguf_config_matches_transformers(plait_gguf, hf_gguf_model) -> None:
    config, _ = plait_gguf
    ref = hf_gguf_model.config
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "hidden_act",
        "attention_bias",
    ):
        assert config[key] == getattr(ref, key), key
    # transformers 5 keeps theta under rope_parameters; plait's dict keeps the config.json key.
    assert config["rope_theta"] == ref.rope_parameters["rope_theta"]
    assert config["model_type"] == ref.model_type == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "rope_scaling" not in config
    assert read_gguf_config(default_model_path()) == config


def test_gguf_weights_drive_a_transformers_model(plait_gguf, hf_gguf_model) -> None:
    """The dict loads strictly into a stock LlamaForCausalLM built from the dict config."""
    config, state_dict = plait_gguf
    with no_init_weights():  # random init of 135M params is wasted work: every weight is replaced
        model = LlamaForCausalLM(LlamaConfig(**config)).eval()
    missing, unexpected = model.load_state_dict(state_dict, strict=False, assign=True)
    assert unexpected == [] and missing in ([], ["lm_head.weight"])
    model.tie_weights()
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253]])
    # One thread: on a shared 2-core box multi-threaded GEMMs of a 6-token forward slow down ~20x
    # when other processes compete for the cores; one thread also makes both runs identical.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            assert torch.equal(model(ids).logits, hf_gguf_model(ids).logits)
    finally:
        torch.set_num_threads(threads)


def _llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: the layout plait must undo."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


_TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=100,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)
_TINY_MODELS = {
    # Untied head plus linear rope scaling: exercises output.weight and rope_scaling.
    "llama": (LlamaForCausalLM, LlamaConfig(**_TINY, tie_word_embeddings=False), gguf.MODEL_ARCH.LLAMA),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**_TINY, tie_word_embeddings=True), gguf.MODEL_ARCH.QWEN2),
    # head_dim 32 != 64 / 4: must come from attention.key_length, not hidden_size / heads.
    "qwen3": (
        Qwen3ForCausalLM,
        Qwen3Config(**_TINY, head_dim=32, tie_word_embeddings=True),
        gguf.MODEL_ARCH.QWEN3,
    ),
}


def _write_f32_gguf(model: torch.nn.Module, arch: gguf.MODEL_ARCH, path: Path) -> None:
    """Write an unquantised GGUF the way llama.cpp's converter does (names, metadata, Q/K permute)."""
    cfg = model.config
    arch_name = gguf.MODEL_ARCH_NAMES[arch]
    writer = gguf.GGUFWriter(path, arch_name)
    add_gguf_shape(writer, cfg)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    if arch_name == "llama":
        writer.add_rope_dimension_count(cfg.head_dim)
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(2.0)
    if arch_name == "qwen3":
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        stem, kind = hf_name.rsplit(".", 1)
        gguf_name = f"{names.get_name(stem)}.{kind}"
        weights = tensor.numpy()
        if arch_name == "llama" and ".attn_q." in gguf_name:
            weights = _llama_cpp_permute(weights, cfg.num_attention_heads)
        elif arch_name == "llama" and ".attn_k." in gguf_name:
            weights = _llama_cpp_permute(weights, cfg.num_key_value_heads)
        writer.add_tensor(gguf_name, np.ascontiguousarray(weights))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", sorted(_TINY_MODELS))
def test_gguf_round_trip_recovers_original_weights(tmp_path: Path, arch: str) -> None:
    """HF model -> llama.cpp-style F32 GGUF -> load_gguf gives back the very same tensors and config."""
    model_cls, config, gguf_arch = _TINY_MODELS[arch]
    torch.manual_seed(0)
    model = model_cls(config)
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_f32_gguf(model, gguf_arch, path)

    loaded_config, state_dict = load_gguf(path)
    reference = model.state_dict()
    if config.tie_word_embeddings:
        reference.pop("lm_head.weight")
    assert set(state_dict) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(state_dict[name], tensor), name
    assert loaded_config["model_type"] == config.model_type
    assert loaded_config["architectures"] == [model_cls.__name__]
    # Qwen2Config has no head_dim attribute: it is always hidden_size / heads there.
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert loaded_config["head_dim"] == head_dim
    assert loaded_config["tie_word_embeddings"] == config.tie_word_embeddings
    assert loaded_config["attention_bias"] == (arch == "qwen2")
    if arch == "llama":
        assert loaded_config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    else:
        assert "rope_scaling" not in loaded_config


def test_load_gguf_rejects_non_gguf(tmp_path: Path) -> None:
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_gguf(fake)
    with pytest.raises(FileNotFoundError):
        load_gguf(tmp_path / "missing.gguf")


# --- (b) tokenizer --------------------------------------------------------------------------------


def test_gguf_tokenizer_round_trip_chat_template_and_cache(gguf_path, plait_gguf, tmp_path, monkeypatch):
    config, _ = plait_gguf
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path))
    cache_dir = tokenizer_cache_dir(gguf_path)
    assert cache_dir.is_relative_to(tmp_path) and not cache_dir.exists()

    start = time.perf_counter()
    tok = load_tokenizer(gguf_path)
    first_s = time.perf_counter() - start
    assert (cache_dir / "tokenizer.json").is_file()
    assert not [p for p in cache_dir.parent.iterdir() if p.name.endswith(".tmp")]  # no leftovers

    ids = tok(ROUND_TRIP_TEXT, add_special_tokens=False).input_ids
    assert tok.decode(ids) == ROUND_TRIP_TEXT
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == config["eos_token_id"] == 2
    assert tok.bos_token_id == config["bos_token_id"]
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    prompt = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")

    # Second call must come from the cache: make conversion impossible.
    def no_conversion(path: Path) -> None:
        raise AssertionError("tokenizer was converted again instead of read from the cache")

    monkeypatch.setattr(tokenizer_mod, "_convert_gguf_tokenizer", no_conversion)
    start = time.perf_counter()
    tok2 = load_tokenizer(gguf_path)
    second_s = time.perf_counter() - start
    assert Path(tok2.name_or_path) == cache_dir
    assert second_s < first_s / 3, (first_s, second_s)
    assert tok2(ROUND_TRIP_TEXT).input_ids == tok(ROUND_TRIP_TEXT).input_ids
    assert tok2.chat_template == tok.chat_template
    assert tok2.eos_token_id == tok.eos_token_id

    # A process that loses the race to publish the cache entry keeps the winner's copy, cleanly.
    tokenizer_mod._save_atomically(tok2, cache_dir)
    assert (cache_dir / "tokenizer.json").is_file()
    assert [p.name for p in cache_dir.parent.iterdir()] == [cache_dir.name]


def test_hf_folder_without_tokenizer_returns_none(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert load_tokenizer(tmp_path) is None


# --- (c) HF folders -----------------------------------------------------------------------------


def _tiny_llama(tie: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("tie", [False, True])
def test_hf_folder_round_trip(tmp_path: Path, tie: bool) -> None:
    model = _tiny_llama(tie)
    model.save_pretrained(tmp_path)
    config, state_dict = load_hf_folder(tmp_path)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["hidden_size"] == 64 and config["num_key_value_heads"] == 2
    reference = model.state_dict()
    expected = set(reference) - ({"lm_head.weight"} if tie else set())
    assert set(state_dict) == expected
    for name, tensor in state_dict.items():
        assert torch.equal(tensor, reference[name]), name
    assert resolve_model(tmp_path) == ModelSource("hf", tmp_path.resolve())


def test_hf_folder_sharded(tmp_path: Path) -> None:
    model = _tiny_llama(tie=False)
    model.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    _, state_dict = load_hf_folder(tmp_path)
    reference = model.state_dict()
    assert set(state_dict) == set(reference)
    assert all(torch.equal(state_dict[k], reference[k]) for k in reference)


def test_hf_weights_stream_shard_by_shard(tmp_path: Path, monkeypatch) -> None:
    """The engine reads a sharded checkpoint a shard at a time: the first tensor arrives before the second
    file is opened, so a model larger than host memory still loads."""
    from plait.loader import hf

    _tiny_llama(tie=False).save_pretrained(tmp_path, max_shard_size="50KB")
    opened = []
    real_open = hf.safe_open
    monkeypatch.setattr(hf, "safe_open", lambda file, **kw: (opened.append(file), real_open(file, **kw))[1])
    stream = hf.iter_hf_weights(tmp_path)
    next(stream)
    assert len(opened) == 1
    rest = list(stream)
    assert len(opened) > 1 and len(rest) + 1 == len(_tiny_llama(tie=False).state_dict())


def _sharded_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    """A tiny Llama saved in several shards; its state dict."""
    model = _tiny_llama(tie=False)
    model.save_pretrained(folder, max_shard_size="50KB")
    return model.state_dict()


def test_safetensors_load_strategies_read_the_same_tensors(tmp_path: Path, monkeypatch) -> None:
    """vLLM's --safetensors-load-strategy: "eager" reads each shard whole (no map: safe_open is never
    called), "prefetch" maps them while its thread reads every file ahead, and both give lazy's tensors; the
    prefetch thread is stopped when the load ends."""
    from plait.loader import hf

    reference = _sharded_checkpoint(tmp_path)
    files = hf.checkpoint_files(tmp_path)
    assert len(files) > 2
    lazy = list(hf.iter_hf_weights(tmp_path))
    assert [name for name, _ in lazy] and {name for name, _ in lazy} == set(reference)

    def same_as_lazy(got: list[tuple[str, torch.Tensor]]) -> bool:  # a shard's names may come in any order
        want = dict(lazy)
        return len(got) == len(want) and all(torch.equal(t, want[name]) for name, t in got)

    prefetchers = []

    class Recorded(hf.Prefetcher):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            prefetchers.append(self)

    monkeypatch.setattr(hf, "Prefetcher", Recorded)
    assert same_as_lazy(list(hf.iter_hf_weights(tmp_path, strategy="prefetch")))
    (prefetcher,) = prefetchers
    assert prefetcher.files == files and prefetcher.ident is not None and not prefetcher.is_alive()
    whole = hf.Prefetcher(files, block_bytes=4096)
    whole.run()  # what the thread does, here to its end: every byte of every file read
    assert whole.bytes_read == sum(f.stat().st_size for f in files)

    def no_map(*args, **kwargs):
        raise AssertionError("the eager strategy mapped a file")

    monkeypatch.setattr(hf, "safe_open", no_map)
    assert same_as_lazy(list(hf.iter_hf_weights(tmp_path, strategy="eager")))
    assert same_as_lazy(list(hf.iter_hf_weights(tmp_path, strategy="eager", threads=2)))
    with pytest.raises(AssertionError, match="mapped"):
        list(hf.iter_hf_weights(tmp_path))


def test_multithread_load_reads_shards_ahead_on_threads(tmp_path: Path, monkeypatch) -> None:
    """vLLM's --model-loader-extra-config enable_multithread_load / num_threads: shards are read on that many
    threads, at most num_threads ahead of the one handed out, and the tensors come in file order."""
    import threading

    from plait.loader import hf

    _sharded_checkpoint(tmp_path)
    files = hf.checkpoint_files(tmp_path)
    assert len(files) > 3
    lazy = list(hf.iter_hf_weights(tmp_path))
    read = []
    real_read = hf.read_shard

    def recorded(file, strategy):
        read.append((file, threading.current_thread().name))
        return real_read(file, strategy)

    monkeypatch.setattr(hf, "read_shard", recorded)
    stream = hf.iter_hf_weights(tmp_path, threads=2)
    next(stream)
    assert 1 <= len(read) <= 3  # the shard handed out and at most two ahead
    got = [lazy[0], *stream]
    assert [n for n, _ in got] == [n for n, _ in lazy]
    assert all(torch.equal(t, want) for (_, t), (_, want) in zip(got, lazy))
    assert sorted(file for file, _ in read) == files
    assert all(name.startswith("plait-load") for _, name in read)


def test_model_loader_extra_config_and_additional_config_are_checked_by_key(tmp_path: Path) -> None:
    """vLLM's loader options: its safetensors loader's keys are taken (num_threads alone reads one shard at
    a time, as vLLM's), others refused by name; --additional-config only as {} (plait has no platform
    plugins); a GGUF model refuses the multithreaded load, which reads safetensors shards."""
    from plait.config import EngineConfig, load_threads
    from plait.loader.hf import resolve_model
    from plait.loader.model_loader import read_source

    assert load_threads(EngineConfig()) == 1
    assert load_threads(EngineConfig(model_loader_extra_config='{"enable_multithread_load": true}')) == 8
    assert load_threads(EngineConfig(model_loader_extra_config={"enable_multithread_load": True,
                                                                "num_threads": 3})) == 3
    assert load_threads(EngineConfig(model_loader_extra_config={"num_threads": 3})) == 1
    assert EngineConfig(additional_config="{}").additional_config is None
    refused = [(dict(model_loader_extra_config='{"pattern": "x"}'), r"\['pattern'\] is not available"),
               (dict(model_loader_extra_config={"num_threads": 0}), "num_threads must be >= 1"),
               (dict(model_loader_extra_config={"enable_multithread_load": "yes"}), "true or false"),
               (dict(model_loader_extra_config="[1]"), "must be a JSON object"),
               (dict(additional_config='{"b": 1, "a": {}}'), r"\['a', 'b'\] is not available"),
               (dict(safetensors_load_strategy="mmap"), "lazy, eager, prefetch")]
    for kwargs, words in refused:
        with pytest.raises(ValueError, match=words):
            EngineConfig(**kwargs)
    with pytest.raises(ValueError, match="is a GGUF file"):
        read_source(resolve_model(None), "dummy", threads=2)


def test_hf_config_path_describes_the_model_whose_weights_load(tiny_llama: Path, tmp_path: Path) -> None:
    """vLLM's --hf-config-path (and LLM(hf_config_path=...)): config.json and, under generation_config auto,
    generation_config.json come from that folder, which holds no weights; the weights from the model's.
    A folder without a config.json is refused before the weights load."""
    import json
    import shutil

    from plait import LLM

    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.75}))
    config = json.loads((tiny_llama / "config.json").read_text())
    assert config["max_position_embeddings"] == 512
    other = tmp_path / "config"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 96}))
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.25}))
    llm = LLM(str(model), hf_config_path=str(other), block_size=8)
    engine = llm.engine
    assert engine.model_config.max_position_embeddings == 96 and engine.max_model_len == 96
    assert engine.runner.model_path == model.resolve()
    assert llm.get_default_sampling_params().temperature == 0.25
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) > 0
    with pytest.raises(ValueError, match="is not a folder holding a config.json"):
        LLM(str(model), hf_config_path=str(tmp_path), block_size=8)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(model), hf_config_path=str(tmp_path / "none"), block_size=8)


# --- (d) resolve_model --------------------------------------------------------------------------


def test_resolve_model_default_and_gguf(gguf_path: Path) -> None:
    assert resolve_model(None) == ModelSource("gguf", gguf_path)
    assert resolve_model(str(gguf_path)).kind == "gguf"


def test_resolve_model_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model(missing)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model(str(missing))


def test_resolve_model_non_model_folder_and_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="neither a .gguf file nor a folder with config.json"):
        resolve_model(tmp_path)
    text = tmp_path / "notes.txt"
    text.write_text("hi")
    with pytest.raises(ValueError, match="neither a .gguf file"):
        resolve_model(text)
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"nope")
    with pytest.raises(ValueError, match="not a GGUF file"):
        resolve_model(fake)


# Hub ids ("org/name"), resolved from the local HF cache: tests/test_hub_cache.py.


@pytest.mark.parametrize("shard", [False, True])
def test_pytorch_bin_checkpoints_load_as_their_safetensors_twins(tiny_llama, tmp_path, shard):
    """A folder of PyTorch weight files (pytorch_model.bin, or shards named by its index; older checkpoints
    and EAGLE heads ship these), read with torch.load's weights_only: the model its safetensors twin is."""
    import json
    import shutil

    from conftest import run_greedy
    from transformers import AutoModelForCausalLM

    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine
    from plait.loader.hf import checkpoint_files, read_pt_file

    state = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).state_dict()
    shutil.copy(tiny_llama / "config.json", tmp_path / "config.json")
    if not shard:
        torch.save(state, tmp_path / "pytorch_model.bin")
    else:  # two shards and the index naming them, as transformers 4 wrote them
        names = sorted(state)
        halves = {"pytorch_model-00001-of-00002.bin": names[::2],
                  "pytorch_model-00002-of-00002.bin": names[1::2]}
        for file, part in halves.items():
            torch.save({n: state[n] for n in part}, tmp_path / file)
        weight_map = {n: file for file, part in halves.items() for n in part}
        (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "training_args.bin").write_bytes(b"not weights")  # left beside them by a training run
    files = checkpoint_files(tmp_path)
    assert files and all(f.suffix == ".bin" and f.name != "training_args.bin" for f in files)
    assert (len(files) > 1) == bool(shard)
    prompts = [[5, 6, 7, 8], list(range(20, 50))]

    def outputs(folder):
        return run_greedy(LLMEngine(EngineConfig(model=str(folder), num_kv_blocks=64, block_size=8)), prompts,
                          max_tokens=6)[0]

    assert outputs(tmp_path) == outputs(tiny_llama)
    torch.save({"w": torch.zeros(2), "note": "not a tensor"}, tmp_path / "other.bin")
    with pytest.raises(ValueError, match="not a state dict of tensors"):
        read_pt_file(tmp_path / "other.bin")
