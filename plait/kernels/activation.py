"""SiLU-and-multiply for gated MLPs in Triton, with its torch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

from plait.kernels.pdl import pdl_args, pdl_prologue

# Output columns per program: 4 warps x 32 threads x 8 values (16-byte bf16 stores).
BLOCK_COLS = 1024


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """plait.layers.activation.act_and_mul(gate_up, F.silu)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def silu_rounded(g, out_dtype: tl.constexpr, PRECISE: tl.constexpr):
    """silu of fp32 g, rounded to out_dtype (as torch's F.silu output is) and handed back in fp32."""
    if PRECISE:
        e = libdevice.exp(-g)  # CUDA's expf, as torch's silu kernel uses; tl.exp is ex2.approx
    else:
        e = tl.exp(-g)  # the interpreter has no libdevice
    return (g / (1.0 + e)).to(out_dtype).to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, s_x, s_out, PRECISE: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * s_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    s = silu_rounded(g, out_ptr.dtype.element_ty, PRECISE)
    tl.store(out_ptr + row * s_out + cols, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]: silu(gate) * up, each step rounded as torch rounds it; equals silu_and_mul_ref."""
    # gate_up: [T, 2 * I]
    two_i = gate_up.shape[-1]
    if two_i % 2:
        raise ValueError(f"gate_up's last dim must be even (gate then up), got {two_i}")
    x = gate_up.reshape(-1, two_i)
    if x.stride(-1) != 1:
        x = x.contiguous()
    inter = two_i // 2
    out = torch.empty((x.shape[0], inter), dtype=gate_up.dtype, device=gate_up.device)
    if x.shape[0] > 0 and inter > 0:
        grid = (x.shape[0], triton.cdiv(inter, BLOCK_COLS))
        _silu_and_mul_kernel[grid](x, out, inter, x.stride(0), out.stride(0), PRECISE=gate_up.is_cuda,
                                   BLOCK=min(BLOCK_COLS, triton.next_power_of_2(inter)), num_warps=4,
                                   **pdl_args(x))
    return out.view(*gate_up.shape[:-1], inter)
