"""Read a GGUF checkpoint into an HF-style config dict and an fp32 state dict with transformers names."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from plait.loader.source import default_model_path, is_gguf_file  # noqa: F401 (re-exported)

# Above this file size dequantising takes long enough that a progress bar is worth its noise.
PROGRESS_BAR_MIN_BYTES = 512 * 1024**2

# GGUF `general.architecture` -> (HF model_type, HF architecture class).
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}
# llama.cpp's converter interleaves the Q/K rows of these architectures for its rotary layout
# (LlamaModel.permute in convert_hf_to_gguf.py); Qwen2/Qwen3 are written unpermuted.
PERMUTED_QK_ARCHITECTURES = frozenset({"llama"})

# Per-block GGUF tensor stem -> HF module path under model.layers.{i}.
_BLOCK_TENSOR_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSOR_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors llama.cpp computes from the config (Llama 3 rope frequencies); HF models have no such
# parameter, so they are dropped just as transformers drops them.
_IGNORED_TENSORS = frozenset({"rope_freqs.weight"})
_BLOCK_TENSOR_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# GGUF rope.scaling.type -> HF rope_type; "none" means no scaling.
_ROPE_SCALING_TYPES = {"linear": "linear", "yarn": "yarn"}


class _FastGGUFReader(gguf.GGUFReader):
    """GGUFReader that slices a plain ndarray view of its memmap instead of the memmap itself.

    Parsing the header touches ~500k tiny slices (one per vocabulary string); np.memmap's Python-level
    __getitem__/__array_finalize__ make that ~3x slower. The view shares the same mapping, so tensor
    data stays zero-copy. Falls back to the stock reader in `_open_reader` if internals change.
    """

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        plain = self.__dict__.get("_plain_data")
        if plain is None:
            plain = self.__dict__["_plain_data"] = self.data.view(np.ndarray)
        count = int(count)
        end = offset + np.dtype(dtype).itemsize * count
        arr = plain[offset:end].view(dtype=dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


def _open_reader(path: Path) -> gguf.GGUFReader:
    try:
        return _FastGGUFReader(path)
    except (TypeError, AttributeError):
        return gguf.GGUFReader(path)


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _build_config(reader: gguf.GGUFReader, path: Path) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF file {str(path)!r} has architecture {arch!r}; "
            f"plait supports {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    model_type, hf_class = SUPPORTED_ARCHITECTURES[arch]
    tensor_names = {t.name for t in reader.tensors}

    def required(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"GGUF file {str(path)!r} lacks the metadata key '{arch}.{key}'")
        return value

    hidden_size = required("embedding_length")
    num_heads = required("attention.head_count")
    # head_count_kv may be absent (MHA) or a per-layer list (hybrid models); take the common value.
    num_kv_heads = _field(reader, f"{arch}.attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):
        num_kv_heads = max(num_kv_heads)
    # key_length is the real head size (Qwen3: 128 with hidden 1024 / 16 heads); llama.cpp writes
    # rope.dimension_count == head_dim for Llama and omits key_length there.
    head_dim = _field(reader, f"{arch}.attention.key_length") or (
        _field(reader, f"{arch}.rope.dimension_count") if arch == "llama" else None
    )
    head_dim = head_dim or hidden_size // num_heads
    vocab_size = _field(reader, f"{arch}.vocab_size")
    if vocab_size is None:  # older converters only store the token list
        vocab_size = len(reader.fields["tokenizer.ggml.tokens"].data)

    config: dict[str, Any] = {
        "architectures": [hf_class],
        "model_type": model_type,
        "hidden_size": hidden_size,
        "intermediate_size": required("feed_forward_length"),
        "num_hidden_layers": required("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab_size,
        "max_position_embeddings": required("context_length"),
        "rms_norm_eps": required("attention.layer_norm_rms_epsilon"),
        "rope_theta": _field(reader, f"{arch}.rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
    }
    pad = _field(reader, "tokenizer.ggml.padding_token_id")
    if pad is not None:
        config["pad_token_id"] = pad
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    if scaling_type in _ROPE_SCALING_TYPES:
        rope_scaling: dict[str, Any] = {
            "rope_type": _ROPE_SCALING_TYPES[scaling_type],
            "factor": float(_field(reader, f"{arch}.rope.scaling.factor", 1.0)),
        }
        orig_ctx = _field(reader, f"{arch}.rope.scaling.original_context_length")
        if orig_ctx is not None:
            rope_scaling["original_max_position_embeddings"] = orig_ctx
        config["rope_scaling"] = rope_scaling
    elif scaling_type not in (None, "none"):
        raise ValueError(f"GGUF file {str(path)!r} uses unsupported rope scaling {scaling_type!r}")
    return config


def _hf_name(gguf_name: str) -> str | None:
    """HF parameter name of a GGUF tensor, or None for tensors HF models do not have."""
    if gguf_name in _IGNORED_TENSORS:
        return None
    m = _BLOCK_TENSOR_RE.fullmatch(gguf_name)
    if m:
        layer, stem, kind = m.groups()
        module = _BLOCK_TENSOR_NAMES.get(stem)
        if module is None:
            raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
        return f"model.layers.{layer}.{module}.{kind}"
    stem, _, kind = gguf_name.rpartition(".")
    module = _GLOBAL_TENSOR_NAMES.get(stem)
    if module is None:
        raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
    return f"{module}.{kind}"


def _unpermute_rotary_rows(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of Q/K rows (same arithmetic as transformers' GGUF loader).

    The converter regroups each head's rows from HF's rotate-half order [x0..x_{d/2}, y0..] into
    interleaved pairs; swapping the (dim, 2) axes back restores HF's order. Works on weights
    (rows, cols) and on biases (rows,).
    """
    half = weights.shape[0] // n_head // 2
    w = weights.reshape(n_head, half, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


def read_gguf_config(path: str | Path) -> dict[str, Any]:
    """Only the HF-style config dict of a GGUF file (no dequantisation), e.g. for random-weight runs."""
    path = _check_gguf_path(path)
    return _build_config(_open_reader(path), path)


def _check_gguf_path(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    if not is_gguf_file(path):
        raise ValueError(f"{str(path)!r} is not a GGUF file (bad magic bytes)")
    return path


def load_gguf(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Read a GGUF checkpoint: (HF-style config.json dict, fp32 state dict with HF parameter names).

    The tensors are dequantised with gguf-py exactly as transformers does, so they are bit-identical
    to `AutoModelForCausalLM.from_pretrained(dir, gguf_file=name, dtype=torch.float32)`.
    `lm_head.weight` is present only when the file has an untied output matrix.
    """
    path = _check_gguf_path(path)
    reader = _open_reader(path)
    config = _build_config(reader, path)
    arch = _field(reader, "general.architecture")
    permute = arch in PERMUTED_QK_ARCHITECTURES
    n_heads, n_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]

    tensors = reader.tensors
    if path.stat().st_size >= PROGRESS_BAR_MIN_BYTES:
        from tqdm.auto import tqdm

        tensors = tqdm(tensors, desc=f"Dequantising {path.name}", unit="tensor")
    state_dict: dict[str, torch.Tensor] = {}
    for tensor in tensors:
        name = _hf_name(tensor.name)
        if name is None:
            continue
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if permute and ".attn_q." in tensor.name:
            weights = _unpermute_rotary_rows(weights, n_heads)
        elif permute and ".attn_k." in tensor.name:
            weights = _unpermute_rotary_rows(weights, n_kv_heads)
        # Copy: F32 tensors come back as read-only views of the memory map.
        state_dict[name] = torch.from_numpy(np.array(weights, dtype=np.float32, order="C", copy=True))
    _check_complete(state_dict, config, path)
    return config, state_dict


def _check_complete(state_dict: dict[str, torch.Tensor], config: dict[str, Any], path: Path) -> None:
    expected = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config["tie_word_embeddings"]:
        expected.append("lm_head.weight")
    for i in range(config["num_hidden_layers"]):
        expected += [
            f"model.layers.{i}.{module}.weight"
            for module in (
                "input_layernorm",
                "post_attention_layernorm",
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "self_attn.o_proj",
                "mlp.gate_proj",
                "mlp.up_proj",
                "mlp.down_proj",
            )
        ]
    missing = [name for name in expected if name not in state_dict]
    if missing:
        raise ValueError(f"GGUF file {str(path)!r} lacks {len(missing)} tensor(s), e.g. {missing[:3]}")
