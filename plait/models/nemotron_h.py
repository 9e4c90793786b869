"""NemotronH: a hybrid whose every layer is RMSNorm + one mixer (Mamba2, attention without rotary
embeddings, a squared-ReLU MLP, or a sparse MoE block) + residual.

Attention layers use the paged KV cache, allocated only for them (``kv_index`` among attention
layers); Mamba layers keep per-request state in slots (``state_index`` among Mamba layers).

MoE layers (Nemotron 3 Nano / Super) are transformers' NemotronHMoE: DeepSeek-V3's noaux_tc router on the
layer's input picks among ungated relu^2 experts (plait.layers.moe.RELU2_NO_MUL); with moe_latent_size
(Nemotron 3 Super's latent MoE) the experts run in that width, between fc1_latent_proj (their input) and
fc2_latent_proj (their routed-weighted sum's way back); a relu^2 shared expert on the layer's input adds to
the result.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from plait.config import ModelConfig
from plait.layers.mamba import Mamba2Dims, Mamba2Mixer
from plait.layers.moe import RELU2_NO_MUL, FusedMoE, NoAuxTcRouter
from plait.layers.norm import RMSNorm
from plait.models.base import RecurrentCausalLM
from plait.models.llama import Attention
from plait.models.mamba2 import check_activation
from plait.models.weights import load_checked
from plait.runner.forward_batch import ForwardBatch

MAMBA, ATTENTION, MLP_LAYER, MOE = "linear_attention", "full_attention", "mlp", "moe"
SUPPORTED_MLP_ACTIVATION = "relu2"
_QKV = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
# transformers 5's stacked routed experts (its state dict; save_pretrained writes one tensor per expert):
# up_proj [E, I, in] is FusedMoE's gate_up_proj of ungated experts.
STACKED_UP = ".experts.up_proj"


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
    unknown = sorted(set(types) - {MAMBA, ATTENTION, MLP_LAYER, MOE})
    if unknown:
        raise ValueError(f"NemotronH layer kinds {unknown} are not supported")
    return list(types)


class ReluSquaredMLP(nn.Module):
    """The MLP layer (intermediate_size wide), or a MoE layer's shared expert (its own width)."""

    def __init__(self, cfg: ModelConfig, width: int | None = None) -> None:
        super().__init__()
        bias = bool(cfg.raw.get("mlp_bias", False))
        width = width or cfg.intermediate_size
        self.up_proj = nn.Linear(cfg.hidden_size, width, bias=bias)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]
        return self.down_proj(F.relu(self.up_proj(x)).square())


class NemotronHMoE(nn.Module):
    """transformers' NemotronHMoE (module docstring). Under tensor parallelism each rank holds a slice of
    every expert's and the shared expert's width (or, expert-parallel, whole experts); the latent
    projections are whole on every rank (fc2_latent_proj's bias the driver's), and the block's output is
    summed over the ranks."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        bias = bool(cfg.raw.get("mlp_bias", False))
        latent = cfg.raw.get("moe_latent_size")
        self.gate = NoAuxTcRouter.of(cfg)
        self.experts = FusedMoE(moe.num_experts, moe.top_k, latent or cfg.hidden_size, moe.intermediate_size,
                                moe.renormalize, activation=RELU2_NO_MUL, expert_range=moe.expert_range)
        self.shared_experts = ReluSquaredMLP(cfg, moe.shared_intermediate_size)
        if latent:
            self.fc1_latent_proj = nn.Linear(cfg.hidden_size, latent, bias=bias)
            self.fc2_latent_proj = nn.Linear(latent, cfg.hidden_size, bias=bias)
        else:
            self.fc1_latent_proj = self.fc2_latent_proj = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        weights, ids = self.gate(x)  # [T, k] fp32 (routed_scaling_factor in them), [T, k]
        routed = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)  # [T, latent or hidden]
        routed = self.experts.run_routed(routed, weights, ids)
        if self.fc2_latent_proj is not None:  # after the weighted sum, as transformers: its bias added once
            routed = self.fc2_latent_proj(routed)
        return routed + self.shared_experts(x)


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
        elif kind == MOE:
            self.mixer = NemotronHMoE(cfg)
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
        if isinstance(raw.get("intermediate_size"), list):  # vLLM's heterogeneous NemotronH configs
            raise ValueError("NemotronH with per-layer intermediate sizes is not supported")
        if MOE in layer_types(raw) and cfg.moe is None:
            raise ValueError("NemotronH MoE layers need the config's routed experts (n_routed_experts)")
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
            if name.endswith(STACKED_UP):
                name = name.removesuffix("up_proj") + "gate_up_proj"
            # NemotronH checkpoints (and transformers' save_pretrained) call the trunk "backbone".
            return "model." + name.removeprefix("backbone.") if name.startswith("backbone.") else name

        load_checked(self, weights, _QKV, {"qkv_proj": [q, kv, kv]}, rename)
