"""Mamba2 mixer operations: the torch reference against the plain recurrence, and every Triton
kernel against the reference (interpreter on CPU, tiny shapes; real sizes on CUDA)."""

from __future__ import annotations

import pytest
import torch

from plait.layers.mamba_ops import (
    causal_conv1d_ref,
    gated_rms_norm_ref,
    make_rows,
    softplus_dt,
    ssd_scan_ref,
    ssd_varlen_ref,
    ssm_step_ref,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# Tiny-shape kernel tests run in the Triton interpreter on CPU-only machines, on the GPU elsewhere.
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NO_LIMIT = (0.0, float("inf"))


def _rows(lens: list[int], first: list[bool], slots: list[int], device: str = "cpu"):
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=device)
    return make_rows(qsl, torch.tensor(slots, device=device), torch.tensor(first, device=device))


# A step of every kind of row: one-token first chunks and decodes, rows shorter than the conv
# window continuing from state, first and later chunks longer than one SSD tile.
MIXED_LENS = [5, 1, 2, 37, 1, 3, 16, 1]
MIXED_FIRST = [True, False, True, False, True, False, True, False]
MIXED_SLOTS = [3, 1, 5, 2, 4, 6, 7, 8]


def _ssd_inputs(num_tokens: int, heads: int, head_dim: int, state: int, groups: int, slots: int,
                dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> dict:
    """Inputs laid out as the mixer passes them: strided views into one projection output."""
    g = torch.Generator(device=device).manual_seed(seed)
    width = heads * head_dim + 2 * groups * state + heads + 7
    proj = torch.randn(num_tokens, width, generator=g, device=device).to(dtype)
    x, b, c, dt = proj.split([heads * head_dim, groups * state, groups * state, heads + 7], dim=-1)
    return dict(
        x=x.view(num_tokens, heads, head_dim), dt=dt[:, :heads],
        A=-torch.rand(heads, generator=g, device=device) * 4, B=b.view(num_tokens, groups, state),
        C=c.view(num_tokens, groups, state), D=torch.randn(heads, generator=g, device=device),
        dt_bias=torch.randn(heads, generator=g, device=device),
        ssm_state=torch.randn(slots, heads, head_dim, state, generator=g, device=device),
    )


def _run_ssd(fn, inp: dict, rows, dt_limit=NO_LIMIT, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    state = inp["ssm_state"].clone()
    y = fn(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dt_bias"], dt_limit, state, rows,
           16, **kw)
    return y, state


# -- the reference against the definition ---------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [4, 16, 64])
def test_scan_equals_the_token_by_token_recurrence(chunk_size):
    g = torch.Generator().manual_seed(1)
    length, heads, head_dim, state = 37, 4, 8, 16
    x = torch.randn(length, heads, head_dim, generator=g)
    dt = softplus_dt(torch.randn(length, heads, generator=g), torch.zeros(heads), NO_LIMIT)
    A, D = -torch.rand(heads, generator=g) * 3, torch.randn(heads, generator=g)
    B, C = torch.randn(length, heads, state, generator=g), torch.randn(length, heads, state, generator=g)
    s0 = torch.randn(heads, head_dim, state, generator=g)
    y, final = ssd_scan_ref(x, dt, A, B, C, D, s0, chunk_size)
    s, ys = s0[None], []
    for t in range(length):
        out, s = ssm_step_ref(x[t : t + 1], dt[t : t + 1], A, B[t : t + 1], C[t : t + 1], D, s)
        ys.append(out[0])
    torch.testing.assert_close(y, torch.stack(ys), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, s[0], atol=1e-4, rtol=1e-4)


def test_conv_reference_equals_a_full_causal_conv():
    g = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(20, 12, generator=g), torch.randn(12, 4, generator=g), torch.randn(12, generator=g)
    state = torch.randn(2, 3, 12, generator=g)
    out = causal_conv1d_ref(x, w, b, state, _rows([20], [True], [1]), silu=False)
    full = torch.nn.functional.conv1d(x.t()[None], w[:, None], b, padding=3, groups=12)[0, :, :20].t()
    torch.testing.assert_close(out, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state[1], x[-3:])


@pytest.mark.parametrize("split", [1, 2, 3, 16, 20])
def test_a_row_split_in_two_steps_equals_the_whole_row(split):
    """The second chunk continues from the state the first left (conv window and SSM state)."""
    inp = _ssd_inputs(37, 4, 8, 16, 2, slots=3, dtype=torch.float32)
    whole_y, whole_state = _run_ssd(ssd_varlen_ref, inp, _rows([37], [True], [1]))
    state = inp["ssm_state"].clone()
    args = [inp[k] for k in ("x", "dt", "A", "B", "C", "D", "dt_bias")]
    y1 = ssd_varlen_ref(*[a[:split] if a.dim() > 1 else a for a in args], NO_LIMIT, state,
                        _rows([split], [True], [2]), 16)
    y2 = ssd_varlen_ref(*[a[split:] if a.dim() > 1 else a for a in args], NO_LIMIT, state,
                        _rows([37 - split], [False], [2]), 16)
    torch.testing.assert_close(torch.cat([y1, y2]), whole_y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state[2], whole_state[1], atol=1e-4, rtol=1e-4)

    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(37, 12, generator=g), torch.randn(12, 4, generator=g)
    conv_state = torch.randn(3, 3, 12, generator=g)
    whole = causal_conv1d_ref(x, w, None, conv_state, _rows([37], [True], [1]))
    part = torch.cat([causal_conv1d_ref(x[:split], w, None, conv_state, _rows([split], [True], [2])),
                      causal_conv1d_ref(x[split:], w, None, conv_state, _rows([37 - split], [False], [2]))])
    torch.testing.assert_close(part, whole)
    torch.testing.assert_close(conv_state[2], conv_state[1])


@pytest.mark.parametrize("length", [1, 2, 3, 20])
def test_a_first_chunk_ignores_whatever_its_slot_held(length):
    inp = _ssd_inputs(length, 4, 8, 16, 1, slots=2, dtype=torch.float32)
    rows = _rows([length], [True], [1])
    y_stale, s_stale = _run_ssd(ssd_varlen_ref, inp, rows)
    y_zero, s_zero = _run_ssd(ssd_varlen_ref, {**inp, "ssm_state": torch.zeros_like(inp["ssm_state"])}, rows)
    torch.testing.assert_close(y_stale, y_zero)
    torch.testing.assert_close(s_stale[1], s_zero[1])
    x, w = torch.randn(length, 12), torch.randn(12, 4)
    stale, zero = torch.randn(2, 3, 12), torch.zeros(2, 3, 12)
    from_stale = causal_conv1d_ref(x, w, None, stale, rows)
    torch.testing.assert_close(from_stale, causal_conv1d_ref(x, w, None, zero, rows))
    torch.testing.assert_close(stale[1], zero[1])


# -- Triton kernels against the reference ---------------------------------------------------------


def _conv_case(dtype: torch.dtype, device: str, lens: list[int], dim: int, num_slots: int, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    wide = torch.randn(sum(lens), dim + 10, generator=g, device=device).to(dtype)
    x = wide[:, 3 : 3 + dim]  # strided rows, as the split of the projection output
    w = torch.randn(dim, 4, generator=g, device=device).to(dtype)
    b = torch.randn(dim, generator=g, device=device).to(dtype)
    state = torch.randn(num_slots, 3, dim, generator=g, device=device).to(dtype)
    return x, w, b, state


def _check_conv(dtype, device, lens, first, slots, dim, atol):
    from plait.kernels.mamba_conv import causal_conv1d_varlen

    x, w, b, state = _conv_case(dtype, device, lens, dim, max(slots) + 1)
    rows = _rows(lens, first, slots, device)
    ref_state, got_state = state.clone(), state.clone()
    ref = causal_conv1d_ref(x, w, b, ref_state, rows)
    got = causal_conv1d_varlen(x, w, b, got_state, rows)
    torch.testing.assert_close(got, ref, atol=atol, rtol=atol)
    torch.testing.assert_close(got_state, ref_state, atol=0, rtol=0)


def _check_ssd(dtype, device, lens, first, slots, heads, head_dim, state, groups, atol, dt_limit=NO_LIMIT,
               block_q=16):
    from plait.kernels.mamba_scan import ssd_varlen

    inp = _ssd_inputs(sum(lens), heads, head_dim, state, groups, max(slots) + 1, dtype, device)
    rows = _rows(lens, first, slots, device)
    ref_y, ref_state = _run_ssd(ssd_varlen_ref, inp, rows, dt_limit)
    got_y, got_state = _run_ssd(ssd_varlen, inp, rows, dt_limit, block_q=block_q)
    scale = ref_y.float().abs().max().item()
    torch.testing.assert_close(got_y.float(), ref_y.float(), atol=atol * scale, rtol=0)
    torch.testing.assert_close(got_state, ref_state, atol=atol * ref_state.abs().max().item(), rtol=0)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_conv_kernel_matches_reference(dtype, atol):
    _check_conv(dtype, KERNEL_DEVICE, MIXED_LENS, MIXED_FIRST, MIXED_SLOTS, dim=40, atol=atol)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_ssd_kernels_match_reference(dtype, atol):
    """The scan (rows of 2+ tokens) and the single step (one-token rows) in one mixed step."""
    _check_ssd(dtype, KERNEL_DEVICE, MIXED_LENS, MIXED_FIRST, MIXED_SLOTS, heads=4, head_dim=16, state=16,
               groups=2, atol=atol)


def test_ssd_kernels_apply_the_time_step_limit():
    _check_ssd(torch.float32, KERNEL_DEVICE, [1, 20], [False, True], [1, 2], heads=2, head_dim=16, state=16,
               groups=1, atol=1e-5, dt_limit=(0.05, 0.5))


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_gated_norm_kernel_matches_reference(dtype, atol):
    from plait.kernels.mamba_norm import gated_rms_norm

    g = torch.Generator().manual_seed(4)
    yz = torch.randn(5, 2 * 48 + 3, generator=g).to(device=KERNEL_DEVICE, dtype=dtype)
    y, z = yz[:, :48], yz[:, 48:96]
    weight = torch.randn(48, generator=g).to(device=KERNEL_DEVICE, dtype=dtype)
    got = gated_rms_norm(y, z, weight, 24, 1e-5)
    torch.testing.assert_close(got, gated_rms_norm_ref(y, z, weight, 24, 1e-5), atol=atol, rtol=atol)


# -- real sizes on the GPU ------------------------------------------------------------------------

# A mixed step at a Bamba-like mixer size: decodes, short continuations, long first chunks.
GPU_LENS = [1, 1, 1, 7, 64, 129, 1000, 1, 300, 2]
GPU_FIRST = [False, True, False, False, True, True, True, False, False, True]
GPU_SLOTS = [9, 2, 7, 4, 5, 6, 1, 3, 8, 10]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("kind", ["conv", "ssd", "norm"])
def test_kernels_match_reference_on_gpu(kind, dtype, atol):
    if kind == "conv":
        _check_conv(dtype, "cuda", GPU_LENS, GPU_FIRST, GPU_SLOTS, dim=4096 + 2 * 128, atol=atol)
    elif kind == "ssd":
        _check_ssd(dtype, "cuda", GPU_LENS, GPU_FIRST, GPU_SLOTS, heads=64, head_dim=64, state=128, groups=1,
                   atol=atol, block_q=64)
        _check_ssd(dtype, "cuda", GPU_LENS, GPU_FIRST, GPU_SLOTS, heads=32, head_dim=64, state=64, groups=8,
                   atol=atol, block_q=64)
    else:
        from plait.kernels.mamba_norm import gated_rms_norm

        shapes = ((300, 4096), (300, 4096), 4096)
        y, z, w = (torch.randn(shape, device="cuda", dtype=dtype) for shape in shapes)
        got = gated_rms_norm(y, z, w, 4096, 1e-5)
        torch.testing.assert_close(got, gated_rms_norm_ref(y, z, w, 4096, 1e-5), atol=atol, rtol=atol)
