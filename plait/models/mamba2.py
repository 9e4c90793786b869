"""Mamba2 (attention-free): every layer is RMSNorm + a Mamba2 mixer with per-request state slots."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from plait.config import ModelConfig, decoded_floats
from plait.layers.mamba import Mamba2Dims, Mamba2Mixer
from plait.layers.norm import RMSNorm
from plait.models.base import RecurrentCausalLM
from plait.models.weights import load_checked
from plait.runner.forward_batch import ForwardBatch

# The only conv/gate activation the Mamba2 kernels implement.
SUPPORTED_MAMBA_ACTIVATION = "silu"


def hf_float(value: Any) -> float:
    """A float from an HF config: transformers 5 writes infinities as {"__float__": "Infinity"}."""
    return float(decoded_floats(value))


def time_step_limit(raw: dict) -> tuple[float, float]:
    limit = raw.get("time_step_limit") or (0.0, float("inf"))
    return hf_float(limit[0]), hf_float(limit[1])


def check_activation(name: str) -> None:
    if name != SUPPORTED_MAMBA_ACTIVATION:
        raise ValueError(f"Mamba activation {name!r} is not supported (only {SUPPORTED_MAMBA_ACTIVATION})")


def mamba2_dims(raw: dict) -> Mamba2Dims:
    check_activation(raw.get("hidden_act", SUPPORTED_MAMBA_ACTIVATION))
    dims = Mamba2Dims(
        hidden_size=raw["hidden_size"], num_heads=raw["num_heads"], head_dim=raw["head_dim"],
        state_size=raw["state_size"], n_groups=raw.get("n_groups", 1), conv_kernel=raw.get("conv_kernel", 4),
        chunk_size=raw.get("chunk_size", 256), use_conv_bias=raw.get("use_conv_bias", True),
        use_bias=raw.get("use_bias", False), norm_eps=raw.get("layer_norm_epsilon", 1e-5),
        time_step_limit=time_step_limit(raw),
    )
    if raw.get("expand", 2) * dims.hidden_size != dims.intermediate_size:
        raise ValueError("Mamba2 config: hidden_size * expand must equal num_heads * head_dim")
    return dims


class Mamba2Block(nn.Module):
    def __init__(self, dims: Mamba2Dims, eps: float, layer_idx: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dims.hidden_size, eps)
        self.mixer = Mamba2Mixer(dims, state_index=layer_idx)

    def forward(self, residual: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # residual: [T, hidden], fp32 when the config keeps residuals in fp32 (as HF does)
        return residual + self.mixer(self.norm(residual.to(self.norm.weight.dtype)), batch)


class Mamba2Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, dims: Mamba2Dims) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        num_layers = cfg.num_hidden_layers
        self.layers = nn.ModuleList(Mamba2Block(dims, cfg.rms_norm_eps, i) for i in range(num_layers))
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.residual_in_fp32 = bool(cfg.raw.get("residual_in_fp32", True))

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = self.embeddings(input_ids)  # [T, hidden]
        dtype = x.dtype
        if self.residual_in_fp32:
            x = x.float()
        for layer in self.layers:
            x = layer(x, batch)
        return self.norm_f(x).to(dtype)


class Mamba2ForCausalLM(RecurrentCausalLM):
    """forward(input_ids, positions, batch) -> hidden states; state lives in batch.recurrent_states."""

    num_kv_cache_layers = 0  # attention-free

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.dims = mamba2_dims(cfg.raw).split(cfg.mamba_ranks)
        self.num_mamba_layers = cfg.num_hidden_layers  # every layer
        self.backbone = Mamba2Backbone(cfg, self.dims)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden: [T, hidden]; a recurrent model needs no positions
        return self.backbone(input_ids, batch)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        tied = self.config.tie_word_embeddings

        def rename(name: str) -> str | None:
            if tied and name == "lm_head.weight":
                return None  # tied checkpoints sometimes store a copy of the embedding
            # Old Mamba2 checkpoints call the embedding "embedding" (HF renames it at load too).
            return name.replace("backbone.embedding.", "backbone.embeddings.")

        load_checked(self, weights, {}, {}, rename, frozenset({"lm_head.weight"}) if tied else frozenset())
