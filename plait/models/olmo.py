"""OLMo 2 and OLMo 3 (AllenAI): the Llama decoder with its norms moved after each sublayer (their output is
normalised, then added to the stream; no norm before), q and k normalised across all heads, and OLMo 3's
sliding-window layers beside global ones."""

from __future__ import annotations

import torch
from torch import nn

from plait.attention.base import Rotary
from plait.config import ModelConfig
from plait.layers.norm import OlmoRMSNorm
from plait.models.layer_kinds import FULL, SLIDING, kind_rotaries, layer_ropes, layer_types
from plait.models.llama import MLP, Attention, LlamaForCausalLM
from plait.runner.forward_batch import ForwardBatch

# transformers' defaults where a config leaves them out (Olmo3Config): every fourth layer global.
DEFAULT_SLIDING_PATTERN = 4
DEFAULT_THETA = 10_000.0


class OlmoAttention(Attention):
    flat_qk_norm = True

    def __init__(self, cfg: ModelConfig, layer_idx: int, sliding: bool) -> None:
        super().__init__(cfg, layer_idx)
        self.q_norm = OlmoRMSNorm(self.q_size, cfg.rms_norm_eps)
        self.k_norm = OlmoRMSNorm(self.kv_size, cfg.rms_norm_eps)
        self.sliding_window = cfg.raw.get("sliding_window") if sliding else None


class OlmoDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.self_attn = OlmoAttention(cfg, layer_idx, sliding=kind == SLIDING)
        self.mlp = MLP(cfg)
        self.post_attention_layernorm = OlmoRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = OlmoRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rotary: Rotary, batch: ForwardBatch) -> torch.Tensor:
        # x: the residual stream [T, hidden] -> the stream after this layer
        x = x + self.post_attention_layernorm(self.self_attn(x, rotary, batch))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class OlmoModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        # OLMo 2 attends globally everywhere; OLMo 3's configs list their layers' kinds.
        kinds = layer_types(cfg.raw, DEFAULT_SLIDING_PATTERN) if cfg.raw.get("layer_types") else (
            [FULL] * cfg.num_hidden_layers)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(OlmoDecoderLayer(cfg, i, kind) for i, kind in enumerate(kinds))
        self.norm = OlmoRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = kind_rotaries(layer_ropes(cfg.raw, DEFAULT_THETA, DEFAULT_THETA), cfg.head_dim,
                                    max_positions)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # input_ids: [T] -> hidden: [T, hidden]
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, self.rotary[layer.kind], batch)
        return self.norm(x)


class OlmoForCausalLM(LlamaForCausalLM):
    """Olmo2ForCausalLM and Olmo3ForCausalLM (7B, 13B, 32B): checkpoints in the Llama family's names, so
    q/k/v and gate/up fuse at load and adapters wrap the same projections."""

    model_class = OlmoModel

    def fold_norm_weights(self) -> None:
        """Nothing to fold: OLMo has no norm before its MLP."""
