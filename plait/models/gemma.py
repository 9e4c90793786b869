"""The Gemma family: norms of the 1 + weight kind, GeGLU, embeddings scaled by sqrt(hidden). Gemma 1 is the
Llama decoder so changed; Gemma 2 and Gemma 3 (text) add sandwich norms and sliding-window layers beside
global ones, Gemma 2 soft-caps its attention scores, Gemma 3 normalises q and k and gives its sliding layers
a rotary base of their own."""

from __future__ import annotations

import functools

import torch
from torch import nn

from plait.attention.base import Rotary
from plait.config import ModelConfig
from plait.layers.linear import Linear
from plait.layers.norm import GemmaRMSNorm
from plait.models.layer_kinds import SLIDING, kind_rotaries, layer_ropes, layer_types
from plait.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM, LlamaModel
from plait.models.weights import LoadRecord
from plait.runner.forward_batch import ForwardBatch

# transformers' defaults where a config leaves them out (Gemma3TextConfig).
DEFAULT_GLOBAL_THETA = 1_000_000.0
DEFAULT_LOCAL_THETA = 10_000.0
DEFAULT_SLIDING_PATTERN = 6  # Gemma 3: every sixth layer attends globally


def check_gemma(raw: dict) -> None:
    """Refuse, by name, what plait's Gemma does not compute."""
    if raw.get("use_bidirectional_attention"):
        raise ValueError("bidirectional Gemma 3 (EmbeddingGemma) is not supported")


@functools.cache
def rounded_to(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype``, as a Python float."""
    return torch.tensor(value, dtype=dtype).item()


class GemmaAttention(Attention):
    """The Llama family's attention with Gemma's 1 + weight q/k norms (Gemma 3), a window on sliding layers,
    the query scale query_pre_attn_scalar^-1/2, and Gemma 2's cap on the scores."""

    norm_class = GemmaRMSNorm

    def __init__(self, cfg: ModelConfig, layer_idx: int, sliding: bool) -> None:
        super().__init__(cfg, layer_idx)
        if cfg.attention_bias:  # Gemma's o_proj takes the bias its q/k/v do
            self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=True)
        self.sliding_window = cfg.raw.get("sliding_window") if sliding else None
        self.scale = float(cfg.raw.get("query_pre_attn_scalar") or self.head_dim) ** -0.5
        self.logit_softcap = cfg.raw.get("attn_logit_softcapping")


class GemmaDecoderLayer(nn.Module):
    """Pre- and post-norms around both attention and MLP. A post-norm's output joins the residual stream,
    which the next pre-norm reads: the post-norm, the add and the pre-norm take one launch on the GPU, so
    the MLP's post-norm is applied by the next layer (or the final norm)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.self_attn = GemmaAttention(cfg, layer_idx, sliding=kind == SLIDING)
        self.mlp = MLP(cfg)
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, pending: GemmaRMSNorm | None, rotary: Rotary,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # x: the last layer's MLP output before its post-norm ``pending`` (the embeddings for the first
        # layer), residual: the stream it joins ([T, hidden] each) -> this layer's pair.
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.forward_residual(x, residual, pre_norm=pending)
        attn = self.self_attn(h, rotary, batch)
        h, residual = self.pre_feedforward_layernorm.forward_residual(
            attn, residual, pre_norm=self.post_attention_layernorm)
        return self.mlp(h), residual


class ScaledEmbedding(nn.Embedding):
    """Gemma's token embedding: the rows scaled by sqrt(hidden), rounded to the weights' dtype first as
    transformers does (sqrt(3072) becomes 55.5 in bf16; a host number, so graphs capture no copy). The scale
    belongs to the layer, as in transformers' Gemma 2 / 3, so given prompt embeddings (its inputs_embeds)
    are taken as they are."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.scale = embedding_dim**0.5

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, hidden]
        rows = super().forward(input_ids)
        return rows * rounded_to(self.scale, rows.dtype)


class GemmaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        kinds = layer_types(cfg.raw, DEFAULT_SLIDING_PATTERN)
        self.embed_tokens = ScaledEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, i, kind) for i, kind in enumerate(kinds))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        ropes = layer_ropes(cfg.raw, DEFAULT_GLOBAL_THETA, DEFAULT_LOCAL_THETA)
        self.rotary = kind_rotaries(ropes, cfg.head_dim, max_positions)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        # input_ids: [T] -> hidden: [T, hidden]; inputs_embeds [T, hidden]: the first layer's input where
        # given (an image model's, its placeholders' rows the image's)
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual, pending = None, None
        for layer in self.layers:
            x, residual = layer(x, residual, pending, self.rotary[layer.kind], batch)
            pending = layer.post_feedforward_layernorm
        x, _ = self.norm.forward_residual(x, residual, pre_norm=pending)
        return x


class Gemma1DecoderLayer(DecoderLayer):
    """Llama's pre-norm layer with Gemma's norms and attention (every layer global, no score cap)."""

    norm_class = GemmaRMSNorm

    def make_attention(self, cfg: ModelConfig, layer_idx: int) -> Attention:
        return GemmaAttention(cfg, layer_idx, sliding=False)


class Gemma1Model(LlamaModel):
    layer_class = Gemma1DecoderLayer
    embedding_class = ScaledEmbedding


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 (2B, 9B, 27B) and Gemma 3's text decoder (Gemma3ForCausalLM: 270M, 1B): the Llama family's
    causal LM around GemmaModel (the same projections, so q/k/v and gate/up fuse at load and LoRA wraps them
    from outside), logits soft-capped where the config asks (Gemma 2)."""

    model_class = GemmaModel

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        check_gemma(cfg.raw)
        super().__init__(cfg, max_positions)
        self.final_logit_softcapping = cfg.raw.get("final_logit_softcapping")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [S, hidden] -> [S, vocab] fp32
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def fold_norm_weights(self, loaded: LoadRecord | None = None) -> None:
        """Kept unfolded: what folding serves (LlamaModel.fuses_mlp_norm) takes SiLU MLPs with Llama's norms
        only, and Gemma 2 / 3 fuse the pre-MLP norm with the post-attention norm and the add instead."""


class Gemma1ForCausalLM(GemmaForCausalLM):
    """Gemma 1 (GemmaForCausalLM: Gemma 2B and 7B, Gemma 1.1, CodeGemma): Gemma 2 / 3's causal LM around
    Gemma1Model; its configs cap no logits."""

    model_class = Gemma1Model
