"""Gated RMSNorm of the Mamba2 mixer output, RMSNorm(y * silu(z)) per group (Triton).

Reference: plait.layers.mamba_ops.gated_rms_norm_ref. One program per (token, group).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gated_norm_kernel(y_ptr, z_ptr, w_ptr, out_ptr, stride_y, stride_z, stride_out, eps,
                       GROUP: tl.constexpr, BLOCK: tl.constexpr):
    t, g = tl.program_id(0), tl.program_id(1)
    i = tl.arange(0, BLOCK)
    mask = i < GROUP
    col = g * GROUP + i
    y = tl.load(y_ptr + t * stride_y + col, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + t * stride_z + col, mask=mask, other=0.0).to(tl.float32)
    h = y * z / (1.0 + tl.exp(-z))
    h = h * tl.rsqrt(tl.sum(h * h, axis=0) / GROUP + eps)
    # As the reference (and HF): normalise in fp32, round to the activation dtype, then scale.
    h = h.to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_out + col, (w * h).to(out_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int,
                   eps: float) -> torch.Tensor:
    """y, z: [T, I] (rows may be strided) -> [T, I] in y's dtype."""
    num_tokens, size = y.shape
    assert y.stride(1) == 1 and z.stride(1) == 1 and size % group_size == 0
    out = torch.empty((num_tokens, size), dtype=y.dtype, device=y.device)
    if num_tokens == 0:
        return out
    _gated_norm_kernel[(num_tokens, size // group_size)](
        y, z, weight, out, y.stride(0), z.stride(0), out.stride(0), eps,
        GROUP=group_size, BLOCK=triton.next_power_of_2(group_size))
    return out
