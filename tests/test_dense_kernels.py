"""Dense Triton kernels (RMSNorm, rotary, rotary + KV store, SiLU-and-mul, skinny GEMM) vs torch reference."""

# Unmarked tests use tiny shapes: through the Triton interpreter on CPU, compiled on a GPU when there
# is one. `gpu` tests use real Llama-8B / Qwen3-0.6B layer shapes in bf16.

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from plait.attention import triton_backend  # noqa: E402
from plait.attention.base import get_backend  # noqa: E402
from plait.engine.kv_cache import PAD_BLOCK_ID  # noqa: E402
from plait.kernels import activation, dispatch, rms_norm, rope_store, rotary, skinny_gemm  # noqa: E402
from plait.kernels.skinny_gemm import SkinnyConfig  # noqa: E402
from plait.layers import linear as linear_layer  # noqa: E402
from plait.layers.activation import act_and_mul  # noqa: E402
from plait.layers.norm import RMSNorm, RowNorm  # noqa: E402
from plait.layers.rotary import RotaryEmbedding  # noqa: E402
from plait.models.bamba import PartialRotaryEmbedding  # noqa: E402
from plait.models.nemotron_h import NoRotary  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
MANTISSA_BITS = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}
FP32_UNIT_ROUNDOFF = 2.0**-24
# The interpreter casts fp32 -> bf16 by truncation, not round-to-nearest-even (triton 3.6
# interpreter.py, _convert_float): off the GPU every bf16 rounding in a kernel may land one ulp
# from torch's. fp16 and fp32 casts are numpy's and round correctly.
BF16_TRUNCATION_ULPS = 0 if ON_GPU else 1
EPS = 1e-6

gpu = pytest.mark.skipif(not ON_GPU, reason="needs CUDA")


def ulps(t: torch.Tensor) -> torch.Tensor:
    """Spacing of t's dtype at each element of t, in fp64."""
    mag = t.double().abs()
    _, exp = torch.frexp(mag)
    subnormal_step = torch.finfo(t.dtype).smallest_normal * torch.finfo(t.dtype).eps
    return torch.ldexp(torch.ones_like(mag), exp - 1 - MANTISSA_BITS[t.dtype]).clamp_min(subnormal_step)


def assert_within_ulps(got: torch.Tensor, want: torch.Tensor, n: int) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    err = (got.double() - want.double()).abs()
    scale = torch.maximum(ulps(got), ulps(want))
    worst = (err / scale).max().item() if err.numel() else 0.0
    assert worst <= n, f"{worst:.2f} ulps apart (allowed {n})"


def bf16_slack(dtype: torch.dtype, roundings: int) -> int:
    return BF16_TRUNCATION_ULPS * roundings if dtype == torch.bfloat16 else 0


def assert_matmul_close(
    got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """got is a rounding of some fp32 summation of x @ w.T + bias.

    Any order of summing K products in fp32 is within gamma_K * sum|x w| of the exact value
    (Higham, Accuracy and Stability, 3.1), gamma_K ~ K u; doubled for tensor-core accumulators, which
    align products with truncation. The final cast adds half an ulp of the output dtype. A wrong row,
    a lost K slice or a misplaced partial misses this bound by orders of magnitude.
    """
    exact = x.double() @ w.double().T
    mag = x.double().abs() @ w.double().abs().T
    if bias is not None:
        exact, mag = exact + bias.double(), mag + bias.double().abs()
    k = x.shape[-1] + 1
    bound = 2 * k * FP32_UNIT_ROUNDOFF * mag + 0.5 * torch.maximum(ulps(got), ulps(exact.to(got.dtype)))
    excess = ((got.double() - exact).abs() - bound).max().item()
    assert excess <= 0, f"matmul error exceeds its bound by {excess:.3g}"


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    # Drawn on the device: real-shape weights (up to 1 GB) would be slow to draw on the host.
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=DEVICE) * scale).to(dtype)


# -- tiny shapes (interpreter on CPU) --------------------------------------------------------------

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# fp32 norms differ from torch by the order of the sum of squares, a few fp32 ulps at most. In
# fp16/bf16 that can flip the rounding of the normalised value, which the weight multiply turns
# into up to 2 ulps of the output.
NORM_ULPS = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 40), (5, 48), (3, 2, 24)])
def test_rms_norm_matches_ref(dtype, shape):
    x = randn(*shape, dtype=dtype, seed=1)
    w = randn(shape[-1], dtype=dtype, seed=2)
    got = rms_norm.rms_norm(x, w, EPS)
    assert_within_ulps(got, rms_norm.rms_norm_ref(x, w, EPS), NORM_ULPS[dtype] + bf16_slack(dtype, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_on_strided_head_view(dtype):
    # q-norm input: the q slice of a qkv projection viewed as [T, heads, head_dim], rows not uniform.
    t, heads, d = 3, 2, 24
    qkv = randn(t, heads * d + 2 * d, dtype=dtype, seed=3)
    q = qkv[:, : heads * d].view(t, heads, d)
    w = randn(d, dtype=dtype, seed=4)
    want = rms_norm.rms_norm_ref(q, w, EPS)
    assert_within_ulps(rms_norm.rms_norm(q, w, EPS), want, NORM_ULPS[dtype])
    inplace = rms_norm.rms_norm(q, w, EPS, inplace=True)
    assert inplace.data_ptr() == qkv.data_ptr()
    assert_within_ulps(qkv[:, : heads * d].view(t, heads, d), want, NORM_ULPS[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_many_narrow_rows_share_programs(dtype):
    # 37 tokens x 5 heads of 128: 185 rows, 16 to a program, the last program part-filled; and 37 rows
    # of 1024 through the fused add, two to a program.
    t, heads, d = 37, 5, 128
    qkv = randn(t, (heads + 2) * d, dtype=dtype, seed=13)
    q = qkv[:, : heads * d].view(t, heads, d)
    w = randn(d, dtype=dtype, seed=14)
    assert_within_ulps(rms_norm.rms_norm(q, w, EPS), rms_norm.rms_norm_ref(q, w, EPS),
                       NORM_ULPS[dtype] + bf16_slack(dtype, 2))
    x, res, w_wide = randn(t, 1024, dtype=dtype, seed=15), randn(t, 1024, dtype=dtype, seed=16), randn(
        1024, dtype=dtype, seed=17)
    normed, new_res = rms_norm.fused_add_rms_norm(x, res, w_wide, EPS)
    assert_within_ulps(new_res, x + res, bf16_slack(dtype, 1))
    want = rms_norm.rms_norm_ref(new_res, w_wide, EPS)
    assert_within_ulps(normed, want, NORM_ULPS[dtype] + bf16_slack(dtype, 2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5])
def test_fused_add_rms_norm_matches_ref(dtype, rows):
    x, res = randn(rows, 40, dtype=dtype, seed=5), randn(rows, 40, dtype=dtype, seed=6)
    w = randn(40, dtype=dtype, seed=7)
    normed, new_res = rms_norm.fused_add_rms_norm(x, res, w, EPS)
    assert_within_ulps(new_res, x + res, bf16_slack(dtype, 1))
    # Normed is checked against the kernel's own sum so a truncated bf16 sum does not count twice.
    want = rms_norm.rms_norm_ref(new_res, w, EPS)
    assert_within_ulps(normed, want, NORM_ULPS[dtype] + bf16_slack(dtype, 2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_unit_offset_norms_match_ref(dtype):
    """Gemma's norms scale by 1 + weight, the product in fp32 rounded once: the plain and the fused-add
    launch, on [T, H] rows and on strided q-head views, against rms_norm_ref; a kernel that read the weight
    as Llama's (no offset) would be off by the whole row."""
    x, res = randn(5, 40, dtype=dtype, seed=31), randn(5, 40, dtype=dtype, seed=32)
    w = randn(40, dtype=dtype, seed=33)
    want = rms_norm.rms_norm_ref(x, w, EPS, unit_offset=True)
    assert_within_ulps(rms_norm.rms_norm(x, w, EPS, unit_offset=True), want,
                       NORM_ULPS[dtype] + bf16_slack(dtype, 1))
    assert (want.float() - rms_norm.rms_norm_ref(x, w, EPS).float()).abs().max() > 0.5
    normed, new_res = rms_norm.fused_add_rms_norm(x, res, w, EPS, unit_offset=True)
    assert_within_ulps(new_res, x + res, bf16_slack(dtype, 1))
    assert_within_ulps(normed, rms_norm.rms_norm_ref(new_res, w, EPS, unit_offset=True),
                       NORM_ULPS[dtype] + bf16_slack(dtype, 1))
    qkv = randn(3, 4 * 24, dtype=dtype, seed=34)
    q = qkv[:, : 2 * 24].view(3, 2, 24)
    wq = randn(24, dtype=dtype, seed=35)
    assert_within_ulps(rms_norm.rms_norm(q, wq, EPS, unit_offset=True),
                       rms_norm.rms_norm_ref(q, wq, EPS, unit_offset=True),
                       NORM_ULPS[dtype] + bf16_slack(dtype, 1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_once_norm_matches_ref(dtype):
    """OLMo's norms: weight x the fp32 row, rounded once (not the row rounded first, as Llama's); the plain
    launch on rows as wide as a q projection. In bf16 some elements differ between the two orders."""
    x, w = randn(7, 96, dtype=dtype, seed=40, scale=3.0), randn(96, dtype=dtype, seed=41)
    got = rms_norm.rms_norm(x, w, EPS, round_once=True)
    want = rms_norm.rms_norm_ref(x, w, EPS, round_once=True)
    assert_within_ulps(got, want, NORM_ULPS[dtype] + bf16_slack(dtype, 1))
    if dtype == torch.bfloat16:
        assert not torch.equal(want, rms_norm.rms_norm_ref(x, w, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit_offset", [False, True])
def test_fused_sandwich_norm_matches_ref(dtype, unit_offset):
    """Gemma's sandwich in one launch: the sublayer's post-norm (pre_weight), the residual add and the next
    pre-norm; the sum (the new residual) and the output against fused_add_rms_norm_ref, which applies the
    post-norm as its own module (rounded) first. Without the pre-norm the sum would be far off."""
    x, res = randn(5, 40, dtype=dtype, seed=36, scale=4.0), randn(5, 40, dtype=dtype, seed=37)
    w, pre_w = randn(40, dtype=dtype, seed=38), randn(40, dtype=dtype, seed=39)
    normed, new_res = rms_norm.fused_add_rms_norm(x, res, w, EPS, unit_offset=unit_offset,
                                                  pre_weight=pre_w, pre_eps=1e-5)
    want_normed, want_res = rms_norm.fused_add_rms_norm_ref(x, res, w, EPS, unit_offset, pre_w, 1e-5)
    # The post-normed x may sit ulps from torch's (its sum of squares' order), and the add can cancel: the
    # bound is in ulps of the addends' magnitudes, not of the sum.
    addends = rms_norm.rms_norm_ref(x, pre_w, 1e-5, unit_offset).double().abs() + res.double().abs()
    err = (new_res.double() - want_res.double()).abs()
    assert (err <= (NORM_ULPS[dtype] + bf16_slack(dtype, 2)) * ulps(addends.to(dtype))).all()
    assert_within_ulps(normed, rms_norm.rms_norm_ref(new_res, w, EPS, unit_offset),
                       NORM_ULPS[dtype] + bf16_slack(dtype, 1))
    assert (new_res.float() - (x + res).float()).abs().max() > 0.5


def test_fused_add_rms_norm_inplace_writes_inputs():
    x, res = randn(3, 40, dtype=torch.float16, seed=8), randn(3, 40, dtype=torch.float16, seed=9)
    w = randn(40, dtype=torch.float16, seed=10)
    want_normed, want_res = rms_norm.fused_add_rms_norm_ref(x, res, w, EPS)
    normed, new_res = rms_norm.fused_add_rms_norm(x, res, w, EPS, inplace=True)
    assert normed is x and new_res is res
    assert torch.equal(res, want_res)
    assert_within_ulps(x, want_normed, 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,hq,hkv,d", [(1, 3, 1, 16), (4, 4, 2, 12), (2, 20, 2, 8)])
def test_rotary_matches_ref(dtype, t, hq, hkv, d):
    # d=12: half-dim 6 is not a power of two; hq=20 spans two head blocks of the launch.
    cos_sin = RotaryEmbedding(d, 64, 10000.0).cos_sin.to(DEVICE)
    qkv = randn(t, (hq + 2 * hkv) * d, dtype=dtype, seed=11)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    positions = torch.randint(0, 64, (t,), generator=torch.Generator().manual_seed(12)).to(DEVICE)
    got_q, got_k = rotary.apply_rotary(positions, q, k, cos_sin)
    want_q, want_k = rotary.rotary_ref(positions, q, k, cos_sin)
    assert_within_ulps(got_q, want_q, bf16_slack(dtype, 1))
    assert_within_ulps(got_k, want_k, bf16_slack(dtype, 1))


def test_rotary_inplace_writes_views():
    cos_sin = RotaryEmbedding(16, 32, 10000.0).cos_sin.to(DEVICE)
    qkv = randn(2, 4 * 16, dtype=torch.float32, seed=13)
    q, k = qkv[:, :32].view(2, 2, 16), qkv[:, 32:48].view(2, 1, 16)
    positions = torch.tensor([3, 31], device=DEVICE)
    want_q, want_k = rotary.rotary_ref(positions, q, k, cos_sin)
    v_before = qkv[:, 48:].clone()
    rotary.apply_rotary(positions, q, k, cos_sin, inplace=True)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, 48:], v_before)


ROPE_BLOCK_SIZE = 4
ROPE_MAX_POSITIONS = 64


def rope_store_case(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int,
                    head_major: bool = False) -> tuple[torch.Tensor, ...]:
    """q, k, v as views of one fused qkv row; a cache of noise in shuffled blocks (head-major: allocated
    [2, blocks, Hkv, block_size, D] and seen as [2, blocks, block_size, Hkv, D]); slots in random blocks,
    the last two tokens padded rows that both write the pad block; random positions."""
    g = torch.Generator().manual_seed(seed)
    qkv = randn(t, (hq + 2 * hkv) * d, dtype=dtype, seed=seed)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    num_blocks = max(6, -(-t // ROPE_BLOCK_SIZE) + 2)
    real = torch.randperm((num_blocks - 1) * ROPE_BLOCK_SIZE, generator=g)[: t - 2] + ROPE_BLOCK_SIZE
    slots = torch.cat([real, torch.full((2,), PAD_BLOCK_ID * ROPE_BLOCK_SIZE + 1)])
    cache = torch.randn(2, num_blocks, ROPE_BLOCK_SIZE, hkv, d, generator=g).to(dtype)
    if head_major:
        cache = cache.transpose(2, 3).contiguous().transpose(2, 3)
    positions = torch.randint(0, ROPE_MAX_POSITIONS, (t,), generator=g)
    return q, k, v, cache.to(DEVICE), slots.to(DEVICE), positions.to(DEVICE)


def rope_store_reference(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cos_sin: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotated q, a copy of ``cache`` after the reference's store): what the fused kernel must give."""
    want_cache = cache.clone()
    want_q = rope_store.rope_store_kv_ref(positions, q, k, v, cos_sin, want_cache[0], want_cache[1], slots)
    return want_q, want_cache


def assert_caches_match(got: torch.Tensor, want: torch.Tensor, n_ulps: int) -> None:
    # Both padded rows write the pad block, in no set order on the GPU; nothing reads it.
    real = [b for b in range(got.shape[1]) if b != PAD_BLOCK_ID]
    assert_within_ulps(got[:, real], want[:, real], n_ulps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,hq,hkv,d,rot", [
    (6, 4, 2, 32, 32),  # GQA
    (5, 5, 3, 12, 12),  # odd head counts; half-dim 6 is not a power of two
    (3, 20, 2, 16, 16),  # q spans two head blocks
    (3, 32, 8, 128, 128),  # a Llama-8B token
    (4, 4, 4, 64, 64),  # MHA at D 64
    (3, 4, 2, 24, 12),  # partial rotary (Bamba): the last 12 channels pass through
    (3, 3, 1, 13, 8),  # an odd head dim, 5 channels passed through
])
def test_rope_store_matches_rotary_then_store_kv(dtype, t, hq, hkv, d, rot):
    q, k, v, cache, slots, positions = rope_store_case(t, hq, hkv, d, dtype, seed=20)
    cos_sin = RotaryEmbedding(rot, ROPE_MAX_POSITIONS, 10000.0).cos_sin.to(DEVICE)
    qkv_before = q.clone(), k.clone(), v.clone()
    want_q, want_cache = rope_store_reference(positions, q, k, v, cos_sin, cache, slots)
    got_q = rope_store.rope_store_kv(positions, q, k, v, cos_sin, cache[0], cache[1], slots)
    # The reference's arithmetic, rounding by rounding: exact but for the interpreter's bf16 truncation.
    assert_within_ulps(got_q, want_q, bf16_slack(dtype, 1))
    assert_caches_match(cache, want_cache, bf16_slack(dtype, 1))
    if rot == d and dtype != torch.bfloat16:  # the reference is the two kernels it replaces
        two_q, two_k = rotary.apply_rotary(positions, q, k, cos_sin)
        assert torch.equal(got_q, two_q)
        assert torch.equal(cache[0, slots[:-2] // ROPE_BLOCK_SIZE, slots[:-2] % ROPE_BLOCK_SIZE], two_k[:-2])
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), qkv_before))  # inputs untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,hq,hkv,d,unit_offset", [
    (6, 4, 2, 32, False), (3, 16, 8, 128, False), (5, 5, 3, 12, False),
    (3, 4, 1, 256, True), (5, 5, 3, 12, True),
], ids=["qwen3-d32", "qwen3-d128", "qwen3-d12", "gemma3-d256", "gemma-d12"])
def test_rope_store_with_qk_norm_matches_norms_then_rotary_then_store_kv(dtype, t, hq, hkv, d, unit_offset):
    """Qwen3's q/k RMSNorms (and Gemma 3's, which scale by 1 + weight and round once) in the same launch: as
    rms_norm_ref of each head row, then the rotation and the store, within the norm's sum-order slack
    (rounded once more by the rotation)."""
    q, k, v, cache, slots, positions = rope_store_case(t, hq, hkv, d, dtype, seed=22)
    cos_sin = RotaryEmbedding(d, ROPE_MAX_POSITIONS, 10000.0).cos_sin.to(DEVICE)
    # Weights away from 1, scaled so the rows' norms matter (inputs x 3): a kernel that skipped a weight, the
    # normalisation or used the other head's weight would be far off. Gemma's hold the offset from 1.
    one = 0.0 if unit_offset else 1.0
    qw = (one + 0.5 * randn(1, d, dtype=torch.float32, seed=23)[0]).to(dtype).to(DEVICE)
    kw = (one - 0.5 * randn(1, d, dtype=torch.float32, seed=24)[0]).to(dtype).to(DEVICE)
    q, k = q * 3, k * 3
    norm = rope_store.QKNorm(qw, kw, 1e-6, unit_offset)
    want_cache = cache.clone()
    want_q = rope_store.rope_store_kv_ref(positions, q, k, v, cos_sin, want_cache[0], want_cache[1], slots,
                                          qk_norm=norm)
    got_q = rope_store.rope_store_kv(positions, q, k, v, cos_sin, cache[0], cache[1], slots, qk_norm=norm)
    # A last-bit difference of a normalised input (the sum of squares' order) becomes many ulps of a rotated
    # value that cancels to near zero, so the bound is absolute as well as relative, at the O(1) scale of a
    # normalised row: a few roundings of the dtype.
    tol = 8 * 2.0 ** -MANTISSA_BITS[dtype]
    real = [b for b in range(cache.shape[1]) if b != PAD_BLOCK_ID]
    torch.testing.assert_close(got_q.float(), want_q.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(cache[:, real].float(), want_cache[:, real].float(), rtol=tol, atol=tol)
    # Not the unnormalised rotation, nor the other kind of norm: the norm did what it should.
    other = rope_store.QKNorm(qw, kw, 1e-6, not unit_offset)
    for wrong in (None, other):
        plain = rope_store.rope_store_kv_ref(positions, q, k, v, cos_sin, want_cache[0].clone(),
                                             want_cache[1].clone(), slots, qk_norm=wrong)
        assert (plain.float() - got_q.float()).abs().max() > 0.1
    with pytest.raises(ValueError, match="whole-head rotation"):
        half = RotaryEmbedding(d // 2, ROPE_MAX_POSITIONS, 10000.0).cos_sin.to(DEVICE)
        rope_store.rope_store_kv(positions, q, k, v, half, cache[0], cache[1], slots, qk_norm=norm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_store_into_head_major_cache(dtype):
    q, k, v, cache, slots, positions = rope_store_case(7, 6, 3, 32, dtype, seed=21, head_major=True)
    assert cache.stride(2) == 32 and cache.stride(3) == ROPE_BLOCK_SIZE * 32
    cos_sin = RotaryEmbedding(32, ROPE_MAX_POSITIONS, 10000.0).cos_sin.to(DEVICE)
    want_q, want_cache = rope_store_reference(positions, q, k, v, cos_sin, cache, slots)
    got_q = rope_store.rope_store_kv(positions, q, k, v, cos_sin, cache[0], cache[1], slots)
    assert torch.equal(got_q, want_q)
    assert_caches_match(cache, want_cache, 0)


def test_rope_store_casts_into_a_wider_cache_and_rejects_bad_args():
    # fp16 activations into an fp32 cache: rounded to fp16 first, as rotary then store_kv round.
    q, k, v, cache, slots, positions = rope_store_case(5, 4, 2, 16, torch.float16, seed=22)
    cache = cache.float()
    cos_sin = RotaryEmbedding(16, ROPE_MAX_POSITIONS, 10000.0).cos_sin.to(DEVICE)
    want_q, want_cache = rope_store_reference(positions, q, k, v, cos_sin, cache, slots)
    got_q = rope_store.rope_store_kv(positions, q, k, v, cos_sin, cache[0], cache[1], slots)
    assert torch.equal(got_q, want_q)
    assert_caches_match(cache, want_cache, 0)
    none = slice(0, 0)
    empty = rope_store.rope_store_kv(positions[none], q[none], k[none], v[none], cos_sin, cache[0], cache[1],
                                     slots[none])
    assert empty.shape == (0, 4, 16)
    with pytest.raises(ValueError):
        rope_store.rope_store_kv(positions, q, k, v, cos_sin, cache[0], cache[1], slots.int())
    with pytest.raises(ValueError):  # a table wider than the head
        rope_store.rope_store_kv(positions, q, k, v, cos_sin.repeat(1, 2), cache[0], cache[1], slots)


@pytest.mark.parametrize("rope", ["full", "partial", "none"])
def test_backend_fused_rotate_and_store_equals_the_default(rope, monkeypatch):
    """The Triton backend's fused rotate_and_store against the interface's default (rotary module, then
    store_kv) through both backends; a rotary without a table (NemotronH's) takes the default."""
    from types import SimpleNamespace

    t, hq, hkv, d = 6, 4, 2, 32
    with torch.device(DEVICE):  # the tables are made on the device a model is built under
        rotaries = {"full": RotaryEmbedding(d, ROPE_MAX_POSITIONS, 10000.0),
                    "partial": PartialRotaryEmbedding(d // 2, ROPE_MAX_POSITIONS, 10000.0, None),
                    "none": NoRotary()}
    calls = {}
    monkeypatch.setattr(triton_backend, "rope_store_kv",
                        _counted(triton_backend.rope_store_kv, "rope_store_kv", calls))
    q, k, v, cache, slots, positions = rope_store_case(t, hq, hkv, d, torch.float16, seed=23)
    batch = SimpleNamespace(positions=positions, slot_mapping=slots)  # all rotate_and_store reads
    caches, outs = {}, {}
    for name in ("triton", "torch_ref"):  # the reference through the torch layers where there is no GPU
        monkeypatch.setattr(dispatch, "_cpu_interpreter", name == "triton" and not ON_GPU)
        caches[name] = cache.clone()
        with torch.inference_mode():
            outs[name] = get_backend(name).rotate_and_store(q, k, v, caches[name], batch, rotaries[rope])
    assert bool(calls) == (rope != "none")
    assert torch.equal(outs["triton"], outs["torch_ref"])
    assert_caches_match(caches["triton"], caches["torch_ref"], 0)
    if rope == "none":
        assert outs["triton"] is q


# silu: two exp implementations (numpy in the interpreter, Sleef in torch on CPU), each within an
# ulp of exact, may be 2 ulps apart; through 1 + e, the division and the product with up that is
# up to 4 fp32 ulps of the output. In fp16/bf16 it can flip the rounded silu: 2 ulps after the
# product. On the GPU both sides use CUDA's expf.
SILU_ULPS = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 37), (3, 1030)])
def test_silu_and_mul_matches_ref(dtype, rows, inter):
    # inter=1030 crosses the 1024-column block of one program.
    gate_up = randn(rows, 2 * inter, dtype=dtype, seed=14, scale=3.0)
    got = activation.silu_and_mul(gate_up)
    assert_within_ulps(got, activation.silu_and_mul_ref(gate_up), SILU_ULPS[dtype] + bf16_slack(dtype, 2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 37), (3, 1030)])
def test_gelu_tanh_and_mul_matches_ref(dtype, rows, inter):
    """Gemma's GeGLU (transformers' gelu_pytorch_tanh): the launch silu uses, GELU's tanh form in its place;
    tanh through exp in the interpreter, CUDA's tanhf on the GPU, as torch's kernel."""
    gate_up = randn(rows, 2 * inter, dtype=dtype, seed=15, scale=3.0)
    got = activation.gelu_tanh_and_mul(gate_up)
    want = activation.gelu_tanh_and_mul_ref(gate_up)
    if ON_GPU:
        assert_within_ulps(got, want, SILU_ULPS[dtype])
    else:
        # Off the GPU tanh goes through exp (the interpreter) against torch's Sleef tanh. Near tanh = -1 an
        # fp32 ulp of 1 apart becomes, through 1 + tanh, ~2^-24 |gate x up| of absolute error: many ulps of a
        # near-zero output, so the bound takes that on top of the ulps.
        gate, up = gate_up.double().chunk(2, dim=-1)
        err = (got.double() - want.double()).abs()
        bound = (SILU_ULPS[dtype] + bf16_slack(dtype, 2)) * torch.maximum(ulps(got), ulps(want))
        assert (err <= bound + 2.0**-21 * (gate * up).abs()).all(), (err - bound).max()
    assert (want.float() - activation.silu_and_mul_ref(gate_up).float()).abs().max() > 0.1
    from plait.layers.activation import gelu_tanh

    if dispatch.use_triton(gate_up):  # the layer's dispatch takes the same launch
        assert torch.equal(act_and_mul(gate_up, gelu_tanh), got)


# Configs that force each code path on tiny shapes: CUDA-core and tensor-core accumulation, split-K
# with an uneven last split (K=100 is no multiple of 3 x 32), one-row blocks. N=21 leaves a partial
# last row block.
FORCED_CONFIGS = {
    "fma_split3": SkinnyConfig(block_n=8, block_k=32, split_k=3),
    "dot_split2": SkinnyConfig(block_n=16, block_k=32, split_k=2, use_dot=True),
    "fma_rows1": SkinnyConfig(block_n=1, block_k=64),
    # deeper prefetch rings, with fewer K steps (K=100 over 32-wide steps: 4) and more than the ring
    "fma_prefetch2": SkinnyConfig(block_n=8, block_k=32, prefetch=2),
    "fma_prefetch3": SkinnyConfig(block_n=4, block_k=16, prefetch=3),
}
SKINNY_DTYPES = [torch.float32, torch.float16]  # bf16 tl.dot is wrong in the interpreter


@pytest.mark.parametrize("dtype", SKINNY_DTYPES)
@pytest.mark.parametrize("m", [1, 3, 16])
def test_skinny_linear_heuristic_config(dtype, m):
    x, w = randn(m, 100, dtype=dtype, seed=15), randn(21, 100, dtype=dtype, seed=16)
    bias = randn(21, dtype=dtype, seed=17)
    assert_matmul_close(skinny_gemm.skinny_linear(x, w, bias), x, w, bias)


@pytest.mark.parametrize("dtype", SKINNY_DTYPES)
@pytest.mark.parametrize("name", sorted(FORCED_CONFIGS))
def test_skinny_linear_forced_configs(dtype, name):
    x, w = randn(3, 100, dtype=dtype, seed=18), randn(21, 100, dtype=dtype, seed=19)
    got = skinny_gemm.skinny_linear(x, w, None, config=FORCED_CONFIGS[name])
    assert_matmul_close(got, x, w, None)


def test_skinny_linear_keeps_leading_dims_and_rejects_large_m():
    x, w = randn(2, 1, 64, dtype=torch.float32, seed=20), randn(16, 64, dtype=torch.float32, seed=21)
    got = skinny_gemm.skinny_linear(x, w)
    assert got.shape == (2, 1, 16)
    assert_matmul_close(got.view(2, 16), x.view(2, 64), w, None)
    with pytest.raises(ValueError):
        skinny_gemm.skinny_linear(randn(17, 64, dtype=torch.float32, seed=22), w)


@pytest.mark.parametrize("name", ["fma_split3", "dot_split2", "fma_prefetch3", None])
def test_skinny_gate_up_silu_equals_unfused_kernels(name):
    # fp16: the fused epilogue rounds gate and up as F.linear's output would, then silu, then the
    # product: with the same config it must reproduce skinny_linear + silu_and_mul bit for bit.
    cfg = FORCED_CONFIGS[name] if name else None
    x, w = randn(3, 100, dtype=torch.float16, seed=23), randn(2 * 19, 100, dtype=torch.float16, seed=24)
    fused = skinny_gemm.skinny_gate_up_silu(x, w, config=cfg)
    unfused_cfg = cfg or skinny_gemm.get_config(3, 19, 100, x.device, gate_up=True)
    gate_up = torch.cat([skinny_gemm.skinny_linear(x, w[:19], config=unfused_cfg),
                         skinny_gemm.skinny_linear(x, w[19:], config=unfused_cfg)], dim=-1)
    assert torch.equal(fused, activation.silu_and_mul(gate_up))


# Configs the residual-add form takes (unsplit, CUDA cores): several programs along N,
# a partial last row block (N=21), K in one and in several steps.
FUSABLE_CONFIGS = {
    "fma_rows8": SkinnyConfig(block_n=8, block_k=32),
    "fma_rows1": SkinnyConfig(block_n=1, block_k=128),
    "fma_rows8_prefetch2": SkinnyConfig(block_n=8, block_k=32, prefetch=2),
}


@pytest.mark.parametrize("dtype", SKINNY_DTYPES)
@pytest.mark.parametrize("name", sorted(FUSABLE_CONFIGS))
@pytest.mark.parametrize("m", [1, 2])
def test_skinny_linear_add_matches_ref(dtype, name, m):
    # The output projection's residual add: out rounds as torch's F.linear(x, w) + residual does
    # (two roundings), and the partials sum to each row's sum of squares of the rounded out.
    x, w = randn(m, 100, dtype=dtype, seed=30), randn(21, 100, dtype=dtype, seed=31)
    residual = randn(m, 21, dtype=dtype, seed=32, scale=4.0)
    got, parts = skinny_gemm.skinny_linear_add(x, w, residual, config=FUSABLE_CONFIGS[name])
    want, want_sq = skinny_gemm.skinny_linear_add_ref(x, w, residual)
    assert parts.shape == (m, triton.cdiv(21, FUSABLE_CONFIGS[name].block_n))
    # Some fp32 order of the matmul's sum (bounded as in assert_matmul_close), rounded, then the add,
    # rounded: half an ulp of each rounding on top (a whole one each where the interpreter truncates).
    exact = x.double() @ w.double().T + residual.double()
    mag = x.double().abs() @ w.double().abs().T
    halves = 0.5 + bf16_slack(dtype, 1)
    bound = (2 * 101 * FP32_UNIT_ROUNDOFF * mag
             + halves * (ulps(F.linear(x, w)) + torch.maximum(ulps(got), ulps(want))))
    assert ((got.double() - exact).abs() <= bound).all()
    torch.testing.assert_close(parts.sum(-1, keepdim=True), got.float().pow(2).sum(-1, keepdim=True),
                               rtol=1e-5, atol=0)
    torch.testing.assert_close(parts.sum(-1, keepdim=True), want_sq, rtol=0.02, atol=0)


def test_skinny_linear_add_refuses_split_and_tensor_core_configs():
    x, w = randn(1, 100, dtype=torch.float16, seed=37), randn(21, 100, dtype=torch.float16, seed=38)
    residual = randn(1, 21, dtype=torch.float16, seed=39)
    for name in ("fma_split3", "dot_split2"):
        with pytest.raises(ValueError, match="unsplit CUDA-core"):
            skinny_gemm.skinny_linear_add(x, w, residual, config=FORCED_CONFIGS[name])
    with pytest.raises(ValueError, match="residual must be"):
        skinny_gemm.skinny_linear_add(x, w, residual.float())


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_with_row_norm_matches_ref(dtype):
    rows, inter = 3, 1030
    gate_up = randn(rows, 2 * inter, dtype=dtype, seed=40, scale=30.0)  # un-normalised stream's scale
    norm = RowNorm(randn(rows, 5, dtype=torch.float32, seed=41).abs() * 100, 64, EPS)
    got = activation.silu_and_mul(gate_up, norm)
    want = activation.silu_and_mul_rms_ref(gate_up, norm)
    assert_within_ulps(got, want, SILU_ULPS[dtype] + bf16_slack(dtype, 2))


def test_heuristic_splits_k_only_when_rows_are_too_few():
    sms = 132
    wide = skinny_gemm.heuristic_config(1, 128256, 4096, sms)
    assert wide.split_k == 1 and not wide.use_dot
    narrow = skinny_gemm.heuristic_config(16, 1024, 3072, sms)
    assert narrow.use_dot and narrow.split_k > 1
    assert 3072 // narrow.split_k >= skinny_gemm.MIN_K_PER_SPLIT
    for m in (1, 2, 4, 8, 16):
        for n, k in [(6144, 4096), (4096, 14336), (1024, 2048), (151936, 1024)]:
            cfg = skinny_gemm.heuristic_config(m, n, k, sms)
            assert cfg.split_k <= skinny_gemm.MAX_SPLIT_K and cfg.block_n >= 1
            if not cfg.use_dot:
                assert skinny_gemm.m_bucket(m) * cfg.block_n * cfg.block_k <= skinny_gemm.FMA_ACC_ELEMENTS


def test_config_table_overrides_heuristic(monkeypatch):
    cfg = SkinnyConfig(block_n=2, block_k=64, split_k=2)
    monkeypatch.setitem(skinny_gemm.SKINNY_CONFIGS, (4, 24, 80), cfg)
    assert skinny_gemm.get_config(3, 24, 80, torch.device("cpu")) == cfg
    assert skinny_gemm.get_config(5, 24, 80, torch.device("cpu")) != cfg


# -- dispatch --------------------------------------------------------------------------------------


def test_torch_references_are_the_layers_torch_code():
    # The references the kernels are held to must be exactly what the layers compute off the GPU.
    x = torch.randn(3, 2, 24)
    norm = RMSNorm(24, EPS)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(24))
    assert torch.equal(norm(x), rms_norm.rms_norm_ref(x, norm.weight, EPS))
    res = torch.randn(3, 2, 24)
    want_pair = rms_norm.fused_add_rms_norm_ref(x, res, norm.weight, EPS)
    for got, want in zip(norm.forward_residual(x, res), want_pair):
        assert torch.equal(got, want)
    rope = RotaryEmbedding(24, 16, 10000.0)
    pos, q, k = torch.tensor([0, 5, 15]), torch.randn(3, 4, 24), torch.randn(3, 2, 24)
    for got, want in zip(rope(pos, q, k), rotary.rotary_ref(pos, q, k, rope.cos_sin)):
        assert torch.equal(got, want)
    gate_up = torch.randn(3, 40)
    assert torch.equal(act_and_mul(gate_up, F.silu), activation.silu_and_mul_ref(gate_up))


def test_use_triton_only_for_cuda_without_autograd(monkeypatch):
    monkeypatch.setattr(dispatch, "_enabled", True)
    x = torch.randn(2, 4)
    assert not dispatch.use_triton(x)
    assert dispatch.triton_importable()
    if ON_GPU:
        xc = x.cuda()
        with torch.no_grad():
            assert dispatch.use_triton(xc)
            dispatch.set_triton_enabled(False)
            assert not dispatch.use_triton(xc)
            dispatch.set_triton_enabled(True)
        assert not dispatch.use_triton(xc)  # grad mode on: the kernels have no backward


def test_linear_is_a_drop_in_for_nn_linear():
    torch.manual_seed(0)
    ref = torch.nn.Linear(24, 10, bias=True)
    lin = linear_layer.Linear(24, 10, bias=True)
    assert list(lin.state_dict()) == list(ref.state_dict())
    lin.load_state_dict(ref.state_dict())
    x = torch.randn(3, 24)
    assert torch.equal(lin(x), ref(x))  # autograd: F.linear itself (oneDNN has no backward)
    lin(x).sum().backward()
    assert lin.weight.grad is not None
    with torch.no_grad():  # inference: on CPU oneDNN's linear, nn.Linear's to rounding
        torch.testing.assert_close(lin(x), ref(x), rtol=1e-6, atol=1e-6)
    assert not lin.uses_skinny(x)
    assert linear_layer.Linear(24, 10, bias=False).bias is None


def test_skinny_mode_env_parsing(monkeypatch):
    name = "PLAIT_TEST_SWITCH"
    monkeypatch.delenv(name, raising=False)
    assert linear_layer._env_mode(name, "auto") == "auto"
    for mode in ("0", "1", "auto"):
        monkeypatch.setenv(name, mode)
        assert linear_layer._env_mode(name, "auto") == mode
    monkeypatch.setenv(name, "yes")
    with pytest.raises(ValueError):
        linear_layer._env_mode(name, "auto")


def test_auto_mode_takes_only_measured_winners():
    # A shape listed in SKINNY_CONFIGS (qwen3-0.6b o at M=1) goes to the skinny kernel; an unlisted one
    # (qwen3-0.6b gate_up, where cuBLAS won) stays with F.linear; M past the skinny range never goes.
    assert skinny_gemm.measured_faster(1, 1024, 2048) and skinny_gemm.measured_faster(2, 1024, 2048)
    assert not skinny_gemm.measured_faster(1, 6144, 1024)
    assert skinny_gemm.measured_faster(1, 28672, 4096) and not skinny_gemm.measured_faster(2, 28672, 4096)
    assert skinny_gemm.measured_faster(3, 1024, 3072)  # M=3 takes the M=4 measurement


@pytest.mark.skipif(ON_GPU, reason="the gpu test below runs the same check compiled")
def test_tiny_model_through_interpreted_kernels_matches_torch(tiny_models, monkeypatch):
    # Every layer routed to its kernel under the interpreter, fp16 so the skinny GEMM applies: a
    # first step of more than SKINNY_MAX_M tokens (F.linear + silu_and_mul), then decodes (skinny
    # projections, fused gate/up + SiLU, skinny lm_head); norms on strided q/k views; rotary fused with
    # the KV store by the Triton attention backend, never launched alone. Same greedy tokens as the
    # torch layers and the torch_ref backend, logits within fp16 noise.
    from conftest import random_prompts, run_greedy

    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine

    # One "SM" for the heuristic: wide row blocks, so the interpreter runs few programs per launch.
    monkeypatch.setattr(skinny_gemm, "DEFAULT_NUM_SMS", 1)
    calls = {}
    for module, name in [(rms_norm, "rms_norm"), (rms_norm, "fused_add_rms_norm"), (rotary, "apply_rotary"),
                         (triton_backend, "rope_store_kv"), (activation, "silu_and_mul"),
                         (skinny_gemm, "skinny_linear"), (skinny_gemm, "skinny_gate_up_silu")]:
        monkeypatch.setattr(module, name, _counted(getattr(module, name), name, calls))
    prompts = random_prompts(2, 10, 14, seed=4)
    runs = {}
    for kernels in (False, True):
        monkeypatch.setattr(dispatch, "_cpu_interpreter", kernels)
        monkeypatch.setattr(linear_layer, "_skinny_mode", "1" if kernels else "0")
        engine = LLMEngine(EngineConfig(model=str(tiny_models["qwen3"]), device="cpu", dtype="float16",
                                        max_num_batched_tokens=32, block_size=8, num_kv_blocks=16,
                                        attention_backend="triton" if kernels else "torch_ref"))
        runs[kernels] = run_greedy(engine, prompts, 3, capture_logits=True)
        assert bool(calls) == kernels
    assert "apply_rotary" not in calls, "q and k were rotated apart from the KV store"
    assert len(calls) == 6, f"kernels never called: {sorted(calls)}"
    (tok_torch, logits_torch), (tok_kernels, logits_kernels) = runs[False], runs[True]
    assert tok_kernels == tok_torch
    for i in range(len(prompts)):
        a, b = torch.stack(logits_kernels[i]), torch.stack(logits_torch[i])
        torch.testing.assert_close(a, b, rtol=0, atol=0.01 * b.abs().max().item())


def _counting_fused_norms(monkeypatch, calls: dict) -> None:
    """Count the launches that carry the MLP norm: o's residual add, silu-and-mul with the norm's scale."""
    monkeypatch.setattr(skinny_gemm, "skinny_linear_add",
                        _counted(skinny_gemm.skinny_linear_add, "add", calls))
    silu = activation.silu_and_mul

    def silu_counted(gate_up, row_norm=None):
        calls["silu_norm"] = calls.get("silu_norm", 0) + (row_norm is not None)
        return silu(gate_up, row_norm)

    monkeypatch.setattr(activation, "silu_and_mul", silu_counted)


@pytest.mark.skipif(ON_GPU, reason="the gpu engine tests run folded models compiled")
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_folded_norms_fused_into_decode_matmuls_match_torch(tiny_models, monkeypatch, family):
    # The MLP norms' weights (made random here: HF initialises them to 1) folded into gate/up: one- and
    # two-row decode steps take the fused path (o adds the residual and leaves the sums of squares,
    # silu-and-mul takes the norm's scale from them), three-row and prompt steps the ordinary path on
    # the folded weights. Same greedy tokens as the torch layers on the unfolded model (qwen2 brings a
    # qkv bias, qwen3 q/k norms).
    from conftest import random_prompts, run_greedy

    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine

    monkeypatch.setattr(skinny_gemm, "DEFAULT_NUM_SMS", 1)
    monkeypatch.setattr(linear_layer, "FUSE_GATE_UP_SILU", False)
    calls = {}
    _counting_fused_norms(monkeypatch, calls)
    prompts = random_prompts(3, 6, 12, seed=5)
    runs = {}
    for kernels in (False, True):
        monkeypatch.setattr(dispatch, "_cpu_interpreter", kernels)
        monkeypatch.setattr(linear_layer, "_skinny_mode", "1" if kernels else "0")
        engine = LLMEngine(EngineConfig(model=str(tiny_models[family]), device="cpu", dtype="float16",
                                        max_num_batched_tokens=32, block_size=8, num_kv_blocks=16,
                                        attention_backend="triton" if kernels else "torch_ref"))
        model = engine.runner.model
        g = torch.Generator().manual_seed(6)
        with torch.no_grad():
            for layer in model.model.layers:
                for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                    norm.weight.copy_(0.5 + torch.rand(norm.weight.shape, generator=g))
        if kernels:
            model.fold_norm_weights()
        runs[kernels] = run_greedy(engine, prompts, 4, arrive_every=2, capture_logits=True)
    assert calls["add"] > 0 and calls["silu_norm"] > 0
    (tok_torch, logits_torch), (tok_kernels, logits_kernels) = runs[False], runs[True]
    assert tok_kernels == tok_torch
    for i in range(len(prompts)):
        a, b = torch.stack(logits_kernels[i]), torch.stack(logits_torch[i])
        torch.testing.assert_close(a, b, rtol=0, atol=0.01 * b.abs().max().item())


def _counted(fn, name: str, calls: dict):
    def counted(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return fn(*args, **kwargs)

    return counted


# -- real shapes on the GPU ------------------------------------------------------------------------

LLAMA_8B = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, inter=14336, vocab=128256, theta=500000.0)
QWEN3_06B = dict(hidden=1024, heads=16, kv_heads=8, head_dim=128, inter=3072, vocab=151936, theta=1e6)
MODELS = {"llama8b": LLAMA_8B, "qwen3_0.6b": QWEN3_06B}
BF16 = torch.bfloat16


def linear_shapes(c: dict) -> dict[str, tuple[int, int]]:
    qkv = (c["heads"] + 2 * c["kv_heads"]) * c["head_dim"]
    return {"qkv": (qkv, c["hidden"]), "o": (c["hidden"], c["heads"] * c["head_dim"]),
            "gate_up": (2 * c["inter"], c["hidden"]), "down": (c["hidden"], c["inter"]),
            "lm_head": (c["vocab"], c["hidden"])}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("t", [1, 257])
def test_gpu_norms_real_shapes(model, t):
    c = MODELS[model]
    x, res = randn(t, c["hidden"], dtype=BF16, seed=30), randn(t, c["hidden"], dtype=BF16, seed=31)
    w = randn(c["hidden"], dtype=BF16, seed=32, scale=0.1) + 1
    assert_within_ulps(rms_norm.rms_norm(x, w, EPS), rms_norm.rms_norm_ref(x, w, EPS), NORM_ULPS[BF16])
    normed, new_res = rms_norm.fused_add_rms_norm(x, res, w, EPS)
    assert torch.equal(new_res, x + res)
    assert_within_ulps(normed, rms_norm.rms_norm_ref(x + res, w, EPS), NORM_ULPS[BF16])
    qkv = randn(t, (c["heads"] + 2 * c["kv_heads"]) * c["head_dim"], dtype=BF16, seed=33)
    q = qkv[:, : c["heads"] * c["head_dim"]].view(t, c["heads"], c["head_dim"])
    wq = randn(c["head_dim"], dtype=BF16, seed=34)
    assert_within_ulps(rms_norm.rms_norm(q, wq, EPS), rms_norm.rms_norm_ref(q, wq, EPS), NORM_ULPS[BF16])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("t", [1, 300])
def test_gpu_rotary_real_shapes_exact(model, t):
    c = MODELS[model]
    rope = RotaryEmbedding(c["head_dim"], 8192, c["theta"])
    cos_sin = rope.cos_sin.cuda()
    hq, hkv, d = c["heads"], c["kv_heads"], c["head_dim"]
    qkv = randn(t, (hq + 2 * hkv) * d, dtype=BF16, seed=35)
    q, k = qkv[:, : hq * d].view(t, hq, d), qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    positions = torch.randint(0, 8192, (t,), device="cuda")
    got, want = rotary.apply_rotary(positions, q, k, cos_sin), rotary.rotary_ref(positions, q, k, cos_sin)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("t", [1, 300])
def test_gpu_rope_store_real_shapes_exact(model, t):
    """Bit-exact against rotary then store_kv at real shapes in bf16, launched plainly and replayed in a
    CUDA graph (with PDL where the device has it) on new inputs."""
    c = MODELS[model]
    hq, hkv, d, block_size = c["heads"], c["kv_heads"], c["head_dim"], 16
    cos_sin = RotaryEmbedding(d, 8192, c["theta"]).cos_sin.cuda()
    qkv = randn(t, (hq + 2 * hkv) * d, dtype=BF16, seed=36)
    q = qkv[:, : hq * d].view(t, hq, d)
    k, v = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d), qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    num_blocks = -(-t // block_size) + 4
    cache = randn(2, num_blocks, block_size, hkv, d, dtype=BF16, seed=37)
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:t]  # distinct slots
    positions = torch.randint(0, 8192, (t,), device="cuda")
    want, want_cache = rope_store_reference(positions, q, k, v, cos_sin, cache, slots)
    got = rope_store.rope_store_kv(positions, q, k, v, cos_sin, cache[0], cache[1], slots)
    assert torch.equal(got, want) and torch.equal(cache, want_cache)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed = rope_store.rope_store_kv(positions, q, k, v, cos_sin, cache[0], cache[1], slots)
    qkv.copy_(randn(t, qkv.shape[1], dtype=BF16, seed=38))
    want, want_cache = rope_store_reference(positions, q, k, v, cos_sin, cache, slots)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graphed, want) and torch.equal(cache, want_cache)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("t", [1, 300])
def test_gpu_silu_and_mul_real_shapes(model, t):
    gate_up = randn(t, 2 * MODELS[model]["inter"], dtype=BF16, seed=36, scale=3.0)
    got, want = activation.silu_and_mul(gate_up), activation.silu_and_mul_ref(gate_up)
    assert_within_ulps(got, want, SILU_ULPS[BF16])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("proj", ["qkv", "o", "gate_up", "down", "lm_head"])
@pytest.mark.parametrize("m", [1, 2, 5, 16])
def test_gpu_skinny_linear_real_shapes(model, proj, m):
    n, k = linear_shapes(MODELS[model])[proj]
    x = randn(m, k, dtype=BF16, seed=37)
    w = randn(n, k, dtype=BF16, seed=38, scale=0.02)
    bias = randn(n, dtype=BF16, seed=39, scale=0.02) if proj == "qkv" else None
    assert_matmul_close(skinny_gemm.skinny_linear(x, w, bias), x, w, bias)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("m", [1, 4, 16])
def test_gpu_skinny_gate_up_silu_real_shapes(model, m):
    c = MODELS[model]
    x = randn(m, c["hidden"], dtype=BF16, seed=40)
    w = randn(2 * c["inter"], c["hidden"], dtype=BF16, seed=41, scale=0.02)
    got = skinny_gemm.skinny_gate_up_silu(x, w)
    want = activation.silu_and_mul_ref(F.linear(x, w))
    # gate and up may each sit an ulp from cuBLAS's (summation order); silu and the product add a
    # rounding each: a few bf16 ulps of the result's scale.
    torch.testing.assert_close(got, want, rtol=2.0**-6, atol=2.0**-6 * want.abs().max().item())


@pytest.mark.gpu
@gpu
def test_gpu_skinny_linear_replays_in_a_cuda_graph():
    x, w = randn(4, 4096, dtype=BF16, seed=42), randn(1024, 4096, dtype=BF16, seed=43, scale=0.02)
    split = SkinnyConfig(block_n=16, block_k=128, split_k=4, use_dot=True, num_stages=4)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        skinny_gemm.skinny_linear(x, w, config=split)
        skinny_gemm.skinny_gate_up_silu(x, w, config=split)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_gemm.skinny_linear(x, w, config=split)
        fused = skinny_gemm.skinny_gate_up_silu(x, w, config=split)
    x.copy_(randn(4, 4096, dtype=BF16, seed=44))
    graph.replay()
    torch.cuda.synchronize()
    assert_matmul_close(out, x, w, None)
    assert torch.equal(fused, skinny_gemm.skinny_gate_up_silu(x, w, config=split))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_gpu_tiny_model_same_greedy_tokens_with_and_without_triton(tiny_models, family, monkeypatch):
    from conftest import random_prompts, run_greedy

    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine

    prompts = random_prompts(4, 1, 40, seed=3)
    runs = {}
    for label, triton_on in [("triton", True), ("torch", False)]:
        monkeypatch.setattr(dispatch, "_enabled", triton_on)
        monkeypatch.setattr(linear_layer, "_skinny_mode", "1" if triton_on else "0")
        # A fixed small KV pool: the default takes most of the GPU, and two engines are alive here.
        engine = LLMEngine(EngineConfig(model=str(tiny_models[family]), device="cuda", dtype="bfloat16",
                                        max_num_batched_tokens=32, block_size=8, num_kv_blocks=128))
        runs[label] = run_greedy(engine, prompts, 8, capture_logits=True)
    (tok_a, logits_a), (tok_b, logits_b) = runs["triton"], runs["torch"]
    assert tok_a == tok_b
    for i in range(len(prompts)):
        a, b = torch.stack(logits_a[i]), torch.stack(logits_b[i])
        # Two bf16 layers: each kernel may round an ulp apart from torch; 2% of the logit range.
        torch.testing.assert_close(a, b, rtol=0, atol=0.02 * b.abs().max().item())


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_gpu_tiny_model_folded_norms_same_greedy_tokens(tiny_models, family, monkeypatch):
    """The fused-norm decode path compiled (test_folded_norms_fused_into_decode_matmuls_match_torch's
    check on the GPU), eager and replayed from CUDA graphs with overlapped steps: random MLP norm
    weights folded into gate/up, 1-2 row decode steps applying the norm in o's and silu-and-mul's
    launches; the torch layers on the unfolded model are the reference."""
    from conftest import random_prompts, run_greedy

    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine

    monkeypatch.setattr(linear_layer, "FUSE_GATE_UP_SILU", False)
    calls = {}
    _counting_fused_norms(monkeypatch, calls)
    prompts = random_prompts(3, 1, 40, seed=3)
    runs = {}
    for label, triton_on, eager in [("eager", True, True), ("graphs", True, False), ("torch", False, True)]:
        monkeypatch.setattr(dispatch, "_enabled", triton_on)
        monkeypatch.setattr(linear_layer, "_skinny_mode", "1" if triton_on else "0")
        engine = LLMEngine(EngineConfig(model=str(tiny_models[family]), device="cuda", dtype="bfloat16",
                                        max_num_batched_tokens=32, block_size=8, num_kv_blocks=128,
                                        enforce_eager=eager))
        model = engine.runner.model
        assert model.model.norms_folded == triton_on  # folded at load (HF's norms are all ones)
        g = torch.Generator().manual_seed(6)
        with torch.no_grad():
            for layer in model.model.layers:
                for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                    norm.weight.copy_(0.5 + torch.rand(norm.weight.shape, generator=g))
        if triton_on:  # in place, so graphs captured at load read the folded random norms
            model.fold_norm_weights()
        runs[label] = run_greedy(engine, prompts, 8, arrive_every=3, capture_logits=True)
    assert calls["add"] > 0 and calls["silu_norm"] > 0, "no step took the fused-norm path"
    tok_ref, logits_ref = runs.pop("torch")
    for label, (tokens, logits) in runs.items():
        for i in range(len(prompts)):
            # bf16 roundings in other places (the folded weights, the scale applied to unrounded sums)
            # may flip a near-tie; up to a fork, logits agree within bf16 noise, and at a fork the
            # reference's own top two were within that noise (a wrong row or scale is far outside it).
            fork = next((j for j, (x, y) in enumerate(zip(tokens[i], tok_ref[i])) if x != y), len(tok_ref[i]))
            a, b = torch.stack(logits[i][: fork + 1]), torch.stack(logits_ref[i][: fork + 1])
            noise = 0.03 * b.abs().max().item()
            where = f"{label}, prompt {i}"
            torch.testing.assert_close(a, b, rtol=0, atol=noise, msg=lambda m, where=where: f"{where}: {m}")
            if fork < len(tok_ref[i]):
                gap = b[fork, tok_ref[i][fork]] - b[fork, tokens[i][fork]]
                assert gap <= noise, f"{where}: fork at a confident token ({gap:.3g} > {noise:.3g})"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("model", sorted(MODELS))
def test_gpu_fused_norm_layer_chain_real_shapes(model):
    """A decode token's MLP at M=1 with its norm applied late (o + residual -> gate/up on the
    un-normalised stream -> silu-and-mul with the norm's scale -> down) against the unfused chain:
    add, norm, matmul, silu-and-mul, each as torch rounds it."""
    c = MODELS[model]
    shapes = linear_shapes(c)
    w = {p: randn(*shapes[p], dtype=BF16, seed=50 + i, scale=0.02) for i, p in enumerate(shapes)}
    w_post = randn(c["hidden"], dtype=BF16, seed=60, scale=0.2) + 1
    h = randn(1, c["hidden"], dtype=BF16, seed=62, scale=3.0)
    attn = randn(1, shapes["o"][1], dtype=BF16, seed=63)
    eps = 1e-5

    h2, parts = skinny_gemm.skinny_linear_add(attn, w["o"], h)
    gate_up_folded = (w["gate_up"].float() * w_post.float()).to(BF16)
    act = activation.silu_and_mul(F.linear(h2, gate_up_folded), RowNorm(parts, c["hidden"], eps))
    out = skinny_gemm.skinny_linear(act, w["down"])

    ref_h2 = F.linear(attn, w["o"]) + h
    ref_act = activation.silu_and_mul_ref(F.linear(rms_norm.rms_norm_ref(ref_h2, w_post, eps), w["gate_up"]))
    ref_out = F.linear(ref_act, w["down"])
    for got, want in [(h2, ref_h2), (act, ref_act), (out, ref_out)]:
        # bf16 roundings in other places (the folded weight, the scale applied to unrounded sums): a
        # few bf16 ulps of each result's scale.
        torch.testing.assert_close(got, want, rtol=2.0**-5, atol=2.0**-5 * want.abs().max().item())
    torch.testing.assert_close(parts.sum(-1), h2.float().pow(2).sum(-1), rtol=1e-5, atol=0)


def test_skinny_logits_in_fp32():
    """fp32 logits from 16-bit activations: the fp32 accumulator is written unrounded, as the lm_head's
    LOGITS_CONFIG does (bf16 logits would tie at the top of a large vocabulary)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 96, generator=g).half().to(DEVICE)
    w = (torch.randn(200, 96, generator=g) * 0.1).half().to(DEVICE)
    got = skinny_gemm.skinny_linear(x, w, config=skinny_gemm.LOGITS_CONFIG, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    want = x.double() @ w.double().T
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)  # far inside one fp16 ulp
    assert (got.half().float() != got).any(), "the result was rounded to fp16 on the way"


def test_pdl_launches_only_where_the_device_has_it():
    from plait.kernels import pdl

    assert not pdl.use_pdl(torch.zeros(1))  # CPU (and the interpreter) never launch with PDL
    if ON_GPU:
        cuda = torch.zeros(1, device="cuda")
        assert pdl.use_pdl(cuda) == (torch.cuda.get_device_capability() >= pdl.MIN_CAPABILITY)
        pdl.set_pdl_enabled(False)
        try:
            assert not pdl.use_pdl(cuda)
        finally:
            pdl.set_pdl_enabled(True)


@pytest.mark.gpu
@gpu
def test_gpu_pdl_chain_in_a_graph_equals_plain_launches():
    """A decode layer's kernel chain (norm, skinny GEMV, rotary, silu) captured in a CUDA graph and replayed
    on new inputs: with PDL each kernel starts while the one before drains, and must still see its
    writes, so the results equal plain launches bit for bit."""
    from plait.kernels import pdl

    hidden, heads, d = 4096, 32, 128
    x = randn(1, hidden, dtype=BF16, seed=40)
    w_norm = randn(hidden, dtype=BF16, seed=41, scale=0.1) + 1
    w_qkv, w_up = randn(heads * d, hidden, dtype=BF16, seed=42), randn(2 * 2048, hidden, dtype=BF16, seed=43)
    cos_sin = RotaryEmbedding(d, 4096, 10000.0).cos_sin.cuda()
    positions = torch.tensor([17], device="cuda")

    def chain(inp):
        h = rms_norm.rms_norm(inp, w_norm, EPS)
        q = skinny_gemm.skinny_linear(h, w_qkv).view(1, heads, d)
        q, _ = rotary.apply_rotary(positions, q, q[:, :8], cos_sin)
        g = activation.silu_and_mul(skinny_gemm.skinny_linear(q.reshape(1, hidden), w_up))
        return rms_norm.rms_norm(torch.cat([g, g], dim=-1), w_norm, EPS)

    results = {}
    for enabled in (False, True):
        pdl.set_pdl_enabled(enabled)
        try:
            static = x.clone()
            chain(static)  # compile outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = chain(static)
            static.copy_(randn(1, hidden, dtype=BF16, seed=44))
            graph.replay()
            torch.cuda.synchronize()
            results[enabled] = out.clone()
        finally:
            pdl.set_pdl_enabled(True)
    want = chain(randn(1, hidden, dtype=BF16, seed=44))
    assert torch.equal(results[True], results[False]) and torch.equal(results[True], want)
