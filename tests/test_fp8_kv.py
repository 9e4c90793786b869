"""The FP8 KV cache (kv_cache_dtype="fp8"): the store and attention kernels against their torch references,
and the engine against HF transformers rounding K/V the same way.

Unmarked kernel tests run in the Triton interpreter on CPU (compiled where there is a GPU); ``gpu`` tests
use Llama-8B head shapes in bf16 and the engine with CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts, run_greedy

triton = pytest.importorskip("triton")

from test_triton_attention import DECODES, MIXED, PAD_ROW, PREFILL_SPLIT_ROWS, make_batch  # noqa: E402

from plait.attention.fp8_kv import UNIT_SCALES, KVScales, from_cache, to_cache  # noqa: E402
from plait.config import EngineConfig  # noqa: E402
from plait.engine.engine import LLMEngine  # noqa: E402
from plait.engine.kv_cache import PAD_BLOCK_ID  # noqa: E402
from plait.kernels.paged_attention import paged_attention, paged_attention_ref, plan_paged_attention  # noqa: E402
from plait.kernels.rope_store import rope_store_kv, rope_store_kv_ref  # noqa: E402
from plait.kernels.store_kv import store_kv, store_kv_ref  # noqa: E402
from plait.layers.rotary import RotaryEmbedding  # noqa: E402

FP8 = torch.float8_e4m3fn
ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
# Scales a checkpoint might carry: one a power of two (exact), one not.
SCALES = [UNIT_SCALES, KVScales(0.5, 2.0), KVScales(0.037, 0.011)]


def codes(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor's bit patterns, to compare codes exactly (NaN codes included)."""
    return t.view(torch.uint8)


def fake_quant(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x as an FP8 cache with this scale gives it back, written out here as the test's own oracle:
    x * fp32(1 / scale), saturated at the format's largest value, rounded to e4m3, times the scale."""
    inv = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(scale, dtype=torch.float32)
    stored = (x.float() * inv).clamp(-448.0, 448.0).to(FP8)
    return stored.float() * scale


# -- the format ------------------------------------------------------------------------------------------


def test_codes_saturate_round_and_scale():
    x = torch.tensor([0.0, 1.0, -3.3, 447.0, 449.0, 1e6, -1e6, 0.0137, 2.0**-9, 3 * 2.0**-10])
    stored = to_cache(x, FP8, 1.0)
    assert stored.dtype == FP8
    assert from_cache(stored, 1.0).tolist() == [0.0, 1.0, -3.25, 448.0, 448.0, 448.0, -448.0, 0.013671875,
                                                 2.0**-9, 2.0**-8]  # 3 * 2^-10 ties to the even code
    # With a scale, a code stands for code * scale, and the stored codes are those of x / scale.
    s = KVScales(0.25, 4.0)
    assert torch.equal(codes(to_cache(x, FP8, s.inverse[0])), codes(to_cache(x * 4.0, FP8, 1.0)))
    assert torch.equal(from_cache(to_cache(x, FP8, s.inverse[1]), s.v), fake_quant(x, 4.0))
    # A cache in a model dtype is a plain cast, and reading it back ignores the scale.
    assert torch.equal(to_cache(x, torch.float16, 5.0), x.half())
    assert torch.equal(from_cache(x.half(), 5.0), x.half().float())
    assert KVScales(0.037, 3.0).inverse == (float(torch.tensor(1.0) / torch.tensor(0.037)),
                                            float(torch.tensor(1.0) / torch.tensor(3.0)))


def test_config_names_and_refusals():
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8"
    assert EngineConfig().kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int8")


def test_cli_flag_reaches_the_engine_config():
    import argparse

    from plait.entrypoints.cli import _add_engine_args, _engine_config

    parser = argparse.ArgumentParser()
    _add_engine_args(parser)
    args = parser.parse_args(["--kv-cache-dtype", "fp8_e4m3"])
    assert _engine_config(args).kv_cache_dtype == "fp8"


# -- kernels ---------------------------------------------------------------------------------------------


def store_case(t: int, hkv: int, d: int, dtype: torch.dtype, seed: int):
    """k, v as strided views of one qkv row with values across the FP8 range (saturating, subnormal,
    exact ties); a noise-filled FP8 cache of shuffled blocks; slots in random blocks, the last two tokens
    padded rows that both write the pad block."""
    g = torch.Generator().manual_seed(seed)
    block_size = 4
    magnitude = 2.0 ** torch.randint(-12, 10, (t, 2 * hkv + 2, d), generator=g)
    qkv = (torch.randn(t, 2 * hkv + 2, d, generator=g) * magnitude).to(dtype)
    qkv[0, 2, :4] = torch.tensor([3 * 2.0**-10, 5 * 2.0**-10, 2.0**-13, 600.0]).to(dtype)
    k, v = qkv[:, 2 : 2 + hkv], qkv[:, 2 + hkv :]
    num_blocks = max(6, -(-t // block_size) + 2)
    real = torch.randperm((num_blocks - 1) * block_size, generator=g)[: t - 2] + block_size
    slots = torch.cat([real, torch.full((2,), PAD_BLOCK_ID * block_size + 1)])
    cache = torch.randn(2, num_blocks, block_size, hkv, d, generator=g).to(FP8)
    positions = torch.randint(0, 64, (t,), generator=g)
    return k.to(DEVICE), v.to(DEVICE), cache.to(DEVICE), slots.to(DEVICE), positions.to(DEVICE)


def real_blocks(cache: torch.Tensor) -> torch.Tensor:
    # Both padded rows write the pad block, in no set order on the GPU; nothing reads it.
    return codes(cache[:, [b for b in range(cache.shape[1]) if b != PAD_BLOCK_ID]])


@pytest.mark.parametrize("scales", SCALES, ids=["unit", "pow2", "odd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_writes_the_reference_codes(dtype, scales):
    k, v, cache, slots, _ = store_case(9, 2, 32, dtype, seed=1)
    want = cache.clone()
    store_kv_ref(k, v, want[0], want[1], slots, scales)
    store_kv(k, v, cache[0], cache[1], slots, scales)
    assert torch.equal(real_blocks(cache), real_blocks(want))
    # The reference stores the oracle's values.
    block, pos = slots[:-2] // 4, slots[:-2] % 4
    assert torch.equal(from_cache(want[0, block, pos], scales.k), fake_quant(k[:-2], scales.k))
    assert torch.equal(from_cache(want[1, block, pos], scales.v), fake_quant(v[:-2], scales.v))


@pytest.mark.parametrize("scales", SCALES[1:], ids=["pow2", "odd"])
@pytest.mark.parametrize("rot", [32, 16])
def test_rope_store_writes_the_reference_codes(rot, scales):
    """The fused rotary + store: k rotated in q's dtype, then stored as FP8 codes with its scale."""
    k, v, cache, slots, positions = store_case(7, 2, 32, torch.float16, seed=2)
    q = torch.randn(7, 4, 32, dtype=torch.float16, device=DEVICE)
    cos_sin = RotaryEmbedding(rot, 64, 10000.0).cos_sin.to(DEVICE)
    want = cache.clone()
    want_q = rope_store_kv_ref(positions, q, k, v, cos_sin, want[0], want[1], slots, scales)
    got_q = rope_store_kv(positions, q, k, v, cos_sin, cache[0], cache[1], slots, scales)
    assert torch.equal(got_q, want_q)
    assert torch.equal(real_blocks(cache), real_blocks(want))


def fp8_batch(specs, heads, dtype, scales: KVScales, seed: int, head_dim: int = 32, block_size: int = 4):
    """make_batch's call with its caches turned into FP8 codes (NaN codes where no row may read)."""
    b = make_batch(specs, block_size, *heads, head_dim, dtype, DEVICE, seed=seed)
    inv_k, inv_v = scales.inverse
    b.k_cache, b.v_cache = to_cache(b.k_cache * 3, FP8, inv_k), to_cache(b.v_cache * 3, FP8, inv_v)
    b.k_poisoned = torch.where(b.k_poisoned.isnan(), torch.nan, b.k_cache.float()).to(FP8)
    b.v_poisoned = torch.where(b.v_poisoned.isnan(), torch.nan, b.v_cache.float()).to(FP8)
    return b


def run_fp8(b, scale: float, scales: KVScales, num_kv_splits=None, window: int = 0, **overrides):
    out = torch.full_like(b.q, float("nan"))
    lse = torch.full(b.q.shape[:2], float("nan"), device=b.q.device)
    (num_tokens, num_heads, head_dim), num_rows = b.q.shape, b.seq_lens.shape[0]
    plan = plan_paged_attention(num_tokens, num_rows, num_heads, b.k_cache.shape[2], head_dim, b.q.dtype,
                                b.max_query_len, b.max_seq_len + 7, b.q.device, num_kv_splits, **overrides)
    paged_attention(b.q, b.k_poisoned, b.v_poisoned, out, b.query_start_loc, b.seq_lens, b.block_tables,
                    scale, b.max_query_len, b.max_seq_len + 7, window, lse, plan=plan, k_scale=scales.k,
                    v_scale=scales.v)
    return out, lse, plan


ATOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize(("specs", "splits", "window"), [
    (MIXED, 1, 0), (DECODES, 3, 0), (PREFILL_SPLIT_ROWS, 3, 0), (MIXED, 1, 6),
], ids=["mixed", "decode-split", "prefill-split", "window"])
@pytest.mark.parametrize("scales", SCALES[1:], ids=["pow2", "odd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_attention_over_fp8_codes_matches_torch_ref(dtype, scales, specs, splits, window):
    """The kernel reads codes, widens them and folds the scales in; torch_ref dequantises them; both equal
    plain attention over the values the codes stand for."""
    b = fp8_batch(specs, (4, 2), dtype, scales, seed=splits + window)
    out, lse, plan = run_fp8(b, 0.3, scales, splits, window, tile_n=16, block_m=16)
    assert plan.config.num_splits == splits
    ref_out, ref_lse = paged_attention_ref(b.q.float(), b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens,
                                           b.block_tables, 0.3, window, scales.k, scales.v)
    plain_out, plain_lse = paged_attention_ref(
        b.q.float(), from_cache(b.k_cache, scales.k), from_cache(b.v_cache, scales.v), b.query_start_loc,
        b.seq_lens, b.block_tables, 0.3, window)
    torch.testing.assert_close(ref_out, plain_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ref_lse, plain_lse, atol=1e-6, rtol=1e-6)
    assert torch.isfinite(out).all() and not lse.isnan().any()
    torch.testing.assert_close(out.float(), ref_out, atol=ATOL[dtype] * (1 + abs(scales.v)), rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_over_fp8_codes_takes_its_own_tiles(dtype):
    """Decode launches over an FP8 cache take FP8_DECODE_TILE_N / FP8_DECODE_NUM_STAGES; bf16 queries
    take their dots in fp16 (exact widening of q and of the codes)."""
    from plait.kernels.paged_attention import FP8_DECODE_NUM_STAGES, FP8_DECODE_TILE_N

    scales = SCALES[2]
    b = fp8_batch([(130, 1), (0, 1), (301, 1), (5, 0), (64, 1), PAD_ROW], (4, 2), dtype, scales, seed=4)
    out, lse, plan = run_fp8(b, 0.3, scales, num_kv_splits=None, cache_dtype=FP8)
    assert plan.config.tile_n == FP8_DECODE_TILE_N[64] and plan.config.num_stages >= FP8_DECODE_NUM_STAGES
    ref_out, ref_lse = paged_attention_ref(b.q.float(), b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens,
                                           b.block_tables, 0.3, 0, scales.k, scales.v)
    # bf16 outputs: one rounding (a truncation in the interpreter) of values up to ~5.
    rtol = 2**-7 if dtype == torch.bfloat16 else 0.0
    torch.testing.assert_close(out.float(), ref_out, atol=ATOL[dtype], rtol=rtol)
    torch.testing.assert_close(lse, ref_lse, atol=ATOL[dtype], rtol=0)


def test_attention_refuses_a_cache_of_another_dtype():
    b = make_batch([(3, 2)], 4, 2, 2, 32, torch.float32, DEVICE, seed=0)
    out = torch.empty_like(b.q)
    with pytest.raises(ValueError, match="FP8"):
        paged_attention(b.q, b.k_cache.half(), b.v_cache.half(), out, b.query_start_loc, b.seq_lens,
                        b.block_tables, 0.3, b.max_query_len, b.max_seq_len)


# -- the engine ------------------------------------------------------------------------------------------


class QuantizingCache:
    """An HF DynamicCache whose every update rounds the new K/V through FP8 first (``scales[layer]``, else
    1.0), so HF's attention sees what plait's FP8 cache holds: its own chunk's K/V included, as plait reads
    them from the cache."""

    def __new__(cls, scales: list[KVScales] | None = None):
        from transformers import DynamicCache

        class _Cache(DynamicCache):
            def update(self, key_states, value_states, layer_idx, *args, **kwargs):
                s = UNIT_SCALES if scales is None else scales[layer_idx]
                return super().update(fake_quant(key_states, s.k), fake_quant(value_states, s.v), layer_idx,
                                      *args, **kwargs)

        return _Cache()


# FP8 moves logits by ~1e-2 (the check that the cache really is FP8); the engine tracks HF's FP8 run to
# fp32 noise, and a rounding of a K/V element that fp32 noise flips to its neighbour code.
FP8_LOGITS_ATOL = 2e-3


def assert_matches_hf_with_fp8_kv(folder, engine: LLMEngine, scales: list[KVScales] | None = None):
    """Greedy tokens equal to HF's with K/V rounded through FP8 (``scales``), logits within fp32 noise of
    them and visibly away from the unquantised model's."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = random_prompts(5, 1, 60, seed=17)
    assert engine.runner.kv_caches[0].dtype == FP8
    outputs, logits = run_greedy(engine, prompts, 10, capture_logits=True)
    moved = 0.0
    for i, prompt in enumerate(prompts):
        full = torch.tensor([prompt + outputs[i]])
        with torch.no_grad():
            ref_ids = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                  eos_token_id=None, pad_token_id=0, past_key_values=QuantizingCache(scales))
            ref_ids = ref_ids[0, len(prompt):].tolist()
            ref_logits = hf(full, past_key_values=QuantizingCache(scales), use_cache=True).logits
            ref_logits = ref_logits[0, len(prompt) - 1:-1]
            plain_logits = hf(full).logits[0, len(prompt) - 1:-1]
        assert outputs[i] == ref_ids, f"prompt {i}: greedy tokens differ from HF with FP8 K/V"
        got = torch.stack(logits[i])
        torch.testing.assert_close(got, ref_logits, atol=FP8_LOGITS_ATOL, rtol=0)
        moved = max(moved, float((got - plain_logits).abs().max()))
    assert moved > 5 * FP8_LOGITS_ATOL, "the FP8 cache computed what the unquantised one does"
    assert engine.is_idle_and_clean()


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])
def test_engine_with_fp8_cache_matches_hf_with_fp8_rounded_kv(tiny_models, family):
    engine = LLMEngine(EngineConfig(model=str(tiny_models[family]), max_num_batched_tokens=40, block_size=8,
                                    kv_cache_dtype="fp8", device="cpu"))
    assert engine.runner.kv_scales == [UNIT_SCALES] * 2
    assert_matches_hf_with_fp8_kv(tiny_models[family], engine)


def with_kv_scales(folder, tmp_path, scales: list[KVScales], style: str):
    """A copy of a tiny checkpoint carrying FP8 KV-cache scales, named as compressed-tensors does
    ("attn": self_attn.k_scale) or as older checkpoints ("proj": self_attn.k_proj.output_scale)."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path / f"scaled-{style}"
    shutil.copytree(folder, out)
    tensors = load_file(out / "model.safetensors")
    for layer, s in enumerate(scales):
        for which, value in (("k", s.k), ("v", s.v)):
            name = f"{which}_scale" if style == "attn" else f"{which}_proj.output_scale"
            tensors[f"model.layers.{layer}.self_attn.{name}"] = torch.tensor([value])
    save_file(tensors, out / "model.safetensors")
    return out


@pytest.mark.parametrize("style", ["attn", "proj"])
def test_checkpoint_kv_scales_are_used_by_an_fp8_cache_and_ignored_by_others(tiny_llama, tmp_path, style):
    # fp32 values, as a checkpoint stores them; small, so that the codes span the format's range.
    pairs = ((0.011, 0.0062), (0.0075, 0.019))
    scales = [KVScales(*(float(torch.tensor(x)) for x in pair)) for pair in pairs]
    folder = with_kv_scales(tiny_llama, tmp_path, scales, style)
    engine = LLMEngine(EngineConfig(model=str(folder), max_num_batched_tokens=40, block_size=8,
                                    kv_cache_dtype="fp8", device="cpu"))
    assert engine.runner.kv_scales == scales
    assert_matches_hf_with_fp8_kv(folder, engine, scales)
    # A cache in the model's dtype loads the same checkpoint and leaves the scales be.
    prompts = random_prompts(3, 5, 30, seed=2)
    plain, scaled = (run_greedy(LLMEngine(EngineConfig(model=str(f), device="cpu")), prompts, 6)[0]
                     for f in (tiny_llama, folder))
    assert plain == scaled


def test_checkpoint_with_kv_scales_for_some_layers_is_refused(tiny_llama, tmp_path):
    folder = with_kv_scales(tiny_llama, tmp_path, [KVScales(0.5, 0.5)], "attn")  # layer 0 of 2
    with pytest.raises(ValueError, match="KV-cache scales for 1 of 2"):
        LLMEngine(EngineConfig(model=str(folder), kv_cache_dtype="fp8", device="cpu"))


def test_fp8_cache_holds_twice_the_blocks_and_answers_do_not_depend_on_batching(tiny_llama):
    """Half the bytes a block: twice the blocks in the same memory. Every token reads its own chunk's K/V
    back from the cache too, so chunking a prompt differently changes no token."""
    base = dict(model=str(tiny_llama), device="cpu", max_model_len=512)
    auto = LLMEngine(EngineConfig(**base))
    fp8 = LLMEngine(EngineConfig(**base, kv_cache_dtype="fp8"))
    assert fp8.runner._bytes_per_block() * 4 == auto.runner._bytes_per_block()  # fp32 model on CPU
    prompts = random_prompts(6, 20, 90, seed=5)
    results = []
    for budget, arrive in [(16, 0), (512, 3)]:
        engine = LLMEngine(EngineConfig(**base, kv_cache_dtype="fp8", max_num_batched_tokens=budget,
                                        num_kv_blocks=256))
        results.append(run_greedy(engine, prompts, 8, arrive_every=arrive)[0])
    assert results[0] == results[1]


def test_start_up_names_the_cache_it_made(tiny_llama, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="plait.runner.model_runner"):
        LLMEngine(EngineConfig(model=str(tiny_llama), device="cpu", kv_cache_dtype="fp8", num_kv_blocks=40,
                               block_size=8))
    assert "KV cache: 40 blocks of 8 tokens (320 tokens), float8_e4m3fn" in caplog.text


def test_prefix_cache_hits_read_fp8_blocks_as_written(tiny_llama):
    """Cached FP8 blocks are reused as they are: cache on answers as cache off, with hits."""
    g = torch.Generator().manual_seed(9)
    prefix = torch.randint(3, 500, (43,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 1, 13, 0, 9)]
    runs = {}
    for caching in (False, True):
        engine = LLMEngine(EngineConfig(model=str(tiny_llama), device="cpu", kv_cache_dtype="fp8",
                                        block_size=8, max_num_batched_tokens=32,
                                        enable_prefix_caching=caching))
        runs[caching] = run_greedy(engine, prompts, 8, arrive_every=4)[0]
        if caching:
            assert engine.kv_cache.stats.hits > 0
    assert runs[True] == runs[False]


# -- on a GPU --------------------------------------------------------------------------------------------


@gpu
@needs_cuda
@pytest.mark.parametrize("scales", SCALES[1:], ids=["pow2", "odd"])
@pytest.mark.parametrize(("rows", "kind"), [
    ([(4000, 1)] * 3 + [(900, 1)] * 60, "decode"),
    ([(30, 1)] * 8 + [(3800, 256)], "mixed"),
    ([(0, 700)], "prefill"),
])
def test_llama8b_heads_over_fp8_codes_on_gpu(rows, kind, scales):
    b = fp8_batch(rows + [PAD_ROW], (32, 8), torch.bfloat16, scales, seed=len(rows), head_dim=128,
                  block_size=16)
    out, lse, _ = run_fp8(b, 128**-0.5, scales)
    ref_out, ref_lse = paged_attention_ref(b.q.float(), b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens,
                                           b.block_tables, 128**-0.5, 0, scales.k, scales.v)
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2 * max(1.0, scales.v * 3), rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=0)


@gpu
@needs_cuda
def test_engine_fp8_cache_graphs_agree_with_eager_and_torch_ref_on_gpu(tmp_path):
    """bf16, random Llama-shaped config: graphed Triton FP8-cache decoding against eager Triton and
    against torch_ref, both reading the same codes. Forks only at near-ties, as in bf16 (test_gpu_engine)."""
    import json

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
           "intermediate_size": 2816, "num_hidden_layers": 4, "num_attention_heads": 8,
           "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 4096, "max_position_embeddings": 2048,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    prompts = random_prompts(16, 1, 600, seed=3)
    runs = {}
    for name, knobs in {"graphs": {}, "eager": dict(enforce_eager=True),
                        "torch_ref": dict(enforce_eager=True, attention_backend="torch_ref")}.items():
        engine = LLMEngine(EngineConfig(model=str(tmp_path), load_format="dummy", seed=3,
                                        kv_cache_dtype="fp8", num_kv_blocks=1024, max_num_batched_tokens=256,
                                        max_model_len=1024, **knobs))
        with torch.no_grad():
            engine.runner.model.model.embed_tokens.weight.mul_(100.0)  # as test_gpu_engine: decisive logits
        assert engine.runner.kv_caches[0].dtype == FP8
        runs[name] = run_greedy(engine, prompts, 24, arrive_every=2)[0]
        if name == "graphs":
            b = engine.runner.breakdown
            assert b.single_token_steps > 0 and b.graph_single_token_steps == b.single_token_steps
    for name in ("eager", "torch_ref"):
        agree = sum(runs[name][i] == runs["graphs"][i] for i in range(len(prompts))) / len(prompts)
        print(f"\nFP8 KV, bf16: graphs vs {name}: {agree:.0%} of prompts agree for 24 tokens")
        assert agree >= 0.6
