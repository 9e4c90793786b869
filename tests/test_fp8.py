"""FP8 quantisation (plait.layers.fp8, `quantization="fp8"`, W8A8): the rounding, the kernels against
their torch references, and the engine computing exactly the model whose weights and linear-layer inputs
are rounded to FP8 (tiny random models, fp32 on CPU; the `gpu` tests take real shapes in bf16)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_engines_agree, random_prompts, run_greedy
from torch import nn

from plait.config import EngineConfig
from plait.engine.engine import LLMEngine
from plait.layers.fp8 import (
    FP8_MAX,
    Fp8Linear,
    dequantize_rows,
    fp8_linear_ref,
    quantize_model,
    quantize_rows,
)

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


def _fake_quantized(x: torch.Tensor) -> torch.Tensor:
    """x with each row replaced by its FP8 rounding on its own scale (fp32)."""
    codes, scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    return dequantize_rows(codes, scale, torch.float32).view(x.shape)


def test_fp8_linear_quantizes_weight_and_each_input_row():
    torch.manual_seed(1)
    linear = nn.Linear(48, 24, bias=True)
    fp8 = Fp8Linear.from_linear(linear)
    assert fp8.weight.dtype == torch.float8_e4m3fn and fp8.compute_dtype == torch.float32
    # Rows of very different magnitudes: each is rounded on its own scale.
    x = torch.randn(2, 5, 48) * torch.logspace(-2, 2, 5)[None, :, None]
    want = torch.nn.functional.linear(_fake_quantized(x), fp8.dequantized(torch.float32), linear.bias)
    got = fp8(x)
    assert got.shape == (2, 5, 24) and torch.equal(got, want)
    # A row's scale is its own: alone, a row rounds to the same codes (equal up to the BLAS's summation
    # order, which depends on the batch's shape on CPU).
    torch.testing.assert_close(fp8(x[1, 3:4]), got[1, 3:4], rtol=1e-6, atol=1e-5)
    # The input rounding is real: the unrounded input gives other numbers.
    assert not torch.equal(got, torch.nn.functional.linear(x, fp8.dequantized(torch.float32), linear.bias))
    with pytest.raises(RuntimeError, match="before quantising"):
        fp8.fold_norm_weight(torch.ones(48))


def _fp8_reference(engine: LLMEngine) -> None:
    """Make engine's model the FP8 one with plain layers: every linear weight but the lm_head replaced by
    its FP8 rounding, and those layers' inputs rounded per row before the matmul (a forward pre-hook)."""
    with torch.no_grad():
        for name, module in engine.runner.model.named_modules():
            if isinstance(module, nn.Linear) and not name.endswith("lm_head"):
                module.weight.copy_(dequantize_rows(*quantize_rows(module.weight), module.weight.dtype))
                module.register_forward_pre_hook(lambda _m, args: (_fake_quantized(args[0]),))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fp8_engine_is_the_model_with_fp8_weights_and_inputs(tiny_models, family):
    """quantization="fp8" in fp32 on CPU computes F.linear on dequantised FP8 codes of both the weight
    and each token's input: the same arithmetic as an unquantised engine whose weights were replaced by
    their FP8 roundings and whose linear layers round their inputs, so tokens and logits agree exactly,
    with chunked prompts and decodes batched together."""
    kw = dict(model=str(tiny_models[family]), block_size=8, max_num_batched_tokens=24, max_model_len=96,
              device="cpu")
    quantized = LLMEngine(EngineConfig(quantization="fp8", **kw))
    layers = [m for m in quantized.runner.model.modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == 4 * 2  # qkv, o, gate/up, down in each of 2 layers; the lm_head stays
    assert not isinstance(quantized.runner.model.lm_head, Fp8Linear)
    reference = LLMEngine(EngineConfig(**kw))
    _fp8_reference(reference)
    prompts = random_prompts(6, 3, 40, seed=11)
    got_logits = assert_engines_agree(quantized, reference, prompts)
    # ... and FP8 is a real change: the unrounded model's logits differ.
    plain, plain_logits = run_greedy(LLMEngine(EngineConfig(**kw)), prompts, max_tokens=8, arrive_every=1,
                                     capture_logits=True)
    assert any(not torch.equal(a, b) for i in plain_logits for a, b in zip(plain_logits[i], got_logits[i]))


def test_quantized_models_never_hold_their_16_bit_weights(tiny_models, monkeypatch):
    """The Llama family's linear layers are built on the meta device under quantization and each
    checkpoint tensor is quantised as it is read: no 16-bit copy of a quantised layer is made (what lets
    a model that fits only in FP8 load at all). Random weights take the unquantised model's draws."""
    made_from = []
    real = Fp8Linear.from_linear.__func__
    monkeypatch.setattr(Fp8Linear, "from_linear",
                        classmethod(lambda cls, linear, device=None: (made_from.append(linear.weight.is_meta),
                                                                      real(cls, linear, device))[1]))
    kw = dict(model=str(tiny_models["llama"]), block_size=8, max_model_len=64, device="cpu")
    LLMEngine(EngineConfig(quantization="fp8", **kw))
    assert made_from and all(made_from)
    dummy = LLMEngine(EngineConfig(quantization="fp8", load_format="dummy", **kw)).runner.model
    plain = LLMEngine(EngineConfig(load_format="dummy", **kw)).runner.model
    for name, module in dummy.named_modules():
        if isinstance(module, Fp8Linear):
            codes, scale = quantize_rows(plain.get_submodule(name).weight)
            assert torch.equal(module.weight.view(torch.uint8), codes.view(torch.uint8))
            assert torch.equal(module.weight_scale, scale)
    assert torch.equal(dummy.lm_head.weight, plain.lm_head.weight)


LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _fp8_checkpoint(src, dst, method: str) -> dict:
    """dst: src's checkpoint with every decoder linear weight in FP8, as llm-compressor ("compressed-tensors",
    per-channel scales [N, 1], dynamic per-token inputs) or AutoFP8 ("fp8", one scale per tensor and a
    static input scale) write them; returns the codes and scales written, by HF name."""
    import shutil

    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    tensors, written = {}, {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(f).items():
            if name.rsplit(".", 2)[-2] in LINEARS and name.endswith(".weight"):
                if method == "fp8":  # one scale for the whole tensor
                    scale = (t.float().abs().amax() * (1.0 / FP8_MAX)).reshape(())
                    codes = (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
                    tensors[name.replace(".weight", ".input_scale")] = torch.tensor(0.05)
                else:
                    codes, scale = quantize_rows(t)
                    scale = scale[:, None]
                tensors[name], tensors[name.replace(".weight", ".weight_scale")] = codes, scale
                written[name] = (codes, scale)
            else:
                tensors[name] = t
    save_file(tensors, dst / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    if method == "fp8":
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static",
                                      "ignored_layers": ["lm_head"]}
    else:
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}
    (dst / "config.json").write_text(json.dumps(cfg))
    return written


def test_an_fp8_checkpoint_is_served_as_it_is(tiny_models, tmp_path):
    """An llm-compressor FP8-dynamic checkpoint (per-channel scales) loads without --quantization, its codes
    and scales kept: the same engine as quantising the original checkpoint, logits for logits. An AutoFP8
    checkpoint (one scale per tensor, a static input scale plait replaces by per-token ones) loads with
    each fused layer's shards keeping their own tensor's scale."""
    src = tiny_models["llama"]
    _fp8_checkpoint(src, tmp_path / "ct", "compressed-tensors")
    kw = dict(block_size=8, max_num_batched_tokens=24, max_model_len=96, device="cpu")
    served = LLMEngine(EngineConfig(model=str(tmp_path / "ct"), **kw))
    assert served.runner.quantization == "fp8"
    assert sum(isinstance(m, Fp8Linear) for m in served.runner.model.modules()) == 8
    quantized = LLMEngine(EngineConfig(model=str(src), quantization="fp8", **kw))
    prompts = random_prompts(4, 3, 30, seed=2)
    assert_engines_agree(served, quantized, prompts, max_tokens=6)

    written = _fp8_checkpoint(src, tmp_path / "autofp8", "fp8")
    model = LLMEngine(EngineConfig(model=str(tmp_path / "autofp8"), **kw)).runner.model
    qkv = model.model.layers[1].self_attn.qkv_proj
    q_codes, q_scale = written["model.layers.1.self_attn.q_proj.weight"]
    k_codes, k_scale = written["model.layers.1.self_attn.k_proj.weight"]
    q_rows, k_rows = q_codes.shape[0], k_codes.shape[0]
    assert torch.equal(qkv.weight[:q_rows].view(torch.uint8), q_codes.view(torch.uint8))
    assert torch.equal(qkv.weight[q_rows:q_rows + k_rows].view(torch.uint8), k_codes.view(torch.uint8))
    assert torch.equal(qkv.weight_scale[:q_rows], q_scale.expand(q_rows))
    assert torch.equal(qkv.weight_scale[q_rows:q_rows + k_rows], k_scale.expand(k_rows))
    assert not torch.equal(q_scale, k_scale)


@pytest.mark.parametrize("change, message", [
    (lambda q: q.update(quant_method="bitsandbytes"), "quant_method 'bitsandbytes' is not supported"),
    (lambda q: q.update(quant_method="fp8", weight_block_size=[100, 128]), "powers of two"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(type="int", num_bits=4),
     "weights .* not supported"),
    (lambda q: q.update(ignore=["lm_head", "model.layers.0.mlp.down_proj"]), "other than the lm_head"),
])
def test_unsupported_checkpoint_quantization_is_refused_by_name(tiny_models, tmp_path, change, message):
    folder = tmp_path / "ct"
    _fp8_checkpoint(tiny_models["llama"], folder, "compressed-tensors")
    cfg = json.loads((folder / "config.json").read_text())
    change(cfg["quantization_config"])
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        LLMEngine(EngineConfig(model=str(folder), device="cpu", max_model_len=64))


def test_an_fp8_checkpoint_without_its_scales_is_refused(tiny_models, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "ct"
    _fp8_checkpoint(tiny_models["llama"], folder, "compressed-tensors")
    tensors = {k: v for k, v in load_file(folder / "model.safetensors").items()
               if k != "model.layers.0.mlp.down_proj.weight_scale"}
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match="without its weight_scale"):
        LLMEngine(EngineConfig(model=str(folder), device="cpu", max_model_len=64))


def test_quantization_is_validated_and_reaches_the_cli():
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="quantization must be one of"):
        quantize_model(nn.Sequential(nn.Linear(2, 2)), "awq")
    from plait.entrypoints.cli import _engine_config, build_parser

    args = build_parser().parse_args(["serve", "--quantization", "fp8"])
    assert _engine_config(args).quantization == "fp8"


# ---- the kernels (Triton interpreter on CPU, compiled on a GPU) -------------------------------------------

DEVICE = "cuda" if ON_GPU else "cpu"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [100, 2500])  # one ragged step; several steps, the last ragged
@pytest.mark.parametrize("rows", [5, 20])  # K in chunks of one program each; one program a row
def test_quantize_rows_kernel_is_the_reference_bit_for_bit(dtype, k, rows):
    pytest.importorskip("triton")
    from plait.kernels.fp8_gemm import quantize_rows_fp8

    g = torch.Generator().manual_seed(k)
    x = torch.randn(rows, k, generator=g) * torch.logspace(-3, 3, rows)[:, None]
    # A few entries far below their row's amax: their codes are FP8 subnormals (below 2^-6).
    x[:, 7:10] = x.abs().amax(dim=1, keepdim=True) * torch.tensor([3e-5, -1.7e-5, 4e-6])
    x = x.to(device=DEVICE, dtype=dtype)
    x[2] = 0.0
    codes, scale = quantize_rows_fp8(x)
    want_codes, want_scale = quantize_rows(x)
    assert torch.equal(scale, want_scale)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    live = torch.arange(rows) != 2
    assert codes.float().abs().amax(dim=1)[live].eq(FP8_MAX).all()


def _exact(codes, scale, w_codes, w_scale, bias):
    """The kernel's function in fp64, and the magnitude its fp32 sums' error scales with."""
    xd = codes.double() * scale.double()[:, None]
    wd = w_codes.double() * w_scale.double()[:, None]
    b = bias.double() if bias is not None else 0.0
    return xd @ wd.T + b, xd.abs() @ wd.abs().T


gemv_configs = {
    "unsplit": dict(block_n=64, block_k=32, split_k=1, num_stages=2),
    "split3": dict(block_n=64, block_k=32, split_k=3, num_stages=1),
    "wide_k": dict(block_n=64, block_k=128, split_k=1, num_stages=3),
}


@pytest.mark.parametrize("name", sorted(gemv_configs))
@pytest.mark.parametrize("m", [1, 5, 16])
def test_fp8_gemv_matches_its_reference(name, m):
    pytest.importorskip("triton")
    from plait.kernels.fp8_gemm import Fp8GemvConfig, fp8_skinny, quantize_rows_fp8

    g = torch.Generator().manual_seed(m)
    k, n = 200, 70  # ragged K for every block_k; a partial last block of weight rows
    x = torch.randn(m, k, generator=g).to(device=DEVICE, dtype=torch.bfloat16)
    w_codes, w_scale = quantize_rows(torch.randn(n, k, generator=g).to(DEVICE))
    bias = torch.randn(n, generator=g).to(device=DEVICE, dtype=torch.bfloat16)
    codes, scale = quantize_rows_fp8(x)
    got = fp8_skinny(codes, scale, w_codes, w_scale, bias, torch.bfloat16,
                     config=Fp8GemvConfig(**gemv_configs[name]))
    exact, mag = _exact(codes, scale, w_codes, w_scale, bias)
    # Products of FP8 codes are exact in fp32; the sum of K of them, the scales and the bias add a few
    # fp32 roundings, and the bf16 output an ulp (Triton's CPU interpreter truncates to bf16).
    bound = (k + 4) * 2.0**-24 * (mag + bias.double().abs()) + 2.0**-7 * exact.abs()
    assert ((got.double() - exact).abs() <= bound).all()
    with pytest.raises(ValueError, match="rows"):
        fp8_skinny(codes[:0], scale[:0], w_codes, w_scale, None, torch.bfloat16)


@pytest.mark.parametrize("m", [1, 20, 37])
def test_fp8_linear_matches_its_reference(m):
    """The dispatch: the GEMV up to 16 rows, cuBLASLt's FP8 GEMM beyond (16 rows a launch where a shape is
    not a multiple of 16), against fp8_linear_ref."""
    pytest.importorskip("triton")
    from plait.kernels.fp8_gemm import fp8_linear

    g = torch.Generator().manual_seed(m)
    for k, n in ((128, 48), (100, 45)):  # _scaled_mm's shapes, and ragged ones it refuses
        x = torch.randn(2, m, k, generator=g).to(device=DEVICE, dtype=torch.bfloat16)
        w_codes, w_scale = quantize_rows(torch.randn(n, k, generator=g).to(DEVICE))
        bias = torch.randn(n, generator=g).to(device=DEVICE, dtype=torch.bfloat16)
        got = fp8_linear(x, w_codes, w_scale, bias)
        assert got.shape == (2, m, n) and got.dtype == torch.bfloat16
        torch.testing.assert_close(got, fp8_linear_ref(x, w_codes, w_scale, bias), rtol=2e-2, atol=2e-2)


# ---- GPU: real shapes, bf16, CUDA graphs -----------------------------------------------------------------

gpu = pytest.mark.skipif(not ON_GPU, reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 4, 16, 256])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (28672, 4096)])
def test_fp8_linear_real_shapes_match_the_exact_product(m, n, k):
    """Llama-8B's qkv, down and gate/up with the default configs (the GEMV's split-K chosen for the GPU,
    cuBLASLt at 256 rows) against the product of the same codes in fp64."""
    from plait.kernels.fp8_gemm import fp8_linear, quantize_rows_fp8

    g = torch.Generator(device="cuda").manual_seed(n + m)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    w_codes, w_scale = quantize_rows(torch.randn(n, k, device="cuda", generator=g) * 0.02)
    got = fp8_linear(x, w_codes, w_scale).double()
    codes, scale = quantize_rows_fp8(x)
    exact, mag = _exact(codes, scale, w_codes, w_scale, None)
    # bf16 output: half an ulp (2^-8 relative) plus the fp32 sums' error (cuBLASLt's included).
    assert ((got - exact).abs() <= 2.0**-8 * exact.abs() + 2 * k * 2.0**-24 * mag + 1e-30).all()


def _logit_gaps(got, got_logits, want, want_logits) -> list[float]:
    """Per prompt and step, while the two greedy outputs still agree: max |logits difference| over the
    reference's logit std (so a wrong row or weight, ~1, stands apart from rounding, ~0.01)."""
    gaps = []
    for i in want:
        for t, (a, b) in enumerate(zip(got_logits[i], want_logits[i])):
            if got[i][:t] != want[i][:t]:
                break
            gaps.append(float((a.float() - b.float()).abs().max() / b.float().std()))
    return gaps


def _embedding_led_engine(**config) -> LLMEngine:
    """An engine of EngineConfig(**config) (random weights) whose token embeddings are 100x larger, so that,
    as in tests/test_gpu_engine.py, the token's own embedding dominates and greedy picks seldom tie."""
    engine = LLMEngine(EngineConfig(**config))
    with torch.no_grad():
        engine.runner.model.model.embed_tokens.weight.mul_(100.0)
    return engine


def _random_llama(tmp_path) -> str:
    """A random-weight Llama of modest width (weights drawn at load: load_format="dummy")."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
           "intermediate_size": 1408, "num_hidden_layers": 4, "num_attention_heads": 8,
           "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 2048, "max_position_embeddings": 1024,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


@pytest.mark.gpu
@gpu
def test_fp8_engine_on_gpu_graphs_and_eager_agree(tmp_path):
    """bf16 on the GPU: FP8 steps (the GEMV and cuBLASLt's FP8 GEMM, CUDA graphs, overlapped steps) give
    the logits that eager, synchronous steps give, up to rounding, and stay near the unquantised model's.

    Logits are compared only up to each output's first fork: graph padding changes a step's row count,
    so its matmuls may take other kernels (other summation orders), and a last-bit change of an
    activation can move its FP8 code a whole step. On CPU in fp32 this model's FP8 logits differ from
    the unquantised ones by at most 0.03 logit std; a wrong row or weight moves them by ~1."""
    kw = dict(model=_random_llama(tmp_path), load_format="dummy", seed=3, block_size=16, max_model_len=256,
              num_kv_blocks=256, quantization="fp8", dtype="bfloat16")

    def engine(**knobs) -> LLMEngine:
        return _embedding_led_engine(**{**kw, **knobs})

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 2048, (int(n),), generator=g).tolist()
               for n in torch.randint(3, 60, (8,), generator=g)]
    graphed = engine()
    got, got_logits = run_greedy(graphed, prompts, max_tokens=16, arrive_every=1, capture_logits=True)
    want, want_logits = run_greedy(engine(enforce_eager=True, async_scheduling=False), prompts, max_tokens=16,
                                   arrive_every=1, capture_logits=True)
    b = graphed.runner.breakdown
    assert b.single_token_steps > 0 and b.graph_single_token_steps == b.single_token_steps
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in graphed.runner.model.modules()
               if isinstance(m, Fp8Linear))
    plain, plain_logits = run_greedy(engine(quantization=None), prompts, max_tokens=16, arrive_every=1,
                                     capture_logits=True)
    same = _logit_gaps(got, got_logits, want, want_logits)
    quant = _logit_gaps(got, got_logits, plain, plain_logits)
    print(f"\nfp8 graphed vs eager: {sum(got[i] == want[i] for i in want)}/8 agree, logit gaps max "
          f"{max(same):.4f}; vs bf16: {sum(got[i] == plain[i] for i in plain)}/8, max {max(quant):.4f}")
    assert len(same) >= len(prompts) and max(same) < 0.1
    # FP8 is an approximation, not garbage: the quantised logits stay near the unquantised ones.
    assert len(quant) >= len(prompts) and max(quant) < 0.15


def test_bench_floors_count_the_bytes_an_fp8_model_reads(tiny_models):
    """`plait bench throughput --quantization fp8` sets its weight-read floor from 1-byte weights plus
    their scales, while the prompt FLOPs stay those of the same parameter count."""
    from plait.bench.throughput import floor_seconds

    roof = {"read_GBps": 1.0, "bf16_TFLOPs": 1.0}  # 1 GB/s: the floor in ms is the bytes / 1e6
    kw = dict(model=str(tiny_models["llama"]), block_size=8, max_model_len=64, device="cpu")
    plain, fp8 = LLMEngine(EngineConfig(**kw)), LLMEngine(EngineConfig(quantization="fp8", **kw))
    prompts, out_len = [[5, 6, 7]], 2
    layers = [m for m in fp8.runner.model.modules() if isinstance(m, Fp8Linear)]
    saved = sum(m.weight.numel() * (4 - 1) - 4 * m.out_features for m in layers)  # fp32 -> fp8 + scales
    want_ms = (sum(p.numel() * 4 for p in plain.runner.model.parameters()) - saved) / 1e9 * 1e3
    got, ref = floor_seconds(fp8, prompts, out_len, roof), floor_seconds(plain, prompts, out_len, roof)
    assert got["weight_read_floor_ms_per_step"] == pytest.approx(want_ms, rel=1e-12)
    assert got["prefill_matmul_s"] == pytest.approx(ref["prefill_matmul_s"], rel=1e-12)
