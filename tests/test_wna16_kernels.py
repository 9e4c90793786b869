"""plait.kernels.wna16_gemm (W4A16 / W8A16 GEMV and GEMM) against plait.layers.wna16's reference: small shapes
through Triton's CPU interpreter, Llama-8B's shapes and CUDA-graph replay on a GPU."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from plait.kernels.wna16_gemm import (  # noqa: E402
    DEQUANT_MIN_M,
    GEMV_PROGRAMS_PER_SM,
    TILED_PROGRAMS_PER_SM,
    FmaConfig,
    WNA16Config,
    default_config,
    dequantize_kn,
    fma_config,
    wna16_linear,
)
from plait.layers.wna16 import (  # noqa: E402
    WORD_BITS,
    WNA16Linear,
    WNA16Spec,
    dequantize,
    pack_rows,
    wna16_linear_ref,
)

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
# Relative error of one rounding to the output dtype, at most: an ulp (the interpreter's fp32 -> bf16
# conversion, in the split-K reduction, truncates; compiled kernels round to nearest, half of it).
OUTPUT_ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def gpu(test):
    """Marks a test as needing CUDA; it skips where there is none."""
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")(test))


def _layer(k: int, n: int, bits: int, group_rows: int, seed: int, scale_dtype: torch.dtype = torch.float16,
           device: str = DEVICE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random codes, scales and zeros in plait's layout (group_rows 0: one group spanning K). Every bit
    pattern occurs (words with their top bit set are negative int32s); zero points anywhere in the code
    range; each group's scales 1x-8x apart from the others', so that a kernel reading the wrong group, or
    ignoring the zero points, is far off."""
    g = torch.Generator().manual_seed(seed)
    top = (1 << bits) - 1
    groups = k // group_rows if group_rows else 1
    codes = pack_rows(torch.randint(0, top + 1, (k, n), generator=g, dtype=torch.int32), bits)
    # |code - zero| * scale stays within ~2: outputs of a few units, well inside fp16.
    scales = (torch.rand(groups, n, generator=g) * 7 + 1) * (2.0 / (8 * top))
    zeros = torch.randint(0, top + 1, (groups, n), generator=g)
    zero_dtype = torch.uint8 if bits == 4 else torch.int16
    scales = scales.to(device=device, dtype=scale_dtype)
    return codes.to(device), scales, zeros.to(device=device, dtype=zero_dtype)


def _uneven_layer(k: int, n: int, bits: int, groups: int, seed: int, scale_dtype: torch.dtype = torch.float16,
                  device: str = DEVICE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """_layer's codes with ``groups`` groups of scales and zeros that the word rows fall in at random (act-
    order's uneven groups, padded to whole words, as a row-parallel rank holds them): codes, scales, zeros
    and word_groups [K // pack] int32."""
    pack = WORD_BITS // bits
    codes, _, _ = _layer(k, n, bits, 0, seed, scale_dtype, device)
    _, scales, zeros = _layer(groups * pack, n, bits, pack, seed + 1, scale_dtype, device)
    g = torch.Generator().manual_seed(seed + 2)
    word_groups = torch.randint(0, groups, (k // pack,), generator=g, dtype=torch.int32)
    return codes, scales, zeros, word_groups.to(device)


def _inputs(m: int, k: int, n: int, dtype: torch.dtype, bias: bool, seed: int, device: str = DEVICE
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
    b = (torch.randn(n, generator=g) * 4).to(device=device, dtype=dtype) if bias else None
    return x, b


def _assert_matches(out: torch.Tensor, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                    zeros: torch.Tensor, bits: int, bias: torch.Tensor | None,
                    config: WNA16Config | FmaConfig | None = None, word_groups: torch.Tensor | None = None
                    ) -> None:
    """out against the reference (loosely, as torch's own matmul computes it), and against the exact product
    of the same weights (tightly: one rounding to the output dtype plus fp32 summation error), rounded to x's
    dtype, or in fp32 where the call (``config``: its override) took the one-row FMA kernel."""
    k, n = x.shape[-1], codes.shape[1]
    exact_weights = fma_config(x.numel() // k, n, k, scales.shape[0], bits, config,
                               word_groups is not None) is not None
    ref = wna16_linear_ref(x, codes, scales, zeros, bits, bias, exact_weights=exact_weights,
                           word_groups=word_groups)
    assert out.shape == ref.shape and out.dtype == ref.dtype == x.dtype
    atol = 2e-2 * ref.float().abs().max().item()
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=atol)
    x2 = x.reshape(-1, x.shape[-1]).double()
    w = dequantize(codes, scales, zeros, bits, torch.float32 if exact_weights else x.dtype,
                   word_groups).double()  # [N, K]
    b = bias.double() if bias is not None else torch.zeros((), dtype=torch.float64, device=x.device)
    exact = x2 @ w.T + b
    mag = x2.abs() @ w.abs().T + b.abs()
    bound = OUTPUT_ULP[x.dtype] * exact.abs() + (x.shape[-1] + 4) * 2.0**-23 * mag
    err = (out.reshape(exact.shape).double() - exact).abs()
    assert (err <= bound).all(), f"max error {err.max().item():.3g}, over its bound at {(err > bound).sum()}"


# ---- the interpreter on CPU (compiled on a GPU) ----------------------------------------------------------

# block_m 16: the GEMV shape; 32: a tiled one (several M tiles, grouped order). block_k against the groups:
# 64 lies in one 64-row group, spans four 16-row ones.
STEP_CONFIGS = {
    # The one-row FMA kernel: steps within a 64-row group, and steps spanning 16-row groups (ROW_GROUPS).
    "fma": FmaConfig(block_n=32, block_w=8, split_k=1),
    "fma_split2": FmaConfig(block_n=64, block_w=4, split_k=2),
    "gemv": WNA16Config(block_m=16, block_n=32, block_k=64, split_k=1, group_m=1),
    "gemv_split3": WNA16Config(block_m=16, block_n=64, block_k=16, split_k=3, group_m=1),
    "tiled": WNA16Config(block_m=32, block_n=32, block_k=32, split_k=1, group_m=2),
    "tiled_split2": WNA16Config(block_m=32, block_n=64, block_k=64, split_k=2, group_m=2),
}


BITS_AND_GROUPS = [(4, 16), (8, 64), (4, 0)]
DTYPES_AND_SCALES = [(torch.bfloat16, torch.float16), (torch.float16, torch.float16),
                     (torch.float16, torch.bfloat16), (torch.bfloat16, torch.float32)]
# Every config with every dtype pair, the codes' bits and groups turning with both: each pair of the three
# parameters meets (24 cases; the whole product, 72, took a minute of the suite in Triton's interpreter).
WEIGHT_CASES = [(config, *BITS_AND_GROUPS[(i + j) % len(BITS_AND_GROUPS)], *dtypes)
                for i, config in enumerate(sorted(STEP_CONFIGS))
                for j, dtypes in enumerate(DTYPES_AND_SCALES)]


@pytest.mark.parametrize("config,bits,group_rows,dtype,scale_dtype", WEIGHT_CASES)
def test_kernel_weights_are_the_references_bit_for_bit(config, bits, group_rows, dtype, scale_dtype):
    """x = the identity: each output row is one input row of the weight the kernel dequantised (one exact
    product, sums of zeros), so it must equal plait.layers.wna16.dequantize's bit for bit: every code's
    position in its word, its group's scale and zero, and the fp32 arithmetic rounded once (the fp16 path
    where x and the scales are fp16)."""
    k, n = 128, 48  # n: a partial last block of 32 columns
    codes, scales, zeros = _layer(k, n, bits, group_rows, seed=bits + group_rows, scale_dtype=scale_dtype)
    x = torch.eye(k, device=DEVICE, dtype=dtype)
    cfg = STEP_CONFIGS[config]
    if isinstance(cfg, FmaConfig):  # one row a call: rows at every place in a word (9i % 8 = i), and the last
        if dtype == torch.bfloat16 and cfg.split_k > 1 and not HAS_CUDA:
            pytest.skip("the interpreter's split-K reduction truncates to bf16 (compiled kernels round)")
        if k % (cfg.block_w * WORD_BITS // bits):
            pytest.skip("K is not whole steps of this config")
        rows = [9 * i for i in range(8)] + [k - 1]
        out = torch.cat([wna16_linear(x[i:i + 1], codes, scales, zeros, bits, config=cfg) for i in rows])
        weights = dequantize(codes, scales, zeros, bits, torch.float32).t()[list(rows)].to(dtype)
        assert torch.equal(out, weights)  # exact fp32 weights (q - z) * s, rounded once at the output
        return
    out = wna16_linear(x, codes, scales, zeros, bits, config=cfg)
    assert torch.equal(out, dequantize(codes, scales, zeros, bits, dtype).t())


@pytest.mark.parametrize("m", [1, 3, 16, 17, 40])  # the GEMV shape up to 16 rows, 64-row tiles beyond
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k,n,group_rows", [(128, 80, 32), (256, 48, 0), (64, 96, 16)])
def test_wna16_linear_matches_the_reference(m, bits, dtype, k, n, group_rows):
    """The default configs (N not a multiple of the column block, groups narrower than a K step and one
    group spanning K), with a bias on every other row count."""
    codes, scales, zeros = _layer(k, n, bits, group_rows, seed=m + k)
    x, bias = _inputs(m, k, n, dtype, bias=m % 2 == 1, seed=m)
    _assert_matches(wna16_linear(x, codes, scales, zeros, bits, bias), x, codes, scales, zeros, bits, bias)


@pytest.mark.parametrize("bits,group_rows", [(4, 16), (8, 64), (4, 0)])
@pytest.mark.parametrize("dtype,scale_dtype", [
    (torch.bfloat16, torch.float16), (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16)])
def test_prompt_sized_steps_take_the_references_weights(bits, group_rows, dtype, scale_dtype):
    """From DEQUANT_MIN_M rows: dequantize_kn's [K, N] weights are dequantize's bit for bit (N and K not
    multiples of its blocks), and the matmul on them is the reference's function."""
    k, n = 96, 200
    codes, scales, zeros = _layer(k, n, bits, group_rows, seed=bits, scale_dtype=scale_dtype)
    assert torch.equal(dequantize_kn(codes, scales, zeros, bits, dtype),
                       dequantize(codes, scales, zeros, bits, dtype).t())
    x, bias = _inputs(256, k, n, dtype, bias=True, seed=bits)
    _assert_matches(wna16_linear(x, codes, scales, zeros, bits, bias), x, codes, scales, zeros, bits, bias)


@pytest.mark.parametrize("config", sorted(STEP_CONFIGS))
def test_split_k_and_ragged_k_match_the_reference_deterministically(config):
    """Explicit configs: K split over programs (3 splits of a K whose steps do not divide evenly), K not a
    multiple of the step (one 40-row group), bias added once whatever the split; the same bits each run."""
    for bits, k, group_rows in ((4, 40, 0), (8, 96, 32)):
        codes, scales, zeros = _layer(k, 40, bits, group_rows, seed=k)
        x, bias = _inputs(5, k, 40, torch.bfloat16, bias=True, seed=k)
        cfg = STEP_CONFIGS[config]
        if isinstance(cfg, FmaConfig):
            if k % (cfg.block_w * WORD_BITS // bits):
                continue  # K is not whole steps of this config
            x = x[:1]
        out = wna16_linear(x, codes, scales, zeros, bits, bias, config=cfg)
        _assert_matches(out, x, codes, scales, zeros, bits, bias, cfg)
        assert torch.equal(out, wna16_linear(x, codes, scales, zeros, bits, bias, config=cfg))


# Uneven groups: K is a padded one (whole words, not whole blocks: 13 words of 4-bit codes, 27 of 8-bit).
UNEVEN_K = {4: 104, 8: 108}
UNEVEN_GROUPS = 5


@pytest.mark.parametrize("config", sorted(STEP_CONFIGS))
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])  # fp32 and fp16 dequantisation
def test_word_groups_weights_are_the_references_bit_for_bit(config, bits, dtype):
    """word_groups (act-order's uneven groups): x = the identity, as above, so each output row is one input
    row of the kernel's weight, which must be dequantize's with the same word_groups bit for bit: each word
    row's scale and zero read from its own group, K past the last whole step masked (the FMA kernel too)."""
    k, n = UNEVEN_K[bits], 48
    codes, scales, zeros, word_groups = _uneven_layer(k, n, bits, UNEVEN_GROUPS, seed=bits)
    x = torch.eye(k, device=DEVICE, dtype=dtype)
    cfg = STEP_CONFIGS[config]
    want = dequantize(codes, scales, zeros, bits, dtype, word_groups).t()  # [K, N]
    if isinstance(cfg, FmaConfig):
        if dtype == torch.bfloat16 and cfg.split_k > 1 and not HAS_CUDA:
            pytest.skip("the interpreter's split-K reduction truncates to bf16 (compiled kernels round)")
        rows = [9 * i for i in range(8)] + [k - 1]
        out = torch.cat([wna16_linear(x[i:i + 1], codes, scales, zeros, bits, config=cfg,
                                      word_groups=word_groups) for i in rows])
        exact = dequantize(codes, scales, zeros, bits, torch.float32, word_groups).t()[rows].to(dtype)
        assert torch.equal(out, exact)
        return
    assert torch.equal(wna16_linear(x, codes, scales, zeros, bits, config=cfg, word_groups=word_groups), want)


@pytest.mark.parametrize("m", [1, 5, 300])  # the FMA GEMV, the dot GEMV, dequantize_kn then a matmul
@pytest.mark.parametrize("bits", [4, 8])
def test_word_groups_match_the_reference(m, bits):
    """The default configs with word_groups, bias on: the reference's function of the same weights, and
    dequantize_kn's weights dequantize's bit for bit."""
    k, n = UNEVEN_K[bits], 80
    codes, scales, zeros, word_groups = _uneven_layer(k, n, bits, UNEVEN_GROUPS, seed=m + bits)
    x, bias = _inputs(m, k, n, torch.bfloat16, bias=True, seed=m)
    out = wna16_linear(x, codes, scales, zeros, bits, bias, word_groups=word_groups)
    _assert_matches(out, x, codes, scales, zeros, bits, bias, word_groups=word_groups)
    if m >= DEQUANT_MIN_M:
        assert torch.equal(dequantize_kn(codes, scales, zeros, bits, torch.bfloat16, word_groups),
                           dequantize(codes, scales, zeros, bits, torch.bfloat16, word_groups).t())


def test_batch_dims_strided_rows_and_empty_inputs():
    k, n, bits = 64, 32, 4
    codes, scales, zeros = _layer(k, n, bits, 32, seed=7)
    x, bias = _inputs(6, k, n, torch.bfloat16, bias=True, seed=7)
    flat = wna16_linear(x, codes, scales, zeros, bits, bias)
    got = wna16_linear(x.view(2, 3, k), codes, scales, zeros, bits, bias)
    assert got.shape == (2, 3, n) and torch.equal(got.view(6, n), flat)
    # Rows of a wider tensor (a fused projection's slice): read in place, the same result.
    wide = torch.cat([x, torch.full_like(x, float("nan"))], dim=1)[:, :k]
    assert wide.stride(0) == 2 * k and torch.equal(wna16_linear(wide, codes, scales, zeros, bits, bias), flat)
    # A non-unit stride along K: copied first.
    columns = torch.stack([x, x], dim=2)[:, :, 0]
    assert columns.stride(1) == 2
    assert torch.equal(wna16_linear(columns, codes, scales, zeros, bits, bias), flat)
    empty = wna16_linear(x[:0].view(2, 0, k), codes, scales, zeros, bits, bias)
    assert empty.shape == (2, 0, n) and empty.dtype == torch.bfloat16


def test_arguments_that_do_not_fit_are_refused():
    codes, scales, zeros = _layer(64, 32, 4, 32, seed=3)
    x = torch.randn(2, 64, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bits"):
        wna16_linear(x, codes, scales, zeros, 3)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        wna16_linear(x.float(), codes, scales, zeros, 4)
    with pytest.raises(ValueError, match="do not pack"):
        wna16_linear(x[:, :32], codes, scales, zeros, 4)
    with pytest.raises(ValueError, match="groups"):
        wna16_linear(x, codes, scales[:, :16], zeros, 4)
    with pytest.raises(ValueError, match="split words"):  # 4-row groups of 8-code words
        wna16_linear(x, codes, scales.repeat(8, 1), zeros.repeat(8, 1), 4)
    with pytest.raises(ValueError, match="bias"):
        wna16_linear(x, codes, scales, zeros, 4, bias=torch.zeros(16, device=DEVICE, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="word_groups"):  # one a word row: 8 of 64 4-bit inputs
        wna16_linear(x, codes, scales, zeros, 4, word_groups=torch.zeros(4, device=DEVICE, dtype=torch.int32))


@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (16, 6144, 4096), (1, 28672, 4096), (4, 4096, 14336),
                                   (64, 4096, 4096), (1024, 4096, 4096), (1, 64, 64)])
def test_default_configs_fill_the_gpu_without_crowding_it(m, n, k):
    num_sms = 132
    cfg = default_config(m, n, k, num_sms)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    per_sm = GEMV_PROGRAMS_PER_SM if m <= 16 else TILED_PROGRAMS_PER_SM
    assert cfg.block_k <= max(16, triton.next_power_of_2(k)) and cfg.split_k >= 1
    assert cfg.split_k == 1 or tiles * cfg.split_k <= per_sm * num_sms
    # A split never leaves a wave's worth of SMs idle that doubling it would have filled (K allowing).
    assert tiles * cfg.split_k * 2 > per_sm * num_sms or k // (2 * cfg.split_k) < 4 * cfg.block_k


def test_the_layer_runs_the_kernel_where_triton_runs(monkeypatch):
    """WNA16Linear.forward on the kernel path (the interpreter taking CPU tensors; CUDA as it is): act-order's
    gather of x's columns, then wna16_linear on the layer's codes, scales, zeros and bias."""
    from plait.kernels import dispatch, wna16_gemm

    calls = []
    kernel = wna16_gemm.wna16_linear
    monkeypatch.setattr(wna16_gemm, "wna16_linear",
                        lambda *args, **kwargs: calls.append(args) or kernel(*args, **kwargs))
    spec = WNA16Spec("gptq", 4, 32, sym=False)
    layer = WNA16Linear(64, 48, bias=True, spec=spec, compute_dtype=torch.bfloat16, device=DEVICE)
    g = torch.Generator().manual_seed(11)
    layer.load_weight_rows(0, torch.randn(48, 64, generator=g).to(DEVICE))
    layer.bias.copy_(torch.randn(48, generator=g))
    layer.perm = torch.randperm(64, generator=g).to(DEVICE)
    x = torch.randn(3, 64, generator=g).to(device=DEVICE, dtype=torch.bfloat16)
    if not HAS_CUDA:
        dispatch.set_cpu_interpreter(True)
    try:
        with torch.no_grad():
            got = layer(x)
    finally:
        dispatch.set_cpu_interpreter(False)
    assert len(calls) == 1
    _assert_matches(got, x.index_select(-1, layer.perm), layer.codes, layer.scales, layer.zeros, 4,
                    layer.bias)


# ---- GPU: Llama-8B's shapes, CUDA graphs -----------------------------------------------------------------

LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate/up, down: (N, K)


@gpu
@pytest.mark.parametrize("m", [1, 4, 16, 64, 256, 1024])
@pytest.mark.parametrize("n,k", LLAMA_8B)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_real_shapes_match_the_reference(m, n, k, dtype):
    """4-bit codes in groups of 128 with the default configs (the GEMV with K split to fill the GPU, the
    tiled GEMM); fp16 takes the fp16 dequantisation (fp16 scales), bf16 the fp32 one."""
    codes, scales, zeros = _layer(k, n, 4, 128, seed=n + m, device="cuda")
    x, bias = _inputs(m, k, n, dtype, bias=m == 4, seed=m, device="cuda")
    _assert_matches(wna16_linear(x, codes, scales, zeros, 4, bias), x, codes, scales, zeros, 4, bias)


@gpu
@pytest.mark.parametrize("bits,group_rows", [(8, 128), (4, 0), (4, 32)])
@pytest.mark.parametrize("m", [1, 300])
def test_other_widths_and_groups_on_real_shapes(bits, group_rows, m):
    n, k = 4096, 4096
    codes, scales, zeros = _layer(k, n, bits, group_rows, seed=bits + group_rows, scale_dtype=torch.bfloat16,
                                  device="cuda")
    x, bias = _inputs(m, k, n, torch.bfloat16, bias=True, seed=m, device="cuda")
    _assert_matches(wna16_linear(x, codes, scales, zeros, bits, bias), x, codes, scales, zeros, bits, bias)


@gpu
@pytest.mark.parametrize("m", [1, 4, 16, 100, 300])
@pytest.mark.parametrize("bits", [4, 8])
def test_word_groups_on_real_shapes(m, bits):
    """A row-parallel rank's act-order down_proj of Llama-8B split in two: 7,168 inputs whose rows fall in
    all 112 groups of 128, padded to whole words (K a multiple of no block), word rows' groups in sorted
    order as WNA16Linear._pad_groups lays them out; every path (FMA GEMV, dot GEMV, tiled GEMM,
    dequantize_kn) against the reference."""
    groups, n, pack = 112, 4096, WORD_BITS // bits
    g = torch.Generator().manual_seed(m + bits)
    # Each group's rows on this rank: about half its 128, so padding adds up to pack - 1 a group.
    counts = torch.randint(40, 89, (groups,), generator=g)
    words = (counts + pack - 1) // pack  # [G] word rows a group
    word_groups = torch.repeat_interleave(torch.arange(groups), words).to(device="cuda", dtype=torch.int32)
    k = int(words.sum()) * pack
    codes, scales, zeros, _ = _uneven_layer(k, n, bits, groups, seed=m, scale_dtype=torch.float16,
                                            device="cuda")
    for dtype in (torch.bfloat16, torch.float16):
        x, bias = _inputs(m, k, n, dtype, bias=m == 4, seed=m, device="cuda")
        out = wna16_linear(x, codes, scales, zeros, bits, bias, word_groups=word_groups)
        _assert_matches(out, x, codes, scales, zeros, bits, bias, word_groups=word_groups)


@gpu
@pytest.mark.parametrize("m", [1, 16, 100])
def test_cuda_graph_replays_the_kernel(m):
    """Captured once (the split-K GEMV and its reduction at 1 and 16 rows, the tiled GEMM at 100), replayed
    on new inputs written in place: the eager results, bit for bit."""
    n, k = 4096, 4096
    codes, scales, zeros = _layer(k, n, 4, 128, seed=m, device="cuda")
    x, bias = _inputs(m, k, n, torch.bfloat16, bias=True, seed=m, device="cuda")
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        wna16_linear(static_x, codes, scales, zeros, 4, bias)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = wna16_linear(static_x, codes, scales, zeros, 4, bias)
    for seed in (1, 2):
        fresh, _ = _inputs(m, k, n, torch.bfloat16, bias=False, seed=100 * seed, device="cuda")
        static_x.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, wna16_linear(fresh, codes, scales, zeros, 4, bias))
    _assert_matches(static_out, fresh, codes, scales, zeros, 4, bias)
