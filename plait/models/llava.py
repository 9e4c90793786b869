"""LLaVA (LlavaForConditionalGeneration: LLaVA-1.5 and checkpoints built like it): a CLIP vision tower and a
two-layer projector turn each image into embeddings that stand in the prompt for its placeholder tokens; the
Llama decoder takes them from there."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from plait.config import ModelConfig
from plait.models.llama import LlamaForCausalLM
from plait.models.weights import language_model_name, load_decoder_weights
from plait.runner.forward_batch import ForwardBatch

# transformers' activation names as the vision tower and projector configs give them.
_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}
# The CLIP vision config's fields where a checkpoint's config.json leaves them out (transformers' defaults).
_CLIP_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                      num_channels=3, image_size=224, patch_size=32, hidden_act="quick_gelu",
                      layer_norm_eps=1e-5)
# Checkpoint prefixes of the vision tower and projector (llava-hf's, and as transformers 5 names them),
# longest first -> the model's.
_VISION_PREFIXES = (("model.vision_tower.vision_model.", "vision_tower."),
                    ("vision_tower.vision_model.", "vision_tower."),
                    ("model.vision_tower.", "vision_tower."), ("vision_tower.", "vision_tower."),
                    ("model.multi_modal_projector.", "multi_modal_projector."),
                    ("multi_modal_projector.", "multi_modal_projector."))


def activation(name: str):
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class CLIPAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden // num_heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [images, patches + 1, hidden]; every patch sees every other (no mask)
        b, n, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # -> [images, heads, patches + 1, head_dim]
            return t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg["layer_norm_eps"]
        self.self_attn = CLIPAttention(hidden, cfg["num_attention_heads"])
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps)
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(hidden, cfg["intermediate_size"])
        self.mlp.fc2 = nn.Linear(cfg["intermediate_size"], hidden)
        self.act = activation(cfg["hidden_act"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp.fc2(self.act(self.mlp.fc1(self.layer_norm2(x))))


class CLIPVisionTower(nn.Module):
    """CLIP's vision transformer (HF CLIPVisionModel), run only as far as the deepest layer whose output
    LLaVA reads."""

    def __init__(self, cfg: dict, num_layers: int) -> None:
        super().__init__()
        hidden, patch = cfg["hidden_size"], cfg["patch_size"]
        self.image_size = cfg["image_size"]
        self.num_patches = (self.image_size // patch) ** 2
        self.embeddings = nn.Module()
        self.embeddings.class_embedding = nn.Parameter(torch.empty(hidden))
        self.embeddings.patch_embedding = nn.Conv2d(cfg["num_channels"], hidden, patch, patch, bias=False)
        self.embeddings.position_embedding = nn.Embedding(self.num_patches + 1, hidden)
        self.pre_layrnorm = nn.LayerNorm(hidden, eps=cfg["layer_norm_eps"])
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(CLIPEncoderLayer(cfg) for _ in range(num_layers))

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """The hidden states after the embeddings (index 0) and after each layer built.
        pixel_values: [images, channels, size, size] -> each [images, patches + 1, hidden]."""
        emb = self.embeddings
        patches = emb.patch_embedding(pixel_values.to(emb.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)  # [images, patches, hidden]
        cls = emb.class_embedding.expand(patches.shape[0], 1, -1)
        x = self.pre_layrnorm(torch.cat([cls, patches], dim=1) + emb.position_embedding.weight)
        states = [x]
        for layer in self.encoder.layers:
            x = layer(x)
            states.append(x)
        return states


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, vision_width: int, text_hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(vision_width, text_hidden, bias=bias)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """The Llama decoder with image inputs. ``embed_images`` runs the vision tower and projector; the runner
    stages a step's image embeddings in ``ForwardBatch.image_embeds`` (static buffers, so graphs replay image
    steps too), which replace the placeholder tokens' own embeddings before the first layer."""

    supports_lora = False
    supports_images = True

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        raw = cfg.raw
        vision = {**_CLIP_DEFAULTS, **(raw.get("vision_config") or {})}
        layer = raw.get("vision_feature_layer", -2)
        self.feature_layers = [layer] if isinstance(layer, int) else list(layer)
        num_vision_layers = vision["num_hidden_layers"]
        # hidden state i is after layer i (0: the embeddings), so layer -2 is the last layer but one
        indices = [i % (num_vision_layers + 1) for i in self.feature_layers]
        self.feature_indices = indices
        self.drop_cls = raw.get("vision_feature_select_strategy", "default") == "default"
        if raw.get("vision_feature_select_strategy", "default") not in ("default", "full"):
            raise ValueError("vision_feature_select_strategy must be 'default' or 'full', got "
                             f"{raw.get('vision_feature_select_strategy')!r}")
        self.vision_tower = CLIPVisionTower(vision, max(indices))
        self.multi_modal_projector = LlavaMultiModalProjector(
            vision["hidden_size"] * len(indices), cfg.hidden_size, raw.get("projector_hidden_act", "gelu"),
            raw.get("multimodal_projector_bias", True))
        self.image_token_id = int(raw.get("image_token_id", raw.get("image_token_index", 32000)))
        self.image_size = vision["image_size"]
        self.num_image_tokens = self.vision_tower.num_patches + (0 if self.drop_cls else 1)

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values: [images, channels, size, size] -> [images, num_image_tokens, hidden] in the model's
        dtype."""
        states = self.vision_tower(pixel_values)
        features = torch.cat([states[i] for i in self.feature_indices], dim=-1)
        if self.drop_cls:
            features = features[:, 1:]
        return self.multi_modal_projector(features)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden: [T, hidden]
        embeds = self.model.embed_tokens(input_ids)
        if batch.image_embeds is not None:
            mask, values = batch.image_embeds  # [T] bool, [T, hidden]
            embeds = torch.where(mask[:, None], values, embeds)
        return self.model(input_ids, batch, inputs_embeds=embeds)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The decoder's tensors as a Llama's; the vision tower's and projector's by name, each checked."""
        own = dict(self.named_parameters())
        vision_names = {n for n in own if n.startswith(("vision_tower.", "multi_modal_projector."))}
        loaded: set[str] = set()

        def decoder(stream):
            for name, tensor in stream:
                renamed = _vision_name(name)
                if renamed is None:
                    if language_model_name(name) is not None:
                        yield language_model_name(name), tensor
                    continue
                if renamed.startswith("vision_tower.post_layernorm."):
                    continue  # LLaVA reads hidden states before it
                if renamed not in own:
                    if _layer_index(renamed) >= len(self.vision_tower.encoder.layers):
                        continue  # layers past the deepest one LLaVA reads
                    raise ValueError(f"unexpected tensor {name!r} in a LLaVA checkpoint")
                if own[renamed].shape != tensor.shape:
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match "
                                     f"{tuple(own[renamed].shape)}")
                with torch.no_grad():
                    own[renamed].copy_(tensor)
                loaded.add(renamed)

        load_decoder_weights(self, decoder(weights), not_in_checkpoint=frozenset(vision_names))
        missing = vision_names - loaded
        if missing:
            raise ValueError(f"the checkpoint lacks vision tensors: {sorted(missing)[:5]}")


def _vision_name(name: str) -> str | None:
    for prefix, to in _VISION_PREFIXES:
        if name.startswith(prefix):
            return to + name[len(prefix):]
    return None


def _layer_index(name: str) -> int:
    """The vision encoder layer a tensor name belongs to; -1 for any other tensor."""
    match = re.match(r"vision_tower\.encoder\.layers\.(\d+)\.", name)
    return int(match[1]) if match else -1
