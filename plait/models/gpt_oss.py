"""GPT-OSS (OpenAI gpt-oss-20b / gpt-oss-120b): the Llama decoder with biases on every attention projection,
a learned sink logit per query head, 128-token sliding windows on every other layer, YaRN, and sparse MoE
blocks whose experts have biases and a clamped SwiGLU. The Hub checkpoints hold the experts in MXFP4, which
they keep (plait.layers.mxfp4; the fused MoE kernels decode it as they multiply)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from plait.config import ModelConfig
from plait.layers.linear import Linear, deferred_device
from plait.layers.moe import (
    GPT_OSS_SWIGLU_ALPHA,
    GPT_OSS_SWIGLU_LIMIT,
    MXFP4_WEIGHTS,
    STACKS,
    SWIGLU_OAI,
    FusedMoE,
)
from plait.layers.mxfp4 import MXFP4_SUFFIXES, MxFp4Pairs
from plait.models.layer_kinds import SLIDING, layer_types
from plait.models.llama import Attention, DecoderLayer, LlamaModel, MoeForCausalLM
from plait.models.weights import halves_order, load_decoder_weights

# Every other layer slides, the first among them (GptOssConfig.layer_types' default).
DEFAULT_SLIDING_PATTERN = 2


class GptOssAttention(Attention):
    """q/k/v and o with biases; each query head's sink logit joins its softmax as a key with no value."""

    o_proj_bias = True

    def __init__(self, cfg: ModelConfig, layer_idx: int, sliding: bool) -> None:
        super().__init__(cfg, layer_idx)
        self.sinks = nn.Parameter(torch.empty(self.num_heads, device=deferred_device()), requires_grad=False)
        self.sliding_window = cfg.raw.get("sliding_window") if sliding else None


class GptOssMoE(nn.Module):
    """The router (a biased linear) picks each token's top-k experts, weighted by a softmax over their
    logits alone: the same weights as a softmax over all experts renormalised over the top k."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe, raw = cfg.moe, cfg.raw
        self.router = Linear(cfg.hidden_size, moe.num_experts, bias=True)
        self.experts = FusedMoE(moe.num_experts, moe.top_k, cfg.hidden_size, moe.intermediate_size,
                                renormalize=True, activation=SWIGLU_OAI, bias=True,
                                swiglu_alpha=raw.get("swiglu_alpha", GPT_OSS_SWIGLU_ALPHA),
                                swiglu_limit=raw.get("swiglu_limit", GPT_OSS_SWIGLU_LIMIT),
                                expert_range=moe.expert_range)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        return self.experts(x, self.router(x))


class GptOssDecoderLayer(DecoderLayer):
    """The Llama layer around GPT-OSS's attention and MoE block."""

    def make_attention(self, cfg: ModelConfig, layer_idx: int) -> GptOssAttention:
        kind = layer_types(cfg.raw, DEFAULT_SLIDING_PATTERN)[layer_idx]
        return GptOssAttention(cfg, layer_idx, sliding=kind == SLIDING)

    def make_mlp(self, cfg: ModelConfig, layer_idx: int) -> GptOssMoE:
        return GptOssMoE(cfg)


class GptOssModel(LlamaModel):
    layer_class = GptOssDecoderLayer


class GptOssForCausalLM(MoeForCausalLM):
    """GptOssForCausalLM: checkpoints in MXFP4 (the Hub's: the experts stay MXFP4, FusedMoE.use_mxfp4, applied
    by the loader) or in 16 bits (transformers' own layout: each expert's gate_up_proj as [hidden, 2 * inter]
    with gate and up columns interleaved)."""

    model_class = GptOssModel

    def checkpoint_layout(self, weights: Iterable[tuple[str, torch.Tensor]]
                          ) -> Iterator[tuple[str, torch.Tensor]]:
        return expert_weights(weights)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        experts = {name: m for name, m in self.named_modules() if isinstance(m, FusedMoE)}
        packed = frozenset(f"{name}.{stack}" for name, m in experts.items()
                           if m.weight_format == MXFP4_WEIGHTS for stack in STACKS)  # load_mxfp4 fills them
        load_decoder_weights(self, self._mxfp4_pairs_loaded(weights, experts), not_in_checkpoint=packed)

    @staticmethod
    def _mxfp4_pairs_loaded(weights: Iterable[tuple[str, torch.Tensor]], experts: dict[str, FusedMoE]
                            ) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors but the MXFP4 ones, each pair of which goes to its FusedMoE's load_mxfp4 once both
        have arrived (FusedMoE.check_loaded refuses experts left without theirs)."""
        pairs = MxFp4Pairs()
        for name, tensor in weights:
            if not name.endswith(MXFP4_SUFFIXES):
                yield name, tensor
                continue
            done = pairs.add(name, tensor)
            if done is not None:
                base, blocks, scales = done
                owner, _, stack = base.rpartition(".")
                if owner not in experts:
                    raise ValueError(f"MXFP4 tensor {base!r} is not an expert projection of this model")
                experts[owner].load_mxfp4(stack, blocks, scales)
        pairs.check_empty()


# A GPT-OSS checkpoint's expert tensors under plait's FusedMoE names.
EXPERT_BIAS_NAMES = {"gate_up_proj_bias": "gate_up_bias", "down_proj_bias": "down_bias"}


def expert_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each layer's experts in FusedMoE's layout: gate_up_proj [E, 2I, H] (an
    expert's gate rows, then its up rows) and down_proj [E, H, I], their biases in the same row order. MXFP4
    blocks ([E, out, in / 32, 16]) and scales ([E, out, in / 32]) keep their names and packing, their rows
    put in the same order."""
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if not prefix.endswith(".mlp.experts"):
            yield name, tensor
        elif leaf in EXPERT_BIAS_NAMES:
            bias = gate_up_halves(tensor, dim=1) if leaf == "gate_up_proj_bias" else tensor
            yield f"{prefix}.{EXPERT_BIAS_NAMES[leaf]}", bias
        elif leaf in STACKS:
            # transformers' layout is [E, in, out]: FusedMoE's rows are the outputs
            yield f"{prefix}.{leaf}", fused_rows(leaf, tensor.transpose(1, 2))
        elif leaf.endswith(MXFP4_SUFFIXES):
            yield name, fused_rows(leaf.rpartition("_")[0], tensor)
        else:
            yield name, tensor  # not an expert tensor GPT-OSS has: load_weights names it


def fused_rows(projection: str, weight: torch.Tensor) -> torch.Tensor:
    """An expert projection's [E, out, ...] weight in FusedMoE's row order: gate_up_proj's interleaved rows as
    all gates, then all ups; down_proj's as they are."""
    return gate_up_halves(weight, dim=1) if projection == "gate_up_proj" else weight


def gate_up_halves(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """Interleaved gate/up entries along ``dim`` (gate 0, up 0, gate 1, ...) as all gates, then all ups: the
    even entries, then the odd ones (weights.halves_order over the whole dimension)."""
    size = tensor.shape[dim]
    return tensor.index_select(dim, halves_order(size, size).to(tensor.device))
