"""Qwen3-VL (Qwen3VLForConditionalGeneration: Qwen3-VL-2B / 4B / 8B / 32B): Qwen2-VL's scheme (images of any
size as patches, merged 2x2 into placeholders, M-RoPE positions) with a new vision encoder and DeepStack.

The encoder embeds 16x16 patches (a biased 3D conv), adds a learned position embedding resampled
bilinearly from its square table to each image's grid, and runs LayerNorm blocks with 2D rotary and a plain
GELU MLP. Besides the final PatchMerger, ``deepstack_visual_indexes`` name blocks whose outputs each pass a
merger of their own (normalised after the 2x2 shuffle): DeepStack's features. The decoder is Qwen3's (q/k
norms) with interleaved M-RoPE (t, h, w take the rotary's frequencies in turn), and after each of its first
len(deepstack_visual_indexes) layers the k-th DeepStack feature is added to the hidden states at the image's
placeholders.

How the DeepStack features reach the decoder under plait's batching: ``embed_image_list`` returns each
placeholder's embedding and its DeepStack features side by side, one row of ``image_embed_width`` = hidden x
(1 + levels); the runner's ImageEmbeddings keeps, slices across chunks and stages those rows exactly as it
does Qwen2-VL's (its static buffers are that wide), a tensor-parallel driver sends them in FORWARD as it
does any image embeddings, and ``forward`` splits them: the first hidden columns replace the placeholders'
token embeddings, the rest are added after the first layers at the same rows. So a chunk boundary inside an
image moves its DeepStack rows with its embeddings, and graphs read the same buffers. Video inputs are
refused (as for Qwen2-VL)."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from plait.attention.base import Rotary
from plait.config import MROPE_INTERLEAVED_KEY, ModelConfig
from plait.layers.rotary import MRopeRotary, interleaved_mrope_columns
from plait.models.llama import LlamaModel
from plait.models.llava import activation
from plait.models.qwen2_vl import (
    VISION_NORM_EPS,
    Grid,
    Qwen2VLForConditionalGeneration,
    VisionBlock,
    span_groups,
    vision_positions,
)
from plait.models.weights import LoadRecord
from plait.runner.forward_batch import ForwardBatch

# Qwen3-VL's preprocessor_config.json (the Hub's): pixel bounds of 256 x 256 to 4096 x 4096, and mean / std
# 0.5 (Qwen2-VL's are CLIP's); for a folder without one (dummy weights).
QWEN3_VL_MIN_PIXELS, QWEN3_VL_MAX_PIXELS = 256 * 256, 4096 * 4096
QWEN3_VL_IMAGE_MEAN = QWEN3_VL_IMAGE_STD = [0.5, 0.5, 0.5]
# Taps of the bilinear resampling of the position table, per axis.
_BILINEAR_TAPS = 2


class Qwen3VisionMLP(nn.Module):
    """A block's MLP: linear_fc1 / act (the tanh GELU) / linear_fc2, with biases."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden)
        self.linear_fc2 = nn.Linear(hidden, dim)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3PatchMerger(nn.Module):
    """Each merge x merge group of neighbouring patches -> one embedding of the decoder's width: LayerNorm
    over each patch (the final merger) or over the group's concatenation (``postshuffle``: the DeepStack
    mergers), then Linear / GELU / Linear."""

    def __init__(self, out_dim: int, dim: int, merge: int, postshuffle: bool) -> None:
        super().__init__()
        self.group = dim * merge**2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.group if postshuffle else dim, eps=VISION_NORM_EPS)
        self.linear_fc1 = nn.Linear(self.group, self.group)
        self.act = nn.GELU()
        self.linear_fc2 = nn.Linear(self.group, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, dim] -> [N / merge^2, out_dim]
        x = self.norm(x.view(-1, self.group)) if self.postshuffle else self.norm(x).view(-1, self.group)
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3VisionTransformer(nn.Module):
    """The vision encoder, named as transformers' Qwen3VLVisionModel names its tensors."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        dim, heads = cfg["hidden_size"], cfg["num_heads"]
        self.patch, self.temporal = cfg["patch_size"], cfg["temporal_patch_size"]
        self.merge, self.channels = cfg["spatial_merge_size"], cfg["in_channels"]
        self.out_dim = cfg["out_hidden_size"]
        self.patch_embed = nn.Module()
        kernel = (self.temporal, self.patch, self.patch)
        self.patch_embed.proj = nn.Conv3d(self.channels, dim, kernel, kernel, bias=True)
        # a square table of learned positions, resampled to each image's grid (transformers reads its side so)
        self.pos_embed = nn.Embedding(cfg["num_position_embeddings"], dim)
        self.side = int(cfg["num_position_embeddings"] ** 0.5)
        theta = float((cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        spatial = dim // heads // 2  # each of row and column turns a quarter of a head's channels
        self.inv_freq = 1.0 / theta ** (torch.arange(0, spatial, 2, dtype=torch.float32) / spatial)
        norm = functools.partial(nn.LayerNorm, eps=VISION_NORM_EPS)
        self.blocks = nn.ModuleList(
            VisionBlock(dim, heads, Qwen3VisionMLP(dim, cfg["intermediate_size"], cfg["hidden_act"]), norm)
            for _ in range(cfg["depth"]))
        self.merger = Qwen3PatchMerger(self.out_dim, dim, self.merge, postshuffle=False)
        # the blocks whose outputs DeepStack reads, in the config's order (each has its merger, by position)
        self.deepstack_visual_indexes = [int(i) for i in cfg.get("deepstack_visual_indexes") or ()]
        if any(not 0 <= i < cfg["depth"] for i in self.deepstack_visual_indexes):
            raise ValueError(f"deepstack_visual_indexes {self.deepstack_visual_indexes} name blocks beyond "
                             f"the encoder's {cfg['depth']}")
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3PatchMerger(self.out_dim, dim, self.merge, postshuffle=True)
            for _ in self.deepstack_visual_indexes)

    @property
    def patch_dim(self) -> int:
        """Values of one flattened patch, as the processor writes it: channels x temporal x patch x patch."""
        return self.channels * self.temporal * self.patch**2

    @property
    def num_deepstack(self) -> int:
        return len(self.deepstack_visual_indexes)

    def _cos_sin(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # pos: [N, 2] (row, column) -> each [N, head_dim] fp32: the row's angles, then the column's, twice
        angles = (pos[..., None].float() * self.inv_freq.to(pos.device)).flatten(1)  # [N, head_dim / 2]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    def _position_embeds(self, pos: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        """The learned positions at each patch: the side x side table resampled bilinearly (align_corners:
        the grid's corners on the table's) to its image's rows and columns; pos: [N, 2] (row, column) ->
        [N, dim] fp32. The same arithmetic as transformers' (source coordinate, floor, two taps an axis
        clamped to the table, weights 1 - distance), so the sums round alike."""
        sizes = torch.cat([torch.tensor([[h, w]]).expand(t * h * w, 2) for t, h, w in grids]).to(pos.device)
        src = pos.float() * (self.side - 1) / torch.clamp(sizes - 1, min=1)  # [N, 2] table coordinates
        floor = torch.floor(src)
        offsets = torch.arange(_BILINEAR_TAPS, device=pos.device)
        taps = (floor.long()[..., None] + offsets).clamp(0, self.side - 1)  # [N, 2 axes, 2 taps]
        weights = (1 - (src[..., None] - floor[..., None] - offsets).abs()).clamp(min=0)  # [N, 2, 2]
        indices = (taps[:, 0, :, None] * self.side + taps[:, 1, None, :]).flatten(1)  # [N, 4] table rows
        weights = (weights[:, 0, :, None] * weights[:, 1, None, :]).flatten(1)  # [N, 4]
        # tap by tap, in transformers' order: one [N, dim] gather at a time, not [N, 4, dim] in fp32 (1.2 GB
        # at the 4096 x 4096 image the memory profile runs)
        out = self.pos_embed(indices[:, 0]) * weights[:, :1]
        for tap in range(1, indices.shape[1]):
            out += self.pos_embed(indices[:, tap]) * weights[:, tap:tap + 1]
        return out

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        """pixel_values: [N, patch_dim] (every image's patches, in order); grids: each image's (t, h, w) ->
        [N / merge^2, out_dim (1 + num_deepstack)] in the decoder's dtype: each placeholder's embedding, then
        its DeepStack features in decoder-layer order, side by side."""
        # The conv's stride is its kernel: one matmul over each flattened patch (as Qwen2-VL's encoder).
        proj = self.patch_embed.proj
        x = F.linear(pixel_values.to(proj.weight.dtype), proj.weight.flatten(1), proj.bias)  # [N, dim]
        pos = torch.cat([vision_positions(g, self.merge) for g in grids]).to(x.device)  # [N, 2]
        x = x + self._position_embeds(pos, grids).to(x.dtype)
        cos_sin = self._cos_sin(pos)
        frames = np.cumsum([0] + [h * w for t, h, w in grids for _ in range(t)]).tolist()  # each frame alone
        spans = span_groups(frames, x.device)
        deepstack = []  # in block order, which is the decoder layers' order (transformers')
        for i, block in enumerate(self.blocks):
            x = block(x, cos_sin, spans)
            if i in self.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[self.deepstack_visual_indexes.index(i)](x))
        return torch.cat([self.merger(x), *deepstack], dim=-1)


class Qwen3VLTextModel(LlamaModel):
    """The Qwen3 decoder, adding DeepStack features after its first layers."""

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch,
                inputs_embeds: torch.Tensor | None = None, rotary: Rotary | None = None,
                deepstack: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        # input_ids: [T]; inputs_embeds: [T, hidden]; deepstack: (mask [T] bool, features [T, levels,
        # hidden]): after layer k < levels, features[:, k] is added where mask is set (rows elsewhere are
        # stale values of the static buffer, never read: torch.where, not a product, so nothing leaks in)
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        fuse = self.fuses_mlp_norm(x)
        rotary = self.rotary if rotary is None else rotary
        levels = 0 if deepstack is None else deepstack[1].shape[1]
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, rotary, batch, fuse)
            if i < levels:
                mask, features = deepstack
                # the layer's output as transformers sums it (residual + MLP), then the features: the next
                # layer takes it as its whole input (residual None), so the arithmetic is transformers'
                h = residual + x
                x, residual = torch.where(mask[:, None], h + features[:, i], h), None
        if residual is None:  # the last layer took DeepStack features
            return self.norm(x)
        x, _ = self.norm.forward_residual(x, residual)
        return x


class Qwen3VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen3-VL: Qwen2-VL's image path with Qwen3VisionTransformer, interleaved M-RoPE, the Qwen3 decoder and
    DeepStack (the module docstring says how its features travel with the image embeddings)."""

    model_class = Qwen3VLTextModel
    pixel_bounds = (QWEN3_VL_MIN_PIXELS, QWEN3_VL_MAX_PIXELS)

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        self.num_deepstack = self.visual.num_deepstack
        if self.num_deepstack > cfg.num_hidden_layers:
            raise ValueError(f"Qwen3-VL: {self.num_deepstack} DeepStack levels for a decoder of "
                             f"{cfg.num_hidden_layers} layers")
        # The width of an image placeholder's row in ImageEmbeddings' buffers: its embedding, then each
        # DeepStack level's feature.
        self.image_embed_width = cfg.hidden_size * (1 + self.num_deepstack)

    def make_visual(self, vision_config: dict) -> nn.Module:
        visual = Qwen3VisionTransformer(vision_config)
        if visual.out_dim != self.config.hidden_size:
            raise ValueError(f"Qwen3-VL: the vision encoder's out_hidden_size {visual.out_dim} is not the "
                             f"decoder's hidden_size {self.config.hidden_size}")
        return visual

    def make_mrope_columns(self, section: list[int], head_dim: int) -> torch.Tensor:
        """Qwen3-VL's interleaved bands (transformers interleaves whatever the config says; a config that
        says otherwise is refused rather than read two ways)."""
        if not self.config.raw.get(MROPE_INTERLEAVED_KEY, True):
            raise ValueError("Qwen3-VL with mrope_interleaved false is not supported: transformers' Qwen3-VL "
                             "interleaves the M-RoPE bands")
        return interleaved_mrope_columns(section, head_dim)

    def processor_defaults(self) -> dict:
        return {"size": {"shortest_edge": QWEN3_VL_MIN_PIXELS, "longest_edge": QWEN3_VL_MAX_PIXELS},
                "image_mean": QWEN3_VL_IMAGE_MEAN, "image_std": QWEN3_VL_IMAGE_STD}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden: [T, hidden]
        embeds = self.model.embed_tokens(input_ids)
        deepstack = None
        if batch.image_embeds is not None:
            mask, values = batch.image_embeds  # [T] bool, [T, hidden (1 + num_deepstack)]
            hidden = embeds.shape[-1]
            embeds = torch.where(mask[:, None], values[:, :hidden], embeds)
            if self.num_deepstack:
                deepstack = (mask, values[:, hidden:].view(-1, self.num_deepstack, hidden))
        rotary = None  # a batch without three positions (built outside the runner) is text: all three equal
        if batch.mrope_positions is not None:
            rotary = MRopeRotary(self.model.rotary.cos_sin, batch.mrope_positions, self.mrope_columns)
        return self.model(input_ids, batch, inputs_embeds=embeds, rotary=rotary, deepstack=deepstack)


# A stacked experts tensor of a Qwen3-VL-MoE checkpoint (the decoder's, under any prefix) and its kind.
_STACKED_EXPERTS = re.compile(r"\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)$")


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):
    """Qwen3-VL-MoE (Qwen3-VL-30B-A3B, 235B-A22B): Qwen3VLForConditionalGeneration with the Qwen3-MoE
    decoder's sparse blocks (DecoderLayer.make_mlp builds them from ModelConfig.moe; the router always
    renormalises, config.completed_qwen_vl_config). Its checkpoints stack each layer's experts as [experts,
    in, out]; checkpoint_layout turns them into transformers 5's [experts, out, in] that FusedMoE.load_stacked
    takes."""

    # Adapters would need per-expert deltas inside the expert kernels (as MoeForCausalLM).
    supports_lora = False

    def fold_norm_weights(self, loaded: LoadRecord | None = None) -> None:
        """Kept unfolded: the MLP norm feeds the router and every expert, which take no row scale."""

    def checkpoint_layout(self, weights: Iterable[tuple[str, torch.Tensor]]
                          ) -> Iterator[tuple[str, torch.Tensor]]:
        """Each stacked experts tensor as [experts, out, in]: transposed unless it is so already
        (transformers' Transpose(1, 2, check_dims=True) for qwen3_vl_moe)."""
        # the whole model's shapes (the loaders call this before a tensor-parallel rank takes its slices)
        moe, hidden = self.config.moe, self.config.hidden_size
        width = int(self.config.raw["moe_intermediate_size"])
        want = {"gate_up_proj": (moe.num_experts, 2 * width, hidden),
                "down_proj": (moe.num_experts, hidden, width)}
        for name, tensor in weights:
            stacked = _STACKED_EXPERTS.search(name)
            if stacked and tuple(tensor.shape) != want[stacked[1]]:
                tensor = tensor.transpose(1, 2).contiguous()  # [E, in, out] -> [E, out, in]
            yield name, tensor
