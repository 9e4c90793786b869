"""MTP speculative decoding (speculative_config method "mtp"): a GLM-4.5 / DeepSeek-V3 checkpoint's own
multi-token-prediction layer drafts from the target's final hidden states. Every draft equals a plain-torch
MTP layer's over transformers' hidden states (its decoder layer transformers' own); outputs equal those
without speculation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import random_prompts
from safetensors.torch import load_file, save_file
from test_deepseek import deepseek_models  # noqa: F401 (fixtures: tiny checkpoints with an MTP layer)
from test_eagle import _record_drafts, _spec_run
from test_glm4_moe import glm4_moe_models  # noqa: F401
from test_speculative import MIXED_PARAMS, _assert_same, _engine, _generate

from plait.config import SpeculativeConfig
from plait.engine.eagle import EagleDrafter
from plait.models.mtp import DeepSeekMTPModel, Glm4MoeMTPModel
from plait.sampling_params import SamplingParams

MTP_LAYER = 3  # the tiny models' num_hidden_layers: their MTP layer is model.layers.3.*
# The tiny targets with an MTP layer (test_glm4_moe's, test_deepseek's) and the head class each drafts with.
FAMILIES = {"glm4_moe": ("glm4_moe_models", "qk_norm", Glm4MoeMTPModel),
            "deepseek_v3": ("deepseek_models", "v3_yarn", DeepSeekMTPModel)}
# The target layer (MoE) whose tensors the ``distinct`` checkpoint's MTP decoder layer copies.
DECODER_COPY = 1
# A small token budget: the long prompt is chunked over several steps beside other rows' decodes.
BUDGET = 24
# The "predictive" checkpoint: the decoder's sublayer outputs scaled down so that the target is nearly a
# bigram model (its next token mostly the last token's), and an MTP layer that predicts that bigram.
SUBLAYER_SCALE = 0.02
NUM_SMALL_KV_BLOCKS = 24  # of 8 tokens: too few for the seeded test's seven requests at once
FEATURE_MIX = 0.005  # eh_proj's weight on the hidden state beside the identity on the embedding


def _prompts() -> list[list[int]]:
    return random_prompts(3, 3, 20, seed=51) + random_prompts(1, 70, 70, seed=52)


def _spec(k: int, **more) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k, **more}


def _mtp_engine(folder: Path, spec: dict | None, **knobs):
    return _engine(folder, spec, max_num_batched_tokens=BUDGET, **knobs)


# -- a plain-torch MTP layer over transformers' hidden states ------------------------------------------------


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _reference_layer(folder: Path, hf):
    """transformers' GLM-4.5 of one MoE layer holding the MTP layer's decoder layer (a copy of the target's
    layer 1: see ``distinct``), its final norm shared_head.norm, and the target's LM head:
    model(inputs_embeds=h) is shared_head.norm(decoder layer(h))."""
    from transformers import AutoModelForCausalLM

    cfg = hf.config.to_dict() | {"num_hidden_layers": 1, "first_k_dense_replace": 0,
                                 "num_nextn_predict_layers": 0}
    ref_config = type(hf.config)(**{k: v for k, v in cfg.items() if k != "architectures"})
    ref = AutoModelForCausalLM.from_config(ref_config, dtype=torch.float32).eval()
    tensors = load_file(folder / "model.safetensors")
    with torch.no_grad():
        ref.model.layers[0].load_state_dict(hf.model.layers[DECODER_COPY].state_dict())
        ref.model.norm.weight.copy_(tensors[f"model.layers.{MTP_LAYER}.shared_head.norm.weight"])
    return ref, tensors


@torch.no_grad()
def _reference_drafts(folder: Path, hf, known: list[int], k: int, cache: dict) -> list[int]:
    """The MTP layer's k greedy drafts after ``known`` (t0..tn): position p takes token p + 1's embedding
    (zero at p = 0) and the target's final hidden state at p; each draft then feeds the next with the layer's
    own output (before shared_head.norm)."""
    if "ref" not in cache:
        cache["ref"] = _reference_layer(folder, hf)
    ref, t = cache["ref"]
    eps = hf.config.rms_norm_eps
    p = f"model.layers.{MTP_LAYER}."
    features = hf.model(torch.tensor([known])).last_hidden_state[0][:-1]  # [n, hidden], after the final norm
    tokens, drafts = list(known[1:]), []
    prenorm: list[torch.Tensor] = []
    hook = ref.model.norm.register_forward_pre_hook(lambda module, args: prenorm.append(args[0][0]))
    try:
        for _ in range(k):
            embeds = hf.model.embed_tokens(torch.tensor(tokens))  # [n, hidden]
            embeds[0] = 0.0
            x = torch.cat([_rms(embeds, t[f"{p}enorm.weight"], eps),
                           _rms(features, t[f"{p}hnorm.weight"], eps)], -1)
            out = ref.model(inputs_embeds=(x @ t[f"{p}eh_proj.weight"].T)[None]).last_hidden_state[0]
            drafts.append(int((out[-1] @ hf.lm_head.weight.T).argmax()))
            tokens.append(drafts[-1])
            features = torch.cat([features, prenorm[-1][-1:]])  # the layer's output before shared_head.norm
    finally:
        hook.remove()
    return drafts


# -- checkpoints ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def predictive(glm4_moe_models, tmp_path_factory) -> Path:  # noqa: F811
    """The tiny GLM-4.5 (q/k norms) made nearly a bigram model (every attention and MLP output scaled by
    SUBLAYER_SCALE), with an MTP layer whose eh_proj passes the normed embedding on (plus a little of the
    hidden state) and whose decoder layer is scaled alike: its drafts are mostly the target's tokens, so some
    are kept and some rejected."""
    folder, _ = glm4_moe_models["qk_norm"]
    out = _copy_config(folder, tmp_path_factory.mktemp("tiny-glm4-moe-predictive"))
    tensors = load_file(folder / "model.safetensors")
    g = torch.Generator().manual_seed(61)
    for name, tensor in tensors.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")) or ".experts." in name and "down" in name:
            tensors[name] = tensor * SUBLAYER_SCALE
    hidden = tensors["model.embed_tokens.weight"].shape[1]
    mix = torch.randn(hidden, hidden, generator=g) * FEATURE_MIX
    tensors[f"model.layers.{MTP_LAYER}.eh_proj.weight"] = torch.cat([torch.eye(hidden), mix], dim=1)
    tensors["model.norm.weight"] = torch.ones(hidden)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module", params=list(FAMILIES))
def distinct(request, tmp_path_factory) -> tuple[str, Path, object]:
    """(family, a tiny target whose MTP layer's decoder layer is a copy of layer DECODER_COPY's (not of the
    last layer's, as the fixtures': a head loading the wrong layer would draft otherwise), and whose enorm,
    hnorm and shared_head.norm are not ones, transformers' target)."""
    fixture, variant, _ = FAMILIES[request.param]
    folder, hf = request.getfixturevalue(fixture)[variant]
    out = _copy_config(folder, tmp_path_factory.mktemp(f"tiny-{request.param}-distinct"))
    tensors = load_file(folder / "model.safetensors")
    g = torch.Generator().manual_seed(62)
    mtp, source = f"model.layers.{MTP_LAYER}.", f"model.layers.{DECODER_COPY}."
    own = ("eh_proj.", "enorm.", "hnorm.", "shared_head.")
    tensors = {k: v for k, v in tensors.items() if not k.startswith(mtp) or k[len(mtp):].startswith(own)}
    tensors |= {mtp + k[len(source):]: v.clone() for k, v in tensors.items() if k.startswith(source)}
    for name in ("enorm", "hnorm", "shared_head.norm"):
        weight = tensors[f"{mtp}{name}.weight"]
        tensors[f"{mtp}{name}.weight"] = 1 + 0.2 * torch.randn(weight.shape, generator=g)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return request.param, out, hf


def _copy_config(folder: Path, out: Path) -> Path:
    for name in ("config.json", "generation_config.json"):
        if (folder / name).exists():
            (out / name).write_text((folder / name).read_text())
    return out


def _without_mtp(folder: Path, out: Path) -> Path:
    """The same checkpoint without its MTP layer, as a GLM-4.5 saved by transformers is."""
    out.mkdir()
    config = json.loads((folder / "config.json").read_text()) | {"num_nextn_predict_layers": 0}
    (out / "config.json").write_text(json.dumps(config))
    tensors = {k: v for k, v in load_file(folder / "model.safetensors").items()
               if not k.startswith(f"model.layers.{MTP_LAYER}.")}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# -- the tests -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2])
def test_drafts_are_the_mtp_layers_over_the_targets_hidden_states(distinct, k, monkeypatch):
    """Every proposal, for prompts chunked over several steps beside decodes and for decodes after kept and
    rejected drafts, equals the plain-torch MTP layer's (transformers' decoder layer: GLM-4.5's attention, or
    DeepSeek-V3's MLA, and MoE) over transformers' hidden states; the outputs and logprobs are those without
    speculation."""
    family, folder, hf = distinct
    engine = _mtp_engine(folder, _spec(k))
    assert isinstance(engine.drafter, EagleDrafter) and isinstance(engine.drafter.head, FAMILIES[family][2])
    seen: list[tuple[list[int], tuple[int, ...]]] = []
    _record_drafts(monkeypatch, lambda known, drafts: seen.append((known, drafts)))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompts = _prompts()
    got = _generate(engine, prompts, [params] * len(prompts))
    _assert_same(got, _generate(_mtp_engine(folder, None), prompts, [params] * len(prompts)))
    assert engine.drafter.is_clean() and engine.spec_stats.num_draft_tokens > 0
    assert len(seen) >= 12
    cache: dict = {}
    for known, drafts in seen[:: max(1, len(seen) // 12)]:
        assert list(drafts) == _reference_drafts(folder, hf, known, k, cache), f"after {len(known)} tokens"


@pytest.mark.parametrize("k", [1, 2])
def test_a_predictive_mtp_layer_has_drafts_kept_and_outputs_unchanged(predictive, k):
    """Greedy requests arriving while the long prompt is still chunked: the same tokens as without
    speculation, in fewer target steps, with drafts proposed, most kept and some rejected."""
    prompts, params = _prompts(), SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = _generate(_mtp_engine(predictive, None), prompts, [params] * len(prompts))
    engine = _mtp_engine(predictive, _spec(k))
    _assert_same(_generate(engine, prompts, [params] * len(prompts)), want)
    stats = engine.spec_stats
    assert stats.num_draft_tokens >= 20, stats
    assert stats.num_draft_tokens // 2 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert all(kept > 0 for kept in stats.accepted_per_position), stats


def test_seeded_sampling_penalties_stops_prefix_cache_and_preemption_are_unchanged(predictive):
    """Sampled, penalised and stopped requests, a shared prefix served from the cache (the head's K/V of
    those blocks is at the target's block ids too) and a KV cache small enough to preempt: the same outputs
    as the same engine without speculation."""
    shared = random_prompts(1, 40, 40, seed=53)[0]
    prompts = [shared + p for p in random_prompts(len(MIXED_PARAMS), 3, 20, seed=54)]
    knobs = dict(enable_prefix_caching=True, num_kv_blocks=NUM_SMALL_KV_BLOCKS)
    want = _generate(_mtp_engine(predictive, None, **knobs), prompts, MIXED_PARAMS)
    engine = _mtp_engine(predictive, _spec(2), **knobs)
    engine.record_timeline = True
    _assert_same(_generate(engine, prompts, MIXED_PARAMS), want)
    assert engine.spec_stats.num_accepted_tokens > 0 and engine.kv_cache.stats.hits > 0
    assert sum(s.num_preempted for s in engine.timeline) > 0, "the test did not force a preemption"


def test_mtp_config_names_and_refusals(glm4_moe_models, deepseek_models, tiny_llama, tmp_path):  # noqa: F811
    """vLLM's names for the method, from the CLI's --speculative-config too; its model the target's by
    default; targets without MTP layers (or of other architectures) refused by name."""
    from plait.entrypoints.cli import _engine_config, parse_args

    for name in ("mtp", "deepseek_mtp", "glm4_moe_mtp"):
        assert SpeculativeConfig.parse({"method": name, "num_speculative_tokens": 1}).method == "mtp"
    folder, _ = glm4_moe_models["no_qk_norm"]
    flag = json.dumps({"method": "glm4_moe_mtp", "num_speculative_tokens": 1})
    config = _engine_config(parse_args(["serve", str(folder), "--speculative-config", flag]))
    assert config.speculative_config == SpeculativeConfig("mtp", 1, model=str(folder))
    engine = _mtp_engine(folder, _spec(1))
    assert engine.config.speculative_config.model == str(folder)
    with pytest.raises(ValueError, match="has none .num_nextn_predict_layers"):
        _mtp_engine(_without_mtp(folder, tmp_path / "no-mtp"), _spec(1))
    with pytest.raises(ValueError, match="LlamaForCausalLM is not supported"):
        _engine(tiny_llama, _spec(1))
    with pytest.raises(ValueError, match="DeepseekV2ForCausalLM is not supported"):
        _engine(deepseek_models["v2_lite"][0], _spec(1))
    with pytest.raises(ValueError, match='"max_model_len" is not for "mtp"'):
        SpeculativeConfig.parse(_spec(1, max_model_len=64))


def test_an_mtp_head_beside_a_target_split_over_two_ranks_drafts_as_on_one(glm4_moe_models,  # noqa: F811
                                                                              monkeypatch):
    """Tensor parallelism (gloo): the MTP head runs whole on the driver, reading the driver's final hidden
    states of the split target (GLM-4.5: the head runs unsplit whatever its family): the drafts and outputs
    of one device."""
    folder, _ = glm4_moe_models["qk_norm"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = _prompts()
    want = _spec_run(_mtp_engine(folder, _spec(2)), prompts, params, monkeypatch)
    engine = _mtp_engine(folder, _spec(2), tensor_parallel_size=2)
    try:
        outputs, drafts = _spec_run(engine, prompts, params, monkeypatch)
    finally:
        engine.shutdown()
    assert outputs == want[0]
    assert len(drafts) > 12 and drafts == want[1]


def test_the_head_reads_only_its_layer_of_the_checkpoint(glm4_moe_models, monkeypatch):  # noqa: F811
    """The head's load reads model.layers.{N}.* of the target's checkpoint and leaves the rest unread (a
    GLM-4.5's is hundreds of GB): every tensor read after the target's load is the MTP layer's."""
    from safetensors import safe_open

    import plait.loader.hf as hf_loader

    folder, _ = glm4_moe_models["qk_norm"]
    read: list[str] = []

    class Recording:
        def __init__(self, *args, **kwargs) -> None:
            self.file = safe_open(*args, **kwargs)

        def __enter__(self):
            self.shard = self.file.__enter__()
            return self

        def __exit__(self, *exc) -> None:
            self.file.__exit__(*exc)

        def keys(self) -> list[str]:
            return list(self.shard.keys())

        def get_tensor(self, name: str) -> torch.Tensor:
            read.append(name)
            return self.shard.get_tensor(name)

    monkeypatch.setattr(hf_loader, "safe_open", Recording)
    plain = _mtp_engine(folder, None)
    target_reads = len(read)
    assert any(name.startswith(f"model.layers.{MTP_LAYER - 1}.") for name in read)
    read.clear()
    engine = _mtp_engine(folder, _spec(1))
    assert engine.drafter is not None and plain is not None
    head_reads = read[target_reads:]  # the target's load first, then the head's
    assert head_reads and all(name.startswith(f"model.layers.{MTP_LAYER}.") for name in head_reads)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["predictive_glm4_moe", "deepseek_v3"])
def test_on_the_gpu_path_outputs_are_the_cpus_without_speculation(family, request, monkeypatch):
    """fp32 on CUDA (Triton attention, the head's runner replaying its own CUDA graphs, GLM-4.5's attention
    or DeepSeek-V3's MLA in the head): the greedy tokens of the CPU engine without speculation, with drafts
    proposed (and, for the predictive layer, kept)."""
    if family == "predictive_glm4_moe":
        folder = request.getfixturevalue("predictive")
    else:
        folder = request.getfixturevalue("deepseek_models")["v3_yarn"][0]
    prompts, params = _prompts(), SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    cpu = _mtp_engine(folder, None, device="cpu", dtype="float32")
    want = _generate(cpu, prompts, [params] * len(prompts))
    engine = _mtp_engine(folder, _spec(2), device="cuda", dtype="float32")
    assert engine.runner.attn_backend.name == "triton"
    outputs, drafts = _spec_run(engine, prompts, params, monkeypatch)
    assert {i: o[0] for i, o in outputs.items()} == {i: w[0] for i, w in want.items()}
    stats = engine.spec_stats
    assert len(drafts) > 12 and engine.drafter.is_clean(), stats
    if family == "predictive_glm4_moe":
        assert stats.num_accepted_tokens > stats.num_draft_tokens // 2, stats
    assert engine.drafter.runner.breakdown.graph_single_token_steps > 0, "the head replayed no graph"
