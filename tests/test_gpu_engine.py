"""The GPU path end to end (pytest -m gpu): Triton attention, CUDA graphs and overlapped steps agree
with the torch_ref backend; every pure-decode step replays a graph; pinned staging never races."""

from __future__ import annotations

import contextlib
import json
import shutil

import numpy as np
import pytest
import torch

from plait.config import EngineConfig
from plait.engine.engine import LLMEngine
from plait.pooling_params import PoolingParams
from plait.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

NUM_PROMPTS = 64
NEW_TOKENS = 32
# bf16: a fork is rounding when the reference's top two logits were this close (in logit std); the
# largest gap measured at a fork was 0.0057, a wrong row or block moves logits by ~0.1 and more.
NEAR_TIE = 0.02
FP32_AGREEMENT = 0.95
VOCAB = 8192


def _write_config(folder, cfg: dict) -> str:
    """A model folder holding only ``cfg`` as its config.json (the engines load random weights)."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


def _config(tmp_path, head_dim: int, arch: str = "llama", layers: int = 4) -> str:
    heads = 16
    cfg = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]],
        "model_type": arch,
        "hidden_size": heads * head_dim,
        "intermediate_size": 2816,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 4,
        "head_dim": head_dim,
        "vocab_size": VOCAB,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    return _write_config(tmp_path / f"{arch}-d{head_dim}", cfg)


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 400, (NUM_PROMPTS,), generator=g).tolist()
    return [torch.randint(10, VOCAB, (n,), generator=g).tolist() for n in lens]


def _greedy(engine: LLMEngine, prompts: list[list[int]] | list[torch.Tensor], arrive_every: int
            ) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs: dict[int, list[int]] = {}
    pending, step = list(enumerate(prompts)), 0
    while pending or engine.has_unfinished_requests():
        while pending and step >= pending[0][0] * arrive_every:
            i, p = pending.pop(0)
            engine.add_request(p, params, request_id=f"r-{i}")
        for out in engine.step():
            if out.finished:
                outputs[int(out.request_id.split("-")[1])] = out.outputs[0].token_ids
        step += 1
    assert engine.is_idle_and_clean()
    return [outputs[i] for i in range(len(prompts))]


# Stands for {"model": the test's model folder, "num_speculative_tokens": 3} (the folder is made per test).
DRAFT_OF_ITS_OWN_CONFIG = "draft: the model's own config"

# Each GPU path beside the reference (torch_ref, eager, no overlap, budget 4096): name -> engine knobs.
VARIANTS = {
    "torch_ref-eager-sync": dict(attention_backend="torch_ref", enforce_eager=True, async_scheduling=False),
    "triton-eager-sync": dict(attention_backend="triton", enforce_eager=True, async_scheduling=False),
    "torch_ref-eager-async": dict(attention_backend="torch_ref", enforce_eager=True),
    "triton-graphs-async": dict(attention_backend="triton"),
    # Speculative decoding: rows of 1 + drafts tokens replayed in mixed-shape graphs, rejected drafts' KV
    # left behind num_computed_tokens; 1-token n-grams, so random prompts draft too.
    "triton-graphs-ngram": dict(attention_backend="triton", speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}),
    # A draft model (the same config, seed and embedding scale: the target's own weights): its runner's own
    # graphs, chunked catch-up forwards and shadow roll-backs beside the target's verify rows.
    "triton-graphs-draft-model": dict(attention_backend="triton", speculative_config=DRAFT_OF_ITS_OWN_CONFIG),
}

BUDGET = 256  # the variants chunk prompts; the fp32 reference takes each prompt in one step


# Random weights (std 0.02) make every layer's output larger than the embedding it adds to, so the
# residual stream is all layer outputs, each carrying its bf16 rounding, and greedy picks between
# near-equal logits: batching alone then forks half the prompts. Larger embeddings (std 2) make the
# token's own embedding dominate, as in trained models, while attention still moves the logits.
EMBED_SCALE = 100.0


def _engine(model: str, dtype: str, embed_scale: float = EMBED_SCALE, **knobs) -> LLMEngine:
    # Serving's cap on prompt tokens beside decodes: requests arrive while others decode, and the steps
    # that carry both replay mixed-shape graphs (an offline engine has no cap, so no such graphs).
    defaults = dict(load_format="dummy", seed=7, max_model_len=1024, num_kv_blocks=2048, max_num_seqs=64,
                    enable_prefix_caching=False, usage="serve")
    config = EngineConfig(model=model, dtype=dtype, **{**defaults, **knobs})
    engine = LLMEngine(config)
    with torch.no_grad():
        engine.runner.model.model.embed_tokens.weight.mul_(embed_scale)
    return engine


def sharpen_attention(engine: LLMEngine, qk_scale: float) -> None:
    """Multiply every layer's q and k projections by ``qk_scale`` (its scores by its square)."""
    with torch.no_grad():
        for layer in engine.runner.model.model.layers:
            attn = layer.self_attn
            attn.qkv_proj.weight[: attn.q_size + attn.kv_size].mul_(qk_scale)


def _first_fork(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def _agreement(got: list[list[int]], ref: list[list[int]]) -> tuple[float, list[int]]:
    forks = [_first_fork(a, b) for a, b in zip(got, ref)]
    return sum(f is None for f in forks) / len(ref), sorted(f for f in forks if f is not None)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_every_gpu_path_computes_the_reference_function_in_fp32(tmp_path, head_dim):
    """fp32 with IEEE dots in the kernels: chunking, overlap, graphs and Triton attention change only
    fp32 rounding, so a fork would mean a bug (a wrong token, row, slot or padded row)."""
    model = _config(tmp_path, head_dim)
    prompts = _prompts(head_dim)
    ref = _greedy(_engine(model, "float32", attention_backend="torch_ref", enforce_eager=True,
                          async_scheduling=False, max_num_batched_tokens=4096), prompts, 0)
    for name, knobs in VARIANTS.items():
        if knobs.get("speculative_config") == DRAFT_OF_ITS_OWN_CONFIG:
            knobs = {**knobs, "speculative_config": {"model": model, "num_speculative_tokens": 3}}
        engine = _engine(model, "float32", max_num_batched_tokens=BUDGET, **knobs)
        draft_runner = getattr(engine.drafter, "runner", None)
        if draft_runner is not None:
            with torch.no_grad():
                draft_runner.model.model.embed_tokens.weight.mul_(EMBED_SCALE)
        agree, forks = _agreement(_greedy(engine, prompts, arrive_every=2), ref)
        assert agree >= FP32_AGREEMENT, f"{name}: {agree:.0%} agree; first forks at {forks}"
        if engine.runner.graphs is not None:
            b = engine.runner.breakdown
            assert b.graph_single_token_steps == b.single_token_steps
            # A draft model drafts on every decode step (the target's own choices, all kept), so only the
            # target's verify rows run: none of one token.
            assert b.single_token_steps > 0 or knobs.get("speculative_config", {}).get("model")
        if draft_runner is not None:  # the target's own choices, in another batch: nearly all kept
            spec = engine.spec_stats
            assert spec.num_accepted_tokens >= 0.9 * spec.num_draft_tokens > 0, spec
            assert engine.drafter.is_clean() and draft_runner.breakdown.graph_single_token_steps > 0
        elif engine.drafter is not None:
            spec = engine.spec_stats
            assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens, spec


def test_qwen3_q_k_norms_fused_with_rotary_compute_the_reference_function_in_fp32(tmp_path):
    """Qwen3's per-head q/k RMSNorms run inside the rotary + KV-store launch on the Triton path (graphs,
    overlap, chunks): greedy fp32 outputs equal the reference's, where they are separate torch ops."""
    import plait.attention.triton_backend as tb
    from plait.kernels import rope_store

    model = _config(tmp_path, 128, arch="qwen3")
    prompts = _prompts(3)[:16]
    ref = _greedy(_engine(model, "float32", attention_backend="torch_ref", enforce_eager=True,
                          async_scheduling=False, max_num_batched_tokens=4096), prompts, 0)
    fused = []
    launch = rope_store.rope_store_kv

    def counting(*args, **kwargs):
        fused.append(kwargs.get("qk_norm", args[9] if len(args) > 9 else None) is not None)
        return launch(*args, **kwargs)

    rope_store.rope_store_kv = tb.rope_store_kv = counting
    try:
        engine = _engine(model, "float32", attention_backend="triton", max_num_batched_tokens=BUDGET)
        agree, forks = _agreement(_greedy(engine, prompts, arrive_every=2), ref)
    finally:
        rope_store.rope_store_kv = tb.rope_store_kv = launch
    assert fused and all(fused)  # every layer's norms went through the fused launch
    assert agree >= FP32_AGREEMENT, f"{agree:.0%} agree; first forks at {forks}"


def _gemma_config(tmp_path, family: str) -> str:
    """A Gemma config at its real head dim (256) with random weights: sliding layers with a window shorter
    than most prompts beside global ones, GeGLU, soft-capped logits; Gemma 3's q/k norms and per-kind
    rotary, Gemma 2's soft-capped attention scores."""
    cfg = {
        "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 256, "query_pre_attn_scalar": 256, "vocab_size": VOCAB,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "sliding_window": 64,
        "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
    }
    sliding, full = "sliding_attention", "full_attention"
    if family == "gemma":  # Gemma 1: no window, no caps, no post-norms
        for key in ("sliding_window", "final_logit_softcapping", "query_pre_attn_scalar"):
            del cfg[key]
        cfg |= {"architectures": ["GemmaForCausalLM"], "model_type": "gemma", "hidden_act": "gelu"}
    elif family == "gemma3":
        cfg |= {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                "layer_types": [sliding, sliding, full, sliding],
                "rope_parameters": {full: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                    sliding: {"rope_type": "default", "rope_theta": 10000.0}}}
    else:
        cfg |= {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
                "attn_logit_softcapping": 50.0}
    return _write_config(tmp_path / family, cfg)


@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3"])
def test_gemma_on_the_gpu_path_computes_the_reference_function_in_fp32(tmp_path, family):
    """Gemma through Triton (per-layer windows and rotaries, Gemma 3's 1 + weight q/k norms fused into the
    rotary launch, Gemma 2's capped scores, GeGLU), CUDA graphs and overlap, against torch_ref, eager and
    synchronous, in fp32."""
    from plait.attention import triton_backend as tb
    from plait.kernels import rope_store

    model = _gemma_config(tmp_path, family)
    prompts = _prompts(5)[:24]
    ref = _greedy(_engine(model, "float32", attention_backend="torch_ref", enforce_eager=True,
                          async_scheduling=False, max_num_batched_tokens=4096), prompts, 0)
    norms, caps = [], []
    store, attend = rope_store.rope_store_kv, tb.paged_attention

    def counting_store(*args, **kwargs):
        norm = kwargs.get("qk_norm", args[9] if len(args) > 9 else None)
        norms.append(norm is not None and norm.unit_offset)
        return store(*args, **kwargs)

    def counting_attend(*args, **kwargs):
        caps.append(kwargs.get("softcap", 0.0))
        return attend(*args, **kwargs)

    rope_store.rope_store_kv = tb.rope_store_kv = counting_store
    tb.paged_attention = counting_attend
    try:
        engine = _engine(model, "float32", attention_backend="triton", max_num_batched_tokens=BUDGET)
        agree, forks = _agreement(_greedy(engine, prompts, arrive_every=2), ref)
    finally:
        rope_store.rope_store_kv = tb.rope_store_kv = store
        tb.paged_attention = attend
    # Every layer's Gemma 3 norms went through the fused launch, and every Gemma 2 launch capped its scores.
    assert norms and all(norms) if family == "gemma3" else not any(norms)
    assert caps and (all(c == 50.0 for c in caps) if family == "gemma2" else not any(caps))
    assert agree >= FP32_AGREEMENT, f"{agree:.0%} agree; first forks at {forks}"
    b = engine.runner.breakdown
    assert b.single_token_steps > 0 and b.graph_single_token_steps == b.single_token_steps


def _dense_family_config(tmp_path, family: str) -> str:
    """Granite (its four multipliers), OLMo 3 (post-sublayer norms, q/k normalised across heads, sliding
    layers beside a YaRN-scaled global one), SmolLM3 (its last layer without rotary, and windowed),
    Ministral 3 (YaRN, queries scaled by position past a 64-token period), EXAONE 4.0 (per-head q/k norms,
    a global layer without rotary after three sliding ones), GLM-4-0414 (GPT-J pairs over half of each head,
    reordered at load), ERNIE 4.5 (the same over whole heads), Command R+ (Cohere: LayerNorms, attention
    and MLP in parallel, per-head q/k LayerNorms, GPT-J pairs, logit_scale), Command R7B (Cohere2: windows of
    64 on three layers, which alone rotate) at Llama-8B's head dim, or GPT-OSS (sinks, windows of 64, YaRN,
    experts with biases and the clamped SwiGLU) at its head dim 64; random weights."""
    cfg = {
        "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 128, "vocab_size": VOCAB, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
    }
    sliding, full = "sliding_attention", "full_attention"
    if family == "granite":
        cfg |= {"architectures": ["GraniteForCausalLM"], "model_type": "granite", "rope_theta": 10000.0,
                "embedding_multiplier": 12.0, "attention_multiplier": 0.0078125, "residual_multiplier": 0.22,
                "logits_scaling": 8.0}
    elif family == "ministral3":
        cfg |= {"architectures": ["Ministral3ForCausalLM"], "model_type": "ministral3",
                "rope_parameters": {"rope_type": "yarn", "factor": 16.0, "rope_theta": 1e6,
                                    "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                    "beta_slow": 1.0, "llama_4_scaling_beta": 0.1}}
    elif family == "exaone4":
        cfg |= {"architectures": ["Exaone4ForCausalLM"], "model_type": "exaone4", "sliding_window": 64,
                "layer_types": [sliding, sliding, sliding, full], "rope_theta": 1e6}
    elif family == "glm4":
        cfg |= {"architectures": ["Glm4ForCausalLM"], "model_type": "glm4", "partial_rotary_factor": 0.5,
                "attention_bias": True, "rope_theta": 10000.0}
    elif family == "ernie4_5":
        cfg |= {"architectures": ["Ernie4_5ForCausalLM"], "model_type": "ernie4_5", "rope_theta": 500000.0}
    elif family in ("cohere", "cohere2"):  # eos inside the vocabulary (CohereConfig's is 255001)
        cfg |= {"model_type": family, "eos_token_id": 1, "logit_scale": 0.25, "tie_word_embeddings": True}
        if family == "cohere":
            cfg |= {"architectures": ["CohereForCausalLM"], "use_qk_norm": True, "rope_theta": 8e6}
        else:
            cfg |= {"architectures": ["Cohere2ForCausalLM"], "sliding_window": 64,
                    "sliding_window_pattern": 4, "rope_theta": 50000.0}
    elif family == "gpt_oss":
        cfg |= {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "head_dim": 64,
                "num_attention_heads": 16, "num_local_experts": 8, "num_experts_per_tok": 4,
                "intermediate_size": 1024, "sliding_window": 64, "layer_types": [sliding, full] * 2,
                "rope_theta": 150000.0,
                "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "original_max_position_embeddings": 256}}
    elif family == "smollm3":
        cfg |= {"architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "rope_theta": 5_000_000.0,
                "no_rope_layers": [1, 1, 1, 0], "use_sliding_window": True, "sliding_window": 64,
                "layer_types": [full, full, full, sliding]}
    else:
        cfg |= {"architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", "sliding_window": 64,
                "eos_token_id": 1, "layer_types": [sliding, sliding, sliding, full],
                "rope_parameters": {full: {"rope_type": "yarn", "factor": 8.0, "rope_theta": 500000.0,
                                           "original_max_position_embeddings": 256},
                                    sliding: {"rope_type": "default", "rope_theta": 500000.0}}}
    return _write_config(tmp_path / family, cfg)


@pytest.mark.parametrize("family", ["granite", "olmo3", "smollm3", "ministral3", "exaone4", "glm4",
                                    "ernie4_5", "cohere", "cohere2", "gpt_oss"])
def test_dense_families_on_the_gpu_path_compute_the_reference_function_in_fp32(tmp_path, family):
    """Granite, OLMo 3, SmolLM3 and Ministral 3 through Triton (OLMo's round-once norms over whole q/k rows,
    its windows and YaRN table in the rotary launch; SmolLM3's unrotated store; Ministral 3's scaled
    queries), CUDA graphs and overlap, against torch_ref, eager and synchronous, fp32."""
    model = _dense_family_config(tmp_path, family)
    prompts = _prompts(6)[:24]
    ref = _greedy(_engine(model, "float32", attention_backend="torch_ref", enforce_eager=True,
                          async_scheduling=False, max_num_batched_tokens=4096), prompts, 0)
    engine = _engine(model, "float32", attention_backend="triton", max_num_batched_tokens=BUDGET)
    agree, forks = _agreement(_greedy(engine, prompts, arrive_every=2), ref)
    assert agree >= FP32_AGREEMENT, f"{agree:.0%} agree; first forks at {forks}"
    b = engine.runner.breakdown
    assert b.single_token_steps > 0 and b.graph_single_token_steps == b.single_token_steps


# A Phi-4-mini-shaped LongRoPE Phi-3 pretrained on this many positions: most prompts and outputs cross it.
PHI3_ORIGINAL_MAX_POSITIONS = 256


def _phi3_config(tmp_path) -> str:
    """A Phi-4-mini-shaped Phi-3 (heads of 128 channels, 96 of them rotated, LongRoPE) with random weights."""
    rotary_half = 48
    cfg = {
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 2048,
        "intermediate_size": 2816, "num_hidden_layers": 4, "num_attention_heads": 16,
        "num_key_value_heads": 4, "vocab_size": VOCAB, "max_position_embeddings": 2048,
        "original_max_position_embeddings": PHI3_ORIGINAL_MAX_POSITIONS, "partial_rotary_factor": 0.75,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": True,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(rotary_half)],
                         "long_factor": [1.0 + 2.0 * i for i in range(rotary_half)]},
    }
    return _write_config(tmp_path / "phi3", cfg)


def test_phi3_longrope_on_the_gpu_path_computes_the_reference_function_in_fp32(tmp_path):
    """A partial LongRoPE Phi-3 through Triton (the rotary of 96 of 128 channels in the KV store's launch),
    chunks, CUDA graphs and overlap, against torch_ref taking each prompt in one step, in fp32: prompts and
    outputs cross the pretraining length, and each position's short or long rotation is its own whatever
    else is in its step."""
    from plait.attention import triton_backend as tb
    from plait.kernels import rope_store

    model = _phi3_config(tmp_path)
    prompts = _prompts(9)[:24]
    assert sum(len(p) < PHI3_ORIGINAL_MAX_POSITIONS < len(p) + NEW_TOKENS for p in prompts) > 0
    ref = _greedy(_engine(model, "float32", attention_backend="torch_ref", enforce_eager=True,
                          async_scheduling=False, max_num_batched_tokens=4096), prompts, 0)
    widths = []
    store = rope_store.rope_store_kv

    def counting_store(*args, **kwargs):
        widths.append(args[4].shape[1])  # the cos_sin table's width: the rotated channels
        return store(*args, **kwargs)

    rope_store.rope_store_kv = tb.rope_store_kv = counting_store
    try:
        for name in ("torch_ref-eager-async", "triton-graphs-async"):
            engine = _engine(model, "float32", max_num_batched_tokens=BUDGET, **VARIANTS[name])
            agree, forks = _agreement(_greedy(engine, prompts, arrive_every=2), ref)
            assert agree >= FP32_AGREEMENT, f"{name}: {agree:.0%} agree; first forks at {forks}"
    finally:
        rope_store.rope_store_kv = tb.rope_store_kv = store
    assert widths and set(widths) == {96}
    b = engine.runner.breakdown
    assert b.single_token_steps > 0 and b.graph_single_token_steps == b.single_token_steps


def fork_gaps(got: list[list[int]], ref: list[list[int]], ref_logits: dict) -> list[float]:
    """At each prompt's first fork from ``ref``, the reference's logit for its own token minus its logit for
    ``got``'s, in the standard deviations of that logits row (``ref_logits``: _greedy_with_logits's)."""
    gaps = []
    for i, (a, b) in enumerate(zip(got, ref)):
        f = _first_fork(a, b)
        if f is not None:
            row = ref_logits[i][f]
            gaps.append(float(row[b[f]] - row[a[f]]) / float(row.std()))
    return gaps


def _greedy_with_logits(engine: LLMEngine, prompts: list[list[int]]) -> tuple[list[list[int]], dict]:
    """Greedy outputs, and each request's sampled logits rows (to weigh a fork by its logit gap)."""
    logits: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(prompts))}
    collect = engine.runner.collect

    def capturing(step):
        out = collect(step)
        for k, s in enumerate(out.sampled):
            if not s.request.is_finished:
                logits[int(s.request.request_id.split("-")[1])].append(out.logits[k].float().cpu())
        return out

    engine.runner.collect = capturing
    return _greedy(engine, prompts, arrive_every=2), logits


# The bf16 bar's model. Random weights put the top two logits of a 4-layer random Llama (the fp32 tests')
# within a few thousandths of a standard deviation on ~2% of tokens, and any last-bit difference in
# attention, grown through the bf16 activations of every later layer, flips such a tie: Triton against
# torch_ref agreed on 83% / 56-61% of prompts there (head dims 64 / 128), every fork at a near-tie, and
# no kernel arithmetic reached 90% (benchmarks/results/bf16_agreement_precision_h200.json). Decisiveness is
# what a trained model has and a random one lacks; each knob that buys it can also blind the test, so
# each was measured against a kernel with a doubled softmax scale (benchmarks/bf16_agreement_gpu.py):
# - one layer: rounding no longer grows through later layers, while a bug is as large as at the first;
# - embeddings 1,000x (std 20): the token's own embedding dominates its residual stream, as in trained
#   models, so attention's rounding moves the logits less; alone it also hides a wrong scale;
# - q and k 2x (scores 4x): attention peaks on a few keys, as trained heads do, so a wrong scale or key
#   changes its output by much more than rounding does.
BF16_LAYERS = 1
BF16_EMBED_SCALE = 1000.0
BF16_QK_SCALE = 2.0
BF16_AGREEMENT = 0.90  # issue 4's bar: the first 32 greedy tokens identical on 90% of 64 prompts
WRONG_SCALE = 2.0


def bf16_engine(model: str, backend: str, embed_scale: float = BF16_EMBED_SCALE,
                qk_scale: float = BF16_QK_SCALE) -> LLMEngine:
    """The bf16 bar's engine: batching held fixed (budget, arrivals, eager, no overlap) across backends."""
    engine = _engine(model, "bfloat16", embed_scale, attention_backend=backend, enforce_eager=True,
                     async_scheduling=False, max_num_batched_tokens=BUDGET)
    sharpen_attention(engine, qk_scale)
    return engine


@contextlib.contextmanager
def wrong_softmax_scale(factor: float):
    """Within the block the Triton backend multiplies its softmax scale by ``factor``: an injected bug."""
    from plait.attention.triton_backend import TritonBackend

    original = TritonBackend.attend

    def attend(backend, q, kv_cache, batch, scale, *args, **kwargs):
        return original(backend, q, kv_cache, batch, scale * factor, *args, **kwargs)

    TritonBackend.attend = attend
    try:
        yield
    finally:
        TritonBackend.attend = original


@pytest.mark.parametrize("head_dim", [64, 128])
def test_triton_agrees_with_torch_ref_in_bf16(tmp_path, head_dim):
    """Issue 4's bar: with batching held fixed the only difference is the attention backend, and Triton's
    first 32 greedy tokens equal torch_ref's on at least 90% of 64 prompts; the reference is
    deterministic, and wherever Triton forks from it the reference's own logits were a near-tie (a kernel
    bug moves logits by a sizeable part of their spread and forks at confident tokens).

    The bar can fail: the same kernel with its softmax scale doubled (a kernel that read the wrong head
    dim, say) falls below it. On an H200 (benchmarks/results/bf16_agreement_shapes_h200.json), this
    model's correct kernel agreed on 100% / 97% of the test's prompts and 94-98% / 95-97% of four other
    prompt sets (head dims 64 / 128), the doubled scale on 72% / 34% and 61-73% / 36-53%."""
    model = _config(tmp_path, head_dim, layers=BF16_LAYERS)
    prompts = _prompts(head_dim)
    ref, ref_logits = _greedy_with_logits(bf16_engine(model, "torch_ref"), prompts)
    again = _greedy(bf16_engine(model, "torch_ref"), prompts, 2)
    got = _greedy(bf16_engine(model, "triton"), prompts, 2)
    with wrong_softmax_scale(WRONG_SCALE):
        wrong = _greedy(bf16_engine(model, "triton"), prompts, 2)
    agree, forks = _agreement(got, ref)
    gaps = fork_gaps(got, ref, ref_logits)
    wrong_agree = _agreement(wrong, ref)[0]
    print(f"\nbf16 d{head_dim}: triton vs torch_ref {agree:.0%} agree; first forks at {forks}; "
          f"reference logit gap at each fork (logit std): {sorted(round(g, 4) for g in gaps)}; "
          f"softmax scale x{WRONG_SCALE}: {wrong_agree:.0%} agree")
    assert _agreement(again, ref)[0] == 1.0, "the reference is not deterministic"
    assert agree >= BF16_AGREEMENT, f"{agree:.0%} agree; first forks at {forks}"
    assert all(0 <= g <= NEAR_TIE for g in gaps), f"a fork at a confident token: gaps {sorted(gaps)}"
    assert wrong_agree < BF16_AGREEMENT, f"a doubled softmax scale passes the bar ({wrong_agree:.0%})"


def test_staging_never_overwrites_a_copy_in_flight():
    """Hazard 9: the host fills pinned buffers while the stream is held up; every step must still
    arrive intact, so a buffer is reused only after the copy that read it completed. The copies run on
    their own stream ahead of the compute stream, so this also checks that a staging buffer is not
    overwritten before the landing launch that reads it, and that an input id still on the device is
    read after the step that samples it (each step's prev ids are written late, behind a sleep)."""
    from plait.runner.forward_batch import StepArrays
    from plait.runner.input_buffers import InputBuffers, Layout

    buffers = InputBuffers(Layout(max_tokens=64, max_rows=8, block_table_width=4), torch.device("cuda"))
    seen, expected = [], []
    for step in range(12):
        torch.cuda._sleep(2_000_000)  # keep the stream busy so copies queue up behind it
        prev_ids = torch.full((3,), -5, dtype=torch.long, device="cuda")
        prev_ids.fill_(9000 + step)  # "sampled" behind the sleep, in stream order
        ids = np.arange(step * 100, step * 100 + 5, dtype=np.int64)
        arrays = StepArrays(
            input_ids=ids.copy(),
            positions=np.arange(5),
            slot_mapping=np.arange(5) + 16,
            query_start_loc=np.array([0, 5]),
            context_lens=np.array([0]),
            seq_lens=np.array([5]),
            is_first_chunk=np.array([1]),
            state_slots=np.array([0]),
            block_tables=np.array([[step]]),
            sample_indices=np.array([4]),
            sample_rows=[0],
            pending_rows=[0] if step % 2 else [],
        )
        views = buffers.stage(arrays, np.array([2] if step % 2 else [], dtype=np.int64), prev_ids)
        seen.append((views["input_ids"].clone(), views["block_tables"].clone()))  # stream-ordered
        ids[4] = 9000 + step if step % 2 else ids[4]
        expected.append((ids, step))
    torch.cuda.synchronize()
    for (got_ids, got_table), (want_ids, want_table) in zip(seen, expected):
        assert got_ids.cpu().tolist() == want_ids.tolist()
        assert got_table.dtype == torch.int32 and got_table.cpu().tolist() == [[want_table]]


def test_gpu_engine_with_graphs_is_freed_without_the_cycle_collector(tmp_path):
    """The CUDA engine froze the heap at start-up; its graphs must not tie it into a reference cycle, or
    a dropped engine would keep its KV cache on the GPU for good."""
    import gc

    from test_engine import freed_when_dropped

    # An earlier CUDA engine's freeze is let go (as each engine's start does, collect_dropped_engines), so
    # what is frozen afterwards is this engine's doing.
    gc.unfreeze()
    freed = freed_when_dropped(model=_config(tmp_path, 64), load_format="dummy", max_model_len=256,
                               num_kv_blocks=64, max_num_seqs=8)
    assert gc.get_freeze_count() > 0
    assert freed == [True] * len(freed)


def test_kv_cache_memory_bytes_sizes_the_gpu_cache_without_the_utilisation_share(tmp_path):
    """vLLM's kv_cache_memory_bytes on the GPU: the cache takes that many bytes whatever
    gpu_memory_utilization says (a share far too small for any cache here), and the engine generates."""
    model = _config(tmp_path, 64)
    sized = _engine(model, "bfloat16", num_kv_blocks=None, kv_cache_memory_bytes=256 * 2**20,
                    gpu_memory_utilization=0.01)
    runner = sized.runner
    per_block = runner._bytes_per_block()
    assert runner.num_kv_blocks == 256 * 2**20 // per_block
    assert sum(t.numel() * t.element_size() for t in runner.kv_caches) == runner.num_kv_blocks * per_block
    (out,) = _greedy(sized, [[5, 6, 7, 8]], arrive_every=0)
    assert len(out) == NEW_TOKENS


def test_cuda_graph_sizes_capture_only_the_chosen_decode_batches(tmp_path):
    """vLLM's cuda_graph_sizes on the GPU: decode steps of 1 or 2 rows replay graphs, those of 4 rows run
    eager, and the tokens are the default buckets' engine's (fp32)."""
    model = _config(tmp_path, 64)
    prompts = [[5 + i, 6, 7, 8, 9] for i in range(4)]
    want = _greedy(_engine(model, "float32"), prompts, arrive_every=0)
    chosen = _engine(model, "float32", cuda_graph_sizes=[1, 2])
    chosen.record_timeline = True
    assert sorted({s.decode_rows for s in chosen.runner.graph_shapes if not s.is_mixed}) == [1, 2]
    assert _greedy(chosen, prompts, arrive_every=0) == want
    decodes = [s for s in chosen.timeline if s.num_prefill_tokens == 0]
    assert {s.used_cuda_graph for s in decodes if s.num_rows == 4} == {False}
    chosen.timeline.clear()
    assert _greedy(chosen, prompts[:1], arrive_every=0) == want[:1]
    alone = [s for s in chosen.timeline if s.num_prefill_tokens == 0]
    assert alone and all(s.used_cuda_graph for s in alone)


def _prompt_logprobs(engine: LLMEngine, prompts: list[list[int]], arrive_every: int) -> dict[int, list]:
    """Greedy runs where every third request asks for prompt logprobs (top 2); the others decode beside
    their chunks, so those chunks ride in mixed steps (graph replays where a shape fits)."""
    asks = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    plain = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    got, pending, step = {}, list(enumerate(prompts)), 0
    while pending or engine.has_unfinished_requests():
        while pending and step >= pending[0][0] * arrive_every:
            i, p = pending.pop(0)
            engine.add_request(p, asks if i % 3 == 0 else plain, request_id=f"r-{i}")
        for out in engine.step():
            if out.finished and out.prompt_logprobs is not None:
                got[int(out.request_id.split("-")[1])] = out.prompt_logprobs
        step += 1
    assert engine.is_idle_and_clean()
    return got


def test_prompt_logprobs_on_the_gpu_path_match_the_reference_in_fp32(tmp_path):
    """Prompt logprobs read the hidden states of chunked, overlapped, graph-replayed mixed steps: in fp32
    they equal those of the torch_ref engine that takes each prompt whole, position by position."""
    model = _config(tmp_path, 64)
    prompts = _prompts(64)[:24]
    ref = _prompt_logprobs(_engine(model, "float32", attention_backend="torch_ref", enforce_eager=True,
                                   async_scheduling=False, max_num_batched_tokens=4096), prompts, 0)
    engine = _engine(model, "float32", max_num_batched_tokens=BUDGET, attention_backend="triton")
    got = _prompt_logprobs(engine, prompts, arrive_every=2)
    assert sorted(got) == sorted(ref) == list(range(0, 24, 3))
    assert engine.runner.breakdown.graph_steps > 0
    for i in ref:
        assert len(got[i]) == len(ref[i]) == len(prompts[i]) and got[i][0] is None
        a = torch.tensor([e.logprob for e in got[i][1:]])
        b = torch.tensor([e.logprob for e in ref[i][1:]])
        torch.testing.assert_close(a, b, atol=1e-3, rtol=0)
        assert [e.token_id for e in got[i][1:]] == prompts[i][1:]


def _embed(engine: LLMEngine, prompts: list[list[int]], arrive_every: int) -> torch.Tensor:
    """Every prompt's pooled output (an embedding [N, hidden], a classifier's probabilities [N, labels]),
    prompts arriving every ``arrive_every`` steps."""
    got, pending, step = {}, list(enumerate(prompts)), 0
    while pending or engine.has_unfinished_requests():
        while pending and step >= pending[0][0] * arrive_every:
            i, p = pending.pop(0)
            engine.add_request(p, PoolingParams(), request_id=f"r-{i}")
        for out in engine.step():
            got[int(out.request_id.split("-")[1])] = out.outputs.data
        step += 1
    assert engine.is_idle_and_clean()
    return torch.stack([got[i] for i in range(len(prompts))])


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_embeddings_on_the_gpu_path_match_the_reference(tmp_path, pooling_type):
    """A pooling model's embeddings from chunked, overlapped, graph-replayed prompt steps on the Triton path
    equal those of the torch_ref engine that takes each prompt whole (fp32), and stay within bf16 rounding of
    them in bf16."""
    model = _config(tmp_path, 128)
    prompts = _prompts(3)[:32]
    pooling = dict(runner="pooling", pooler_config={"pooling_type": pooling_type})
    ref = _embed(_engine(model, "float32", attention_backend="torch_ref", enforce_eager=True,
                         async_scheduling=False, max_num_batched_tokens=4096, **pooling), prompts, 0)
    fast = _engine(model, "float32", max_num_batched_tokens=BUDGET, attention_backend="triton", **pooling)
    torch.testing.assert_close(_embed(fast, prompts, arrive_every=2), ref, atol=1e-4, rtol=0)
    graphs = fast.runner.graphs
    assert fast.runner.breakdown.graph_steps > 0 and all(s.decode_rows == 0 for s in graphs.shapes)
    bf16 = _engine(model, "bfloat16", max_num_batched_tokens=BUDGET, attention_backend="triton", **pooling)
    cosine = torch.nn.functional.cosine_similarity(_embed(bf16, prompts, arrive_every=2), ref)
    assert cosine.min() > 0.99, cosine


def test_classifier_on_the_gpu_path_matches_the_reference(tmp_path):
    """A ...ForSequenceClassification model's probabilities from the Triton path (chunked, overlapped,
    graph-replayed) equal the torch_ref engine's in fp32, and stay close in bf16."""
    folder = tmp_path / "classifier"
    shutil.copytree(_config(tmp_path, 64), folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(architectures=["LlamaForSequenceClassification"], id2label={"0": "a", "1": "b", "2": "c"})
    (folder / "config.json").write_text(json.dumps(cfg))
    prompts = _prompts(5)[:24]
    ref = _embed(_engine(str(folder), "float32", attention_backend="torch_ref", enforce_eager=True,
                         async_scheduling=False, max_num_batched_tokens=4096), prompts, 0)
    fast = _engine(str(folder), "float32", max_num_batched_tokens=BUDGET, attention_backend="triton")
    assert fast.pooler.spec.task == "classify" and ref.shape == (24, 3)
    torch.testing.assert_close(_embed(fast, prompts, arrive_every=2), ref, atol=1e-4, rtol=0)
    assert fast.runner.breakdown.graph_steps > 0
    bf16 = _engine(str(folder), "bfloat16", max_num_batched_tokens=BUDGET, attention_backend="triton")
    assert (_embed(bf16, prompts, arrive_every=2) - ref).abs().max() < 0.05


def test_prompt_embeds_replay_in_graphs_as_their_token_ids(tmp_path):
    """Prompts given as embeddings (the embedding rows of token prompts) through Triton, CUDA graphs (mixed
    steps replay with the staged rows) and overlap answer as the token prompts do (fp32)."""
    model = _config(tmp_path, 64)
    prompts = _prompts(9)[:16]
    engine = _engine(model, "float32", attention_backend="triton", max_num_batched_tokens=BUDGET,
                     enable_prompt_embeds=True)
    want = _greedy(engine, prompts, arrive_every=2)
    weight = engine.runner.model.model.embed_tokens.weight
    embeds = [weight[torch.tensor(p, device=weight.device)].cpu() for p in prompts]
    b = engine.runner.breakdown
    graph_steps = b.graph_steps
    assert _greedy(engine, embeds, arrive_every=2) == want  # the engine takes a [tokens, hidden] tensor
    assert b.graph_steps > graph_steps


def test_logits_processors_on_the_gpu_path(tmp_path):
    """Custom logits processors on the device's sampler, with graphs and overlapped steps: the target-token
    one changes only the rows that ask (greedy and sampled), the successor one reads every last token."""
    from test_logits_processors import Successor, TargetToken

    model = _config(tmp_path, 64)
    prompts = _prompts(11)[:9]
    engine = _engine(model, "float32", attention_backend="triton", logits_processors=[TargetToken, Successor])
    target = {"target_token": 7}
    kinds = [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, extra_args=target),
             SamplingParams(temperature=1.0, seed=3, max_tokens=NEW_TOKENS, ignore_eos=True,
                            extra_args=target),
             SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)]
    for i, p in enumerate(prompts):
        engine.add_request(p, kinds[i % 3], request_id=f"r-{i}")
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    for i in range(len(prompts)):
        out = outs[f"r-{i}"]
        first = 7 if i % 3 < 2 else out[0]  # the target first (Successor waits for an output), then its chain
        assert out == [(first + k) % VOCAB for k in range(NEW_TOKENS)], (i, out)
    assert engine.runner.breakdown.graph_steps > 0


@pytest.mark.parametrize("knobs,decode_sizes", [
    (dict(optimization_level=0), None),
    (dict(compilation_config={"cudagraph_mode": "NONE"}), None),
    (dict(compilation_config='{"cudagraph_capture_sizes": [1, 2], "level": 3}'), [1, 2]),
])
def test_vllm_compilation_knobs_choose_the_gpu_graphs(tmp_path, knobs, decode_sizes):
    """-O0 and cudagraph_mode NONE capture nothing; capture sizes capture exactly those decode batches."""
    model = _config(tmp_path, 64)
    engine = _engine(model, "float32", attention_backend="triton", **knobs)
    if decode_sizes is None:
        assert engine.runner.graphs is None and not engine.runner.graph_shapes
    else:
        assert sorted({s.decode_rows for s in engine.runner.graph_shapes if not s.is_mixed}) == decode_sizes
    prompts = [[5 + i, 6, 7, 8, 9] for i in range(3)]
    assert _greedy(engine, prompts, arrive_every=0) == _greedy(_engine(model, "float32"), prompts, 0)
