"""GLM-4 (Zhipu AI): GLM-4-9B (GlmForCausalLM, the Llama layer) and GLM-4-0414 / GLM-Z1 (Glm4ForCausalLM, a
norm after each sublayer as well as before it): q/k/v biases, fused gate/up, and a rotary over part of each
head (half by default) that turns adjacent channel pairs, GPT-J's way, which plait's kernels compute once
q's and k's channels are reordered at load (plait.models.weights.pairs_as_halves)."""

from __future__ import annotations

import torch
from torch import nn

from plait.attention.base import Rotary
from plait.config import ModelConfig
from plait.layers.norm import RMSNorm
from plait.layers.rotary import rotary_embedding
from plait.models.llama import MLP, Attention, PairedRotaryForCausalLM
from plait.models.weights import LoadRecord
from plait.runner.forward_batch import ForwardBatch


class GlmForCausalLM(PairedRotaryForCausalLM):
    """GlmForCausalLM (GLM-4-9B-chat in HF's format)."""


class Glm4DecoderLayer(nn.Module):
    """Each sublayer between a norm before it and one after it, its normalised output added to the stream."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_self_attn_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, eps)

    def forward(self, x: torch.Tensor, rotary: Rotary, batch: ForwardBatch) -> torch.Tensor:
        # x: the residual stream [T, hidden] -> the stream after this layer
        attn = self.post_self_attn_layernorm(self.self_attn(self.input_layernorm(x), rotary, batch))
        h, x = self.post_attention_layernorm.forward_residual(attn, x)  # the add and the MLP's pre-norm
        return x + self.post_mlp_layernorm(self.mlp(h))


class Glm4Model(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Glm4DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = rotary_embedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling,
                                       cfg.partial_rotary_factor)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # input_ids: [T] -> hidden: [T, hidden]
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, self.rotary, batch)
        return self.norm(x)


class Glm4ForCausalLM(GlmForCausalLM):
    """Glm4ForCausalLM (GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1)."""

    model_class = Glm4Model

    def fold_norm_weights(self, loaded: LoadRecord | None = None) -> None:
        """Kept unfolded: the MLP's output is normalised again before it joins the stream."""
