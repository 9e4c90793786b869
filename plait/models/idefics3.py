"""Idefics3 (Idefics3ForConditionalGeneration: Idefics3-8B-Llama3, SmolVLM) and SmolVLM2
(SmolVLMForConditionalGeneration): each image cut into a grid of square tiles plus the whole image shrunk to
one, each tile through a SigLIP tower (with its post-norm), its patch features pixel-shuffled (scale_factor^2
neighbours folded into one) and projected by one linear layer into the Llama decoder's width. The prompt
holds each tile's placeholders between tile tags (``<fake_token_around_image><row_1_col_1>``...,
``<global-img>``) and newlines, as transformers' Idefics3Processor / SmolVLMProcessor writes them."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from plait.config import ModelConfig
from plait.models.llama import LlamaForCausalLM
from plait.models.llava import VisionTower, embed_with_images
from plait.models.weights import load_image_model_weights
from plait.runner.forward_batch import ForwardBatch

# Idefics3VisionConfig's defaults, for the fields a checkpoint's vision_config leaves out (SmolVLMVisionConfig
# has the same).
VISION_DEFAULTS = dict(hidden_size=1152, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=16,
                       num_channels=3, image_size=224, patch_size=32, hidden_act="gelu_pytorch_tanh",
                       layer_norm_eps=1e-6)
# Idefics3Config's defaults.
DEFAULT_IMAGE_TOKEN_ID = 128257
DEFAULT_SCALE_FACTOR = 2
# The processor's tags around and between an image's tiles (transformers' Idefics3Processor writes these
# strings; SmolVLMProcessor the same, where the tokenizer names no others).
IMAGE_TOKEN = "<image>"
FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TOKEN = "<global-img>"
# The image processor's defaults: tiles of the tower's size, the image first resized so that its longest
# edge is this many tiles (Idefics3: 4 x 364; SmolVLM: 4 x 512), and transformers' cap on that edge.
DEFAULT_TILES_PER_EDGE = 4
MAX_IMAGE_SIZE = 4096
# Checkpoint prefixes of the vision side (transformers 4's and 5's alike) -> the model's.
_VISION_PREFIXES = (("model.vision_model.", "vision_model."), ("model.connector.", "connector."))


def _field(size: Any, key: str) -> int | None:
    """A size setting of an image processor: a dict (transformers 4) or a SizeDict (5)."""
    if size is None:
        return None
    return size.get(key) if isinstance(size, dict) else getattr(size, key, None)


def _rescaled_to(height: int, width: int, longest: int) -> tuple[int, int]:
    """(height, width) with the longest edge made ``longest``, the other kept in proportion and even, then
    kept under MAX_IMAGE_SIZE (transformers' _resize_output_size_rescale_to_max_len, then
    _resize_output_size_scale_below_upper_bound, float steps and all)."""
    aspect = width / height
    if width >= height:
        width = longest
        height = int(width / aspect)
        height += height % 2
    else:
        height = longest
        width = int(height * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def _to_tile_multiples(height: int, width: int, tile: int) -> tuple[int, int]:
    """The (height, width) an image is resized to before it is cut: each edge rounded up to whole tiles, the
    shorter one from the longer one's proportion (transformers' resize_for_vision_encoder)."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


class Idefics3Layout:
    """How an image processor's settings cut an image of a size (height, width): its grid of tiles, its tile
    count, and the text that stands for it in the prompt (ImageProcessor.layout)."""

    def __init__(self, processor: Any, tile: int, seq_len: int) -> None:
        given = _field(getattr(processor, "max_image_size", None), "longest_edge")
        if given is not None and int(given) != tile:
            raise ValueError(f"the image processor's max_image_size ({given}) must be the vision tower's "
                             f"image_size ({tile}): each tile's {seq_len} placeholders are the tower's")
        self.tile, self.seq_len = tile, seq_len
        self.split = bool(getattr(processor, "do_image_splitting", True))
        self.resize = bool(getattr(processor, "do_resize", True))
        size = getattr(processor, "size", None)
        longest = _field(size, "longest_edge")
        fixed = (_field(size, "height"), _field(size, "width"))
        if longest is None and None in fixed and self.resize:
            raise ValueError(f"the image processor's size must give longest_edge or height and width, "
                             f"got {size}")
        self.longest = None if longest is None else int(longest)
        self.fixed = None if None in fixed else (int(fixed[0]), int(fixed[1]))

    def grid(self, size: tuple[int, int]) -> tuple[int, int]:
        """(rows, columns) of tiles an image of ``size`` is cut into; (0, 0): not cut, one tile alone (the
        processor's image splitting off, or an image no larger than a tile)."""
        if not self.split:
            return 0, 0
        height, width = size
        if self.resize:
            height, width = (_rescaled_to(height, width, self.longest) if self.longest is not None
                             else self.fixed)
        height, width = _to_tile_multiples(height, width, self.tile)
        if height > self.tile or width > self.tile:
            return height // self.tile, width // self.tile
        return 0, 0

    def tiles(self, size: tuple[int, int]) -> int:
        """Tiles the processor makes of an image of ``size``: the grid's, then the whole image's."""
        rows, cols = self.grid(size)
        return rows * cols + 1

    def num_placeholders(self, size: tuple[int, int]) -> int:
        """Image tokens of an image of ``size``: each tile's."""
        return self.tiles(size) * self.seq_len

    def prompt_text(self, size: tuple[int, int]) -> str:
        """The text an image of ``size`` stands for (transformers' get_image_prompt_string): each tile's
        placeholders after its tags, a newline after each row of tiles, then the whole image's."""
        rows, cols = self.grid(size)
        placeholders = IMAGE_TOKEN * self.seq_len
        whole = f"{FAKE_TOKEN}{GLOBAL_TOKEN}{placeholders}{FAKE_TOKEN}"
        if rows == 0 and cols == 0:
            return whole
        text = "".join("".join(f"{FAKE_TOKEN}<row_{r + 1}_col_{c + 1}>{placeholders}"
                               for c in range(cols)) + "\n"
                       for r in range(rows))
        return f"{text}\n{whole}"

    def process(self, processor: Any, images: list[Any]) -> dict:
        """The processor's pixel values of ``images``, one sample each ([images, most tiles, C, H, W], fewer
        tiles padded with blank ones), checked against ``grid``: the placeholders plait writes must be the
        tiles the processor made."""
        made = processor(images=[[image] for image in images], return_tensors="pt", return_row_col_info=True)
        for k, image in enumerate(images):
            size = (image.height, image.width)
            grid = (int(made["rows"][k][0]), int(made["cols"][k][0]))
            if grid != self.grid(size):
                raise ValueError(f"the image processor cut a {size[0]}x{size[1]} image into "
                                 f"{grid[0]}x{grid[1]} tiles where plait expected {self.grid(size)}; this "
                                 "processor's settings are not supported")
        mask = made.get("pixel_attention_mask")
        if mask is not None:
            for k, image in enumerate(images):  # every tile whole: the tower runs without a patch mask
                if not bool(mask[k, :self.tiles((image.height, image.width))].all()):
                    raise ValueError("the image processor padded an image's tiles; such tiles are not "
                                     "supported")
        return made


def bucketed_position_ids(side: int) -> torch.Tensor:
    """[side * side] the position id of each patch of a whole tile, as Idefics3VisionEmbeddings computes it:
    each patch's fractional row and column in fp32, bucketed by the 1 / side boundaries (for some sides a
    rounding puts a patch in the bucket before its own, and the trained model reads it so). On the host,
    whatever device the model is built on: the boundaries' fp32 arange steps are summed in double there and
    in fp32 on a GPU, which moves patches of some sides (25 a side: SmolVLM's) into other buckets; the CPU's
    are transformers 4's and vLLM's."""
    host = torch.device("cpu")
    boundaries = torch.arange(1 / side, 1.0, 1 / side, device=host)
    step = 1.0 / torch.tensor(side, device=host)  # fp32, as transformers divides by its patch counts
    coords = torch.clamp(torch.arange(side, dtype=torch.float32, device=host) * step, max=1.0 - 1e-6)
    buckets = torch.bucketize(coords, boundaries, right=True)
    return (buckets[:, None] * side + buckets[None, :]).flatten()


class ModalityProjection(nn.Module):
    """Idefics3SimpleMLP: one linear layer, no bias."""

    def __init__(self, width: int, out: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Connector(nn.Module):
    """Idefics3Connector: each scale x scale block of a tile's patch features folded into one feature
    (pixel shuffle), then projected."""

    def __init__(self, vision_hidden: int, text_hidden: int, scale: int) -> None:
        super().__init__()
        self.scale = scale
        self.modality_projection = ModalityProjection(vision_hidden * scale**2, text_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [tiles, side * side, dim] -> [tiles, side^2 / scale^2, text hidden], transformers' pixel_shuffle
        tiles, seq, dim = x.shape
        side, s = math.isqrt(seq), self.scale
        x = x.reshape(tiles, side, side // s, dim * s).permute(0, 2, 1, 3)
        x = x.reshape(tiles, side // s, side // s, dim * s * s).permute(0, 2, 1, 3)
        return self.modality_projection(x.reshape(tiles, seq // s**2, dim * s * s))


class Idefics3ForConditionalGeneration(LlamaForCausalLM):
    """The Llama decoder with image inputs. ``embed_images`` runs the tower and connector on tiles (all of the
    tower's size, so the runner may capture it in CUDA graphs as LLaVA's); the runner stages a step's
    placeholder embeddings in ``ForwardBatch.image_embeds``, and the tile tags between them keep their own."""

    supports_lora = True  # on the decoder's projections (plait.lora.model.lora_targets)
    supports_images = True

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        raw = cfg.raw
        vision = {**VISION_DEFAULTS, **(raw.get("vision_config") or {})}
        tile, patch = vision["image_size"], vision["patch_size"]
        if not isinstance(tile, int) or not isinstance(patch, int):
            raise ValueError(f"the vision tower's image_size and patch_size must be single numbers, got "
                             f"{tile} and {patch}")
        self.scale = int(raw.get("scale_factor", DEFAULT_SCALE_FACTOR))
        side = tile // patch
        if side % self.scale:
            raise ValueError(f"scale_factor {self.scale} must divide the {side} patches of a tile's side")
        # SigLIP's tower (no class token, a patch embedding with bias) with its post-norm
        self.vision_model = VisionTower({**vision, "model_type": "siglip_vision_model"},
                                        vision["num_hidden_layers"], post_norm=True,
                                        position_ids=bucketed_position_ids(side))
        self.connector = Connector(vision["hidden_size"], cfg.hidden_size, self.scale)
        self.image_token_id = int(raw.get("image_token_id", DEFAULT_IMAGE_TOKEN_ID))
        self.image_size = tile
        self.image_seq_len = side**2 // self.scale**2  # placeholders of one tile

    def image_prompt_layout(self, processor: Any) -> Idefics3Layout:
        """How ``processor`` (an Idefics3 / SmolVLM image processor) cuts an image, and what the prompt holds
        for it."""
        return Idefics3Layout(processor, self.image_size, self.image_seq_len)

    @functools.cached_property
    def _default_layout(self) -> Idefics3Layout:
        return self.image_prompt_layout(self.default_image_processor())

    def num_image_tokens_for(self, size: tuple[int, int]) -> int:
        """Placeholders of an image of ``size`` under the default processor (ImageProcessor counts its own
        processor's, tile tags between them, through image_prompt_layout)."""
        return self._default_layout.num_placeholders(size)

    def num_tiles_for(self, size: tuple[int, int]) -> int:
        """Tiles the default processor makes of an image of ``size``."""
        return self._default_layout.tiles(size)

    @property
    def tile_shape(self) -> tuple[int, int, int]:
        """(channels, size, size): one tile's pixel values, as the vision tower takes them."""
        return self.vision_model.embeddings.patch_embedding.in_channels, self.image_size, self.image_size

    def default_image_processor(self) -> object:
        """The image processor of a folder that ships none (dummy weights): transformers' defaults at this
        tower's tile size, the PIL one, which needs no torchvision."""
        try:
            from transformers.models.idefics3.image_processing_pil_idefics3 import (
                Idefics3ImageProcessorPil as Processor,
            )
        except ImportError:  # an older transformers: its one processor
            from transformers import Idefics3ImageProcessor as Processor

        tile = self.image_size
        return Processor(size={"longest_edge": DEFAULT_TILES_PER_EDGE * tile},
                         max_image_size={"longest_edge": tile})

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values: [tiles, channels, size, size] -> [tiles, image_seq_len, hidden] (model dtype)."""
        return self.connector(self.vision_model.last_hidden_state(pixel_values))

    def pack_image(self, features: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """One image's tiles' features [tiles, image_seq_len, hidden] -> its placeholders' embeddings, in the
        prompt's order (the grid's tiles row by row, then the whole image's: the processor's order too)."""
        return features.flatten(0, 1)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden: [T, hidden]
        return self.model(input_ids, batch, inputs_embeds=embed_with_images(self, input_ids, batch))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The decoder's tensors (model.text_model.*, lm_head) as a Llama's; the tower's and connector's by
        name, each checked."""
        load_image_model_weights(self, weights, ("vision_model.", "connector."), _vision_name)


def _vision_name(name: str) -> str | None:
    for prefix, to in _VISION_PREFIXES:
        if name.startswith(prefix):
            return to + name[len(prefix):]
    return None

