"""Rotary of q and k fused with the paged-cache store of k and v in one Triton launch; the torch reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from plait.attention.fp8_kv import UNIT_SCALES, KVScales
from plait.kernels.pdl import pdl_args, pdl_prologue
from plait.kernels.rms_norm import rms_norm_ref
from plait.kernels.rotary import HEADS_PER_PROGRAM, load_cos_sin, rotary_ref, rotate_halves
from plait.kernels.store_kv import check_store_args, store_kv_ref, to_cache_dtype

# Warps per program, as the rotary and store_kv launches this replaces use.
NUM_WARPS = 4


@dataclass(frozen=True)
class QKNorm:
    """Per-head RMSNorms of q and k before the rotation (Qwen3's q_norm / k_norm): weights [D], one eps;
    ``unit_offset``: Gemma's norms, which scale by 1 + weight (plait.layers.norm.GemmaRMSNorm)."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float
    unit_offset: bool = False


def rope_store_kv_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scales: KVScales = UNIT_SCALES, qk_norm: QKNorm | None = None,
) -> torch.Tensor:
    """[rms_norm_ref of q and k,] rotary_ref, then store_kv_ref; returns the rotated q. A cos_sin table
    narrower than the head rotates only the leading channels and passes the rest through
    (plait.layers.rotary.PartialRotaryEmbedding)."""
    if qk_norm is not None:
        q = rms_norm_ref(q, qk_norm.q_weight, qk_norm.eps, qk_norm.unit_offset)
        k = rms_norm_ref(k, qk_norm.k_weight, qk_norm.eps, qk_norm.unit_offset)
    r = cos_sin.shape[1]
    q_rot, k_rot = rotary_ref(positions, q[..., :r], k[..., :r], cos_sin)
    if r < q.shape[-1]:
        q_rot, k_rot = torch.cat([q_rot, q[..., r:]], dim=-1), torch.cat([k_rot, k[..., r:]], dim=-1)
    store_kv_ref(k_rot, v, k_cache, v_cache, slot_mapping, kv_scales)
    return q_rot


@triton.jit
def _norm_halves(x1, x2, w_ptr, eps, d, d_mask, dtype, HALF: tl.constexpr, PRECISE: tl.constexpr,
                 UNIT_OFFSET: tl.constexpr):
    """RMSNorm of head rows given as halves ([BLOCK_H, D/2] fp32 each, masked lanes 0) with weight w_ptr [D]:
    rms_norm_ref's roundings (normalised to the activation dtype, then times the weight, rounded again; with
    UNIT_OFFSET, Gemma's: times 1 + weight in fp32, rounded once)."""
    mean_sq = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
    if PRECISE:
        inv = libdevice.rsqrt(mean_sq + eps)  # CUDA's rsqrtf, as torch.rsqrt uses
    else:
        inv = 1.0 / tl.sqrt(mean_sq + eps)  # the interpreter has no libdevice
    w1 = tl.load(w_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + d, mask=d_mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        return (((w1 + 1.0)[None, :] * (x1 * inv[:, None])).to(dtype).to(tl.float32),
                ((w2 + 1.0)[None, :] * (x2 * inv[:, None])).to(dtype).to(tl.float32))
    n1 = (x1 * inv[:, None]).to(dtype).to(tl.float32)
    n2 = (x2 * inv[:, None]).to(dtype).to(tl.float32)
    return (w1[None, :] * n1).to(dtype).to(tl.float32), (w2[None, :] * n2).to(dtype).to(tl.float32)


@triton.jit
def _rotate_rows(src, dst, heads, n_heads, s_head, so_head, cos, sin, d, d_mask, inv_scale, w_ptr, eps,
                 HALF: tl.constexpr, PASS: tl.constexpr, BLOCK_PASS: tl.constexpr, NORM: tl.constexpr,
                 PRECISE: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    # src, dst: one token's row of heads (dst may be a cache slot, inv_scale its FP8 codes' 1 / scale);
    # heads: [BLOCK_H] head indices; with NORM, each head row is RMS-normalised (weight w_ptr) first.
    head_mask = (heads < n_heads)[:, None]
    mask = head_mask & d_mask[None, :]
    src_rows = src + heads[:, None] * s_head
    dst_rows = dst + heads[:, None] * so_head
    x1 = tl.load(src_rows + d[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_rows + HALF + d[None, :], mask=mask, other=0.0).to(tl.float32)
    if NORM:
        x1, x2 = _norm_halves(x1, x2, w_ptr, eps, d, d_mask, src.dtype.element_ty, HALF, PRECISE,
                              UNIT_OFFSET)
    out1, out2 = rotate_halves(x1, x2, cos, sin)
    # Rounded to the input's dtype first, then to the destination's: the reference rotates into q/k's dtype
    # and store_kv converts that to the cache's (both no-ops when the dtypes agree).
    out1 = to_cache_dtype(out1.to(src.dtype.element_ty), dst, inv_scale)
    out2 = to_cache_dtype(out2.to(src.dtype.element_ty), dst, inv_scale)
    tl.store(dst_rows + d[None, :], out1, mask=mask)
    tl.store(dst_rows + HALF + d[None, :], out2, mask=mask)
    if PASS > 0:  # channels past the rotary dim are copied unchanged
        p = tl.arange(0, BLOCK_PASS)
        p_mask = head_mask & (p < PASS)[None, :]
        x = tl.load(src_rows + 2 * HALF + p[None, :], mask=p_mask)
        tl.store(dst_rows + 2 * HALF + p[None, :], to_cache_dtype(x, dst, inv_scale), mask=p_mask)


@triton.jit
def _rope_store_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, slot_ptr, cs_ptr, qw_ptr, kw_ptr,
    norm_eps, inv_k_scale, inv_v_scale, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sqo_t, sqo_h,
    skc_block, skc_pos, skc_head, svc_block, svc_pos, svc_head, s_cs,
    HQ, HKV, q_blocks,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, PASS: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, NORM: tl.constexpr, PRECISE: tl.constexpr,
    UNIT_OFFSET: tl.constexpr, PDL: tl.constexpr,
):
    # Program (token, head block): the first q_blocks blocks rotate q heads into q_out; each later one
    # rotates a block of k heads into the token's cache slot and copies the same v heads beside them.
    pdl_prologue(PDL)
    tok = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    d, d_mask, cos, sin = load_cos_sin(cs_ptr, pos_ptr, tok, s_cs, HALF, BLOCK_HALF)
    # (The branches name their head blocks apart: compiled Triton merges a name bound in both branches,
    # and the two blocks differ in size.)
    if hb < q_blocks:
        q_heads = hb * BLOCK_HQ + tl.arange(0, BLOCK_HQ)
        _rotate_rows(q_ptr + tok * sq_t, q_out_ptr + tok * sqo_t, q_heads, HQ, sq_h, sqo_h, cos, sin, d,
                     d_mask, 1.0, qw_ptr, norm_eps, HALF, PASS, BLOCK_PASS, NORM, PRECISE, UNIT_OFFSET)
    else:
        slot = tl.load(slot_ptr + tok)
        block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
        kv_heads = (hb - q_blocks) * BLOCK_HKV + tl.arange(0, BLOCK_HKV)
        k_dst = k_cache_ptr + block * skc_block + offset * skc_pos
        _rotate_rows(k_ptr + tok * sk_t, k_dst, kv_heads, HKV, sk_h, skc_head, cos, sin, d, d_mask,
                     inv_k_scale, kw_ptr, norm_eps, HALF, PASS, BLOCK_PASS, NORM, PRECISE, UNIT_OFFSET)
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (kv_heads < HKV)[:, None] & (dims < HEAD_DIM)
        v = tl.load(v_ptr + tok * sv_t + kv_heads[:, None] * sv_h + dims, mask=mask)
        v_dst = v_cache_ptr + block * svc_block + offset * svc_pos + kv_heads[:, None] * svc_head + dims
        tl.store(v_dst, to_cache_dtype(v, v_cache_ptr, inv_v_scale), mask=mask)


def rope_store_kv(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scales: KVScales = UNIT_SCALES, qk_norm: QKNorm | None = None,
) -> torch.Tensor:
    """apply_rotary + store_kv in one launch; returns the rotated q (a new tensor). Equals rope_store_kv_ref.

    With ``qk_norm`` (a whole-head rotation only), q's and k's head rows are RMS-normalised first, in the
    same launch: Qwen3's q_norm and k_norm take no launches of their own.

    Token ``t``'s q and k heads are rotated at ``positions[t]`` (neox layout, fp32 math); its rotated k and
    its v land at cache slot ``slot_mapping[t]`` (block * block_size + offset), cast to the cache dtype (FP8
    codes of k / kv_scales.k and v / kv_scales.v for an FP8 cache).
    cos_sin: [max_positions, R] fp32, cos then sin; R < D rotates the first R channels of each head and
    copies the rest. positions index it unchecked (no host sync): callers keep them below max_positions.
    q, k, v may be strided views (a fused qkv output's slices) and the caches any strides, as store_kv
    takes them, if their last dim is contiguous.
    """
    # positions, slot_mapping: [T]; q: [T, Hq, D]; k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D]
    t, hq, d = q.shape
    hkv = k.shape[1]
    rot = cos_sin.shape[1]
    if rot % 2 or not 0 < rot <= d or q.shape[::2] != k.shape[::2]:
        raise ValueError(f"rotary dim {rot} does not fit q {tuple(q.shape)} and k {tuple(k.shape)}")
    check_store_args(k, v, k_cache, v_cache, slot_mapping)
    if qk_norm is not None and rot != d:
        raise ValueError(f"a fused q/k norm needs a whole-head rotation (rotary dim {rot}, head dim {d})")
    if q.stride(-1) != 1:
        q = q.contiguous()
    cos_sin, positions = cos_sin.contiguous(), positions.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if t == 0:
        return q_out
    # Heads per program as apply_rotary: a batch-1 Llama-8B decode token is two q programs of 16 heads
    # and one of its 8 k + 8 v heads, so every program moves about the same bytes.
    block_hq = min(HEADS_PER_PROGRAM, triton.next_power_of_2(hq))
    block_hkv = min(HEADS_PER_PROGRAM, triton.next_power_of_2(hkv))
    q_blocks = triton.cdiv(hq, block_hq)
    grid = (t, q_blocks + triton.cdiv(hkv, block_hkv))
    half, passed = rot // 2, d - rot
    inv_k, inv_v = kv_scales.inverse
    norm = qk_norm if qk_norm is not None else QKNorm(cos_sin, cos_sin, 0.0)  # never read without NORM
    _rope_store_kernel[grid](
        q, k, v, q_out, k_cache, v_cache, positions, slot_mapping, cos_sin, norm.q_weight, norm.k_weight,
        norm.eps, inv_k, inv_v,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), cos_sin.stride(0),
        hq, hkv, q_blocks,
        BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=d, HALF=half, PASS=passed,
        BLOCK_HALF=triton.next_power_of_2(half), BLOCK_PASS=triton.next_power_of_2(max(passed, 1)),
        BLOCK_D=triton.next_power_of_2(d), BLOCK_HQ=block_hq, BLOCK_HKV=block_hkv,
        NORM=qk_norm is not None, PRECISE=q.is_cuda, UNIT_OFFSET=norm.unit_offset,
        num_warps=NUM_WARPS, enable_fp_fusion=False, **pdl_args(q),
    )
    return q_out
