"""Causal depthwise conv1d over a varlen batch, with per-slot conv state (Triton).

Reference: plait.layers.mamba_ops.causal_conv1d_ref. One launch computes every row's outputs (a
row's first K - 1 taps read its slot's state, or zeros for a first chunk); a second launch then
writes each row's last K - 1 inputs back to its slot. Two launches, because the first reads the
state that the second overwrites, from different programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plait.layers.mamba_ops import MambaRows

BLOCK_T = 16  # tokens per program
BLOCK_D = 64  # channels per program


@triton.jit
def _conv_kernel(x_ptr, w_ptr, b_ptr, state_ptr, out_ptr, qsl_ptr, slot_ptr, first_ptr,
                 stride_x, stride_out, stride_slot, dim,
                 K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    start = tl.load(qsl_ptr + row)
    length = tl.load(qsl_ptr + row + 1) - start
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)  # token offsets within the row
    if tl.program_id(1) * BLOCK_T >= length:
        return
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_t, mask_d = t < length, d < dim
    slot = tl.load(slot_ptr + row)
    has_state = tl.load(first_ptr + row) == 0
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    for k in tl.static_range(K):
        # Tap k of output t reads padded input t + k, where padded = [state (K - 1), row tokens].
        j = t + k
        from_x = (j >= K - 1) & mask_t
        xv = tl.load(x_ptr + (start + j - (K - 1))[:, None] * stride_x + d[None, :],
                     mask=from_x[:, None] & mask_d[None, :], other=0.0)
        from_state = (j < K - 1) & mask_t & has_state
        sv = tl.load(state_ptr + slot * stride_slot + j[:, None] * dim + d[None, :],
                     mask=from_state[:, None] & mask_d[None, :], other=0.0)
        w = tl.load(w_ptr + d * K + k, mask=mask_d, other=0.0).to(tl.float32)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * w[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + (start + t)[:, None] * stride_out + d[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask_t[:, None] & mask_d[None, :])


@triton.jit
def _conv_state_kernel(x_ptr, state_ptr, qsl_ptr, slot_ptr, first_ptr, stride_x, stride_slot, dim,
                       K: tl.constexpr, WIDTH_P2: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    start = tl.load(qsl_ptr + row)
    length = tl.load(qsl_ptr + row + 1) - start
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = d < dim
    slot = tl.load(slot_ptr + row)
    has_state = tl.load(first_ptr + row) == 0
    i = tl.arange(0, WIDTH_P2)  # new state entry i = padded input length + i
    valid = i < K - 1
    j = length + i
    from_x = (j >= K - 1) & valid
    xv = tl.load(x_ptr + (start + j - (K - 1))[:, None] * stride_x + d[None, :],
                 mask=from_x[:, None] & mask_d[None, :], other=0.0)
    from_state = (j < K - 1) & valid & has_state
    sv = tl.load(state_ptr + slot * stride_slot + j[:, None] * dim + d[None, :],
                 mask=from_state[:, None] & mask_d[None, :], other=0.0)
    new = xv.to(tl.float32) + sv.to(tl.float32)
    # Entries are read from the slot above and written below by different threads: all reads first.
    tl.debug_barrier()
    tl.store(state_ptr + slot * stride_slot + i[:, None] * dim + d[None, :],
             new.to(state_ptr.dtype.element_ty), mask=valid[:, None] & mask_d[None, :])


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_state: torch.Tensor, rows: MambaRows, silu: bool = True) -> torch.Tensor:
    """x: [T, D] (rows may be strided), weight: [D, K], conv_state: [slots, K - 1, D] (updated in
    place) -> [T, D]. Same contract as causal_conv1d_ref."""
    num_tokens, dim = x.shape
    kernel = weight.shape[1]
    assert x.stride(1) == 1 and weight.is_contiguous() and conv_state.is_contiguous()
    out = torch.empty((num_tokens, dim), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    grid = (rows.num_rows, triton.cdiv(rows.max_query_len, BLOCK_T), triton.cdiv(dim, BLOCK_D))
    _conv_kernel[grid](x, weight, bias if bias is not None else weight, conv_state, out,
                       rows.query_start_loc, rows.state_slots, rows.is_first_chunk,
                       x.stride(0), out.stride(0), conv_state.stride(0), dim,
                       K=kernel, HAS_BIAS=bias is not None, SILU=silu, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D)
    _conv_state_kernel[(rows.num_rows, triton.cdiv(dim, BLOCK_D))](
        x, conv_state, rows.query_start_loc, rows.state_slots, rows.is_first_chunk,
        x.stride(0), conv_state.stride(0), dim,
        K=kernel, WIDTH_P2=triton.next_power_of_2(max(kernel - 1, 1)), BLOCK_D=BLOCK_D)
    return out
