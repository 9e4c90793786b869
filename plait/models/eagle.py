"""EAGLE draft heads: one Llama decoder layer that drafts from the target model's hidden states (EAGLE-1) or
from three of its layers' residual streams (EAGLE-3), run by plait.engine.eagle.EagleDrafter."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from plait.attention.base import Rotary
from plait.config import ModelConfig
from plait.layers.linear import Linear, logits_fp32
from plait.layers.norm import RMSNorm
from plait.layers.rotary import rotary_embedding
from plait.models.base import CausalLM
from plait.models.llama import Attention, DecoderLayer
from plait.models.weights import STACKED_PROJECTIONS, decoder_shard_sizes, load_checked
from plait.runner.forward_batch import ForwardBatch

# Names the EAGLE checkpoints give their tensors -> the head's own (EAGLE-3's single layer is "midlayer").
_EAGLE3_LAYER_PREFIX = ("midlayer.", "layers.0.")
# Tensors an EAGLE checkpoint may leave out, shared from the target model instead (as vLLM does).
SHARED_WITH_TARGET = ("model.embed_tokens.weight", "lm_head.weight")


class EagleHead(CausalLM):
    """What the drafter needs of an EAGLE head: feature buffers that steps read and write (static, so CUDA
    graphs replay them), and the target's embedding (and LM head) where the checkpoint has none."""

    # The target's tensors this head may take where its checkpoint has none.
    shareable: tuple[str, ...] = SHARED_WITH_TARGET

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        # Set by allocate_feature_buffers once the runner knows a step's most tokens; None before (the
        # runner's profiling step reads zeros).
        self.features_in: torch.Tensor | None = None  # [max_tokens, hidden]: each token's input feature
        self.features_out: torch.Tensor | None = None  # [max_tokens, hidden]: the next position's input
        self.loaded: set[str] = set()  # checkpoint tensors load_weights took (the rest may be shared)

    def allocate_feature_buffers(self, max_tokens: int) -> None:
        """The static buffers a step's features go through (ModelRunner calls this before any capture)."""
        weight = self.model.norm_like_weight()
        shape = (max_tokens, self.config.hidden_size)
        self.features_in = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        self.features_out = torch.zeros(shape, dtype=weight.dtype, device=weight.device)

    def share_target(self, target: nn.Module) -> None:
        """Take the target's embedding (and LM head) where the checkpoint had none."""
        if "model.embed_tokens.weight" not in self.loaded and "model.embed_tokens.weight" in self.shareable:
            self.model.embed_tokens = target.model.embed_tokens
        if "lm_head.weight" not in self.loaded and "lm_head.weight" in self.shareable:
            self.lm_head = target.lm_head

    def combine_features(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features as the head's input (EAGLE-3 fuses its three layers' here)."""
        return features

    def _input_features(self, num_tokens: int, like: torch.Tensor) -> torch.Tensor:
        if self.features_in is None:  # the runner's profiling step, before the buffers exist
            return torch.zeros_like(like)
        return self.features_in[:num_tokens]

    def _output_features(self, features: torch.Tensor) -> None:
        if self.features_out is not None:
            self.features_out[: features.shape[0]].copy_(features)

    def _load(self, weights: Iterable[tuple[str, torch.Tensor]], rename,
              stacked: dict[str, tuple[str, int]] = STACKED_PROJECTIONS,
              shard_sizes: dict[str, list[int]] | None = None) -> None:
        names: list[str] = []

        def tracked() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                renamed = rename(name)
                if renamed is not None:
                    names.append(renamed)
                    yield renamed, tensor

        sizes = decoder_shard_sizes(self.config) if shard_sizes is None else shard_sizes
        load_checked(self, tracked(), stacked, sizes, not_in_checkpoint=frozenset(self.shareable))
        self.loaded = set(names)


class _EagleTrunk(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary: Rotary = rotary_embedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling,
                                               cfg.partial_rotary_factor)

    def norm_like_weight(self) -> torch.Tensor:
        return self.layers[0].post_attention_layernorm.weight


class _Eagle1Trunk(_EagleTrunk):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        # The token's embedding beside the target's feature, projected back to the hidden size.
        self.fc = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=bool(cfg.raw.get("eagle_fc_bias")))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        # EAGLE-1 feeds the projection straight in: the first layer has no input norm.
        self.layers[0].input_layernorm = nn.Identity()


class EagleLlamaForCausalLM(EagleHead):
    """EAGLE-1 (yuhuili/EAGLE-LLaMA3-Instruct-8B and the like, vLLM's EagleLlamaForCausalLM): position p takes
    the next token's embedding and the target's last hidden state (after its final norm) at p, and predicts
    the target's hidden state at p + 1, read through the target's LM head (no norm of its own). Its next
    draft's feature is that prediction."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__(cfg)
        self.model = _Eagle1Trunk(cfg, max_positions)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # input_ids: [T] -> hidden: [T, hidden] (also left in features_out for the next draft)
        trunk = self.model
        embeds = trunk.embed_tokens(input_ids)  # [T, hidden]
        x = trunk.fc(torch.cat([embeds, self._input_features(len(input_ids), embeds)], dim=-1))
        residual = None
        for layer in trunk.layers:
            x, residual = layer(x, residual, trunk.rotary, batch)
        x = x + residual
        self._output_features(x)
        return x

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def rename(name: str) -> str | None:
            if name == "layers.0.input_layernorm.weight":
                return None  # EAGLE-1's first layer reads the projection unnormed
            return name if name.startswith("lm_head.") else f"model.{name}"

        self._load(weights, rename)


class Eagle3Layer(DecoderLayer):
    """EAGLE-3's layer: attention over the normed token embedding beside the normed feature (2 x hidden in),
    the feature carrying the residual stream."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        attn: Attention = self.self_attn
        attn.qkv_proj = Linear(2 * cfg.hidden_size, attn.q_size + 2 * attn.kv_size, bias=cfg.attention_bias)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Checkpoints trained to norm the feature before it becomes the residual (speculators' option).
        self.norm_before_residual = bool(cfg.raw.get("norm_before_residual"))

    def forward_eagle(self, embeds: torch.Tensor, features: torch.Tensor, rotary: Rotary, batch: ForwardBatch
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        # embeds, features: [T, hidden] -> (the MLP's output, the residual stream before it)
        normed = self.hidden_norm(features)
        residual = normed if self.norm_before_residual else features
        attn = self.self_attn
        qkv = attn.qkv_proj(torch.cat([self.input_layernorm(embeds), normed], dim=-1))
        x, residual = self.post_attention_layernorm.forward_residual(
            attn.o_proj(attn.attend(qkv, rotary, batch)), residual)
        return self.mlp(x), residual


class _Eagle3Trunk(_EagleTrunk):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        if cfg.num_hidden_layers != 1:
            raise ValueError(f"EAGLE-3 heads have one layer; this config has {cfg.num_hidden_layers}")
        target_hidden = int(cfg.raw.get("target_hidden_size") or cfg.hidden_size)
        # The target's three layers' residual streams, fused into one feature.
        self.fc = Linear(3 * target_hidden, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(cfg, 0)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Eagle3LlamaForCausalLM(EagleHead):
    """EAGLE-3 (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, RedHatAI's speculators, vLLM's Eagle3LlamaForCausalLM):
    the feature is the target's residual stream at three layers (EagleDrafter taps them), fused by ``fc``;
    the head normalises its output and reads it through its own LM head over a draft vocabulary, whose ids map
    to the target's through ``d2t`` (target id = draft id + d2t[draft id]). Its next draft's feature is its
    output before that norm."""

    shareable = ("model.embed_tokens.weight",)

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__(cfg)
        self.model = _Eagle3Trunk(cfg, max_positions)
        self.draft_vocab_size = int(cfg.raw.get("draft_vocab_size") or cfg.vocab_size)
        self.lm_head = Linear(cfg.hidden_size, self.draft_vocab_size, bias=False)
        # [draft vocab] int64: target id - draft id (zeros: the draft vocabulary is the target's first ids)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long), persistent=False)
        # Whether a draft id differs from its target id (decided at load: compute_logits never syncs).
        self.maps_ids = self.draft_vocab_size != cfg.vocab_size

    def combine_features(self, features: torch.Tensor) -> torch.Tensor:
        # features: [n, 3 x target hidden] -> [n, hidden]
        return self.model.fc(features)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # input_ids: [T] -> hidden (normed): [T, hidden]; the pre-norm output is left in features_out
        trunk = self.model
        embeds = trunk.embed_tokens(input_ids)
        features = self._input_features(len(input_ids), embeds)
        x, residual = trunk.layers[0].forward_eagle(embeds, features, trunk.rotary, batch)
        normed, prenorm = trunk.norm.forward_residual(x, residual)
        self._output_features(prenorm)
        return normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [S, hidden] -> [S, target vocab] fp32: the draft vocabulary's logits at their target
        # ids, the rest -inf (never drafted)
        draft = logits_fp32(hidden, self.lm_head.weight)  # [S, draft vocab]
        if not self.maps_ids:
            return draft
        target_ids = torch.arange(self.draft_vocab_size, device=draft.device) + self.d2t
        logits = draft.new_full((draft.shape[0], self.config.vocab_size), float("-inf"))
        logits[:, target_ids] = draft
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def rename(name: str) -> str | None:
            if name == "t2d":
                return None  # the inverse map, a mask over the target vocabulary: d2t says it all
            if name == "lm_head.weight":
                return name
            old, new = _EAGLE3_LAYER_PREFIX
            return "model." + (new + name[len(old):] if name.startswith(old) else name)

        def without_d2t() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name == "d2t":
                    if tensor.shape != self.d2t.shape:
                        raise ValueError(f"d2t has shape {tuple(tensor.shape)}; the head's draft vocabulary "
                                         f"is {self.draft_vocab_size}")
                    self.d2t.copy_(tensor.to(torch.long))
                    self.maps_ids = self.maps_ids or bool(tensor.any())
                    continue
                yield name, tensor

        self._load(without_d2t(), rename)


def aux_layer_ids(draft_raw: dict, target_num_layers: int) -> tuple[int, ...]:
    """The target layers whose input (the residual stream after the layers before) EAGLE-3 reads: the draft
    config's ``eagle_config.eagle_aux_hidden_state_layer_ids``, else vLLM's default (2, L // 2, L - 3)."""
    given = (draft_raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ids = tuple(int(i) for i in given) if given else (2, target_num_layers // 2, target_num_layers - 3)
    if len(ids) != 3 or not all(0 <= i < target_num_layers for i in ids):
        raise ValueError(f"EAGLE-3 reads three of the target's {target_num_layers} layers; got layers {ids}")
    return ids


def read_head_config(model: str, download_dir: str | None = None) -> dict:
    """An EAGLE head's config.json (an HF folder, or a Hub id in the local cache)."""
    from plait.loader.hf import read_hf_config, resolve_model

    source = resolve_model(model, None, download_dir)
    if source.kind != "hf":
        raise ValueError(f"an EAGLE head is an HF folder (config.json + safetensors); {model!r} is not")
    return read_hf_config(source.path)


def check_eagle_target(model: nn.Module, cfg: ModelConfig) -> None:
    """EAGLE heads draft for models of the Llama decoder's layers, whose inputs the drafter taps: refused, by
    architecture, for the others and for image models (their placeholder tokens are not what the head saw)."""
    from plait.models.llama import LlamaModel

    trunk = getattr(model, "model", None)
    if (not isinstance(trunk, LlamaModel) or getattr(model, "supports_images", False)
            or not all(type(layer).forward is DecoderLayer.forward for layer in trunk.layers)):
        raise ValueError(f"EAGLE speculation drafts for models whose layers are the Llama decoder's (Llama, "
                         f"Mistral, Qwen2/3, GPT-OSS); {cfg.architecture} is not supported")
