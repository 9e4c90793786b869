"""One selective-state-space recurrence step per one-token row, state addressed by slot (Triton).

Reference: plait.layers.mamba_ops.ssm_step_ref (through ssd_varlen_ref). Launched over every row of
the step; rows of more than one token return at once (the chunked scan takes them). A one-token
row starts from zero state iff it is a first chunk (a one-token prompt), whatever its slot holds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plait.layers.mamba_ops import SOFTPLUS_THRESHOLD, MambaRows


@triton.jit
def softplus_clamped(v, lo, hi, THRESHOLD: tl.constexpr):
    v = tl.where(v > THRESHOLD, v, tl.log(1.0 + tl.exp(tl.minimum(v, THRESHOLD))))
    return tl.minimum(tl.maximum(v, lo), hi)


@triton.jit
def _step_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, dt_bias_ptr, state_ptr, y_ptr,
                 qsl_ptr, slot_ptr, first_ptr,
                 stride_x, stride_dt, stride_bc, stride_y, stride_slot, dt_lo, dt_hi,
                 HEAD_DIM: tl.constexpr, STATE: tl.constexpr, HEADS_PER_GROUP: tl.constexpr,
                 BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, THRESHOLD: tl.constexpr):
    row, h = tl.program_id(0), tl.program_id(1)
    t = tl.load(qsl_ptr + row)
    if tl.load(qsl_ptr + row + 1) - t != 1:
        return
    slot = tl.load(slot_ptr + row)
    has_state = tl.load(first_ptr + row) == 0
    g = h // HEADS_PER_GROUP
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    mask_p, mask_n = p < HEAD_DIM, n < STATE
    x = tl.load(x_ptr + t * stride_x + h * HEAD_DIM + p, mask=mask_p, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + t * stride_dt + h).to(tl.float32) + tl.load(dt_bias_ptr + h).to(tl.float32)
    dt = softplus_clamped(dt, dt_lo, dt_hi, THRESHOLD)
    a = tl.load(a_ptr + h).to(tl.float32)
    b = tl.load(b_ptr + t * stride_bc + g * STATE + n, mask=mask_n, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + t * stride_bc + g * STATE + n, mask=mask_n, other=0.0).to(tl.float32)
    # state: [BLOCK_P, BLOCK_N] of slot's [H, P, N]
    s_ptrs = state_ptr + slot * stride_slot + h * HEAD_DIM * STATE + p[:, None] * STATE + n[None, :]
    s_mask = mask_p[:, None] & mask_n[None, :]
    s = tl.load(s_ptrs, mask=s_mask & has_state, other=0.0).to(tl.float32)
    s = s * tl.exp(dt * a) + (dt * x)[:, None] * b[None, :]
    y = tl.sum(s * c[None, :], axis=1) + tl.load(d_ptr + h).to(tl.float32) * x
    tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=s_mask)
    tl.store(y_ptr + t * stride_y + h * HEAD_DIM + p, y.to(y_ptr.dtype.element_ty), mask=mask_p)


def selective_state_update_varlen(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                                  C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor,
                                  dt_limit: tuple[float, float], ssm_state: torch.Tensor, rows: MambaRows,
                                  y: torch.Tensor) -> None:
    """Fill y's one-token rows and advance their slots' state by one step.

    x: [T, H, P]; dt: [T, H] raw; A (negative), D, dt_bias: [H] fp32; B, C: [T, G, N];
    ssm_state: [slots, H, P, N]; y: [T, H, P] contiguous.
    """
    _, num_heads, head_dim = x.shape
    num_groups, state_size = B.shape[1], B.shape[2]
    check_ssd_layout(x, dt, B, C, ssm_state, y)
    block_p = min(triton.next_power_of_2(head_dim), 64)
    grid = (rows.num_rows, num_heads, triton.cdiv(head_dim, block_p))
    _step_kernel[grid](x, dt, A, B, C, D, dt_bias, ssm_state, y,
                       rows.query_start_loc, rows.state_slots, rows.is_first_chunk,
                       x.stride(0), dt.stride(0), B.stride(0), y.stride(0), ssm_state.stride(0),
                       float(dt_limit[0]), float(dt_limit[1]),
                       HEAD_DIM=head_dim, STATE=state_size, HEADS_PER_GROUP=num_heads // num_groups,
                       BLOCK_P=block_p, BLOCK_N=triton.next_power_of_2(state_size),
                       THRESHOLD=SOFTPLUS_THRESHOLD)


def check_ssd_layout(x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                  ssm_state: torch.Tensor, y: torch.Tensor) -> None:
    # Token rows may be strided (views into the projection output); within a token, dense.
    assert x.stride(2) == 1 and x.stride(1) == x.shape[2] and dt.stride(1) == 1
    assert B.stride() == C.stride() and B.stride(2) == 1 and B.stride(1) == B.shape[2]
    assert ssm_state.is_contiguous() and y.is_contiguous()
