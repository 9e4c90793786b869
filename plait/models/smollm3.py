"""SmolLM3: the Llama decoder with no rotary on some layers (NoPE: every fourth by default) and, where the
config turns it on, a sliding window on the layers its ``layer_types`` name."""

from __future__ import annotations

import torch

from plait.attention.base import Rotary
from plait.config import ModelConfig
from plait.models.base import refuse_config_keys
from plait.models.layer_kinds import FULL, SLIDING, layer_types
from plait.models.llama import DecoderLayer, LlamaForCausalLM, LlamaModel
from plait.runner.forward_batch import ForwardBatch

# transformers' default (SmolLM3Config): a layer without rotary every this many layers, the last of each run.
DEFAULT_NO_ROPE_INTERVAL = 4


def rope_layers(raw: dict) -> list[bool]:
    """Whether each layer rotates q and k: the config's ``no_rope_layers`` (1: rotary, 0: none, as
    transformers reads the list despite its name), else every ``no_rope_layer_interval``-th layer without."""
    n = raw["num_hidden_layers"]
    flags = raw.get("no_rope_layers")
    if flags is None:
        interval = raw.get("no_rope_layer_interval") or DEFAULT_NO_ROPE_INTERVAL
        return [(i + 1) % interval != 0 for i in range(n)]
    if len(flags) != n:
        raise ValueError(f"no_rope_layers must give {n} layers a flag, got {len(flags)}")
    return [bool(flag) for flag in flags]


def layer_windows(raw: dict) -> list[int | None]:
    """Each layer's sliding window: the config's ``sliding_window`` on the layers ``layer_types`` calls
    sliding (without the list, the NoPE layers, as transformers fills it in), and only with
    ``use_sliding_window``: transformers ignores the window otherwise."""
    n = raw["num_hidden_layers"]
    window = raw.get("sliding_window")
    if not raw.get("use_sliding_window") or not window:
        return [None] * n
    if raw.get("layer_types"):
        kinds = layer_types(raw, default_pattern=1)
    else:
        kinds = [FULL if rope else SLIDING for rope in rope_layers(raw)]
    return [window if kind == SLIDING else None for kind in kinds]


class SmolLM3DecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.uses_rope = rope_layers(cfg.raw)[layer_idx]
        self.self_attn.sliding_window = layer_windows(cfg.raw)[layer_idx]

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rotary: Rotary, batch: ForwardBatch,
        fuse_mlp_norm: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # A NoPE layer stores and attends with q and k as projected: positions reach it only through the
        # causal mask and the layers below.
        return super().forward(x, residual, rotary if self.uses_rope else None, batch, fuse_mlp_norm)


class SmolLM3Model(LlamaModel):
    layer_class = SmolLM3DecoderLayer


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """SmolLM3ForCausalLM (HuggingFaceTB/SmolLM3-3B and its kin)."""

    model_class = SmolLM3Model

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        refuse_config_keys(cfg.raw, "SmolLM3", ("attention_bias", "mlp_bias"))
        super().__init__(cfg, max_positions)
