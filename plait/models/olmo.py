"""OLMo 2 and OLMo 3 (AllenAI): the Llama decoder with its norms moved after each sublayer (their output is
normalised, then added to the stream; no norm before), q and k normalised across all heads, and OLMo 3's
sliding-window layers beside global ones. EXAONE 4.0 (LG AI Research) has the same layer with Llama's norms,
q and k normalised per head, and no rotary on its global layers where it has sliding ones. OLMoE (AllenAI's
MoE) keeps Llama's norms before each sublayer, normalises q and k across all heads as OLMo 2 does, and runs
the Llama family's sparse MoE block."""

from __future__ import annotations

import torch
from torch import nn

from plait.attention.base import Rotary
from plait.config import ModelConfig
from plait.layers.norm import OlmoRMSNorm, RMSNorm
from plait.models.layer_kinds import FULL, SLIDING, kind_rotaries, layer_ropes, layer_types
from plait.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM, LlamaModel, MoeForCausalLM
from plait.models.weights import LoadRecord
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


class ExaoneAttention(Attention):
    """Per-head q/k norms (Llama's RMSNorm, fused into the rotary launch on the GPU); a model with a window
    rotates q and k on its sliding layers only: its global layers attend without positions (NoPE)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, sliding: bool) -> None:
        super().__init__(cfg, layer_idx)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        window = cfg.raw.get("sliding_window")
        self.sliding_window = window if sliding else None
        self.uses_rope = window is None or sliding

    def forward(self, x: torch.Tensor, rotary: Rotary, batch: ForwardBatch) -> torch.Tensor:
        return super().forward(x, rotary if self.uses_rope else None, batch)


class OlmoDecoderLayer(nn.Module):
    attention_class: type[Attention] = OlmoAttention
    norm_class: type[nn.Module] = OlmoRMSNorm

    def __init__(self, cfg: ModelConfig, layer_idx: int, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.self_attn = self.attention_class(cfg, layer_idx, sliding=kind == SLIDING)
        self.mlp = MLP(cfg)
        self.post_attention_layernorm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rotary: Rotary, batch: ForwardBatch) -> torch.Tensor:
        # x: the residual stream [T, hidden] -> the stream after this layer
        x = x + self.post_attention_layernorm(self.self_attn(x, rotary, batch))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class ExaoneDecoderLayer(OlmoDecoderLayer):
    attention_class = ExaoneAttention
    norm_class = RMSNorm


class OlmoModel(nn.Module):
    layer_class = OlmoDecoderLayer

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        kinds = self.layer_kinds(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(cfg, i, kind) for i, kind in enumerate(kinds))
        self.norm = self.layer_class.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = kind_rotaries(layer_ropes(cfg.raw, DEFAULT_THETA, DEFAULT_THETA), cfg.head_dim,
                                    max_positions)

    @staticmethod
    def layer_kinds(cfg: ModelConfig) -> list[str]:
        """OLMo 2 attends globally everywhere; OLMo 3's configs list their layers' kinds."""
        if cfg.raw.get("layer_types"):
            return layer_types(cfg.raw, DEFAULT_SLIDING_PATTERN)
        return [FULL] * cfg.num_hidden_layers

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # input_ids: [T] -> hidden: [T, hidden]
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, self.rotary[layer.kind], batch)
        return self.norm(x)


class ExaoneModel(OlmoModel):
    layer_class = ExaoneDecoderLayer

    @staticmethod
    def layer_kinds(cfg: ModelConfig) -> list[str]:
        """The config's layer_types, else every sliding_window_pattern-th layer global (EXAONE 4.0's
        default: 4) where the model has a window, every layer global where it has none."""
        if not cfg.raw.get("sliding_window"):
            return [FULL] * cfg.num_hidden_layers
        if not cfg.raw.get("layer_types") and isinstance(cfg.raw.get("sliding_window_pattern"), str):
            raise ValueError("an EXAONE 4.0 config with a lettered sliding_window_pattern needs layer_types")
        return layer_types(cfg.raw, DEFAULT_SLIDING_PATTERN)


class OlmoForCausalLM(LlamaForCausalLM):
    """Olmo2ForCausalLM and Olmo3ForCausalLM (7B, 13B, 32B): checkpoints in the Llama family's names, so
    q/k/v and gate/up fuse at load and adapters wrap the same projections."""

    model_class = OlmoModel

    def fold_norm_weights(self, loaded: LoadRecord | None = None) -> None:
        """Nothing to fold: OLMo has no norm before its MLP."""


class Exaone4ForCausalLM(OlmoForCausalLM):
    """Exaone4ForCausalLM (EXAONE 4.0 1.2B and 32B)."""

    model_class = ExaoneModel


class OlmoeAttention(Attention):
    """OLMoE's: q and k each normalised as one row across all heads (OlmoeRMSNorm is Llama's, rounding the
    row before the weight: not OLMo 2's), then q, k and v clipped to +-clip_qkv where the config sets it."""

    flat_qk_norm = True

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.q_norm = RMSNorm(self.q_size, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, cfg.rms_norm_eps)
        clip = cfg.raw.get("clip_qkv")
        self.clip_qkv = None if clip is None else float(clip)


class OlmoeDecoderLayer(DecoderLayer):
    def make_attention(self, cfg: ModelConfig, layer_idx: int) -> Attention:
        return OlmoeAttention(cfg, layer_idx)


class OlmoeModel(LlamaModel):
    layer_class = OlmoeDecoderLayer


class OlmoeForCausalLM(MoeForCausalLM):
    """OlmoeForCausalLM (OLMoE-1B-7B-0924 / -0125 and their -Instruct: 64 experts, 8 a token, whose softmax
    weights are not renormalised: norm_topk_prob false). Hub checkpoints name each expert's projections as
    Qwen-MoE's do (mlp.experts.{e}.gate_proj, mlp.gate the router); transformers 5's stacked experts load too.
    Split across GPUs as OLMo 2 is (q/k norms: Attention.qk_norm_group)."""

    model_class = OlmoeModel
