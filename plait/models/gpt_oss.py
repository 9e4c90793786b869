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
from plait.layers.norm import RMSNorm
from plait.models.layer_kinds import SLIDING, layer_types
from plait.models.llama import Attention, DecoderLayer, LlamaModel, MoeForCausalLM
from plait.models.weights import load_decoder_weights

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
    """The Llama layer (DecoderLayer.forward) around GPT-OSS's attention and MoE block."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        nn.Module.__init__(self)  # not DecoderLayer's, which would build a SiLU MoE block to throw away
        kind = layer_types(cfg.raw, DEFAULT_SLIDING_PATTERN)[layer_idx]
        self.self_attn = GptOssAttention(cfg, layer_idx, sliding=kind == SLIDING)
        self.mlp = GptOssMoE(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class GptOssModel(LlamaModel):
    layer_class = GptOssDecoderLayer


class GptOssForCausalLM(MoeForCausalLM):
    """GptOssForCausalLM: checkpoints in MXFP4 (the Hub's) or in 16 bits (transformers' own layout: each
    expert's gate_up_proj as [hidden, 2 * inter] with gate and up columns interleaved)."""

    model_class = GptOssModel

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_decoder_weights(self, expert_weights(weights, self.model.embed_tokens.weight.device))


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
            weight = tensor.transpose(1, 2)
            yield f"{prefix}.{leaf}", gate_up_halves(weight, dim=1) if leaf == "gate_up_proj" else weight
        else:
            done = pairs.add(name, tensor)  # the blocks or scales of an MXFP4 tensor: [E, out, in] once whole
            if done is not None:
                full_name, weight = done
                leaf = full_name.rpartition(".")[2]
                yield full_name, gate_up_halves(weight, dim=1) if leaf == "gate_up_proj" else weight
    pairs.check_empty()


def gate_up_halves(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """Interleaved gate/up entries along ``dim`` (gate 0, up 0, gate 1, ...) as all gates, then all ups."""
    index = torch.arange(tensor.shape[dim], device=tensor.device)
    return tensor.index_select(dim, torch.cat([index[0::2], index[1::2]]))
