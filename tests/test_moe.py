"""Sparse MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE) against HF transformers (fp32 CPU), their checkpoint
layouts and refusals; on a GPU (pytest -m gpu) the Triton experts and CUDA graphs against the torch path."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import (
    TINY_VOCAB,
    assert_engines_agree,
    assert_greedy_matches_hf,
    hf_greedy_reference,
    random_prompts,
    run_greedy,
)

from plait.config import EngineConfig, ModelConfig
from plait.engine.engine import LLMEngine
from plait.layers.moe import route

LOGITS_ATOL = 1e-4
MAX_TOKENS = 10
# Larger than the tiny dense models' scale-up: the router's logits must separate the top_k experts
# clearly, or HF and plait (equal up to fp32 rounding) could route a token differently.
WEIGHT_SCALE = 8.0


def _moe_configs() -> dict:
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=TINY_VOCAB, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2)
    return {
        "mixtral": MixtralConfig(**common, num_local_experts=6, num_experts_per_tok=2),
        # A dense layer (mlp_only_layers) beside the sparse ones, and the gated shared expert.
        "qwen2_moe": Qwen2MoeConfig(**common, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=64, mlp_only_layers=[1],
                                    norm_topk_prob=False),
        "qwen3_moe": Qwen3MoeConfig(**common, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                    head_dim=32, norm_topk_prob=True, tie_word_embeddings=True),
    }


def saved_random_models(tmp_path_factory, configs: dict, seed: int, weight_scale: float,
                        **from_config) -> dict[str, tuple]:
    """family -> (folder of a random tiny model as save_pretrained writes it, the HF model): each of
    ``configs`` seeded seed + its index, every weight but the norms' scaled by ``weight_scale``."""
    from transformers import AutoModelForCausalLM

    models = {}
    for i, (family, cfg) in enumerate(configs.items()):
        torch.manual_seed(seed + i)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, **from_config).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" not in name:
                    p.mul_(weight_scale)
        folder = tmp_path_factory.mktemp(f"tiny-{family}")
        model.save_pretrained(folder)
        models[family] = (folder, model)
    return models


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict[str, object]:
    """family -> (folder of a random tiny model as save_pretrained writes it, the HF model)."""
    return saved_random_models(tmp_path_factory, _moe_configs(), 2000, WEIGHT_SCALE)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_logits_and_greedy_match_hf(moe_models, family):
    folder, hf = moe_models[family]
    # Prompts longer than the step budget, so rows mix prompt chunks and decodes in one step.
    prompts = random_prompts(5, 1, 60, seed=11)
    engine = LLMEngine(EngineConfig(model=str(folder), max_num_batched_tokens=40, block_size=8))
    outputs, logits = run_greedy(engine, prompts, MAX_TOKENS, arrive_every=1, capture_logits=True)
    for i, prompt in enumerate(prompts):
        ref_ids, ref_logits = hf_greedy_reference(hf, prompt, outputs[i], MAX_TOKENS)
        assert outputs[i] == ref_ids, f"{family} prompt {i}: greedy tokens differ from HF"
        torch.testing.assert_close(torch.stack(logits[i]), ref_logits, atol=LOGITS_ATOL, rtol=0)
    assert engine.is_idle_and_clean()


def test_moe_config_reads_each_family(moe_models):
    read = {f: ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
            for f, (folder, _) in moe_models.items()}
    assert read["mixtral"].moe.renormalize and read["mixtral"].moe.intermediate_size == 96
    assert read["mixtral"].moe.dense_layers == ()
    qwen2 = read["qwen2_moe"]
    assert qwen2.attention_bias and qwen2.sliding_window is None
    assert qwen2.moe.shared_intermediate_size == 64 and qwen2.moe.dense_layers == (1,)
    assert not qwen2.moe.renormalize
    qwen3 = read["qwen3_moe"]
    assert qwen3.qk_norm and qwen3.moe.top_k == 3 and qwen3.moe.renormalize and qwen3.moe.num_experts == 8
    dense = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "vocab_size": 8,
                                 "num_attention_heads": 2})
    assert dense.moe is None


def test_moe_answers_do_not_depend_on_batching(moe_models):
    """A prompt's greedy tokens are the same whether it runs alone in whole steps or chunked beside
    others (the routed experts see different row sets in each)."""
    folder, _ = moe_models["qwen2_moe"]
    prompts = random_prompts(4, 20, 50, seed=5)
    chunked = LLMEngine(EngineConfig(model=str(folder), max_num_batched_tokens=24, block_size=8))
    whole = LLMEngine(EngineConfig(model=str(folder), max_num_batched_tokens=512, max_num_seqs=1))
    assert_engines_agree(chunked, whole, prompts, max_tokens=6, atol=LOGITS_ATOL)


def test_route_takes_the_softmax_top_k_and_renormalises_only_when_asked():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    probs = torch.softmax(logits, -1)[0]
    weights, ids = route(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(weights[0], probs[[1, 2]])
    weights, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(weights[0], probs[[1, 2]] / probs[[1, 2]].sum())
    assert weights.dtype == torch.float32


def _copy_model_folder(src, dst, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in tensors.items()}, dst / "model.safetensors")


def test_stacked_expert_checkpoint_loads_as_the_per_expert_one(moe_models, tmp_path):
    """transformers 5 holds each block's experts as two stacked tensors (experts.gate_up_proj /
    down_proj); a checkpoint written from its state dict serves the same model as save_pretrained's."""
    folder, hf = moe_models["qwen3_moe"]
    stacked = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # tied
    assert any(k.endswith("experts.gate_up_proj") for k in stacked)
    _copy_model_folder(folder, tmp_path / "stacked", stacked)
    prompts = random_prompts(3, 5, 30, seed=3)
    a = LLMEngine(EngineConfig(model=str(tmp_path / "stacked"), max_num_batched_tokens=64))
    b = LLMEngine(EngineConfig(model=str(folder), max_num_batched_tokens=64))
    assert_engines_agree(a, b, prompts, max_tokens=4)


def test_checkpoint_missing_an_expert_is_refused(moe_models, tmp_path):
    from safetensors.torch import load_file

    folder, _ = moe_models["mixtral"]
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.2.block_sparse_moe.experts.3.w3.weight"]
    _copy_model_folder(folder, tmp_path / "broken", tensors)
    with pytest.raises(ValueError, match=r"missing 1 expert tensors.*\(3, 'up_proj'\)"):
        LLMEngine(EngineConfig(model=str(tmp_path / "broken")))


def test_lora_is_refused_with_a_reason(moe_models):
    folder, _ = moe_models["mixtral"]
    with pytest.raises(ValueError, match="LoRA is not supported"):
        LLMEngine(EngineConfig(model=str(folder), enable_lora=True))


# ---- FP8 ------------------------------------------------------------------------------------------------

BLOCK = (32, 32)  # the tiny experts span several tiles each way (hidden 64, widths 32 / 96)
# Every linear weight a block-wise FP8 MoE checkpoint quantises: attention, dense and shared-expert MLPs,
# and each routed expert (Mixtral's w1 / w3 / w2 too); routers and the lm_head stay 16-bit.
FP8_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def fp8_moe_checkpoint(src, dst, block=BLOCK, linears: tuple[str, ...] = FP8_LINEARS) -> None:
    """dst: src's checkpoint as Qwen's FP8 MoE releases are written (quant_method "fp8", weight_block_size,
    per-tile weight_scale_inv of the weights of ``linears``; the routers listed in modules_to_not_convert and
    left 16-bit)."""
    from safetensors.torch import load_file

    from plait.layers.fp8_block import quantize_blocks

    tensors, routers = {}, []
    checkpoint = {name: t for f in sorted(src.glob("*.safetensors")) for name, t in load_file(f).items()}
    for name, t in checkpoint.items():
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in linears:
            tensors[name], tensors[name.replace(".weight", ".weight_scale_inv")] = quantize_blocks(t, block)
        else:
            tensors[name] = t
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                routers.append(name.removesuffix(".weight"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block),
                                  "modules_to_not_convert": ["lm_head", *routers]}
    _copy_model_folder(src, dst, tensors)
    (dst / "config.json").write_text(json.dumps(cfg))


def fp8_reference(engine: LLMEngine, block=BLOCK) -> None:
    """Make an unquantised engine's model the block-FP8 one: routed experts quantised in memory
    (FusedMoE.quantize_fp8, whose CPU path rounds their inputs per token group), every other linear weight
    but the routers' and the lm_head's replaced by its tile rounding and its input rounded per group."""
    from torch import nn

    from plait.layers.fp8_block import dequantize_blocks, quantize_blocks, quantize_groups
    from plait.layers.moe import FusedMoE

    def round_inputs(_module, args):
        x = args[0]
        codes, scale = quantize_groups(x.reshape(-1, x.shape[-1]), block[1])
        return ((codes.float() * scale.repeat_interleave(block[1], 1)[:, : x.shape[-1]]).view(x.shape),)

    with torch.no_grad():
        for name, module in engine.runner.model.named_modules():
            if isinstance(module, FusedMoE):
                module.quantize_fp8(block)
            elif isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] not in (
                    "lm_head", "gate", "shared_expert_gate"):
                module.weight.copy_(dequantize_blocks(*quantize_blocks(module.weight, block), block,
                                                      module.weight.dtype))
                module.register_forward_pre_hook(round_inputs)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_a_block_fp8_moe_checkpoint_is_the_model_with_its_tiles(moe_models, tmp_path, family):
    """Codes and tile scales of every expert land where quantising the 16-bit experts in memory puts
    them, routers stay 16-bit, and the whole model computes the block-FP8 function."""
    from plait.layers.moe import FusedMoE

    folder, _ = moe_models[family]
    fp8_moe_checkpoint(folder, tmp_path / "fp8")
    kw = dict(max_num_batched_tokens=40, block_size=8, max_model_len=128)
    served = LLMEngine(EngineConfig(model=str(tmp_path / "fp8"), **kw))
    moes = [m for m in served.runner.model.modules() if isinstance(m, FusedMoE)]
    assert moes and all(m.block == BLOCK and m.gate_up_proj.dtype == torch.float8_e4m3fn for m in moes)
    assert served.runner.model.model.layers[0].mlp.gate.weight.dtype == torch.float32  # the router
    reference = LLMEngine(EngineConfig(model=str(folder), **kw))
    fp8_reference(reference)
    assert_engines_agree(served, reference, random_prompts(4, 3, 40, seed=17), max_tokens=6, atol=1e-5)


def test_quantization_fp8_and_random_weights_make_fp8_experts(moe_models):
    """--quantization fp8 on a 16-bit MoE checkpoint: experts on tiles of 128 columns (and rows as many as
    divide the expert width: 32 here), close
    to the 16-bit model; random weights: the unquantised model's draws, tiled."""
    from plait.layers.fp8_block import dequantize_blocks, quantize_blocks
    from plait.layers.moe import FusedMoE, default_fp8_block

    folder, hf = moe_models["qwen3_moe"]
    engine = LLMEngine(EngineConfig(model=str(folder), quantization="fp8", max_model_len=128))
    moe = engine.runner.model.model.layers[1].mlp.experts
    assert isinstance(moe, FusedMoE) and moe.block == default_fp8_block(32) == (32, 128)
    want = hf.model.layers[1].mlp.experts.down_proj[2].detach()
    got = dequantize_blocks(moe.down_proj[2], moe.down_scale[2], moe.block, torch.float32)
    torch.testing.assert_close(got, want, rtol=2.0**-4, atol=want.abs().max().item() * 2.0**-9)
    outputs, _ = run_greedy(engine, random_prompts(2, 5, 20, seed=3), 4)
    assert all(len(o) == 4 for o in outputs.values())

    kw = dict(model=str(folder), load_format="dummy", max_model_len=64)
    fp8 = LLMEngine(EngineConfig(**kw, quantization="fp8")).runner.model.model.layers[0].mlp.experts
    plain = LLMEngine(EngineConfig(**kw)).runner.model.model.layers[0].mlp.experts
    codes, scale = quantize_blocks(plain.gate_up_proj[5], fp8.block)
    assert torch.equal(fp8.gate_up_proj[5].view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(fp8.gate_up_scale[5], scale)


def test_fp8_moe_checkpoints_plait_cannot_serve_are_refused(moe_models, tmp_path):
    folder, _ = moe_models["qwen3_moe"]
    fp8_moe_checkpoint(folder, tmp_path / "fp8")
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())
    per_channel = {**cfg, "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(per_channel))
    with pytest.raises(ValueError, match="per-tensor or per-channel scales are not supported"):
        LLMEngine(EngineConfig(model=str(tmp_path / "fp8")))
    # Experts 32 wide cannot take 64-row tiles: the up rows would not start on a tile row.
    fp8_moe_checkpoint(folder, tmp_path / "wide", block=(64, 32))
    with pytest.raises(ValueError, match="not a multiple of the 64-row FP8 blocks"):
        LLMEngine(EngineConfig(model=str(tmp_path / "wide")))
    # A missing tile scale.
    from safetensors.torch import load_file

    tensors = load_file(tmp_path / "fp8" / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.4.down_proj.weight_scale_inv"]
    _copy_model_folder(folder, tmp_path / "noscale", tensors)
    (tmp_path / "noscale" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="without their block scales"):
        LLMEngine(EngineConfig(model=str(tmp_path / "noscale")))


# ---- GPU (pytest -m gpu) ------------------------------------------------------------------------------

GPU_VOCAB = 4096


def _gpu_config(tmp_path) -> str:
    """A Qwen3-MoE-shaped random model big enough to route every expert in each step."""
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 512,
           "intermediate_size": 1024, "moe_intermediate_size": 256, "num_experts": 16,
           "num_experts_per_tok": 4,
           "norm_topk_prob": True, "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2,
           "head_dim": 64, "vocab_size": GPU_VOCAB, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
           "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu"}
    folder = tmp_path / "qwen3-moe"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


def _gpu_run(model: str, seed: int) -> tuple[list[list[int]], dict]:
    """The GPU tests' prompts (one token to 300, drawn with ``seed``) and engine knobs (fp32, random weights,
    no prefix cache) for ``model``."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(10, GPU_VOCAB, (n,), generator=g).tolist() for n in (1, 7, 40, 130, 300, 5)]
    return prompts, dict(model=model, load_format="dummy", seed=3, dtype="float32", max_model_len=1024,
                         num_kv_blocks=512, enable_prefix_caching=False)


def _torch_path_tokens(common: dict, prompts: list[list[int]]) -> dict[int, list[int]]:
    """Greedy tokens of the torch path (no Triton, torch_ref attention, eager, whole prompts) of the engine
    ``common`` describes, for the GPU tests to hold the Triton experts under graphs to."""
    from plait.kernels import dispatch

    dispatch.set_triton_enabled(False)
    try:
        engine = LLMEngine(EngineConfig(**common, attention_backend="torch_ref", enforce_eager=True,
                                        async_scheduling=False, max_num_batched_tokens=4096))
        return run_greedy(engine, prompts, 16, arrive_every=2)[0]
    finally:
        dispatch.set_triton_enabled(True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_moe_with_graphs_computes_the_torch_path_in_fp32(tmp_path):
    """fp32 on the GPU: the Triton experts under CUDA graphs and chunked mixed steps give the torch path's
    tokens (eager, whole prompts, torch_ref attention); every pure-decode step replays a graph."""
    model = _gpu_config(tmp_path)
    prompts, common = _gpu_run(model, seed=0)
    ref = _torch_path_tokens(common, prompts)
    engine = LLMEngine(EngineConfig(**common, max_num_batched_tokens=64))
    got, _ = run_greedy(engine, prompts, 16, arrive_every=2)
    assert got == ref
    b = engine.runner.breakdown
    assert b.single_token_steps > 0 and b.graph_single_token_steps == b.single_token_steps


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fp8_moe_replays_graphs_and_answers_the_same_twice(tmp_path):
    """bf16 with FP8 experts (--quantization fp8, random weights) on the Triton path: every pure-decode step
    replays a graph, and the same requests get the same tokens again (no atomics, no stale graph inputs)."""
    from plait.layers.moe import FusedMoE

    model = _gpu_config(tmp_path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, GPU_VOCAB, (n,), generator=g).tolist() for n in (3, 90, 17, 260)]
    # No prefix caching: the second run must take the first one's steps, not reuse its KV.
    engine = LLMEngine(EngineConfig(model=model, load_format="dummy", seed=5, quantization="fp8",
                                    max_model_len=1024, num_kv_blocks=512, max_num_batched_tokens=64,
                                    enable_prefix_caching=False))
    moe = engine.runner.model.model.layers[0].mlp.experts
    assert isinstance(moe, FusedMoE) and moe.gate_up_proj.dtype == torch.float8_e4m3fn
    first, _ = run_greedy(engine, prompts, 12, arrive_every=2)
    again, _ = run_greedy(engine, prompts, 12, arrive_every=2)
    assert first == again and all(len(t) == 12 for t in first.values())
    b = engine.runner.breakdown
    assert b.single_token_steps > 0 and b.graph_single_token_steps == b.single_token_steps


# ---- integer experts (GPTQ / AWQ / compressed-tensors) -------------------------------------------------


def _dequantized_hf(src, dst, weights: dict[str, torch.Tensor]):
    """transformers' model of ``src`` with the weights an integer checkpoint stands for (by HF name), loaded
    from a 16-bit checkpoint of them written to ``dst`` (transformers 5 stacks the per-expert tensors)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    _copy_model_folder(src, dst, load_file(src / "model.safetensors") | weights)
    return AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()


def _assert_integer_moe(engine: LLMEngine, bits: int) -> None:
    """Routed experts held as integer stacks; routers (and Qwen2-MoE's shared-expert gate) 16-bit; the
    shared expert's projections WNA16Linear."""
    from plait.layers.linear import Linear
    from plait.layers.moe import INT_WEIGHTS, FusedMoE
    from plait.layers.wna16 import WNA16Linear

    model = engine.runner.model
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert moes and all(m.weight_format == INT_WEIGHTS and m.int_spec.bits == bits for m in moes)
    assert all(m.gate_up_proj.dtype == torch.int32 for m in moes)
    for layer in model.model.layers:
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            assert type(mlp.gate) is Linear and mlp.gate.weight.dtype == torch.float32
            if mlp.shared_expert is not None:
                assert type(mlp.shared_expert_gate) is Linear
                assert isinstance(mlp.shared_expert.gate_up_proj, WNA16Linear)


@pytest.mark.parametrize("family,method,bits,group,sym,not_converted", [
    ("qwen3_moe", "gptq", 4, 32, True, ["mlp.gate"]),  # the routers listed as left 16-bit
    ("qwen2_moe", "awq", 4, 32, False, None),  # the shared expert and its gate; a dense layer
    ("mixtral", "gptq", 8, -1, False, None),  # w1 / w3 / w2; one group spanning each input
    ("mixtral", "awq", 4, 32, False, ["gate"]),  # as AutoAWQ's Mixtral checkpoints list the router
])
def test_an_integer_moe_checkpoint_matches_transformers_on_its_weights(moe_models, tmp_path, family, method,
                                                                        bits, group, sym, not_converted):
    """A GPTQ / AWQ MoE checkpoint (every expert's projections packed, the routers 16-bit, whether or not
    modules_to_not_convert lists them) loads without --quantization and gives transformers' greedy tokens
    and logits for the model of the weights it stands for, prompts chunked and batched with decodes."""
    from test_wna16 import _quantized_checkpoint

    folder, _ = moe_models[family]
    weights = _quantized_checkpoint(folder, tmp_path / method, method, bits, group, sym, False)
    if not_converted:
        cfg = json.loads((tmp_path / method / "config.json").read_text())
        cfg["quantization_config"]["modules_to_not_convert"] = not_converted
        (tmp_path / method / "config.json").write_text(json.dumps(cfg))
    assert any(".experts." in name for name in weights)
    hf = _dequantized_hf(folder, tmp_path / "dequantized", weights)
    engine = LLMEngine(EngineConfig(model=str(tmp_path / method), max_num_batched_tokens=40, block_size=8))
    assert engine.runner.quantization == method
    _assert_integer_moe(engine, bits)
    assert_greedy_matches_hf(engine, hf, random_prompts(4, 1, 50, seed=7), 6, LOGITS_ATOL)


def test_a_compressed_tensors_moe_checkpoint_matches_transformers_on_its_weights(moe_models, tmp_path):
    """llm-compressor's W4A16 of a MoE model (RedHatAI's *-quantized.w4a16 MoE releases: weight_packed,
    weight_scale, weight_shape per expert), as the compressed-tensors library writes it."""
    pytest.importorskip("compressed_tensors")
    from test_wna16 import _compressed_tensors_checkpoint

    folder, _ = moe_models["qwen3_moe"]
    weights = _compressed_tensors_checkpoint(folder, tmp_path / "w4a16", 4, 32, True)
    hf = _dequantized_hf(folder, tmp_path / "dequantized", weights)
    engine = LLMEngine(EngineConfig(model=str(tmp_path / "w4a16"), max_num_batched_tokens=40, block_size=8))
    assert engine.runner.quantization == "compressed-tensors"
    _assert_integer_moe(engine, 4)
    assert_greedy_matches_hf(engine, hf, random_prompts(3, 1, 50, seed=8), 6, LOGITS_ATOL)


def test_integer_moe_checkpoints_plait_cannot_serve_are_refused(moe_models, tmp_path):
    """Act-order (desc_act) experts, whose input rows each expert orders its own way, are refused by name;
    so are a missing expert tensor, a missing expert's scales and a 16-bit expert (a split across devices:
    test_tensor_parallel_int.py)."""
    from test_wna16 import _quantized_checkpoint

    folder, _ = moe_models["qwen3_moe"]
    _quantized_checkpoint(folder, tmp_path / "act-order", "gptq", 4, 32, True, True)
    with pytest.raises(ValueError, match=r"act-order \(desc_act\) MoE experts are not supported"):
        LLMEngine(EngineConfig(model=str(tmp_path / "act-order")))
    from safetensors.torch import load_file

    _quantized_checkpoint(folder, tmp_path / "gptq", "gptq", 4, 32, True, False)
    tensors = load_file(tmp_path / "gptq" / "model.safetensors")
    cfg = json.loads((tmp_path / "gptq" / "config.json").read_text())
    for gone, message in (("model.layers.1.mlp.experts.5.up_proj.qweight", r"missing 1 expert tensors"),
                          ("model.layers.2.mlp.experts.0.down_proj.scales", "without the scales")):
        broken = tmp_path / gone
        _copy_model_folder(folder, broken, {k: v for k, v in tensors.items() if k != gone})
        (broken / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match=message):
            LLMEngine(EngineConfig(model=str(broken)))
    # An expert left 16-bit among integer ones (as WNA16Linear refuses a dense layer's).
    original = load_file(folder / "model.safetensors")
    stem = "model.layers.0.mlp.experts.2.gate_proj"
    mixed = {k: v for k, v in tensors.items() if not k.startswith(f"{stem}.")}
    _copy_model_folder(folder, tmp_path / "mixed", mixed | {f"{stem}.weight": original[f"{stem}.weight"]})
    (tmp_path / "mixed" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="experts left unquantised are not supported"):
        LLMEngine(EngineConfig(model=str(tmp_path / "mixed")))
    # A router quantised too (plait keeps routers 16-bit): refused by name, not as an unknown tensor.
    router = "model.layers.0.mlp.gate"
    quantised_router = tensors | {f"{router}.qweight": tensors[f"{stem}.qweight"].clone()}
    _copy_model_folder(folder, tmp_path / "router", quantised_router)
    (tmp_path / "router" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"the checkpoint quantises {router}, which plait keeps in 16 bits"):
        LLMEngine(EngineConfig(model=str(tmp_path / "router")))


def test_random_weights_of_an_integer_moe_config(moe_models, tmp_path):
    """load_format dummy with a GPTQ MoE config.json (what GPU benchmarks run): the experts hold the round-
    to-nearest codes of the 16-bit model's random draws, one quantisation step from them at most."""
    from test_wna16 import _quantization_config

    from plait.layers.wna16 import dequantize

    folder, _ = moe_models["qwen3_moe"]
    dst = tmp_path / "gptq-config"
    dst.mkdir()
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = _quantization_config("gptq", 4, 32, True, False)
    (dst / "config.json").write_text(json.dumps(cfg))
    kw = dict(load_format="dummy", max_model_len=128)
    quantized = LLMEngine(EngineConfig(model=str(dst), **kw))
    plain = LLMEngine(EngineConfig(model=str(folder), **kw))
    _assert_integer_moe(quantized, 4)
    got = quantized.runner.model.model.layers[1].mlp.experts
    want = plain.runner.model.model.layers[1].mlp.experts.down_proj[3]  # [H, I]
    weight = dequantize(got.down_proj[3], got.down_scale[3], got.down_zeros[3], 4, torch.float32)
    assert 0 < (weight - want).abs().max() <= got.down_scale[3].float().max()
    outputs, _ = run_greedy(quantized, random_prompts(2, 3, 9, seed=1), 4)
    assert all(len(o) == 4 for o in outputs.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_gptq_moe_with_graphs_computes_the_torch_path_in_fp32(tmp_path):
    """A random GPTQ Qwen3-MoE (4-bit experts in groups of 128, every other projection a WNA16Linear), fp32:
    the Triton experts (dequantised in their K loops) under CUDA graphs and chunked mixed steps give the
    torch path's tokens (the experts dequantised, eager, whole prompts, torch_ref attention); every pure-
    decode step replays a graph."""
    from test_wna16 import _quantization_config

    model = _gpu_config(tmp_path)
    cfg = json.loads((tmp_path / "qwen3-moe" / "config.json").read_text())
    cfg["quantization_config"] = _quantization_config("gptq", 4, 128, True, False)
    (tmp_path / "qwen3-moe" / "config.json").write_text(json.dumps(cfg))
    prompts, common = _gpu_run(model, seed=2)
    ref = _torch_path_tokens(common, prompts)
    engine = LLMEngine(EngineConfig(**common, max_num_batched_tokens=64))
    _assert_integer_moe(engine, 4)
    got, _ = run_greedy(engine, prompts, 16, arrive_every=2)
    assert got == ref
    b = engine.runner.breakdown
    assert b.single_token_steps > 0 and b.graph_single_token_steps == b.single_token_steps
