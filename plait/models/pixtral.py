"""Pixtral's vision encoder and the image-text models that read it, in transformers' format: Mistral 3
(Mistral3ForConditionalGeneration: Mistral-Small-3.1 / 3.2, and the Ministral 3 models' image-text
checkpoints), whose projector merges each 2x2 group of patches into one placeholder, and LLaVA with a
Pixtral tower (LlavaForConditionalGeneration of mistral-community/pixtral-12b: a patch a placeholder).

Each image is seen whole at its own (resized) size, no tiles: the processor resizes it to fit inside
``longest_edge`` in multiples of patch x merge pixels; the encoder embeds its 2D grid of patches (a conv
without bias, an RMSNorm), and its transformer blocks rotate q and k by each patch's (row, column) and let a
patch attend to its own image's patches alone. A prompt's ``[IMG]`` becomes the image's rows of ``[IMG]``
placeholders, each row ended by ``[IMG_BREAK]`` and the last by ``[IMG_END]`` (transformers'
PixtralProcessor); the image's embeddings take the ``[IMG]`` tokens' places, the break and end tokens keep
their own embeddings."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from plait.config import ModelConfig
from plait.models.llama import LlamaForCausalLM
from plait.models.llava import LlavaMultiModalProjector, activation
from plait.models.qwen2_vl import VisionRMSNorm, rotary_span_attention, span_groups
from plait.models.weights import load_image_model_weights
from plait.runner.forward_batch import ForwardBatch

# The encoder's norms' epsilon (transformers hard-codes it in PixtralVisionModel).
PIXTRAL_NORM_EPS = 1e-5
# PixtralVisionConfig's defaults where a checkpoint's vision_config leaves them out.
_VISION_DEFAULTS = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                        num_attention_heads=16, num_channels=3, image_size=1024, patch_size=16,
                        hidden_act="gelu")
DEFAULT_ROPE_THETA = 10000.0
# PixtralProcessor's tokens around an image's placeholders, and their ids in Mistral's tekken vocabulary
# (Pixtral-12B, Mistral-Small-3.1 / 3.2) for a model served without its tokenizer (dummy weights).
IMAGE_BREAK_TOKEN, IMAGE_END_TOKEN = "[IMG_BREAK]", "[IMG_END]"
DEFAULT_IMAGE_BREAK_ID, DEFAULT_IMAGE_END_ID = 12, 13
# Checkpoint prefixes of the image side (transformers 5's names, then the older ones) -> the model's.
_IMAGE_PREFIXES = (("model.vision_tower.", "vision_tower."), ("vision_tower.", "vision_tower."),
                   ("model.multi_modal_projector.", "multi_modal_projector."),
                   ("multi_modal_projector.", "multi_modal_projector."))


class PixtralAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                spans: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        # x: [N, dim] (every image's patches) -> [N, dim]; a patch attends to its own image's alone
        n = x.shape[0]
        q, k, v = (proj(x).view(n, self.num_heads, self.head_dim)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = rotary_span_attention(q, k, v, cos_sin, spans, rotate_in_fp32=False)
        return self.o_proj(out.reshape(n, -1))


class PixtralMLP(nn.Module):
    """down(act(gate(x)) * up(x)), without biases."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PixtralLayer(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        dim = cfg["hidden_size"]
        self.attention_norm = VisionRMSNorm(dim, PIXTRAL_NORM_EPS)
        self.attention = PixtralAttention(dim, cfg["num_attention_heads"])
        self.ffn_norm = VisionRMSNorm(dim, PIXTRAL_NORM_EPS)
        self.feed_forward = PixtralMLP(dim, cfg["intermediate_size"], cfg["hidden_act"])

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                spans: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos_sin, spans)
        return x + self.feed_forward(self.ffn_norm(x))


class PixtralVisionModel(nn.Module):
    """transformers' PixtralVisionModel (its tensors' names), built only as deep as the deepest layer read."""

    def __init__(self, cfg: dict, num_layers: int) -> None:
        super().__init__()
        dim, heads, self.patch = cfg["hidden_size"], cfg["num_attention_heads"], cfg["patch_size"]
        self.channels = cfg["num_channels"]
        self.patch_conv = nn.Conv2d(self.channels, dim, self.patch, self.patch, bias=False)
        self.ln_pre = VisionRMSNorm(dim, PIXTRAL_NORM_EPS)
        self.transformer = nn.Module()
        self.transformer.layers = nn.ModuleList(PixtralLayer(cfg) for _ in range(num_layers))
        # Axial rotary over a whole head: its first quarter of frequencies' pairs turn by the patch's row
        # (the even-indexed frequencies of a 1D rotary over head_dim), the next quarter by its column (the
        # odd-indexed), repeated over both halves (transformers' layout of Pixtral's, whose q / k rows the
        # checkpoint conversion permuted to rotate halves)
        head_dim = dim // heads
        theta = float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta",
                                                                                   DEFAULT_ROPE_THETA)))
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.row_freq, self.col_freq = inv_freq[0::2], inv_freq[1::2]

    def _cos_sin(self, grids: Sequence[tuple[int, int]], device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        # -> each [N, head_dim] fp32, the images' patches row-major one image after another
        rows = torch.cat([torch.arange(h).repeat_interleave(w) for h, w in grids]).to(device)
        cols = torch.cat([torch.arange(w).repeat(h) for h, w in grids]).to(device)
        angles = torch.cat([rows[:, None].float() * self.row_freq.to(device),
                            cols[:, None].float() * self.col_freq.to(device)], dim=-1)  # [N, head_dim / 2]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, images: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
        """Each image's pixels [channels, height, width] (multiples of the patch) -> (the hidden states of
        every image's patches [N, dim], row-major one image after another: after ln_pre (index 0) and after
        each layer built; each image's (rows, columns) of patches)."""
        weight = self.patch_conv.weight
        # one conv an image: the images differ in size (its stride is its kernel, so no padding counts)
        patches = [F.conv2d(image.to(weight.dtype)[None], weight, stride=self.patch)[0] for image in images]
        grids = [(p.shape[1], p.shape[2]) for p in patches]
        x = self.ln_pre(torch.cat([p.flatten(1).t() for p in patches]))  # [N, dim]
        cos_sin = self._cos_sin(grids, x.device)
        spans = span_groups(np.cumsum([0] + [h * w for h, w in grids]).tolist(), x.device)
        states = [x]
        for layer in self.transformer.layers:
            x = layer(x, cos_sin, spans)
            states.append(x)
        return states, grids


class Mistral3PatchMerger(nn.Module):
    """Each merge x merge group of an image's patches -> one: their features side by side (channel, then the
    group's row, then its column: torch's unfold order), through one linear layer."""

    def __init__(self, dim: int, merge: int) -> None:
        super().__init__()
        self.merge = merge
        self.merging_layer = nn.Linear(dim * merge**2, dim, bias=False)

    def forward(self, features: torch.Tensor, grids: Sequence[tuple[int, int]]) -> torch.Tensor:
        # features: [N, dim], each image's patches row-major -> [N / merge^2, dim], its groups row-major
        m, dim = self.merge, features.shape[-1]
        groups = []
        for image, (h, w) in zip(features.split([h * w for h, w in grids]), grids):
            grid = image.view(h // m, m, w // m, m, dim).permute(0, 2, 4, 1, 3)  # [rows, cols, dim, m, m]
            groups.append(grid.reshape(-1, dim * m * m))
        return self.merging_layer(torch.cat(groups))


class Mistral3MultiModalProjector(nn.Module):
    """transformers' Mistral3MultiModalProjector: RMSNorm, the patch merger, linear_1, act, linear_2."""

    def __init__(self, dim: int, text_hidden: int, merge: int, eps: float, act: str, bias: bool) -> None:
        super().__init__()
        self.norm = VisionRMSNorm(dim, eps)
        self.patch_merger = Mistral3PatchMerger(dim, merge)
        self.linear_1 = nn.Linear(dim, text_hidden, bias=bias)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)
        self.act = activation(act)

    def forward(self, features: torch.Tensor, grids: Sequence[tuple[int, int]]) -> torch.Tensor:
        merged = self.patch_merger(self.norm(features), grids)
        return self.linear_2(self.act(self.linear_1(merged)))


def resized_grid(size: tuple[int, int], longest_edge: int, unit: int) -> tuple[int, int]:
    """(rows, columns) of ``unit``-pixel squares of an image of ``size`` (height, width) as
    PixtralImageProcessor resizes it: scaled down (floored) to fit in longest_edge x longest_edge, then each
    side rounded up to whole units (transformers' get_resize_output_image_size)."""
    height, width = size
    ratio = max(height / longest_edge, width / longest_edge)
    if ratio > 1:
        height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
    if min(height, width) < 1:
        raise ValueError(f"an image of {size[0]}x{size[1]} pixels is too thin: scaled to fit in "
                         f"{longest_edge}x{longest_edge} it has no rows or columns left")
    return (height - 1) // unit + 1, (width - 1) // unit + 1


def _longest_edge(processor: Any) -> int | None:
    """A PixtralImageProcessor's size["longest_edge"] (a dict, or transformers 5's SizeDict)."""
    size = getattr(processor, "size", None)
    if isinstance(size, dict):
        return size.get("longest_edge")
    return getattr(size, "longest_edge", None)


class PixtralImageModel(LlamaForCausalLM):
    """The Mistral decoder with images through a Pixtral encoder and a projector (the subclass's ``project``).
    Images of any size: the runner embeds a step's new images in one eager call (``embed_image_list``) and
    stages their placeholders' embeddings in ``ForwardBatch.image_embeds``, of which ``forward`` takes those
    at ``[IMG]`` tokens."""

    supports_lora = True  # on the decoder's projections (plait.lora.model.lora_targets)
    supports_images = True
    variable_size_images = True
    # ImageProcessor: each image cut to its own size out of the processor's padded batch
    images_at_own_size = True
    merge = 1  # patches a placeholder side
    default_feature_layer = -1  # where the config names none (LlavaConfig's default differs)

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        raw = cfg.raw
        given = raw.get("vision_config") or {}
        kind = given.get("model_type", "pixtral")
        if kind != "pixtral":
            raise ValueError(f"{cfg.architecture}: a {kind!r} vision tower is not supported here (a Pixtral "
                             "one is)")
        vision = {**_VISION_DEFAULTS, **given}
        layer = raw.get("vision_feature_layer", self.default_feature_layer)
        layers = [layer] if isinstance(layer, int) else list(layer)
        # hidden state i is after layer i (0: after ln_pre), as transformers' hidden_states
        self.feature_indices = [i % (vision["num_hidden_layers"] + 1) for i in layers]
        self.vision_tower = PixtralVisionModel(vision, max(self.feature_indices))
        self.patch, self.image_size = vision["patch_size"], vision["image_size"]
        self.vision_hidden = vision["hidden_size"]
        self.image_token_id = int(raw.get("image_token_id", raw.get("image_token_index", 10)))

    @property
    def unit(self) -> int:
        """Pixels a placeholder's side: the processor resizes images to multiples of this."""
        return self.patch * self.merge

    @property
    def image_processor_kwargs(self) -> dict[str, Any]:
        """PixtralProcessor calls its image processor with patch x merge as the patch size (the processor's
        preprocessor_config.json names the encoder's patch alone)."""
        return {"patch_size": {"height": self.unit, "width": self.unit}}

    def image_placeholders(self, processor: Any, tokenizer: Any | None
                           ) -> Callable[[tuple[int, int]], list[int]]:
        """The placeholder ids of an image of a (height, width) under ``processor``: PixtralProcessor's rows
        of [IMG] a column of merged patches, each row ended by [IMG_BREAK], the last by [IMG_END]."""
        longest = int(_longest_edge(processor) or self.image_size)
        unit, image = self.unit, self.image_token_id
        brk, end = (self._token_id(tokenizer, name, default) for name, default in
                    ((IMAGE_BREAK_TOKEN, DEFAULT_IMAGE_BREAK_ID), (IMAGE_END_TOKEN, DEFAULT_IMAGE_END_ID)))

        def placeholders(size: tuple[int, int]) -> list[int]:
            rows, cols = resized_grid(size, longest, unit)
            ids = ([image] * cols + [brk]) * rows
            ids[-1] = end
            return ids

        return placeholders

    def _token_id(self, tokenizer: Any | None, token: str, default: int) -> int:
        if tokenizer is None:  # dummy weights: Mistral's own vocabulary
            return default
        token_id = tokenizer.convert_tokens_to_ids(token)
        if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id:
            raise ValueError(f"{self.config.architecture}: the tokenizer has no {token} token, which ends "
                             "rows of image placeholders")
        return token_id

    def num_image_tokens_for(self, size: tuple[int, int]) -> int:
        """Placeholders (with their break and end tokens) of an image of ``size`` at the encoder's size."""
        rows, cols = resized_grid(size, self.image_size, self.unit)
        return rows * (cols + 1)

    def num_tiles_for(self, size: tuple[int, int]) -> int:
        return 1

    def largest_image(self, processor: Any) -> tuple[torch.Tensor, None]:
        """Blank pixels [channels, side, side] of the largest image ``processor`` makes (the runner's memory
        profile runs the encoder on it)."""
        longest = int(_longest_edge(processor) or self.image_size)
        side = -(-longest // self.unit) * self.unit
        return torch.zeros(self.vision_tower.channels, side, side), None

    def default_image_processor(self) -> object:
        """PixtralImageProcessor's defaults at the encoder's size (a folder without its
        preprocessor_config.json); the PIL one where transformers has it, which needs no torchvision."""
        try:
            from transformers.models.pixtral.image_processing_pil_pixtral import (
                PixtralImageProcessorPil as Processor,
            )
        except ImportError:  # an older transformers: its one processor
            from transformers import PixtralImageProcessor as Processor

        return Processor(size={"longest_edge": self.image_size},
                         patch_size={"height": self.patch, "width": self.patch})

    def project(self, features: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        """The encoder's features [N, dim * feature layers] of images of ``grids`` (patches) -> each [IMG]'s
        embedding, image after image, row-major."""
        raise NotImplementedError

    def embed_image_list(self, pixel_values: list[torch.Tensor], grids: list[Any]) -> list[torch.Tensor]:
        """Each image's pixels [channels, height, width] -> its placeholders' embeddings [rows * (columns +
        1), hidden] in the model's dtype: the [IMG] ones the image's; those at [IMG_BREAK] / [IMG_END] zero
        (``forward`` keeps those tokens' own). ``grids``: unused (the pixels' shapes say)."""
        states, patch_grids = self.vision_tower(pixel_values)
        features = torch.cat([states[i] for i in self.feature_indices], dim=-1)
        embeds = self.project(features, patch_grids)
        out, at = [], 0
        for h, w in patch_grids:
            rows, cols = h // self.merge, w // self.merge
            image = embeds[at:at + rows * cols].view(rows, cols, -1)
            at += rows * cols
            breaks = image.new_zeros(rows, 1, image.shape[-1])
            out.append(torch.cat([image, breaks], dim=1).flatten(0, 1))
        return out

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden: [T, hidden]
        embeds = self.model.embed_tokens(input_ids)
        if batch.image_embeds is not None:
            mask, values = batch.image_embeds  # [T] bool, [T, hidden]
            # an image's span holds its break and end tokens too, which keep their own embeddings
            at_image = mask & (input_ids == self.image_token_id)
            embeds = torch.where(at_image[:, None], values, embeds)
        return self.model(input_ids, batch, inputs_embeds=embeds)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The decoder's tensors as a Mistral's (transformers 4's or 5's names); the encoder's and projector's
        by name, each checked; encoder layers past the deepest one read skipped."""
        depth = len(self.vision_tower.transformer.layers)

        def unread(name: str) -> bool:
            parts = name.split(".")
            return parts[:3] == ["vision_tower", "transformer", "layers"] and int(parts[3]) >= depth

        load_image_model_weights(self, weights, ("vision_tower.", "multi_modal_projector."), _image_name,
                                 skip=unread)


class Mistral3ForConditionalGeneration(PixtralImageModel):
    """Mistral-Small-3.1 / 3.2 (and the Ministral 3 image-text checkpoints, whose decoder is ministral3's):
    the Pixtral encoder's features (one layer's) through Mistral3's projector, which merges each
    spatial_merge_size x spatial_merge_size group of patches into one placeholder."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        raw = cfg.raw
        if len(self.feature_indices) != 1:  # its projector normalises one layer's width
            raise ValueError("Mistral3ForConditionalGeneration: a list of vision_feature_layer is not "
                             "supported")
        self.merge = int(raw.get("spatial_merge_size", 2))
        self.multi_modal_projector = Mistral3MultiModalProjector(
            self.vision_hidden, cfg.hidden_size, self.merge, cfg.rms_norm_eps,
            raw.get("projector_hidden_act", "gelu"), raw.get("multimodal_projector_bias", False))

    def project(self, features: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        return self.multi_modal_projector(features, grids)


class PixtralLlavaForConditionalGeneration(PixtralImageModel):
    """LLaVA with a Pixtral tower (mistral-community/pixtral-12b): LLaVA's two-layer projector on every
    patch (no merger), the same placeholders with a patch each."""

    default_feature_layer = -2  # LlavaConfig's

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        raw = cfg.raw
        strategy = raw.get("vision_feature_select_strategy", "default")  # LlavaConfig's default
        if strategy != "full":  # "default" would drop each image's first patch (there is no class token)
            raise ValueError(f"LLaVA with a Pixtral tower: vision_feature_select_strategy {strategy!r} is "
                             "not supported ('full' is)")
        self.multi_modal_projector = LlavaMultiModalProjector(
            self.vision_hidden * len(self.feature_indices), cfg.hidden_size,
            raw.get("projector_hidden_act", "gelu"), raw.get("multimodal_projector_bias", True))

    def project(self, features: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        return self.multi_modal_projector(features)


def _image_name(name: str) -> str | None:
    for prefix, to in _IMAGE_PREFIXES:
        if name.startswith(prefix):
            return to + name[len(prefix):]
    return None


def has_pixtral_tower(raw: dict) -> bool:
    """Whether an image-text config's vision tower is Pixtral's."""
    return (raw.get("vision_config") or {}).get("model_type") == "pixtral"

