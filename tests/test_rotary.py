"""Rotary tables (plait.layers.rotary) against transformers' own rotary modules: every scaling plait reads
from a config gives the cos and sin transformers computes, attention factor included."""

from __future__ import annotations

import pytest
import torch

from plait.config import ModelConfig
from plait.layers.rotary import RotaryEmbedding, rotary_embedding

POSITIONS = 300
HEAD_DIM = 64

# (name, rope_scaling as a Hub config writes it, theta): each kind and its optional keys.
SCALINGS = [
    ("none", None, 10_000.0),
    ("linear", {"rope_type": "linear", "factor": 4.0}, 10_000.0),
    ("llama3", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}, 500_000.0),
    # Qwen2.5 / Qwen3 long-context configs (older "type" key), and the attention factor they imply.
    ("yarn", {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}, 1_000_000.0),
    ("yarn-betas-no-truncate", {"rope_type": "yarn", "factor": 2.5, "original_max_position_embeddings": 100,
                                "beta_fast": 16, "beta_slow": 2, "truncate": False}, 10_000.0),
    # DeepSeek's mscale / mscale_all_dim ratio, and an explicit attention factor.
    ("yarn-mscale", {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64,
                     "mscale": 0.707, "mscale_all_dim": 1.0}, 10_000.0),
    ("yarn-attention-factor", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                               "attention_factor": 0.5}, 10_000.0),
    # No original length given: transformers takes max_position_embeddings.
    ("yarn-no-original", {"rope_type": "yarn", "factor": 4.0}, 10_000.0),
]


def _hf_cos_sin(config_dict: dict) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(**config_dict)
    rotary = LlamaRotaryEmbedding(config)
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary(x, torch.arange(POSITIONS)[None])  # [1, P, D] each
    return cos[0], sin[0]


@pytest.mark.parametrize("name,scaling,theta", SCALINGS, ids=[s[0] for s in SCALINGS])
def test_table_equals_transformers(name, scaling, theta):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32,
              "hidden_size": 4 * HEAD_DIM, "intermediate_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 4, "max_position_embeddings": 256, "rope_theta": theta,
              "rope_scaling": scaling}
    cfg = ModelConfig.from_hf(config)
    table = RotaryEmbedding(cfg.head_dim, POSITIONS, cfg.rope_theta, cfg.rope_scaling).cos_sin
    cos, sin = _hf_cos_sin(config)
    half = HEAD_DIM // 2
    torch.testing.assert_close(table[:, :half], cos[:, :half], rtol=0, atol=1e-6)
    torch.testing.assert_close(table[:, half:], sin[:, :half], rtol=0, atol=1e-6)
    if scaling is not None:  # the scaling changed the table
        plain = RotaryEmbedding(cfg.head_dim, POSITIONS, cfg.rope_theta).cos_sin
        assert (plain - table).abs().max() > 1e-2


def test_yarn_over_a_partial_rotary_scales_the_rotated_channels_only():
    """A YaRN table for the first half of a head's channels (rotary_embedding's partial rotary) is YaRN of
    that width, as transformers computes it for dim = head_dim * partial_rotary_factor."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    partial = rotary_embedding(HEAD_DIM, POSITIONS, 10_000.0, yarn, partial_rotary_factor=0.5)
    whole = RotaryEmbedding(HEAD_DIM // 2, POSITIONS, 10_000.0, yarn)
    assert torch.equal(partial.cos_sin, whole.cos_sin)
