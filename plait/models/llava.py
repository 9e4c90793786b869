"""LLaVA (LlavaForConditionalGeneration: LLaVA-1.5 and LLaVA-Interleave's build;
LlavaNextForConditionalGeneration: LLaVA-NeXT / 1.6): a CLIP or SigLIP vision tower and a two-layer projector
turn each image into embeddings that stand in the prompt for its placeholder tokens; the Llama-family decoder
of the text_config (Llama, Mistral, Qwen2) takes them from there. A LLaVA with a Pixtral tower (pixtral-12b)
is plait.models.pixtral's."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from plait.config import ModelConfig
from plait.models.llama import LlamaForCausalLM
from plait.models.weights import load_image_model_weights
from plait.runner.forward_batch import ForwardBatch

# OpenAI CLIP's pixel statistics: the image processor of a CLIP-tower folder that ships none (a config alone).
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
# transformers' activation names as the vision tower and projector configs give them.
_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}
# A vision config's fields where a checkpoint's config.json leaves them out (transformers' defaults), by its
# model_type: CLIP's (LLaVA-1.5, LLaVA-NeXT) and SigLIP's (LLaVA-Interleave).
_VISION_DEFAULTS = {
    "clip_vision_model": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                              num_attention_heads=12, num_channels=3, image_size=224, patch_size=32,
                              hidden_act="quick_gelu", layer_norm_eps=1e-5),
    "siglip_vision_model": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                num_attention_heads=12, num_channels=3, image_size=224, patch_size=16,
                                hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6),
}
# Checkpoint prefixes of the vision tower and projector (llava-hf's, and as transformers 5 names them),
# longest first -> the model's.
_VISION_PREFIXES = (("model.vision_tower.vision_model.", "vision_tower."),
                    ("vision_tower.vision_model.", "vision_tower."),
                    ("model.vision_tower.", "vision_tower."), ("vision_tower.", "vision_tower."),
                    ("model.multi_modal_projector.", "multi_modal_projector."),
                    ("multi_modal_projector.", "multi_modal_projector."),
                    ("model.image_newline", "image_newline"), ("image_newline", "image_newline"))


def embed_with_images(model: nn.Module, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """An image model's input embeddings [T, hidden]: the tokens' own, the step's staged image embeddings
    (``ForwardBatch.image_embeds``) in place of its placeholders'."""
    embeds = model.model.embed_tokens(input_ids)
    if batch.image_embeds is not None:
        mask, values = batch.image_embeds  # [T] bool, [T, hidden]
        embeds = torch.where(mask[:, None], values, embeds)
    return embeds


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


class VisionTower(nn.Module):
    """CLIP's vision transformer (a class token, a norm before the layers) or SigLIP's (neither, a patch
    embedding with bias), as HF's CLIPVisionModel / SiglipVisionModel name their tensors, run only as far as
    the deepest layer whose output LLaVA reads (SigLIP's post-norm and pooling head are not read). Idefics3's
    tower is SigLIP's with its post-norm (``post_norm``) and its patches' own position ids (``position_ids``
    [patches]: the buckets its embeddings compute, not always 0, 1, ... in fp32)."""

    def __init__(self, cfg: dict, num_layers: int, post_norm: bool = False,
                 position_ids: torch.Tensor | None = None) -> None:
        super().__init__()
        hidden, patch = cfg["hidden_size"], cfg["patch_size"]
        self.image_size, self.patch_size = cfg["image_size"], patch
        self.num_patches = (self.image_size // patch) ** 2
        self.is_clip = cfg["model_type"] == "clip_vision_model"
        self.num_tokens = self.num_patches + self.is_clip  # a tile's hidden states: CLIP's class token first
        self.embeddings = nn.Module()
        if self.is_clip:
            self.embeddings.class_embedding = nn.Parameter(torch.empty(hidden))
        self.embeddings.patch_embedding = nn.Conv2d(cfg["num_channels"], hidden, patch, patch,
                                                    bias=not self.is_clip)
        self.embeddings.position_embedding = nn.Embedding(self.num_tokens, hidden)
        self.pre_layrnorm = nn.LayerNorm(hidden, eps=cfg["layer_norm_eps"]) if self.is_clip else None
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(CLIPEncoderLayer(cfg) for _ in range(num_layers))
        self.post_layernorm = nn.LayerNorm(hidden, eps=cfg["layer_norm_eps"]) if post_norm else None
        # a constant of the config, not a checkpoint tensor (so not persistent), moved with the model; made on
        # the host, it joins the device the model is being built on
        if position_ids is not None:
            position_ids = position_ids.to(torch.get_default_device())
        self.register_buffer("position_ids", position_ids, persistent=False)

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """The hidden states after the embeddings (index 0) and after each layer built.
        pixel_values: [tiles, channels, size, size] -> each [tiles, num_tokens, hidden]."""
        x = self._embed(pixel_values)
        states = [x]
        for layer in self.encoder.layers:
            x = layer(x)
            states.append(x)
        return states

    def last_hidden_state(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """After every layer and the post-norm (Idefics3 reads nothing else, so no earlier state is kept).
        pixel_values: [tiles, channels, size, size] -> [tiles, num_tokens, hidden]."""
        x = self._embed(pixel_values)
        for layer in self.encoder.layers:
            x = layer(x)
        return x if self.post_layernorm is None else self.post_layernorm(x)

    def _embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        emb = self.embeddings
        patches = emb.patch_embedding(pixel_values.to(emb.patch_embedding.weight.dtype))
        x = patches.flatten(2).transpose(1, 2)  # [tiles, patches, hidden]
        if self.is_clip:
            x = torch.cat([emb.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        if self.position_ids is None:
            x = x + emb.position_embedding.weight
        else:
            x = x + emb.position_embedding(self.position_ids)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        return x


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

    supports_lora = True  # on the decoder's projections (plait.lora.model.lora_targets)
    supports_images = True

    def __new__(cls, cfg: ModelConfig | None = None, max_positions: int | None = None) -> nn.Module:
        # A Pixtral tower (pixtral-12b in transformers' format) takes images at their own size, as Mistral 3
        # does: the architecture name alone does not tell the two kinds of LLaVA apart.
        if cls is LlavaForConditionalGeneration and cfg is not None:
            from plait.models.pixtral import PixtralLlavaForConditionalGeneration, has_pixtral_tower

            if has_pixtral_tower(cfg.raw):
                return PixtralLlavaForConditionalGeneration(cfg, max_positions)
        return super().__new__(cls)

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        raw = cfg.raw
        given = raw.get("vision_config") or {}
        kind = given.get("model_type", "clip_vision_model")
        if kind not in _VISION_DEFAULTS:
            raise ValueError(f"a {kind!r} vision tower is not supported; towers: {sorted(_VISION_DEFAULTS)}")
        vision = {**_VISION_DEFAULTS[kind], **given, "model_type": kind}
        layer = raw.get("vision_feature_layer", -2)
        layers = [layer] if isinstance(layer, int) else list(layer)
        # hidden state i is after layer i (0: the embeddings), so layer -2 is the last layer but one
        indices = [i % (vision["num_hidden_layers"] + 1) for i in layers]
        self.feature_indices = indices
        strategy = raw.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy must be 'default' or 'full', got {strategy!r}")
        self.drop_cls = strategy == "default"
        self.vision_tower = VisionTower(vision, max(indices))
        self.multi_modal_projector = LlavaMultiModalProjector(
            vision["hidden_size"] * len(indices), cfg.hidden_size, raw.get("projector_hidden_act", "gelu"),
            raw.get("multimodal_projector_bias", True))
        self.image_token_id = int(raw.get("image_token_id", raw.get("image_token_index", 32000)))
        self.image_size = vision["image_size"]
        # "default" drops each tile's first hidden state (CLIP's class token; a patch of SigLIP's, as
        # transformers does)
        self.num_image_tokens = self.vision_tower.num_tokens - self.drop_cls

    def num_image_tokens_for(self, size: tuple[int, int]) -> int:
        """Placeholders of an image of ``size`` (height, width): one per patch feature of its one tile."""
        return self.num_image_tokens

    def num_tiles_for(self, size: tuple[int, int]) -> int:
        """Tiles the image processor makes of an image of ``size`` (height, width)."""
        return 1

    @property
    def tile_shape(self) -> tuple[int, int, int]:
        """(channels, size, size): one tile's pixel values, as the vision tower takes them."""
        return self.vision_tower.embeddings.patch_embedding.in_channels, self.image_size, self.image_size

    def default_image_processor(self) -> object:
        """The image processor of a folder that ships none (dummy weights): CLIP's or SigLIP's at the tower's
        size."""
        from transformers import CLIPImageProcessor, SiglipImageProcessor

        size = self.image_size
        if not self.vision_tower.is_clip:
            return SiglipImageProcessor(size={"height": size, "width": size})
        return CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size},
                                  image_mean=CLIP_MEAN, image_std=CLIP_STD)

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values: [tiles, channels, size, size] -> [tiles, patch features, hidden] in the model's
        dtype (each tile's features projected, without the CLS token under the "default" strategy)."""
        states = self.vision_tower(pixel_values)
        features = torch.cat([states[i] for i in self.feature_indices], dim=-1)
        if self.drop_cls:
            features = features[:, 1:]
        return self.multi_modal_projector(features)

    def pack_image(self, features: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """One image's tiles' features [tiles, patch features, hidden] -> its placeholders' embeddings
        [num_image_tokens_for(size), hidden]."""
        return features.flatten(0, 1)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden: [T, hidden]
        return self.model(input_ids, batch, inputs_embeds=embed_with_images(self, input_ids, batch))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The decoder's tensors as a Llama's; the vision tower's and projector's by name, each checked; the
        tower's last norm and head, and layers past the deepest one LLaVA reads, skipped (it reads hidden
        states before them)."""
        depth = len(self.vision_tower.encoder.layers)

        def unread(name: str) -> bool:
            return (name.startswith(("vision_tower.post_layernorm.", "vision_tower.head."))
                    or _layer_index(name) >= depth)

        load_image_model_weights(self, weights, ("vision_tower.", "multi_modal_projector.", "image_newline"),
                                 _vision_name, skip=unread)


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    """LLaVA-NeXT (LLaVA-1.6): each image is seen whole at the tower's size and as the tiles of the grid in
    ``image_grid_pinpoints`` that fits it best; the tiles' features are laid out as one picture, the padding
    the resize added cut off, and a learned ``image_newline`` embedding ends each row (transformers'
    LlavaNextForConditionalGeneration.pack_image_features)."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        pinpoints = cfg.raw.get("image_grid_pinpoints") or DEFAULT_GRID_PINPOINTS
        self.grid_pinpoints = [tuple(p) for p in pinpoints]
        self.image_newline = nn.Parameter(torch.empty(cfg.hidden_size))
        self.features_side = self.image_size // self.vision_tower.patch_size  # patch features a tile side

    def _grid(self, size: tuple[int, int]) -> tuple[int, int]:
        """(rows, columns) of tiles for an image of ``size`` (height, width)."""
        height, width = best_resolution(size, self.grid_pinpoints)
        return height // self.image_size, width // self.image_size

    def num_tiles_for(self, size: tuple[int, int]) -> int:
        rows, cols = self._grid(size)
        return 1 + rows * cols  # the whole image first

    def num_image_tokens_for(self, size: tuple[int, int]) -> int:
        rows, cols = self._grid(size)
        side = self.features_side
        height, width = unpadded_shape(size, rows * side, cols * side)
        # the whole image's features first, then the picture with a newline after each row
        return self.num_image_tokens + height * width + height

    def default_image_processor(self) -> object:
        from transformers import LlavaNextImageProcessor

        size = self.image_size
        return LlavaNextImageProcessor(
            size={"shortest_edge": size}, crop_size={"height": size, "width": size},
            image_grid_pinpoints=[list(p) for p in self.grid_pinpoints], image_mean=CLIP_MEAN,
            image_std=CLIP_STD)

    def pack_image(self, features: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        # features: [1 + rows * cols, side * side, hidden] -> [base + unpadded rows * (cols + 1), hidden]
        rows, cols = self._grid(size)
        side, hidden = self.features_side, features.shape[-1]
        base, tiles = features[0], features[1:]
        picture = tiles.view(rows, cols, side, side, hidden).permute(0, 2, 1, 3, 4)
        picture = picture.reshape(rows * side, cols * side, hidden)  # the tiles' features as one picture
        height, width = unpadded_shape(size, rows * side, cols * side)
        top, left = (rows * side - height) // 2, (cols * side - width) // 2
        picture = picture[top:top + height, left:left + width]
        newline = self.image_newline.to(picture.dtype).expand(height, 1, hidden)
        return torch.cat([base, torch.cat([picture, newline], dim=1).flatten(0, 1)])


# transformers' LlavaNextConfig default.
DEFAULT_GRID_PINPOINTS = [(336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008)]


def best_resolution(size: tuple[int, int], candidates: list[tuple[int, int]]) -> tuple[int, int]:
    """The candidate (height, width) that keeps most of an image of ``size`` (height, width) when it is
    scaled to fit inside, wasting least area on ties (transformers' select_best_resolution)."""
    h, w = size
    best, kept_best, wasted_best = candidates[0], -1, float("inf")
    for ch, cw in candidates:
        scale = min(cw / w, ch / h)
        kept = min(int(w * scale) * int(h * scale), w * h)
        wasted = ch * cw - kept
        if kept > kept_best or (kept == kept_best and wasted < wasted_best):
            best, kept_best, wasted_best = (ch, cw), kept, wasted
    return best


def unpadded_shape(size: tuple[int, int], height: int, width: int) -> tuple[int, int]:
    """The (height, width) of an image of ``size`` inside a ``height`` x ``width`` picture it was resized
    to fit and centred in: the padding rows or columns cut off (transformers' unpad_image)."""
    h, w = size
    if w / h > width / height:
        padding = (height - int(round(h * (width / w), 7))) // 2
        return height - 2 * padding, width
    padding = (width - int(round(w * (height / h), 7))) // 2
    return height, width - 2 * padding


def _vision_name(name: str) -> str | None:
    for prefix, to in _VISION_PREFIXES:
        if name.startswith(prefix):
            return to + name[len(prefix):]
    return None


def _layer_index(name: str) -> int:
    """The vision encoder layer a tensor name belongs to; -1 for any other tensor."""
    match = re.match(r"vision_tower\.encoder\.layers\.(\d+)\.", name)
    return int(match[1]) if match else -1
