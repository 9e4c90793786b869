"""Granite (IBM Granite 3.x, dense): the Llama decoder with four multipliers, on the embeddings, as the
attention scale, on each sublayer's output before it joins the residual stream, and dividing the logits.
Granite MoE (and Granite MoE shared) is the same decoder with the Llama family's sparse MoE block for its
MLP (and an ungated shared MLP beside the experts). Granite 4.0 (plait.models.granite4) is these layers with a
Mamba2 mixer in place of attention on most of them."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from plait.attention.base import Rotary
from plait.config import ModelConfig
from plait.layers.linear import logits_fp32
from plait.models.base import refuse_config_keys
from plait.models.llama import Attention, DecoderLayer, LlamaForCausalLM, LlamaModel
from plait.models.weights import LoadRecord
from plait.runner.forward_batch import ForwardBatch


class GraniteDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.residual_multiplier = float(cfg.raw["residual_multiplier"])

    def make_attention(self, cfg: ModelConfig, layer_idx: int) -> Attention:
        attn = super().make_attention(cfg, layer_idx)
        attn.scale = float(cfg.raw["attention_multiplier"])  # in place of 1 / sqrt(head_dim)
        return attn

    def mix(self, x: torch.Tensor, rotary: Rotary | None, batch: ForwardBatch) -> torch.Tensor:
        """The layer's token mixer: attention (Granite 4's Mamba layers mix with a Mamba2 mixer instead)."""
        # x: [T, hidden] normalised -> [T, hidden]
        return self.self_attn(x, rotary, batch)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rotary: Rotary | None, batch: ForwardBatch,
        fuse_mlp_norm: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # x: the last layer's MLP output before its multiplier (the scaled embeddings for the first layer),
        # residual: the stream it joins ([T, hidden] each) -> this layer's pair. Each output is scaled (and
        # rounded) before the fused add-and-normalise, as transformers scales it before the add.
        scale = self.residual_multiplier
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.forward_residual(x * scale, residual)
        attn = self.mix(x, rotary, batch)
        x, residual = self.post_attention_layernorm.forward_residual(attn * scale, residual)
        return self.mlp(x), residual


class GraniteModel(LlamaModel):
    layer_class = GraniteDecoderLayer

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        self.embedding_multiplier = float(cfg.raw["embedding_multiplier"])
        self.residual_multiplier = float(cfg.raw["residual_multiplier"])

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # input_ids: [T] -> hidden: [T, hidden]
        x, residual = self.embed_tokens(input_ids) * self.embedding_multiplier, None
        for layer in self.layers:
            x, residual = layer(x, residual, self.rotary, batch)
        x, _ = self.norm.forward_residual(x * self.residual_multiplier, residual)
        return x


class GraniteForCausalLM(LlamaForCausalLM):
    """GraniteForCausalLM (Granite 3.0-3.3 dense models); logits divided by logits_scaling."""

    model_class = GraniteModel

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        refuse_config_keys(cfg.raw, "Granite", ("attention_bias", "mlp_bias"))
        super().__init__(cfg, max_positions)
        self.logits_scaling = float(cfg.raw.get("logits_scaling") or 1.0)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [S, hidden] -> [S, vocab] fp32
        return logits_fp32(hidden, self.lm_head.weight) / self.logits_scaling

    def fold_norm_weights(self, loaded: LoadRecord | None = None) -> None:
        """Kept unfolded: the fused decode path adds o's output to the stream unscaled."""


# A Granite MoE checkpoint's names (the Hub's, and transformers 5's where it renames them) -> plait's: the
# stacked experts ([E, 2I, H]: each expert's gate rows, then its up rows; [E, H, I]) and the router as the
# Llama family's MoE block holds them (FusedMoE's stacks, SparseMoeBlock's gate), the shared MLP's fused
# gate/up rows as its shared expert's gate_up_proj.
GRANITE_MOE_NAMES = (
    ("block_sparse_moe.input_linear.weight", "mlp.experts.gate_up_proj"),
    ("block_sparse_moe.output_linear.weight", "mlp.experts.down_proj"),
    ("block_sparse_moe.router.layer.weight", "mlp.gate.weight"),
    ("block_sparse_moe.experts.gate_up_proj", "mlp.experts.gate_up_proj"),
    ("block_sparse_moe.experts.down_proj", "mlp.experts.down_proj"),
    ("block_sparse_moe.router.weight", "mlp.gate.weight"),
    ("shared_mlp.input_linear.weight", "mlp.shared_expert.gate_up_proj.weight"),
    ("shared_mlp.output_linear.weight", "mlp.shared_expert.down_proj.weight"),
)


class GraniteMoeForCausalLM(GraniteForCausalLM):
    """GraniteMoeForCausalLM (granite-3.0-1b-a400m / 3b-a800m, granite-3.1's MoE models) and
    GraniteMoeSharedForCausalLM (with a shared MLP every token takes): Granite's multipliers around the
    sparse MoE block (ModelConfig.moe: the router's softmax over its top-k logits is route's renormalised
    top-k)."""

    # Adapters would need per-expert deltas inside the expert kernels (as MoeForCausalLM).
    supports_lora = False
    # (checkpoint suffix, plait's) pairs checkpoint_layout renames (Granite 4's dense models: their own).
    checkpoint_names: tuple[tuple[str, str], ...] = GRANITE_MOE_NAMES

    def checkpoint_layout(self, weights: Iterable[tuple[str, torch.Tensor]]
                          ) -> Iterator[tuple[str, torch.Tensor]]:
        # Renamed before tensor parallelism slices them, so that the shard reads them as any MoE's.
        for name, tensor in weights:
            for old, new in self.checkpoint_names:
                if name.endswith("." + old):
                    name = name[: -len(old)] + new
                    break
            yield name, tensor
