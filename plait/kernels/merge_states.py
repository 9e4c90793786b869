"""merge_attn_states in Triton: combine two partial attention results by LSE, NaN-safe for empty sides.

The torch reference is ``plait.attention.merge.merge_attn_states``; this kernel has its semantics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_states_kernel(
    out_ptr, lse_ptr, out_a_ptr, lse_a_ptr, out_b_ptr, lse_b_ptr,
    num_heads, stride_ot, stride_oh, stride_at, stride_ah, stride_bt, stride_bh,
    stride_lse_t, stride_lse_at, stride_lse_bt,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
):
    # One program per (token, head); lse tensors are [T, H] with a unit head stride.
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    lse_a = tl.load(lse_a_ptr + token * stride_lse_at + head)
    lse_b = tl.load(lse_b_ptr + token * stride_lse_bt + head)
    lse_max = tl.maximum(lse_a, lse_b)
    both_empty = lse_max == float("-inf")
    safe_max = tl.where(both_empty, 0.0, lse_max)
    w_a = tl.exp(lse_a - safe_max)  # exp(-inf) = 0 for an empty side
    w_b = tl.exp(lse_b - safe_max)
    denom = w_a + w_b
    inv = tl.where(both_empty, 0.0, 1.0 / tl.where(both_empty, 1.0, denom))

    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    out_a = tl.load(out_a_ptr + token * stride_at + head * stride_ah + dims, mask=dim_ok, other=0.0)
    out_b = tl.load(out_b_ptr + token * stride_bt + head * stride_bh + dims, mask=dim_ok, other=0.0)
    # An empty side is selected away, not multiplied by 0, so whatever it holds (NaN, inf) cannot leak in.
    part_a = tl.where(w_a > 0, out_a.to(tl.float32) * (w_a * inv), 0.0)
    part_b = tl.where(w_b > 0, out_b.to(tl.float32) * (w_b * inv), 0.0)
    merged = part_a + part_b
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, merged.to(out_ptr.dtype.element_ty),
             mask=dim_ok)
    lse = tl.where(both_empty, lse_max, safe_max + tl.log(tl.where(both_empty, 1.0, denom)))
    tl.store(lse_ptr + token * stride_lse_t + head, lse)


def merge_attn_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """out_*: [T, H, D], lse_*: [T, H] fp32 (natural log; -inf where a side attended to nothing).

    Returns (out [T, H, D] in out_a's dtype, lse [T, H] fp32). An empty side contributes nothing,
    whatever its out holds; two empty sides give zeros with lse -inf.
    """
    num_tokens, num_heads, head_dim = out_a.shape
    if out_b.shape != out_a.shape or lse_a.shape != (num_tokens, num_heads) or lse_b.shape != lse_a.shape:
        raise ValueError("out_a/out_b must be [T, H, D] and lse_a/lse_b [T, H]")
    lse_a, lse_b = lse_a.float().contiguous(), lse_b.float().contiguous()
    if out_a.stride(2) != 1 or out_b.stride(2) != 1:
        raise ValueError("out_a and out_b need a contiguous last (head_dim) dimension")
    out = torch.empty(out_a.shape, dtype=out_a.dtype, device=out_a.device)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=out_a.device)
    if num_tokens == 0 or num_heads == 0:
        return out, lse
    _merge_states_kernel[(num_tokens, num_heads)](
        out, lse, out_a, lse_a, out_b, lse_b,
        num_heads, out.stride(0), out.stride(1), out_a.stride(0), out_a.stride(1),
        out_b.stride(0), out_b.stride(1),
        lse.stride(0), lse_a.stride(0), lse_b.stride(0),
        HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim),
    )
    return out, lse
