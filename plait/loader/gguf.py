"""Read a GGUF checkpoint into an HF-style config dict and an fp32 state dict with transformers names."""

from __future__ import annotations

import re
from collections.abc import Callable
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
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "gemma": ("gemma", "GemmaForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    # Text-only: llama.cpp writes an image-text Gemma 3's vision tower to a separate mmproj file.
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    # Cohere's Command R / R+ / Aya and Command R7B / A: LayerNorms (layer_norm_epsilon), logit_scale.
    "command-r": ("cohere", "CohereForCausalLM"),
    "cohere2": ("cohere2", "Cohere2ForCausalLM"),
}
# llama.cpp's converter interleaves the Q/K rows of these architectures for its rotary layout
# (LlamaModel.permute in convert_hf_to_gguf.py); every other one here is written unpermuted (llama.cpp
# rotates them in the NeoX / rotate-half layout HF uses).
PERMUTED_QK_ARCHITECTURES = frozenset({"llama"})
# Gemma's RMSNorms scale by (1 + weight); llama.cpp's converter stores every "*norm.weight" as weight + 1
# (q/k norms included), so that its plain RMSNorm applies them.
NORM_OFFSET_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3"})
MOE_ARCHITECTURES = frozenset({"qwen2moe", "qwen3moe"})
# One LayerNorm a layer (no ffn_norm: attention and MLP read the same), its eps under
# attention.layer_norm_epsilon; llama.cpp rotates their q/k as HF stores them (adjacent pairs), unpermuted.
COHERE_ARCHITECTURES = frozenset({"command-r", "cohere2"})
# llama.cpp's Cohere2 (llama_model::load_hparams: set_swa_pattern(4)): every fourth layer global.
COHERE2_SLIDING_PATTERN = 4
GEMMA_ACTIVATION = "gelu_pytorch_tanh"

# Per-block GGUF tensor stem -> HF module path under model.layers.{i}.
_BLOCK_TENSOR_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3: q, k, v rows fused, as its HF checkpoints store them
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Qwen-MoE: the router, and Qwen2-MoE's gated shared expert.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Where an architecture names a stem otherwise.
_ARCH_BLOCK_TENSOR_NAMES: dict[str, dict[str, str]] = {
    # Gemma's sandwich norms: llama.cpp's ffn_norm is the pre-MLP norm, its post_attention_norm the norm on
    # the attention output (HF's post_attention_layernorm), post_ffw_norm the one on the MLP output.
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    # Phi-3's ffn_up holds gate and up rows fused (HF's gate_up_proj: gate rows first).
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
}
_ARCH_BLOCK_TENSOR_NAMES["gemma3"] = _ARCH_BLOCK_TENSOR_NAMES["gemma2"]
# MoE experts, stacked by llama.cpp into one [n_expert, rows, cols] tensor per projection (gate and up may
# also come fused as ffn_gate_up_exps: [n_expert, 2 * rows, cols], gate rows first); HF checkpoints store
# each expert's [rows, cols] matrix as model.layers.{i}.mlp.experts.{e}.{projection}.weight.
_EXPERT_TENSORS: dict[str, tuple[str, ...]] = {
    "ffn_gate_exps": ("gate_proj",),
    "ffn_up_exps": ("up_proj",),
    "ffn_down_exps": ("down_proj",),
    "ffn_gate_up_exps": ("gate_proj", "up_proj"),
}
_GLOBAL_TENSOR_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Phi-3's LongRoPE factors, which HF keeps in the config's rope_scaling (read by _build_config).
_ROPE_FACTOR_TENSORS = {"rope_factors_long.weight": "long_factor",
                        "rope_factors_short.weight": "short_factor"}
# Tensors llama.cpp computes from the config (Llama 3 rope frequencies) or keeps there (Phi-3's); HF models
# have no such parameter, so they are dropped just as transformers drops them.
_IGNORED_TENSORS = frozenset({"rope_freqs.weight", *_ROPE_FACTOR_TENSORS})
_BLOCK_TENSOR_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# GGUF rope.scaling.type -> HF rope_type; "none" means no scaling.
_ROPE_SCALING_TYPES = {"linear": "linear", "yarn": "yarn"}
# What llama.cpp assumes where a Gemma GGUF leaves a key out (llama_model::load_hparams).
GEMMA2_DEFAULTS = {"sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
GEMMA3_SLIDING_PATTERN = 6  # every sixth layer global
GEMMA3_LOCAL_ROPE_THETA = 10_000.0
# llama.cpp scales Gemma's queries by 1/sqrt(head_dim), except in the 27B models (told apart by their layer
# count), whose query_pre_attn_scalar is hidden_size / num_attention_heads: HF's value in every release.
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


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


def _torch_shape(tensor: Any) -> tuple[int, ...]:
    """A GGUF tensor's shape as torch / HF order it (GGUF lists dimensions innermost first)."""
    return tuple(int(d) for d in reversed(tensor.shape))


def _build_config(reader: gguf.GGUFReader, path: Path) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF file {str(path)!r} has architecture {arch!r}; "
            f"plait supports {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    model_type, hf_class = SUPPORTED_ARCHITECTURES[arch]
    tensors = {t.name: t for t in reader.tensors}

    def key(name: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{name}", default)

    def required(name: str) -> Any:
        value = key(name)
        if value is None:
            raise ValueError(f"GGUF file {str(path)!r} lacks the metadata key '{arch}.{name}'")
        return value

    hidden_size = required("embedding_length")
    num_heads = required("attention.head_count")
    num_layers = required("block_count")
    # head_count_kv may be absent (MHA) or a per-layer list (hybrid models); take the common value.
    num_kv_heads = key("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):
        num_kv_heads = max(num_kv_heads)
    # key_length is the real head size (Qwen3: 128 with hidden 1024 / 16 heads); llama.cpp writes
    # rope.dimension_count == head_dim for Llama and omits key_length there (Phi-3's dimension_count is
    # the rotated part of a head only).
    head_dim = key("attention.key_length") or (key("rope.dimension_count") if arch == "llama" else None)
    head_dim = head_dim or hidden_size // num_heads
    # The embedding's rows: Gemma 3's converter drops the rows past the tokenizer's vocabulary, which a
    # vocab_size key (or the HF config) may still count.
    embedding = tensors.get("token_embd.weight")
    vocab_size = _torch_shape(embedding)[0] if embedding is not None else key("vocab_size")
    if vocab_size is None:  # older converters only store the token list
        vocab_size = len(reader.fields["tokenizer.ggml.tokens"].data)

    # An all-expert MoE file may leave the dense width out (_moe_config fills it in).
    ffn = "feed_forward_length"
    intermediate = key(ffn) if arch in MOE_ARCHITECTURES else required(ffn)
    config: dict[str, Any] = {
        "architectures": [hf_class],
        "model_type": model_type,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab_size,
        "max_position_embeddings": required("context_length"),
        "rope_theta": key("rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in tensors,
    }
    if arch in COHERE_ARCHITECTURES:
        config.update(_cohere_config(arch, key, required, tensors, config, path))
    else:
        config["rms_norm_eps"] = required("attention.layer_norm_rms_epsilon")
    pad = _field(reader, "tokenizer.ggml.padding_token_id")
    if pad is not None:
        config["pad_token_id"] = pad
    scaling_type = key("rope.scaling.type")
    if scaling_type in _ROPE_SCALING_TYPES:
        rope_scaling: dict[str, Any] = {
            "rope_type": _ROPE_SCALING_TYPES[scaling_type],
            "factor": float(key("rope.scaling.factor", 1.0)),
        }
        orig_ctx = key("rope.scaling.original_context_length")
        if orig_ctx is not None:
            rope_scaling["original_max_position_embeddings"] = orig_ctx
        config["rope_scaling"] = rope_scaling
    elif scaling_type not in (None, "none") and not (arch == "phi3" and scaling_type == "longrope"):
        raise ValueError(f"GGUF file {str(path)!r} uses unsupported rope scaling {scaling_type!r}")
    if arch in NORM_OFFSET_ARCHITECTURES:
        config.update(_gemma_config(arch, key, config))
    elif arch == "phi3":
        config.update(_phi3_config(key, tensors, config, path))
    elif arch in MOE_ARCHITECTURES:
        config.update(_moe_config(arch, key, required, tensors, config))
    return config


def _gemma_config(arch: str, key: Callable[..., Any], config: dict[str, Any]) -> dict[str, Any]:
    """Gemma's keys of an HF config.json, as llama.cpp runs the file: GeGLU; no more for Gemma 1 (every layer
    global, queries scaled by head_dim^-1/2, as transformers runs it). Gemma 2's sliding layers alternate
    with global ones (from the first) and its soft-caps are the file's (else llama.cpp's defaults); Gemma 3's
    every sixth layer is global where the file has a window (none without), its sliding layers rotate with
    their own unscaled base, its logits are soft-capped where the file says."""
    gemma: dict[str, Any] = {"hidden_act": GEMMA_ACTIVATION, "hidden_activation": GEMMA_ACTIVATION}
    if arch == "gemma":
        return gemma
    layers = config["num_hidden_layers"]
    is_27b = layers == GEMMA_27B_LAYERS[arch]
    gemma["query_pre_attn_scalar"] = (config["hidden_size"] // config["num_attention_heads"] if is_27b
                                      else config["head_dim"])
    if arch == "gemma2":
        sliding = [i % 2 == 0 for i in range(layers)]
        gemma["sliding_window"] = key("attention.sliding_window") or GEMMA2_DEFAULTS["sliding_window"]
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            gemma[name] = key(name, GEMMA2_DEFAULTS[name]) or None
    else:
        window = key("attention.sliding_window")
        pattern = key("attention.sliding_window_pattern", GEMMA3_SLIDING_PATTERN)
        if not window:
            sliding = [False] * layers
        elif isinstance(pattern, list):  # one flag per layer, True where it slides
            sliding = [bool(flag) for flag in pattern]
        else:  # llama.cpp's set_swa_pattern(n): all but every n-th layer slide (n = 0: all)
            sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
        gemma["sliding_window"] = window or None
        gemma["rope_local_base_freq"] = float(key("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_THETA))
        gemma["final_logit_softcapping"] = key("final_logit_softcapping") or None
        gemma["attn_logit_softcapping"] = None
    gemma["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    return gemma


def _cohere_config(arch: str, key: Callable[..., Any], required: Callable[[str], Any],
                   tensors: dict[str, Any], config: dict[str, Any], path: Path) -> dict[str, Any]:
    """Cohere's keys of an HF config.json, as llama.cpp runs the file: the LayerNorms' eps, logit_scale;
    Command R+'s per-head q/k norms where the file has them; Cohere2's window on all but every fourth layer
    (whose layers without a window do not rotate: plait.models.cohere). A rotary over part of each head
    (Cohere2's converter writes rotary_pct's share; every release turns whole heads, as transformers does) is
    refused."""
    rotated = key("rope.dimension_count")
    if rotated is not None and rotated != config["head_dim"]:
        raise ValueError(f"GGUF file {str(path)!r}: {arch} with a rotary over {rotated} of each head's "
                         f"{config['head_dim']} channels is not supported")
    cohere: dict[str, Any] = {"layer_norm_eps": required("attention.layer_norm_epsilon"),
                              "logit_scale": required("logit_scale")}
    if arch == "command-r":
        cohere["use_qk_norm"] = "blk.0.attn_q_norm.weight" in tensors
    else:
        cohere["sliding_window"] = required("attention.sliding_window")
        pattern = COHERE2_SLIDING_PATTERN
        cohere["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                 for i in range(config["num_hidden_layers"])]
    return cohere


def _phi3_config(key: Callable[..., Any], tensors: dict[str, Any], config: dict[str, Any],
                 path: Path) -> dict[str, Any]:
    """Phi-3's keys of an HF config.json: the rotated share of each head (Phi-4-mini's 0.75), the window
    (0 in the file: none), the pretraining length, and LongRoPE's factors, which llama.cpp keeps as
    tensors."""
    phi3: dict[str, Any] = {"sliding_window": key("attention.sliding_window") or None}
    rotated = key("rope.dimension_count")
    if rotated and rotated != config["head_dim"]:
        phi3["partial_rotary_factor"] = rotated / config["head_dim"]
    original = key("rope.scaling.original_context_length")
    if original is not None:
        phi3["original_max_position_embeddings"] = original
    factors = {hf: gguf.quants.dequantize(tensors[name].data, tensors[name].tensor_type).ravel().tolist()
               for name, hf in _ROPE_FACTOR_TENSORS.items() if name in tensors}
    if factors:
        if len(factors) != len(_ROPE_FACTOR_TENSORS):
            raise ValueError(f"GGUF file {str(path)!r} has only one of {sorted(_ROPE_FACTOR_TENSORS)}")
        phi3["rope_scaling"] = {"type": "longrope", **factors}
    return phi3


def _moe_config(arch: str, key: Callable[..., Any], required: Callable[[str], Any], tensors: dict[str, Any],
                config: dict[str, Any]) -> dict[str, Any]:
    """Qwen2-MoE / Qwen3-MoE's keys of an HF config.json. Layers without a router keep a dense MLP
    (mlp_only_layers); llama.cpp renormalises the top-k weights for Qwen3-MoE and not for Qwen2-MoE."""
    layers = config["num_hidden_layers"]
    sparse = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in tensors]

    def rows(stem: str) -> int | None:  # a tensor's output rows in the first sparse layer
        tensor = tensors.get(f"blk.{sparse[0]}.{stem}.weight") if sparse else None
        return None if tensor is None else _torch_shape(tensor)[-2]

    gate_up = rows("ffn_gate_up_exps")
    expert_size = key("expert_feed_forward_length") or rows("ffn_gate_exps") or (gate_up and gate_up // 2)
    moe: dict[str, Any] = {
        "num_experts": required("expert_count"),
        "num_experts_per_tok": required("expert_used_count"),
        "moe_intermediate_size": expert_size,
        "norm_topk_prob": bool(key("expert_weights_norm", arch == "qwen3moe")),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(layers) if i not in sparse],
        "use_sliding_window": False,
    }
    if config["intermediate_size"] is None:
        moe["intermediate_size"] = expert_size
    if arch == "qwen2moe":
        shared = rows("ffn_gate_shexp")  # None: no shared expert
        if shared is not None:
            shared = key("expert_shared_feed_forward_length") or shared
        moe["shared_expert_intermediate_size"] = shared or 0
    return moe


def _hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """HF parameter name of a GGUF tensor, or None for tensors HF models do not have."""
    if gguf_name in _IGNORED_TENSORS:
        return None
    m = _BLOCK_TENSOR_RE.fullmatch(gguf_name)
    if m:
        layer, stem, kind = m.groups()
        module = _ARCH_BLOCK_TENSOR_NAMES.get(arch, {}).get(stem) or _BLOCK_TENSOR_NAMES.get(stem)
        if module is None:
            raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
        return f"model.layers.{layer}.{module}.{kind}"
    stem, _, kind = gguf_name.rpartition(".")
    module = _GLOBAL_TENSOR_NAMES.get(stem)
    if module is None:
        raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
    return f"{module}.{kind}"


def _expert_tensors(layer: int, stem: str, weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """HF's per-expert matrices of a stacked GGUF expert tensor ([n_expert, rows, cols]), as views."""
    projections = _EXPERT_TENSORS[stem]
    if weights.dim() != 3:
        raise ValueError(f"GGUF expert tensor blk.{layer}.{stem} has shape {tuple(weights.shape)}, "
                         "expected [experts, rows, columns]")
    parts = weights.chunk(len(projections), dim=1)  # ffn_gate_up_exps: gate rows, then up rows
    return {f"model.layers.{layer}.mlp.experts.{expert}.{projection}.weight": part[expert]
            for projection, part in zip(projections, parts, strict=True) for expert in range(len(weights))}


def _unpermute_rotary_rows(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of Q/K rows (same arithmetic as transformers' GGUF loader).

    The converter regroups each head's rows from HF's rotate-half order [x0..x_{d/2}, y0..] into
    interleaved pairs; swapping the (dim, 2) axes back restores HF's order. Works on weights
    (rows, cols) and on biases (rows,).
    """
    half = weights.shape[0] // n_head // 2
    w = weights.reshape(n_head, half, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


def gguf_architecture(path: str | Path) -> str:
    """A GGUF file's ``general.architecture`` (llama.cpp's name: "gemma", "qwen3moe", ...)."""
    path = _check_gguf_path(path)
    return _field(_open_reader(path), "general.architecture")


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
    to `AutoModelForCausalLM.from_pretrained(dir, gguf_file=name, dtype=torch.float32)`; what llama.cpp's
    converter changed is undone (Llama's Q/K row interleaving, Gemma's norm weights stored as w + 1), and
    stacked MoE experts come apart into HF's per-expert matrices (views of one tensor per projection).
    `lm_head.weight` is present only when the file has an untied output matrix.
    """
    path = _check_gguf_path(path)
    reader = _open_reader(path)
    config = _build_config(reader, path)
    arch = _field(reader, "general.architecture")
    permute = arch in PERMUTED_QK_ARCHITECTURES
    norm_offset = arch in NORM_OFFSET_ARCHITECTURES
    n_heads, n_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]

    tensors = reader.tensors
    if path.stat().st_size >= PROGRESS_BAR_MIN_BYTES:
        from tqdm.auto import tqdm

        tensors = tqdm(tensors, desc=f"Dequantising {path.name}", unit="tensor")
    state_dict: dict[str, torch.Tensor] = {}
    for tensor in tensors:
        if tensor.name in _IGNORED_TENSORS:
            continue
        block = _BLOCK_TENSOR_RE.fullmatch(tensor.name)
        name = None if block and block[2] in _EXPERT_TENSORS else _hf_name(tensor.name, arch)
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if permute and ".attn_q." in tensor.name:
            weights = _unpermute_rotary_rows(weights, n_heads)
        elif permute and ".attn_k." in tensor.name:
            weights = _unpermute_rotary_rows(weights, n_kv_heads)
        elif norm_offset and tensor.name.endswith("norm.weight"):
            weights = weights - 1  # in fp32, as transformers' Gemma2TensorProcessor
        # Copy: F32 tensors come back as read-only views of the memory map.
        weights = torch.from_numpy(np.array(weights, dtype=np.float32, order="C", copy=True))
        if name is None:
            state_dict.update(_expert_tensors(int(block[1]), block[2], weights))
            continue
        if name.endswith("shared_expert_gate.weight") and weights.dim() == 1:
            weights = weights[None]  # HF's [1, hidden]; converters have squeezed it to [hidden]
        state_dict[name] = weights
    _check_complete(state_dict, config, path)
    return config, state_dict


def _expected_tensors(state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> list[str]:
    """The HF tensors a checkpoint of ``config`` must have."""
    model_type = config["model_type"]
    sandwich = model_type in ("gemma2", "gemma3_text")  # Gemma 2 / 3: norms after the sublayers too
    expected = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config["tie_word_embeddings"]:
        expected.append("lm_head.weight")
    parallel = model_type in ("cohere", "cohere2")  # Cohere: one norm feeding attention and MLP
    norms = ["input_layernorm"] if parallel else ["input_layernorm", "post_attention_layernorm"]
    if sandwich:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    qk_normed = model_type in ("qwen3", "qwen3_moe", "gemma3_text") or config.get("use_qk_norm")
    qk_norms = ["self_attn.q_norm", "self_attn.k_norm"] if qk_normed else []
    dense_layers = set(config.get("mlp_only_layers") or [])
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        fused_qkv = f"{prefix}self_attn.qkv_proj.weight" in state_dict
        modules = norms + qk_norms + ["self_attn.o_proj"]
        modules += ["self_attn.qkv_proj"] if fused_qkv else ["self_attn.q_proj", "self_attn.k_proj",
                                                             "self_attn.v_proj"]
        if model_type == "phi3":
            modules += ["mlp.gate_up_proj", "mlp.down_proj"]
        elif config.get("num_experts") and i not in dense_layers:
            modules += ["mlp.gate"] + [f"mlp.experts.{e}.{p}" for e in range(config["num_experts"])
                                       for p in ("gate_proj", "up_proj", "down_proj")]
            if config.get("shared_expert_intermediate_size"):
                modules += ["mlp.shared_expert_gate"] + [f"mlp.shared_expert.{p}"
                                                         for p in ("gate_proj", "up_proj", "down_proj")]
        else:
            modules += ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
        expected += [f"{prefix}{module}.weight" for module in modules]
    return expected


def _check_complete(state_dict: dict[str, torch.Tensor], config: dict[str, Any], path: Path) -> None:
    missing = [name for name in _expected_tensors(state_dict, config) if name not in state_dict]
    if missing:
        raise ValueError(f"GGUF file {str(path)!r} lacks {len(missing)} tensor(s), e.g. {missing[:3]}")
