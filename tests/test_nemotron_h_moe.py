"""NemotronH with MoE layers (Nemotron 3 Nano's; Nemotron 3 Super's latent MoE) against transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY_VOCAB, assert_greedy_matches_hf, hf_greedy_reference, random_prompts, run_greedy
from test_moe import _copy_model_folder

from plait.config import EngineConfig, ModelConfig
from plait.engine.engine import LLMEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models

LOGITS_ATOL = 1e-4
MAX_TOKENS = 8
# Random init gives tiny logits: projections are scaled up so that greedy has clear winners; not the SSM's own
# parameters (A_log, dt_bias, D), which set the decay and must stay in a sane range.
WEIGHT_SCALE = 6.0
_SSM_PARAMS = ("A_log", "dt_bias", ".D")
# transformers initialises e_score_correction_bias to zeros: random ones, of the sigmoid scores' spread, so
# that a router that chose on unbiased scores (or weighted by biased ones) picks or weighs other experts.
CORRECTION_BIAS_STD = 0.2
# SSD chunks of 16 tokens: prompts (up to 70) and the 48-token budget cross their boundaries.
CHUNK = 16


def _configs() -> dict:
    from transformers import NemotronHConfig

    # Every layer kind: Mamba (M), MoE (E), attention (*), MLP (-). Eight experts in two groups (one kept a
    # token), two a token, each of its own width beside the shared expert's and the MLP's; a dt floor that
    # never binds (transformers floors its scan's dt, not its decode step's).
    common = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, vocab_size=TINY_VOCAB, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16,
                  n_groups=2, chunk_size=CHUNK, time_step_min=1e-9, max_position_embeddings=512,
                  n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                  norm_topk_prob=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return {
        # Nemotron 3 Nano's shape: the experts in the hidden width.
        "nano": NemotronHConfig(**common, hybrid_override_pattern="ME*E-M"),
        # Nemotron 3 Super's latent MoE: the experts in a 24-wide latent (not a multiple of the kernels'
        # K tiles); biases on the latent projections, the shared expert and the MLP (mlp_bias).
        "latent": NemotronHConfig(**common, hybrid_override_pattern="MEM*E-", moe_latent_size=24,
                                  mlp_bias=True),
    }


VARIANTS = list(_configs())


def randomized(model: torch.nn.Module) -> torch.nn.Module:
    """Weights scaled up (WEIGHT_SCALE), norms' weights and biases random (so that a misplaced one shows),
    the routers' correction biases random (CORRECTION_BIAS_STD)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)
            elif not name.endswith(_SSM_PARAMS):
                p.mul_(WEIGHT_SCALE)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, CORRECTION_BIAS_STD)
    return model


def save_random_nemotron_h(cfg, folder: Path, seed: int):
    """A tiny random NemotronH checkpoint in ``folder`` (save_pretrained: the Hub's per-expert names) and
    transformers' fp32 model of it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    randomized(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)).save_pretrained(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    return hf.eval()


@pytest.fixture(scope="module")
def nemotron_moe_models(tmp_path_factory) -> dict:
    """variant -> (folder of a tiny random checkpoint, transformers' model of it)."""
    models = {}
    for i, (variant, cfg) in enumerate(_configs().items()):
        folder = tmp_path_factory.mktemp(f"tiny-nemotron-h-{variant}")
        models[variant] = folder, save_random_nemotron_h(cfg, folder, 5000 + i)
    return models


def _engine(folder: Path, **kw) -> LLMEngine:
    kw.setdefault("device", "cpu")
    kw.setdefault("dtype", "float32")
    kw.setdefault("max_num_batched_tokens", 48)
    return LLMEngine(EngineConfig(model=str(folder), block_size=8, **kw))


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_and_logits_match_hf(nemotron_moe_models, variant):
    """Six prompts (up to 70 tokens) at once under a 48-token budget: prompts chunked across steps beside
    decodes, across SSD chunk boundaries."""
    folder, hf = nemotron_moe_models[variant]
    engine = _engine(folder)
    engine.record_timeline = True
    assert_greedy_matches_hf(engine, hf, random_prompts(6, 1, 70, seed=7), MAX_TOKENS, LOGITS_ATOL, variant)
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in engine.timeline), "no mixed step"
    assert max(s.num_prefill_tokens for s in engine.timeline) < 70, "no prompt was chunked"


def test_preempted_requests_restart_and_match_hf(nemotron_moe_models):
    """Too few KV blocks for six requests: the newest are preempted, restart from token 0 (a fresh state
    slot) and still answer as transformers."""
    folder, hf = nemotron_moe_models["nano"]
    engine = _engine(folder, max_num_batched_tokens=32, num_kv_blocks=20, max_model_len=64)
    engine.record_timeline = True
    assert_greedy_matches_hf(engine, hf, random_prompts(6, 20, 40, seed=51), 16, LOGITS_ATOL)
    assert sum(s.num_preempted for s in engine.timeline) > 0, "the test did not force a preemption"


def test_layers_and_caches(nemotron_moe_models):
    """Each layer kind where the pattern puts it: KV caches for attention alone, state slots for Mamba alone;
    the MoE blocks' experts ungated (relu2_no_mul: their up rows alone), in the latent width where there is
    one; prefix caching off (Mamba state)."""
    from plait.layers.moe import RELU2_NO_MUL, FusedMoE
    from plait.models.nemotron_h import NemotronHMoE

    nano = _engine(nemotron_moe_models["nano"][0], max_num_seqs=4)
    layers = nano.runner.model.model.layers
    assert [layer.kind for layer in layers] == ["linear_attention", "moe", "full_attention", "moe", "mlp",
                                                "linear_attention"]
    assert len(nano.runner.kv_caches) == 1 and len(nano.runner.recurrent_states) == 2
    assert not nano.kv_cache.enable_prefix_caching
    moe = layers[1].mixer
    assert isinstance(moe, NemotronHMoE) and isinstance(moe.experts, FusedMoE)
    assert moe.experts.activation == RELU2_NO_MUL and moe.experts.gate_up_proj.shape == (8, 32, 64)
    assert moe.fc1_latent_proj is None and moe.shared_experts.down_proj.in_features == 48
    latent = _engine(nemotron_moe_models["latent"][0]).runner.model.model.layers[1].mixer
    assert latent.experts.gate_up_proj.shape == (8, 32, 24) and latent.experts.down_proj.shape == (8, 24, 32)
    assert latent.fc2_latent_proj.bias is not None


@pytest.mark.parametrize("variant", VARIANTS)
def test_transformers_5_stacked_names_load(nemotron_moe_models, tmp_path, variant):
    """save_pretrained writes the Hub's per-expert names (backbone.layers.N.mixer.experts.E.up_proj.weight);
    a checkpoint of transformers 5's state dict (model.layers.N.mixer.experts.up_proj [E, I, in], stacked)
    serves the same model."""
    folder, hf = nemotron_moe_models[variant]
    state = hf.state_dict()
    assert any(k.endswith("mixer.experts.up_proj") for k in state)
    _copy_model_folder(folder, tmp_path / "stacked", state)
    assert_greedy_matches_hf(_engine(tmp_path / "stacked"), hf, random_prompts(3, 1, 40, seed=22), 4,
                             LOGITS_ATOL)


def test_bf16_checkpoint(nemotron_moe_models, tmp_path):
    """A bf16 checkpoint (as the Hub's are; the routers' correction biases kept fp32, as transformers keeps
    them): read into fp32 it answers as transformers reads it; served in bf16 its first logits are near the
    fp32 engine's."""
    from transformers import AutoModelForCausalLM

    folder, _ = nemotron_moe_models["latent"]
    AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    hf32 = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32,
                                                attn_implementation="eager").eval()
    prompts = random_prompts(3, 10, 40, seed=31)
    assert_greedy_matches_hf(_engine(tmp_path / "bf16"), hf32, prompts, 4, LOGITS_ATOL)
    _, fp32_logits = run_greedy(_engine(tmp_path / "bf16"), prompts, 1, capture_logits=True)
    bf16 = _engine(tmp_path / "bf16", dtype="bfloat16")
    router = bf16.runner.model.model.layers[1].mixer.gate
    assert router.weight.dtype == router.e_score_correction_bias.dtype == torch.float32
    _, bf16_logits = run_greedy(bf16, prompts, 1, capture_logits=True)
    for i in range(len(prompts)):
        want = fp32_logits[i][0]
        torch.testing.assert_close(bf16_logits[i][0], want, atol=0.05 * want.abs().max().item(), rtol=0)


# variant -> (prompts, shortest, longest, greedy tokens): the interpreter is slow
TRITON_RUNS = {"nano": (2, 12, 20, 2), "latent": (2, 6, 12, 2)}


@pytest.mark.parametrize("variant", VARIANTS)
def test_through_the_triton_kernels_matches_hf(nemotron_moe_models, monkeypatch, variant):
    """The GPU path's kernels (Triton's interpreter on CPU, fp32): the Mamba2 kernels, paged attention, the
    noaux_tc router in one kernel and the fused MoE with relu2_no_mul experts (its GEMV path: 16-token
    steps; tests/test_fused_moe.py runs the grouped GEMMs too); greedy tokens and logits as HF's."""
    import plait.kernels.fused_moe as fused_moe
    from plait.kernels import dispatch

    monkeypatch.setattr(dispatch, "_cpu_interpreter", True)
    activations = []
    kernel = fused_moe.fused_moe

    def counted(*args, **kwargs):
        activations.append(kwargs.get("activation"))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(fused_moe, "fused_moe", counted)
    folder, hf = nemotron_moe_models[variant]
    engine = _engine(folder, max_num_batched_tokens=16, attention_backend="triton")
    num, shortest, longest, max_tokens = TRITON_RUNS[variant]
    assert_greedy_matches_hf(engine, hf, random_prompts(num, shortest, longest, seed=9), max_tokens,
                             LOGITS_ATOL)
    assert activations and set(activations) == {fused_moe.RELU2_NO_MUL}


def test_moe_config_reading():
    """The MoE numbers from NemotronHConfig's names; a config without MoE layers has none (transformers
    writes n_routed_experts into every NemotronH config.json)."""
    cfg = _configs()["latent"]
    raw = cfg.to_dict() | {"architectures": ["NemotronHForCausalLM"]}
    moe = ModelConfig.from_hf(raw).moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.shared_intermediate_size) == (8, 2, 32, 48)
    assert (moe.router, moe.n_group, moe.topk_group, moe.routed_scaling_factor) == ("noaux_tc", 2, 1, 2.5)
    assert moe.renormalize and not moe.shared_expert_gated
    assert ModelConfig.from_hf(raw | {"layers_block_type": ["linear_attention", "mlp"]}).moe is None
    pattern = {k: v for k, v in raw.items() if k != "layers_block_type"} | {"hybrid_override_pattern": "ME"}
    assert ModelConfig.from_hf(pattern).moe.num_experts == 8


def test_refused_variants_say_what(nemotron_moe_models, tmp_path):
    """FP8 experts with relu^2 (--quantization fp8), an unknown layer kind and per-layer MLP widths (vLLM's
    heterogeneous NemotronH configs; transformers has none) are refused by name."""
    folder, _ = nemotron_moe_models["nano"]
    with pytest.raises(ValueError, match="relu2_no_mul"):
        _engine(folder, quantization="fp8", load_format="dummy")
    config = json.loads((folder / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(config | {"layers_block_type": ["linear_attention", "conv"]}))
    with pytest.raises(ValueError, match=r"NemotronH layer kinds \['conv'\] are not supported"):
        _engine(bad, load_format="dummy")
    (bad / "config.json").write_text(json.dumps(config | {"intermediate_size": [96, 64]}))
    with pytest.raises(ValueError, match="NemotronH with per-layer intermediate sizes is not supported"):
        _engine(bad, load_format="dummy")


@pytest.mark.parametrize("variant, expert_parallel", [("latent", False), ("nano", True)])
def test_two_ranks_match_hf(nemotron_moe_models, variant, expert_parallel):
    """Two gloo ranks, prompts chunked beside decodes: each rank holds half of every Mamba mixer's heads and
    of the shared expert's width, and half of every routed expert's width or (expert-parallel) four whole
    experts; the latent projections whole on both (fc2_latent_proj's bias the driver's); transformers'
    greedy tokens, its logits within 1e-4."""
    folder, hf = nemotron_moe_models[variant]
    engine = _engine(folder, tensor_parallel_size=2, enable_expert_parallel=expert_parallel)
    try:
        moe = engine.runner.model.model.layers[1].mixer
        assert moe.shared_experts.down_proj.in_features == 24
        if expert_parallel:
            assert moe.experts.local_experts.count == 4 and moe.experts.gate_up_proj.shape[:2] == (4, 32)
        else:
            assert moe.experts.local_experts is None and moe.experts.gate_up_proj.shape[:2] == (8, 16)
        engine.record_timeline = True
        assert_greedy_matches_hf(engine, hf, random_prompts(4, 1, 60, seed=7), 4, LOGITS_ATOL)
        assert any(s.num_prefill_tokens and s.num_decode_tokens for s in engine.timeline), "no mixed step"
    finally:
        engine.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", VARIANTS)
def test_gpu_engine_matches_hf(nemotron_moe_models, variant):
    """fp32 on CUDA: the compiled ungated expert kernels, the Mamba kernels and Triton attention in mixed,
    chunked steps with CUDA graphs for pure decodes, against transformers on the CPU."""
    folder, hf = nemotron_moe_models[variant]
    # A fixed KV pool: sized from free memory, it would take 90% of the GPU.
    engine = _engine(folder, device="cuda", num_kv_blocks=256)
    engine.record_timeline = True
    prompts = random_prompts(6, 1, 70, seed=7)
    outputs, logits = run_greedy(engine, prompts, MAX_TOKENS, capture_logits=True)
    for i, prompt in enumerate(prompts):
        ref_ids, ref_logits = hf_greedy_reference(hf, prompt, outputs[i], MAX_TOKENS)
        assert outputs[i] == ref_ids, f"{variant} prompt {i}: GPU tokens differ from transformers"
        # 1e-3, as the Mamba-hybrid GPU test: the kernels' and cuBLAS's order of summation in fp32.
        torch.testing.assert_close(torch.stack(logits[i]).cpu(), ref_logits, atol=1e-3, rtol=0)
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in engine.timeline), "no mixed step"
    assert any(s.used_cuda_graph for s in engine.timeline), "no pure-decode step replayed a graph"
    assert engine.is_idle_and_clean()
