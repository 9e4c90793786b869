"""Block-wise FP8 (DeepSeek / Qwen FP8 checkpoints): Fp8BlockLinear, its torch reference and the format."""

# Checkpoints such as Qwen3-8B-FP8 keep each linear weight as float8_e4m3fn codes with one fp32 scale per
# [block_n, block_k] tile (weight_block_size, usually [128, 128]; the scales are named weight_scale_inv, or
# weight_scale in compressed-tensors' "block" strategy), and quantise each input per token and per group of
# block_k along K at run time. A weight element is code * scale[n // block_n, k // block_k]; an input element
# code * scale[m, k // block_k]. Fp8BlockLinear serves such a layer as it is; off CUDA the same arithmetic
# runs in torch (fp32 on the dequantised codes), which is what the kernels are tested against.

from __future__ import annotations

import torch
import torch.nn.functional as F

from plait.kernels.dispatch import use_triton
from plait.layers.fp8 import FP8_DTYPE, FP8_MAX, INV_FP8_MAX, KERNEL_DTYPES, MIN_SCALE, Fp8Linear
from plait.layers.linear import linear

# Block sides the kernels take: powers of two, at least the FP8 dot's smallest K.
MIN_BLOCK = 32


def check_block(block: tuple[int, int]) -> tuple[int, int]:
    """``block`` as (block_n, block_k) ints, or a ValueError naming what the kernels need."""
    if len(block) != 2 or any(not isinstance(b, int) or b < MIN_BLOCK or b & (b - 1) for b in block):
        raise ValueError(f"FP8 weight_block_size {list(block)}: plait takes two powers of two of at least "
                         f"{MIN_BLOCK} (e.g. [128, 128])")
    return block[0], block[1]


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [N, K], scales [cdiv(N, bn), cdiv(K, bk)]): each tile scaled so its largest magnitude lands
    on FP8_MAX, rounded to FP8 (the last tiles of a side may be partial)."""
    bn, bk = block
    n, k = weight.shape
    w = weight.float()
    padded = F.pad(w, (0, -k % bk, 0, -n % bn))  # zeros do not change a tile's amax
    tiles = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    scale = (tiles.abs().amax(dim=(1, 3)) * INV_FP8_MAX).clamp_min(MIN_SCALE)
    codes = (w / expand_blocks(scale, block, n, k)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scale


def expand_blocks(scale: torch.Tensor, block: tuple[int, int], n: int, k: int) -> torch.Tensor:
    """Per-tile scales [cdiv(N, bn), cdiv(K, bk)] spread to one per element, [N, K]."""
    return scale.repeat_interleave(block[0], dim=0)[:n].repeat_interleave(block[1], dim=1)[:, :k]


def dequantize_blocks(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype) -> torch.Tensor:
    return (codes.float() * expand_blocks(scale, block, *codes.shape)).to(dtype)


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [M, K], scales [M, cdiv(K, group)]): each row's groups of ``group`` elements on their own
    scale (amax * fp32(1 / FP8_MAX)), as the inputs of a block-wise layer are quantised."""
    m, k = x.shape
    xf = x.float()
    groups = F.pad(xf, (0, -k % group)).view(m, -1, group)
    scale = (groups.abs().amax(dim=2) * INV_FP8_MAX).clamp_min(MIN_SCALE)
    codes = (xf / scale.repeat_interleave(group, dim=1)[:, :k]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scale


def fp8_block_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         block: tuple[int, int], bias: torch.Tensor | None = None,
                         dequantized: torch.Tensor | None = None) -> torch.Tensor:
    """x quantised per token and K group, times the block-wise FP8 weight, in fp32; rounded to x's dtype.
    ``dequantized``: the weight's fp32 values, where the caller keeps them."""
    # x: [..., K]; weight: [N, K] float8_e4m3fn; weight_scale: [cdiv(N, bn), cdiv(K, bk)] -> [..., N]
    x2 = x.reshape(-1, x.shape[-1])
    codes, scale = quantize_groups(x2, block[1])
    xd = codes.float() * scale.repeat_interleave(block[1], dim=1)[:, : x2.shape[1]]
    if dequantized is None:
        dequantized = dequantize_blocks(weight, weight_scale, block, torch.float32)
    out = linear(xd, dequantized, bias.float() if bias is not None else None)
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


class Fp8BlockLinear(Fp8Linear):
    """An Fp8Linear whose weight has one scale per [block_n, block_k] tile and whose input is quantised per
    token and K group (weight_scale: [cdiv(N, bn), cdiv(K, bk)] fp32)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                 bias: torch.Tensor | None, compute_dtype: torch.dtype) -> None:
        super().__init__(codes, scale, bias, compute_dtype)
        self.block = check_block(block)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, device: torch.device | None = None,
                    block: tuple[int, int] = (128, 128)) -> Fp8BlockLinear:
        """The layer's weight quantised tile by tile; a layer on the meta device gives an empty one on
        ``device``, for the checkpoint (load_weight_rows, load_scale_rows) to fill."""
        bn, bk = check_block(block)
        w = linear.weight
        if w.is_meta:
            n, k = w.shape
            bias = torch.zeros(n, dtype=w.dtype, device=device) if linear.bias is not None else None
            scale = torch.full((-(-n // bn), -(-k // bk)), float("nan"), dtype=torch.float32, device=device)
            return cls(torch.zeros((n, k), dtype=FP8_DTYPE, device=device), scale, (bn, bk), bias, w.dtype)
        codes, scale = quantize_blocks(w.detach(), (bn, bk))
        return cls(codes, scale, (bn, bk), linear.bias.detach() if linear.bias is not None else None, w.dtype)

    def _block_rows(self, start: int, num_rows: int) -> slice:
        """The scale rows of weight rows ``start:start + num_rows``, which must start a tile row (a fused
        layer's shards each keep their own tiles)."""
        bn = self.block[0]
        if start % bn or (num_rows % bn and start + num_rows != self.out_features):
            raise ValueError(f"a shard of rows {start}:{start + num_rows} does not fall on the checkpoint's "
                             f"{bn}-row blocks")
        return slice(start // bn, -(-(start + num_rows) // bn))

    @torch.no_grad()
    def load_weight_rows(self, start: int, rows: torch.Tensor) -> None:
        """Checkpoint rows ``start:start + len(rows)``: FP8 codes kept (their scales come as load_scale_rows),
        16/32-bit rows (random weights) quantised tile by tile here."""
        blocks = self._block_rows(start, rows.shape[0])
        end = start + rows.shape[0]
        if rows.dtype == FP8_DTYPE:
            self.weight[start:end].copy_(rows)
            return
        codes, scale = quantize_blocks(rows, self.block)
        self.weight[start:end].copy_(codes)
        self.weight_scale[blocks].copy_(scale)

    @torch.no_grad()
    def load_scale_rows(self, start: int, num_rows: int, scale: torch.Tensor) -> None:
        """The checkpoint's tile scales, [cdiv(num_rows, bn), cdiv(K, bk)], of rows start:start + num_rows."""
        blocks = self._block_rows(start, num_rows)
        want = (blocks.stop - blocks.start, self.weight_scale.shape[1])
        if tuple(scale.shape) != want:
            raise ValueError(f"block scales of shape {tuple(scale.shape)} for {num_rows} rows of "
                             f"{self.in_features} with blocks {list(self.block)}: expected {want}")
        self.weight_scale[blocks].copy_(scale.float())

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_blocks(self.weight, self.weight_scale, self.block, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features]
        if x.dtype in KERNEL_DTYPES and use_triton(x):
            from plait.kernels.fp8_block_gemm import fp8_block_linear

            return fp8_block_linear(x, self.weight, self.weight_scale, self.block, self.bias)
        if self._reference_weight is None:
            self._reference_weight = self.dequantized(torch.float32)
        return fp8_block_linear_ref(x, self.weight, self.weight_scale, self.block, self.bias,
                                    self._reference_weight)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, fp8 scales per "
                f"{self.block[0]}x{self.block[1]} block")
