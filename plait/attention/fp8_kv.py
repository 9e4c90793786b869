"""The FP8 KV cache format: per-layer scales, and writing / reading float8 codes in torch (the reference)."""

# With kv_cache_dtype="fp8" (vLLM's --kv-cache-dtype fp8) every attention layer's cache holds float8_e4m3fn
# codes: a stored K element is code * k_scale, a V element code * v_scale, one pair of fp32 scales per layer
# (1.0 unless the checkpoint carries calibrated ones, as vLLM). Storing multiplies by the fp32 reciprocal of
# the scale, saturates at +-448 and rounds to nearest even: the same multiply in torch and in the Triton
# kernels, so both write the same codes. Readers fold the scales into the arithmetic (k_scale into the
# softmax scale, v_scale into the output) rather than widening each element twice.

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from plait.layers.fp8 import FP8_DTYPE, FP8_MAX

KV_CACHE_TORCH_DTYPES = {"fp8": FP8_DTYPE}


@dataclass(frozen=True)
class KVScales:
    """One layer's KV-cache scales: a stored code times its scale is the value. Set by the runner."""

    k: float = 1.0
    v: float = 1.0

    @functools.cached_property  # read by every layer's store in every eager step
    def inverse(self) -> tuple[float, float]:
        """(1 / k, 1 / v) rounded to fp32: what a value is multiplied by before it is rounded to a code."""
        return float(np.float32(1.0) / np.float32(self.k)), float(np.float32(1.0) / np.float32(self.v))


UNIT_SCALES = KVScales()


def cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' dtype for EngineConfig.kv_cache_dtype ("auto": the model's)."""
    return KV_CACHE_TORCH_DTYPES.get(kv_cache_dtype, model_dtype)


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype, inv_scale: float) -> torch.Tensor:
    """x as a cache of ``cache_dtype`` stores it: a cast, or FP8 codes of x * inv_scale (fp32, saturated)."""
    if cache_dtype != FP8_DTYPE:
        return x.to(cache_dtype)
    return (x.float() * inv_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def from_cache(stored: torch.Tensor, scale: float) -> torch.Tensor:
    """Cache elements as the fp32 values they stand for (codes times ``scale`` for FP8)."""
    values = stored.float()
    return values * scale if stored.dtype == FP8_DTYPE and scale != 1.0 else values
