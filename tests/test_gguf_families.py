"""GGUF files of Gemma 1 / 2 / 3, Phi-3, Qwen2-MoE / Qwen3-MoE and Cohere's Command R / R7B, written from tiny
random transformers models as llama.cpp's convert_hf_to_gguf.py writes them (F32 tensors, so nothing is lost
to quantisation): transformers reads each back as the model it came from (where its GGUF reader takes the
architecture), plait's loader gives back the HF checkpoint's tensors and config, and plait serves the file as
transformers runs the model."""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY_VOCAB, add_gguf_shape, assert_greedy_matches_hf, random_prompts

gguf = pytest.importorskip("gguf")

from plait.config import ModelConfig  # noqa: E402
from plait.loader.gguf import load_gguf, read_gguf_config  # noqa: E402

LOGITS_ATOL = 1e-4
MAX_TOKENS = 8
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=TINY_VOCAB, max_position_embeddings=512, bos_token_id=1,
              eos_token_id=2)
# Gemma: head_dim = query_pre_attn_scalar = 256 as in the 1B-12B models (llama.cpp scales queries by
# head_dim^-1/2 outside the 27B ones; transformers' GGUF reader takes the config class's 256), a window
# shorter than the prompts.
GEMMA = COMMON | dict(num_attention_heads=2, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                      sliding_window=12, tie_word_embeddings=True)


def _configs() -> dict:
    """name -> (GGUF architecture, transformers config). The families' configs hold only what transformers'
    GGUF reader recovers (or is told: UNREAD_BY_TRANSFORMERS); the variants carry what only llama.cpp's keys
    and plait read, and are checked through plait's loader against the HF checkpoint."""
    from transformers import (
        Cohere2Config,
        CohereConfig,
        Gemma2Config,
        Gemma3TextConfig,
        GemmaConfig,
        Phi3Config,
        Qwen2MoeConfig,
        Qwen3MoeConfig,
    )

    return {
        # Six layers: llama.cpp's (and transformers') every-sixth-layer-global pattern shows; its own base
        # for the global layers, transformers' default one (10k) for the sliding ones.
        "gemma3": ("gemma3", Gemma3TextConfig(
            **GEMMA | dict(num_hidden_layers=6),
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 50_000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})),
        "qwen3_moe": ("qwen3moe", Qwen3MoeConfig(**COMMON, num_experts=8, num_experts_per_tok=3,
                                                 moe_intermediate_size=32, head_dim=32, norm_topk_prob=True,
                                                 tie_word_embeddings=True)),
        "phi3": ("phi3", Phi3Config(**COMMON, pad_token_id=None, sliding_window=None)),
        # Gemma 2's soft-caps at their released (and llama.cpp's default) values; sliding layers first.
        "gemma2": ("gemma2", Gemma2Config(**GEMMA | dict(num_hidden_layers=3), attn_logit_softcapping=50.0,
                                          final_logit_softcapping=30.0)),
        "qwen2_moe": ("qwen2moe", Qwen2MoeConfig(**COMMON, num_experts=6, num_experts_per_tok=2,
                                                 moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                                 norm_topk_prob=False)),
        # Gemma 1: a head size apart from hidden / heads (the file's key_length), rotary base 10k (its
        # converter writes none: llama.cpp's default).
        "gemma": ("gemma", GemmaConfig(**COMMON, head_dim=32, tie_word_embeddings=True)),
        # Command R+ (llama.cpp's "command-r"): per-head q/k LayerNorms, a logit scale, tied embeddings.
        "cohere": ("command-r", CohereConfig(**COMMON, pad_token_id=0, use_qk_norm=True, logit_scale=0.25,
                                             rope_parameters={"rope_type": "default", "rope_theta": 1e4})),
        # Command R7B: three sliding layers (a window shorter than the prompts) rotate, the fourth does not.
        "cohere2": ("cohere2", Cohere2Config(**COMMON | dict(num_hidden_layers=4), pad_token_id=0,
                                             sliding_window=12, logit_scale=0.5,
                                             rope_parameters={"rope_type": "default", "rope_theta": 1e4})),
        # Gemma 3 4B+: global layers linearly stretched, sliding ones on a base of their own; soft-capped
        # logits; another head size and query scale.
        "gemma3-scaled": ("gemma3", Gemma3TextConfig(
            **COMMON | dict(num_hidden_layers=6), head_dim=32, query_pre_attn_scalar=32, sliding_window=12,
            final_logit_softcapping=30.0, tie_word_embeddings=True,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1_000.0}})),
        # Gemma 2 with caps that bind, another head size and query scale.
        "gemma2-caps": ("gemma2", Gemma2Config(**GEMMA | dict(num_hidden_layers=3, head_dim=32,
                                                              query_pre_attn_scalar=32),
                                               attn_logit_softcapping=5.0, final_logit_softcapping=20.0)),
        # Phi-3-mini-4k's window; Phi-4-mini's partial rotary and LongRoPE, tied embeddings.
        "phi3-window": ("phi3", Phi3Config(**COMMON, pad_token_id=None, sliding_window=24)),
        "phi3-longrope": ("phi3", Phi3Config(
            **COMMON, pad_token_id=None, tie_word_embeddings=True, partial_rotary_factor=0.75,
            original_max_position_embeddings=128,
            rope_scaling={"type": "longrope", "short_factor": [1.0, 1.3, 1.9, 2.6, 3.4, 4.5],
                          "long_factor": [2.0, 4.0, 8.0, 12.0, 20.0, 30.0]})),
        # Written with the converter's --fuse-gate-up-exps (ffn_gate_up_exps), the shared expert's gate
        # kept [1, hidden].
        "qwen2_moe-fused": ("qwen2moe", Qwen2MoeConfig(**COMMON, num_experts=6, num_experts_per_tok=2,
                                                       moe_intermediate_size=32,
                                                       shared_expert_intermediate_size=48)),
    }


FAMILIES = ["gemma3", "qwen3_moe", "phi3", "gemma2", "qwen2_moe", "gemma", "cohere", "cohere2"]
# Families whose architecture transformers' GGUF reader does not take (Gemma 1's "gemma", Cohere's): their
# files are checked against the checkpoint they were written from only.
UNREAD_FAMILIES = ("gemma", "cohere", "cohere2")
COHERE_ARCHITECTURES = ("command-r", "cohere2")
VARIANTS = ["gemma3-scaled", "gemma2-caps", "phi3-window", "phi3-longrope", "qwen2_moe-fused"]
# Config keys transformers' GGUF reader does not map for these architectures (it would take the config class's
# defaults: Qwen2MoeConfig's 1408-wide experts...), given to it beside the file.
UNREAD_BY_TRANSFORMERS = {
    "qwen3_moe": ("moe_intermediate_size",),
    "qwen2_moe": ("moe_intermediate_size", "shared_expert_intermediate_size"),
}


# --- a GGUF file as llama.cpp's converter writes it -----------------------------------------------------


def _byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _write_tokenizer(writer, vocab_size: int) -> None:
    """A byte-level BPE vocabulary of ``vocab_size`` tokens: <unk> <s> </s>, the 256 bytes, letter pairs."""
    tokens, merges = ["<unk>", "<s>", "</s>"] + _byte_level_alphabet(), []
    letters = "abcdefghijklmnopqrstuvwxyz"
    pairs = iter((a, b) for a in letters for b in letters)
    while len(tokens) < vocab_size:
        a, b = next(pairs)
        tokens.append(a + b)
        merges.append(f"{a} {b}")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (vocab_size - 3))
    writer.add_token_merges(merges)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)  # else transformers keeps Phi3Config's 32000, past this vocabulary


def _write_metadata(writer, arch: str, cfg) -> None:
    """The hyperparameters convert_hf_to_gguf.py writes for ``arch`` (TextModel.set_gguf_parameters and the
    architecture's override)."""
    w = writer
    add_gguf_shape(w, cfg)
    if arch in COHERE_ARCHITECTURES:  # LayerNorms: the converter writes layer_norm_eps under its own key
        w.add_layer_norm_eps(cfg.layer_norm_eps)
    else:
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    rope = cfg.rope_parameters
    if arch.startswith("gemma"):  # the only key Gemma 1's converter (GemmaModel) adds beside the shape
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if arch in ("gemma", "gemma2"):  # no rope base: llama.cpp's default, 10k, is theirs
        assert rope["rope_theta"] == 10_000.0
    if arch == "gemma2":
        w.add_sliding_window(cfg.sliding_window)
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    elif arch == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
        full, local = rope["full_attention"], rope["sliding_attention"]
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
        w.add_rope_freq_base(full["rope_theta"])
        w.add_rope_freq_base_swa(local["rope_theta"])
        if cfg.final_logit_softcapping:
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    elif arch == "phi3":  # Phi3MiniModel: rotated dims, the pretraining length, window 0 for none
        rotated = int(rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size) // cfg.num_attention_heads
        w.add_rope_dimension_count(rotated)
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        w.add_sliding_window(cfg.sliding_window or 0)
        if rope.get("rope_type") == "longrope":
            scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(
                cfg.original_max_position_embeddings)) if scale > 1 else 1.0)
    elif arch in COHERE_ARCHITECTURES:  # CommandR2Model / Cohere2Model
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_logit_scale(cfg.logit_scale)
        w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
        if arch == "cohere2":
            w.add_sliding_window(cfg.sliding_window)
            w.add_vocab_size(cfg.vocab_size)
            w.add_rope_dimension_count(cfg.head_dim)
    elif arch != "gemma":  # Qwen2MoeModel / Qwen3MoeModel
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if arch == "qwen2moe":
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
        if getattr(cfg, "head_dim", None):
            w.add_key_length(cfg.head_dim)
            w.add_value_length(cfg.head_dim)


EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight")


def _gguf_tensors(checkpoint: dict[str, torch.Tensor], arch: str, cfg, fused: bool = False
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF checkpoint's tensors under llama.cpp's names and in its layouts: Gemma's norms as weight + 1,
    experts stacked per projection ([n_expert, rows, cols]; ``fused``: gate and up in one, gate rows first),
    Phi-3's LongRoPE factors as tensors; no Q/K interleaving (only llama.cpp's Llama converter permutes)."""
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch),
                                     cfg.num_hidden_layers)
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = defaultdict(dict)
    for name, tensor in checkpoint.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if m := EXPERT.fullmatch(name):
            experts[int(m[1]), m[3]][int(m[2])] = tensor
            continue
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            tensor = tensor + 1
        if name.endswith("shared_expert_gate.weight") and not fused:
            tensor = tensor.squeeze(0)  # [hidden], as Qwen1.5-MoE files (and transformers' reader) have it
        stem, kind = name.rsplit(".", 1)
        yield f"{names.get_name(stem)}.{kind}", tensor
    stacked = {key: torch.stack([by_expert[e] for e in range(len(by_expert))])
               for key, by_expert in sorted(experts.items())}
    for (layer, projection), tensor in stacked.items():
        if fused and projection != "down_proj":
            if projection == "gate_proj":
                gate_up = torch.cat([tensor, stacked[layer, "up_proj"]], dim=1)
                yield f"blk.{layer}.ffn_gate_up_exps.weight", gate_up
            continue
        yield f"{names.get_name(f'model.layers.{layer}.mlp.experts.{projection}')}.weight", tensor
    if cfg.rope_parameters.get("rope_type") == "longrope":
        for kind in ("long", "short"):
            yield f"rope_factors_{kind}.weight", torch.tensor(cfg.rope_parameters[f"{kind}_factor"])


def write_gguf(folder: Path, arch: str, cfg, path: Path, fused: bool = False) -> Path:
    """The checkpoint saved in ``folder`` as an F32 GGUF file of ``arch``, with a tokenizer."""
    from safetensors.torch import load_file

    writer = gguf.GGUFWriter(path, arch)
    _write_metadata(writer, arch, cfg)
    _write_tokenizer(writer, cfg.vocab_size)
    for name, tensor in _gguf_tensors(load_file(folder / "model.safetensors"), arch, cfg, fused):
        writer.add_tensor(name, np.ascontiguousarray(tensor.float().numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tiny_checkpoint(name: str, folder: Path):
    """(the random transformers model, its GGUF file): weights scaled up so greedy picks are clear, Gemma's
    1 + weight norms drawn away from zero."""
    from transformers import AutoModelForCausalLM

    arch, cfg = _configs()[name]
    torch.manual_seed(3000 + sorted(_configs()).index(name))
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if "norm" not in param_name:
                p.mul_(8.0)
            elif arch.startswith("gemma"):
                p.normal_(0.0, 0.3)
    model.save_pretrained(folder / "hf")
    (folder / "gguf").mkdir()  # a folder of its own: transformers must not find the HF config.json beside it
    path = folder / "gguf" / f"{name}.gguf"
    return model, write_gguf(folder / "hf", arch, cfg, path, fused=name.endswith("-fused"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (transformers model, GGUF path), made on first use."""
    made: dict[str, tuple] = {}

    def get(name: str):
        if name not in made:
            made[name] = tiny_checkpoint(name, tmp_path_factory.mktemp(f"gguf-{name}"))
        return made[name]

    return get


# --- the checks ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", [family for family in FAMILIES if family not in UNREAD_FAMILIES])
def test_transformers_reads_the_gguf_as_the_model_it_came_from(checkpoints, family):
    """The writer follows llama.cpp's conventions, independently of plait: transformers' own GGUF reader
    (its config mapping and tensor processors) rebuilds the model, same logits."""
    from transformers import AutoModelForCausalLM

    model, path = checkpoints(family)
    told = {key: getattr(model.config, key) for key in UNREAD_BY_TRANSFORMERS.get(family, ())}
    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                  attn_implementation="eager", **told).eval()
    assert type(loaded) is type(model)
    ids = torch.tensor(random_prompts(1, 40, 40, seed=5))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_plait_serves_the_gguf_as_transformers(checkpoints, family, monkeypatch, tmp_path):
    """plait's engine on the GGUF file: transformers' greedy tokens, and its logits within 1e-4, for prompts
    longer than the step budget and the sliding windows."""
    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine

    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path))  # the converted tokenizer's cache
    model, path = checkpoints(family)
    prompts = random_prompts(3, 1, 40, seed=7)
    engine = LLMEngine(EngineConfig(model=str(path), max_num_batched_tokens=32, block_size=8))
    assert_greedy_matches_hf(engine, model, prompts, MAX_TOKENS, LOGITS_ATOL, family)


def _same_model_config(got: ModelConfig, want: ModelConfig) -> None:
    """Equal field by field; GGUF keeps floats (eps, LongRoPE factors) in fp32: those to fp32's precision."""
    for f in fields(ModelConfig):
        if f.name == "raw":
            continue
        a, b = getattr(got, f.name), getattr(want, f.name)
        if f.name == "rope_scaling" and a is not None and b is not None:
            # transformers 5's rope_parameters also repeat the base and rotated share (fields of their own)
            assert set(b) - set(a) <= {"rope_theta", "partial_rotary_factor"}, (a, b)
            for key in a:
                if isinstance(a[key], str):
                    assert a[key] == b[key], key
                else:
                    np.testing.assert_allclose(a[key], b[key], rtol=1e-6, err_msg=key)
        elif isinstance(b, float):
            assert math.isclose(a, b, rel_tol=1e-6), (f.name, a, b)
        else:
            assert a == b, (f.name, a, b)


@pytest.mark.parametrize("name", FAMILIES + VARIANTS)
def test_gguf_reads_back_as_the_hf_checkpoint(checkpoints, name):
    """plait's loader gives the HF checkpoint's tensors (names, shapes, values; Gemma's norms up to the
    rounding of w + 1 in fp32) and a config plait reads as the checkpoint's config.json."""
    from safetensors.torch import load_file

    from plait.models.layer_kinds import layer_ropes, layer_types

    model, path = checkpoints(name)
    config, state_dict = load_gguf(path)
    assert read_gguf_config(path) == config
    hf_folder = path.parent.parent / "hf"
    reference = load_file(hf_folder / "model.safetensors")
    if model.config.tie_word_embeddings:
        reference.pop("lm_head.weight", None)
    assert set(state_dict) == set(reference)
    for key, want in reference.items():
        got = state_dict[key]
        assert got.dtype == torch.float32 and got.shape == want.shape, key
        if name.startswith("gemma") and key.endswith("norm.weight"):
            want = (want + 1) - 1  # the rounding of storing w + 1 in fp32
        assert torch.equal(got, want), key

    hf_config = json.loads((hf_folder / "config.json").read_text())
    got, want = ModelConfig.from_hf(config), ModelConfig.from_hf(hf_config)
    _same_model_config(got, want)
    if name.startswith(("gemma2", "gemma3")):  # completed from transformers' defaults: what GemmaModel reads
        assert layer_types(got.raw, 6) == layer_types(want.raw, 6)
        assert layer_ropes(got.raw, 1e6, 1e4) == layer_ropes(want.raw, 1e6, 1e4)
        for key in ("sliding_window", "query_pre_attn_scalar", "attn_logit_softcapping",
                    "final_logit_softcapping", "hidden_activation"):
            assert got.raw[key] == want.raw[key], key
    if name.startswith("cohere"):  # what CohereModel reads beside ModelConfig (eps kept in fp32 by GGUF)
        assert math.isclose(got.raw["layer_norm_eps"], want.raw["layer_norm_eps"], rel_tol=1e-6)
        for key in ("logit_scale", "use_qk_norm", "layer_types", "sliding_window"):
            assert got.raw.get(key) == want.raw.get(key), key


def _metadata_only_gguf(path: Path, arch: str, layers: int, **keys) -> Path:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(layers)
    writer.add_context_length(512)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(TINY_VOCAB)
    for key, value in keys.items():
        getattr(writer, f"add_{key}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(("arch", "layers_27b"), [("gemma2", 46), ("gemma3", 62)])
def test_gemma_query_scale_follows_llama_cpp(tmp_path, arch, layers_27b):
    """No key holds query_pre_attn_scalar: llama.cpp takes head_dim, but hidden / heads for the 27B models
    (told apart by their layer count), which is HF's value for every Gemma 2 / 3 release."""
    small = read_gguf_config(_metadata_only_gguf(tmp_path / "small.gguf", arch, 26, key_length=256))
    large = read_gguf_config(_metadata_only_gguf(tmp_path / "large.gguf", arch, layers_27b, key_length=32))
    assert small["query_pre_attn_scalar"] == 256 and large["query_pre_attn_scalar"] == 64 // 4
    if arch == "gemma2":  # llama.cpp's defaults where the file is silent
        caps = small["attn_logit_softcapping"], small["final_logit_softcapping"]
        assert small["sliding_window"] == 4096 and caps == (50.0, 30.0)
        assert small["layer_types"][:3] == ["sliding_attention", "full_attention", "sliding_attention"]
    else:  # no window: every layer global
        assert set(small["layer_types"]) == {"full_attention"} and small["sliding_window"] is None


def test_unsupported_architecture_is_refused_by_name(tmp_path, monkeypatch):
    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine

    path = _metadata_only_gguf(tmp_path / "falcon.gguf", "falcon", 2)
    for read in (read_gguf_config, load_gguf):
        with pytest.raises(ValueError, match=r"architecture 'falcon'.*'gemma3'.*'qwen3moe'"):
            read(path)
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="architecture 'falcon'"):
        LLMEngine(EngineConfig(model=str(path)))


def test_cohere_partial_rotary_is_refused_by_name(tmp_path):
    """Cohere2's converter writes rotary_pct's share of each head as the rotated dims; plait turns whole heads
    (every release, and transformers), so a file that says less is refused rather than misread."""
    path = _metadata_only_gguf(tmp_path / "r7b.gguf", "cohere2", 4, rope_dimension_count=8)
    with pytest.raises(ValueError, match="cohere2 with a rotary over 8 of each head's 16 channels"):
        read_gguf_config(path)
