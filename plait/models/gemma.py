"""The Gemma family, Gemma 2 and Gemma 3 (text): sandwich norms of the 1 + weight kind, GeGLU, sliding-window
layers beside global ones, embeddings scaled by sqrt(hidden); Gemma 2 soft-caps its attention scores, Gemma 3
normalises q and k and gives its sliding layers a rotary base of their own."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from plait.attention.base import Rotary
from plait.config import ModelConfig
from plait.layers.linear import Linear, logits_fp32
from plait.layers.norm import GemmaRMSNorm
from plait.layers.rotary import RotaryEmbedding
from plait.models.base import CausalLM
from plait.models.llama import MLP, Attention
from plait.models.weights import language_model_weights, load_decoder_weights
from plait.runner.forward_batch import ForwardBatch

SLIDING = "sliding_attention"
FULL = "full_attention"
# transformers' defaults where a config leaves them out (Gemma3TextConfig).
DEFAULT_GLOBAL_THETA = 1_000_000.0
DEFAULT_LOCAL_THETA = 10_000.0
DEFAULT_SLIDING_PATTERN = 6  # Gemma 3: every sixth layer attends globally


@dataclass(frozen=True)
class LayerRope:
    """The rotary base and scaling of one kind of layer."""

    theta: float
    scaling: dict | None


def check_gemma(raw: dict) -> None:
    """Refuse, by name, what plait's Gemma does not compute."""
    if raw.get("use_bidirectional_attention"):
        raise ValueError("bidirectional Gemma 3 (EmbeddingGemma) is not supported")


def layer_types(raw: dict) -> list[str]:
    """Each layer's kind: the config's ``layer_types``, else older configs' ``sliding_window_pattern``
    (ModelConfig fills ``layer_types`` in through transformers' own defaults: Gemma 2 alternates)."""
    n = raw["num_hidden_layers"]
    kinds = raw.get("layer_types")
    if kinds:
        if len(kinds) != n or set(kinds) - {SLIDING, FULL}:
            raise ValueError(f"layer_types must name {n} layers, each {SLIDING!r} or {FULL!r}")
        return list(kinds)
    pattern = raw.get("sliding_window_pattern") or DEFAULT_SLIDING_PATTERN
    return [SLIDING if (i + 1) % pattern else FULL for i in range(n)]


def _scaling(params: dict | None) -> dict | None:
    if not params or params.get("rope_type", params.get("type", "default")) == "default":
        return None
    return params


def layer_ropes(raw: dict) -> dict[str, LayerRope]:
    """The rotary of global and of sliding layers: Gemma 3's per-kind ``rope_parameters`` (transformers 5),
    or one ``rope_parameters`` / ``rope_theta`` + ``rope_scaling`` for the global layers, which the sliding
    ones share (Gemma 2) unless ``rope_local_base_freq`` gives them their own unscaled base (Gemma 3 as
    transformers 4 writes it)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and (FULL in params or SLIDING in params):
        full, local = params.get(FULL) or {}, params.get(SLIDING) or {}
        return {FULL: LayerRope(float(full.get("rope_theta", DEFAULT_GLOBAL_THETA)), _scaling(full)),
                SLIDING: LayerRope(float(local.get("rope_theta", DEFAULT_LOCAL_THETA)), _scaling(local))}
    if isinstance(params, dict):
        full = LayerRope(float(params.get("rope_theta", DEFAULT_LOCAL_THETA)), _scaling(params))
    else:
        theta = float(raw.get("rope_theta") or DEFAULT_LOCAL_THETA)
        full = LayerRope(theta, _scaling(raw.get("rope_scaling")))
    local = raw.get("rope_local_base_freq")
    return {FULL: full, SLIDING: full if local is None else LayerRope(float(local), None)}


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


class GemmaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        kinds = layer_types(cfg.raw)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_scale = cfg.hidden_size**0.5
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, i, kind) for i, kind in enumerate(kinds))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        ropes = layer_ropes(cfg.raw)
        self.rotary = {kind: RotaryEmbedding(cfg.head_dim, max_positions, rope.theta, rope.scaling)
                       for kind, rope in ropes.items()}

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # input_ids: [T] -> hidden: [T, hidden]. The scale is rounded to the weights' dtype first, as
        # transformers does (sqrt(3072) becomes 55.5 in bf16); a host number, so graphs capture no copy.
        x = self.embed_tokens(input_ids)
        x = x * rounded_to(self.embed_scale, x.dtype)
        residual, pending = None, None
        for layer in self.layers:
            x, residual = layer(x, residual, pending, self.rotary[layer.kind], batch)
            pending = layer.post_feedforward_layernorm
        x, _ = self.norm.forward_residual(x, residual, pre_norm=pending)
        return x


class GemmaForCausalLM(CausalLM):
    """Gemma 2 (2B, 9B, 27B) and Gemma 3's text decoder (Gemma3ForCausalLM: 270M, 1B), logits soft-capped
    where the config asks (Gemma 2)."""

    # Its projections are the Llama family's (q/k/v, o, gate/up, down): plait.lora wraps them from outside.
    supports_lora = True

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        check_gemma(cfg.raw)
        self.config = cfg
        self.model = GemmaModel(cfg, max_positions)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.final_logit_softcapping = cfg.raw.get("final_logit_softcapping")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [S, hidden] -> [S, vocab] fp32
        logits = logits_fp32(hidden, self.lm_head.weight)
        cap = self.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named tensors, q/k/v and gate/up fused at load; every parameter must be covered."""
        load_decoder_weights(self, weights)


class Gemma3ForConditionalGeneration(GemmaForCausalLM):
    """An image-text Gemma 3 checkpoint (4B, 12B, 27B) served as text only: its language model's tensors
    (``language_model.model.*``, or ``model.language_model.*`` as transformers 5 saves them) under the
    decoder's names; the vision tower and projector are not loaded, so prompts are text."""

    # Adapters for these checkpoints name the multimodal model's modules (language_model.model...).
    supports_lora = False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_decoder_weights(self, language_model_weights(weights))
