"""FP8 weight-only quantisation: Fp8Linear, and the pass that swaps it in for a model's Linear layers."""

# vLLM's `--quantization fp8` on an unquantised checkpoint: every linear layer but the lm_head keeps its
# weight as float8_e4m3fn codes with one fp32 scale per output row (amax / 448), half the bytes of bf16.
# Activations stay 16-bit (W8A16): a matmul computes x @ (code * scale)^T with the product summed in fp32,
# so every row of a batch sees the same weight whatever else is in the step. Decode-sized steps read the
# 8-bit weight directly (plait.kernels.skinny_gemm, the scale applied to the fp32 sums); larger ones
# widen the weight to x's dtype and run F.linear, where matmuls are compute-bound anyway.

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.config import QUANTIZATION_METHODS
from plait.kernels.dispatch import use_triton

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# A row of zeros still gets a positive scale, so that dequantising never divides by zero.
MIN_SCALE = 1e-12
# Layers left in 16 bits: the lm_head (the logits' precision; tied to the embedding in some models).
SKIPPED_LAYERS = ("lm_head",)
SKINNY_MAX_M = 16  # plait.kernels.skinny_gemm.SKINNY_MAX_M (repeated so the CPU path never imports triton)
SKINNY_DTYPES = (torch.bfloat16, torch.float16)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales): each row scaled so its largest magnitude lands on FP8_MAX, rounded to FP8."""
    # weight: [N, K] -> codes: [N, K] float8_e4m3fn; scales: [N] fp32
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp_min(MIN_SCALE)
    codes = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scale


def dequantize_rows(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """code * scale per row in fp32, rounded to dtype: the weight that codes and scales stand for."""
    # weight: [N, K] 8-bit; weight_scale: [N] fp32 -> [N, K] dtype
    return (weight.float() * weight_scale[:, None]).to(dtype)


class Fp8Linear(nn.Module):
    """A Linear whose weight is FP8 codes with per-row scales, with plait.layers.linear.Linear's interface
    (forward, and the fused decode paths the models ask for)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.weight = nn.Parameter(codes, requires_grad=False)  # [N, K] float8_e4m3fn
        self.register_buffer("weight_scale", scale.contiguous())  # [N] fp32
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.compute_dtype = compute_dtype  # the model's dtype: what x and the output are

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        codes, scale = quantize_rows(linear.weight.detach())
        bias = linear.bias.detach() if linear.bias is not None else None
        return cls(codes, scale, bias, linear.weight.dtype)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_rows(self.weight, self.weight_scale, dtype)

    def uses_skinny(self, x: torch.Tensor, gate_up: bool = False) -> bool:
        """True when x's rows go through the skinny Triton GEMM, reading the 8-bit weight."""
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        return (not gate_up and 0 < rows <= SKINNY_MAX_M and x.dtype in SKINNY_DTYPES and use_triton(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features]
        if self.uses_skinny(x):
            from plait.kernels.skinny_gemm import skinny_linear

            return skinny_linear(x, self.weight, self.bias, weight_scale=self.weight_scale)
        if x.dtype in SKINNY_DTYPES and use_triton(x):  # widen the weight inside the matmul, not before it
            from plait.kernels.fp8_gemm import fp8_linear

            return fp8_linear(x, self.weight, self.weight_scale, self.bias)
        return F.linear(x, self.dequantized(x.dtype), self.bias)

    def adds_residual(self, x: torch.Tensor) -> bool:
        if not self.uses_skinny(x) or self.bias is not None:
            return False
        from plait.kernels.skinny_gemm import fusable_config

        rows = x.numel() // x.shape[-1]
        return fusable_config(rows, self.out_features, self.in_features, x.device, fp8=True)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As Linear.forward_add: (x @ W.T + residual, its rows' sum-of-squares partials)."""
        from plait.kernels.skinny_gemm import skinny_linear_add

        return skinny_linear_add(x, self.weight, residual, weight_scale=self.weight_scale)

    def fuses_gate_up_silu(self, x: torch.Tensor) -> bool:
        return False  # gate/up + SiLU in one launch is a 16-bit-weight kernel

    def gate_up_silu(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("Fp8Linear has no fused gate/up + SiLU (fuses_gate_up_silu is False)")

    def fold_norm_weight(self, norm_weight: torch.Tensor) -> None:
        raise RuntimeError("fold norm weights into a layer before quantising it, not after")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 per-row scales"


@torch.no_grad()
def quantize_model(model: nn.Module, method: str) -> int:
    """Replace every nn.Linear of ``model`` but SKIPPED_LAYERS with its quantised form, from outside the
    model (its code is unchanged); returns how many layers were replaced."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS}, got {method!r}")
    targets = [(name, module) for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] not in SKIPPED_LAYERS]
    count = len(targets)
    while targets:  # popped one by one, so each 16-bit weight is freed once its layer is replaced
        name, module = targets.pop()
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Fp8Linear.from_linear(module))
    return count
