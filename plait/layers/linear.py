"""Linear: nn.Linear whose decode-sized matmuls can run on the skinny Triton GEMM on CUDA."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from plait.kernels.dispatch import use_triton

# Whether decode-sized matmuls use the skinny Triton GEMM unless PLAIT_SKINNY_GEMM says otherwise.
# The lead sets this from GPU measurements (benchmarks/kernels/dense_bench.py).
SKINNY_GEMM_DEFAULT = False
SKINNY_GEMM_ENV = "PLAIT_SKINNY_GEMM"  # "1" on, "0" off
# Row counts up to this go to the skinny GEMM (plait.kernels.skinny_gemm.SKINNY_MAX_M, repeated so
# the CPU path never imports triton).
SKINNY_MAX_M = 16
SKINNY_DTYPES = (torch.bfloat16, torch.float16)
# With the skinny GEMM on, a silu-gated MLP's gate/up projection and silu-and-mul run as one kernel.
FUSE_GATE_UP_SILU = True


def _env_switch(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


# Read once at import: forward runs hundreds of times per step. Tests flip it with set_skinny_enabled().
_skinny_enabled = _env_switch(SKINNY_GEMM_ENV, SKINNY_GEMM_DEFAULT)


def set_skinny_enabled(enabled: bool) -> None:
    global _skinny_enabled
    _skinny_enabled = enabled


def skinny_enabled() -> bool:
    return _skinny_enabled


class Linear(nn.Linear):
    """Drop-in nn.Linear (same parameters, init and state dict); see uses_skinny for the GPU route."""

    def uses_skinny(self, x: torch.Tensor) -> bool:
        """True when this x goes through the skinny Triton GEMM rather than F.linear."""
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        return (
            _skinny_enabled
            and 0 < rows <= SKINNY_MAX_M
            and x.dtype in SKINNY_DTYPES
            and x.dtype == self.weight.dtype
            and use_triton(x)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features]
        if self.uses_skinny(x):
            from plait.kernels.skinny_gemm import skinny_linear

            return skinny_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def fuses_gate_up_silu(self, x: torch.Tensor) -> bool:
        """True when gate_up_silu(x) runs as one fused skinny kernel (this layer being [gate; up])."""
        return FUSE_GATE_UP_SILU and self.bias is None and self.uses_skinny(x)

    def gate_up_silu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x @ gate.T) * (x @ up.T) for this fused [gate; up] weight; needs fuses_gate_up_silu(x)."""
        # x: [..., in_features] -> [..., out_features / 2]
        from plait.kernels.skinny_gemm import skinny_gate_up_silu

        return skinny_gate_up_silu(x, self.weight)
