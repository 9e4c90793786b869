"""RMSNorm (and Gemma's 1 + weight form) and Cohere's LayerNorm, computed in fp32 the way Hugging Face
transformers does them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from plait.kernels.dispatch import use_triton

if TYPE_CHECKING:
    from plait.parallel.group import TPGroup


@dataclass(frozen=True)
class RowNorm:
    """An RMSNorm applied late, as a per-row scale: the sum-of-squares partials ([T, parts] fp32) of
    the un-normalised rows h that the kernel writing h left (plait.kernels.skinny_gemm's
    skinny_linear_add), h's width and the norm's eps. The norm's weight is folded into the matmul
    that reads h, whose output takes rsqrt(mean(h^2) + eps) in a kernel further on (silu_and_mul)
    instead of a norm launch of its own."""

    sum_sq_parts: torch.Tensor
    width: int
    eps: float

    def scale(self) -> torch.Tensor:
        """[T, 1] fp32: rsqrt(mean(h^2) + eps), as the kernels compute it."""
        return torch.rsqrt(self.sum_sq_parts.sum(-1, keepdim=True) / self.width + self.eps)


class RMSNorm(nn.Module):
    # Gemma's norms scale by 1 + weight (GemmaRMSNorm); OLMo's take weight x row in fp32, rounded once (as
    # Gemma's do): the kernels read both flags.
    unit_offset = False
    round_once = False

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((hidden_size,), 0.0 if self.unit_offset else 1.0))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., hidden_size]; the variance is taken in fp32 so bf16 inputs do not lose range.
        if use_triton(x):
            from plait.kernels import rms_norm as kernels

            if kernels.supported_hidden(x.shape[-1]):
                return kernels.rms_norm(x, self.weight, self.eps, unit_offset=self.unit_offset,
                                        round_once=self.round_once)
        x32 = x.float()
        return self.scaled(x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps), x.dtype)

    def scaled(self, x32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The normalised fp32 rows ``x32`` times the weight, rounded to ``dtype`` as this kind of norm
        rounds (Llama's the row first, Gemma's and OLMo's once)."""
        if self.unit_offset:
            return (x32 * (1.0 + self.weight.float())).to(dtype)
        if self.round_once:
            return (self.weight.float() * x32).to(dtype)
        return self.weight * x32.to(dtype)

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor, pre_norm: RMSNorm | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the pre-norm block's add-then-normalise, one call. With
        ``pre_norm`` (a norm of the same kind) x is pre_norm(x) first: Gemma's sandwich, the sublayer's
        post-norm, the add and the next pre-norm in one launch on the GPU."""
        if pre_norm is not None and (pre_norm.unit_offset, pre_norm.round_once) != (self.unit_offset,
                                                                                     self.round_once):
            raise ValueError("a fused pre_norm must be of the norm's own kind")
        if use_triton(x) and x.shape == residual.shape:
            from plait.kernels import rms_norm as kernels

            if kernels.supported_hidden(x.shape[-1]):
                pre = {} if pre_norm is None else {"pre_weight": pre_norm.weight, "pre_eps": pre_norm.eps}
                return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps,
                                                  unit_offset=self.unit_offset, round_once=self.round_once,
                                                  **pre)
        if pre_norm is not None:
            x = pre_norm(x)
        residual = x + residual
        return self.forward(residual), residual


def split_rms_norms(pairs: list[tuple[torch.Tensor, RMSNorm]], group: TPGroup) -> list[torch.Tensor]:
    """Each (x, norm)'s norm of rows that tensor parallelism split across the ranks in equal slices, x and
    the norm's weight this rank's ([T, width] and [width]): OLMo's q/k norms across all heads. One all-reduce
    sums every pair's squares (where ranks share a KV head each counts it, but then each rank's slice is that
    one head, of the world_size heads' worth summed: the same mean, the sum over the ranks divided by
    width * world_size either way)."""
    sums = torch.cat([x.float().pow(2).sum(-1, keepdim=True) for x, _ in pairs], dim=-1)  # [T, pairs]
    group.all_reduce_(sums)
    out = []
    for i, (x, norm) in enumerate(pairs):
        mean = sums[:, i:i + 1] / (x.shape[-1] * group.world_size)
        out.append(norm.scaled(x.float() * torch.rsqrt(mean + norm.eps), x.dtype))
    return out


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint's weight w scales by 1 + w (zero-initialised), the product taken in
    fp32 and rounded once."""

    unit_offset = True


class OlmoRMSNorm(RMSNorm):
    """OLMo 2 / 3's RMSNorm: the weight times the fp32 row, rounded once (Llama's rounds the row first)."""

    round_once = True


class CohereLayerNorm(nn.Module):
    """Cohere's LayerNorm (Command R, Command R7B / A, Aya): the row's mean subtracted, divided by its
    standard deviation, times a weight, no bias; in fp32, rounded once (transformers' CohereLayerNorm).
    ``shape`` is the weight's: (hidden,) for the layer norms, (heads, head_dim) for Command R+'s q/k norms,
    which normalise each head's row with that head's own weight. Not an RMSNorm: no kernel of plait's fuses
    it, so the RMSNorm fast paths (fused add, norms folded into gate/up, q/k norms in the rotary launch)
    never see it."""

    def __init__(self, shape: int | tuple[int, ...], eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(shape))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., *shape] (a weight of [heads, head_dim] broadcasts over [T, heads, head_dim])
        x32 = x.float()
        centred = x32 - x32.mean(-1, keepdim=True)
        x32 = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x32).to(x.dtype)
