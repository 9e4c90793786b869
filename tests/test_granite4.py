"""Granite 4.0 (GraniteMoeHybridForCausalLM) against transformers in fp32 on CPU: h-tiny, h-micro, micro."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY_VOCAB, assert_greedy_matches_hf, random_prompts, run_greedy
from test_moe import _copy_model_folder

from plait.config import EngineConfig, ModelConfig
from plait.engine.engine import LLMEngine
from plait.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models

LOGITS_ATOL = 1e-4
MAX_TOKENS = 8
# Random init gives tiny logits: projections are scaled up so that greedy has clear winners; not the SSM's own
# parameters (A_log, dt_bias, D), which set the decay and must stay in a sane range.
WEIGHT_SCALE = 6.0
_SSM_PARAMS = ("A_log", "dt_bias", ".D")
# Granite's four multipliers, each away from 1 (and the attention's from 1 / sqrt(head_dim)), so that a model
# that skipped one would answer differently.
MULTIPLIERS = {"embedding_multiplier": 2.0, "attention_multiplier": 0.3, "residual_multiplier": 0.5,
               "logits_scaling": 0.5}
HUB_CONFIG = Path(__file__).resolve().parents[1] / "benchmarks/configs/granite-4.0-h-tiny/config.json"
# The layer kinds as the Hub's configs name them (transformers 5 writes linear_attention / full_attention).
HUB_LAYER_NAMES = {"linear_attention": "mamba", "full_attention": "attention"}


def _mamba_groups() -> int:
    """Two Mamba groups where transformers normalises the gated output per group, as vLLM and Granite 4 do
    (transformers 5.23); transformers 5.17 (the GPU image's) normalised over all groups at once, which equals
    per-group only for one group, as every Granite 4.0 checkpoint has."""
    import inspect

    from transformers.models.granitemoehybrid import modeling_granitemoehybrid as hf

    return 2 if "group_size" in inspect.signature(hf.GraniteMoeHybridRMSNormGated.__init__).parameters else 1


def _configs() -> dict:
    from transformers import GraniteMoeHybridConfig

    # SSD chunk 16, so that prompts and step budgets cross chunk boundaries; the experts, the shared MLP and
    # the dense MLP each of its own width.
    common = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=TINY_VOCAB,
                  mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16,
                  max_position_embeddings=512, tie_word_embeddings=True, intermediate_size=32,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, **MULTIPLIERS)
    return {
        # h-tiny's shape: MoE (4 experts, 2 a token) beside the shared MLP, one attention layer of four, no
        # positions; two Mamba groups (see _mamba_groups).
        "h-tiny": GraniteMoeHybridConfig(**common, shared_intermediate_size=48, num_local_experts=4,
                                         num_experts_per_tok=2, num_hidden_layers=4,
                                         mamba_n_groups=_mamba_groups(),
                                         layer_types=["mamba", "mamba", "attention", "mamba"],
                                         position_embedding_type="nope"),
        # h-micro's: no experts, the shared MLP is the layer's MLP.
        "h-micro": GraniteMoeHybridConfig(**common, shared_intermediate_size=96, num_local_experts=0,
                                          num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
                                          position_embedding_type="nope"),
        # granite-4.0-micro's: attention only, rotary, dense.
        "micro": GraniteMoeHybridConfig(**common, shared_intermediate_size=96, num_local_experts=0,
                                        num_hidden_layers=2, layer_types=["attention", "attention"],
                                        position_embedding_type="rope",
                                        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}),
    }


VARIANTS = list(_configs())


def _save(hf, folder: Path, hub_layer_names: bool) -> None:
    hf.save_pretrained(folder)
    if hub_layer_names:  # as the Hub's config.json says them
        config = json.loads((folder / "config.json").read_text())
        config["layer_types"] = [HUB_LAYER_NAMES[t] for t in config["layer_types"]]
        (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def granite4_models(tmp_path_factory) -> dict:
    """variant -> (folder of a tiny random checkpoint saved by transformers, transformers' model of it)."""
    from transformers import AutoModelForCausalLM

    models = {}
    for i, (variant, cfg) in enumerate(_configs().items()):
        torch.manual_seed(3000 + i)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:  # ones at init: random, so that a norm weight in the wrong channel shows
                    p.normal_(1.0, 0.3)
                elif not name.endswith(_SSM_PARAMS):
                    p.mul_(WEIGHT_SCALE)
        folder = tmp_path_factory.mktemp(f"tiny-granite4-{variant}")
        _save(model, folder, hub_layer_names=variant != "h-micro")
        models[variant] = folder, _hf(folder)
    return models


def _hf(folder: Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager").eval()


def _engine(folder: Path, **kw) -> LLMEngine:
    kw.setdefault("device", "cpu")
    kw.setdefault("dtype", "float32")
    kw.setdefault("max_num_batched_tokens", 48)
    return LLMEngine(EngineConfig(model=str(folder), block_size=8, **kw))


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_and_logits_match_hf(granite4_models, variant):
    """Six prompts (up to 70 tokens) at once under a 48-token budget: prompts chunked across steps beside
    decodes."""
    folder, hf = granite4_models[variant]
    engine = _engine(folder)
    engine.record_timeline = True
    assert_greedy_matches_hf(engine, hf, random_prompts(6, 1, 70, seed=7), MAX_TOKENS, LOGITS_ATOL, variant)
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in engine.timeline), "no mixed step"
    assert max(s.num_prefill_tokens for s in engine.timeline) < 70, "no prompt was chunked"


@pytest.mark.parametrize("budget", [7, 33])
def test_chunks_across_ssd_chunk_boundaries_match_hf(granite4_models, budget):
    """Budgets that are not multiples of the SSD chunk (16), prompts arriving every other step: each Mamba
    layer's state carries over from chunk to chunk."""
    folder, hf = granite4_models["h-tiny"]
    engine = _engine(folder, max_num_batched_tokens=budget)
    prompts = random_prompts(4, 20, 60, seed=8)
    outputs, logits = run_greedy(engine, prompts, MAX_TOKENS, arrive_every=2, capture_logits=True)
    whole, whole_logits = run_greedy(_engine(folder, max_num_batched_tokens=512), prompts, MAX_TOKENS,
                                     capture_logits=True)
    assert outputs == whole
    for i in range(len(prompts)):
        torch.testing.assert_close(torch.stack(logits[i]), torch.stack(whole_logits[i]), atol=LOGITS_ATOL,
                                   rtol=0)
    assert engine.is_idle_and_clean()


def test_preempted_requests_restart_and_match_hf(granite4_models):
    """Too few KV blocks for six requests: the newest are preempted, restart from token 0 (their state slot
    freed, a fresh one zeroed) and still answer as transformers."""
    folder, hf = granite4_models["h-tiny"]
    engine = _engine(folder, max_num_batched_tokens=32, num_kv_blocks=20, max_model_len=64)
    engine.record_timeline = True
    assert_greedy_matches_hf(engine, hf, random_prompts(6, 20, 40, seed=51), 16, LOGITS_ATOL)
    assert sum(s.num_preempted for s in engine.timeline) > 0, "the test did not force a preemption"


def test_layers_caches_and_prefix_caching(granite4_models):
    """KV caches for the attention layers alone, a state slot set per Mamba layer; the H models' attention
    has no rotary, the micro model's has; the dense models' MLP is the shared MLP's width. Prefix caching is
    off where Mamba layers keep state, on for the all-attention model (and a cached prefix answers as HF)."""
    from plait.layers.moe import FusedMoE

    tiny = _engine(granite4_models["h-tiny"][0], max_num_seqs=4)
    assert len(tiny.runner.kv_caches) == 1 and len(tiny.runner.recurrent_states) == 3
    assert not tiny.kv_cache.enable_prefix_caching
    layers = tiny.runner.model.model.layers
    assert [layer.mamba is None for layer in layers] == [False, False, True, False]
    assert isinstance(layers[0].mlp.experts, FusedMoE)
    assert layers[0].mlp.shared_expert.down_proj.in_features == 48
    assert tiny.runner.model.model.rotary is None
    assert tiny.runner.model.lm_head.weight is tiny.runner.model.model.embed_tokens.weight

    dense = _engine(granite4_models["h-micro"][0])
    assert dense.runner.model.model.layers[0].mlp.down_proj.in_features == 96
    assert len(dense.runner.kv_caches) == 1 and len(dense.runner.recurrent_states) == 2

    folder, hf = granite4_models["micro"]
    micro = _engine(folder, enable_prefix_caching=True)
    assert micro.runner.recurrent_states is None and micro.state_slots is None
    assert micro.kv_cache.enable_prefix_caching and micro.runner.model.model.rotary is not None
    shared = random_prompts(1, 40, 40, seed=12)[0]
    prompts = [shared + [5, 6, 7], shared + [9, 10]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        micro.add_request(prompt, params, request_id=f"p-{i}")
        while micro.has_unfinished_requests():
            for out in micro.step():
                if out.finished:
                    with torch.no_grad():
                        want = hf.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False,
                                           eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
                    assert list(out.outputs[0].token_ids) == want
                    assert out.num_cached_tokens == (0 if i == 0 else 40)


# variant -> (prompts, shortest, longest, greedy tokens): the interpreter is slow
TRITON_RUNS = {"h-tiny": (2, 18, 26, 2), "micro": (2, 10, 14, 2)}


@pytest.mark.parametrize("variant", sorted(TRITON_RUNS))
def test_through_the_triton_kernels_matches_hf(granite4_models, monkeypatch, variant):
    """The GPU path's kernels (Triton's interpreter on CPU, fp32): the Mamba2 conv, SSD scan / step and gated
    norm kernels, the fused MoE, paged attention without rotary (h-tiny) and with the fused rotary store
    (micro); greedy tokens and logits as HF's."""
    import plait.attention.triton_backend as triton_backend
    import plait.kernels.fused_moe as fused_moe
    import plait.kernels.mamba_norm as mamba_norm
    import plait.kernels.mamba_scan as mamba_scan
    from plait.kernels import dispatch

    monkeypatch.setattr(dispatch, "_cpu_interpreter", True)
    launches = {}
    for module, name in ((mamba_scan, "ssd_varlen"), (mamba_norm, "gated_rms_norm"), (fused_moe, "fused_moe"),
                         (triton_backend, "store_kv"), (triton_backend, "rope_store_kv")):
        launches[name] = 0
        kernel = getattr(module, name)

        def counted(*args, _kernel=kernel, _name=name, **kwargs):
            launches[_name] += 1
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    folder, hf = granite4_models[variant]
    engine = _engine(folder, max_num_batched_tokens=16, attention_backend="triton")
    num, shortest, longest, max_tokens = TRITON_RUNS[variant]
    assert_greedy_matches_hf(engine, hf, random_prompts(num, shortest, longest, seed=9), max_tokens,
                             LOGITS_ATOL)
    hybrid = variant == "h-tiny"
    assert (launches["ssd_varlen"] > 0) == hybrid and (launches["gated_rms_norm"] > 0) == hybrid
    assert (launches["fused_moe"] > 0) == hybrid
    assert (launches["store_kv"] > 0) == hybrid and (launches["rope_store_kv"] > 0) == (not hybrid)


@pytest.mark.parametrize("variant", ["h-tiny", "h-micro"])
def test_transformers_5_names_load(granite4_models, tmp_path, variant):
    """save_pretrained writes the Hub's names (block_sparse_moe.input_linear / output_linear / router.layer,
    shared_mlp.input_linear / output_linear); a checkpoint written from transformers 5's state dict (stacked
    experts.gate_up_proj / down_proj, router.weight) serves the same model."""
    folder, hf = granite4_models[variant]
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # tied
    if variant == "h-tiny":
        assert any(k.endswith("block_sparse_moe.experts.gate_up_proj") for k in state)
    _copy_model_folder(folder, tmp_path / "stacked", state)
    assert_greedy_matches_hf(_engine(tmp_path / "stacked"), hf, random_prompts(3, 1, 40, seed=22), 4,
                             LOGITS_ATOL)


def test_bf16_checkpoint(granite4_models, tmp_path):
    """A bf16 checkpoint (as the Hub's are): read into fp32 it answers as transformers reads it; served in
    bf16 its first logits are near the fp32 engine's."""
    from transformers import AutoModelForCausalLM

    folder, _ = granite4_models["h-tiny"]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    _save(hf, tmp_path / "bf16", hub_layer_names=True)
    hf32 = _hf(tmp_path / "bf16")
    prompts = random_prompts(3, 10, 40, seed=31)
    assert_greedy_matches_hf(_engine(tmp_path / "bf16"), hf32, prompts, 4, LOGITS_ATOL)
    fp32, fp32_logits = run_greedy(_engine(tmp_path / "bf16"), prompts, 1, capture_logits=True)
    bf16, bf16_logits = run_greedy(_engine(tmp_path / "bf16", dtype="bfloat16"), prompts, 1,
                                   capture_logits=True)
    for i in range(len(prompts)):
        want = fp32_logits[i][0]
        torch.testing.assert_close(bf16_logits[i][0], want, atol=0.05 * want.abs().max().item(), rtol=0)


def test_hub_config_reading():
    """granite-4.0-h-tiny's config.json (benchmarks/configs): 64 experts of 512, 6 a token, the shared MLP's
    1024, Mamba and attention layers from the Hub's names, the Mamba dims and the multipliers; its dense
    twin's MLP is the shared MLP. The whole model builds (on the meta device) with those layers."""
    from plait.models.granite4 import GraniteMoeHybridForCausalLM
    from plait.models.registry import get_model_class

    raw = json.loads(HUB_CONFIG.read_text())
    cfg = ModelConfig.from_hf(raw)
    moe = cfg.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (64, 6, 512)
    assert moe.shared_intermediate_size == 1024
    assert moe.renormalize and not moe.shared_expert_gated
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.tie_word_embeddings) == (128, 4, True)
    assert get_model_class(cfg.architecture) is GraniteMoeHybridForCausalLM
    with torch.device("meta"):
        model = GraniteMoeHybridForCausalLM(cfg, max_positions=4096)
    attention = [i for i, layer in enumerate(model.model.layers) if layer.mamba is None]
    assert attention == [5, 15, 25, 35] and (model.num_kv_cache_layers, model.num_mamba_layers) == (4, 36)
    assert [model.model.layers[i].self_attn.layer_idx for i in attention] == [0, 1, 2, 3]
    assert model.model.layers[6].mamba.state_index == 5
    assert model.recurrent_state_specs()[0].ssm_shape == (48, 64, 128)
    assert model.recurrent_state_specs()[0].conv_shape == (3, 2 * 1536 + 2 * 128)
    assert model.model.rotary is None and model.model.layers[5].self_attn.scale == 0.0078125
    assert (model.model.embedding_multiplier, model.logits_scaling) == (12.0, 6.0)
    assert model.model.layers[0].residual_multiplier == 0.22

    dense = ModelConfig.from_hf(raw | {"num_local_experts": 0, "num_experts_per_tok": 0,
                                       "shared_intermediate_size": 4096})
    assert dense.moe is None and dense.intermediate_size == 4096


@pytest.mark.parametrize("multiplier", sorted(MULTIPLIERS))
def test_each_multiplier_bites(granite4_models, tmp_path, multiplier):
    """Each of Granite's multipliers changed in config.json (the weights as they are): plait's logits move
    away from the original model's, to transformers' for the changed config."""
    folder, _ = granite4_models["h-tiny"]
    changed = tmp_path / "changed"
    changed.mkdir()
    for f in folder.iterdir():
        (changed / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config[multiplier] *= 1.5
    (changed / "config.json").write_text(json.dumps(config))
    prompts = random_prompts(2, 10, 30, seed=41)
    _, before = run_greedy(_engine(folder), prompts, 1, capture_logits=True)
    _, after = run_greedy(_engine(changed), prompts, 1, capture_logits=True)
    hf = _hf(changed)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(after[i][0], want, atol=LOGITS_ATOL, rtol=0)
        assert (after[i][0] - before[i][0]).abs().max() > 100 * LOGITS_ATOL


def test_unsupported_variants_are_refused_by_name(granite4_models, tmp_path):
    """A layer kind that is neither Mamba nor attention, an unknown position embedding, attention biases (not
    in any Granite 4 checkpoint) and GPTQ / AWQ
    checkpoints (the Mamba projections have no integer path) are refused, each saying what."""
    from plait.layers.wna16 import WNA16Spec, check_method

    folder, _ = granite4_models["h-tiny"]
    config = json.loads((folder / "config.json").read_text())
    cases = {"sliding": ({"layer_types": ["mamba", "sliding_attention", "attention", "mamba"]},
                         r"Granite 4 layer kinds \['sliding_attention'\] are not supported"),
             "alibi": ({"position_embedding_type": "alibi"},
                       "position_embedding_type 'alibi' is not supported"),
             "bias": ({"attention_bias": True}, "Granite with attention_bias is not supported")}
    for name, (change, message) in cases.items():
        bad = tmp_path / name
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps(config | change))
        with pytest.raises(ValueError, match=message):
            LLMEngine(EngineConfig(model=str(bad), load_format="dummy", device="cpu", dtype="float32"))
    with pytest.raises(ValueError, match="GPTQ checkpoints of GraniteMoeHybridForCausalLM are not supported"):
        check_method(WNA16Spec("gptq", 4, 128, zero_offset=1), None, "GraniteMoeHybridForCausalLM")
