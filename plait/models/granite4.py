"""Granite 4.0 (GraniteMoeHybridForCausalLM): Granite MoE shared's layers, mixing by Mamba2 or attention."""

from __future__ import annotations

import torch

from plait.attention.base import Rotary
from plait.config import ModelConfig
from plait.layers.mamba import Mamba2Mixer
from plait.models.bamba import ATTENTION, MAMBA, bamba_dims
from plait.models.base import RecurrentCausalLM
from plait.models.granite import (
    GRANITE_MOE_NAMES,
    GraniteDecoderLayer,
    GraniteModel,
    GraniteMoeForCausalLM,
)
from plait.models.llama import Attention
from plait.runner.forward_batch import ForwardBatch

# position_embedding_type: "rope" rotates q and k (granite-4.0-micro); the H models say "nope" (or nothing, as
# transformers' default): their attention has no positions, the Mamba layers carry order.
ROPE, NOPE = "rope", "nope"
POSITION_EMBEDDING_TYPES = (ROPE, NOPE, None)
# A dense model's shared MLP (no experts) is its layers' MLP: its checkpoint names -> plait's.
GRANITE4_DENSE_NAMES = (
    ("shared_mlp.input_linear.weight", "mlp.gate_up_proj.weight"),
    ("shared_mlp.output_linear.weight", "mlp.down_proj.weight"),
)


def layer_types(raw: dict) -> list[str]:
    """Each layer's kind (MAMBA or ATTENTION) from a completed config (plait.config.completed_text_config
    reads the Hub's "mamba" / "attention" as transformers 5's names); any other kind is refused by name."""
    types = list(raw["layer_types"])
    unknown = sorted({t for t in types if t not in (MAMBA, ATTENTION)})
    if unknown:
        raise ValueError(f"Granite 4 layer kinds {unknown} are not supported (only Mamba and attention)")
    if len(types) != raw["num_hidden_layers"]:
        raise ValueError(f"Granite 4 config: {len(types)} layer_types for {raw['num_hidden_layers']} layers")
    return types


class GraniteMoeHybridDecoderLayer(GraniteDecoderLayer):
    """Granite's layer (multipliers, the MoE block beside the shared MLP, or the shared MLP alone) whose mixer
    is attention or, on a Mamba layer, a Mamba2 mixer (``mamba``, its state among the Mamba layers' slots)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)  # make_attention: None on a Mamba layer
        types = layer_types(cfg.raw)
        kind = types[layer_idx]
        dims = bamba_dims(cfg.raw).split(cfg.mamba_ranks)  # a tensor-parallel rank's: its heads
        self.mamba = Mamba2Mixer(dims, state_index=types[:layer_idx].count(MAMBA)) if kind == MAMBA else None

    def make_attention(self, cfg: ModelConfig, layer_idx: int) -> Attention | None:
        types = layer_types(cfg.raw)
        if types[layer_idx] == MAMBA:
            return None
        return super().make_attention(cfg, types[:layer_idx].count(ATTENTION))  # its index: its KV cache

    def mix(self, x: torch.Tensor, rotary: Rotary | None, batch: ForwardBatch) -> torch.Tensor:
        # x: [T, hidden] normalised -> [T, hidden]
        return self.mamba(x, batch) if self.mamba is not None else self.self_attn(x, rotary, batch)


class GraniteMoeHybridModel(GraniteModel):
    layer_class = GraniteMoeHybridDecoderLayer

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        kind = cfg.raw.get("position_embedding_type")
        if kind not in POSITION_EMBEDDING_TYPES:
            raise ValueError(f"Granite 4 position_embedding_type {kind!r} is not supported "
                             f"(only {ROPE!r} and {NOPE!r})")
        if kind != ROPE:
            self.rotary = None  # the attention layers store K as it is and attend without positions


class GraniteMoeHybridForCausalLM(GraniteMoeForCausalLM, RecurrentCausalLM):
    """GraniteMoeHybridForCausalLM (granite-4.0-h-tiny / -h-small: MoE with a shared MLP; -h-micro: dense;
    granite-4.0-micro: all attention with rotary, dense): Granite's four multipliers, logits divided by
    logits_scaling, tied embeddings. Mamba layers keep state in slots (so no prefix caching); an
    all-attention model is a plain decoder and caches prefixes."""

    model_class = GraniteMoeHybridModel

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        types = layer_types(cfg.raw)
        self.dims = bamba_dims(cfg.raw).split(cfg.mamba_ranks)
        self.num_mamba_layers = types.count(MAMBA)
        self.num_kv_cache_layers = types.count(ATTENTION)
        self.supports_prefix_caching = self.num_mamba_layers == 0
        self.checkpoint_names = GRANITE_MOE_NAMES if cfg.moe is not None else GRANITE4_DENSE_NAMES
