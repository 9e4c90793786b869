"""What Triton's CPU interpreter cannot run as compiled kernels do, and the work-around kernels share."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def trip_count(STATIC_ITERS: tl.constexpr, iters):
    # The Triton interpreter under numpy >= 2.4 cannot loop to a runtime bound, so there the trip
    # count is baked in (STATIC_ITERS > 0); compiled kernels take iters at run time, so one
    # binary serves every size. (Returned, never assigned: the interpreter turns assigned ints into
    # tensors, which range() then rejects.)
    if STATIC_ITERS > 0:
        return STATIC_ITERS
    else:
        return iters


def static_iters(on_cuda: bool, iters: int) -> int:
    """The STATIC_ITERS argument for trip_count: 0 (read at run time) when compiled for CUDA."""
    return 0 if on_cuda else iters
