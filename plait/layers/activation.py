"""Activations; SiLU- (and GELU-tanh-) and-multiply for gated MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plait.kernels.dispatch import use_triton
from plait.layers.norm import RowNorm


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """transformers' gelu_pytorch_tanh (Gemma's GeGLU)."""
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": gelu_tanh}


def get_activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported (supported: {sorted(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def act_and_mul(gate_up: torch.Tensor, act) -> torch.Tensor:
    # gate_up: [T, 2 * I] -> [T, I]
    if act in (F.silu, gelu_tanh) and use_triton(gate_up):
        from plait.kernels.activation import gelu_tanh_and_mul, silu_and_mul

        return gelu_tanh_and_mul(gate_up) if act is gelu_tanh else silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up


def silu_and_mul_rms(gate_up: torch.Tensor, row_norm: RowNorm) -> torch.Tensor:
    """silu-and-mul of gate_up = h @ W.T, W holding the MLP norm's weight and h the un-normalised
    stream: each row first takes row_norm's scale, so the norm needs no launch of its own (the fused
    decode path; Triton only)."""
    # gate_up: [T, 2 * I] -> [T, I]
    from plait.kernels.activation import silu_and_mul

    return silu_and_mul(gate_up, row_norm)
