"""The chunked SSD scan over a varlen batch, state addressed by slot (Triton).

Reference: plait.layers.mamba_ops.ssd_scan_ref (through ssd_varlen_ref). One program per (row,
head) walks its row chunk by chunk: within a chunk the output is a causal, decay-weighted C.B^T
product applied to x (tensor-core dots); the state carried in registers ([N, P], fp32) adds the
contribution of everything before the chunk and is updated at its end. A row starts from its slot's
state, or from zeros when it is a first chunk; its final state goes back to the slot. One-token rows
return at once: ``ssd_varlen`` runs the single-step kernel for them.

The kernel's chunk length is its own tile size, independent of the model's ``chunk_size``:
chunking the scan changes only rounding, never the result.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plait.kernels.mamba_step import check_ssd_layout, selective_state_update_varlen, softplus_clamped
from plait.layers.mamba_ops import SOFTPLUS_THRESHOLD, MambaRows

# Chunk (tile) length on the GPU; tl.dot needs at least 16.
BLOCK_Q = 64
MIN_DOT_DIM = 16


@triton.jit
def _scan_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, dt_bias_ptr, state_ptr, y_ptr,
                 qsl_ptr, slot_ptr, first_ptr,
                 stride_x, stride_dt, stride_bc, stride_y, stride_slot, dt_lo, dt_hi,
                 HEAD_DIM: tl.constexpr, STATE: tl.constexpr, HEADS_PER_GROUP: tl.constexpr,
                 BLOCK_Q: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                 THRESHOLD: tl.constexpr, PRECISION: tl.constexpr):
    row, h = tl.program_id(0), tl.program_id(1)
    start = tl.load(qsl_ptr + row)
    length = tl.load(qsl_ptr + row + 1) - start
    if length <= 1:
        return
    slot = tl.load(slot_ptr + row)
    has_state = tl.load(first_ptr + row) == 0
    g = h // HEADS_PER_GROUP
    a = tl.load(a_ptr + h).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    skip = tl.load(d_ptr + h).to(tl.float32)
    p = tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    q = tl.arange(0, BLOCK_Q)
    mask_p, mask_n = p < HEAD_DIM, n < STATE
    # state_t: [BLOCK_N, BLOCK_P], the slot's [P, N] state transposed so C @ state_t is a plain dot.
    s_ptrs = state_ptr + slot * stride_slot + h * HEAD_DIM * STATE + p[None, :] * STATE + n[:, None]
    s_mask = mask_n[:, None] & mask_p[None, :]
    state_t = tl.load(s_ptrs, mask=s_mask & has_state, other=0.0).to(tl.float32)
    causal = q[:, None] >= q[None, :]
    c0 = 0
    # A while loop, not range(): the Triton interpreter cannot take a loaded scalar as a range bound.
    while c0 < length:
        mask_q = c0 + q < length
        tok = start + c0 + q
        dt = tl.load(dt_ptr + tok * stride_dt + h, mask=mask_q, other=0.0).to(tl.float32)
        # Padding tokens get dt = 0: no decay, no contribution.
        dt = tl.where(mask_q, softplus_clamped(dt + dt_bias, dt_lo, dt_hi, THRESHOLD), 0.0)
        acs = tl.cumsum(dt * a, axis=0)  # [Q]: log-decay from the chunk start to each token
        x = tl.load(x_ptr + tok[:, None] * stride_x + h * HEAD_DIM + p[None, :],
                    mask=mask_q[:, None] & mask_p[None, :], other=0.0).to(tl.float32)  # [Q, P]
        bc_off = tok[:, None] * stride_bc + g * STATE + n[None, :]
        bc_mask = mask_q[:, None] & mask_n[None, :]
        b = tl.load(b_ptr + bc_off, mask=bc_mask, other=0.0).to(tl.float32)  # [Q, N]
        c = tl.load(c_ptr + bc_off, mask=bc_mask, other=0.0).to(tl.float32)
        scores = tl.dot(c, tl.trans(b), input_precision=PRECISION)  # [Q, Q]
        decay = tl.exp(tl.where(causal, acs[:, None] - acs[None, :], float("-inf")))
        y = tl.dot(scores * decay * dt[None, :], x, input_precision=PRECISION)  # [Q, P]
        y += tl.dot(c, state_t, input_precision=PRECISION) * tl.exp(acs)[:, None]
        y += skip * x
        tl.store(y_ptr + tok[:, None] * stride_y + h * HEAD_DIM + p[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=mask_q[:, None] & mask_p[None, :])
        total = tl.sum(dt * a, axis=0)
        weight = tl.exp(total - acs) * dt  # [Q]: how much of token j survives to the chunk end
        added = tl.dot(tl.trans(b * weight[:, None]), x, input_precision=PRECISION)  # [N, P]
        state_t = state_t * tl.exp(total) + added
        c0 += BLOCK_Q
    tl.store(s_ptrs, state_t.to(state_ptr.dtype.element_ty), mask=s_mask)


def ssd_scan_varlen(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                    D: torch.Tensor, dt_bias: torch.Tensor, dt_limit: tuple[float, float],
                    ssm_state: torch.Tensor, rows: MambaRows, y: torch.Tensor,
                    block_q: int = BLOCK_Q) -> None:
    """Fill y's rows of two or more tokens and leave each row's final state in its slot.
    Shapes as selective_state_update_varlen."""
    _, num_heads, head_dim = x.shape
    num_groups, state_size = B.shape[1], B.shape[2]
    check_ssd_layout(x, dt, B, C, ssm_state, y)
    # fp32 models (tests) want exact fp32 dots; 16-bit models lose nothing to tf32.
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    _scan_kernel[(rows.num_rows, num_heads)](
        x, dt, A, B, C, D, dt_bias, ssm_state, y, rows.query_start_loc, rows.state_slots, rows.is_first_chunk,
        x.stride(0), dt.stride(0), B.stride(0), y.stride(0), ssm_state.stride(0),
        float(dt_limit[0]), float(dt_limit[1]),
        HEAD_DIM=head_dim, STATE=state_size, HEADS_PER_GROUP=num_heads // num_groups, BLOCK_Q=block_q,
        BLOCK_P=max(triton.next_power_of_2(head_dim), MIN_DOT_DIM),
        BLOCK_N=max(triton.next_power_of_2(state_size), MIN_DOT_DIM),
        THRESHOLD=SOFTPLUS_THRESHOLD, PRECISION=precision, num_warps=8 if block_q >= 64 else 4)


def ssd_varlen(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               D: torch.Tensor, dt_bias: torch.Tensor, dt_limit: tuple[float, float], ssm_state: torch.Tensor,
               rows: MambaRows, chunk_size: int, block_q: int = BLOCK_Q) -> torch.Tensor:
    """Every row of the step: the scan for rows of two or more tokens, one recurrence step for
    one-token rows. Same contract as ssd_varlen_ref (``chunk_size`` is the model's; the kernel
    tiles by ``block_q`` instead, which changes only rounding)."""
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return y
    A, D, dt_bias = A.float(), D.float(), dt_bias.float()
    ssd_scan_varlen(x, dt, A, B, C, D, dt_bias, dt_limit, ssm_state, rows, y, block_q)
    selective_state_update_varlen(x, dt, A, B, C, D, dt_bias, dt_limit, ssm_state, rows, y)
    return y
