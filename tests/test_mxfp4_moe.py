"""MXFP4 experts (W4A16: packed E2M1 codes and E8M0 scales decoded in fused_moe's K loops) against the 16-bit
kernels on the dequantised weights, fused_moe_ref, and FusedMoE's MXFP4 mode."""

# Unmarked tests use tiny shapes (E=4, k=2, H and I of 64 or 96: multiples of MXFP4's 32-value groups) through
# the Triton interpreter on CPU, compiled on a GPU when there is one. `gpu` tests use gpt-oss-20b's and
# gpt-oss-120b's expert shapes in bf16.

from __future__ import annotations

import math

import pytest
import torch
from conftest import capture_cuda_graph
from test_fused_moe import assert_ranks_sum_to_the_whole, poisoned_empty, randn, routing  # noqa: F401

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from plait.kernels import dispatch  # noqa: E402
from plait.kernels import fused_moe as fm  # noqa: E402
from plait.kernels.fused_moe import (  # noqa: E402
    MoeConfig,
    dequantize_mxfp4_experts,
    fused_moe,
    fused_moe_ref,
)
from plait.layers.linear import deferred_weights  # noqa: E402
from plait.layers.moe import FusedMoE, route  # noqa: E402
from plait.layers.mxfp4 import (  # noqa: E402
    BLOCK_VALUES,
    CODES_PER_BYTE,
    E8M0_BIAS,
    FP4_VALUES,
    dequantize_mxfp4,
)

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
BF16 = torch.bfloat16
E, K = 4, 2  # experts, slots a token
gpu = pytest.mark.skipif(not ON_GPU, reason="needs CUDA")

# The root mean square of FP4's values over uniform codes: random code bytes times a scale 2^e have a std
# of about FP4_RMS * 2^e.
FP4_RMS = math.sqrt(sum(v * v for v in FP4_VALUES) / len(FP4_VALUES))
# swiglu_oai's clamps bind (assert_clamps_bind checks it) with inputs this many times the O(1) scale.
OAI_X_SCALE = 4.0
# fp32 against fused_moe_ref: the kernel and the reference sum the same products in other orders (see
# tests/test_fused_moe.py's FP32_REL_TOL), ~1e-7 relative to max|out|.
FP32_REL_TOL = 1e-5
# bf16 against fused_moe_ref, in units of eps x max|out|: tests/test_fused_moe.py's bound for gpt-oss's
# experts (3 units of order and slot-sum rounding; on the interpreter another 3 for its truncating casts and
# 5 for their effect through swiglu_oai's six roundings).
BF16_REF_ULPS = 3 if ON_GPU else 11


def generator(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def random_mxfp4(num_experts: int, rows: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [E, rows, K / 2], E8M0 scales uint8 [E, rows, K / 32]): uniform code bytes (every E2M1
    code, -0 and the subnormal 0.5 too) and scales 2^e, e drawn from two neighbours for a weight std of
    about K^-0.5 (so that every activation is O(1))."""
    g = generator(seed)
    codes = torch.randint(0, 1 << 8, (num_experts, rows, k // CODES_PER_BYTE), dtype=torch.uint8, generator=g,
                          device=DEVICE)
    top = E8M0_BIAS + round(math.log2(k**-0.5 / FP4_RMS))
    scales = torch.randint(top - 1, top + 1, (num_experts, rows, k // BLOCK_VALUES), dtype=torch.uint8,
                           generator=g, device=DEVICE)
    return codes, scales


def mxfp4_experts(num_experts: int, hidden: int, inter: int, seed: int) -> dict[str, torch.Tensor]:
    w13, w13_scale = random_mxfp4(num_experts, 2 * inter, hidden, seed)
    w2, w2_scale = random_mxfp4(num_experts, hidden, inter, seed + 1)
    return dict(w13=w13, w13_scale=w13_scale, w2=w2, w2_scale=w2_scale)


def dequantized(w: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The same experts as 16-bit (or fp32) weights: w13 [E, 2I, H], w2 [E, H, I]."""
    return dict(w13=dequantize_mxfp4_experts(w["w13"], w["w13_scale"], dtype),
                w2=dequantize_mxfp4_experts(w["w2"], w["w2_scale"], dtype))


def mlp_kw(case: str, num_experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int) -> dict:
    """fused_moe's epilogue keywords: "silu" (Mixtral-like) or "gpt_oss" (swiglu_oai and both biases)."""
    if case == "silu":
        return dict(activation=fm.SILU)
    g = generator(seed)
    return dict(activation=fm.SWIGLU_OAI,
                w13_bias=torch.randn(num_experts, 2 * inter, generator=g, device=DEVICE).to(dtype),
                w2_bias=torch.randn(num_experts, hidden, generator=g, device=DEVICE).to(dtype))


def assert_clamps_bind(x: torch.Tensor, w13: torch.Tensor, kw: dict, ids: torch.Tensor) -> None:
    """Some entries' gate and up values pass swiglu_oai's limit (so the clamps are exercised)."""
    inter = w13.shape[1] // 2
    gate_up = torch.einsum("th,tkih->tki", x.float(), w13.float()[ids]) + kw["w13_bias"].float()[ids]
    gate, up = gate_up.split(inter, dim=-1)
    limit = fm.GPT_OSS_SWIGLU_LIMIT
    assert bool((gate > limit).any() & (up > limit).any() & (up < -limit).any())


# -- the decoding ------------------------------------------------------------------------------------------

# The interpreter's fp32 -> bf16 cast mishandles fp32's subnormals (triton 3.6 interpreter.py, _convert_float,
# clamps their renormalised exponent), which E8M0 bytes 0 and 1 give FP4's smallest values: off the GPU,
# bf16's decoding is checked from byte 2.
FIRST_BF16_SCALE = 0 if ON_GPU else 2

@triton.jit
def _decode_kernel(w_ptr, s_ptr, out_ptr, K, stride_wn, stride_sn, stride_on, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, K_MAJOR: tl.constexpr):
    # One [BLOCK_N, BLOCK_K] tile of MXFP4 weights decoded as the fused_moe kernels decode theirs.
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    k0 = tl.program_id(1) * BLOCK_K
    w_ptrs, s_ptrs = fm._mxfp4_ptrs(w_ptr + k0 // fm._MX_PACK, s_ptr + k0 // fm._MX_GROUP, rows, stride_wn,
                                    stride_sn, 1, BLOCK_K, K_MAJOR)
    scale = fm._load_groups(s_ptrs, K - k0, False, 0 if K_MAJOR else 1)
    w = fm._mxfp4_tile(w_ptrs, scale, K - k0, False, out_ptr.dtype.element_ty, K_MAJOR)
    cols = k0 + tl.arange(0, BLOCK_K)
    if K_MAJOR:
        tl.store(out_ptr + rows[None, :] * stride_on + cols[:, None], w)
    else:
        tl.store(out_ptr + rows[:, None] * stride_on + cols[None, :], w)


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")  # the interpreter's numpy, at the overflow
@pytest.mark.parametrize("dtype", [torch.float32, BF16, torch.float16])
@pytest.mark.parametrize("k_major", [False, True])
def test_decoding_is_dequantize_mxfp4_for_every_byte_and_scale(dtype, k_major):
    """Every code byte under every E8M0 scale up to 254 (2^-127, subnormal in fp32, to 2^127, which overflows
    the largest codes as dequantize_mxfp4 does; 255 is NaN to OCP): the kernels' decoding is
    dequantize_mxfp4's, bit for bit (fp16 rounding and overflowing as torch's conversion does)."""
    rows, cols = 256, 512  # row r: scale byte r (255 -> 127), and all 256 bytes in a row-dependent order
    first = FIRST_BF16_SCALE if dtype == BF16 else 0
    scale_bytes = torch.arange(rows).clamp(first, 254).repeat_interleave(cols // BLOCK_VALUES).view(rows, -1)
    scale_bytes[-1] = E8M0_BIAS
    codes = (torch.arange(cols // 2)[None, :] * 7 + torch.arange(rows)[:, None]) % 256
    codes, scale_bytes = codes.to(torch.uint8).to(DEVICE), scale_bytes.to(torch.uint8).to(DEVICE)
    want = dequantize_mxfp4(codes.view(rows, -1, BLOCK_VALUES // 2), scale_bytes, dtype)
    got = torch.empty(rows, cols, dtype=dtype, device=DEVICE)
    block_n, block_k = 64, 128
    _decode_kernel[(rows // block_n, cols // block_k)](codes, scale_bytes, got, cols, codes.stride(0),
                                                       scale_bytes.stride(0), got.stride(0), BLOCK_N=block_n,
                                                       BLOCK_K=block_k, K_MAJOR=k_major)
    assert torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       want.view(torch.int16 if dtype != torch.float32 else torch.int32))
    assert bool(want.isinf().any()) and bool((want != 0).any())  # the overflow and the values both seen


# -- fused_moe on MXFP4 experts ----------------------------------------------------------------------------

def run_pair(x, w, weights, ids, kw, gemv, config=None):
    """fused_moe on the MXFP4 experts and on their dequantisation in x's dtype, with the same tiles."""
    got = fused_moe(x, w["w13"], w["w2"], weights, ids, config, gemv, w13_scale=w["w13_scale"],
                    w2_scale=w["w2_scale"], **kw)
    d = dequantized(w, x.dtype)
    return got, fused_moe(x, d["w13"], d["w2"], weights, ids, config, gemv, **kw)


# t tokens a path: a single token and a few on the GEMV path (a program an entry: slow in the interpreter),
# 17 on the grouped GEMM (two 16-row blocks for an expert that gets most of them, one ragged).
PATH_TOKENS = {"gemv": (1, 3), "grouped": (17,)}


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("path", sorted(PATH_TOKENS))
@pytest.mark.parametrize("mlp", ["silu", "gpt_oss"])
def test_mxfp4_kernel_is_the_16bit_kernel_on_the_dequantised_weights(dtype, path, mlp):
    """The same tiles and K order on weights decoded exactly: the same bits (the 16-bit kernel's own
    accuracy is tests/test_fused_moe.py's)."""
    hidden, inter = 64, 96
    w = mxfp4_experts(E, hidden, inter, seed=1)
    kw = mlp_kw(mlp, E, hidden, inter, dtype, seed=3)
    for t in PATH_TOKENS[path]:
        x = randn(t, hidden, dtype=dtype, seed=4 + t, scale=OAI_X_SCALE if mlp == "gpt_oss" else 1.0)
        weights, ids = routing(t, E, K, seed=5 + t)
        got, want = run_pair(x, w, weights, ids, kw, gemv=path == "gemv")
        assert torch.equal(got, want)


def padded_view(t: torch.Tensor, extra: int, fill: int) -> torch.Tensor:
    """t as a view into rows ``extra`` elements longer, those all ``fill``."""
    wide = torch.full((*t.shape[:-1], t.shape[-1] + extra), fill, dtype=t.dtype, device=t.device)
    wide[..., : t.shape[-1]] = t
    return wide[..., : t.shape[-1]]


E8M0_NAN = 0xFF  # OCP's NaN scale; the kernels make it inf (and 0 x inf = NaN)
FP4_SIX_SIX = 0x77  # a byte of two 6.0 codes


@pytest.mark.parametrize("path", ["gemv", "grouped"])
def test_mxfp4_k_tails_and_wide_steps(monkeypatch, path):
    """64-wide K steps (two 32-value groups) over H = I = 96: each GEMM's last step has one group in K and
    one past it (masked); bit for bit the 16-bit kernel with the same steps. The codes and scales are views
    into longer rows (the kernels take their strides) whose extra group holds NaN scales: a step that read
    past K would bring NaNs in. A 16-wide K step (half a group) is refused."""
    hidden = inter = 96
    w = mxfp4_experts(E, hidden, inter, seed=10)
    # One more group a row: its 16 code bytes, or its scale byte.
    w = {name: padded_view(t, 1, E8M0_NAN) if name.endswith("scale") else
         padded_view(t, BLOCK_VALUES // 2, FP4_SIX_SIX) for name, t in w.items()}
    assert w["w13"].stride(1) == hidden // 2 + BLOCK_VALUES // 2
    kw = mlp_kw("gpt_oss", E, hidden, inter, BF16, seed=12)
    x = randn(5, hidden, dtype=BF16, seed=13, scale=OAI_X_SCALE)
    weights, ids = routing(5, E, K, seed=14)
    if path == "gemv":  # its CPU K step (the same for both kernels)
        monkeypatch.setattr(fm, "CPU_BLOCK_K", 64)
        config = None
    else:
        config = MoeConfig(block_m=16, block_n=32, block_k=64, group_m=2, num_stages=1)
    got, want = run_pair(x, w, weights, ids, kw, gemv=path == "gemv", config=config)
    assert torch.equal(got, want)
    if path == "grouped":
        with pytest.raises(ValueError, match="block_k"):
            run_pair(x, w, weights, ids, kw, gemv=False, config=MoeConfig(block_m=16, block_n=32, block_k=16))


def ref_error_units(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| in units of eps(dtype) x max|want|."""
    unit = torch.finfo(want.dtype).eps * want.double().abs().max().item()
    return (got.double() - want.double()).abs().max().item() / unit


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("path", ["gemv", "grouped"])
def test_fused_moe_mxfp4_matches_ref(dtype, path):
    """gpt-oss's experts (swiglu_oai with its clamps binding, both biases) in MXFP4: fused_moe against
    fused_moe_ref of the same MXFP4 tensors."""
    hidden, inter, t = 64, 64, PATH_TOKENS[path][-1]
    w = mxfp4_experts(E, hidden, inter, seed=20)
    kw = mlp_kw("gpt_oss", E, hidden, inter, dtype, seed=22)
    x = randn(t, hidden, dtype=dtype, seed=23, scale=OAI_X_SCALE)
    weights, ids = routing(t, E, K, seed=24)
    d = dequantized(w, dtype)
    assert_clamps_bind(x, d["w13"], kw, ids)
    got = fused_moe(x, w["w13"], w["w2"], weights, ids, gemv=path == "gemv", w13_scale=w["w13_scale"],
                    w2_scale=w["w2_scale"], **kw)
    want = fused_moe_ref(x, w["w13"], w["w2"], weights, ids, w13_scale=w["w13_scale"],
                         w2_scale=w["w2_scale"], **kw)
    # The reference is the 16-bit one on the exact dequantisation.
    assert torch.equal(want, fused_moe_ref(x, d["w13"], d["w2"], weights, ids, **kw))
    allowed = FP32_REL_TOL / torch.finfo(torch.float32).eps if dtype == torch.float32 else BF16_REF_ULPS
    assert ref_error_units(got, want) <= allowed


@pytest.mark.parametrize("path", sorted(PATH_TOKENS))
def test_fused_moe_mxfp4_local_experts(poisoned_empty, path):  # noqa: F811 - the fixture imported above
    """Expert parallelism with gpt-oss's MXFP4 experts: their codes, E8M0 scales and biases split by expert,
    two ranks add up to the whole (test_fused_moe's assert_ranks_sum_to_the_whole), in fp32."""
    hidden, inter, t = 64, 64, PATH_TOKENS[path][-1]
    weights, ids = routing(t, E, K, seed=24)
    args = dict(x=randn(t, hidden, dtype=torch.float32, seed=23, scale=OAI_X_SCALE), topk_weights=weights,
                topk_ids=ids, **mxfp4_experts(E, hidden, inter, seed=20),
                **mlp_kw("gpt_oss", E, hidden, inter, torch.float32, seed=22))
    assert_ranks_sum_to_the_whole(args, gemv=path == "gemv")


@pytest.mark.parametrize("bad", ["hidden_48", "inter_48", "block", "no_w13_scale", "w2_scale_shape",
                                 "scale_fp32", "w2_bf16", "w13_bytes"])
def test_fused_moe_mxfp4_rejects_bad_arguments(bad):
    hidden, inter = (48 if bad == "hidden_48" else 64), (48 if bad == "inter_48" else 64)
    w = {}
    for name, rows, k in (("w13", 2 * inter, hidden), ("w2", hidden, inter)):
        # 48 inputs: consistent bytes (24 a row) but no whole 32-value groups (one scale a row, say)
        w[name] = torch.zeros(E, rows, k // 2, dtype=torch.uint8, device=DEVICE)
        w[f"{name}_scale"] = torch.zeros(E, rows, -(-k // BLOCK_VALUES), dtype=torch.uint8, device=DEVICE)
    x = randn(3, hidden, dtype=BF16, seed=31)
    weights, ids = routing(3, E, K, seed=32)
    args = dict(x=x, w13=w["w13"], w2=w["w2"], topk_weights=weights, topk_ids=ids, w13_scale=w["w13_scale"],
                w2_scale=w["w2_scale"])
    args.update({
        "block": dict(block=(32, 32)), "no_w13_scale": dict(w13_scale=None),
        "w2_scale_shape": dict(w2_scale=w["w2_scale"][:, :-1]),
        "scale_fp32": dict(w13_scale=w["w13_scale"].float()),
        "w2_bf16": dict(w2=torch.zeros(E, hidden, inter, dtype=BF16, device=DEVICE)),
        "w13_bytes": dict(w13=w["w13"][..., :-1]),
    }.get(bad, {}))
    for fn in (fused_moe, fused_moe_ref):
        with pytest.raises(ValueError):
            fn(**args)


# -- FusedMoE ----------------------------------------------------------------------------------------------

def gpt_oss_layer(hidden: int, inter: int, dtype: torch.dtype) -> FusedMoE:
    layer = FusedMoE(E, K, hidden, inter, renormalize=True, activation=fm.SWIGLU_OAI, bias=True)
    return layer.to(DEVICE, dtype)


def as_blocks(codes: torch.Tensor) -> torch.Tensor:
    """[E, rows, K / 2] codes as a checkpoint's _blocks, [E, rows, K / 32, 16]."""
    return codes.view(*codes.shape[:2], -1, BLOCK_VALUES // 2)


@pytest.mark.parametrize("kernels", [False, True])
def test_mxfp4_layer_is_the_16bit_layer_on_the_dequantised_weights(monkeypatch, kernels):
    """use_mxfp4, load_mxfp4 of both stacks, forward: the 16-bit FusedMoE holding the dequantised weights, to
    the bit, on the torch path (fused_moe_ref) and on the kernels' (the interpreter on CPU)."""
    monkeypatch.setattr(dispatch, "_enabled", kernels)  # off: the torch path, on a GPU too
    monkeypatch.setattr(dispatch, "_cpu_interpreter", False)  # restored after the test
    if kernels and not ON_GPU:
        dispatch.set_cpu_interpreter(True)
    hidden, inter, t = 64, 96, 7
    w = mxfp4_experts(E, hidden, inter, seed=40)
    d = dequantized(w, BF16)
    biases = mlp_kw("gpt_oss", E, hidden, inter, BF16, seed=42)
    layer, dense = gpt_oss_layer(hidden, inter, BF16), gpt_oss_layer(hidden, inter, BF16)
    layer.use_mxfp4()
    assert layer.gate_up_proj.dtype == layer.gate_up_scale.dtype == torch.uint8
    assert layer.gate_up_proj.shape == (E, 2 * inter, hidden // 2)
    assert layer.down_scale.shape == (E, hidden, inter // BLOCK_VALUES)
    assert "gate_up_scale" in dict(layer.named_buffers()) and "mxfp4" in repr(layer)
    layer.load_mxfp4("gate_up_proj", as_blocks(w["w13"]), w["w13_scale"])
    layer.load_mxfp4("down_proj", as_blocks(w["w2"]), w["w2_scale"])
    layer.check_loaded()
    with torch.no_grad():
        for module in (layer, dense):
            module.gate_up_bias.copy_(biases["w13_bias"])
            module.down_bias.copy_(biases["w2_bias"])
        dense.gate_up_proj.copy_(d["w13"])
        dense.down_proj.copy_(d["w2"])
        x = randn(t, hidden, dtype=BF16, seed=43, scale=OAI_X_SCALE)
        logits = torch.randn(t, E, generator=generator(44), device=DEVICE)
        got, want = layer(x, logits), dense(x, logits)
    assert torch.equal(got, want)
    weights, ids = route(logits, K, renormalize=True)
    assert_clamps_bind(x, d["w13"], biases, ids)


def test_mxfp4_layer_refuses_what_it_cannot_hold():
    from plait.layers.moe import DEFAULT_FP8_BLOCK

    with pytest.raises(ValueError, match="multiples of 32"):
        FusedMoE(E, K, 48, 64, renormalize=True).use_mxfp4()
    with pytest.raises(ValueError, match="multiples of 32"):
        FusedMoE(E, K, 64, 48, renormalize=True).use_mxfp4()
    fp8 = FusedMoE(E, K, 128, 128, renormalize=True)
    fp8.quantize_fp8(DEFAULT_FP8_BLOCK)
    with pytest.raises(ValueError, match="already"):
        fp8.use_mxfp4()
    mx = FusedMoE(E, K, 64, 64, renormalize=True)
    with pytest.raises(ValueError, match="use_mxfp4 first"):
        mx.load_mxfp4("down_proj", *random_mxfp4(E, 64, 64, seed=50))
    mx.use_mxfp4()
    with pytest.raises(ValueError, match="already"):
        mx.quantize_fp8(DEFAULT_FP8_BLOCK)
    with pytest.raises(ValueError, match="already"):
        mx.use_mxfp4()
    codes, scales = random_mxfp4(E, 64, 64, seed=51)
    for bad in ((codes, scales), (as_blocks(codes)[:, :-1], scales), (as_blocks(codes), scales.float())):
        with pytest.raises(ValueError):
            mx.load_mxfp4("down_proj", *bad)
    with pytest.raises(ValueError):
        mx.load_mxfp4("up_proj", as_blocks(codes), scales)
    with pytest.raises(ValueError, match="load_mxfp4"):
        mx.load_expert(0, "down_proj", torch.zeros(64, 64))
    mx.load_mxfp4("down_proj", as_blocks(codes.cpu()), scales.cpu())  # from the host: copied in
    with pytest.raises(ValueError, match="gate_up_proj"):
        mx.check_loaded()
    used = FusedMoE(E, K, 64, 64, renormalize=True)
    used.load_expert(0, "down_proj", torch.zeros(64, 64))
    with pytest.raises(ValueError, match="before"):
        used.use_mxfp4()


def test_mxfp4_layer_on_the_meta_device_and_random_weights():
    """use_mxfp4 on deferred (meta) weights puts the codes on the given device; fill_random_mxfp4 draws
    weights of std about 0.02 (the random 16-bit weights'), the same for the same generator, and counts as
    loaded."""
    hidden, inter = 64, 96
    with deferred_weights():
        layer = FusedMoE(E, K, hidden, inter, renormalize=True)
    assert layer.gate_up_proj.is_meta
    layer.use_mxfp4(torch.device(DEVICE))
    assert layer.gate_up_proj.device.type == layer.down_scale.device.type == torch.device(DEVICE).type
    layer.fill_random_mxfp4(generator(60))
    layer.check_loaded()
    weights = [dequantize_mxfp4_experts(getattr(layer, f"{name}_proj"), getattr(layer, f"{name}_scale"),
                                        torch.float32) for name in ("gate_up", "down")]
    for w in weights:
        assert 0.015 < w.std().item() < 0.025 and abs(w.mean().item()) < 1e-3
    again = FusedMoE(E, K, hidden, inter, renormalize=True).to(DEVICE)
    again.use_mxfp4()
    again.fill_random_mxfp4(generator(60))
    assert torch.equal(again.gate_up_proj, layer.gate_up_proj) and torch.equal(again.down_scale,
                                                                               layer.down_scale)


# -- real shapes (GPU) -------------------------------------------------------------------------------------

GPT_OSS = {
    "gpt-oss-20b": dict(experts=32, top_k=4, hidden=2880, inter=2880),
    "gpt-oss-120b": dict(experts=128, top_k=4, hidden=2880, inter=2880),
}
# Against the fp32 reference on the same values: tests/test_fused_moe.py's bound at gpt-oss-20b's shapes
# (the kernel's bf16 roundings, measured 5.1-7.5e-3 of max|out|).
FP32_REF_REL_TOL = 2e-2
# The GEMV on MXFP4 against the GEMV on the dequantised weights, in units of eps x max|out|: the same
# products, summed in another fp32 order (see test_gpu_mxfp4_real_shapes), which may flip the bf16 rounding
# of a gate or up value, of a slot's output or of the sum: an ulp of an output element, or of a slot output
# as large, each. A wrong code, scale or group is off by the outputs' own size (~100 units).
GEMV_REORDER_ULPS = 3


@pytest.fixture(scope="module")
def gpt_oss_mxfp4():
    """model -> its random MXFP4 experts, biases (bf16) and the experts dequantised to bf16: drawn once a
    module, one model at a time (gpt-oss-120b's bf16 experts are 6.4 GB)."""
    cache: dict[str, tuple] = {}

    def get(model: str) -> tuple:
        if model not in cache:
            cache.clear()
            c = GPT_OSS[model]
            w = mxfp4_experts(c["experts"], c["hidden"], c["inter"], seed=70)
            kw = mlp_kw("gpt_oss", c["experts"], c["hidden"], c["inter"], BF16, seed=72)
            cache[model] = (w, kw, dequantized(w, BF16))
        return cache[model]

    return get


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("model", sorted(GPT_OSS))
@pytest.mark.parametrize("t", [1, 4, 64, 512])  # 4, 16 entries: GEMV; 256, 2048: the grouped GEMM
def test_gpu_mxfp4_real_shapes(gpt_oss_mxfp4, model, t):
    c = GPT_OSS[model]
    w, kw, d = gpt_oss_mxfp4(model)
    mx = dict(w13_scale=w["w13_scale"], w2_scale=w["w2_scale"], **kw)
    x = randn(t, c["hidden"], dtype=BF16, seed=74, scale=OAI_X_SCALE)
    weights, ids = routing(t, c["experts"], c["top_k"], seed=75)
    got = fused_moe(x, w["w13"], w["w2"], weights, ids, **mx)
    assert torch.equal(got, fused_moe(x, w["w13"], w["w2"], weights, ids, **mx))  # deterministic
    # The grouped GEMM takes the 16-bit weights' tiles and MMA instructions (mma.sync for 16-row blocks,
    # wgmma for 64; checked in sm_90a PTX), yet on an H200 some rows differed from the 16-bit weights' in
    # their last bits (T = 4, 64 and 512; benchmarks/results/mxfp4_moe_*_h200.json: up to 7.8e-3 on outputs
    # of ~10): the order of the fp32 sums inside the MMAs is not the same. The GEMV takes
    # MXFP4_GEMV_BLOCK_K steps (GEMV_BLOCK_K for 16-bit weights) and reduces its fp32 lanes in another
    # register layout: only the order of its fp32 sums differs too.
    grouped = fused_moe(x, w["w13"], w["w2"], weights, ids, gemv=False, **mx)
    grouped_16bit = fused_moe(x, d["w13"], d["w2"], weights, ids, gemv=False, **kw)
    assert ref_error_units(grouped, grouped_16bit) <= GEMV_REORDER_ULPS
    if t * c["top_k"] <= fm.GEMV_MAX_ENTRIES:
        gemv_16bit = fused_moe(x, d["w13"], d["w2"], weights, ids, **kw)
        assert ref_error_units(got, gemv_16bit) <= GEMV_REORDER_ULPS
    assert ref_error_units(got, fused_moe_ref(x, w["w13"], w["w2"], weights, ids, **mx)) <= BF16_REF_ULPS
    want = fused_moe_ref(x.float(), d["w13"].float(), d["w2"].float(), weights, ids,
                         **{**kw, "w13_bias": kw["w13_bias"].float(), "w2_bias": kw["w2_bias"].float()})
    err = (got.float() - want).abs().max().item()
    assert err <= FP32_REF_REL_TOL * want.abs().max().item()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("t", [8, 37])  # 32 entries: the GEMV path; 148: the grouped GEMM
def test_gpu_mxfp4_replays_in_a_cuda_graph(gpt_oss_mxfp4, t):
    c = GPT_OSS["gpt-oss-20b"]
    w, kw, _ = gpt_oss_mxfp4("gpt-oss-20b")
    mx = dict(w13_scale=w["w13_scale"], w2_scale=w["w2_scale"], **kw)
    x = randn(t, c["hidden"], dtype=BF16, seed=76, scale=OAI_X_SCALE)
    weights, ids = routing(t, c["experts"], c["top_k"], seed=77)
    graph, graphed = capture_cuda_graph(lambda: fused_moe(x, w["w13"], w["w2"], weights, ids, **mx))
    # New inputs and a new routing (half the tokens sharing expert 5) written in place.
    x.copy_(randn(t, c["hidden"], dtype=BF16, seed=78, scale=OAI_X_SCALE))
    new_weights, new_ids = routing(t, c["experts"], c["top_k"], seed=79)
    new_ids[: t // 2, 0] = 5
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graphed, fused_moe(x, w["w13"], w["w2"], weights, ids, **mx))
