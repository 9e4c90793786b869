"""Activations; SiLU-and-multiply for gated MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plait.kernels.dispatch import use_triton

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def get_activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported (supported: {sorted(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def act_and_mul(gate_up: torch.Tensor, act) -> torch.Tensor:
    # gate_up: [T, 2 * I] -> [T, I]
    if act is F.silu and use_triton(gate_up):
        from plait.kernels.activation import silu_and_mul

        return silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up
