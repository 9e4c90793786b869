"""SiLU-and-multiply (and GELU(tanh)-and-multiply, Gemma's GeGLU) for gated MLPs in Triton, with their torch
references."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

from plait.kernels.pdl import pdl_args, pdl_prologue
from plait.kernels.rms_norm import rms_scale

if TYPE_CHECKING:
    from plait.layers.norm import RowNorm

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


def gelu_tanh_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """plait.layers.activation.act_and_mul(gate_up, gelu_tanh): transformers' gelu_pytorch_tanh."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


# GELU's tanh approximation: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), torch's constants.
_GELU_BETA = tl.constexpr(0.7978845608028654)
_GELU_KAPPA = tl.constexpr(0.044715)


@triton.jit
def gelu_tanh_rounded(g, out_dtype: tl.constexpr, PRECISE: tl.constexpr):
    """gelu (tanh approximation) of fp32 g, rounded to out_dtype as torch's F.gelu output is, in fp32."""
    inner = _GELU_BETA * (g + _GELU_KAPPA * (g * g * g))
    if PRECISE:
        t = libdevice.tanh(inner)  # CUDA's tanhf, as torch's gelu kernel uses
    else:
        # The interpreter has no libdevice; past |2x| = 80, tanh is +-1 in fp32 and exp would overflow.
        t = 1.0 - 2.0 / (tl.exp(tl.minimum(2.0 * inner, 80.0)) + 1.0)
    return (0.5 * g * (1.0 + t)).to(out_dtype).to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, ss_ptr, inter, s_x, s_out, n_parts, width, eps,
                         PRECISE: tl.constexpr, BLOCK: tl.constexpr, ROW_RMS: tl.constexpr,
                         BLOCK_P: tl.constexpr, GELU_TANH: tl.constexpr, PDL: tl.constexpr):
    # ROW_RMS: gate_up came from the un-normalised stream through a weight with the norm's weight
    # folded in, so both halves take the row's RowNorm scale first.
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * s_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if ROW_RMS:
        scale = rms_scale(ss_ptr, row, n_parts, width, eps, BLOCK_P, PRECISE)
        g, u = g * scale, u * scale
    if GELU_TANH:
        s = gelu_tanh_rounded(g, out_ptr.dtype.element_ty, PRECISE)
    else:
        s = silu_rounded(g, out_ptr.dtype.element_ty, PRECISE)
    tl.store(out_ptr + row * s_out + cols, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_rms_ref(gate_up: torch.Tensor, row_norm: RowNorm) -> torch.Tensor:
    """silu_and_mul_ref of gate_up with each row first scaled by row_norm's scale (in fp32)."""
    gate, up = (gate_up.float() * row_norm.scale()).chunk(2, dim=-1)
    return (F.silu(gate).to(gate_up.dtype).float() * up).to(gate_up.dtype)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]: gelu_tanh(gate) * up, each step rounded as torch rounds it; equals
    gelu_tanh_and_mul_ref."""
    return silu_and_mul(gate_up, gelu_tanh=True)


def silu_and_mul(gate_up: torch.Tensor, row_norm: RowNorm | None = None, gelu_tanh: bool = False
                 ) -> torch.Tensor:
    """[T, 2I] -> [T, I]: silu(gate) * up, each step rounded as torch rounds it; equals silu_and_mul_ref
    (``gelu_tanh``: GELU's tanh approximation in place of silu, gelu_tanh_and_mul).

    With row_norm, gate_up is (un-normalised h) @ (W with the norm's weight folded in), and each row
    is first scaled by rsqrt(mean(h^2) + eps): the RMSNorm before the MLP without a launch of its own;
    equals silu_and_mul_rms_ref."""
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
        parts = row_norm.sum_sq_parts if row_norm is not None else out
        n_parts = parts.shape[1] if row_norm is not None else 1
        _silu_and_mul_kernel[grid](
            x, out, parts, inter, x.stride(0), out.stride(0), n_parts,
            row_norm.width if row_norm is not None else 1, row_norm.eps if row_norm is not None else 0.0,
            PRECISE=gate_up.is_cuda, BLOCK=min(BLOCK_COLS, triton.next_power_of_2(inter)),
            ROW_RMS=row_norm is not None, BLOCK_P=triton.next_power_of_2(n_parts), GELU_TANH=gelu_tanh,
            num_warps=4,
            **pdl_args(x))
    return out.view(*gate_up.shape[:-1], inter)
