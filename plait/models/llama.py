"""The Llama decoder family: Llama, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm), SmolLM2 (tied), Phi-3
(fused checkpoint projections, partial rotary, LongRoPE), and its sparse-MoE members: Mixtral, Qwen2-MoE (a
gated shared expert), Qwen3-MoE (and, in their own modules, OLMoE and Granite MoE)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from plait.attention.base import Rotary
from plait.config import ModelConfig
from plait.layers.activation import act_and_mul, get_activation, silu_and_mul_rms
from plait.layers.linear import Linear
from plait.layers.moe import FusedMoE
from plait.layers.norm import RMSNorm, RowNorm, split_rms_norms
from plait.layers.rotary import QueryScaledRotary, llama4_query_scale, rotary_embedding
from plait.models.base import CausalLM, refuse_config_keys
from plait.models.weights import LoadRecord, load_decoder_weights, pairs_as_halves
from plait.runner.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from plait.parallel.group import TPGroup


class Attention(nn.Module):
    # Gemma's attention is this one with its own norms (GemmaRMSNorm), window, scale and score cap; OLMo's
    # normalises q and k across all heads at once (flat_qk_norm), before they are split into heads.
    norm_class = RMSNorm
    logit_softcap: float | None = None
    flat_qk_norm = False
    o_proj_bias = False  # GPT-OSS's has one
    # OLMoE's clip_qkv: q, k (after their flat norms) and v clamped to +-clip_qkv; None: not clipped.
    clip_qkv: float | None = None

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=self.o_proj_bias)
        self.q_norm = self.norm_class(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = self.norm_class(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.sliding_window = cfg.sliding_window
        self.scale = self.head_dim**-0.5
        # GPT-OSS's learned logit per query head, which joins each softmax as a key with no value: [Hq].
        # (An instance attribute: a class one would hide the Parameter a subclass registers.)
        self.sinks: torch.Tensor | None = None
        # Tensor parallelism with flat q/k norms (OLMo 2 / 3, OLMoE): the ranks' group, whose sums of squares
        # make each rank's slice of q and k the whole rows' norm (plait.parallel.shard sets it).
        self.qk_norm_group: TPGroup | None = None

    def forward(self, x: torch.Tensor, rotary: Rotary, batch: ForwardBatch) -> torch.Tensor:
        # x: [T, hidden]
        return self.o_proj(self.attend(self.qkv_proj(x), rotary, batch))

    def attend(self, qkv: torch.Tensor, rotary: Rotary, batch: ForwardBatch) -> torch.Tensor:
        # qkv: [T, (Hq + 2 Hkv) D] -> attention output before o_proj: [T, Hq D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.flat_qk_norm and self.qk_norm_group is not None:  # this rank's heads of each row
            q, k = split_rms_norms([(q, self.q_norm), (k, self.k_norm)], self.qk_norm_group)
        elif self.flat_qk_norm:  # q: [T, Hq D], k: [T, Hkv D], each normalised as one row
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:  # after the flat norms, as OLMoE clips (a per-head norm would be later)
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        # The backend normalises (Qwen3's q/k norms) and rotates q and k with the KV store: one kernel on
        # the GPU.
        qk_norm = (self.q_norm, self.k_norm) if self.q_norm is not None and not self.flat_qk_norm else None
        out = batch.attention(self.layer_idx, q, k, v, self.scale, self.sliding_window, rotary=rotary,
                              qk_norm=qk_norm, logit_softcap=self.logit_softcap, sinks=self.sinks)
        return out.reshape(-1, self.q_size)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter, bias=False)
        self.down_proj = Linear(inter, cfg.hidden_size, bias=False)
        self.act = get_activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act is F.silu and self.gate_up_proj.fuses_gate_up_silu(x):
            return self.down_proj(self.gate_up_proj.gate_up_silu(x))
        return self.down_proj(act_and_mul(self.gate_up_proj(x), self.act))

    def forward_normed(self, h: torch.Tensor, norm: RowNorm) -> torch.Tensor:
        """forward(RMSNorm(h)) for gate/up holding the norm's weight: gate/up reads the un-normalised h
        and silu-and-mul applies the norm's row scale, so the norm takes no launch of its own."""
        # h: [T, hidden] -> [T, hidden]
        return self.down_proj(silu_and_mul_rms(self.gate_up_proj(h), norm))


class SparseMoeBlock(nn.Module):
    """A MoE feed-forward: the router (``gate``) sends each token to its top-k experts; Qwen2-MoE adds a
    shared expert every token takes, scaled by a sigmoid gate, Granite MoE (shared) one added unscaled."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        self.gate = Linear(cfg.hidden_size, moe.num_experts, bias=False)
        self.experts = FusedMoE(moe.num_experts, moe.top_k, cfg.hidden_size, moe.intermediate_size,
                                moe.renormalize, expert_range=moe.expert_range)
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_intermediate_size:
            self.shared_expert = MLP(cfg, moe.shared_intermediate_size)
            if moe.shared_expert_gated:
                self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out


class DecoderLayer(nn.Module):
    norm_class: type[RMSNorm] = RMSNorm  # Gemma 1's scale by 1 + weight (plait.models.gemma)

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = self.make_attention(cfg, layer_idx)
        self.mlp = self.make_mlp(cfg, layer_idx)
        self.input_layernorm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)

    def make_attention(self, cfg: ModelConfig, layer_idx: int) -> Attention:
        """The layer's attention (a family with its own overrides this, as GPT-OSS does)."""
        return Attention(cfg, layer_idx)

    def make_mlp(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        """The layer's feed-forward: a sparse MoE block where the config's MoE covers it, else an MLP."""
        sparse = cfg.moe is not None and layer_idx not in cfg.moe.dense_layers
        return SparseMoeBlock(cfg) if sparse else MLP(cfg)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rotary: Rotary, batch: ForwardBatch,
        fuse_mlp_norm: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [T, hidden] -> (the MLP's output, the residual stream before it)
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.forward_residual(x, residual)
        attn = self.self_attn
        out = attn.attend(attn.qkv_proj(x), rotary, batch)
        if fuse_mlp_norm:
            # o adds the residual in its own launch and leaves the sum's squares, from which silu-and-mul
            # takes the MLP norm's scale (its weight is in gate/up: LlamaForCausalLM.fold_norm_weights).
            residual, sum_sq = attn.o_proj.forward_add(out, residual)
            norm = RowNorm(sum_sq, residual.shape[-1], self.post_attention_layernorm.eps)
            return self.mlp.forward_normed(residual, norm), residual
        x, residual = self.post_attention_layernorm.forward_residual(attn.o_proj(out), residual)
        return self.mlp(x), residual

    @torch.no_grad()
    def fold_mlp_norm(self) -> None:
        """Move the MLP norm's weight into gate/up (the norm keeps weight 1: the same function). The weight
        is kept beside, for gate/up rows loaded again later (refold_mlp_norm)."""
        norm = self.post_attention_layernorm.weight
        self.mlp.gate_up_proj.fold_norm_weight(norm)
        self.folded_norm_weight = norm.detach().clone()
        norm.fill_(1.0)

    @torch.no_grad()
    def refold_mlp_norm(self, loaded: LoadRecord, prefix: str) -> str | None:
        """After a live load into this folded layer (``prefix``: its parameters' name prefix): gate/up rows
        that came take the kept norm weight; a norm weight that came folds in again with the whole of gate/up,
        which must then have come too (the other rows hold the old weight's product, which cannot be undone
        exactly): else the layer keeps its old norm and the reason is returned."""
        gate_up = self.mlp.gate_up_proj
        gate_up_name = f"{prefix}mlp.gate_up_proj.weight"
        norm_name = f"{prefix}post_attention_layernorm.weight"
        norm_came = norm_name in loaded.rows
        if norm_came and loaded.covers(gate_up_name, gate_up.weight.shape[0]):
            self.fold_mlp_norm()
            return None
        if norm_came:  # refused: the layer keeps its old norm, folded in already
            self.post_attention_layernorm.weight.fill_(1.0)
        for rows in loaded.rows.get(gate_up_name, ()):
            gate_up.fold_norm_weight(self.folded_norm_weight, rows)
        if not norm_came:
            return None
        return (f"{norm_name} came without all of gate_proj and up_proj, into which the MLP norms are folded "
                "on this GPU: load the three together (a whole layer, or the whole model), or start the "
                "engine with PLAIT_FOLD_NORMS=0 (or a worker_extension_cls) to keep them apart")


class LlamaModel(nn.Module):
    layer_class = DecoderLayer  # Granite's scales its sublayers' outputs (plait.models.granite)
    embedding_class = nn.Embedding  # Gemma's scales its rows (plait.models.gemma.ScaledEmbedding)

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = self.embedding_class(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = self.layer_class.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = rotary_embedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling,
                                       cfg.partial_rotary_factor)
        self.llama4_scaling = cfg.llama4_scaling
        # Set by LlamaForCausalLM.fold_norm_weights: the MLP norms' weights live in gate/up.
        self.norms_folded = False

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch,
                inputs_embeds: torch.Tensor | None = None, rotary: Rotary | None = None) -> torch.Tensor:
        # input_ids: [T]; inputs_embeds: [T, hidden] where the caller embedded them (images in a prompt);
        # rotary: this step's own where the caller made one (Qwen2-VL's M-RoPE), else the model's
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        fuse = self.fuses_mlp_norm(x)
        rotary = self.rotary if rotary is None else rotary
        if self.llama4_scaling is not None:  # Ministral 3: queries scaled by position, once for every layer
            scale = llama4_query_scale(batch.positions, *self.llama4_scaling, x.dtype)  # [T, 1, 1]
            rotary = QueryScaledRotary(rotary, scale)
        for layer in self.layers:
            x, residual = layer(x, residual, rotary, batch, fuse)
        x, _ = self.norm.forward_residual(x, residual)
        return x

    def fuses_mlp_norm(self, x: torch.Tensor) -> bool:
        """Whether this step's layers fold the MLP norm into o's and silu-and-mul's launches: the norms'
        weights are in gate/up, and o of x's row count adds the residual in its launch (a skinny GEMM
        config: decode-sized steps)."""
        if not self.norms_folded or not self.layers or not isinstance(self.layers[0].mlp, MLP):
            return False
        layer = self.layers[0]
        return (layer.mlp.act is F.silu and not layer.mlp.gate_up_proj.fuses_gate_up_silu(x)
                and layer.self_attn.o_proj.adds_residual(x))


class LlamaForCausalLM(CausalLM):
    """Pure model: forward(input_ids, positions, batch) -> hidden states; logits on request."""

    supports_lora = True
    model_class = LlamaModel

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = self.model_class(cfg, max_positions)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight



    def fold_norm_weights(self, loaded: LoadRecord | None = None) -> None:
        """Fold every MLP norm's weight into gate/up, so that decode-sized steps can apply that norm
        in o's and silu-and-mul's launches (LlamaModel.fuses_mlp_norm). The function is unchanged, but
        each folded weight takes one more rounding, so the runner does this for 16-bit GPU models.
        ``loaded``: after a live load into the folded model, fold what it wrote
        (DecoderLayer.refold_mlp_norm); a ValueError names a norm that could not be."""
        if loaded is None:
            for layer in self.model.layers:
                layer.fold_mlp_norm()
            self.model.norms_folded = True
            return
        refused = [why for i, layer in enumerate(self.model.layers)
                   if (why := layer.refold_mlp_norm(loaded, f"model.layers.{i}.")) is not None]
        if refused:
            raise ValueError(refused[0] + (f" ({len(refused)} layers)" if len(refused) > 1 else ""))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up. Every parameter must be covered."""
        load_decoder_weights(self, weights)


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3, Phi-3.5 and Phi-4 (mini included): the Llama decoder. Their checkpoints store q/k/v and gate/up
    already fused (``qkv_proj``: q, k, v rows; ``gate_up_proj``: gate, up rows), in the order and under the
    names of the parameters plait fuses them into, so they load as they are; the config's partial rotary
    factor and LongRoPE scaling are the rotary's (ModelConfig.from_hf, plait.layers.rotary). LoRA adapters
    name the fused qkv_proj / gate_up_proj too, each changing the whole layer (plait.lora.model)."""


class PairedRotaryForCausalLM(LlamaForCausalLM):
    """The Llama decoder for checkpoints whose rotary turns adjacent channel pairs (GPT-J's): ERNIE 4.5's
    dense models (Ernie4_5ForCausalLM) and GLM-4 (plait.models.glm), their q/k rows reordered at load so that
    plait's kernels compute the same scores (pairs_as_halves)."""

    # An adapter's q/k rows would need the same reordering as the checkpoint's.
    supports_lora = False

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        # ERNIE 4.5's switch for biases on o and the MLP too
        refuse_config_keys(cfg.raw, cfg.architecture, ("use_bias",))
        super().__init__(cfg, max_positions)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_decoder_weights(self, pairs_as_halves(weights, self.config))


class SeedOssForCausalLM(LlamaForCausalLM):
    """Seed-OSS (ByteDance Seed-OSS-36B): the Llama decoder with q/k/v biases, which its configs have on
    by default (ModelConfig.from_hf), and none on o or the MLP."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        refuse_config_keys(cfg.raw, "Seed-OSS", ("attention_out_bias", "mlp_bias"))
        super().__init__(cfg, max_positions)


class LlamaForSequenceClassification(LlamaForCausalLM):
    """A Llama-family classifier or reward model (HF's ``...ForSequenceClassification``): the decoder, then
    ``score`` (hidden -> num_labels) in place of the LM head, read at the prompt's last token. The pooling
    runner pools that token's hidden state and calls ``classify``."""

    supports_lora = False

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        self.lm_head = None
        self.score = Linear(cfg.hidden_size, num_labels(cfg.raw), bias=False)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        # pooled: [n, hidden] fp32 -> logits: [n, num_labels] fp32. A head of a few rows: fp32 costs nothing.
        return pooled @ self.score.weight.float().t()


def num_labels(hf_config: dict) -> int:
    """A classifier's label count, as transformers reads its config (id2label, else num_labels, else 2); a
    classifier made from a causal LM's token logits (vLLM's ``classifier_from_token``) has one label for a
    pair of tokens (the second's logit minus the first's) and one a token otherwise."""
    tokens = hf_config.get("classifier_from_token")
    if tokens:
        return 1 if len(tokens) == 2 else len(tokens)
    return len(hf_config.get("id2label") or {}) or int(hf_config.get("num_labels") or 2)


class MoeForCausalLM(LlamaForCausalLM):
    """Mixtral, Qwen2-MoE and Qwen3-MoE (OLMoE: plait.models.olmo): the Llama decoder with sparse MoE blocks
    (SparseMoeBlock)."""

    # Adapters would need per-expert deltas inside the expert kernels.
    supports_lora = False

    def fold_norm_weights(self, loaded: LoadRecord | None = None) -> None:
        """Kept unfolded: the MLP norm feeds the router and every expert, which take no row scale."""
