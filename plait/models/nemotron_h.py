"""NemotronH: a hybrid whose every layer is RMSNorm + one mixer (Mamba2, attention without rotary
embeddings, or a squared-ReLU MLP) + residual. MoE layers are not supported.

Attention layers use the paged KV cache, allocated only for them (``kv_index`` among attention
layers); Mamba layers keep per-request state in slots (``state_index`` among Mamba layers).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from plait.config import ModelConfig
from plait.layers.mamba import Mamba2Dims, Mamba2Mixer
from plait.layers.norm import RMSNorm
from plait.models.base import RecurrentCausalLM
from plait.models.llama import Attention
from plait.models.mamba2 import check_activation
from plait.models.weights import load_checked
from plait.runner.forward_batch import ForwardBatch

MAMBA, ATTENTION, MLP_LAYER, MOE = "linear_attention", "full_attention", "mlp", "moe"
SUPPORTED_MLP_ACTIVATION = "relu2"
_QKV = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}


def nemotron_h_dims(raw: dict) -> Mamba2Dims:
    check_activation(raw.get("mamba_hidden_act", "silu"))
    return Mamba2Dims(
        hidden_size=raw["hidden_size"], num_heads=raw["mamba_num_heads"], head_dim=raw["mamba_head_dim"],
        state_size=raw["ssm_state_size"], n_groups=raw.get("n_groups", 1),
        conv_kernel=raw.get("conv_kernel", 4), chunk_size=raw.get("chunk_size", 128),
        use_conv_bias=raw.get("use_conv_bias", True), use_bias=raw.get("use_bias", False),
        norm_eps=raw.get("layer_norm_epsilon", 1e-5),
        # NemotronH's mixer floors dt at time_step_min and has no upper limit (as in transformers).
        time_step_limit=(float(raw.get("time_step_min", 0.001)), float("inf")),
    )


def layer_types(raw: dict) -> list[str]:
    types = raw.get("layers_block_type")
    if types is None:
        pattern = {"M": MAMBA, "*": ATTENTION, "-": MLP_LAYER, "E": MOE}
        types = [pattern[c] for c in raw["hybrid_override_pattern"]]
    if MOE in types:
        raise ValueError("NemotronH with MoE layers is not supported")
    return list(types)


class ReluSquaredMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        bias = bool(cfg.raw.get("mlp_bias", False))
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]
        return self.down_proj(F.relu(self.up_proj(x)).square())


class NoRotary(nn.Module):
    """NemotronH attention has no position embedding: the Mamba layers carry order."""

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k


class NemotronHBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, dims: Mamba2Dims, kind: str, index: int) -> None:
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if kind == MAMBA:
            self.mixer = Mamba2Mixer(dims, state_index=index)
        elif kind == ATTENTION:
            self.mixer = Attention(cfg, layer_idx=index)  # index = its KV cache
        else:
            self.mixer = ReluSquaredMLP(cfg)

    def forward(self, x: torch.Tensor, rotary: NoRotary, batch: ForwardBatch) -> torch.Tensor:
        # x: [T, hidden], the residual stream
        h = self.norm(x)
        if self.kind == MAMBA:
            h = self.mixer(h, batch)
        elif self.kind == ATTENTION:
            h = self.mixer(h, rotary, batch)
        else:
            h = self.mixer(h)
        return x + h


class NemotronHModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dims: Mamba2Dims) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        types = layer_types(cfg.raw)
        indices = [types[:i].count(t) for i, t in enumerate(types)]
        self.layers = nn.ModuleList(NemotronHBlock(cfg, dims, t, j) for t, j in zip(types, indices))
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = NoRotary()

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = self.embeddings(input_ids)
        for layer in self.layers:
            x = layer(x, self.rotary, batch)
        return self.norm_f(x)


class NemotronHForCausalLM(RecurrentCausalLM):
    """forward(input_ids, positions, batch) -> hidden states; logits on request."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        raw = cfg.raw
        activation = raw.get("mlp_hidden_act", SUPPORTED_MLP_ACTIVATION)
        if activation != SUPPORTED_MLP_ACTIVATION:
            raise ValueError(f"NemotronH MLP activation {activation!r} is not supported")
        if cfg.attention_bias:
            raise ValueError("NemotronH with attention_bias is not supported")
        self.config = cfg
        self.dims = nemotron_h_dims(raw).split(cfg.mamba_ranks)
        types = layer_types(raw)
        self.num_kv_cache_layers = types.count(ATTENTION)
        self.num_mamba_layers = types.count(MAMBA)
        self.model = NemotronHModel(cfg, self.dims)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embeddings.weight

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        cfg, tied = self.config, self.config.tie_word_embeddings
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim

        def rename(name: str) -> str | None:
            if tied and name == "lm_head.weight":
                return None
            if name.startswith("mtp."):
                return None  # multi-token-prediction heads are not used for plain decoding
            # NemotronH checkpoints (and transformers' save_pretrained) call the trunk "backbone".
            return "model." + name.removeprefix("backbone.") if name.startswith("backbone.") else name

        load_checked(self, weights, _QKV, {"qkv_proj": [q, kv, kv]}, rename)
