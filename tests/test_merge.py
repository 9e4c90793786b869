"""merge_attn_states: exact split-softmax combination, NaN-safe when either or both sides are empty."""

from __future__ import annotations

import pytest
import torch

from plait.attention.merge import merge_attn_states

T, H, D, N = 7, 3, 16, 20


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None = None):
    """q [T, H, D], k/v [N, H, D], visible [T, H, N] or [T, N] bool -> out [T, H, D], lse [T, H].

    A (token, head) that sees no key gets lse -inf and an out of NaN: the garbage a kernel leaves."""
    scores = torch.einsum("thd,nhd->thn", q, k) / D**0.5
    if visible is not None:
        if visible.dim() == 2:
            visible = visible[:, None, :].expand_as(scores)
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    return torch.einsum("thn,nhd->thd", probs, v), lse


def _qkv(seed: int, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g) * scale
    k = torch.randn(N, H, D, generator=g)
    v = torch.randn(N, H, D, generator=g)
    return q, k, v, g


@pytest.mark.parametrize("seed", range(5))
def test_merging_two_disjoint_key_sets_equals_attention_over_all(seed):
    q, k, v, g = _qkv(seed)
    in_a = torch.randperm(N, generator=g) < (seed % 4 + 1) * 4  # random disjoint split, sizes 4..16
    out_a, lse_a = attention(q, k[in_a], v[in_a])
    out_b, lse_b = attention(q, k[~in_a], v[~in_a])
    out_full, lse_full = attention(q, k, v)
    out, lse = merge_attn_states(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out, out_full, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, lse_full, atol=1e-5, rtol=0)
    # Symmetric in its two sides.
    out_ba, lse_ba = merge_attn_states(out_b, lse_b, out_a, lse_a)
    torch.testing.assert_close(out_ba, out, atol=1e-6, rtol=0)
    torch.testing.assert_close(lse_ba, lse, atol=1e-6, rtol=0)


def test_merge_is_stable_for_large_logits():
    # Scores in the hundreds: exp(lse) overflows fp32; only a max-shifted merge gets this right.
    q, k, v, _ = _qkv(11, scale=60.0)
    out_a, lse_a = attention(q, k[:9], v[:9])
    out_b, lse_b = attention(q, k[9:], v[9:])
    assert lse_a.abs().max() > 100
    out_full, lse_full = attention(q, k, v)
    out, lse = merge_attn_states(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out, out_full, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, lse_full, atol=1e-4, rtol=1e-6)


@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), 1e30])
def test_an_empty_side_returns_the_other_exactly(garbage):
    q, k, v, _ = _qkv(3)
    out_x, lse_x = attention(q, k, v)
    empty_out = torch.full_like(out_x, garbage)
    empty_lse = torch.full_like(lse_x, float("-inf"))
    # Empty prefix (nothing cached yet), then empty suffix.
    for args in [(empty_out, empty_lse, out_x, lse_x), (out_x, lse_x, empty_out, empty_lse)]:
        out, lse = merge_attn_states(*args)
        assert torch.equal(out, out_x) and torch.equal(lse, lse_x)


def test_both_sides_empty_gives_zeros_and_minus_inf():
    nan_out = torch.full((T, H, D), float("nan"))
    neg_inf = torch.full((T, H), float("-inf"))
    out, lse = merge_attn_states(nan_out, neg_inf, nan_out.clone(), neg_inf.clone())
    assert torch.equal(out, torch.zeros(T, H, D))
    assert torch.isneginf(lse).all()
    # The real empty outputs of the reference (NaN from 0/0) behave the same.
    q, k, v, _ = _qkv(4)
    nothing = torch.zeros(T, N, dtype=torch.bool)
    out_a, lse_a = attention(q, k, v, nothing)
    assert torch.isnan(out_a).all() and torch.isneginf(lse_a).all()
    out, lse = merge_attn_states(out_a, lse_a, out_a, lse_a)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    # Merging the empty result again with a real one is still exact: nothing was poisoned.
    out_b, lse_b = attention(q, k, v)
    out2, lse2 = merge_attn_states(out, lse, out_b, lse_b)
    assert torch.equal(out2, out_b) and torch.equal(lse2, lse_b)


def test_rows_empty_on_different_sides_in_one_call():
    """Hazard 5: one batch mixes first chunks (no prefix), decodes, and (token, head)s that see
    nothing on one side; each must merge on its own, and no NaN may leak across rows."""
    q, k, v, g = _qkv(7)
    a, b = slice(0, 8), slice(8, N)
    visible = torch.rand(T, H, N, generator=g) < 0.6
    visible[0] = True  # both sides non-empty
    visible[1, :, a] = False  # prefix empty (a first chunk)
    visible[2, :, b] = False  # suffix empty
    visible[3] = False  # both empty
    visible[4, 0, a] = False  # prefix empty for one head only
    visible[4, 1, b] = False  # suffix empty for another head
    visible[5, 2] = False  # one head sees nothing at all
    out_a, lse_a = attention(q, k[a], v[a], visible[:, :, a])
    out_b, lse_b = attention(q, k[b], v[b], visible[:, :, b])
    assert torch.isnan(out_a).any() and torch.isnan(out_b).any()  # real garbage on empty sides
    out, lse = merge_attn_states(out_a, lse_a, out_b, lse_b)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()

    out_full, lse_full = attention(q, k, v, visible)
    sees_any = visible.any(dim=-1)  # [T, H]
    torch.testing.assert_close(out[sees_any], out_full[sees_any], atol=1e-5, rtol=0)
    torch.testing.assert_close(lse[sees_any], lse_full[sees_any], atol=1e-5, rtol=0)
    assert torch.equal(out[~sees_any], torch.zeros_like(out[~sees_any]))
    assert torch.isneginf(lse[~sees_any]).all()
    # Where one side is empty, the other passes through bit for bit.
    only_b = torch.isneginf(lse_a) & ~torch.isneginf(lse_b)
    only_a = torch.isneginf(lse_b) & ~torch.isneginf(lse_a)
    assert only_a.any() and only_b.any()
    assert torch.equal(out[only_b], out_b[only_b]) and torch.equal(out[only_a], out_a[only_a])


def test_low_precision_outputs_keep_their_dtype():
    q, k, v, _ = _qkv(5)
    out_a, lse_a = attention(q, k[:10], v[:10])
    out_b, lse_b = attention(q, k[10:], v[10:])
    out_full, _ = attention(q, k, v)
    out, lse = merge_attn_states(out_a.bfloat16(), lse_a, out_b.bfloat16(), lse_b)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(out.float(), out_full, atol=2e-2, rtol=0)
    # An empty side still passes the other through unchanged in bf16.
    nan = torch.full_like(out_a, float("nan")).bfloat16()
    out, _ = merge_attn_states(nan, torch.full_like(lse_a, float("-inf")), out_b.bfloat16(), lse_b)
    assert torch.equal(out, out_b.bfloat16())
