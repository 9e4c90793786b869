"""Whether a tensor's op should go through a Triton kernel: one check, shared by every layer."""

from __future__ import annotations

import functools
import os

import torch

# PLAIT_DISABLE_TRITON=1 forces every layer onto its torch code (A/B comparisons on a GPU).
DISABLE_TRITON_ENV = "PLAIT_DISABLE_TRITON"
# Dtypes every dense kernel here is written and tested for.
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Read once: the check runs several times per layer per step, and os.environ lookups are not free.
# Tests flip it with set_triton_enabled().
_enabled = os.environ.get(DISABLE_TRITON_ENV, "0") != "1"
# Tests only: with TRITON_INTERPRET=1, CPU tensors take the kernel path too, so a whole model's
# wiring to the kernels can be checked without a GPU.
_cpu_interpreter = False


@functools.cache
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def set_triton_enabled(enabled: bool) -> None:
    """Process-wide switch (the env var's effect, settable at run time for tests and benchmarks)."""
    global _enabled
    _enabled = enabled


def triton_enabled() -> bool:
    return _enabled


def set_cpu_interpreter(enabled: bool) -> None:
    """Tests only: send CPU tensors through the kernels (needs TRITON_INTERPRET=1 set before import)."""
    global _cpu_interpreter
    if enabled and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("CPU tensors can only run Triton kernels under TRITON_INTERPRET=1")
    _cpu_interpreter = enabled


def on_kernel_device(t: torch.Tensor) -> bool:
    """Whether ``t`` lives where the layers that have no torch path fit for a GPU (the Mamba2 mixer's: its
    reference runs row by row) run their kernels: on CUDA, or on the CPU under the tests' interpreter."""
    return t.is_cuda or _cpu_interpreter


def checked_mode(value: str, modes: tuple[str, ...], what: str) -> str:
    """value if it is one of modes, else a ValueError naming what was set (an env var, a setter)."""
    if value not in modes:
        raise ValueError(f"{what} must be one of {modes}, got {value!r}")
    return value


def use_triton(t: torch.Tensor) -> bool:
    """True when ``t`` lives on CUDA, triton imports, the switch is on and no gradient is wanted.

    The kernels have no backward, so anything recording autograd stays on the torch path.
    """
    return (
        _enabled
        and (t.is_cuda or _cpu_interpreter)
        and t.dtype in TRITON_DTYPES
        and not torch.is_grad_enabled()
        and triton_importable()
    )
