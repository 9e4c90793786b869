"""RMSNorm and fused residual-add + RMSNorm in Triton, with the torch reference they must match."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from plait.kernels.pdl import pdl_args, pdl_prologue

# A program normalises rows held whole in registers; wider rows go to the torch path.
MAX_FUSED_HIDDEN = 16384
# One warp per 256 elements: each thread holds 8 values (one 16-byte bf16 load).
ELEMENTS_PER_WARP = 256
MAX_WARPS = 16
# Rows narrower than this share a program, up to this many elements in all: one program per 128-wide
# q/k-norm row (262k programs at a 16k-token step) measured 2-3x off the bandwidth on an H200.
ELEMENTS_PER_PROGRAM = 2048


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False,
                 round_once: bool = False) -> torch.Tensor:
    """plait.layers.norm.RMSNorm.forward: variance in fp32, cast to x's dtype, then times weight. With
    ``unit_offset`` (Gemma's norms) the scale is 1 + weight, and the product is taken in fp32 and rounded
    once, as transformers' GemmaRMSNorm does; ``round_once`` alone (OLMo's norms) takes that product without
    the offset."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (x32 * (1.0 + weight.float())).to(dtype)
    if round_once:  # OLMo 2 / 3: the weight times the fp32 row, rounded once
        return (weight.float() * x32).to(dtype)
    return weight * x32.to(dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False,
    pre_weight: torch.Tensor | None = None, pre_eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual); with ``pre_weight``, x is first normalised by that norm (eps
    ``pre_eps``, the same kind): Gemma's post-norm of a sublayer's output, before it joins the stream."""
    if pre_weight is not None:
        x = rms_norm_ref(x, pre_weight, pre_eps, unit_offset)
    residual = x + residual
    return rms_norm_ref(residual, weight, eps, unit_offset), residual


@triton.jit
def rms_scale(ss_ptr, row, n_parts, width, eps, BLOCK_P: tl.constexpr, PRECISE: tl.constexpr):
    """RowNorm's scale for one row: 1 / sqrt(mean(h^2) + eps) from the row's n_parts partials."""
    offs_p = tl.arange(0, BLOCK_P)
    parts = tl.load(ss_ptr + row * n_parts + offs_p, mask=offs_p < n_parts, other=0.0)
    mean_sq = tl.sum(parts, axis=0) / width
    if PRECISE:
        return libdevice.rsqrt(mean_sq + eps)  # CUDA's rsqrtf, as torch.rsqrt uses
    return 1.0 / tl.sqrt(mean_sq + eps)  # the interpreter has no libdevice


@triton.jit
def _inv_rms(x, H, eps, PRECISE: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) of each row of x ([ROWS, BLOCK_H] fp32, masked lanes 0)."""
    mean_sq = tl.sum(x * x, axis=1) / H
    if PRECISE:
        return libdevice.rsqrt(mean_sq + eps)  # CUDA's rsqrtf, as torch.rsqrt uses
    return 1.0 / tl.sqrt(mean_sq + eps)  # the interpreter has no libdevice


@triton.jit
def _normalize(x, w_ptr, cols, H, eps, dtype: tl.constexpr, PRECISE: tl.constexpr, UNIT_OFFSET: tl.constexpr,
               ROUND_ONCE: tl.constexpr):
    """rms_norm_ref of rows x ([ROWS, BLOCK_H] fp32) with weight w_ptr [H], left unrounded in fp32: its one
    remaining rounding is to ``dtype``."""
    inv = _inv_rms(x, H, eps, PRECISE)
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        # Gemma: scale by 1 + w, the product in fp32 and rounded once.
        return (w + 1.0)[None, :] * (x * inv[:, None])
    if ROUND_ONCE:  # OLMo: w times the fp32 row, rounded once
        return w[None, :] * (x * inv[:, None])
    # HF's Llama casts the normalised value to the activation dtype before the weight multiply. Both
    # factors are exact in fp32 (<= 24 mantissa bits together), so the product is torch's one rounding.
    return w[None, :] * (x * inv[:, None]).to(dtype).to(tl.float32)


# n_rows changes from step to step: unspecialised, so no step compiles a variant mid-run.
@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, res_ptr, res_out_ptr, pre_w_ptr,
    n_rows, n_inner, sx_outer, sx_inner, so_outer, so_inner, s_res, s_res_out,
    H, eps, pre_eps,
    HAS_RESIDUAL: tl.constexpr, PRECISE: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr,
    UNIT_OFFSET: tl.constexpr, ROUND_ONCE: tl.constexpr, PRE_NORM: tl.constexpr, PDL: tl.constexpr,
):
    # Row r of the flattened [..., H] input sits at (r // n_inner) * s_outer + (r % n_inner) * s_inner:
    # that covers [T, H] and the strided [T, heads, head_dim] views q/k-norm get from the qkv split.
    # A program takes ROWS rows: narrow ones (q/k-norm's head_dim) in bulk, wide ones alone.
    pdl_prologue(PDL)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    outer, inner = rows // n_inner, rows % n_inner
    cols = tl.arange(0, BLOCK_H)
    mask = (rows < n_rows)[:, None] & (cols < H)[None, :]
    x_offs = (outer * sx_outer + inner * sx_inner)[:, None] + cols[None, :]
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)  # [ROWS, BLOCK_H]
    act_dtype = x_ptr.dtype.element_ty
    if HAS_RESIDUAL:
        act_dtype = res_out_ptr.dtype.element_ty
        if PRE_NORM:  # Gemma's post-norm of the sublayer's output, rounded as its own module's output is
            x = _normalize(x, pre_w_ptr, cols, H, pre_eps, act_dtype, PRECISE, UNIT_OFFSET, ROUND_ONCE)
            x = x.to(act_dtype).to(tl.float32)
        r = tl.load(res_ptr + (rows * s_res)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        # Rounded to the activation dtype first, as torch's x + residual is.
        summed = (x + r).to(act_dtype)
        tl.store(res_out_ptr + (rows * s_res_out)[:, None] + cols[None, :], summed, mask=mask)
        x = summed.to(tl.float32)
    normed = _normalize(x, w_ptr, cols, H, eps, act_dtype, PRECISE, UNIT_OFFSET, ROUND_ONCE)
    out_offs = (outer * so_outer + inner * so_inner)[:, None] + cols[None, :]
    tl.store(out_ptr + out_offs, normed.to(out_ptr.dtype.element_ty), mask=mask)


def _row_layout(t: torch.Tensor) -> tuple[int, int, int, int]:
    """(rows, n_inner, outer stride, inner stride) of a [..., H] tensor with unit stride along H."""
    if t.dim() == 2:
        return t.shape[0], 1, t.stride(0), 0
    return t.shape[0] * t.shape[1], t.shape[1], t.stride(0), t.stride(1)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    # The kernel addresses 2-D and 3-D tensors with unit stride along H; anything else is reshaped.
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 1:
        return t.unsqueeze(0)
    if t.dim() > 3:
        return t.reshape(-1, t.shape[-1])
    return t


def _launch_config(h: int) -> tuple[int, int, int]:
    """(BLOCK_H, rows per program, num_warps) for rows of width h."""
    block_h = triton.next_power_of_2(h)
    rows = max(1, ELEMENTS_PER_PROGRAM // block_h)
    return block_h, rows, max(1, min(MAX_WARPS, rows * block_h // ELEMENTS_PER_WARP))


def supported_hidden(h: int) -> bool:
    return h <= MAX_FUSED_HIDDEN


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, inplace: bool = False,
             unit_offset: bool = False, round_once: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim of x ([T, H] or [T, heads, D]); equals rms_norm_ref (``unit_offset``:
    Gemma's 1 + weight; ``round_once``: OLMo's rounding).

    inplace=True writes the result into x's storage (only when weight's dtype gives x's dtype back).
    """
    # x: [..., H]; weight: [H]
    h = x.shape[-1]
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    rows_view = _as_rows(x)
    if inplace and out_dtype == x.dtype and rows_view.data_ptr() == x.data_ptr():
        out_view = rows_view
    else:
        inplace = False
        out_view = torch.empty(rows_view.shape, dtype=out_dtype, device=x.device)
    n_rows, n_inner, sx_o, sx_i = _row_layout(rows_view)
    if n_rows == 0:
        return out_view.view(x.shape)
    _, _, so_o, so_i = _row_layout(out_view)
    block_h, rows, num_warps = _launch_config(h)
    _rms_norm_kernel[(triton.cdiv(n_rows, rows),)](
        rows_view, weight, out_view, rows_view, rows_view, weight, n_rows, n_inner, sx_o, sx_i, so_o, so_i,
        0, 0, h, eps, 0.0, HAS_RESIDUAL=False, PRECISE=x.is_cuda, BLOCK_H=block_h, ROWS=rows,
        UNIT_OFFSET=unit_offset, ROUND_ONCE=round_once, PRE_NORM=False, num_warps=num_warps, **pdl_args(x),
    )
    return x if inplace else out_view.view(x.shape)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, inplace: bool = False,
    unit_offset: bool = False, pre_weight: torch.Tensor | None = None, pre_eps: float = 0.0,
    round_once: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual) in one pass; equals fused_add_rms_norm_ref. With
    ``pre_weight`` x is first normalised by that norm (Gemma's sandwich: a sublayer's post-norm, the
    residual add and the next pre-norm in one launch).

    inplace=True writes the normed rows into x and the sum into residual (vLLM's convention) and
    returns them; it saves two allocations, not memory traffic. The layers use the out-of-place form.
    """
    # x, residual: [T, H]; weight: [H]
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} must have one shape")
    h = x.shape[-1]
    act_dtype = torch.promote_types(x.dtype, residual.dtype)
    out_dtype = torch.promote_types(weight.dtype, act_dtype)
    x2, r2 = x.reshape(-1, h), residual.reshape(-1, h)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if r2.stride(-1) != 1:
        r2 = r2.contiguous()
    can_inplace = (out_dtype == x.dtype and act_dtype == residual.dtype
                   and x2.data_ptr() == x.data_ptr() and r2.data_ptr() == residual.data_ptr())
    inplace = inplace and can_inplace
    out = x2 if inplace else torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    res_out = r2 if inplace else torch.empty(r2.shape, dtype=act_dtype, device=x.device)
    if x2.shape[0] > 0:
        block_h, rows, num_warps = _launch_config(h)
        _rms_norm_kernel[(triton.cdiv(x2.shape[0], rows),)](
            x2, weight, out, r2, res_out, weight if pre_weight is None else pre_weight, x2.shape[0], 1,
            x2.stride(0), 0, out.stride(0), 0, r2.stride(0), res_out.stride(0), h, eps, pre_eps,
            HAS_RESIDUAL=True, PRECISE=x.is_cuda, BLOCK_H=block_h, ROWS=rows, UNIT_OFFSET=unit_offset,
            ROUND_ONCE=round_once, PRE_NORM=pre_weight is not None, num_warps=num_warps, **pdl_args(x),
        )
    if inplace:
        return x, residual
    return out.view(x.shape), res_out.view(x.shape)
