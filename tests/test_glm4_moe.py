"""GLM-4.5 / GLM-4.6 (Glm4MoeForCausalLM) against transformers (fp32 CPU): noaux_tc routing (sigmoid scores,
a correction bias that moves the choice, groups, renormalised and scaled weights), ungated shared experts, a
dense first layer, a rotary over half of each head, q/k/v biases, q/k norms on and off; MTP layers skipped at
load; over two gloo ranks, experts split by width or held whole."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_VOCAB, assert_engines_agree, assert_greedy_matches_hf, random_prompts

from plait.config import NOAUX_TC_ROUTER, EngineConfig, ModelConfig
from plait.engine.engine import LLMEngine
from plait.layers.moe import NoAuxTcRouter, route_noaux_tc

LOGITS_ATOL = 1e-4
MAX_TOKENS = 8
WEIGHT_SCALE = 8.0  # as test_moe: clear argmax winners
# The routers' weights and biases, drawn apart from the scale-up: sigmoid scores spread over (0, 1) (logits of
# std ~2, not saturated at 1.0) and biases large enough to change which experts win.
ROUTER_STD = 0.25
BIAS_STD = 0.3


def _config(use_qk_norm: bool):
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=TINY_VOCAB,
        max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=None,
        n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=2,
        first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5, attention_bias=True,
        use_qk_norm=use_qk_norm, partial_rotary_factor=0.5, num_nextn_predict_layers=1,
        tie_word_embeddings=False)


def _mtp_tensors(state: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """A stand-in for GLM-4.5's MTP layer (model.layers.{num_hidden_layers}.*): the last layer's tensors under
    its number, and the MTP head's own (eh_proj, enorm, hnorm, shared_head)."""
    last, mtp = f"model.layers.{cfg.num_hidden_layers - 1}.", f"model.layers.{cfg.num_hidden_layers}."
    out = {mtp + k[len(last):]: v.clone() for k, v in state.items() if k.startswith(last)}
    h = cfg.hidden_size
    out.update({f"{mtp}eh_proj.weight": torch.randn(h, 2 * h), f"{mtp}enorm.weight": torch.ones(h),
                f"{mtp}hnorm.weight": torch.ones(h), f"{mtp}shared_head.norm.weight": torch.ones(h)})
    return out


@pytest.fixture(scope="module")
def glm4_moe_models(tmp_path_factory) -> dict[str, tuple]:
    """variant -> (folder of a tiny random checkpoint with an MTP layer beside, transformers' model)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    models = {}
    for i, (variant, qk_norm) in enumerate((("qk_norm", True), ("no_qk_norm", False))):
        torch.manual_seed(3000 + i)
        cfg = _config(qk_norm)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.normal_(0.0, ROUTER_STD)
                elif "norm" not in name:
                    p.mul_(WEIGHT_SCALE)
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.normal_(0.0, BIAS_STD)
        folder = tmp_path_factory.mktemp(f"tiny-glm4-moe-{variant}")
        model.save_pretrained(folder)
        path = folder / "model.safetensors"
        tensors = load_file(path)
        assert any(k.endswith("mlp.gate.e_score_correction_bias") for k in tensors)
        save_file(tensors | _mtp_tensors(tensors, cfg), path, metadata={"format": "pt"})
        models[variant] = (folder, model)
    return models


def test_config_reads_glm4_moe(glm4_moe_models):
    folder, _ = glm4_moe_models["qk_norm"]
    cfg = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    moe = cfg.moe
    assert cfg.architecture == "Glm4MoeForCausalLM" and cfg.qk_norm and cfg.attention_bias
    assert cfg.partial_rotary_factor == 0.5 and cfg.intermediate_size == 96
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (8, 3, 32)
    assert moe.router == NOAUX_TC_ROUTER and (moe.n_group, moe.topk_group) == (4, 2)
    assert moe.renormalize and moe.routed_scaling_factor == 2.5
    assert moe.shared_intermediate_size == 64 and moe.dense_layers == (0,)
    folder, _ = glm4_moe_models["no_qk_norm"]
    assert not ModelConfig.from_hf(json.loads((folder / "config.json").read_text())).qk_norm


@pytest.mark.parametrize("variant", ["qk_norm", "no_qk_norm"])
def test_glm4_moe_logits_and_greedy_match_hf(glm4_moe_models, variant):
    """Prompts chunked (a 40-token budget) and batched with decodes; the checkpoint's MTP layer skipped."""
    folder, hf = glm4_moe_models[variant]
    engine = LLMEngine(EngineConfig(model=str(folder), max_num_batched_tokens=40, block_size=8))
    model = engine.runner.model
    assert len(model.model.layers) == 3
    router = model.model.layers[1].mlp.gate
    assert isinstance(router, NoAuxTcRouter) and router.e_score_correction_bias.dtype == torch.float32
    want = hf.model.layers[1].mlp.gate.e_score_correction_bias
    assert torch.equal(router.e_score_correction_bias, want) and want.abs().min() > 0
    assert_greedy_matches_hf(engine, hf, random_prompts(5, 1, 60, seed=21), MAX_TOKENS, LOGITS_ATOL, variant)


def test_the_correction_bias_changes_the_model(glm4_moe_models):
    """The tiny models' biases move expert choices: transformers' logits without them are not the same."""
    _, hf = glm4_moe_models["qk_norm"]
    ids = torch.tensor([random_prompts(1, 40, 40, seed=4)[0]])
    biases = [m.gate.e_score_correction_bias for m in (layer.mlp for layer in hf.model.layers)
              if hasattr(m, "gate")]
    with torch.no_grad():
        want = hf(ids).logits
        kept = [b.clone() for b in biases]
        for b in biases:
            b.zero_()
        try:
            unbiased = hf(ids).logits
        finally:
            for b, k in zip(biases, kept, strict=True):
                b.copy_(k)
    assert (want - unbiased).abs().max() > 1.0


def _hf_router(num_experts: int, top_k: int, n_group: int, topk_group: int, norm: bool, scale: float):
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    cfg = Glm4MoeConfig(hidden_size=16, n_routed_experts=num_experts, num_experts_per_tok=top_k,
                        n_group=n_group, topk_group=topk_group, norm_topk_prob=norm,
                        routed_scaling_factor=scale)
    return Glm4MoeTopkRouter(cfg)


@pytest.mark.parametrize("num_experts,top_k,n_group,topk_group,norm,scale", [
    (16, 4, 4, 2, True, 2.5), (8, 3, 4, 2, False, 1.0), (12, 2, 1, 1, True, 1.0), (32, 8, 8, 3, True, 1.5)])
def test_route_noaux_tc_is_transformers_router(num_experts, top_k, n_group, topk_group, norm, scale):
    """Random router logits through NoAuxTcRouter and transformers' Glm4MoeTopkRouter on the same weights,
    with exact ties (the last two experts copies of the first two, bias too, in other groups: tied experts
    and tied groups): the same experts in the same order, the same weights to the bit."""
    g = torch.Generator().manual_seed(num_experts + top_k)
    hf = _hf_router(num_experts, top_k, n_group, topk_group, norm, scale)
    ours = NoAuxTcRouter(16, num_experts, top_k, norm, n_group, topk_group, scale)
    weight, bias = torch.randn(num_experts, 16, generator=g), torch.randn(num_experts, generator=g) * 0.3
    weight[-2:], bias[-2:] = weight[:2], bias[:2]
    with torch.no_grad():
        for router in (hf, ours):
            router.weight.copy_(weight)
            router.e_score_correction_bias.copy_(bias)
    x = torch.randn(64, 16, generator=g)
    x[:4] *= 100.0  # saturated sigmoids: scores exactly 1.0 or 0.0
    with torch.no_grad():
        _, want_weights, want_ids = hf(x)
        weights, ids = ours(x)
    assert torch.isin(want_ids, torch.tensor([0, 1, num_experts - 2, num_experts - 1])).any()  # ties met
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)
    assert weights.dtype == torch.float32


def test_route_noaux_tc_bias_chooses_but_does_not_weigh():
    """The bias alone can move the choice; the weights stay the unbiased sigmoid scores, renormalised and
    scaled; the groups bound the choice."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    scores = logits.sigmoid()[0]
    none = torch.zeros(4)
    weights, ids = route_noaux_tc(logits, 1, False, none, 1, 1, 1.0)
    assert ids.tolist() == [[0]] and torch.equal(weights[0], scores[[0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 2.0])
    weights, ids = route_noaux_tc(logits, 1, False, bias, 1, 1, 3.0)
    assert ids.tolist() == [[3]] and torch.equal(weights[0], scores[[3]] * 3.0)
    # Two groups {0, 1} {2, 3}, one kept: group 0's biased pair sum (1.61) beats group 1's (0.77).
    weights, ids = route_noaux_tc(logits, 2, True, none, 2, 1, 1.0)
    assert sorted(ids[0].tolist()) == [0, 1]
    torch.testing.assert_close(weights.sum(), torch.tensor(1.0))
    with pytest.raises(ValueError, match="groups of at least 2"):
        NoAuxTcRouter(8, 6, 2, True, 4 * 2, 1, 1.0)
    with pytest.raises(ValueError, match="cannot hold"):
        NoAuxTcRouter(8, 8, 5, True, 4, 2, 1.0)


def test_router_stays_fp32_in_a_16_bit_model():
    """model.to(bf16) leaves the router's weight and correction bias fp32 (their values too)."""
    router = NoAuxTcRouter(16, 8, 2, True, 4, 2, 1.0)
    with torch.no_grad():
        router.e_score_correction_bias.copy_(torch.linspace(0, 1e-3, 8) + 1.0)
    want = router.e_score_correction_bias.clone()
    router.to(torch.bfloat16)
    assert router.weight.dtype == torch.float32 and torch.equal(router.e_score_correction_bias, want)
    weights, _ = router(torch.randn(3, 16, dtype=torch.bfloat16))
    assert weights.dtype == torch.float32


def test_through_the_triton_kernels_matches_hf(glm4_moe_models, monkeypatch):
    """The GPU path's kernels (Triton's interpreter on CPU, fp32): the noaux_tc routing in one kernel
    (moe_route_noaux_tc: int32 ids, scaled weights) handed to the fused MoE kernels, q/k norms before a
    half-head rotary; greedy tokens and logits as HF's."""
    from plait.kernels import dispatch, fused_moe

    monkeypatch.setattr(dispatch, "_cpu_interpreter", True)
    calls = []
    experts = fused_moe.fused_moe

    def counted(x, w13, w2, weights, ids, *args, **kwargs):
        calls.append(ids.dtype)
        return experts(x, w13, w2, weights, ids, *args, **kwargs)

    monkeypatch.setattr(fused_moe, "fused_moe", counted)
    monkeypatch.setattr(fused_moe, "GEMV_MAX_ENTRIES", 4)  # decode steps' GEMV; prompt chunks' grouped GEMMs
    folder, hf = glm4_moe_models["qk_norm"]
    engine = LLMEngine(EngineConfig(model=str(folder), max_num_batched_tokens=32, block_size=8,
                                    attention_backend="triton"))
    calls.clear()
    assert_greedy_matches_hf(engine, hf, random_prompts(2, 5, 20, seed=22), 3, LOGITS_ATOL)
    assert set(calls) == {torch.int32}  # the router kernel's ids


def test_lora_is_refused(glm4_moe_models):
    folder, _ = glm4_moe_models["no_qk_norm"]
    with pytest.raises(ValueError, match="LoRA is not supported"):
        LLMEngine(EngineConfig(model=str(folder), enable_lora=True))


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["width", "whole-experts"])
def test_two_ranks_match_hf(glm4_moe_models, expert_parallel):
    """Over two gloo ranks: heads, the dense layer's and the shared experts' widths split, every routed
    expert's width split (or, under expert parallelism, half the experts whole on each rank), the router and
    its correction bias replicated, the block's routed and shared sums added up once; the MTP layer skipped
    before any rank slices it. Transformers' tokens and logits."""
    folder, hf = glm4_moe_models["qk_norm"]
    engine = LLMEngine(EngineConfig(model=str(folder), max_num_batched_tokens=48, block_size=8,
                                    tensor_parallel_size=2, enable_expert_parallel=expert_parallel))
    try:
        block = engine.runner.model.model.layers[1].mlp
        assert block.shared_experts.down_proj.weight.shape == (64, 32)  # 2 x 32 shared columns, half each
        assert block.experts.num_experts == (4 if expert_parallel else 8)
        assert block.experts.intermediate_size == (32 if expert_parallel else 16)
        assert block.gate.weight.shape == (8, 64)
        assert_greedy_matches_hf(engine, hf, random_prompts(3, 1, 40, seed=23), 6, LOGITS_ATOL)
    finally:
        engine.shutdown()


def test_a_block_fp8_checkpoint_is_the_model_with_its_tiles(glm4_moe_models, tmp_path):
    """GLM-4.5-Air-FP8's kind of checkpoint (block-wise FP8, routers left unquantised): the routed experts'
    codes and tile scales, the shared experts', dense MLP's and attention's as block-FP8 layers, the router
    and its bias fp32; the whole model computes the block-FP8 function (test_moe's reference)."""
    from test_moe import BLOCK, fp8_moe_checkpoint, fp8_reference

    from plait.layers.fp8_block import Fp8BlockLinear
    from plait.layers.moe import FusedMoE

    folder, _ = glm4_moe_models["no_qk_norm"]
    fp8_moe_checkpoint(folder, tmp_path / "fp8")
    kw = dict(max_num_batched_tokens=40, block_size=8, max_model_len=128)
    served = LLMEngine(EngineConfig(model=str(tmp_path / "fp8"), **kw))
    block = served.runner.model.model.layers[1].mlp
    assert isinstance(block.experts, FusedMoE) and block.experts.block == BLOCK
    assert isinstance(block.shared_experts.gate_up_proj, Fp8BlockLinear)
    assert block.gate.weight.dtype == block.gate.e_score_correction_bias.dtype == torch.float32
    reference = LLMEngine(EngineConfig(model=str(folder), **kw))
    fp8_reference(reference)
    assert_engines_agree(served, reference, random_prompts(2, 3, 40, seed=24), max_tokens=4, atol=1e-5)
