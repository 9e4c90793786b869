"""Neox-style rotary embedding of q and k in one Triton launch, with its torch reference."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plait.kernels.pdl import pdl_args, pdl_prologue

# Heads rotated by one program: a decode token's q and k heads take a couple of programs, not dozens.
HEADS_PER_PROGRAM = 16


def rotary_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """plait.layers.rotary.RotaryEmbedding.forward with its cos_sin table passed in."""
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)  # each [T, 1, D/2]
    return _rotate_ref(q, cos, sin), _rotate_ref(k, cos, sin)


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(dtype)


@triton.jit
def rotate_halves(x1, x2, cos, sin):
    """x1, x2: [heads, D/2] fp32 halves; cos, sin: [D/2]. _rotate_ref's arithmetic: products and
    differences rounded one by one as torch does, so launches must turn off FMA contraction."""
    return x1 * cos[None, :] - x2 * sin[None, :], x2 * cos[None, :] + x1 * sin[None, :]


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, tok, heads, n_heads, s_tok, s_head, so_tok, so_head, cos, sin,
                  d, d_mask, HALF: tl.constexpr):
    mask = (heads < n_heads)[:, None] & d_mask[None, :]
    src = src_ptr + tok * s_tok + heads[:, None] * s_head + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    out1, out2 = rotate_halves(x1, x2, cos, sin)
    dst = dst_ptr + tok * so_tok + heads[:, None] * so_head + d[None, :]
    tl.store(dst, out1.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, out2.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def load_cos_sin(cs_ptr, pos_ptr, tok, s_cs, HALF: tl.constexpr, BLOCK: tl.constexpr):
    """(d, d_mask, cos, sin): the half-dim lanes and token ``tok``'s cos and sin at its position."""
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    d = tl.arange(0, BLOCK)
    d_mask = d < HALF
    cos = tl.load(cs_ptr + pos * s_cs + d, mask=d_mask, other=0.0)
    sin = tl.load(cs_ptr + pos * s_cs + HALF + d, mask=d_mask, other=0.0)
    return d, d_mask, cos, sin


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cs_ptr,
    sq_t, sq_h, sk_t, sk_h, sqo_t, sqo_h, sko_t, sko_h, s_cs,
    HQ, HKV, q_blocks,
    HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):
    # Program (token, head block): the first q_blocks head blocks are q's, the rest k's.
    pdl_prologue(PDL)
    tok = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    d, d_mask, cos, sin = load_cos_sin(cs_ptr, pos_ptr, tok, s_cs, HALF, BLOCK_D)
    if hb < q_blocks:
        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        _rotate_heads(q_ptr, q_out_ptr, tok, heads, HQ, sq_t, sq_h, sqo_t, sqo_h, cos, sin, d, d_mask, HALF)
    else:
        heads = (hb - q_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        _rotate_heads(k_ptr, k_out_ptr, tok, heads, HKV, sk_t, sk_h, sko_t, sko_h, cos, sin, d, d_mask, HALF)


def apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, inplace: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k at per-token positions in one launch; equals rotary_ref.

    positions index cos_sin unchecked (no host sync): callers keep them below max_positions.
    inplace=True writes the rotated values back into q and k (which may be strided views).
    """
    # positions: [T] int; q: [T, Hq, D]; k: [T, Hkv, D]; cos_sin: [max_positions, D] fp32
    t, hq, d = q.shape
    hkv = k.shape[1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    cos_sin, positions = cos_sin.contiguous(), positions.contiguous()
    q_out = q if inplace else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = k if inplace else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if t == 0:
        return q_out, k_out
    block_h = min(HEADS_PER_PROGRAM, triton.next_power_of_2(max(hq, hkv)))
    q_blocks = triton.cdiv(hq, block_h)
    grid = (t, q_blocks + triton.cdiv(hkv, block_h))
    _rotary_kernel[grid](
        q, k, q_out, k_out, positions, cos_sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin.stride(0),
        hq, hkv, q_blocks,
        HALF=d // 2, BLOCK_D=triton.next_power_of_2(d // 2), BLOCK_H=block_h,
        num_warps=4, enable_fp_fusion=False, **pdl_args(q),
    )
    return q_out, k_out
