"""GPT-OSS beyond the family parity test: MXFP4 checkpoints (served with MXFP4 experts) against transformers
on one device and split over two, and what plait refuses for it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import assert_greedy_matches_hf, random_prompts
from safetensors.torch import load_file, save_file

from plait.config import EngineConfig
from plait.engine.engine import LLMEngine
from plait.layers.moe import MXFP4_WEIGHTS
from plait.layers.mxfp4 import BLOCK_VALUES, FP4_VALUES, dequantize_mxfp4, quantize_mxfp4

EXPERT_PROJECTIONS = ("gate_up_proj", "down_proj")
BENCH_CONFIGS = Path(__file__).resolve().parents[1] / "benchmarks" / "configs"
# fp32 logits of the MXFP4 model against its dequantised twin on the GPU, relative to the largest logit.
GPU_TWIN_ATOL = 1e-5


def test_dequantize_mxfp4_is_transformers():
    """Every byte (both nibbles) under scales across E8M0's range decodes as transformers decodes it."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 6, 8, BLOCK_VALUES // 2), generator=g, dtype=torch.uint8)
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # both nibbles of every code
    scales = torch.randint(127 - 20, 127 + 20, (2, 6, 8), generator=g, dtype=torch.uint8)
    scales[0, 0, 0], scales[1, 5, 7] = 1, 254  # the extremes bf16 still holds
    ours = dequantize_mxfp4(blocks, scales, torch.bfloat16)  # [2, 6, 256]: [E, out, in]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)  # [E, in, out]
    assert torch.equal(ours, theirs.transpose(1, 2))
    assert ours[0, 0, :BLOCK_VALUES:2].float().tolist() == [v * 2.0**-126 for v in FP4_VALUES]


def test_quantize_mxfp4_round_trips():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(3, 5, 64, generator=g) * 4
    blocks, scales = quantize_mxfp4(w)
    values = dequantize_mxfp4(blocks, scales, torch.float32)
    # codes are fixed points
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(values), torch.float32), values)
    # Each value lands within half a step of the coarsest code spacing (2 * 2 ** scale at magnitude 4..6).
    step = torch.exp2(scales.float() - 127).repeat_interleave(BLOCK_VALUES, dim=-1)
    assert ((values - w).abs() <= step + 1e-6).all()


def _mxfp4_checkpoint(source: Path, dest: Path) -> Path:
    """``source`` (a transformers GPT-OSS folder) with its experts in MXFP4, as the Hub's checkpoints hold
    them, written to ``dest``; returns a transformers folder of the same model whose experts hold the
    dequantised values (the oracle)."""
    tensors = load_file(source / "model.safetensors")
    oracle = dict(tensors)
    for name in list(tensors):
        if name.rpartition(".")[2] not in EXPERT_PROJECTIONS:
            continue
        # transformers' [E, in, out] -> the checkpoint's [E, out, in], quantised along in
        blocks, scales = quantize_mxfp4(tensors.pop(name).transpose(1, 2))
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        oracle[name] = dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2).contiguous()
    config = json.loads((source / "config.json").read_text())
    dest.mkdir()
    save_file(tensors, dest / "model.safetensors")
    mxfp4_config = config | {"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}
    (dest / "config.json").write_text(json.dumps(mxfp4_config))
    oracle_folder = dest.with_name(dest.name + "-dequantized")
    oracle_folder.mkdir()
    save_file(oracle, oracle_folder / "model.safetensors")
    (oracle_folder / "config.json").write_text(json.dumps(config))
    return oracle_folder


def _narrowed(source: Path, dest: Path, width: int) -> Path:
    """``source`` (a transformers GPT-OSS folder) with each expert cut to its first ``width`` columns: a
    GPT-OSS model of intermediate_size ``width``."""
    tensors = load_file(source / "model.safetensors")
    for name in list(tensors):
        leaf = name.rpartition(".")[2]
        if leaf in ("gate_up_proj", "gate_up_proj_bias"):  # [E, H, 2I] / [E, 2I]: gate, up interleaved
            tensors[name] = tensors[name][..., : 2 * width].contiguous()
        elif leaf == "down_proj":  # [E, I, H]
            tensors[name] = tensors[name][:, :width].contiguous()
    dest.mkdir()
    save_file(tensors, dest / "model.safetensors")
    config = json.loads((source / "config.json").read_text()) | {"intermediate_size": width}
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def _mxfp4_engine(folder: Path, **knobs) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=str(folder), max_num_batched_tokens=48, block_size=8, **knobs))
    experts = engine.runner.model.model.layers[0].mlp.experts
    assert experts.weight_format == MXFP4_WEIGHTS and experts.gate_up_proj.dtype == torch.uint8
    return engine


def test_mxfp4_checkpoint_matches_transformers_on_its_values(tiny_models, tmp_path):
    """An MXFP4 checkpoint is served with MXFP4 experts: plait on it and transformers on its dequantised
    values agree on logits and greedy tokens."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "gpt-oss-mxfp4"
    oracle = _mxfp4_checkpoint(tiny_models["gpt_oss"], folder)
    hf = AutoModelForCausalLM.from_pretrained(oracle, dtype=torch.float32, attn_implementation="eager").eval()
    engine = _mxfp4_engine(folder)
    assert_greedy_matches_hf(engine, hf, random_prompts(3, 1, 60, seed=5), 8, 1e-4, "gpt_oss mxfp4")


def test_mxfp4_checkpoint_splits_over_two_ranks(tiny_models, tmp_path):
    """Split over two ranks, each keeps its share of every expert's MXFP4 rows (gate and up) and of its
    down projection's packed input columns with their scales (here one 32-value block each): transformers'
    tokens and logits on the dequantised values."""
    from transformers import AutoModelForCausalLM

    narrow = _narrowed(tiny_models["gpt_oss"], tmp_path / "gpt-oss-64", 2 * BLOCK_VALUES)
    folder = tmp_path / "gpt-oss-64-mxfp4"
    oracle = _mxfp4_checkpoint(narrow, folder)
    hf = AutoModelForCausalLM.from_pretrained(oracle, dtype=torch.float32, attn_implementation="eager").eval()
    engine = _mxfp4_engine(folder, tensor_parallel_size=2)
    try:
        assert_greedy_matches_hf(engine, hf, random_prompts(3, 1, 50, seed=9), 8, 1e-4, "gpt_oss mxfp4 tp2")
    finally:
        engine.shutdown()


def test_mxfp4_checkpoint_over_two_ranks_holding_whole_experts(tiny_models, tmp_path):
    """Expert parallelism: each rank keeps its two of the four MXFP4 experts whole (blocks, scales and
    biases: 96 wide, three blocks, where a split in width would pad), so nothing is padded; transformers'
    tokens and logits on the dequantised values."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "gpt-oss-mxfp4"
    oracle = _mxfp4_checkpoint(tiny_models["gpt_oss"], folder)
    hf = AutoModelForCausalLM.from_pretrained(oracle, dtype=torch.float32, attn_implementation="eager").eval()
    engine = _mxfp4_engine(folder, tensor_parallel_size=2, enable_expert_parallel=True)
    try:
        experts = engine.runner.model.model.layers[0].mlp.experts
        assert experts.gate_up_proj.shape[:2] == (2, 2 * 3 * BLOCK_VALUES)  # two experts, gate and up rows
        assert_greedy_matches_hf(engine, hf, random_prompts(3, 1, 50, seed=10), 8, 1e-4, "gpt_oss mxfp4 ep")
    finally:
        engine.shutdown()


def test_mxfp4_experts_that_split_in_part_blocks_are_padded(tiny_models, tmp_path):
    """Experts 96 wide (3 MXFP4 blocks) over two ranks: 48 columns a rank would cut a block, so each rank
    takes 64 (2 blocks), rank 1's last 32 of them zero weights past the checkpoint's end (vLLM pads gpt-oss's
    2,880 so for 4 or 8 ranks); transformers' tokens and logits on the dequantised values."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "gpt-oss-mxfp4"
    oracle = _mxfp4_checkpoint(tiny_models["gpt_oss"], folder)
    hf = AutoModelForCausalLM.from_pretrained(oracle, dtype=torch.float32, attn_implementation="eager").eval()
    engine = _mxfp4_engine(folder, tensor_parallel_size=2)
    try:
        experts = engine.runner.model.model.layers[0].mlp.experts
        assert experts.gate_up_proj.shape[1] == 2 * 2 * BLOCK_VALUES  # gate and up rows: 64 each
        assert_greedy_matches_hf(engine, hf, random_prompts(3, 1, 50, seed=10), 8, 1e-4, "gpt_oss mxfp4 pad")
    finally:
        engine.shutdown()


def test_mxfp4_shards_pad_each_rank_to_whole_blocks():
    """gpt-oss-20b's experts (2,880 wide: 90 blocks) over 4 and 8 ranks: each rank's slices are whole blocks
    (736 and 384 columns), the ranks' shares put back together are the checkpoint's tensors followed by zero
    codes (and finite scales), and the padding gate/up bias is zero."""
    from plait.config import ModelConfig
    from plait.parallel.shard import PAD_SCALE, shard_for

    hf = json.loads((BENCH_CONFIGS / "gpt-oss-20b" / "config.json").read_text())
    full = ModelConfig.from_hf({k: v for k, v in hf.items() if k != "quantization_config"}
                               | {"num_local_experts": 2})
    width, hidden, layer = full.moe.intermediate_size, full.hidden_size, "model.layers.0.mlp.experts."
    g = torch.Generator().manual_seed(0)
    codes = lambda *shape: torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    tensors = {layer + "gate_up_proj_blocks": codes(2, 2 * width, hidden // 32, 16),
               layer + "gate_up_proj_scales": codes(2, 2 * width, hidden // 32),
               layer + "down_proj_blocks": codes(2, hidden, width // 32, 16),
               layer + "down_proj_scales": codes(2, hidden, width // 32),
               layer + "gate_up_bias": torch.randn(2, 2 * width, generator=g)}
    for world, per_rank in ((4, 736), (8, 384)):
        shards = [dict(shard_for(full, r, world, BLOCK_VALUES).checkpoint(tensors.items()))
                  for r in range(world)]
        padded = per_rank * world - width
        for name, dim, pad in (("gate_up_proj_blocks", 1, 0), ("gate_up_proj_scales", 1, PAD_SCALE),
                               ("gate_up_bias", 1, 0)):
            halves = [s[layer + name].chunk(2, dim=dim) for s in shards]
            for half in range(2):  # gate rows, then up rows: each whole width, then the padding
                joined = torch.cat([h[half] for h in halves], dim=dim)
                want = tensors[layer + name].chunk(2, dim=dim)[half]
                assert joined.shape[dim] == per_rank * world
                assert torch.equal(joined.narrow(dim, 0, width), want), name
                assert (joined.narrow(dim, width, padded) == pad).all(), name
        for name, pad in (("down_proj_blocks", 0), ("down_proj_scales", PAD_SCALE)):
            joined = torch.cat([s[layer + name] for s in shards], dim=2)
            assert joined.shape[2] == per_rank * world // BLOCK_VALUES
            assert torch.equal(joined[:, :, : width // BLOCK_VALUES], tensors[layer + name]), name
            assert (joined[:, :, width // BLOCK_VALUES:] == pad).all(), name


def test_mxfp4_refusals(tiny_models, tmp_path):
    folder = tmp_path / "gpt-oss-half"
    _mxfp4_checkpoint(tiny_models["gpt_oss"], folder)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match="down_proj.* came with only its blocks"):
        LLMEngine(EngineConfig(model=str(folder)))
    llama = tmp_path / "llama-mxfp4"
    llama.mkdir()
    config = json.loads((tiny_models["llama"] / "config.json").read_text())
    mxfp4 = {"quantization_config": {"quant_method": "mxfp4"}}
    (llama / "config.json").write_text(json.dumps(config | mxfp4))
    (llama / "model.safetensors").write_bytes((tiny_models["llama"] / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="MXFP4 checkpoints of LlamaForCausalLM are not supported"):
        LLMEngine(EngineConfig(model=str(llama)))
    whole = tmp_path / "gpt-oss-mxfp4"
    _mxfp4_checkpoint(tiny_models["gpt_oss"], whole)
    with pytest.raises(ValueError, match="--quantization fp8: this checkpoint's experts are MXFP4"):
        LLMEngine(EngineConfig(model=str(whole), quantization="fp8"))


def test_gpt_oss_refusals(tiny_models):
    folder = str(tiny_models["gpt_oss"])
    with pytest.raises(ValueError, match="(?i)fp8"):
        LLMEngine(EngineConfig(model=folder, quantization="fp8"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mxfp4_checkpoint_on_the_gpu_is_its_dequantised_twin(tiny_models, tmp_path):
    """On the GPU the MXFP4 experts are decoded in the kernels: the model computes what the same model loaded
    from its dequantised values computes (Triton kernels, CUDA graphs), the same tokens and logits to fp32
    roundoff (the decode-sized MoE path steps K by 512 for MXFP4, 256 for 16 bits: another order of sums)."""
    from conftest import run_greedy

    folder = tmp_path / "gpt-oss-mxfp4"
    oracle = _mxfp4_checkpoint(tiny_models["gpt_oss"], folder)
    prompts = random_prompts(4, 1, 60, seed=6)
    results = [run_greedy(LLMEngine(EngineConfig(model=str(path), dtype="float32", max_num_batched_tokens=64,
                                                 block_size=16)), prompts, 8, capture_logits=True)
               for path in (folder, oracle)]
    (tokens, logits), (want_tokens, want_logits) = results
    assert tokens == want_tokens
    for i in want_logits:
        for a, b in zip(logits[i], want_logits[i], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=GPU_TWIN_ATOL * float(b.abs().max()))
