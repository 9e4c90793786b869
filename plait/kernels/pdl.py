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
# PLAIT_PDL_EARLY=0: a kernel lets its successor launch only after its own wait (A/B comparisons). Read
# once at import: the kernels are compiled with it.
PDL_EARLY_ENV = "PLAIT_PDL_EARLY"
_EARLY = tl.constexpr(os.environ.get(PDL_EARLY_ENV, "1") != "0")


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
    """First statement of a PDL-launched kernel: let the next kernel begin launching, then wait for the
    previous kernel's writes. Without PDL it compiles to nothing.

    Letting the successor launch before waiting is safe (its own wait is for this whole grid to finish)
    and starts a chain of small kernels early: each is resident and waiting when its predecessor ends.
    A kernel's whole grid must have launched before its successor's programs are placed, so a large
    grid is never starved by the one behind it. (Having the o projection also pull its weights into L2
    before its wait, behind attention, measured slower on an H200: 4.72 vs 4.58 ms a batch-1 Llama-8B
    token, the prefetches crowding attention's loads.)"""
    if PDL:
        if _EARLY:
            gdc_launch_dependents()
            gdc_wait()
        else:
            gdc_wait()
            gdc_launch_dependents()

