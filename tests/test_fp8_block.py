"""Block-wise FP8 checkpoints (DeepSeek / Qwen "fp8" with weight_block_size, compressed-tensors "block"):
the tile and group rounding, the kernels against their torch references, and the engine computing exactly
the model whose weights are the checkpoint's tiles and whose linear-layer inputs are rounded per token
group (tiny random models, fp32 on CPU; the `gpu` tests take real shapes in bf16)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_engines_agree, random_prompts, run_greedy
from torch import nn

from plait.config import EngineConfig
from plait.engine.engine import LLMEngine
from plait.layers.fp8 import FP8_MAX, Fp8Linear
from plait.layers.fp8_block import (
    Fp8BlockLinear,
    dequantize_blocks,
    fp8_block_linear_ref,
    quantize_blocks,
    quantize_groups,
)
from plait.layers.linear import linear as padded_linear

triton = pytest.importorskip("triton")

from plait.kernels.fp8_block_gemm import fp8_block_gemm, fp8_block_linear, quantize_groups_fp8  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
FP8 = torch.float8_e4m3fn
# A normal e4m3 value rounds within 2^-4 of itself; below 2^-6 the spacing is 2^-9 (of the scale).
FP8_RELATIVE = 2.0**-4
FP8_SUBNORMAL_HALF_STEP = 2.0**-10
BLOCK = (32, 32)  # the tiny models' layers span several tiles each way


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def test_quantize_blocks_rounds_each_tile_on_its_own_scale():
    g = torch.Generator().manual_seed(0)
    # Tiles five orders of magnitude apart, partial tiles at both ends, and a tile of zeros.
    w = torch.randn(100, 150, generator=g) * torch.logspace(-3, 2, 100)[:, None]
    w[:32, 64:128] = 0.0
    codes, scale = quantize_blocks(w, (32, 64))
    assert codes.dtype == FP8 and scale.shape == (4, 3)
    back = dequantize_blocks(codes, scale, (32, 64), torch.float32)
    per_element = scale.repeat_interleave(32, 0)[:100].repeat_interleave(64, 1)[:, :150]
    bound = FP8_RELATIVE * w.abs() + FP8_SUBNORMAL_HALF_STEP * per_element
    assert ((back - w).abs() <= bound * (1 + 1e-6)).all()
    for i in range(4):
        for j in range(3):
            tile = codes[32 * i:32 * (i + 1), 64 * j:64 * (j + 1)].float().abs()
            assert tile.max() == (0.0 if (i, j) == (0, 1) else FP8_MAX)
    assert scale[0, 1] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k", [32, 300])
def test_quantize_groups_kernel_is_the_reference_bit_for_bit(dtype, k):
    g = torch.Generator().manual_seed(k)
    x = (torch.randn(7, k, generator=g) * torch.logspace(-4, 3, 7)[:, None]).to(dtype)
    x[2, :40] = 0.0
    want_codes, want_scale = quantize_groups(x, 32)
    codes, scale = quantize_groups_fp8(x.to(DEVICE), 32)
    assert torch.equal(u8(codes.cpu()), u8(want_codes)) and torch.equal(scale.cpu(), want_scale)
    assert want_scale.shape == (7, -(-k // 32))


def exact_product(codes, scale, w_codes, w_scale, block, bias=None) -> torch.Tensor:
    """The block-scaled product in fp64: what every fp32 summation order approximates."""
    k = codes.shape[1]
    xd = codes.double() * scale.double().repeat_interleave(block[1], 1)[:, :k]
    wd = dequantize_blocks(w_codes, w_scale, block, torch.float64)
    out = xd @ wd.T
    return out + bias.double() if bias is not None else out


@pytest.mark.parametrize("m", [1, 5, 16, 20, 70])
@pytest.mark.parametrize("block", [(32, 32), (64, 32), (32, 64)])
def test_block_gemm_matches_the_exact_product(m, block):
    """Decode-sized rows (split K, partial last split) and prompt-sized tiles, ragged N and K."""
    g = torch.Generator().manual_seed(m)
    w_codes, w_scale = quantize_blocks(torch.randn(200, 300, generator=g), block)
    codes, scale = quantize_groups(torch.randn(m, 300, generator=g) * 3, block[1])
    bias = torch.randn(200, generator=g)
    want = exact_product(codes, scale, w_codes, w_scale, block, bias)
    dev = [t.to(DEVICE) for t in (codes, scale, w_codes, w_scale, bias)]
    for split in ([None, 1, 4] if m <= 16 else [None]):
        got = fp8_block_gemm(*dev[:4], block, dev[4], torch.float32, split_k=split).double().cpu()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4 * want.abs().max().item())


def test_block_linear_kernel_path_matches_its_reference():
    g = torch.Generator().manual_seed(3)
    w_codes, w_scale = quantize_blocks(torch.randn(96, 160, generator=g), BLOCK)
    x = torch.randn(2, 9, 160, generator=g).half()
    want = fp8_block_linear_ref(x, w_codes, w_scale, BLOCK)
    got = fp8_block_linear(x.to(DEVICE), w_codes.to(DEVICE), w_scale.to(DEVICE), BLOCK).cpu()
    assert got.shape == (2, 9, 96) and got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=2e-3)


def test_block_layer_rounds_inputs_per_group_and_refuses_misaligned_shards():
    torch.manual_seed(1)
    linear = nn.Linear(64, 96, bias=True)
    layer = Fp8BlockLinear.from_linear(linear, block=BLOCK)
    assert isinstance(layer, Fp8Linear) and layer.weight_scale.shape == (3, 2)
    # Two halves of one row on very different scales: each K group rounds on its own.
    x = torch.randn(3, 64)
    x[:, 32:] *= 1e-3
    codes, scale = quantize_groups(x, 32)
    xd = codes.float() * scale.repeat_interleave(32, 1)
    # plait's linear: F.linear, its 3 rows padded to 4 on CPU (plait.layers.linear.CPU_GEMM_MIN_ROWS)
    assert torch.equal(layer(x), padded_linear(xd, layer.dequantized(torch.float32), linear.bias))
    per_row = Fp8Linear.from_linear(linear)
    assert not torch.equal(layer(x), per_row(x))
    with pytest.raises(ValueError, match="32-row blocks"):
        layer.load_scale_rows(16, 32, torch.ones(1, 2))
    with pytest.raises(ValueError, match="expected"):
        layer.load_scale_rows(32, 32, torch.ones(2, 2))
    with pytest.raises(ValueError, match="powers of two"):
        Fp8BlockLinear.from_linear(linear, block=(48, 32))


LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def block_checkpoint(src, dst, fmt: str, block=BLOCK) -> None:
    """dst: src's checkpoint with every decoder linear weight quantised tile by tile, written as DeepSeek /
    Qwen do (quant_method "fp8", weight_block_size, scales named weight_scale_inv) or as llm-compressor's
    FP8_BLOCK scheme (compressed-tensors, strategy "block", scales named weight_scale)."""
    import shutil

    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(f).items():
            if name.rsplit(".", 2)[-2] in LINEARS and name.endswith(".weight"):
                codes, scale = quantize_blocks(t, block)
                suffix = ".weight_scale_inv" if fmt == "fp8" else ".weight_scale"
                tensors[name], tensors[name.replace(".weight", suffix)] = codes, scale
            else:
                tensors[name] = t
    save_file(tensors, dst / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    if fmt == "fp8":
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": list(block)}
    else:
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "block", "dynamic": False,
                            "block_structure": list(block)},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "group",
                                      "group_size": block[1], "dynamic": True}}}}
    (dst / "config.json").write_text(json.dumps(cfg))


def block_reference(engine: LLMEngine, block=BLOCK) -> None:
    """Make engine's (unquantised) model the block-FP8 one with plain layers: every decoder linear weight
    replaced by its tile rounding, and those layers' inputs rounded per token group (a pre-hook)."""
    def round_inputs(_module, args):
        x = args[0]
        codes, scale = quantize_groups(x.reshape(-1, x.shape[-1]), block[1])
        xd = codes.float() * scale.repeat_interleave(block[1], 1)[:, : x.shape[-1]]
        return (xd.view(x.shape),)

    with torch.no_grad():
        for name, module in engine.runner.model.named_modules():
            if isinstance(module, nn.Linear) and not name.endswith("lm_head"):
                # Fused layers quantise each checkpoint shard on its own tiles; the shards here all start on
                # tile rows, so tiling the fused weight gives the same tiles.
                module.weight.copy_(dequantize_blocks(*quantize_blocks(module.weight, block), block,
                                                      module.weight.dtype))
                module.register_forward_pre_hook(round_inputs)


@pytest.mark.parametrize("fmt", ["fp8", "compressed-tensors"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_block_fp8_checkpoint_is_the_model_with_its_tiles_and_group_rounded_inputs(
        tiny_models, tmp_path, family, fmt):
    block_checkpoint(tiny_models[family], tmp_path / "ckpt", fmt)
    kw = dict(block_size=8, max_num_batched_tokens=24, max_model_len=96, device="cpu")
    served = LLMEngine(EngineConfig(model=str(tmp_path / "ckpt"), **kw))
    layers = [m for m in served.runner.model.modules() if isinstance(m, Fp8BlockLinear)]
    assert served.runner.quantization == "fp8" and len(layers) == 8 and layers[0].block == BLOCK
    reference = LLMEngine(EngineConfig(model=str(tiny_models[family]), **kw))
    block_reference(reference)
    prompts = random_prompts(6, 3, 40, seed=13)
    got_logits = assert_engines_agree(served, reference, prompts, atol=1e-5)
    # ... and the rounding is real: the per-row FP8 model's logits differ.
    per_row, per_row_logits = run_greedy(
        LLMEngine(EngineConfig(model=str(tiny_models[family]), quantization="fp8", **kw)), prompts,
        max_tokens=8, arrive_every=1, capture_logits=True)
    assert any(not torch.allclose(a, b, atol=1e-3) for i in per_row_logits
               for a, b in zip(per_row_logits[i], got_logits[i]))


def test_block_checkpoints_the_kernels_cannot_serve_are_refused(tiny_models, tmp_path):
    src = tiny_models["llama"]
    # k_proj's 32 rows end at row 96 of the fused qkv, inside the second 64-row block.
    block_checkpoint(src, tmp_path / "misaligned", "fp8", block=(64, 32))
    with pytest.raises(ValueError, match="64-row blocks"):
        LLMEngine(EngineConfig(model=str(tmp_path / "misaligned"), device="cpu", max_model_len=64))
    block_checkpoint(src, tmp_path / "odd", "fp8", block=(32, 32))
    cfg = json.loads((tmp_path / "odd" / "config.json").read_text())
    for q, message in [({"weight_block_size": [48, 32]}, "powers of two"),
                       ({"activation_scheme": "static"}, "static activation")]:
        (tmp_path / "odd" / "config.json").write_text(
            json.dumps({**cfg, "quantization_config": {**cfg["quantization_config"], **q}}))
        with pytest.raises(ValueError, match=message):
            LLMEngine(EngineConfig(model=str(tmp_path / "odd"), device="cpu", max_model_len=64))


def test_random_weights_of_a_block_fp8_config(tiny_models, tmp_path):
    """load_format="dummy" on a block-FP8 config (benchmarks): the unquantised model's draws, tiled."""
    block_checkpoint(tiny_models["llama"], tmp_path / "ckpt", "fp8")
    kw = dict(load_format="dummy", device="cpu", max_model_len=64)
    model = LLMEngine(EngineConfig(model=str(tmp_path / "ckpt"), **kw)).runner.model
    plain = LLMEngine(EngineConfig(model=str(tiny_models["llama"]), **kw)).runner.model
    layer = model.model.layers[0].mlp.down_proj
    codes, scale = quantize_blocks(plain.model.layers[0].mlp.down_proj.weight, BLOCK)
    assert isinstance(layer, Fp8BlockLinear)
    assert torch.equal(u8(layer.weight), u8(codes)) and torch.equal(layer.weight_scale, scale)


# -- on a GPU --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 4, 16, 37, 512])  # 37: padded to cuBLASLt's row multiple
# (2048, 2816): 22 groups of K, which cuBLASLt's transposed scale grid cannot take (the Triton kernel runs it)
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (28672, 4096), (2048, 2816)])
def test_block_linear_real_shapes_match_the_exact_product(m, n, k):
    """The Triton kernel (fp32 out): decode-sized tiles to fp32 rounding; prompt-sized tiles within Hopper's
    FP8 accumulation (promoted every IMPRECISE_ACC_K elements: ~1e-4 of the largest output). The layer's
    dispatch (cuBLASLt's block-scaled GEMM beyond 16 rows) to its bf16 output."""
    from plait.kernels.fp8_block_gemm import cublas_block_scaling

    g = torch.Generator(device="cuda").manual_seed(m)
    w_codes, w_scale = quantize_blocks(torch.randn(n, k, device="cuda", generator=g) * 0.02, (128, 128))
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    codes, scale = quantize_groups_fp8(x, 128)
    want = exact_product(codes, scale, w_codes, w_scale, (128, 128))
    largest = want.abs().max().item()
    got = fp8_block_gemm(codes, scale, w_codes, w_scale, (128, 128), None, torch.float32).double()
    tolerance = 1e-5 if m <= 16 else 3e-4
    torch.testing.assert_close(got, want, rtol=1e-5, atol=tolerance * largest)
    out = fp8_block_linear(x, w_codes, w_scale, (128, 128))
    torch.testing.assert_close(out.double(), want, rtol=2**-7, atol=2**-8 * largest)
    assert cublas_block_scaling(x.device)  # torch 2.11 + CUDA 13 on Hopper has it


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_block_fp8_engine_on_gpu_and_each_layer_against_its_reference(tiny_models, tmp_path):
    """A block-FP8 Qwen3 checkpoint in bf16 on the GPU: CUDA graphs and eager agree token for token, and each
    of the engine's block layers (32 x 32 tiles: the Triton kernel at every size), on the same bf16 input,
    gives its torch reference's output to bf16 rounding at decode and prompt sizes. Whole engines on the
    kernels and on torch code are not compared token for token: a last-bit difference in an activation
    crosses an FP8 rounding boundary about one time in 16, so two correct paths fork at the first near-tie."""
    block_checkpoint(tiny_models["qwen3"], tmp_path / "ckpt", "fp8")
    prompts = random_prompts(16, 3, 60, seed=4)
    kw = dict(model=str(tmp_path / "ckpt"), block_size=8, max_num_batched_tokens=64, max_model_len=128,
              num_kv_blocks=512)  # two engines in one process: each sized, not from free memory
    runs = {name: run_greedy(LLMEngine(EngineConfig(**kw, **knobs)), prompts, 12, arrive_every=1)[0]
            for name, knobs in {"graphs": {}, "eager": dict(enforce_eager=True)}.items()}
    agree = sum(runs["eager"][i] == runs["graphs"][i] for i in range(len(prompts))) / len(prompts)
    assert agree >= 0.9, f"graphs vs eager: {agree:.0%} agree"
    model = LLMEngine(EngineConfig(**kw, enforce_eager=True)).runner.model
    layers = [m for m in model.modules() if isinstance(m, Fp8BlockLinear)]
    assert len(layers) == 8
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for layer in layers:
            for m in (3, 16, 37, 64):
                x = torch.randn(m, layer.in_features, device="cuda", generator=g, dtype=torch.bfloat16)
                want = fp8_block_linear_ref(x, layer.weight, layer.weight_scale, layer.block, layer.bias)
                got = layer(x)
                torch.testing.assert_close(got.float(), want.float(), rtol=2**-7,
                                           atol=2**-8 * want.float().abs().max().item())
