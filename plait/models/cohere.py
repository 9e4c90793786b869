"""Cohere's decoders: Command R / R+ and Aya 23 / Aya Expanse (CohereForCausalLM), Command R7B and Command A
(Cohere2ForCausalLM). One LayerNorm (mean-subtracting, no bias) a layer feeds attention and MLP in parallel:
h = x + attn(norm(x)) + mlp(norm(x)). Their rotary turns adjacent channel pairs (GPT-J's), which plait's
kernels compute once q's and k's channels are reordered at load (pairs_as_halves, as for ERNIE 4.5 and GLM-4);
Command R+ normalises each q and k head with a LayerNorm of that head's own weight; logits are scaled by
logit_scale; embeddings are tied. Cohere2 attends through a sliding window on three of every four layers,
which alone rotate: its global layers have no positions (NoPE), as transformers' Cohere2Attention."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from plait.attention.base import Rotary
from plait.config import ModelConfig
from plait.layers.linear import logits_fp32
from plait.layers.norm import CohereLayerNorm
from plait.layers.rotary import rotary_embedding
from plait.models.base import refuse_config_keys
from plait.models.layer_kinds import FULL, SLIDING, layer_types
from plait.models.llama import MLP, Attention, PairedRotaryForCausalLM
from plait.models.weights import LoadRecord, halves_order, load_decoder_weights, pairs_as_halves
from plait.runner.forward_batch import ForwardBatch

# transformers' defaults (CohereConfig / Cohere2Config), which ModelConfig.from_hf fills in where a config
# leaves them out (COMPLETED_CONFIGS); Cohere2's default pattern: every fourth layer global.
DEFAULT_LOGIT_SCALE = 0.0625
DEFAULT_SLIDING_PATTERN = 4


class CohereAttention(Attention):
    """The Llama family's attention with Command R+'s per-head q/k LayerNorms (use_qk_norm) applied before
    the rotation, and a window only on a Cohere2 sliding layer."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, sliding: bool) -> None:
        super().__init__(cfg, layer_idx)
        eps = cfg.rms_norm_eps
        if cfg.raw.get("use_qk_norm"):
            # [heads, head_dim] weights: each head's row normalised with its own (so a tensor-parallel rank
            # holds its heads' rows: plait.parallel.shard).
            self.q_norm = CohereLayerNorm((self.num_heads, self.head_dim), eps)
            self.k_norm = CohereLayerNorm((self.num_kv_heads, self.head_dim), eps)
        self.sliding_window = cfg.raw.get("sliding_window") if sliding else None

    def attend(self, qkv: torch.Tensor, rotary: Rotary | None, batch: ForwardBatch) -> torch.Tensor:
        # qkv: [T, (Hq + 2 Hkv) D] -> attention output before o_proj: [T, Hq D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            # In torch, before the backend rotates: the fused rotary launch's q/k norms are RMSNorms.
            q, k = self.q_norm(q), self.k_norm(k)
        out = batch.attention(self.layer_idx, q, k, v, self.scale, self.sliding_window, rotary=rotary)
        return out.reshape(-1, self.q_size)


class CohereDecoderLayer(nn.Module):
    """One norm, then attention and MLP side by side, both outputs added to the stream (attention's first,
    as transformers adds them). Under tensor parallelism o_proj and down_proj each sum their partial outputs
    over the ranks (plait.parallel.shard.sum_row_parallel_outputs): two all-reduces a layer."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.self_attn = CohereAttention(cfg, layer_idx, sliding=kind == SLIDING)
        self.mlp = MLP(cfg)
        self.input_layernorm = CohereLayerNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rotary: Rotary | None, batch: ForwardBatch) -> torch.Tensor:
        # x: the residual stream [T, hidden] -> the stream after this layer
        h = self.input_layernorm(x)
        return x + self.self_attn(h, rotary, batch) + self.mlp(h)


class CohereModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        kinds = self.layer_kinds(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(CohereDecoderLayer(cfg, i, kind) for i, kind in enumerate(kinds))
        self.norm = CohereLayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # The rotary of each kind of layer that rotates (a module, so sleep parks its table); a kind missing
        # here attends without positions.
        rotary = rotary_embedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.rotary = nn.ModuleDict({kind: rotary for kind in self.rotating_kinds()})

    @staticmethod
    def layer_kinds(cfg: ModelConfig) -> list[str]:
        """Command R's layers all attend globally."""
        return [FULL] * cfg.num_hidden_layers

    @staticmethod
    def rotating_kinds() -> tuple[str, ...]:
        return (FULL,)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # input_ids: [T] -> hidden: [T, hidden]
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            rotary = self.rotary[layer.kind] if layer.kind in self.rotary else None
            x = layer(x, rotary, batch)
        return self.norm(x)


class Cohere2Model(CohereModel):
    @staticmethod
    def layer_kinds(cfg: ModelConfig) -> list[str]:
        """The config's layer_types (ModelConfig.from_hf completes them from sliding_window_pattern, as
        Cohere2Config does: every fourth layer global by default)."""
        return layer_types(cfg.raw, DEFAULT_SLIDING_PATTERN)

    @staticmethod
    def rotating_kinds() -> tuple[str, ...]:
        """Only the sliding layers rotate (transformers' Cohere2Attention: rotary where it has a window)."""
        return (SLIDING,)


def cohere_pairs_as_halves(weights: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig
                           ) -> Iterator[tuple[str, torch.Tensor]]:
    """pairs_as_halves, and Command R+'s per-head q/k norm weights ([heads, head_dim]) with their channels in
    the same order as q's and k's (a LayerNorm over a head's channels is the same under any one order of its
    channels and its weight's)."""
    order = halves_order(cfg.head_dim, cfg.head_dim)
    for name, tensor in pairs_as_halves(weights, cfg):
        if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
            tensor = tensor[..., order.to(tensor.device)]
        yield name, tensor


class CohereForCausalLM(PairedRotaryForCausalLM):
    """CohereForCausalLM (c4ai-command-r-v01, command-r-08-2024, command-r-plus, aya-23, aya-expanse); its
    checkpoints name the Llama family's projections, so q/k/v and gate/up fuse at load. LoRA is refused as
    for every paired-rotary model (PairedRotaryForCausalLM: an adapter's q/k rows would need reordering)."""

    model_class = CohereModel
    family = "Cohere"

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        # Cohere's attention_bias puts biases on o_proj too (and no released checkpoint has them)
        refuse_config_keys(cfg.raw, self.family, ("attention_bias",))
        super().__init__(cfg, max_positions)
        scale = cfg.raw.get("logit_scale")
        self.logit_scale = float(DEFAULT_LOGIT_SCALE if scale is None else scale)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [S, hidden] -> [S, vocab] fp32, scaled as transformers scales them
        return logits_fp32(hidden, self.lm_head.weight) * self.logit_scale

    def fold_norm_weights(self, loaded: LoadRecord | None = None) -> None:
        """Kept unfolded: the fused decode path (LlamaModel.fuses_mlp_norm) applies an RMSNorm's row scale,
        and a LayerNorm subtracts the mean first; one norm feeds attention and MLP besides."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_decoder_weights(self, cohere_pairs_as_halves(weights, self.config))


class Cohere2ForCausalLM(CohereForCausalLM):
    """Cohere2ForCausalLM (c4ai-command-r7b-12-2024, c4ai-command-r7b-arabic-02-2025, command-a-03-2025)."""

    model_class = Cohere2Model
    family = "Cohere2"

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        # transformers' Cohere2 has no q/k norms (the key would be ignored there); refused rather than guessed
        refuse_config_keys(cfg.raw, self.family, ("use_qk_norm",))
        super().__init__(cfg, max_positions)
