"""Bamba: a hybrid of Mamba2 mixers and a few attention layers, each followed by a gated MLP.

Attention layers use the paged KV cache; the runner allocates KV only for them (``kv_index`` is an
attention layer's index among attention layers). Mamba layers keep per-request state in slots
(``state_index`` among Mamba layers).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from plait.config import ModelConfig
from plait.layers.mamba import Mamba2Dims, Mamba2Mixer
from plait.layers.norm import RMSNorm
from plait.layers.rotary import PartialRotaryEmbedding
from plait.models.base import RecurrentCausalLM
from plait.models.llama import MLP, Attention
from plait.models.mamba2 import check_activation, time_step_limit
from plait.models.weights import load_decoder_weights
from plait.runner.forward_batch import ForwardBatch

ATTENTION, MAMBA = "full_attention", "linear_attention"
# Bamba rotates only part of each attention head (transformers hard-codes 0.5 for it).
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5


def bamba_dims(raw: dict) -> Mamba2Dims:
    check_activation(raw.get("hidden_act", "silu"))
    hidden = raw["hidden_size"]
    heads = raw.get("mamba_n_heads", 128)
    head_dim = raw.get("mamba_d_head", "auto")
    if head_dim == "auto":
        head_dim = raw.get("mamba_expand", 2) * hidden // heads
    return Mamba2Dims(
        hidden_size=hidden, num_heads=heads, head_dim=head_dim, state_size=raw.get("mamba_d_state", 256),
        n_groups=raw.get("mamba_n_groups", 1), conv_kernel=raw.get("mamba_d_conv", 4),
        chunk_size=raw.get("mamba_chunk_size", 256), use_conv_bias=raw.get("mamba_conv_bias", True),
        use_bias=raw.get("mamba_proj_bias", False), norm_eps=raw.get("rms_norm_eps", 1e-5),
        time_step_limit=time_step_limit(raw),
    )


def layer_types(raw: dict) -> list[str]:
    attention = set(raw.get("attn_layer_indices") or [])
    return [ATTENTION if i in attention else MAMBA for i in range(raw["num_hidden_layers"])]


class BambaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dims: Mamba2Dims, layer_type: str, index: int) -> None:
        super().__init__()
        self.layer_type = layer_type
        if layer_type == MAMBA:
            self.mamba = Mamba2Mixer(dims, state_index=index)
        else:
            self.self_attn = Attention(cfg, layer_idx=index)  # index = its KV cache
        self.feed_forward = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rotary: PartialRotaryEmbedding,
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.forward_residual(x, residual)
        x = self.mamba(x, batch) if self.layer_type == MAMBA else self.self_attn(x, rotary, batch)
        x, residual = self.pre_ff_layernorm.forward_residual(x, residual)
        return self.feed_forward(x), residual


class BambaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dims: Mamba2Dims, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        types = layer_types(cfg.raw)
        # Each layer's index among layers of its own kind: its state slot tensors or its KV cache.
        indices = [types[:i].count(t) for i, t in enumerate(types)]
        self.layers = nn.ModuleList(BambaDecoderLayer(cfg, dims, t, j) for t, j in zip(types, indices))
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        factor = (cfg.raw.get("rope_parameters") or {}).get("partial_rotary_factor",
                                                            DEFAULT_PARTIAL_ROTARY_FACTOR)
        self.rotary = PartialRotaryEmbedding(int(cfg.head_dim * factor), max_positions, cfg.rope_theta,
                                             cfg.rope_scaling)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, self.rotary, batch)
        x, _ = self.final_layernorm.forward_residual(x, residual)
        return x


class BambaForCausalLM(RecurrentCausalLM):
    """forward(input_ids, positions, batch) -> hidden states; logits on request."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        raw = cfg.raw
        if raw.get("mlp_bias") or raw.get("attention_bias"):
            raise ValueError("Bamba with mlp_bias or attention_bias is not supported")
        self.config = cfg
        self.dims = bamba_dims(raw).split(cfg.mamba_ranks)
        types = layer_types(raw)
        self.num_kv_cache_layers = types.count(ATTENTION)
        self.num_mamba_layers = types.count(MAMBA)
        self.model = BambaModel(cfg, self.dims, max_positions)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_decoder_weights(self, weights)
