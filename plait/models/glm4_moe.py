"""GLM-4.5 / GLM-4.6 (Zhipu AI, Glm4MoeForCausalLM: GLM-4.5-Air, GLM-4.5, GLM-4.6): the Llama decoder with
q/k/v biases, optional per-head q/k norms (use_qk_norm), a rotary over the first half of each head (neox
halves within it, as Phi-3's partial rotary: no reordering, unlike GLM-4's pairs), dense MLPs in the first
first_k_dense_replace layers and sparse MoE blocks after them: DeepSeek-V3's "noaux_tc" router
(plait.layers.moe.NoAuxTcRouter) over the routed experts, plus ungated shared experts every token takes.

The checkpoints also hold num_nextn_predict_layers multi-token-prediction layers (``model.layers.{N}.*`` for
N = num_hidden_layers ...): the target skips them at load; speculative_config method "mtp" drafts with the
first (plait.models.mtp), as vLLM does."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from plait.config import ModelConfig
from plait.layers.moe import FusedMoE, NoAuxTcRouter
from plait.models.llama import MLP, DecoderLayer, LlamaModel, MoeForCausalLM
from plait.models.weights import STACKED_PROJECTIONS, decoder_shard_sizes, load_checked

LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


class Glm4MoeBlock(nn.Module):
    """Routed experts on the noaux_tc router's choice, plus the shared experts (a dense MLP of
    n_shared_experts x moe_intermediate_size, no gate) on every token; the sum is the block's output."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        self.gate = self.make_router(cfg)
        self.experts = FusedMoE(moe.num_experts, moe.top_k, cfg.hidden_size, moe.intermediate_size,
                                moe.renormalize, expert_range=moe.expert_range)
        self.shared_experts = MLP(cfg, moe.shared_intermediate_size) if moe.shared_intermediate_size else None

    @staticmethod
    def make_router(cfg: ModelConfig) -> nn.Module:
        """x [T, hidden] -> (weights [T, k] fp32, routed_scaling_factor in them; ids [T, k])."""
        return NoAuxTcRouter.of(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        weights, ids = self.gate(x)  # [T, k] fp32 (routed_scaling_factor in them), [T, k]
        out = self.experts.run_routed(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class Glm4MoeDecoderLayer(DecoderLayer):
    def make_mlp(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        return MLP(cfg) if layer_idx in cfg.moe.dense_layers else Glm4MoeBlock(cfg)


def without_mtp_layers(cfg: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]]
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` without the checkpoint's num_nextn_predict_layers multi-token-prediction layers
    (model.layers.{N}.* for N from num_hidden_layers on; GLM-4.5's and DeepSeek-V3's): the target's decoder
    has no use for them (the MTP draft head, plait.models.mtp, loads its layer from the checkpoint itself)."""
    first = cfg.num_hidden_layers
    end = first + int(cfg.raw.get("num_nextn_predict_layers") or 0)
    for name, tensor in weights:
        layer = LAYER_INDEX.match(name)
        if layer and first <= int(layer[1]) < end:
            continue
        yield name, tensor


class Glm4MoeModel(LlamaModel):
    layer_class = Glm4MoeDecoderLayer


class Glm4MoeForCausalLM(MoeForCausalLM):
    """Glm4MoeForCausalLM. No LoRA (MoeForCausalLM's reason); MLP norms kept unfolded."""

    model_class = Glm4MoeModel

    def checkpoint_layout(self, weights: Iterable[tuple[str, torch.Tensor]]
                          ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint without its MTP layers (before a tensor-parallel rank slices anything)."""
        return without_mtp_layers(self.config, weights)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        cfg = self.config
        sizes = decoder_shard_sizes(cfg)
        if cfg.moe.shared_intermediate_size:  # gate/up of the shared experts (plural: GLM's module name)
            sizes["shared_experts.gate_up_proj"] = [cfg.moe.shared_intermediate_size] * 2

        def rename(name: str) -> str | None:
            if "rotary_emb.inv_freq" in name or (cfg.tie_word_embeddings and name == "lm_head.weight"):
                return None
            return name

        load_checked(self, weights, STACKED_PROJECTIONS, sizes, rename)
