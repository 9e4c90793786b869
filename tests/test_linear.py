"""plait.layers.linear on CPU: fp32 through oneDNN's linear (every core at any row count), the result
F.linear's to rounding; other dtypes, and torches without oneDNN, through F.linear (2-3 rows padded to 4)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import plait.layers.linear as plait_linear
from plait.layers.linear import CPU_GEMM_MIN_ROWS, linear


def _onednn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


@pytest.mark.parametrize("shape", [(0, 64), (1, 64), (2, 64), (3, 64), (4, 64), (33, 64), (2, 5, 64)])
@pytest.mark.parametrize("bias", [False, True])
@torch.no_grad()
def test_fp32_cpu_linear_is_onednns_and_f_linears_to_rounding(shape, bias):
    assert plait_linear._onednn_linear, "this CPU torch has oneDNN: the fast path must be taken"
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(shape, generator=g), torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    got = linear(x, w, b)
    assert got.shape == (*shape[:-1], 96)
    assert torch.equal(got, _onednn(x, w, b))  # the path taken
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    strided = torch.randn(64, shape[0] if len(shape) == 2 else 1, generator=g).t()  # a transposed view
    torch.testing.assert_close(linear(strided, w, b), F.linear(strided, w, b), rtol=1e-5, atol=1e-5)


def test_bf16_keeps_f_linear():
    """Only fp32 was measured on oneDNN's path: bf16 stays on F.linear (3 rows padded to 4)."""
    x, w = torch.randn(3, 64, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16)
    padded = torch.cat([x, x.new_zeros(CPU_GEMM_MIN_ROWS - 3, 64)])
    assert torch.equal(linear(x, w), F.linear(padded, w)[:3])


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_without_onednn_2_or_3_rows_take_the_matrix_kernel(monkeypatch, rows):
    """A torch without oneDNN: 2-3 rows are F.linear's of the input padded with zero rows to 4, bit for bit
    (MKL's matrix-vector path would read the weight once a row); 1 and 4+ rows are F.linear's as they are."""
    monkeypatch.setattr(plait_linear, "_onednn_linear", False)
    x, w = torch.randn(rows, 64), torch.randn(48, 64)
    padded = torch.cat([x, x.new_zeros(max(CPU_GEMM_MIN_ROWS - rows, 0), 64)]) if 1 < rows else x
    assert torch.equal(linear(x, w), F.linear(padded, w)[:rows])


def test_autograd_keeps_f_linear():
    """oneDNN's linear has no backward: under autograd with a weight that wants gradients, F.linear runs, so
    a layer trained outside the engine gets true gradients."""
    w = torch.randn(32, 64, requires_grad=True)
    x = torch.randn(5, 64)
    y = linear(x, w)
    assert torch.equal(y, F.linear(x, w))
    y.sum().backward()
    torch.testing.assert_close(w.grad, x.sum(0).expand(32, 64))


def test_a_onednn_linear_that_fails_here_is_not_taken(monkeypatch):
    """The op is probed once: where it exists but fails on this CPU, or answers wrong, F.linear stays."""
    def failing(*args):
        raise RuntimeError("no kernel for this CPU")

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", failing)
    assert not plait_linear._onednn_linear_available()
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, w, *rest: F.linear(x, w) + 1)
    assert not plait_linear._onednn_linear_available()
