"""Qwen2-VL (Qwen2VLForConditionalGeneration) and Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration): a ViT
over 14x14 patches of images of any size (a 3D conv over temporal_patch_size repeated frames, 2D rotary in its
attention), whose 2x2 neighbouring patches a PatchMerger folds into one embedding per placeholder, and the
Qwen2 decoder with M-RoPE: each token has (temporal, height, width) positions, an image's placeholders their
grid's, and the rotary's frequency bands are split among the three (``mrope_section``). Qwen2.5-VL's encoder
has RMSNorm, a SwiGLU MLP and attends within windows in all blocks but ``fullatt_block_indexes``. Images
only: video inputs are refused."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from plait.config import ModelConfig
from plait.layers.rotary import MRopeRotary, mrope_columns
from plait.models.llama import LlamaForCausalLM
from plait.models.llava import activation, embed_with_images
from plait.models.weights import language_model_name, load_image_model_weights
from plait.runner.forward_batch import ForwardBatch

# The vision encoder's norms' epsilon (transformers hard-codes it).
VISION_NORM_EPS = 1e-6
# Qwen2VLImageProcessor's defaults: the pixel range an image is resized into, and CLIP's statistics.
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280
# transformers' smart_resize refuses images thinner than this.
MAX_ASPECT_RATIO = 200
# Qwen2VLConfig's default ids of <|vision_start|> and <|vision_end|>, for a config that leaves them out.
DEFAULT_VISION_START_ID, DEFAULT_VISION_END_ID = 151652, 151653
# Checkpoint prefixes of the vision encoder (transformers 5's, then the Hub's older ones) -> the model's.
_VISION_PREFIXES = (("model.visual.", "visual."), ("visual.", "visual."))

Grid = tuple[int, int, int]  # (temporal, height, width) in patches
# Spans of equal length, attended in one batched call: (length, [spans] first rows on the device).
SpanGroups = list[tuple[int, torch.Tensor]]


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) Qwen2VLImageProcessor resizes an image to: multiples of ``factor`` (patch x merge)
    nearest its own, scaled to hold between min_pixels and max_pixels (transformers' smart_resize)."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"an image's aspect ratio must be under {MAX_ASPECT_RATIO}, got {height}x{width}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _pixel_bounds(processor: object, defaults: tuple[int, int] = (DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS)
                  ) -> tuple[int, int]:
    """(min_pixels, max_pixels) of a Qwen2VLImageProcessor (transformers 5 keeps them in ``size``);
    ``defaults`` where it has none (no processor: the model's defaults)."""
    size = getattr(processor, "size", None) or {}
    low = size.get("shortest_edge", getattr(processor, "min_pixels", None) or defaults[0])
    high = size.get("longest_edge", getattr(processor, "max_pixels", None) or defaults[1])
    return int(low), int(high)


class VisionRMSNorm(nn.Module):
    """Qwen2.5-VL's vision RMSNorm: normalised in fp32, cast back, then scaled (transformers' order)."""

    def __init__(self, dim: int, eps: float = VISION_NORM_EPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                spans: SpanGroups) -> torch.Tensor:
        # x: [N, dim]; cos, sin: [N, head_dim] fp32; a patch sees the patches of its span alone (an image's
        # frame, or a window), no mask
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)  # each [N, heads, head_dim]
        return self.proj(rotary_span_attention(q, k, v, cos_sin, spans).reshape(n, -1))


def rotary_span_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          cos_sin: tuple[torch.Tensor, torch.Tensor], spans: SpanGroups,
                          rotate_in_fp32: bool = True) -> torch.Tensor:
    """A vision encoder's attention (Qwen2-VL's, Pixtral's): q and k rotated by their patches' 2D angles,
    then each patch attends to the patches of its span alone (an image, a frame or a window; no mask).
    q, k, v: [N, heads, head_dim]; cos, sin: [N, head_dim] fp32 -> [N, heads, head_dim]."""
    cos, sin = (t[:, None] for t in cos_sin)
    if rotate_in_fp32:  # Qwen-VL's, as transformers rotates them, then back to the activations' dtype
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(v.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(v.dtype)
    else:  # Pixtral's transformers rotates in the activations' dtype, the angles' cos / sin cast to it
        cos, sin = cos.to(v.dtype), sin.to(v.dtype)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    out = torch.empty_like(q)
    for length, starts in spans:
        rows = starts[:, None] + torch.arange(length, device=starts.device)  # [spans, length]
        # -> [spans, heads, length, head_dim]: every span of this length in one call
        part = F.scaled_dot_product_attention(*(t[rows].transpose(1, 2) for t in (q, k, v)))
        out[rows] = part.transpose(1, 2)
    return out


class VisionMLP(nn.Module):
    """Qwen2-VL's fc1 / act / fc2."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionGatedMLP(nn.Module):
    """Qwen2.5-VL's SwiGLU: down(act(gate(x)) * up(x)), with biases."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp: nn.Module, norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.norm1, self.norm2 = norm(dim), norm(dim)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                spans: SpanGroups) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos_sin, spans)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each merge x merge group of neighbouring patches (consecutive rows, the encoder's order) -> one
    embedding of the decoder's width: norm, then Linear / GELU / Linear over the group's concatenation."""

    def __init__(self, out_dim: int, dim: int, merge: int, norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.group = dim * merge**2
        self.ln_q = norm(dim)
        self.mlp = nn.Sequential(nn.Linear(self.group, self.group), nn.GELU(), nn.Linear(self.group, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, dim] -> [N / merge^2, out_dim]
        return self.mlp(self.ln_q(x).view(-1, self.group))


def vision_positions(grid: Grid, merge: int) -> torch.Tensor:
    """[t h w, 2] (row, column) of each patch in the encoder's order: merge x merge blocks, row-major
    within each, the blocks row-major (the processor lays the patches out so)."""
    t, h, w = grid
    rows = torch.arange(h)[:, None].expand(h, w)
    cols = torch.arange(w)[None, :].expand(h, w)
    shape = (h // merge, merge, w // merge, merge)
    rows, cols = (a.reshape(shape).transpose(1, 2).flatten() for a in (rows, cols))
    return torch.stack([rows, cols], dim=-1).repeat(t, 1)


def span_groups(bounds: Sequence[int], device: torch.device) -> SpanGroups:
    """Spans [bounds[i], bounds[i + 1]) grouped by length: a window attention's many equal windows (all but
    those cut at an image's edges) run as one batch."""
    by_length: dict[int, list[int]] = {}
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        by_length.setdefault(hi - lo, []).append(lo)
    return [(length, torch.tensor(starts, device=device)) for length, starts in by_length.items() if length]


def window_order(grids: Sequence[Grid], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows: (the merged groups' order that puts each window's together [groups], the
    windows' patch bounds in that order). A window is ``window`` x ``window`` merged groups of one frame;
    those at the right and bottom edges are cut short (transformers' get_vision_window_index)."""
    order, bounds, first = [], [0], 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        nh, nw = -(-gh // window), -(-gw // window)
        padded = F.pad(index, (0, nw * window - gw, 0, nh * window - gh), value=-1)
        windows = padded.reshape(t, nh, window, nw, window).permute(0, 1, 3, 2, 4).reshape(-1, window**2)
        for cells in windows:
            kept = cells[cells >= 0]
            if len(kept):
                order.append(kept + first)
                bounds.append(bounds[-1] + len(kept) * merge**2)
        first += t * gh * gw
    return torch.cat(order), bounds


def _vision_norm(qwen25: bool) -> Callable[[int], nn.Module]:
    """The encoder's norm of a width: Qwen2.5-VL's RMSNorm, Qwen2-VL's LayerNorm."""
    if qwen25:
        return VisionRMSNorm
    return functools.partial(nn.LayerNorm, eps=VISION_NORM_EPS)


def _vision_mlp(cfg: dict, dim: int, qwen25: bool) -> nn.Module:
    """A block's MLP: Qwen2.5-VL's SwiGLU of intermediate_size, Qwen2-VL's of mlp_ratio x dim."""
    if qwen25:
        return VisionGatedMLP(dim, cfg["intermediate_size"], cfg["hidden_act"])
    return VisionMLP(dim, int(dim * cfg["mlp_ratio"]), cfg["hidden_act"])


class VisionTransformer(nn.Module):
    """The vision encoder, named as transformers' Qwen2VisionTransformerPretrainedModel /
    Qwen2_5_VisionTransformerPretrainedModel name their tensors."""

    def __init__(self, cfg: dict, qwen25: bool) -> None:
        super().__init__()
        dim = cfg["hidden_size"] if qwen25 else cfg["embed_dim"]
        out_dim = cfg["out_hidden_size"] if qwen25 else cfg["hidden_size"]
        self.patch, self.temporal = cfg["patch_size"], cfg["temporal_patch_size"]
        self.merge, self.channels = cfg["spatial_merge_size"], cfg["in_channels"]
        heads = cfg["num_heads"]
        self.qwen25 = qwen25
        # Qwen2.5-VL: window attention but in these blocks; the window's side in merged groups
        self.full_blocks = frozenset(cfg.get("fullatt_block_indexes") or ()) if qwen25 else None
        self.window = cfg["window_size"] // self.merge // self.patch if qwen25 else 0
        self.patch_embed = nn.Module()
        kernel = (self.temporal, self.patch, self.patch)
        self.patch_embed.proj = nn.Conv3d(self.channels, dim, kernel, kernel, bias=False)
        theta = float((cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        spatial = dim // heads // 2  # each of row and column turns a quarter of a head's channels
        self.inv_freq = 1.0 / theta ** (torch.arange(0, spatial, 2, dtype=torch.float32) / spatial)
        norm = _vision_norm(qwen25)
        self.blocks = nn.ModuleList(VisionBlock(dim, heads, _vision_mlp(cfg, dim, qwen25), norm)
                                    for _ in range(cfg["depth"]))
        self.merger = PatchMerger(out_dim, dim, self.merge, norm)

    @property
    def patch_dim(self) -> int:
        """Values of one flattened patch, as the processor writes it: channels x temporal x patch x patch."""
        return self.channels * self.temporal * self.patch**2

    def _cos_sin(self, grids: Sequence[Grid], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # -> each [N, head_dim] fp32: the row's angles, then the column's, the pair repeated over both halves
        pos = torch.cat([vision_positions(g, self.merge) for g in grids]).to(device)  # [N, 2]
        angles = (pos[..., None].float() * self.inv_freq.to(device)).flatten(1)  # [N, head_dim / 2]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        """pixel_values: [N, patch_dim] (every image's patches, in order); grids: each image's (t, h, w) ->
        [N / merge^2, out_dim] in the decoder's dtype: each image's placeholders' embeddings, in order."""
        # The conv's stride is its kernel, so it is one matmul over each flattened patch (the processor's
        # channel, frame, row, column order is the kernel's), without a cuDNN 3D conv.
        weight = self.patch_embed.proj.weight  # [dim, channels, temporal, patch, patch]
        x = F.linear(pixel_values.to(weight.dtype), weight.flatten(1))  # [N, dim]
        cos, sin = self._cos_sin(grids, x.device)
        frames = np.cumsum([0] + [h * w for t, h, w in grids for _ in range(t)]).tolist()  # each frame alone
        full = span_groups(frames, x.device)
        order = windows = None
        if self.qwen25:
            order, bounds = window_order(grids, self.merge, self.window)
            order, windows = order.to(x.device), span_groups(bounds, x.device)
            x, cos, sin = (self._grouped(a, order) for a in (x, cos, sin))
        for i, block in enumerate(self.blocks):
            windowed = self.qwen25 and i not in self.full_blocks
            x = block(x, (cos, sin), windows if windowed else full)
        merged = self.merger(x)  # [N / merge^2, out_dim]
        if order is not None:  # back to the images' own order
            merged = merged[torch.argsort(order)]
        return merged

    def _grouped(self, x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """x's rows taken in merged groups (merge^2 consecutive rows each) in ``order``."""
        unit = self.merge**2
        return x.view(-1, unit, x.shape[-1])[order].view(-1, x.shape[-1])


def mrope_prompt_positions(token_ids: Sequence[int], images: Sequence, merge: int
                           ) -> tuple[np.ndarray, int]:
    """(the prompt's M-RoPE positions [3, len(token_ids)], the delta that later tokens add to their
    position): text runs on from the last position + 1 on all three; an image's placeholders take
    (start, start + row, start + column) of its merged grid, and the text after it starts at start +
    max(rows, columns) (transformers' get_rope_index). ``images``: the prompt's ImageInputs, in order."""
    n = len(token_ids)
    out = np.empty((3, n), dtype=np.int64)
    at, pos = 0, 0  # the next prompt index, and its position
    for image in images:
        text = image.offset - at
        out[:, at:image.offset] = pos + np.arange(text)
        pos += text
        _, h, w = image.grid
        gh, gw = h // merge, w // merge
        span = slice(image.offset, image.offset + image.length)
        out[0, span] = pos
        out[1, span] = pos + np.repeat(np.arange(gh), gw)
        out[2, span] = pos + np.tile(np.arange(gw), gh)
        pos += max(gh, gw)
        at = image.offset + image.length
    out[:, at:] = pos + np.arange(n - at)
    return out, int(out.max(initial=-1)) + 1 - n


class Qwen2VLForConditionalGeneration(LlamaForCausalLM):
    """The Qwen2 decoder with image inputs and M-RoPE. ``embed_image_list`` runs the vision encoder; the
    runner stages the embeddings in ``ForwardBatch.image_embeds`` (as LLaVA's) and each token's (t, h, w)
    positions in ``ForwardBatch.mrope_positions``, from ``mrope_prompt_positions``."""

    supports_lora = True  # on the decoder's projections (plait.lora.model.lora_targets)
    supports_images = True
    # The runner stages each token's three positions (ForwardBatch.mrope_positions) for this model.
    uses_mrope = True
    # Images of any size: a list of them is embedded in one call (embed_image_list), not stacked as tiles.
    variable_size_images = True
    qwen25 = False
    # The processor's (min_pixels, max_pixels) where the folder has no preprocessor_config.json.
    pixel_bounds = (DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS)

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        raw = cfg.raw
        self.visual = self.make_visual(raw["vision_config"])
        self.image_token_id = int(raw["image_token_id"])
        # <|vision_start|><|image_pad|><|vision_end|>: one image in a prompt, as the chat template writes it
        self.image_prompt_token_ids = [int(raw.get("vision_start_token_id", DEFAULT_VISION_START_ID)),
                                       self.image_token_id,
                                       int(raw.get("vision_end_token_id", DEFAULT_VISION_END_ID))]
        self.merge = self.visual.merge
        # [head_dim] (t 0, h 1, w 2) of each rotary channel; a constant, made where the model is built
        self.mrope_columns = self.make_mrope_columns(raw["mrope_section"], cfg.head_dim)

    def make_visual(self, vision_config: dict) -> nn.Module:
        """The vision encoder of the checkpoint's vision_config (Qwen3-VL builds its own)."""
        return VisionTransformer(vision_config, self.qwen25)

    def make_mrope_columns(self, section: list[int], head_dim: int) -> torch.Tensor:
        """[head_dim] the component each rotary channel reads: Qwen2-VL's contiguous bands."""
        return mrope_columns(section, head_dim)

    def num_image_tokens_for(self, size: tuple[int, int]) -> int:
        """Placeholders of an image of ``size`` (height, width) under the processor's default pixel bounds."""
        return self.image_token_counter(None)(size)

    def image_token_counter(self, processor: object | None) -> Callable[[tuple[int, int]], int]:
        """Placeholders of an image of a (height, width) as ``processor`` resizes it: one per merged group."""
        low, high = _pixel_bounds(processor, self.pixel_bounds)
        factor = self.visual.patch * self.merge

        def count(size: tuple[int, int]) -> int:
            h, w = smart_resize(*size, factor, low, high)
            return (h // factor) * (w // factor)

        return count

    def num_tiles_for(self, size: tuple[int, int]) -> int:
        return 1

    def largest_image(self, processor: object | None) -> tuple[torch.Tensor, Grid]:
        """Blank patches [t h w, patch_dim] and the grid of the largest square image ``processor`` makes (the
        runner's memory profile runs the encoder on it)."""
        _, high = _pixel_bounds(processor, self.pixel_bounds)
        factor = self.visual.patch * self.merge
        side = max(factor, math.isqrt(high) // factor * factor) // self.visual.patch  # in patches
        grid = (1, side, side)
        return torch.zeros(side * side, self.visual.patch_dim), grid

    def default_image_processor(self) -> object:
        """Qwen2VLImageProcessor's defaults at this encoder's patch and merge sizes (a folder without its
        preprocessor_config.json); the PIL one where transformers has it, which needs no torchvision."""
        try:
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
                Qwen2VLImageProcessorPil as Processor,
            )
        except ImportError:  # an older transformers: its one processor
            from transformers import Qwen2VLImageProcessor as Processor

        return Processor(patch_size=self.visual.patch, merge_size=self.merge,
                         temporal_patch_size=self.visual.temporal, **self.processor_defaults())

    def processor_defaults(self) -> dict:
        """Qwen2VLImageProcessor's arguments beyond the encoder's sizes for a folder without its
        preprocessor_config.json (Qwen2-VL's are the processor's own defaults)."""
        return {}

    def embed_image_list(self, pixel_values: list[torch.Tensor], grids: list[Grid]) -> list[torch.Tensor]:
        """Each image's patches [t h w, patch_dim] and grid -> its placeholders' embeddings
        [t h w / merge^2, hidden], in the model's dtype."""
        merged = self.visual(torch.cat(pixel_values), grids)
        return list(merged.split([t * h * w // self.merge**2 for t, h, w in grids]))

    def mrope_positions(self, token_ids: Sequence[int], images: Sequence) -> tuple[np.ndarray, int]:
        """The prompt's (t, h, w) positions [3, len] and the delta of the tokens after it."""
        return mrope_prompt_positions(token_ids, images, self.merge)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden: [T, hidden]
        embeds = embed_with_images(self, input_ids, batch)
        rotary = None  # a batch without three positions (built outside the runner) is text: all three equal
        if batch.mrope_positions is not None:
            rotary = MRopeRotary(self.model.rotary.cos_sin, batch.mrope_positions, self.mrope_columns)
        return self.model(input_ids, batch, inputs_embeds=embeds, rotary=rotary)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The decoder's tensors as a Qwen2's (transformers 5's names or the Hub's older ones); the vision
        encoder's by name, each checked."""
        load_image_model_weights(self, weights, ("visual.",), _vision_name,
                                 lambda name: language_model_name(name) or _old_decoder_name(name))


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: the encoder with RMSNorm, SwiGLU MLPs and window attention (VisionTransformer)."""

    qwen25 = True


def _vision_name(name: str) -> str | None:
    for prefix, to in _VISION_PREFIXES:
        if name.startswith(prefix):
            return to + name[len(prefix):]
    return None


def _old_decoder_name(name: str) -> str | None:
    """A Hub checkpoint of transformers 4's layout names the decoder as Qwen2's own (model.layers...)."""
    return name if name.startswith("model.") else None
