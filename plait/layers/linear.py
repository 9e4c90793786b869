"""Linear: nn.Linear whose decode-sized matmuls can run on the skinny Triton GEMM on CUDA."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from plait.kernels.dispatch import checked_mode, use_triton

# Which decode-sized matmuls use the skinny Triton GEMM: "auto" only the shapes where it measured faster
# than cuBLAS (plait.kernels.skinny_gemm.SKINNY_CONFIGS), "1" all of them, "0" none.
SKINNY_GEMM_DEFAULT = "auto"
SKINNY_GEMM_ENV = "PLAIT_SKINNY_GEMM"
SKINNY_MODES = ("auto", "0", "1")
# Row counts up to this go to the skinny GEMM (plait.kernels.skinny_gemm.SKINNY_MAX_M, repeated so
# the CPU path never imports triton).
SKINNY_MAX_M = 16
SKINNY_DTYPES = (torch.bfloat16, torch.float16)
# Where the skinny GEMM takes a silu-gated MLP's gate/up projection (GATE_UP_CONFIGS, or mode "1"),
# the projection and silu-and-mul run as one kernel.
FUSE_GATE_UP_SILU = True


# CPU torch's F.linear of fp32 goes to MKL, whose matrix-vector path (1-3 rows) runs on one core. oneDNN's
# linear (the op torch's own CPU compiler emits for linears) uses every core at any row count: a pass over a
# whole SmolLM2's weights on 2 cores took 34 / 37 / 36 / 38 / 70 / 287 ms at 1 / 2 / 3 / 4 / 32 / 256 rows
# against F.linear's 52 / 92 / 117 / 74 / 107 / 359 (benchmarks/results/cpu_linear_onednn_cpu.json). So fp32
# CPU linears take it where torch has it. oneDNN builds a kernel the first time it meets a (rows, weight
# shape) pair and caches it; a model's layers share their shapes, so a step pays that once a shape.
ONEDNN_DTYPES = (torch.float32,)
# Where oneDNN is missing, MKL's 2-3 row inputs are padded with zero rows up to this many, which takes its
# matrix-matrix kernel.
CPU_GEMM_MIN_ROWS = 4


def _onednn_linear_available() -> bool:
    """Whether this torch has oneDNN's linear and it computes one: probed on a tiny input once, so a build
    whose op exists but fails on this CPU keeps F.linear rather than failing every step."""
    try:
        if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
            return False
        x, w = torch.arange(6.0).view(2, 3), torch.arange(12.0).view(4, 3)
        got = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        return torch.equal(got, F.linear(x, w))  # small integers: exact in any summation order
    except (AttributeError, RuntimeError, TypeError):
        return False


_onednn_linear = _onednn_linear_available()


def _needs_grad(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """oneDNN's linear has no backward: a layer used under autograd (outside the runner's inference mode)
    keeps F.linear."""
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; on CPU oneDNN's linear for fp32 (or, without it, 2-3 rows padded to CPU_GEMM_MIN_ROWS)."""
    # x: [..., in_features] -> [..., out_features]
    if x.device.type != "cpu":
        return F.linear(x, weight, bias)
    if _onednn_linear and x.dtype in ONEDNN_DTYPES and weight.dtype == x.dtype and not _needs_grad(x, weight):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 1 < rows < CPU_GEMM_MIN_ROWS:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    padded = torch.cat([flat, flat.new_zeros(CPU_GEMM_MIN_ROWS - rows, flat.shape[1])])
    return F.linear(padded, weight, bias)[:rows].reshape(*x.shape[:-1], weight.shape[0])


def _env_mode(name: str, default: str) -> str:
    return checked_mode(os.environ.get(name) or default, SKINNY_MODES, name)


# Read once at import: forward runs hundreds of times per step. Tests flip it with set_skinny_mode().
_skinny_mode = _env_mode(SKINNY_GEMM_ENV, SKINNY_GEMM_DEFAULT)


def set_skinny_mode(mode: str) -> None:
    global _skinny_mode
    _skinny_mode = checked_mode(mode, SKINNY_MODES, "skinny mode")


def skinny_mode() -> str:
    return _skinny_mode


# Set while the loader builds a model (plait.loader.model_loader): Linear layers are made on the meta
# device, so no random init is drawn for weights the checkpoint overwrites, and the 16-bit weights that
# quantised layers replace never take memory (a 70B model need not fit in bf16 to be served in FP8).
_defer_weights = False


@contextmanager
def deferred_weights(enabled: bool = True) -> Iterator[None]:
    """Within it, every Linear made has its parameters on the meta device (shapes, no memory)."""
    global _defer_weights
    before, _defer_weights = _defer_weights, enabled
    try:
        yield
    finally:
        _defer_weights = before


def deferred_device(device: torch.device | str | None = None) -> torch.device | str | None:
    """Where a layer made now puts its parameters: the meta device inside deferred_weights, else ``device``
    (layers with parameters of their own, e.g. plait.layers.moe.FusedMoE, follow Linear's deferral)."""
    return "meta" if _defer_weights else device


def materialize_deferred(model: nn.Module, device: torch.device) -> None:
    """Give every module left on the meta device by deferred_weights uninitialised memory on ``device``
    (the checkpoint, or random weights, fill it next)."""
    for module in model.modules():
        if any(p.is_meta for p in module.parameters(recurse=False)):
            # Module.to_empty's own work, but through empty_strided: to_empty's empty_like of a meta tensor
            # takes torch's Python reference path, whose first call imports sympy (~0.4 s of every engine
            # process's and tensor-parallel worker's start-up).
            module._apply(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device),
                          recurse=False)


class Linear(nn.Linear):
    """Drop-in nn.Linear (same parameters, init and state dict); see uses_skinny for the GPU route."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias, device=deferred_device(device), dtype=dtype)

    def uses_skinny(self, x: torch.Tensor, gate_up: bool = False) -> bool:
        """True when this x goes through the skinny Triton GEMM rather than F.linear."""
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if not (
            _skinny_mode != "0"
            and 0 < rows <= SKINNY_MAX_M
            and x.dtype in SKINNY_DTYPES
            and x.dtype == self.weight.dtype
            and use_triton(x)
        ):
            return False
        if _skinny_mode == "1":
            return True
        from plait.kernels.skinny_gemm import measured_faster

        n = self.out_features // 2 if gate_up else self.out_features
        return measured_faster(rows, n, self.in_features, gate_up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features]
        if self.uses_skinny(x):
            from plait.kernels.skinny_gemm import skinny_linear

            return skinny_linear(x, self.weight, self.bias)
        return linear(x, self.weight, self.bias)

    def adds_residual(self, x: torch.Tensor) -> bool:
        """True when a matmul of this layer over x's rows can add the residual in its own launch
        (forward_add)."""
        if not self.uses_skinny(x):
            return False
        from plait.kernels.skinny_gemm import fusable_config

        rows = x.numel() // x.shape[-1]
        return fusable_config(rows, self.out_features, self.in_features, x.device)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x @ W.T + residual, its rows' sum-of-squares partials [T, parts] fp32, what a RowNorm of
        the sum needs) in one launch; needs adds_residual(x)."""
        # x: [T, in_features]; residual: [T, out_features]
        from plait.kernels.skinny_gemm import skinny_linear_add

        return skinny_linear_add(x, self.weight, residual)

    @torch.no_grad()
    def fold_norm_weight(self, norm_weight: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        """W <- W * norm_weight along the input: this layer then takes the norm's un-weighted output, or
        the un-normalised stream itself with the norm's row scale applied to its output further on.
        One more bf16 rounding of each weight; the runner does it only for 16-bit GPU models. ``rows``
        (first, count): only those (rows loaded again into a folded layer)."""
        w = self.weight if rows is None else self.weight[rows[0] : rows[0] + rows[1]]
        w.copy_((w.float() * norm_weight.float()).to(w.dtype))

    def fuses_gate_up_silu(self, x: torch.Tensor) -> bool:
        """True when gate_up_silu(x) runs as one fused skinny kernel (this layer being [gate; up])."""
        return FUSE_GATE_UP_SILU and self.bias is None and self.uses_skinny(x, gate_up=True)

    def gate_up_silu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x @ gate.T) * (x @ up.T) for this fused [gate; up] weight; needs fuses_gate_up_silu(x)."""
        # x: [..., in_features] -> [..., out_features / 2]
        from plait.kernels.skinny_gemm import skinny_gate_up_silu

        return skinny_gate_up_silu(x, self.weight)


# Whether torch.mm can write fp32 from 16-bit inputs on this device (aten::mm.dtype; CUDA only).
# None until the first try.
_mm_fp32_out: bool | None = None


def logits_fp32(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden @ weight.T with fp32 output: [S, H] x [V, H] -> [S, V].

    Logits rounded to bf16 keep 8 bits of mantissa, so across a vocabulary of 10^4-10^5 the top two
    tie exactly now and then, and greedy decoding would break such ties by rounding noise. The GEMM
    accumulates in fp32 anyway; writing its fp32 result costs no more than writing bf16 and widening.
    """
    global _mm_fp32_out
    if hidden.dtype == torch.float32:
        return linear(hidden, weight)
    rows = hidden.shape[0]
    if 0 < rows <= SKINNY_MAX_M and hidden.dtype in SKINNY_DTYPES and use_triton(hidden):
        # Decode-sized: the skinny kernel reads the lm_head as fast as cuBLAS and writes fp32 directly
        # (torch.mm's fp32-output GEMM measured slower at one row: 4.68 vs 4.52 ms a Llama-8B token).
        from plait.kernels.skinny_gemm import LOGITS_CONFIG, skinny_linear

        return skinny_linear(hidden, weight, config=LOGITS_CONFIG, out_dtype=torch.float32)
    if hidden.is_cuda and _mm_fp32_out is not False:
        try:
            out = torch.mm(hidden, weight.t(), out_dtype=torch.float32)
            _mm_fp32_out = True
            return out
        except (RuntimeError, TypeError):  # a torch without mm(out_dtype=...) for this device
            _mm_fp32_out = False
    return linear(hidden, weight).float()
