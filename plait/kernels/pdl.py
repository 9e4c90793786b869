"""Programmatic dependent launch (Hopper and later): a kernel is launched while the one before it drains.

A kernel launched with ``launch_pdl=True`` may start before its predecessor in the stream has finished;
it must wait (``griddepcontrol.wait``) before touching memory, which ``pdl_prologue`` does as its first
statement. It then lets its own successor start launching. A batch-1 decode step is ~350 small kernels
back to back in one CUDA graph, so each launch's latency is paid ~350 times a token.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# PLAIT_PDL=0 launches every kernel plainly (A/B comparisons).
PDL_ENV = "PLAIT_PDL"
_enabled = os.environ.get(PDL_ENV, "1") != "0"
MIN_CAPABILITY = (9, 0)


@functools.cache
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= MIN_CAPABILITY


def set_pdl_enabled(enabled: bool) -> None:
    global _enabled
    _enabled = enabled


def use_pdl(t: torch.Tensor) -> bool:
    """Launch a kernel on ``t``'s device with PDL: a CUDA device of compute capability 9.0 or later, and
    not the interpreter (it has no griddepcontrol)."""
    return (_enabled and t.is_cuda and not triton.knobs.runtime.interpret
            and _device_supports(t.device.index if t.device.index is not None else 0))


def pdl_args(t: torch.Tensor) -> dict[str, bool]:
    """Launch keywords for a kernel with a ``PDL`` constexpr: the flag, and the launch attribute."""
    pdl = use_pdl(t)
    return {"PDL": pdl, "launch_pdl": pdl}


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """Before a PDL-launched kernel first touches what the previous kernel wrote: wait for it, then let
    the next kernel begin launching. Without PDL it compiles to nothing.

    (Measured and not kept, on an H200: letting the successor launch before the wait, and having the
    o projection pull its weights into L2 before its wait behind attention: 4.72 ms a batch-1 Llama-8B
    token with both, 4.58 without the prefetch, no gain from the early launch alone.)"""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
