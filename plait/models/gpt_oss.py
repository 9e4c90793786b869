"""GPT-OSS (OpenAI gpt-oss-20b / gpt-oss-120b): the Llama decoder with biases on every attention projection,
a learned sink logit per query head, 128-token sliding windows on every other layer, YaRN, and sparse MoE
blocks whose experts have biases and a clamped SwiGLU. The Hub checkpoints hold the experts in MXFP4, which
is dequantised to the model's dtype as it streams in (plait.layers.mxfp4)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from plait.config import ModelConfig
from plait.layers.linear import Linear, deferred_device
from plait.layers.moe import GPT_OSS_SWIGLU_ALPHA, GPT_OSS_SWIGLU_LIMIT, SWIGLU_OAI, FusedMoE
from plait.layers.mxfp4 import MxFp4Pairs
from plait.models.layer_kinds import SLIDING, layer_types
from plait.models.llama import Attention, DecoderLayer, LlamaModel, MoeForCausalLM
from plait.models.weights import halves_order

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
                                swiglu_limit=raw.get("swiglu_limit", GPT_OSS_SWIGLU_LIMIT))

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
    """GptOssForCausalLM: checkpoints in MXFP4 (the Hub's) or in 16 bits (transformers' own layout: each
    expert's gate_up_proj as [hidden, 2 * inter] with gate and up columns interleaved)."""

    model_class = GptOssModel

    def checkpoint_layout(self, weights: Iterable[tuple[str, torch.Tensor]]
                          ) -> Iterator[tuple[str, torch.Tensor]]:
        return expert_weights(weights, self.model.embed_tokens.weight.device)


# A GPT-OSS checkpoint's expert tensors under plait's FusedMoE names.
EXPERT_BIAS_NAMES = {"gate_up_proj_bias": "gate_up_bias", "down_proj_bias": "down_bias"}


def expert_weights(weights: Iterable[tuple[str, torch.Tensor]], device: torch.device | str = "cpu"
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each layer's experts in FusedMoE's layout: gate_up_proj [E, 2I, H] (an
    expert's gate rows, then its up rows) and down_proj [E, H, I], their biases in the same row order. MXFP4
    blocks and scales are dequantised on ``device`` once both have arrived."""
    pairs = MxFp4Pairs(device)
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if not prefix.endswith(".mlp.experts"):
            yield name, tensor
        elif leaf in EXPERT_BIAS_NAMES:
            bias = gate_up_halves(tensor, dim=1) if leaf == "gate_up_proj_bias" else tensor
            yield f"{prefix}.{EXPERT_BIAS_NAMES[leaf]}", bias
        elif leaf in ("gate_up_proj", "down_proj"):
            # transformers' layout is [E, in, out]: FusedMoE's rows are the outputs
            yield f"{prefix}.{leaf}", fused_rows(leaf, tensor.transpose(1, 2))
        else:
            done = pairs.add(name, tensor)  # the blocks or scales of an MXFP4 tensor: [E, out, in] once whole
            if done is not None:
                full_name, weight = done
                yield full_name, fused_rows(full_name.rpartition(".")[2], weight)
    pairs.check_empty()


def fused_rows(projection: str, weight: torch.Tensor) -> torch.Tensor:
    """An expert projection's [E, out, in] weight in FusedMoE's row order: gate_up_proj's interleaved rows as
    all gates, then all ups; down_proj's as they are."""
    return gate_up_halves(weight, dim=1) if projection == "gate_up_proj" else weight


def gate_up_halves(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """Interleaved gate/up entries along ``dim`` (gate 0, up 0, gate 1, ...) as all gates, then all ups: the
    even entries, then the odd ones (weights.halves_order over the whole dimension)."""
    size = tensor.shape[dim]
    return tensor.index_select(dim, halves_order(size, size).to(tensor.device))
