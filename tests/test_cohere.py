"""Cohere's decoders (Command R / R+, Aya: CohereForCausalLM; Command R7B / A: Cohere2ForCausalLM) match
transformers (fp32, CPU): the parallel block under one LayerNorm, GPT-J's paired rotary, Command R+'s per-head
q/k LayerNorms, logit_scale, tied embeddings, and Cohere2's sliding layers (a window shorter than the prompts)
beside a global one without rotary; chunked and batched, through the Triton kernels (interpreter) and split
over two ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY_VOCAB, assert_greedy_matches_hf, random_prompts

from plait.config import EngineConfig, ModelConfig
from plait.engine.engine import LLMEngine

LOGITS_ATOL = 1e-4
MAX_TOKENS = 10
WINDOW = 24


def _configs() -> dict:
    from transformers import Cohere2Config, CohereConfig

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=TINY_VOCAB, max_position_embeddings=512, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0,
                  rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    return {
        # A logit_scale away from the default, so that leaving it out changes the logits.
        "cohere": CohereConfig(**common, logit_scale=0.25),
        # Command R+: a LayerNorm per q and k head, each head its own weight.
        "cohere-qk-norm": CohereConfig(**common, use_qk_norm=True),
        # Command R7B's pattern: three sliding layers (a window shorter than the prompts), then a global one.
        "cohere2": Cohere2Config(**(common | {"num_hidden_layers": 4}), sliding_window=WINDOW,
                                 logit_scale=0.5),
    }


@pytest.fixture(scope="module")
def cohere_models(tmp_path_factory) -> dict[str, Path]:
    """family -> folder of a random tiny checkpoint saved by transformers."""
    from transformers import AutoModelForCausalLM

    folders = {}
    for i, (family, cfg) in enumerate(_configs().items()):
        torch.manual_seed(2000 + i)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:  # ones at init: random, so that a norm weight in the wrong channel shows
                    p.normal_(1.0, 0.3)
                else:  # clear greedy winners (as conftest's tiny models)
                    p.mul_(8.0)
        folder = tmp_path_factory.mktemp(f"tiny-{family}")
        model.save_pretrained(folder)
        if family == "cohere2":  # as Command R7B's config.json says it: a pattern, not layer_types
            config = json.loads((folder / "config.json").read_text())
            assert config.pop("layer_types") == ["sliding_attention"] * 3 + ["full_attention"]
            config["sliding_window_pattern"] = 4
            (folder / "config.json").write_text(json.dumps(config))
        folders[family] = folder
    return folders


def _hf(folder: Path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    return hf.eval()


@pytest.mark.parametrize("family", ["cohere", "cohere-qk-norm", "cohere2"])
def test_greedy_and_logits_match_hf(cohere_models, family):
    """Six prompts (up to 70 tokens, past the window) at once under a 48-token budget: chunks beside
    decodes."""
    folder = cohere_models[family]
    engine = LLMEngine(EngineConfig(model=str(folder), max_num_batched_tokens=48, block_size=8))
    model = engine.runner.model
    if family == "cohere2":  # windows and rotary on the sliding layers only
        assert [layer.self_attn.sliding_window for layer in model.model.layers] == [WINDOW] * 3 + [None]
        assert list(model.model.rotary) == ["sliding_attention"]
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as transformers' default
    assert_greedy_matches_hf(engine, _hf(folder), random_prompts(6, 1, 70, seed=7), MAX_TOKENS, LOGITS_ATOL,
                             family)


# family -> (unrotated stores, fused rotary + stores) of one step through its layers
TRITON_KV_STORES = {"cohere-qk-norm": (0, 2), "cohere2": (1, 3)}
# family -> (prompts, shortest, longest, greedy tokens): the interpreter is slow. Cohere2's: one prompt past
# the window, a chunk and decodes each.
TRITON_RUNS = {"cohere-qk-norm": (1, 12, 12, 2), "cohere2": (2, 26, 30, 2)}


@pytest.mark.parametrize("family", sorted(TRITON_KV_STORES))
def test_through_the_triton_kernels_matches_hf(cohere_models, monkeypatch, family):
    """The GPU path's kernels (Triton's interpreter on CPU, fp32): the per-head q/k LayerNorms in torch before
    the fused rotary + KV store launch (whose q/k norms are RMSNorms), Cohere2's global layer storing K/V
    unrotated, windowed paged attention; greedy tokens and logits as HF's."""
    import plait.attention.triton_backend as triton_backend
    from plait.kernels import dispatch

    monkeypatch.setattr(dispatch, "_cpu_interpreter", True)
    launches = {"store": 0, "rope_store": 0}
    for name in launches:
        kernel = getattr(triton_backend, f"{name}_kv")

        def counted(*args, _kernel=kernel, _name=name, **kwargs):
            launches[_name] += 1
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(triton_backend, f"{name}_kv", counted)
    folder = cohere_models[family]
    engine = LLMEngine(EngineConfig(model=str(folder), max_num_batched_tokens=32, block_size=8,
                                    attention_backend="triton"))
    num, shortest, longest, max_tokens = TRITON_RUNS[family]
    prompts = random_prompts(num, shortest, longest, seed=9)
    assert_greedy_matches_hf(engine, _hf(folder), prompts, max_tokens, LOGITS_ATOL)
    plain, fused = TRITON_KV_STORES[family]
    assert launches["rope_store"] > 0 and launches["store"] * fused == launches["rope_store"] * plain


def test_two_ranks_match_hf(cohere_models):
    """Split over two ranks (gloo): heads, KV heads, Command R+'s per-head q/k norm rows and MLP columns,
    o_proj and down_proj each summed over the ranks before both join the stream."""
    folder = cohere_models["cohere-qk-norm"]
    engine = LLMEngine(EngineConfig(model=str(folder), max_num_batched_tokens=48, block_size=8,
                                    tensor_parallel_size=2))
    try:
        assert engine.runner.num_kv_heads == 1
        assert_greedy_matches_hf(engine, _hf(folder), random_prompts(3, 1, 50, seed=13), 6, LOGITS_ATOL)
    finally:
        engine.shutdown()


def test_lora_is_refused_by_name(cohere_models):
    """Adapters' q/k rows would need the checkpoint's paired-rotary reordering: refused before serving."""
    with pytest.raises(ValueError, match="LoRA is not supported for CohereForCausalLM"):
        LLMEngine(EngineConfig(model=str(cohere_models["cohere"]), enable_lora=True))


def test_config_and_layers_read_layer_norm_eps(cohere_models):
    """Cohere names its norms' eps layer_norm_eps: ModelConfig's eps and every LayerNorm take it (it once read
    1e-6 there while the layers read the right key)."""
    folder = cohere_models["cohere"]
    raw = json.loads((folder / "config.json").read_text())
    cfg = ModelConfig.from_hf({**raw, "layer_norm_eps": 3e-4})
    assert cfg.rms_norm_eps == 3e-4
    engine = LLMEngine(EngineConfig(model=str(folder), load_format="dummy", device="cpu", dtype="float32"))
    eps = {m.eps for m in engine.runner.model.modules() if type(m).__name__ == "CohereLayerNorm"}
    assert eps == {raw["layer_norm_eps"]}
