"""FP8 weight-only quantisation (plait.layers.fp8, `quantization="fp8"`): the rounding, the skinny GEMM on
8-bit weights against its torch reference, and the engine computing exactly the model whose weights are
the FP8 ones (tiny random models, fp32 on CPU; the `gpu` tests take real shapes in bf16)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts, run_greedy
from torch import nn

from plait.config import EngineConfig
from plait.engine.engine import LLMEngine
from plait.layers.fp8 import FP8_MAX, Fp8Linear, dequantize_rows, quantize_model, quantize_rows

ON_GPU = torch.cuda.is_available()
# float8_e4m3fn keeps 3 mantissa bits: a normal value rounds within 2^-4 of itself; below 2^-6 the
# spacing is 2^-9 (subnormals), so the error there is at most half of that, in units of the row's scale.
FP8_RELATIVE = 2.0**-4
FP8_SUBNORMAL_HALF_STEP = 2.0**-10


def test_quantize_rows_rounds_each_row_on_its_own_scale():
    g = torch.Generator().manual_seed(0)
    # Rows five orders of magnitude apart, and a row of zeros: per-row scales keep each row's precision.
    w = torch.randn(32, 200, generator=g) * torch.logspace(-3, 2, 32)[:, None]
    w[5] = 0.0
    codes, scale = quantize_rows(w)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == w.shape and scale.shape == (32,)
    live = torch.arange(32) != 5
    assert torch.equal(codes[live].float().abs().amax(dim=1), torch.full((31,), FP8_MAX))
    back = dequantize_rows(codes, scale, torch.float32)
    bound = FP8_RELATIVE * w.abs() + FP8_SUBNORMAL_HALF_STEP * scale[:, None]
    assert ((back - w).abs() <= bound * (1 + 1e-6)).all()
    assert torch.equal(back[5], torch.zeros(200)) and scale[5] > 0


def test_fp8_linear_computes_the_dequantized_weight():
    torch.manual_seed(1)
    linear = nn.Linear(48, 24, bias=True)
    fp8 = Fp8Linear.from_linear(linear)
    assert fp8.weight.dtype == torch.float8_e4m3fn and fp8.compute_dtype == torch.float32
    x = torch.randn(5, 48)
    want = torch.nn.functional.linear(x, dequantize_rows(fp8.weight, fp8.weight_scale, torch.float32),
                                      linear.bias)
    assert torch.equal(fp8(x), want)
    with pytest.raises(RuntimeError, match="before quantising"):
        fp8.fold_norm_weight(torch.ones(48))


def _dequantized_copy(engine: LLMEngine) -> None:
    """Replace every linear weight of engine's model but the lm_head with its FP8 rounding, in place."""
    with torch.no_grad():
        for name, module in engine.runner.model.named_modules():
            if isinstance(module, nn.Linear) and not name.endswith("lm_head"):
                module.weight.copy_(dequantize_rows(*quantize_rows(module.weight), module.weight.dtype))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fp8_engine_is_the_model_with_fp8_weights(tiny_models, family):
    """quantization="fp8" in fp32 on CPU computes F.linear on code * scale: the same arithmetic as an
    unquantised engine whose weights were replaced by their FP8 roundings, so tokens and logits agree
    exactly, with chunked prompts and decodes batched together."""
    kw = dict(model=str(tiny_models[family]), block_size=8, max_num_batched_tokens=24, max_model_len=96)
    quantized = LLMEngine(EngineConfig(quantization="fp8", **kw))
    layers = [m for m in quantized.runner.model.modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == 4 * 2  # qkv, o, gate/up, down in each of 2 layers; the lm_head stays
    assert not isinstance(quantized.runner.model.lm_head, Fp8Linear)
    reference = LLMEngine(EngineConfig(**kw))
    _dequantized_copy(reference)
    prompts = random_prompts(6, 3, 40, seed=11)
    got, got_logits = run_greedy(quantized, prompts, max_tokens=8, arrive_every=1, capture_logits=True)
    want, want_logits = run_greedy(reference, prompts, max_tokens=8, arrive_every=1, capture_logits=True)
    assert got == want
    for i in want_logits:
        assert all(torch.equal(a, b) for a, b in zip(got_logits[i], want_logits[i]))
    # ... and FP8 weights are a real change: the unrounded model's logits differ.
    plain, plain_logits = run_greedy(LLMEngine(EngineConfig(**kw)), prompts, max_tokens=8, arrive_every=1,
                                     capture_logits=True)
    assert any(not torch.equal(a, b) for i in plain_logits for a, b in zip(plain_logits[i], got_logits[i]))


def test_quantization_is_validated_and_reaches_the_cli():
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="LoRA adapters on a quantized model"):
        EngineConfig(quantization="fp8", enable_lora=True)
    with pytest.raises(ValueError, match="quantization must be one of"):
        quantize_model(nn.Sequential(nn.Linear(2, 2)), "awq")
    from plait.entrypoints.cli import _engine_config, build_parser

    args = build_parser().parse_args(["serve", "--quantization", "fp8"])
    assert _engine_config(args).quantization == "fp8"


# ---- the skinny GEMM on 8-bit weights (Triton interpreter on CPU, compiled on a GPU) -------------------

triton_configs = {
    "fma_split3": dict(block_n=8, block_k=32, split_k=3),
    "fma_prefetch2": dict(block_n=4, block_k=32, prefetch=2),
    "dot_split2": dict(block_n=16, block_k=32, split_k=2, use_dot=True),
}


@pytest.mark.parametrize("name", sorted(triton_configs))
@pytest.mark.parametrize("m", [1, 3])
def test_skinny_gemm_on_fp8_weights_matches_its_reference(name, m):
    pytest.importorskip("triton")
    from plait.kernels import skinny_gemm
    from plait.kernels.skinny_gemm import SkinnyConfig

    device = "cuda" if ON_GPU else "cpu"
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 100, generator=g).to(device=device, dtype=torch.float16)
    codes, scale = quantize_rows(torch.randn(21, 100, generator=g).to(device))
    bias = torch.randn(21, generator=g).to(device=device, dtype=torch.float16)
    cfg = SkinnyConfig(**triton_configs[name])
    got = skinny_gemm.skinny_linear(x, codes, bias, config=cfg, weight_scale=scale)
    # Exact in fp64, then the kernel's fp32 sum (K + 2 roundings of the products' magnitudes: the scale
    # multiplies the sum) and its final fp16 rounding (half an ulp).
    w = codes.double() * scale.double()[:, None]
    exact = x.double() @ w.T + bias.double()
    mag = x.double().abs() @ w.abs().T + bias.double().abs()
    ulp = torch.finfo(torch.float16).eps * exact.abs().clamp_min(2.0**-14)
    assert ((got.double() - exact).abs() <= 2 * 103 * 2.0**-24 * mag + ulp).all()
    if not cfg.use_dot and cfg.split_k == 1:  # the residual-add form of the same launch
        residual = torch.randn(m, 21, generator=g).to(device=device, dtype=torch.float16)
        h, parts = skinny_gemm.skinny_linear_add(x, codes, residual, config=cfg, weight_scale=scale)
        want, want_sq = skinny_gemm.skinny_linear_add_ref(x, codes, residual, weight_scale=scale)
        torch.testing.assert_close(h, want, rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(parts.sum(-1, keepdim=True), h.float().pow(2).sum(-1, keepdim=True),
                                   rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match="weight scale"):
        skinny_gemm.skinny_linear(x, codes, None, config=cfg, weight_scale=scale[:-1])


# ---- GPU: real shapes, bf16, CUDA graphs -----------------------------------------------------------------

gpu = pytest.mark.skipif(not ON_GPU, reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (28672, 4096)])
def test_skinny_fp8_real_shapes_match_the_dequantized_matmul(m, n, k):
    from plait.kernels import skinny_gemm

    g = torch.Generator(device="cuda").manual_seed(n + m)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    codes, scale = quantize_rows(torch.randn(n, k, device="cuda", generator=g) * 0.02)
    got = skinny_gemm.skinny_linear(x, codes, weight_scale=scale).double()
    want = x.double() @ (codes.double() * scale.double()[:, None]).T
    # bf16 output: half an ulp (2^-8 relative) plus the fp32 sum's error.
    mag = x.double().abs() @ (codes.double().abs() * scale.double()[:, None]).T
    assert ((got - want).abs() <= 2.0**-8 * want.abs() + 2 * k * 2.0**-24 * mag + 1e-30).all()


@pytest.mark.gpu
@gpu
def test_fp8_engine_on_gpu_graphs_and_eager_agree(tiny_models):
    """bf16 on the GPU: FP8 decode steps (skinny kernel on 8-bit weights, CUDA graphs, overlapped steps)
    give the tokens that eager, synchronous steps give, and the weights take half the bytes."""
    kw = dict(model=str(tiny_models["llama"]), block_size=16, max_model_len=256, num_kv_blocks=256,
              quantization="fp8", dtype="bfloat16")
    graphed = LLMEngine(EngineConfig(**kw))
    eager = LLMEngine(EngineConfig(enforce_eager=True, async_scheduling=False, **kw))
    prompts = random_prompts(8, 3, 60, seed=5)
    got, _ = run_greedy(graphed, prompts, max_tokens=16, arrive_every=1)
    want, _ = run_greedy(eager, prompts, max_tokens=16, arrive_every=1)
    # Graph padding changes a step's row count, so its matmuls may take other kernel configs (other
    # summation orders): bf16 rounding may fork a sequence, rarely, on these decisive tiny models.
    assert sum(got[i] == want[i] for i in want) >= len(want) - 1
    b = graphed.runner.breakdown
    assert b.single_token_steps > 0 and b.graph_single_token_steps == b.single_token_steps
    fp8_bytes = sum(m.weight.numel() for m in graphed.runner.model.modules() if isinstance(m, Fp8Linear))
    assert fp8_bytes > 0


def test_bench_floors_count_the_bytes_an_fp8_model_reads(tiny_models):
    """`plait bench throughput --quantization fp8` sets its weight-read floor from 1-byte weights plus
    their scales, while the prompt FLOPs stay those of the same parameter count."""
    from plait.bench.throughput import floor_seconds

    roof = {"read_GBps": 1.0, "bf16_TFLOPs": 1.0}  # 1 GB/s: the floor in ms is the bytes / 1e6
    kw = dict(model=str(tiny_models["llama"]), block_size=8, max_model_len=64)
    plain, fp8 = LLMEngine(EngineConfig(**kw)), LLMEngine(EngineConfig(quantization="fp8", **kw))
    prompts, out_len = [[5, 6, 7]], 2
    layers = [m for m in fp8.runner.model.modules() if isinstance(m, Fp8Linear)]
    saved = sum(m.weight.numel() * (4 - 1) - 4 * m.out_features for m in layers)  # fp32 -> fp8 + scales
    want_ms = (sum(p.numel() * 4 for p in plain.runner.model.parameters()) - saved) / 1e9 * 1e3
    got, ref = floor_seconds(fp8, prompts, out_len, roof), floor_seconds(plain, prompts, out_len, roof)
    assert got["weight_read_floor_ms_per_step"] == pytest.approx(want_ms, rel=1e-12)
    assert got["prefill_matmul_s"] == pytest.approx(ref["prefill_matmul_s"], rel=1e-12)


@pytest.mark.parametrize("m", [1, 37])
def test_fp8_gemm_matches_its_reference(m):
    pytest.importorskip("triton")
    from plait.kernels.fp8_gemm import GemmConfig, fp8_linear, fp8_linear_ref

    device = "cuda" if ON_GPU else "cpu"
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 100, generator=g).to(device=device, dtype=torch.float16)
    codes, scale = quantize_rows(torch.randn(45, 100, generator=g).to(device))
    bias = torch.randn(45, generator=g).to(device=device, dtype=torch.float16)
    for cfg in (GemmConfig(16, 16, 32, 4, 1), GemmConfig(32, 16, 16, 4, 2, group_m=2)):  # K=100: ragged
        got = fp8_linear(x, codes, scale, bias, config=cfg)
        torch.testing.assert_close(got, fp8_linear_ref(x, codes, scale, bias), rtol=2e-3, atol=2e-2)
