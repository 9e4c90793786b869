"""Mamba2 hybrids over two gloo ranks (heads split, groups split or replicated) answer as transformers."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB, assert_greedy_matches_hf, random_prompts

from plait.config import EngineConfig, ModelConfig
from plait.engine.engine import LLMEngine
from plait.parallel.shard import MAMBA2_DIMS, shard_for

LOGITS_ATOL = 1e-4
MAX_TOKENS = 8
# Random init gives tiny logits: projections are scaled up so greedy has clear winners; not the SSM's own
# parameters (A_log, dt_bias, D), which set the decay and must stay in a sane range.
WEIGHT_SCALE = 4.0
_SSM_PARAMS = ("A_log", "dt_bias", ".D")
# SSD chunks of 16 tokens: prompts (up to 70) and the 48-token budget cross their boundaries.
CHUNK = 16
# Each norm's weight random around 1, so that a rank holding another rank's channels of one answers otherwise.
NORM_SPREAD = 0.3


def _configs() -> dict:
    from transformers import BambaConfig, GraniteMoeHybridConfig, Mamba2Config, NemotronHConfig

    mamba = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=CHUNK)
    granite = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=TINY_VOCAB,
                   max_position_embeddings=512, tie_word_embeddings=True, intermediate_size=32,
                   shared_intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                   num_hidden_layers=4, layer_types=["mamba", "mamba", "attention", "mamba"],
                   position_embedding_type="nope", embedding_multiplier=2.0, attention_multiplier=0.3,
                   residual_multiplier=0.5, logits_scaling=0.5, **mamba)
    return {
        # One group: B and C (in_proj rows, conv1d channels) on both ranks, the gated norm's squares summed.
        "bamba-g1": BambaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                num_attention_heads=4, num_key_value_heads=2, vocab_size=TINY_VOCAB,
                                attn_layer_indices=[1], mamba_n_groups=1, max_position_embeddings=512,
                                **mamba),
        # h-tiny's shape (MoE beside the shared MLP, attention without positions), one group and two.
        "granite4-g1": GraniteMoeHybridConfig(**granite, mamba_n_groups=1),
        "granite4-g2": GraniteMoeHybridConfig(**granite, mamba_n_groups=2),
        # Two groups, one a rank; Mamba, MLP, Mamba, attention, MLP, Mamba (each a layer's "mixer"). A dt
        # floor that never binds (transformers floors its scan's dt, not its decode step's).
        "nemotron_h-g2": NemotronHConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, vocab_size=TINY_VOCAB,
                                         hybrid_override_pattern="M-M*-M", mamba_num_heads=8,
                                         mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=CHUNK,
                                         time_step_min=1e-9, max_position_embeddings=512),
        # Attention-free, four groups: two a rank.
        "mamba2-g4": Mamba2Config(num_heads=8, head_dim=16, hidden_size=64, expand=2, state_size=16,
                                  n_groups=4, num_hidden_layers=2, vocab_size=TINY_VOCAB, chunk_size=CHUNK,
                                  conv_kernel=4, bos_token_id=1, eos_token_id=2, pad_token_id=0),
    }


FAMILIES = list(_configs())
# The architecture of a config transformers made (not yet saved: it names none).
MAMBA2_CLASSES = {"bamba": "BambaForCausalLM", "mamba2": "Mamba2ForCausalLM"}


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory) -> dict:
    """family -> (folder of a tiny random checkpoint, transformers' fp32 model of it)."""
    from transformers import AutoModelForCausalLM

    models = {}
    for i, (family, cfg) in enumerate(_configs().items()):
        torch.manual_seed(4000 + i)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(1.0, NORM_SPREAD)
                elif not name.endswith(_SSM_PARAMS):
                    p.mul_(WEIGHT_SCALE)
        folder = tmp_path_factory.mktemp(f"tiny-{family}")
        model.save_pretrained(folder)
        models[family] = folder, AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, attn_implementation="eager").eval()
    return models


def _engine(folder, tp: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(folder), device="cpu", dtype="float32", block_size=8,
                                  max_num_batched_tokens=48, tensor_parallel_size=tp))


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_match_hf(hybrids, family):
    """Four prompts up to 60 tokens under a 48-token budget (prompts chunked beside decodes, across SSD chunk
    boundaries), each rank holding half of every Mamba2 mixer's heads and state: transformers' greedy tokens,
    its logits within 1e-4."""
    folder, hf = hybrids[family]
    engine = _engine(folder, 2)
    try:
        engine.record_timeline = True
        mixer_heads = {s.ssm.shape[1] for s in engine.runner.recurrent_states}  # [slots, H, P, N]
        assert mixer_heads == {4}, "each rank holds 4 of the 8 heads' state"
        prompts = random_prompts(4, 1, 60, seed=7)
        assert any(len(p) > CHUNK for p in prompts)
        assert_greedy_matches_hf(engine, hf, prompts, MAX_TOKENS, LOGITS_ATOL, family)
        assert any(s.num_prefill_tokens and s.num_decode_tokens for s in engine.timeline), "no mixed step"
        assert max(s.num_prefill_tokens for s in engine.timeline) < max(map(len, prompts)), "none chunked"
    finally:
        engine.shutdown()


@pytest.mark.parametrize("family, groups_per_rank", [("bamba-g1", None), ("mamba2-g4", 2)])
def test_mixer_slices_of_every_rank(family, groups_per_rank):
    """in_proj's z / x / dt rows, conv1d's x channels, A_log / D / dt_bias and the norm's weight: each rank
    its own heads', together the whole; B and C (in_proj rows and conv1d channels) split by groups, or whole
    on every rank where there is one group; out_proj's columns by heads, its bias the driver's alone."""
    hf_config = _configs()[family]
    full = ModelConfig.from_hf({**hf_config.to_dict(), "architectures": hf_config.architectures
                                or [MAMBA2_CLASSES[hf_config.model_type]]})
    dims = MAMBA2_DIMS[full.architecture](full.raw)
    inner, gn, heads, hidden = dims.intermediate_size, dims.n_groups * dims.state_size, dims.num_heads, 64
    prefix = "model.layers.0.mamba." if family.startswith("bamba") else "backbone.layers.0.mixer."
    tensors = {"in_proj.weight": torch.randn(2 * inner + 2 * gn + heads, hidden),
               "conv1d.weight": torch.randn(inner + 2 * gn, 1, dims.conv_kernel),
               "conv1d.bias": torch.randn(inner + 2 * gn),
               "A_log": torch.randn(heads), "D": torch.randn(heads), "dt_bias": torch.randn(heads),
               "norm.weight": torch.randn(inner),
               "out_proj.weight": torch.randn(hidden, inner), "out_proj.bias": torch.randn(hidden)}
    ranks = []
    for r in (0, 1):
        held = shard_for(full, r, 2).checkpoint((prefix + k, t) for k, t in tensors.items())
        ranks.append({k.removeprefix(prefix): t for k, t in held})
    half_i, half_h = inner // 2, heads // 2
    rank_gn = gn if groups_per_rank is None else groups_per_rank * dims.state_size
    for r in (0, 1):
        mine = slice(r * half_i, (r + 1) * half_i)
        groups = slice(0, gn) if groups_per_rank is None else slice(r * rank_gn, (r + 1) * rank_gn)
        z, x, B, C, dt = ranks[r]["in_proj.weight"].split([half_i, half_i, rank_gn, rank_gn, half_h])
        wz, wx, wB, wC, wdt = tensors["in_proj.weight"].split([inner, inner, gn, gn, heads])
        assert torch.equal(z, wz[mine]) and torch.equal(x, wx[mine])
        assert torch.equal(B, wB[groups]) and torch.equal(C, wC[groups])
        assert torch.equal(dt, wdt[r * half_h:(r + 1) * half_h])
        for name in ("conv1d.weight", "conv1d.bias"):
            cx, cB, cC = ranks[r][name].split([half_i, rank_gn, rank_gn])
            wx, wB, wC = tensors[name].split([inner, gn, gn])
            assert torch.equal(cx, wx[mine]) and torch.equal(cB, wB[groups]) and torch.equal(cC, wC[groups])
    for name, dim in (("A_log", 0), ("D", 0), ("dt_bias", 0), ("norm.weight", 0), ("out_proj.weight", 1)):
        assert torch.equal(torch.cat([r[name] for r in ranks], dim=dim), tensors[name]), name
    assert torch.equal(ranks[0]["out_proj.bias"], tensors["out_proj.bias"])
    assert not ranks[1]["out_proj.bias"].any()


@pytest.mark.parametrize("raw, world, message", [
    (dict(mamba_n_heads=6, mamba_n_groups=1), 4, "must divide the model's 6 Mamba heads"),
    (dict(mamba_n_heads=8, mamba_n_groups=2), 4, "the model's 2 Mamba groups"),
])
def test_refused_mamba_splits(raw, world, message):
    """Heads that do not split evenly, and groups that neither split whole nor are one (vLLM refuses both)."""
    cfg = ModelConfig.from_hf({"architectures": ["BambaForCausalLM"], "hidden_size": 48, "vocab_size": 8,
                               "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 1,
                               "intermediate_size": 8, "mamba_d_head": 16, **raw})
    with pytest.raises(ValueError, match=message):
        shard_for(cfg, 0, world)
