"""W8A16 matmul in Triton: 16-bit activations times FP8 weights with per-row scales (prompt-sized steps)."""

# Each program computes a [BLOCK_M, BLOCK_N] tile of x @ (code * scale)^T: the weight tile is loaded as
# 8-bit codes (half the bytes of bf16), widened exactly to x's dtype in registers and fed to tl.dot with
# fp32 accumulation; the row scales multiply the fp32 sums once, in the epilogue. Widening inside the
# kernel, instead of materialising a 16-bit copy of the weight per matmul, keeps the weight traffic at
# one byte per element, so prompt-sized FP8 steps cost about what 16-bit ones do.

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from plait.kernels.interpreter import static_iters, trip_count
from plait.layers.fp8 import dequantize_rows


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8  # M tiles walked together, so a band of weight tiles stays in L2 across them


# Tiles by the step's row count (the last entry whose bound is >= M); measured on an H200.
CONFIGS: list[tuple[int, GemmConfig]] = [
    (64, GemmConfig(64, 128, 128, 4, 4)),
    (1 << 62, GemmConfig(128, 128, 64, 8, 4)),
]


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.nn.functional.linear(x, dequantize_rows(weight, weight_scale, x.dtype), bias)


def config_for(m: int) -> GemmConfig:
    return next(cfg for bound, cfg in CONFIGS if m <= bound)


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om, k_iters,
    STATIC_K_ITERS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % rows_in_group
    pid_n = (pid % (GROUP_M * tiles_n)) // rows_in_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past the end re-read the last valid one (results dropped at the store), keeping loads unmasked.
    rows_m = tl.minimum(offs_m, M - 1).to(tl.int64)
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    x_ptrs = x_ptr + rows_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + rows_n[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for it in range(trip_count(STATIC_K_ITERS, k_iters)):
        k0 = it * BLOCK_K
        if EVEN_K:
            x = tl.load(x_ptrs + k0)
            w = tl.load(w_ptrs + k0)
        else:
            k_ok = (k0 + offs_k) < K
            x = tl.load(x_ptrs + k0, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs + k0, mask=k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    acc = acc * tl.load(s_ptr + rows_n)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows_n).to(tl.float32)[None, :]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out, mask=mask)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None, config: GemmConfig | None = None) -> torch.Tensor:
    """x @ (weight * weight_scale[:, None]).T + bias for 8-bit ``weight`` codes; equals fp8_linear_ref up
    to fp32 summation order and the output's rounding."""
    # x: [..., K] 16-bit; weight: [N, K] float8_e4m3fn; weight_scale: [N] fp32; bias: [N] -> [..., N]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    n = weight.shape[0]
    if weight.shape[1] != k or weight.element_size() != 1 or weight_scale.shape != (n,):
        raise ValueError(f"fp8_linear: x {tuple(x.shape)} does not fit weight {tuple(weight.shape)} "
                         f"{weight.dtype} with scales {tuple(weight_scale.shape)}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], n)
    cfg = config or config_for(m)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _fp8_gemm_kernel[grid](
        x2, weight, weight_scale, bias if bias is not None else out, out, m, n, k,
        x2.stride(0), weight.stride(0), out.stride(0), triton.cdiv(k, cfg.block_k),
        STATIC_K_ITERS=static_iters(x2.is_cuda, triton.cdiv(k, cfg.block_k)),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out.view(*x.shape[:-1], n)
