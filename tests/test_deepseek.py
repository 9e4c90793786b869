"""DeepSeek-V2 / V3 (MLA over the latent cache, DeepSeek's MoE) against transformers, fp32 on CPU."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import TINY_VOCAB, assert_engines_agree, assert_greedy_matches_hf, random_prompts
from test_glm4_moe import _mtp_tensors  # the same MTP layer layout (eh_proj, enorm, hnorm, shared_head)

from plait.config import GROUP_LIMITED_ROUTER, NOAUX_TC_ROUTER, SOFTMAX_ROUTER, EngineConfig, ModelConfig
from plait.engine.engine import LLMEngine
from plait.layers.moe import NoAuxTcRouter, SoftmaxGroupRouter, route_group_limited
from plait.sampling_params import SamplingParams

LOGITS_ATOL = 1e-4
MAX_TOKENS = 6
WEIGHT_SCALE = 4.0  # clear argmax winners (as test_glm4_moe)
ROUTER_STD = 0.25  # router logits of std ~2: softmax / sigmoid scores spread, not saturated
BIAS_STD = 0.3  # noaux_tc's correction bias: large enough to move expert choices
# The tiny MLA: latent 32 + rope 16 = a 48-wide cache row (the Triton kernel's rope dot needs 16 columns); 4
# heads of 16 nope + 16 rope query channels and 12 value channels.
KV_LORA_RANK, ROPE_DIM, NOPE_DIM, V_DIM, HEADS, LAYERS = 32, 16, 16, 12, 4, 3
ROW_WIDTH = KV_LORA_RANK + ROPE_DIM
# DeepSeek's YaRN (as V3's config, with mscale != mscale_all_dim so both the rotary's attention factor and
# the softmax scale's mscale^2 differ from 1).
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32,
        "beta_slow": 1, "mscale": 0.9, "mscale_all_dim": 0.7, "rope_theta": 10000.0}
VARIANTS = ("v2_lite", "v2_q_lora_grouped", "v3_yarn")
STEP = {"max_num_batched_tokens": 40, "block_size": 8}  # prompts chunked over steps beside decodes


def _config(variant: str):
    from transformers import DeepseekV2Config, DeepseekV3Config

    common = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, vocab_size=TINY_VOCAB, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=None, kv_lora_rank=KV_LORA_RANK,
                  qk_nope_head_dim=NOPE_DIM, qk_rope_head_dim=ROPE_DIM, v_head_dim=V_DIM, n_routed_experts=8,
                  num_experts_per_tok=3, first_k_dense_replace=1, tie_word_embeddings=False)
    if variant == "v2_lite":  # q_proj, the softmax greedy router, 2 shared experts
        return DeepseekV2Config(**common, q_lora_rank=None, n_shared_experts=2, topk_method="greedy",
                                routed_scaling_factor=1.5)
    if variant == "v2_q_lora_grouped":  # q_a_proj / q_a_layernorm / q_b_proj, group-limited greedy
        return DeepseekV2Config(**common, q_lora_rank=24, n_shared_experts=1,
                                topk_method=GROUP_LIMITED_ROUTER, n_group=4, topk_group=2,
                                routed_scaling_factor=2.0)
    return DeepseekV3Config(**common, q_lora_rank=24, n_shared_experts=1, n_group=4, topk_group=2,
                            norm_topk_prob=True, routed_scaling_factor=2.5, rope_parameters=dict(YARN),
                            rope_interleave=True, num_nextn_predict_layers=1)


@pytest.fixture(scope="module")
def deepseek_models(tmp_path_factory) -> dict[str, tuple]:
    """variant -> (folder of a tiny random hub-layout checkpoint, transformers' model)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    models = {}
    for i, variant in enumerate(VARIANTS):
        torch.manual_seed(4000 + i)
        cfg = _config(variant)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.normal_(0.0, ROUTER_STD)
                elif "norm" not in name:
                    p.mul_(WEIGHT_SCALE)
                else:  # the norms' weights away from 1, so that a missed norm shows
                    p.uniform_(0.5, 1.5)
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.normal_(0.0, BIAS_STD)
        folder = tmp_path_factory.mktemp(f"tiny-deepseek-{variant}")
        model.save_pretrained(folder)
        if variant == "v3_yarn":
            path = folder / "model.safetensors"
            tensors = load_file(path)
            save_file(tensors | _mtp_tensors(tensors, cfg), path, metadata={"format": "pt"})
        models[variant] = (folder, model)
    return models


def _engine(folder, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(folder), **(STEP | kw)))


def test_config_reads_deepseek(deepseek_models):
    read = {v: ModelConfig.from_hf(json.loads((deepseek_models[v][0] / "config.json").read_text()))
            for v in VARIANTS}
    v2, grouped, v3 = (read[v].moe for v in VARIANTS)
    assert (v2.router, v2.renormalize, v2.routed_scaling_factor) == (SOFTMAX_ROUTER, False, 1.5)
    assert v2.shared_intermediate_size == 64 and v2.dense_layers == (0,) and not v2.shared_expert_gated
    assert (grouped.router, grouped.n_group, grouped.topk_group) == (GROUP_LIMITED_ROUTER, 4, 2)
    assert (v3.router, v3.renormalize, v3.routed_scaling_factor) == (NOAUX_TC_ROUTER, True, 2.5)
    assert read["v3_yarn"].rope_scaling["mscale_all_dim"] == 0.7
    # moe_layer_freq (DeepSeek's own code and vLLM; transformers ignores it): layers it does not divide dense
    raw = json.loads((deepseek_models["v2_lite"][0] / "config.json").read_text())
    freq = ModelConfig.from_hf(raw | {"num_hidden_layers": 6, "moe_layer_freq": 2}).moe
    assert freq.dense_layers == (0, 1, 3, 5)
    with pytest.raises(ValueError, match="topk_method 'sparse' is not supported"):
        ModelConfig.from_hf(raw | {"topk_method": "sparse"})


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_and_greedy_match_hf(deepseek_models, variant):
    """Prompts chunked over steps (a 40-token budget) beside decodes; V3's MTP layer skipped at load."""
    folder, hf = deepseek_models[variant]
    engine = _engine(folder)
    layers = engine.runner.model.model.layers
    assert len(layers) == LAYERS
    gate = layers[1].mlp.gate
    assert isinstance(gate, NoAuxTcRouter if variant == "v3_yarn" else SoftmaxGroupRouter)
    assert hasattr(layers[0].self_attn, "q_proj") == (variant == "v2_lite")
    assert_greedy_matches_hf(engine, hf, random_prompts(5, 1, 60, seed=31), MAX_TOKENS, LOGITS_ATOL, variant)


def test_cache_holds_one_latent_row_per_token(deepseek_models):
    """Each layer's cache is one plane of one kv_lora_rank + qk_rope_head_dim row a token, shared by the
    heads; the pool is sized by it (bytes per token), and a token's row is its normalised c_kv, then k_pe."""
    folder, hf = deepseek_models["v2_lite"]
    engine = _engine(folder, num_kv_blocks=16)
    runner = engine.runner
    assert len(runner.kv_caches) == LAYERS
    for cache in runner.kv_caches:
        assert cache.shape == (1, 16, 8, 1, ROW_WIDTH)
    fp32 = 4
    assert runner._bytes_per_block() == LAYERS * 8 * ROW_WIDTH * fp32
    prompt = random_prompts(1, 5, 5, seed=2)[0]
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    engine.step()  # the prompt's rows are in the cache once its first step ran
    (request,) = engine.scheduler.running
    table = list(request.block_ids)
    with torch.no_grad():
        attn = hf.model.layers[0].self_attn
        x = hf.model.layers[0].input_layernorm(hf.model.embed_tokens(torch.tensor(prompt)))
        c_kv = attn.kv_a_layernorm(attn.kv_a_proj_with_mqa(x)[:, :KV_LORA_RANK])
    rows = runner.kv_caches[0][0, table[0], : len(prompt), 0]  # [5, 40]
    torch.testing.assert_close(rows[:, :KV_LORA_RANK], c_kv, atol=1e-5, rtol=0)


def test_prefix_cache_hit(deepseek_models):
    """A prompt that shares its first blocks with an earlier one reads their latent rows from the cache and
    answers as transformers does."""
    folder, hf = deepseek_models["v3_yarn"]
    engine = _engine(folder, enable_prefix_caching=True)
    base = random_prompts(1, 33, 33, seed=5)[0]
    assert_greedy_matches_hf(engine, hf, [base], 3, LOGITS_ATOL)
    hits = engine.kv_cache.stats.hits
    assert_greedy_matches_hf(engine, hf, [base[:32] + [7, 8, 9]], 4, LOGITS_ATOL)
    assert engine.kv_cache.stats.hits - hits == 32


def test_preempted_requests_recompute(deepseek_models):
    """A KV pool too small for every request at once preempts some; each recomputes its rows and answers
    as transformers does."""
    from conftest import hf_greedy_reference

    from plait.entrypoints.llm import LLM

    folder, hf = deepseek_models["v2_q_lora_grouped"]
    prompts = random_prompts(4, 20, 30, seed=9)
    llm = LLM(str(folder), dtype="float32", block_size=8, num_kv_blocks=13, max_num_batched_tokens=32,
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert list(out.outputs[0].token_ids) == hf_greedy_reference(hf, prompt, [], 16)[0]


def test_stacked_expert_names_load(deepseek_models, tmp_path):
    """transformers 5's in-memory layout (experts stacked: mlp.experts.gate_up_proj / down_proj) loads as the
    hub's per-expert tensors do."""
    from safetensors.torch import load_file, save_file

    folder, _ = deepseek_models["v2_lite"]
    tensors = load_file(folder / "model.safetensors")
    stacked = {k: v for k, v in tensors.items() if ".experts." not in k}
    for layer in range(1, LAYERS):
        prefix = f"model.layers.{layer}.mlp.experts"
        per = [(tensors[f"{prefix}.{e}.gate_proj.weight"], tensors[f"{prefix}.{e}.up_proj.weight"],
                tensors[f"{prefix}.{e}.down_proj.weight"]) for e in range(8)]
        stacked[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u, _ in per])
        stacked[f"{prefix}.down_proj"] = torch.stack([d for _, _, d in per])
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    save_file(stacked, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert_engines_agree(_engine(tmp_path), _engine(folder), random_prompts(2, 3, 20, seed=12), 4)


@pytest.mark.parametrize(("num_experts", "top_k", "n_group", "topk_group", "method"), [
    (16, 4, 4, 2, GROUP_LIMITED_ROUTER), (8, 3, 4, 2, GROUP_LIMITED_ROUTER), (12, 2, 1, 1, "greedy")])
def test_v2_router_is_transformers_router(num_experts, top_k, n_group, topk_group, method):
    """route_group_limited and transformers' DeepseekV2TopkRouter on the same weights: the same experts with
    the same weights (as sets: both take unsorted top-k)."""
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    g = torch.Generator().manual_seed(num_experts + top_k)
    cfg = DeepseekV2Config(hidden_size=16, num_attention_heads=2, n_routed_experts=num_experts,
                           num_experts_per_tok=top_k, n_group=n_group, topk_group=topk_group,
                           topk_method=method, routed_scaling_factor=1.7)
    hf = DeepseekV2TopkRouter(cfg)
    weight = torch.randn(num_experts, 16, generator=g)
    with torch.no_grad():
        hf.weight.copy_(weight)
    x = torch.randn(64, 16, generator=g)
    with torch.no_grad():
        _, want_weights, want_ids = hf(x)
    weights, ids = route_group_limited(x @ weight.t(), top_k, False, n_group, topk_group, 1.7)
    order, want_order = ids.sort(dim=-1), want_ids.sort(dim=-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), want_weights.gather(1, want_order.indices),
                               rtol=0, atol=1e-6)


def test_v2_router_keeps_an_fp32_weight_in_a_16_bit_model():
    """SoftmaxGroupRouter's weight stays fp32 under model.to(bf16); the loader hands it the checkpoint's
    weight rounded to bf16 (as transformers' bf16 model holds it), widened exactly, so its logits are
    transformers' F.linear(x.float(), weight.float()) to the bit, and its experts and weights are too."""
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    from plait.loader.model_loader import to_model_dtype

    num_experts, top_k, n_group, topk_group, scale = 16, 4, 4, 2, 1.7
    cfg = DeepseekV2Config(hidden_size=16, num_attention_heads=2, n_routed_experts=num_experts,
                           num_experts_per_tok=top_k, n_group=n_group, topk_group=topk_group,
                           topk_method=GROUP_LIMITED_ROUTER, routed_scaling_factor=scale)
    hf = DeepseekV2TopkRouter(cfg).to(torch.bfloat16)
    ours = SoftmaxGroupRouter(16, num_experts, top_k, False, n_group, topk_group, scale).to(torch.bfloat16)
    assert ours.weight.dtype == torch.float32
    g = torch.Generator().manual_seed(3)
    checkpoint = torch.randn(num_experts, 16, generator=g)  # an fp32 checkpoint's weight, served in bf16
    with torch.no_grad():
        hf.weight.copy_(checkpoint)
        ours.weight.copy_(to_model_dtype("model.layers.1.mlp.gate.weight", checkpoint, torch.device("cpu"),
                                         torch.bfloat16))
    assert torch.equal(ours.weight, hf.weight.float())
    x = torch.randn(32, 16, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        want_logits, want_weights, want_ids = hf(x)
        weights, ids = ours(x)
    assert torch.equal(torch.nn.functional.linear(x.float(), ours.weight), want_logits)
    order, want_order = ids.sort(dim=-1), want_ids.sort(dim=-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), want_weights.gather(1, want_order.indices),
                               rtol=0, atol=1e-6)


def test_refusals(deepseek_models, tmp_path):
    folder, _ = deepseek_models["v2_lite"]
    with pytest.raises(ValueError, match="LoRA is not supported"):
        _engine(folder, enable_lora=True)
    with pytest.raises(ValueError, match="FP8 KV cache .* multi-head latent attention"):
        _engine(folder, kv_cache_dtype="fp8")
    gptq = json.loads((folder / "config.json").read_text()) | {"quantization_config": {
        "quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": False, "sym": True}}
    (tmp_path / "config.json").write_text(json.dumps(gptq))
    with pytest.raises(ValueError, match="GPTQ checkpoints of DeepseekV2ForCausalLM are not supported"):
        _engine(tmp_path, load_format="dummy")


# variant -> the router kernel its MoE blocks run on the GPU path
ROUTE_KERNELS = {"v3_yarn": "moe_route_noaux_tc", "v2_q_lora_grouped": "moe_route_group_limited"}


@pytest.mark.parametrize("variant", sorted(ROUTE_KERNELS))
def test_through_the_triton_kernels_matches_hf(deepseek_models, monkeypatch, variant):
    """The GPU path's kernels (Triton's interpreter on CPU, fp32): the absorbed queries attend in
    paged_attention over the latent rows, chunked prompts beside decodes, the router is one kernel (V3's
    noaux_tc, V2's group-limited greedy); greedy tokens and logits as HF's."""
    from plait.kernels import dispatch, fused_moe, paged_attention

    monkeypatch.setattr(dispatch, "_cpu_interpreter", True)
    calls, routes = [], []
    kernel, route_kernel = paged_attention.paged_attention, getattr(fused_moe, ROUTE_KERNELS[variant])

    def counted(q, k_cache, v_cache, *args, **kwargs):
        calls.append((q.shape[-1], k_cache.shape[-1], v_cache.shape[-1]))
        return kernel(q, k_cache, v_cache, *args, **kwargs)

    def counted_route(*args, **kwargs):
        routes.append(1)
        return route_kernel(*args, **kwargs)

    monkeypatch.setattr("plait.attention.triton_backend.paged_attention", counted)
    monkeypatch.setattr(fused_moe, ROUTE_KERNELS[variant], counted_route)
    folder, hf = deepseek_models[variant]
    engine = _engine(folder, max_num_batched_tokens=16, attention_backend="triton")
    assert_greedy_matches_hf(engine, hf, random_prompts(2, 5, 20, seed=22), 3, LOGITS_ATOL)
    assert set(calls) == {(ROW_WIDTH, ROW_WIDTH, KV_LORA_RANK)} and routes


# ---- The MLA kernel against torch_ref ---------------------------------------------------------------------

HAS_CUDA = torch.cuda.is_available()
# Every kind of row (block_size 4): first chunks, a chunk over context crossing blocks, decodes, a one-token
# prompt, rows without tokens this step, a chunk spanning several query tiles.
MIXED_ROWS = [(0, 5), (7, 4), (9, 1), (0, 1), (3, 1), (5, 0), (2, 23), (0, 0), (37, 1)]
DECODE_ROWS = [(9, 1), (0, 1), (30, 1), (5, 0), (61, 1)]


def _latent_batch(rows, block_size: int, heads: int, latent: int, rope: int, dtype: torch.dtype,
                  device: torch.device, seed: int):
    """(q [T, H, L + R], clean cache, cache with every slot no row may read NaN [blocks, bs, 1, L + R],
    query_start_loc, seq_lens, block_tables, max_query_len, max_seq_len); blocks shuffled over the pool."""
    from plait.engine.kv_cache import PAD_BLOCK_ID, cdiv

    g = torch.Generator().manual_seed(seed)
    per_row = [cdiv(c + n, block_size) for c, n in rows]
    num_blocks = 1 + sum(per_row) + 2
    pool = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    width = max(per_row) + 1
    tables = []
    for k in per_row:
        tables.append(pool[:k] + [PAD_BLOCK_ID] * (width - k))
        pool = pool[k:]
    cache = torch.randn(num_blocks, block_size, 1, latent + rope, generator=g).to(dtype)
    live = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for (c, n), table in zip(rows, tables, strict=True):
        pos = torch.arange(c + n)
        live[torch.tensor(table, dtype=torch.long)[pos // block_size] * block_size + pos % block_size] = True
    poisoned = cache.clone()
    poisoned.view(-1, latent + rope)[~live] = float("nan")
    qsl = torch.zeros(len(rows) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor([n for _, n in rows]).cumsum(0)
    q = torch.randn(int(qsl[-1]), heads, latent + rope, generator=g).to(dtype)
    seq_lens = torch.tensor([c + n for c, n in rows], dtype=torch.int32)
    block_tables = torch.tensor(tables, dtype=torch.int32)
    tensors = [t.to(device) for t in (q, cache, poisoned, qsl, seq_lens, block_tables)]
    return (*tensors, max(n for _, n in rows), max(c + n for c, n in rows))


def _check_mla_kernel(rows, block_size, heads, latent, rope, dtype, device, seed, splits=None, atol=2e-5):
    from plait.kernels.paged_attention import mla_cache_views, paged_attention, paged_attention_ref

    q, cache, poisoned, qsl, seq_lens, tables, max_q, max_s = _latent_batch(
        rows, block_size, heads, latent, rope, dtype, device, seed)
    scale = (latent + rope) ** -0.5
    k, v = mla_cache_views(poisoned, heads, latent)
    out = torch.full((q.shape[0], heads, latent), float("nan"), dtype=dtype, device=device)
    paged_attention(q, k, v, out, qsl, seq_lens, tables, scale, max_q, max_s, num_kv_splits=splits)
    clean = cache.float()
    want, _ = paged_attention_ref(q.float(), clean, clean[..., :latent], qsl, seq_lens, tables, scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=atol)


@pytest.mark.parametrize(("rows", "heads", "latent", "dtype", "splits"), [
    (MIXED_ROWS, 4, 32, torch.float32, None),
    (MIXED_ROWS, 32, 64, torch.float32, 1),  # two programs of 16 heads over the one latent head
    (DECODE_ROWS, 32, 32, torch.float32, 3),  # split-KV, the last split merging
    (MIXED_ROWS, 16, 32, torch.float16, None),
], ids=["mixed-4h", "mixed-32h", "decodes-split", "mixed-fp16"])
def test_mla_kernel_matches_torch_ref(rows, heads, latent, dtype, splits):
    """paged_attention over MLA's latent rows (K = the row, V = its latent columns, a view; the rope part
    dotted apart) against torch_ref's fp32 attention with K and V apart, every row kind in one batch; the
    slots no row may read hold NaN."""
    _check_mla_kernel(rows, 4, heads, latent, 16, dtype, torch.device("cpu"), seed=heads + latent,
                      splits=splits, atol=2e-5 if dtype == torch.float32 else 3e-3)


def _gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")(test))


@_gpu
@pytest.mark.parametrize("case", range(6))
def test_mla_kernel_matches_torch_ref_on_gpu(case):
    """DeepSeek's real widths (latent 512, rope 64) in bf16 on CUDA: V2-Lite's 16 heads and V3's 128, random
    rows of every kind (contexts up to 4k), decode-only batches (split-KV) among them."""
    rng = random.Random(case)
    decode_only = case % 2 == 1
    rows = [(rng.randint(0, 4096), 1) if decode_only or rng.random() < 0.5 else
            (rng.randint(0, 1024), rng.randint(1, 300)) for _ in range(rng.choice([1, 3, 17, 64]))]
    _check_mla_kernel(rows, [16, 64][case % 2], [16, 128][case // 3], 512, 64, torch.bfloat16,
                      torch.device("cuda"), seed=case, atol=2e-2)


@_gpu
def test_gpu_matches_cpu_fp32(deepseek_models):
    """The tiny V3 (noaux_tc, YaRN) on the GPU engine (Triton attention over the latent cache, CUDA graphs)
    against the CPU engine, fp32: the same greedy tokens, prompts chunked beside decodes."""
    from plait.entrypoints.llm import LLM

    folder, _ = deepseek_models["v3_yarn"]
    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, 3, 60, seed=41)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    cpu = LLM(str(folder), dtype="float32", device="cpu", enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in cpu.generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=24, enable_prefix_caching=False)
    assert llm.engine.runner.attn_backend.name == "triton"
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want


# ---- Across ranks -----------------------------------------------------------------------------------------

# V3's experts split by width are GLM-4.5's (its two-rank tests) and the block-FP8 split's below.
@pytest.mark.parametrize(("variant", "expert_parallel"), [
    ("v2_lite", False), ("v2_q_lora_grouped", True), ("v3_yarn", True)],
    ids=["v2-lite-width", "v2-q-lora-whole-experts", "v3-whole-experts"])
def test_two_ranks_match_hf(deepseek_models, variant, expert_parallel):
    """Over two gloo ranks: two heads each (their query and kv_b_proj rows, so their own absorbed W_UK /
    W_UV, and o_proj's columns, summed), the latent projections and norms whole on both, so each rank's
    cache holds the same one latent row a token; the routed experts split by width (or half of them whole on
    each rank), the shared experts and the dense layer by width, the router replicated. Transformers' tokens
    and logits, prompts chunked beside decodes; V3's MTP layer skipped before any rank slices it."""
    folder, hf = deepseek_models[variant]
    engine = _engine(folder, max_num_batched_tokens=48, tensor_parallel_size=2,
                     enable_expert_parallel=expert_parallel)
    try:
        runner = engine.runner
        attn = runner.model.model.layers[0].self_attn
        assert attn.num_heads == HEADS // 2
        assert attn.kv_b_proj.weight.shape == (HEADS // 2 * (NOPE_DIM + V_DIM), KV_LORA_RANK)
        assert attn.kv_a_proj_with_mqa.weight.shape == (ROW_WIDTH, 64)
        assert attn.o_proj.weight.shape == (64, HEADS // 2 * V_DIM)
        assert runner.kv_caches[0].shape[-2:] == (1, ROW_WIDTH)
        block = runner.model.model.layers[1].mlp
        assert block.experts.num_experts == (4 if expert_parallel else 8)
        assert block.experts.intermediate_size == (32 if expert_parallel else 16)
        assert block.gate.weight.shape == (8, 64)
        assert_greedy_matches_hf(engine, hf, random_prompts(3, 1, 40, seed=23), MAX_TOKENS, LOGITS_ATOL,
                                 variant)
    finally:
        engine.shutdown()


# ---- FP8 weights ------------------------------------------------------------------------------------------

# Every linear DeepSeek-V3's FP8 release quantises: attention's (the latent side too) and the MLPs' and
# experts'; the routers and the lm_head stay 16-bit.
MLA_FP8_LINEARS = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
                   "up_proj", "down_proj")


def test_a_block_fp8_checkpoint_is_the_model_with_its_tiles(deepseek_models, tmp_path):
    """DeepSeek-V3's own kind of checkpoint (quant_method fp8, weight_block_size, weight_scale_inv per tile,
    no modules_to_not_convert): every linear a block-FP8 layer holding the checkpoint's codes, the absorbed
    W_uk / W_uv the dequantised kv_b_proj's tiles, experts FP8, routers fp32; the engine computes the 16-bit
    model whose weights are those tiles and whose linears round their inputs per group (test_moe's
    reference; kv_b_proj is read only through the absorbed weights, unrounded inputs, as vLLM's bmm)."""
    from safetensors.torch import load_file
    from test_moe import BLOCK, fp8_moe_checkpoint, fp8_reference

    from plait.layers.fp8_block import Fp8BlockLinear, dequantize_blocks
    from plait.layers.moe import FusedMoE

    folder, _ = deepseek_models["v3_yarn"]
    fp8 = tmp_path / "fp8"
    fp8_moe_checkpoint(folder, fp8, linears=MLA_FP8_LINEARS)
    config = json.loads((fp8 / "config.json").read_text())
    del config["quantization_config"]["modules_to_not_convert"]  # V3's config names none
    (fp8 / "config.json").write_text(json.dumps(config))
    kw = dict(max_num_batched_tokens=40, max_model_len=128)
    served = _engine(fp8, **kw)
    attn = served.runner.model.model.layers[1].self_attn
    for proj in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
        assert isinstance(getattr(attn, proj), Fp8BlockLinear)
    tensors = load_file(fp8 / "model.safetensors")
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    assert torch.equal(attn.kv_b_proj.weight.view(torch.uint8), tensors[name].view(torch.uint8))
    w_uk, w_uv = attn.absorbed_weights()
    tiles = dequantize_blocks(tensors[name], tensors[name + "_scale_inv"], BLOCK, torch.float32)
    tiles = tiles.view(HEADS, NOPE_DIM + V_DIM, KV_LORA_RANK)
    assert torch.equal(w_uk, tiles[:, :NOPE_DIM]) and torch.equal(w_uv, tiles[:, NOPE_DIM:])
    block = served.runner.model.model.layers[1].mlp
    assert isinstance(block.experts, FusedMoE) and block.experts.block == BLOCK
    assert isinstance(block.shared_experts.gate_up_proj, Fp8BlockLinear)
    assert block.gate.weight.dtype == torch.float32
    reference = _engine(folder, **kw)
    fp8_reference(reference)
    assert_engines_agree(served, reference, random_prompts(2, 3, 40, seed=24), max_tokens=4, atol=1e-5)


def test_quantization_fp8_is_the_model_with_fp8_rows(deepseek_models):
    """--quantization fp8 of a 16-bit checkpoint: every linear per-row FP8 (kv_b_proj dequantised for the
    absorbed weights), the experts on default_fp8_block's tiles; the engine computes the 16-bit model with
    those roundings (weights, and each linear's input per row)."""
    from test_fp8 import _fake_quantized
    from torch import nn

    from plait.layers.fp8 import Fp8Linear, dequantize_rows, quantize_rows
    from plait.layers.moe import FusedMoE, default_fp8_block

    folder, _ = deepseek_models["v2_q_lora_grouped"]
    kw = dict(max_num_batched_tokens=40, max_model_len=128)
    served = _engine(folder, quantization="fp8", **kw)
    attn = served.runner.model.model.layers[0].self_attn
    assert isinstance(attn.kv_b_proj, Fp8Linear) and isinstance(attn.q_a_proj, Fp8Linear)
    reference = _engine(folder, **kw)
    with torch.no_grad():
        for name, module in reference.runner.model.named_modules():
            if isinstance(module, FusedMoE):
                module.quantize_fp8(default_fp8_block(module.intermediate_size))
            elif isinstance(module, nn.Linear) and not name.endswith("lm_head"):
                module.weight.copy_(dequantize_rows(*quantize_rows(module.weight), module.weight.dtype))
                module.register_forward_pre_hook(lambda _m, args: (_fake_quantized(args[0]),))
    assert_engines_agree(served, reference, random_prompts(2, 3, 40, seed=25), max_tokens=4, atol=1e-5)


def test_a_block_fp8_checkpoint_split_in_two_is_the_model_on_one_device(tmp_path):
    """A tiny V3 whose every rank slice is whole 32 x 32 tiles (V3's own proportions: 16 nope + 16 rope query
    rows and 16 + 16 kv_b_proj rows a head, 16 value columns of o_proj a head, experts 64 wide), block-FP8
    over two gloo ranks: each rank's kv_b_proj is its heads' tiles with their scales, its absorbed weights
    those tiles dequantised; the model of one device, up to the order of fp32 sums (and FP8 rounding flips
    that order moves: test_tensor_parallel_fp8)."""
    from safetensors.torch import load_file
    from test_moe import BLOCK, fp8_moe_checkpoint
    from test_tensor_parallel_fp8 import _assert_same_fp8_model
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from plait.layers.fp8_block import dequantize_blocks

    v_dim, heads_per_rank = NOPE_DIM, HEADS // 2
    cfg = DeepseekV3Config(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=HEADS, vocab_size=TINY_VOCAB, max_position_embeddings=512, bos_token_id=1,
        eos_token_id=2, pad_token_id=None, kv_lora_rank=KV_LORA_RANK, q_lora_rank=24,
        qk_nope_head_dim=NOPE_DIM, qk_rope_head_dim=ROPE_DIM, v_head_dim=v_dim, n_routed_experts=8,
        num_experts_per_tok=3, n_shared_experts=1, n_group=4, topk_group=2, norm_topk_prob=True,
        routed_scaling_factor=2.5, first_k_dense_replace=1, tie_word_embeddings=False)
    torch.manual_seed(4100)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, ROUTER_STD)
            elif "norm" not in name:
                p.mul_(WEIGHT_SCALE)
    model.save_pretrained(tmp_path / "bf16")
    fp8_moe_checkpoint(tmp_path / "bf16", tmp_path / "fp8", linears=MLA_FP8_LINEARS)
    kw = dict(max_num_batched_tokens=24, max_model_len=96)
    whole = _engine(tmp_path / "fp8", **kw)
    split = _engine(tmp_path / "fp8", tensor_parallel_size=2, **kw)
    try:
        attn = split.runner.model.model.layers[0].self_attn
        name = "model.layers.0.self_attn.kv_b_proj.weight"
        tensors = load_file(tmp_path / "fp8" / "model.safetensors")
        rows = heads_per_rank * (NOPE_DIM + v_dim)  # the driver's: its heads' first
        assert torch.equal(attn.kv_b_proj.weight.view(torch.uint8), tensors[name][:rows].view(torch.uint8))
        want = dequantize_blocks(tensors[name], tensors[name + "_scale_inv"], BLOCK, torch.float32)[:rows]
        w_uk, w_uv = attn.absorbed_weights()
        assert torch.equal(torch.cat([w_uk, w_uv], dim=1).reshape(rows, KV_LORA_RANK), want)
        assert split.runner.model.model.layers[1].mlp.experts.intermediate_size == 32
        _assert_same_fp8_model(split, whole, random_prompts(3, 3, 40, seed=26))
    finally:
        split.shutdown()
