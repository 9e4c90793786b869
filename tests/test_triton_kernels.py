"""Triton store_kv and merge_attn_states against their torch references (interpreter on CPU, CUDA on GPU)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from plait.attention.merge import merge_attn_states as merge_ref  # noqa: E402
from plait.engine.kv_cache import PAD_BLOCK_ID  # noqa: E402
from plait.kernels.merge_states import merge_attn_states  # noqa: E402
from plait.kernels.store_kv import store_kv, store_kv_ref  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
T, H, D = 7, 3, 16


def gpu(test):
    """Marks a test as needing CUDA; it skips where there is none."""
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")(test))


# ---- store_kv ---------------------------------------------------------------------------------------------


def _store_case(num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str,
                seed: int):
    """Strided k/v (slices of a fused projection), a shuffled cache, slots in random blocks plus two
    padded rows that write to the pad block."""
    g = torch.Generator().manual_seed(seed)
    block_size = 4
    num_blocks = max(6, -(-num_tokens // block_size) + 2)  # room for every token outside the pad block
    fused = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=g)
    k, v = fused[:, num_kv_heads: 2 * num_kv_heads], fused[:, 2 * num_kv_heads:]
    real = torch.randperm((num_blocks - 1) * block_size, generator=g)[: num_tokens - 2] + block_size
    slots = torch.cat([real, torch.full((2,), PAD_BLOCK_ID * block_size + 1)])
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    return k.to(device), v.to(device), cache.to(device), slots.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_matches_index_copy(dtype):
    k, v, cache, slots = _store_case(9, 2, 32, dtype, "cpu", seed=0)
    expected = cache.clone()
    store_kv_ref(k, v, expected[0], expected[1], slots)
    store_kv(k, v, cache[0], cache[1], slots)
    assert torch.equal(cache, expected)


def test_store_kv_into_head_major_cache():
    # The runner's layout: [2, blocks, Hkv, block_size, D] storage seen as [2, blocks, block_size, Hkv, D].
    k, v, cache, slots = _store_case(9, 2, 32, torch.float32, "cpu", seed=3)
    head_major = cache.transpose(2, 3).contiguous().transpose(2, 3)
    expected = cache.clone()
    store_kv_ref(k, v, expected[0], expected[1], slots)
    store_kv(k, v, head_major[0], head_major[1], slots)
    assert torch.equal(head_major, expected)
    ref_head_major = cache.transpose(2, 3).contiguous().transpose(2, 3)
    store_kv_ref(k, v, ref_head_major[0], ref_head_major[1], slots)
    assert torch.equal(ref_head_major, expected)


def test_store_kv_pads_odd_head_counts_and_dims():
    k, v, cache, slots = _store_case(5, 3, 24, torch.float32, "cpu", seed=1)
    expected = cache.clone()
    store_kv_ref(k, v, expected[0], expected[1], slots)
    store_kv(k, v, cache[0], cache[1], slots)
    assert torch.equal(cache, expected)


def test_store_kv_rejects_bad_layouts():
    k, v, cache, slots = _store_case(5, 2, 16, torch.float32, "cpu", seed=2)
    with pytest.raises(ValueError, match="int64"):
        store_kv(k, v, cache[0], cache[1], slots.int())
    with pytest.raises(ValueError, match="shape"):
        store_kv(k, v[:, :1], cache[0], cache[1], slots)


# ---- merge_attn_states ------------------------------------------------------------------------------


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None = None):
    """q [T, H, D], k/v [N, H, D], visible [T, H, N] -> out, lse; a query seeing nothing gets NaN / -inf."""
    scores = torch.einsum("thd,nhd->thn", q, k) / D**0.5
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.einsum("thn,nhd->thd", torch.exp(scores - lse[..., None]), v), lse


def _qkv(seed: int, n: int = 20, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, H, D, generator=g) * scale, torch.randn(n, H, D, generator=g),
            torch.randn(n, H, D, generator=g), g)


def _both(out_a, lse_a, out_b, lse_b, device: str = "cpu"):
    """(triton result, torch result) of one merge."""
    args = [x.to(device) for x in (out_a, lse_a, out_b, lse_b)]
    return merge_attn_states(*args), merge_ref(*args)


@pytest.mark.parametrize("scale", [1.0, 60.0])  # 60: logits in the hundreds, exp(lse) overflows fp32
def test_merge_matches_torch_and_full_attention(scale):
    q, k, v, g = _qkv(int(scale), scale=scale)
    in_a = torch.randperm(20, generator=g) < 9
    a, b = attention(q, k[in_a], v[in_a]), attention(q, k[~in_a], v[~in_a])
    (out, lse), (out_ref, lse_ref) = _both(*a, *b)
    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, lse_ref, atol=1e-4, rtol=1e-6)
    out_full, lse_full = attention(q, k, v)
    # Full attention sums in another order, from scores whose fp32 ulp at scale 60 (hundreds) is ~3e-5:
    # the two agree to that, not to the merge's own 1e-5 (this CPU measured 1.3e-5 apart).
    torch.testing.assert_close(out, out_full, atol=1e-5 * scale ** 0.5, rtol=0)


@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), 1e30])
def test_merge_empty_side_returns_the_other_exactly(garbage):
    q, k, v, _ = _qkv(3)
    out_x, lse_x = attention(q, k, v)
    empty = (torch.full_like(out_x, garbage), torch.full_like(lse_x, float("-inf")))
    for args in [(*empty, out_x, lse_x), (out_x, lse_x, *empty)]:
        (out, lse), (out_ref, lse_ref) = _both(*args)
        assert torch.equal(out, out_x) and torch.equal(lse, lse_x)
        assert torch.equal(out, out_ref) and torch.equal(lse, lse_ref)


def test_merge_both_empty_gives_zeros_and_minus_inf():
    nan_out, neg_inf = torch.full((T, H, D), float("nan")), torch.full((T, H), float("-inf"))
    (out, lse), _ = _both(nan_out, neg_inf, nan_out, neg_inf)
    assert torch.equal(out, torch.zeros(T, H, D)) and torch.isneginf(lse).all()
    # Merging the empty result with a real one afterwards is exact: nothing was poisoned.
    q, k, v, _ = _qkv(4)
    out_b, lse_b = attention(q, k, v)
    (out2, lse2), _ = _both(out, lse, out_b, lse_b)
    assert torch.equal(out2, out_b) and torch.equal(lse2, lse_b)


def test_merge_rows_empty_on_different_sides_in_one_call():
    """Tokens and heads empty on one side, the other, or both, side by side (hazard 5)."""
    q, k, v, g = _qkv(7)
    a, b = slice(0, 8), slice(8, 20)
    visible = torch.rand(T, H, 20, generator=g) < 0.6
    visible[0] = True
    visible[1, :, a] = False
    visible[2, :, b] = False
    visible[3] = False
    visible[4, 0, a] = False
    visible[4, 1, b] = False
    visible[5, 2] = False
    side_a, side_b = attention(q, k[a], v[a], visible[:, :, a]), attention(q, k[b], v[b], visible[:, :, b])
    assert torch.isnan(side_a[0]).any() and torch.isnan(side_b[0]).any()
    (out, lse), (out_ref, lse_ref) = _both(*side_a, *side_b)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out, out_ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(lse, lse_ref, atol=1e-6, rtol=0)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))


def test_merge_keeps_low_precision_dtype_and_reads_strided_inputs():
    q, k, v, _ = _qkv(5)
    (out_a, lse_a), (out_b, lse_b) = attention(q, k[:10], v[:10]), attention(q, k[10:], v[10:])
    wide = torch.zeros(T, 2 * H, D, dtype=torch.float16)
    wide[:, 1::2] = out_a.half()  # every other head: a strided [T, H, D] view
    (out, lse), (out_ref, lse_ref) = _both(wide[:, 1::2], lse_a, out_b.half(), lse_b)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32
    torch.testing.assert_close(out, out_ref, atol=1e-3, rtol=0)
    torch.testing.assert_close(lse, lse_ref, atol=1e-6, rtol=0)


# ---- GPU --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@gpu
def test_gpu_store_kv_matches_index_copy(dtype):
    k, v, cache, slots = _store_case(300, 8, 128, dtype, "cuda", seed=3)
    expected = cache.clone()
    store_kv_ref(k, v, expected[0], expected[1], slots)
    store_kv(k, v, cache[0], cache[1], slots)
    # The two padded rows both write the pad block: which lands last is unordered on the GPU, and
    # nothing ever reads it. Every real block must match exactly.
    real = [b for b in range(cache.shape[1]) if b != PAD_BLOCK_ID]
    assert torch.equal(cache[:, real], expected[:, real])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@gpu
def test_gpu_merge_matches_torch_with_empty_sides(dtype):
    q, k, v, g = _qkv(9, n=64)
    visible = torch.rand(T, H, 64, generator=g) < 0.5
    visible[1, :, :30] = False
    visible[2, :, 30:] = False
    visible[3] = False
    side_a = attention(q, k[:30], v[:30], visible[:, :, :30])
    side_b = attention(q, k[30:], v[30:], visible[:, :, 30:])
    (out, lse), (out_ref, lse_ref) = _both(side_a[0].to(dtype), side_a[1], side_b[0].to(dtype), side_b[1],
                                           "cuda")
    assert out.dtype == dtype and not torch.isnan(out).any()
    atol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), out_ref.float(), atol=atol, rtol=0)
    torch.testing.assert_close(lse, lse_ref, atol=1e-5, rtol=1e-6)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))


# ---- prepare_step_inputs ---------------------------------------------------------------------------------


def _staged_step(used: int, num_tokens: int, num_prev: int, seed: int):
    """A flat staged step: token ids (some of them pending markers into prev_ids), then other fields."""
    from plait.runner.input_buffers import pending_marker

    g = torch.Generator().manual_seed(seed)
    staged = torch.randint(0, 50_000, (used,), generator=g)
    prev_ids = torch.randint(0, 50_000, (num_prev,), generator=g)
    if num_prev:
        dst = torch.randperm(num_tokens, generator=g)[: min(num_prev, num_tokens)]
        src = torch.randint(0, num_prev, (len(dst),), generator=g)
        staged[dst] = torch.tensor([pending_marker(int(s)) for s in src])
    staged[num_tokens:][::7] = -1  # negative values past the ids (pad ids elsewhere) are copied as they are
    return staged, prev_ids


@pytest.mark.parametrize("used,num_tokens,num_prev", [(1, 1, 1), (37, 5, 3), (3000, 1024, 256), (2050, 7, 0)])
def test_prepare_step_inputs_matches_reference(used, num_tokens, num_prev):
    from plait.kernels.step_inputs import prepare_step_inputs
    from plait.runner.input_buffers import prepare_step_inputs_ref

    staged, prev_ids = _staged_step(used, num_tokens, num_prev, seed=used)
    want64, want32 = torch.full((used + 9,), 7), torch.full((used + 9,), 7, dtype=torch.int32)
    prepare_step_inputs_ref(staged, num_tokens, prev_ids if num_prev else None, want64, want32)
    got64, got32 = torch.full((used + 9,), 7), torch.full((used + 9,), 7, dtype=torch.int32)
    prepare_step_inputs(staged, num_tokens, prev_ids if num_prev else None, got64, got32)
    assert torch.equal(got64, want64) and torch.equal(got32, want32)
    assert (want64[:num_tokens] >= 0).all()  # every marker was replaced by its source's id
    assert (want64[used:] == 7).all()  # nothing past the staged prefix is touched
    assert torch.equal(want32[:used], want64[:used].int())


@gpu
def test_gpu_prepare_step_inputs_matches_reference():
    from plait.kernels.step_inputs import prepare_step_inputs
    from plait.runner.input_buffers import prepare_step_inputs_ref

    staged, prev_ids = _staged_step(40_000, 2048, 256, seed=3)
    want64, want32 = torch.zeros(40_000, dtype=torch.long), torch.zeros(40_000, dtype=torch.int32)
    prepare_step_inputs_ref(staged, 2048, prev_ids, want64, want32)
    got64 = torch.zeros(40_000, dtype=torch.long, device="cuda")
    got32 = torch.zeros(40_000, dtype=torch.int32, device="cuda")
    prepare_step_inputs(staged.cuda(), 2048, prev_ids.cuda(), got64, got32)
    assert torch.equal(got64.cpu(), want64) and torch.equal(got32.cpu(), want32)
