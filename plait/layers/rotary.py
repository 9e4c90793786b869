"""Rotary position embeddings (neox layout, as HF Llama/Qwen), with llama3 and linear scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from plait.kernels.dispatch import use_triton


def _inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"rope scaling type {kind!r} is not supported (supported: linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between blended.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings to q and k at arbitrary (per-token) positions.

    ``cos_sin`` is the whole rotation: an attention backend that fuses the rotation into its KV store
    (AttentionBackend.rotate_and_store) reads this table instead of calling forward.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None) -> None:
        super().__init__()
        inv_freq = _inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        # cos_sin: [max_positions, head_dim] fp32; first half cos, second half sin (of the half-dim freqs).
        # A plain attribute, not a buffer, so casting the model to bf16 leaves it fp32; it is made on
        # the device the model is constructed under (``with torch.device(...)``).
        self.cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T]; q: [T, Hq, D]; k: [T, Hkv, D]
        if use_triton(q) and self.cos_sin.device == q.device:
            from plait.kernels.rotary import apply_rotary

            return apply_rotary(positions, q, k, self.cos_sin)
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)  # each [T, 1, D/2]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Same arithmetic as HF's x * cos + rotate_half(x) * sin with cos/sin duplicated over halves,
    # done in fp32 so bf16 activations rotate without extra rounding.
    dtype = x.dtype
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(dtype)
