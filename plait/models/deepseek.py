"""DeepSeek-V2 / V3 (multi-head latent attention over a compressed latent KV cache, DeepSeek's MoE)."""

# DeepseekV2ForCausalLM: DeepSeek-V2, V2-Lite, V2.5, Coder-V2. DeepseekV3ForCausalLM: DeepSeek-V3, R1, V3.1,
# and Kimi K2 and Moonlight, which use its architecture.
#
# MLA as vLLM serves it. Each token's KV is one row shared by every head: the normalised latent c_kv
# (kv_lora_rank) and the rotated k_pe (qk_rope_head_dim), 576 values in the real models. Attention runs in
# the weight-absorbed form: each head's q_nope goes into the latent space through kv_b_proj's K rows of that
# head (q_nope . (W_uk c) = (W_uk^T q_nope) . c), beside its rotated q_pe, and attends as multi-query
# attention with K = the row and V = its c_kv columns; each head's output goes back through kv_b_proj's V
# rows, then o_proj. Prompt chunks take the same absorbed form as decodes (correct, not the fastest prefill).
#
# Across tensor-parallel ranks (plait.parallel.shard, as vLLM): each rank holds its share of the heads (their
# query and kv_b_proj rows, so its absorbed W_uk / W_uv are its heads' alone; o_proj's columns, summed over
# the ranks), and the whole latent side (q_a_proj, kv_a_proj_with_mqa and their norms), so every rank caches
# the same one latent row a token for its own heads. The MoE splits as GLM-4.5's.
#
# FP8 weights (V3's block-FP8 release, or --quantization fp8) are any family's FP8 layers; kv_b_proj alone is
# read only through the absorbed matrices, so it is dequantised once after the load (as vLLM does).
#
# The checkpoints (V3's) also hold num_nextn_predict_layers multi-token-prediction layers, skipped at load as
# glm4_moe skips them (speculative_config method "mtp" drafts with the first: plait.models.mtp).

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from plait.attention.base import KVCacheSpec, Rotary
from plait.config import (
    DEEPSEEK_V3_ARCHITECTURE,
    GROUP_LIMITED_ROUTER,
    MTP_TARGET_ARCHITECTURES,
    NOAUX_TC_ROUTER,
    SOFTMAX_ROUTER,
    ModelConfig,
    mla_dims,
    rope_kind,
)
from plait.layers.fp8 import Fp8Linear
from plait.layers.linear import Linear
from plait.layers.moe import NoAuxTcRouter, SoftmaxGroupRouter
from plait.layers.norm import RMSNorm
from plait.layers.rotary import RotaryEmbedding, _yarn_mscale
from plait.models.base import CausalLM
from plait.models.glm4_moe import Glm4MoeBlock, without_mtp_layers
from plait.models.llama import MLP
from plait.models.weights import halves_order, load_checked
from plait.runner.forward_batch import ForwardBatch

# transformers builds q_a_layernorm and kv_a_layernorm with DeepseekV2RMSNorm's default eps, not the
# config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6
# Only the MLP's gate/up are fused at load (the attention's q_proj stays itself: no k/v beside it).
DEEPSEEK_STACKED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def mla_softmax_scale(qk_head_dim: int, rope_scaling: dict | None) -> float:
    """1 / sqrt(qk_nope_head_dim + qk_rope_head_dim), times mscale(factor, mscale_all_dim)^2 under DeepSeek's
    YaRN (transformers' yarn_apply_mscale): the rotary's own attention factor multiplies q_pe and k_pe only,
    this one every score."""
    scale = qk_head_dim**-0.5
    if rope_kind(rope_scaling) != "default" and (rope_scaling or {}).get("mscale_all_dim"):
        mscale = _yarn_mscale(rope_scaling["factor"], rope_scaling["mscale_all_dim"])
        scale *= mscale * mscale
    return scale


def rope_interleaved(cfg: ModelConfig) -> bool:
    """Whether the checkpoint's rope channels turn in adjacent pairs (GPT-J's): V2's always (transformers
    rotates them as complex numbers), V3's unless its config sets rope_interleave false."""
    if MTP_TARGET_ARCHITECTURES.get(cfg.architecture, cfg.architecture) != DEEPSEEK_V3_ARCHITECTURE:
        return True
    return bool(cfg.raw.get("rope_interleave", True))


class MLAttention(nn.Module):
    """Multi-head latent attention over the one-row-per-token latent cache (module docstring)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = heads = cfg.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim, self.kv_lora_rank = mla_dims(cfg)
        qk_dim = self.nope_dim + self.rope_dim
        q_lora_rank = cfg.raw.get("q_lora_rank")
        bias = cfg.attention_bias
        if q_lora_rank:
            self.q_a_proj = Linear(cfg.hidden_size, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(q_lora_rank, heads * qk_dim, bias=False)
        else:  # V2-Lite
            self.q_proj = Linear(cfg.hidden_size, heads * qk_dim, bias=False)
        self.q_lora = bool(q_lora_rank)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(self.kv_lora_rank, heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = Linear(heads * self.v_dim, cfg.hidden_size, bias=bias)
        self.scale = mla_softmax_scale(qk_dim, cfg.rope_scaling)
        # Pairs (2i, 2i + 1) read as neox halves (i, i + R / 2) before the rotation: q_pe and k_pe are
        # permuted alike, so every score is the checkpoint's (weights.halves_order).
        self.rope_order = halves_order(self.rope_dim, self.rope_dim) if rope_interleaved(cfg) else None
        # An FP8 kv_b_proj (block-wise tiles, or per-row under --quantization fp8) dequantised once to the
        # model's dtype, [H * (nope + v), L], as vLLM builds its absorbed matrices: kv_b_proj is only ever
        # read through them, and widening it at every step would cost a weight's read and write a layer. A
        # buffer, so sleep mode parks it with the weights; None for a 16-bit kv_b_proj (views of its own).
        self.register_buffer("kv_b_dequantized", None, persistent=False)

    def absorb_quantized_kv_b(self) -> None:
        """(Re)build kv_b_dequantized from an FP8 kv_b_proj's codes and scales; nothing for a 16-bit one.
        (Integer checkpoints are refused by name: plait.layers.wna16.REFUSED_ARCHITECTURES.)"""
        layer = self.kv_b_proj
        if isinstance(layer, Fp8Linear):  # Fp8BlockLinear too
            self.kv_b_dequantized = layer.dequantized(layer.compute_dtype)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_uk [H, nope, L], W_uv [H, v, L]): kv_b_proj's rows (each head's K rows, then its V rows), views
        of its weight, or of its dequantised FP8 codes (absorb_quantized_kv_b; made here if the load did not,
        as random weights do not go through load_weights)."""
        if isinstance(self.kv_b_proj, nn.Linear):
            w = self.kv_b_proj.weight
        else:
            if self.kv_b_dequantized is None:
                self.absorb_quantized_kv_b()
            w = self.kv_b_dequantized
        w = w.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def _rope_channels(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, R] -> the same in neox order, contiguous (the rotary kernels want whole rows)
        return x.contiguous() if self.rope_order is None else x[..., self.rope_order.to(x.device)]

    def forward(self, x: torch.Tensor, rotary: Rotary, batch: ForwardBatch) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        num_tokens, heads = x.shape[0], self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q_nope, q_pe = q.view(num_tokens, heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv.contiguous())  # [T, L]
        # q_pe: [T, H, R], k_pe: [T, 1, R], rotated at the batch's positions
        q_pe, k_pe = rotary(batch.positions, self._rope_channels(q_pe), self._rope_channels(k_pe[:, None]))
        w_uk, w_uv = self.absorbed_weights()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, L]
        q_cat = torch.cat([q_latent, q_pe], dim=-1)  # [T, H, L + R]
        row = torch.cat([c_kv, k_pe[:, 0]], dim=-1)  # [T, L + R]: the token's cache row
        out = batch.latent_attention(self.layer_idx, q_cat, row, self.scale, self.kv_lora_rank)  # [T, H, L]
        out = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2))  # [H, T, v]
        return self.o_proj(out.transpose(0, 1).reshape(num_tokens, heads * self.v_dim))


class DeepseekMoE(Glm4MoeBlock):
    """Routed experts on DeepSeek's router (V2: softmax greedy or group-limited greedy; V3: noaux_tc), each
    entry's weight times routed_scaling_factor, plus the ungated shared experts (n_shared_experts x
    moe_intermediate_size wide) on every token: GLM-4.5's block with V2's routers beside V3's."""

    @staticmethod
    def make_router(cfg: ModelConfig) -> nn.Module:
        moe = cfg.moe
        if moe.router == NOAUX_TC_ROUTER:
            return NoAuxTcRouter.of(cfg)
        # V2's "greedy" ignores the config's groups (as transformers does)
        groups = (moe.n_group, moe.topk_group) if moe.router != SOFTMAX_ROUTER else (1, 1)
        if moe.router in (SOFTMAX_ROUTER, GROUP_LIMITED_ROUTER):
            return SoftmaxGroupRouter(cfg.hidden_size, moe.num_experts, moe.top_k, moe.renormalize, *groups,
                                      moe.routed_scaling_factor)
        raise ValueError(f"{cfg.architecture}: router {moe.router!r} is not DeepSeek's")


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = MLAttention(cfg, layer_idx)
        self.mlp = MLP(cfg) if layer_idx in cfg.moe.dense_layers else DeepseekMoE(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rotary: Rotary, batch: ForwardBatch
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [T, hidden] -> (the MLP's output, the residual stream before it)
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.forward_residual(x, residual)
        attn = self.self_attn(x, rotary, batch)
        x, residual = self.post_attention_layernorm.forward_residual(attn, residual)
        return self.mlp(x), residual


class DeepseekModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # The rope part of each head (and k_pe) alone turns; YaRN's attention factor is in the table.
        self.rotary = RotaryEmbedding(mla_dims(cfg)[1], max_positions, cfg.rope_theta, cfg.rope_scaling)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        # input_ids: [T] -> hidden: [T, hidden]
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, self.rotary, batch)
        x, _ = self.norm.forward_residual(x, residual)
        return x


class DeepseekV2ForCausalLM(CausalLM):
    """DeepseekV2ForCausalLM and DeepseekV3ForCausalLM (they differ in config only: router, rope layout). No
    LoRA (adapters would need the absorbed weights rebuilt, and per-expert deltas); no FP8 KV cache (the
    runner refuses it for a one-plane cache)."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        if cfg.moe is None:
            raise ValueError(f"{cfg.architecture}: the config names no routed experts (n_routed_experts)")
        self.config = cfg
        self.model = DeepseekModel(cfg, max_positions)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        _, rope_dim, _, kv_lora_rank = mla_dims(cfg)
        # One latent row a token and layer, shared by every head; no separate V.
        self.kv_cache_spec = KVCacheSpec(planes=1, heads=1, width=kv_lora_rank + rope_dim)

    def checkpoint_layout(self, weights: Iterable[tuple[str, torch.Tensor]]
                          ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint without its MTP layers (model.layers.{N}.* for N >= num_hidden_layers)."""
        return without_mtp_layers(self.config, weights)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        cfg = self.config
        attention = [layer.self_attn for layer in self.model.layers]
        for attn in attention:  # made again from what this load brings
            attn.kv_b_dequantized = None
        sizes = {"gate_up_proj": [cfg.intermediate_size] * 2}
        if cfg.moe.shared_intermediate_size:
            sizes["shared_experts.gate_up_proj"] = [cfg.moe.shared_intermediate_size] * 2

        def rename(name: str) -> str | None:
            if "rotary_emb.inv_freq" in name or (cfg.tie_word_embeddings and name == "lm_head.weight"):
                return None
            return name

        load_checked(self, weights, DEEPSEEK_STACKED, sizes, rename)
        for attn in attention:
            attn.absorb_quantized_kv_b()
