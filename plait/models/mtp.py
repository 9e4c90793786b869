"""Multi-token-prediction (MTP) draft heads: a GLM-4.5 / DeepSeek-V3 checkpoint's own MTP layer, run by
plait.engine.eagle.EagleDrafter as speculative_config method "mtp"."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from plait.attention.base import KVCacheSpec, Rotary
from plait.config import MTP_HEAD_ARCHITECTURES, ModelConfig, mla_dims
from plait.layers.linear import Linear
from plait.layers.norm import RMSNorm
from plait.layers.rotary import RotaryEmbedding, rotary_embedding
from plait.models.eagle import SHARED_WITH_TARGET, EagleHead
from plait.models.weights import STACKED_PROJECTIONS, decoder_shard_sizes
from plait.runner.forward_batch import ForwardBatch

# The MTP layer's tensors beside its decoder layer's (checkpoint names under model.layers.{N}.) -> the head's.
_HEAD_TENSORS = {"embed_tokens.": "model.embed_tokens.", "enorm.": "model.enorm.", "hnorm.": "model.hnorm.",
                 "eh_proj.": "model.eh_proj.", "shared_head.norm.": "model.norm.",
                 "shared_head.head.": "lm_head."}


class _MtpTrunk(nn.Module):
    """The MTP layer: enorm / hnorm over the token's embedding and the hidden state, eh_proj over the two side
    by side, one decoder layer of the target's kind, and shared_head's norm (``norm``)."""

    def __init__(self, cfg: ModelConfig, layer: nn.Module, rotary: Rotary) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, hidden)
        self.enorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([layer])
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.rotary = rotary

    def norm_like_weight(self) -> torch.Tensor:
        return self.norm.weight


class MtpHead(EagleHead):
    """An MTP layer as vLLM's DeepSeekMTP / Glm4MoeMTP run it: position p takes token p + 1's embedding
    (zeroed at position 0, as vLLM does) and the target's last hidden state at p (after its final norm),
    h = eh_proj([enorm(embedding), hnorm(hidden)]), then the layer's decoder layer; the output, through
    shared_head's norm and head, gives the draft, and before that norm is the next draft's hidden state (one
    MTP layer applied again for k > 1). The head loads model.layers.{num_hidden_layers}.* of the target's
    checkpoint; where that layer has no embedding or head of its own, the target's are shared. A checkpoint
    of several MTP layers drafts with its first alone."""

    shareable = SHARED_WITH_TARGET
    stacked: dict[str, tuple[str, int]] = STACKED_PROJECTIONS

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__(cfg)
        if int(cfg.raw.get("num_nextn_predict_layers") or 0) < 1:
            raise ValueError(f"speculative method 'mtp' drafts with the checkpoint's multi-token-prediction "
                             f"layers; this {cfg.architecture} checkpoint has none "
                             "(num_nextn_predict_layers)")
        # The checkpoint's number for the MTP layer: the first after the decoder's.
        self.mtp_layer = cfg.num_hidden_layers
        layer = self.make_layer(cfg, self.mtp_layer)  # its MLP the kind the target has at that depth
        layer.self_attn.layer_idx = 0  # the head's KV cache holds this one layer
        self.num_kv_cache_layers = 1
        self.model = _MtpTrunk(cfg, layer, self.make_rotary(cfg, max_positions))
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @staticmethod
    def wanted_tensors(cfg: ModelConfig) -> Callable[[str], bool]:
        """The checkpoint tensors the head reads: its layer's (the loader leaves the others unread)."""
        prefix = f"model.layers.{cfg.num_hidden_layers}."
        return lambda name: name.startswith(prefix)

    def make_layer(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        raise NotImplementedError

    def make_rotary(self, cfg: ModelConfig, max_positions: int) -> Rotary:
        raise NotImplementedError

    def shard_sizes(self) -> dict[str, list[int]]:
        return decoder_shard_sizes(self.config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden (shared_head-normed): [T, hidden]; the output before that norm
        # is left in features_out for the next draft
        trunk = self.model
        embeds = trunk.embed_tokens(input_ids)  # [T, hidden]
        # No token before position 0 predicted the one there: vLLM's MTP zeroes its embedding.
        embeds = embeds.masked_fill((positions == 0)[:, None], 0.0)
        features = self._input_features(len(input_ids), embeds)  # [T, hidden]: the target's at p
        x = trunk.eh_proj(torch.cat([trunk.enorm(embeds), trunk.hnorm(features)], dim=-1))
        x, residual = trunk.layers[0](x, None, trunk.rotary, batch)
        out = x + residual  # [T, hidden]
        self._output_features(out)
        return trunk.norm(out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        prefix = f"model.layers.{self.mtp_layer}."

        def rename(name: str) -> str | None:
            if not name.startswith(prefix) or "rotary_emb.inv_freq" in name:
                return None  # the target's decoder (and any later MTP layer): not the head's
            rest = name[len(prefix):]
            for old, new in _HEAD_TENSORS.items():
                if rest.startswith(old):
                    return new + rest[len(old):]
            return f"model.layers.0.{rest}"

        self._load(weights, rename, self.stacked, self.shard_sizes())


class Glm4MoeMTPModel(MtpHead):
    """GLM-4.5 / GLM-4.6's MTP layer: a GLM-4.5 decoder layer (its attention, its MoE block)."""

    def make_layer(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        from plait.models.glm4_moe import Glm4MoeDecoderLayer

        return Glm4MoeDecoderLayer(cfg, layer_idx)

    def make_rotary(self, cfg: ModelConfig, max_positions: int) -> Rotary:
        return rotary_embedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling,
                                cfg.partial_rotary_factor)

    def shard_sizes(self) -> dict[str, list[int]]:
        sizes = decoder_shard_sizes(self.config)
        if self.config.moe.shared_intermediate_size:  # GLM's module name is plural
            sizes["shared_experts.gate_up_proj"] = [self.config.moe.shared_intermediate_size] * 2
        return sizes


class DeepSeekMTPModel(MtpHead):
    """DeepSeek-V3's MTP layer: a DeepSeek decoder layer (multi-head latent attention over its own latent
    cache row a token, DeepSeek's MoE)."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        from plait.models.deepseek import DEEPSEEK_STACKED

        super().__init__(cfg, max_positions)
        self.stacked = DEEPSEEK_STACKED
        _, rope_dim, _, kv_lora_rank = mla_dims(cfg)
        self.kv_cache_spec = KVCacheSpec(planes=1, heads=1, width=kv_lora_rank + rope_dim)

    def make_layer(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        from plait.models.deepseek import DeepseekDecoderLayer

        return DeepseekDecoderLayer(cfg, layer_idx)

    def make_rotary(self, cfg: ModelConfig, max_positions: int) -> Rotary:
        return RotaryEmbedding(mla_dims(cfg)[1], max_positions, cfg.rope_theta, cfg.rope_scaling)

    def shard_sizes(self) -> dict[str, list[int]]:
        cfg = self.config
        sizes = {"gate_up_proj": [cfg.intermediate_size] * 2}
        if cfg.moe.shared_intermediate_size:
            sizes["shared_experts.gate_up_proj"] = [cfg.moe.shared_intermediate_size] * 2
        return sizes

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        attn = self.model.layers[0].self_attn
        attn.kv_b_dequantized = None  # made again from what this load brings
        super().load_weights(weights)
        attn.absorb_quantized_kv_b()


def check_mtp_target(target: ModelConfig, model: str, download_dir: str | None = None) -> None:
    """Speculative method "mtp" drafts for GLM-4.5 and DeepSeek-V3 targets from a checkpoint (the target's,
    or the one speculative_config names) with an MTP layer of the target's width: refused by name
    otherwise."""
    from plait.models.eagle import read_head_config

    mtp_head_architecture(target.architecture)
    head_config = read_head_config(model, download_dir)
    if int(head_config.get("num_nextn_predict_layers") or 0) < 1:
        raise ValueError("speculative method 'mtp' drafts with the checkpoint's multi-token-prediction "
                         f"layers; this {target.architecture} checkpoint has none "
                         "(num_nextn_predict_layers is 0)")
    if int(head_config.get("hidden_size", 0)) != target.hidden_size:
        raise ValueError(f"the MTP layer's checkpoint has hidden size {head_config.get('hidden_size')}; the "
                         f"target's is {target.hidden_size}")


def mtp_head_architecture(target_architecture: str) -> str:
    """The MTP head's class for a target (ValueError, by name, for a target plait has no MTP head for)."""
    head = MTP_HEAD_ARCHITECTURES.get(target_architecture)
    if head is None:
        supported = ", ".join(MTP_HEAD_ARCHITECTURES)
        raise ValueError(f"speculative method 'mtp' drafts with the MTP layers of {supported} checkpoints; "
                         f"{target_architecture} is not supported")
    return head
