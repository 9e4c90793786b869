"""Phi-3 (Phi3ForCausalLM): config reading, the LongRoPE table against transformers', and the partial LongRoPE
rotary through the fused rotary + KV-store kernel (whole models against HF: test_hf_parity)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TINY_PHI3_ORIGINAL_MAX_POSITIONS, hf_greedy_reference, random_prompts, run_greedy

from plait.config import EngineConfig, ModelConfig
from plait.layers.rotary import (
    PartialRotaryEmbedding,
    RotaryEmbedding,
    longrope_attention_factor,
    longrope_inv_freq,
    rotary_embedding,
)
from plait.models.registry import get_model_class

# Tiny LongRoPE Phi-3 geometry: heads of 32 channels, 24 of them rotated (Phi-4-mini's 0.75), pretrained on
# 16 positions and stretched to 64 (factor 4).
HEAD_DIM, HEADS, KV_HEADS = 32, 4, 2
PARTIAL = 0.75
ROTARY_DIM = int(HEAD_DIM * PARTIAL)
ORIGINAL, MAX_POSITIONS = 16, 64
SHORT = [1.0 + 0.25 * i for i in range(ROTARY_DIM // 2)]
LONG = [2.0 + 3.0 * i for i in range(ROTARY_DIM // 2)]
THETA = 10_000.0
# As test_hf_parity's: fp32 logits within this of HF's, over this many greedy tokens.
LOGITS_ATOL = 1e-4
MAX_TOKENS = 4


def hub_config(**changes) -> dict:
    """A Phi-4-mini-style config.json as the Hub has them: rope_scaling with "type", the pretraining length
    and the partial rotary factor at the top level."""
    cfg = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": HEADS * HEAD_DIM,
           "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": HEADS,
           "num_key_value_heads": KV_HEADS, "vocab_size": 64, "max_position_embeddings": MAX_POSITIONS,
           "original_max_position_embeddings": ORIGINAL, "partial_rotary_factor": PARTIAL,
           "rope_theta": THETA,
           "rope_scaling": {"type": "longrope", "short_factor": SHORT, "long_factor": LONG},
           "hidden_act": "silu", "rms_norm_eps": 1e-5, "pad_token_id": None}
    cfg.update(changes)
    return cfg


def transformers5_config(hub: dict) -> dict:
    """The same config as transformers 5 saves it (theta, partial factor and lengths in rope_parameters)."""
    from transformers import Phi3Config

    saved = Phi3Config(**{k: v for k, v in hub.items() if k not in ("architectures", "model_type")}).to_dict()
    return saved | {"architectures": hub["architectures"]}


def plait_rotary(cfg: dict, max_positions: int = MAX_POSITIONS) -> torch.nn.Module:
    mc = ModelConfig.from_hf(cfg)
    return rotary_embedding(mc.head_dim, max_positions, mc.rope_theta, mc.rope_scaling,
                            mc.partial_rotary_factor)


def hf_cos_sin(cfg: dict, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Phi-3 rotary module's (cos, sin) ([P, R] fp32, halves duplicated) for one forward over
    ``positions``: its short factors unless the forward reaches original_max_position_embeddings."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = Phi3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = Phi3RotaryEmbedding(config)(x, positions[None])
    return cos[0], sin[0]


def split(table_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """plait's rows (cos then sin of the half-dim angles) in transformers' layout (each half duplicated)."""
    cos, sin = table_rows.chunk(2, dim=-1)
    return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


@pytest.mark.parametrize("layout", ["hub", "hub-su", "transformers5", "explicit-factors"])
def test_longrope_table_equals_transformers_rotary(layout):
    # Rows below the pretraining length equal transformers' rotary over a forward that stays below it (short
    # factors); rows from it on equal its rotary over a forward past it (long factors); both scaled by its
    # attention factor, bit for bit.
    cfg = reference = hub_config()
    if layout == "hub-su":
        # Early Phi-3-128k configs' name for LongRoPE, which Phi3Config renames but transformers 5.23 then
        # refuses (it looks for the pretraining length before the rename): the reference reads "longrope".
        cfg = hub_config(rope_scaling=cfg["rope_scaling"] | {"type": "su"})
    elif layout == "transformers5":
        cfg = transformers5_config(cfg)
    elif layout == "explicit-factors":  # a config's own factor and attention factor override the derived ones
        explicit = {"factor": 2.0, "attention_factor": 1.37}
        cfg = reference = hub_config(rope_scaling=cfg["rope_scaling"] | explicit)
    rotary = plait_rotary(cfg)
    assert isinstance(rotary, PartialRotaryEmbedding) and rotary.cos_sin.shape == (MAX_POSITIONS, ROTARY_DIM)
    for positions in (torch.arange(ORIGINAL), torch.arange(ORIGINAL, MAX_POSITIONS)):
        want_cos, want_sin = hf_cos_sin(reference, positions)
        got_cos, got_sin = split(rotary.cos_sin[positions])
        assert torch.equal(got_cos, want_cos) and torch.equal(got_sin, want_sin)


def test_longrope_attention_factor_and_frequencies_are_transformers():
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import _compute_longrope_parameters

    for changes in ({}, {"max_position_embeddings": ORIGINAL}, {"max_position_embeddings": 131072,
                                                                "original_max_position_embeddings": 4096}):
        cfg = hub_config(**changes)
        config = Phi3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
        short, want_factor = _compute_longrope_parameters(config)
        long, _ = _compute_longrope_parameters(config, seq_len=cfg["original_max_position_embeddings"] + 1)
        scaling = ModelConfig.from_hf(cfg).rope_scaling
        assert longrope_attention_factor(scaling) == want_factor
        assert torch.equal(longrope_inv_freq(ROTARY_DIM, THETA, SHORT), short)
        assert torch.equal(longrope_inv_freq(ROTARY_DIM, THETA, LONG), long)
    # Phi-3.5-mini / Phi-4-mini: 131072 positions stretched from 4096.
    assert longrope_attention_factor(scaling) == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))


def test_longrope_rows_past_the_original_length_take_the_long_factors():
    # Each position its own factors, whatever else is in its step: row p is p's angles under the short
    # factors below the pretraining length, the long ones from it on, all times the attention factor
    # (computed here apart, in fp64).
    rotary = plait_rotary(hub_config())
    scale = math.sqrt(1 + math.log(MAX_POSITIONS / ORIGINAL) / math.log(ORIGINAL))
    base = THETA ** (torch.arange(0, ROTARY_DIM, 2, dtype=torch.float64) / ROTARY_DIM)
    for p in range(MAX_POSITIONS):
        factors = torch.tensor(LONG if p >= ORIGINAL else SHORT, dtype=torch.float64)
        angles = p / (factors * base)
        want = torch.cat([angles.cos(), angles.sin()]) * scale
        torch.testing.assert_close(rotary.cos_sin[p].double(), want, rtol=0, atol=1e-5)
    # A single decode token at position p is what transformers rotates alone at p (its forward reaches the
    # pretraining length exactly when p does), so decodes on either side of it agree with transformers.
    for p in (ORIGINAL - 1, ORIGINAL, MAX_POSITIONS - 1):
        want_cos, want_sin = hf_cos_sin(hub_config(), torch.tensor([p]))
        got_cos, got_sin = split(rotary.cos_sin[[p]])
        assert torch.equal(got_cos, want_cos) and torch.equal(got_sin, want_sin)
    # A table no longer than the pretraining length (max_model_len below it) is all short rows.
    shorter = plait_rotary(hub_config(), max_positions=ORIGINAL // 2)
    assert torch.equal(shorter.cos_sin, rotary.cos_sin[: ORIGINAL // 2])


def test_phi3_configs_are_read_as_transformers_reads_them():
    # Phi-3-mini-4k: no scaling, whole-head rotary, its 2047-token sliding window.
    mini_4k = hub_config(rope_scaling=None, sliding_window=2047, max_position_embeddings=4096)
    del mini_4k["partial_rotary_factor"], mini_4k["original_max_position_embeddings"]
    mini_4k = ModelConfig.from_hf(mini_4k)
    assert mini_4k.rope_scaling is None and mini_4k.partial_rotary_factor == 1.0
    assert mini_4k.sliding_window == 2047
    # Phi-4-mini: LongRoPE, partial rotary from the top level; the pretraining length from the top level
    # even where rope_scaling has one of its own (Phi3Config gives the top level priority).
    mc = ModelConfig.from_hf(hub_config(rope_scaling=hub_config()["rope_scaling"]
                                        | {"original_max_position_embeddings": 999}))
    assert mc.partial_rotary_factor == PARTIAL
    assert mc.rope_scaling["rope_type"] == "longrope" and "type" not in mc.rope_scaling
    assert mc.rope_scaling["original_max_position_embeddings"] == ORIGINAL
    assert mc.rope_scaling["factor"] == MAX_POSITIONS / ORIGINAL
    # The factor in the rope dict wins over the top level's, as in Phi3Config.
    given = hub_config(rope_scaling=hub_config()["rope_scaling"] | {"partial_rotary_factor": 0.5})
    assert ModelConfig.from_hf(given).partial_rotary_factor == 0.5
    # Phi3Config takes no other scaling; nor does plait.
    with pytest.raises(ValueError, match="Phi-3 takes only 'longrope'"):
        ModelConfig.from_hf(hub_config(rope_scaling={"type": "linear", "factor": 2.0}))
    # Other families never read the key (transformers' Llama ignores it too).
    llama = hub_config(architectures=["LlamaForCausalLM"], model_type="llama", rope_scaling=None)
    assert ModelConfig.from_hf(llama).partial_rotary_factor == 1.0
    assert isinstance(plait_rotary(llama), RotaryEmbedding)


def test_phi3_is_served_by_the_llama_decoder():
    # LoRA included: adapters on its fused projections (tests/test_lora.py).
    from plait.models.llama import LlamaForCausalLM

    cls = get_model_class("Phi3ForCausalLM")
    assert issubclass(cls, LlamaForCausalLM) and cls.supports_lora


def test_tiny_longrope_phi3_stays_below_its_original_length(tiny_models):
    # test_hf_parity's prompts and outputs (at most 70 + 12 tokens) stay where transformers and plait agree.
    import json

    cfg = json.loads((tiny_models["phi3-longrope"] / "config.json").read_text())
    assert cfg["original_max_position_embeddings"] == TINY_PHI3_ORIGINAL_MAX_POSITIONS > 70 + 12


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_partial_longrope_through_the_fused_rope_store_matches_torch(monkeypatch, dtype):
    # The Triton backend rotates q and k with the KV store in one launch from the rotary's table (24 of 32
    # channels here, attention-scaled, positions on both sides of the pretraining length): the same q and
    # cache as the torch layers through the torch_ref backend.
    pytest.importorskip("triton")
    from types import SimpleNamespace

    from plait.attention import triton_backend
    from plait.attention.base import get_backend
    from plait.kernels import dispatch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        rotary = plait_rotary(hub_config())
    calls = []
    launch = triton_backend.rope_store_kv
    monkeypatch.setattr(triton_backend, "rope_store_kv", lambda *a, **k: calls.append(1) or launch(*a, **k))
    g = torch.Generator().manual_seed(5)
    t, block_size, num_blocks = 9, 4, 5
    qkv = (torch.randn(t, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g) * 3).to(dtype).to(device)
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    q, k, v = (x.view(t, -1, HEAD_DIM) for x in (q, k, v))
    positions = torch.tensor([0, 3, ORIGINAL - 1, ORIGINAL, ORIGINAL + 1, 30, 47, 62, MAX_POSITIONS - 1])
    slots = torch.randperm((num_blocks - 1) * block_size, generator=g)[:t] + block_size  # past the pad block
    batch = SimpleNamespace(positions=positions.to(device), slot_mapping=slots.to(device))
    cache = torch.randn(2, num_blocks, block_size, KV_HEADS, HEAD_DIM, generator=g).to(dtype).to(device)
    outs, caches = {}, {}
    for name in ("triton", "torch_ref"):
        monkeypatch.setattr(dispatch, "_cpu_interpreter", name == "triton" and device == "cpu")
        caches[name] = cache.clone()
        with torch.inference_mode():
            outs[name] = get_backend(name).rotate_and_store(q, k, v, caches[name], batch, rotary)
    assert calls, "the Triton backend did not fuse the rotation into its KV store"
    assert torch.equal(outs["triton"], outs["torch_ref"])
    assert torch.equal(caches["triton"], caches["torch_ref"])
    assert torch.equal(outs["triton"][..., ROTARY_DIM:], q[..., ROTARY_DIM:])  # the unrotated channels
    assert not torch.equal(outs["triton"][..., :ROTARY_DIM], q[..., :ROTARY_DIM])


@pytest.mark.parametrize("family", ["phi3", "phi3-longrope"])
def test_tiny_phi3_through_the_triton_kernels_matches_hf(tiny_models, monkeypatch, family):
    # The GPU path's kernels (Triton's interpreter on CPU, fp32): q and k rotated from the partial LongRoPE
    # table in the KV store's launch, windowed paged attention, the fused MLP; greedy tokens and logits as
    # HF's.
    pytest.importorskip("triton")
    from transformers import AutoModelForCausalLM

    from plait.attention import triton_backend
    from plait.engine.engine import LLMEngine
    from plait.kernels import dispatch

    calls = []
    launch = triton_backend.rope_store_kv
    monkeypatch.setattr(triton_backend, "rope_store_kv", lambda *a, **k: calls.append(1) or launch(*a, **k))
    monkeypatch.setattr(dispatch, "_cpu_interpreter", not torch.cuda.is_available())
    folder = tiny_models[family]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    prompts = random_prompts(3, 20, 40, seed=9)
    # A KV cache of its own size: on a GPU one sized by memory would keep the next engine from one.
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="float32", max_num_batched_tokens=32,
                                    block_size=8, num_kv_blocks=64, attention_backend="triton"))
    outputs, logits = run_greedy(engine, prompts, MAX_TOKENS, capture_logits=True)
    assert calls, "q and k were not rotated in the KV store's launch"
    for i, prompt in enumerate(prompts):
        ref_ids, ref_logits = hf_greedy_reference(hf, prompt, outputs[i], MAX_TOKENS)
        assert outputs[i] == ref_ids, f"prompt {i}: greedy tokens differ from HF"
        torch.testing.assert_close(torch.stack(logits[i]).cpu(), ref_logits, atol=LOGITS_ATOL, rtol=0)
