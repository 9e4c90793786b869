"""store_kv: write a step's new K/V rows into the paged cache at their slots (Triton + torch reference)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plait.attention.fp8_kv import UNIT_SCALES, KVScales, to_cache
from plait.kernels.fp8_gemm import round_to_e4m3
from plait.kernels.pdl import pdl_args, pdl_prologue
from plait.layers.fp8 import FP8_MAX

_FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def to_cache_dtype(x, cache_ptr, inv_scale):
    """x as the cache at ``cache_ptr`` stores it: a cast, or for an FP8 cache the codes of x * inv_scale
    (fp32, saturated at +-448, rounded to nearest even), as plait.attention.fp8_kv.to_cache."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        y = tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -_FP8_MAX), _FP8_MAX)
        return round_to_e4m3(y).to(tl.float8e4nv)
    else:
        return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, inv_k_scale, inv_v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kc_block, stride_kc_pos, stride_kc_head, stride_vc_block, stride_vc_pos, stride_vc_head,
    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr, PDL: tl.constexpr,
):
    # One program per token: its [Hkv, D] K and V rows move to one cache slot.
    pdl_prologue(PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    block, pos = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(k_cache_ptr + block * stride_kc_block + pos * stride_kc_pos + heads * stride_kc_head + dims,
             to_cache_dtype(k, k_cache_ptr, inv_k_scale), mask=mask)
    tl.store(v_cache_ptr + block * stride_vc_block + pos * stride_vc_pos + heads * stride_vc_head + dims,
             to_cache_dtype(v, v_cache_ptr, inv_v_scale), mask=mask)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, kv_scales: KVScales = UNIT_SCALES,
) -> None:
    """k, v: [T, Hkv, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; slot_mapping: [T] int64.

    Token ``t``'s K/V land at slot ``slot_mapping[t]`` (block * block_size + offset), cast to the cache
    dtype (an FP8 cache: codes of k / kv_scales.k and v / kv_scales.v, see plait.attention.fp8_kv). k, v
    and the caches may be strided views (a fused qkv output's slices; the runner's head-major cache seen
    as [blocks, block_size, Hkv, D]) if their last dim is contiguous.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    check_store_args(k, v, k_cache, v_cache, slot_mapping)
    inv_k, inv_v = kv_scales.inverse
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, inv_k, inv_v,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1], NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), DIM_PAD=triton.next_power_of_2(head_dim),
        **pdl_args(k),
    )


def check_store_args(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Raise ValueError unless k, v, the caches and slot_mapping have the shapes and layout store_kv takes."""
    if k.shape != v.shape or k.shape[1:] != k_cache.shape[2:] or k_cache.shape != v_cache.shape:
        raise ValueError(f"shape mismatch: k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"cache {tuple(k_cache.shape)}")
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("k and v need a contiguous last (head_dim) dimension")
    for cache in (k_cache, v_cache):
        if cache.stride(3) != 1:
            raise ValueError("each cache half needs a contiguous last (head_dim) dimension")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != k.shape[:1]:
        raise ValueError("slot_mapping must be int64 of shape [T]")


def store_kv_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, kv_scales: KVScales = UNIT_SCALES,
) -> None:
    """The torch reference of ``store_kv``: each token's rows written at its (block, offset)."""
    block_size = k_cache.shape[1]
    block, pos = slot_mapping // block_size, slot_mapping % block_size
    inv_k, inv_v = kv_scales.inverse
    k_cache[block, pos] = to_cache(k, k_cache.dtype, inv_k)
    v_cache[block, pos] = to_cache(v, v_cache.dtype, inv_v)
