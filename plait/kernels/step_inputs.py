"""prepare_step_inputs: a staged step lands in the fixed input buffers, pending ids patched (Triton)."""

# A step's inputs arrive on the device as one flat int64 copy. Before the forward reads them, three
# things used to take seven launches on a decode step's critical path (an index_select and an
# index_copy for the input ids still on the device, five narrowing casts inside the graph); here
# they are one: every element is copied to the fixed int64 buffer and to its int32 mirror, and an
# input id staged as a pending marker is replaced by the id the previous step sampled. Its torch
# reference, which CPU runs use (they need no triton), is plait.runner.input_buffers.prepare_step_inputs_ref.

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements per program: a decode step stages a few thousand, a large prompt step ~10^5.
BLOCK = 1024


# Triton compiles a kernel anew for every "== 1" / "% 16 == 0" pattern of its int arguments and every
# alignment of its pointers. A step's element and token counts change from step to step (a decode step's
# 4 tokens, a mixed step's 256), and the previous step's sampled ids may be a slice at any offset: each new
# combination stopped a step for a ~90 ms compile (W4's first mixed step on an H200). None of them is used
# for vector loads, so the kernel takes them unspecialised.
@triton.jit(do_not_specialize=["used", "num_tokens"], do_not_specialize_on_alignment=["prev_ids_ptr"])
def _prepare_kernel(staged_ptr, prev_ids_ptr, out64_ptr, out32_ptr, used, num_tokens,
                    HAS_PREV: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < used
    v = tl.load(staged_ptr + offs, mask=mask, other=0)
    if HAS_PREV:
        pending = mask & (offs < num_tokens) & (v < 0)
        v = tl.where(pending, tl.load(prev_ids_ptr + (-v - 1), mask=pending, other=0), v)
    tl.store(out64_ptr + offs, v, mask=mask)
    tl.store(out32_ptr + offs, v.to(tl.int32), mask=mask)


def prepare_step_inputs(
    staged: torch.Tensor, num_tokens: int, prev_ids: torch.Tensor | None, out64: torch.Tensor,
    out32: torch.Tensor,
) -> None:
    """As plait.runner.input_buffers.prepare_step_inputs_ref, in one launch and without a host sync
    (markers need ``prev_ids``: the runner stages them only for the step it passes as ``prev``)."""
    used = staged.shape[0]
    if used == 0:
        return
    has_prev = prev_ids is not None and prev_ids.numel() > 0
    _prepare_kernel[(triton.cdiv(used, BLOCK),)](
        staged, prev_ids if has_prev else staged, out64, out32, used, num_tokens,
        HAS_PREV=has_prev, BLOCK=BLOCK,
    )
