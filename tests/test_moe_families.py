"""OLMoE and Granite MoE (plain and with a shared MLP) against transformers (fp32 CPU): greedy tokens and
logits with prompts chunked beside decodes, their checkpoints' expert layouts, Granite's router against
transformers', both split across two gloo ranks (OLMoE's q/k norms across all heads too), and LoRA refused."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_VOCAB, assert_greedy_matches_hf, random_prompts
from test_moe import _copy_model_folder, saved_random_models

from plait.config import EngineConfig, ModelConfig
from plait.engine.engine import LLMEngine
from plait.layers.moe import route

LOGITS_ATOL = 1e-4
MAX_TOKENS = 8
# As test_moe's: the router's logits must separate the top_k experts clearly, or transformers and plait
# (equal up to fp32 rounding) could route a token differently.
WEIGHT_SCALE = 8.0
FAMILIES = ("olmoe", "granitemoe", "granitemoeshared")


def _configs() -> dict:
    from transformers import GraniteMoeConfig, GraniteMoeSharedConfig, OlmoeConfig

    common = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=TINY_VOCAB, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    # Granite's four multipliers, each far from 1 so that leaving one out changes the answer.
    granite = dict(embedding_multiplier=6.0, attention_multiplier=0.09, residual_multiplier=0.3,
                   logits_scaling=4.0, num_local_experts=6, num_experts_per_tok=2)
    return {
        # Softmax top-k weights left as they are (norm_topk_prob false, as OLMoE's checkpoints), q, k (after
        # their norms across heads) and v clipped low enough that the clip bites, and one KV head (which
        # two ranks both hold: its norm's squares summed over them count it twice).
        "olmoe": OlmoeConfig(**(common | {"num_key_value_heads": 1}), num_experts=8, num_experts_per_tok=3,
                             norm_topk_prob=False, clip_qkv=1.5),
        "granitemoe": GraniteMoeConfig(**common, **granite, tie_word_embeddings=True),
        "granitemoeshared": GraniteMoeSharedConfig(**common, **granite, shared_intermediate_size=48),
    }


@pytest.fixture(scope="module")
def family_models(tmp_path_factory) -> dict[str, tuple]:
    """family -> (folder of a random tiny model as save_pretrained writes it, the transformers model)."""
    return saved_random_models(tmp_path_factory, _configs(), 3000, WEIGHT_SCALE, attn_implementation="eager")


def _engine(folder, **knobs) -> LLMEngine:
    # A step budget below the longer prompts: rows mix prompt chunks and decodes in one step.
    base = dict(model=str(folder), max_num_batched_tokens=40, block_size=8)
    return LLMEngine(EngineConfig(**(base | knobs)))


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_and_logits_match_transformers(family_models, family):
    folder, hf = family_models[family]
    assert_greedy_matches_hf(_engine(folder), hf, random_prompts(5, 1, 60, seed=21), MAX_TOKENS, LOGITS_ATOL,
                             family)


def test_configs_read_each_family(family_models):
    read = {f: ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
            for f, (folder, _) in family_models.items()}
    olmoe = read["olmoe"].moe
    assert (olmoe.num_experts, olmoe.top_k, olmoe.intermediate_size) == (8, 3, 32) and not olmoe.renormalize
    assert read["olmoe"].raw["clip_qkv"] == 1.5
    granite = read["granitemoe"].moe
    assert granite.renormalize and granite.intermediate_size == 32 and granite.shared_intermediate_size == 0
    shared = read["granitemoeshared"].moe
    assert shared.shared_intermediate_size == 48 and not shared.shared_expert_gated


def test_olmoe_clip_bites(family_models):
    """The tiny OLMoE's clip_qkv changes its answers (so the parity above covers where plait clips)."""
    from transformers import AutoModelForCausalLM

    folder, hf = family_models["olmoe"]
    unclipped = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, clip_qkv=None).eval()
    ids = torch.tensor([random_prompts(1, 30, 30, seed=4)[0]])
    with torch.no_grad():
        assert (hf(ids).logits - unclipped(ids).logits).abs().max() > 1e-2


def test_granite_router_is_route_renormalised():
    """transformers' Granite MoE router (top-k of the logits, then a softmax over those alone) picks the
    experts route(renormalize=True) picks (softmax over all, top-k, renormalised), in the same order, with
    the same weights up to fp32 rounding."""
    from transformers import GraniteMoeConfig
    from transformers.models.granitemoe.modeling_granitemoe import GraniteMoeTopKRouter

    cfg = GraniteMoeConfig(hidden_size=32, num_local_experts=40, num_experts_per_tok=8)
    router = GraniteMoeTopKRouter(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        x = torch.randn(257, 32, generator=g)
        outputs = router(x)
    # transformers 5.23 returns (logits, weights, ids); 5.17 (the GPU image's) another order.
    want_ids = next(t for t in outputs if not t.is_floating_point())
    logits, want_weights = sorted((t for t in outputs if t.is_floating_point()), key=lambda t: -t.shape[-1])
    weights, ids = route(logits, 8, renormalize=True)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("family,stacked", [("olmoe", "mlp.experts.gate_up_proj"),
                                            ("granitemoeshared", "block_sparse_moe.experts.gate_up_proj")])
def test_transformers_5_names_load(family_models, tmp_path, family, stacked):
    """save_pretrained writes the Hub's names (OLMoE's per-expert gate_proj / up_proj / down_proj, Granite's
    block_sparse_moe.input_linear / output_linear / router.layer, loaded above); a checkpoint written from
    transformers 5's state dict (stacked experts.gate_up_proj / down_proj, Granite's router.weight) serves
    the same model."""
    folder, hf = family_models[family]
    state = {k: v for k, v in hf.state_dict().items()
             if not (k == "lm_head.weight" and hf.config.tie_word_embeddings)}
    assert any(k.endswith(stacked) for k in state)
    _copy_model_folder(folder, tmp_path / "stacked", state)
    assert_greedy_matches_hf(_engine(tmp_path / "stacked"), hf, random_prompts(3, 1, 50, seed=22), 4,
                             LOGITS_ATOL)


def test_granite_moe_shared_splits_over_two_ranks(family_models):
    """Granite MoE shared over two gloo ranks: heads, the shared MLP's width and every expert's width, the
    router replicated: transformers' answers."""
    folder, hf = family_models["granitemoeshared"]
    engine = _engine(folder, tensor_parallel_size=2)
    try:
        assert_greedy_matches_hf(engine, hf, random_prompts(3, 1, 50, seed=24), MAX_TOKENS, LOGITS_ATOL)
    finally:
        engine.shutdown()


def test_olmoe_splits_over_two_ranks_holding_whole_experts(family_models):
    """OLMoE over two gloo ranks under expert parallelism: each rank half the query heads and the one KV
    head, q and k normalised across all heads with every rank's squares (Attention.qk_norm_group), four
    experts whole a rank: transformers' answers."""
    folder, hf = family_models["olmoe"]
    engine = _engine(folder, tensor_parallel_size=2, enable_expert_parallel=True)
    try:
        assert_greedy_matches_hf(engine, hf, random_prompts(3, 1, 50, seed=25), MAX_TOKENS, LOGITS_ATOL)
    finally:
        engine.shutdown()


def test_lora_is_refused(family_models):
    """LoRA adapters would need per-expert deltas inside the expert kernels (as for the other MoE models)."""
    for family in FAMILIES:
        with pytest.raises(ValueError, match="LoRA is not supported"):
            LLMEngine(EngineConfig(model=str(family_models[family][0]), enable_lora=True))


@pytest.mark.parametrize("family", ["granitemoe", "granitemoeshared"])
def test_granite_moe_integer_checkpoints_are_refused_by_name(family_models, tmp_path, family):
    """A GPTQ Granite MoE checkpoint stacks its experts' integer codes in input_linear / output_linear, which
    no integer layout plait reads holds: refused by name, before any tensor is read (it once failed with a
    tensor that "has no place")."""
    import json
    import shutil

    folder = tmp_path / family
    shutil.copytree(family_models[family][0], folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
                                     "sym": True}
    (folder / "config.json").write_text(json.dumps(config))
    architecture = config["architectures"][0]
    with pytest.raises(ValueError, match=f"GPTQ checkpoints of {architecture} are not supported"):
        LLMEngine(EngineConfig(model=str(folder)))
