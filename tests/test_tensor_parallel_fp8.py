"""FP8 models split across ranks (CPU, gloo): an FP8 checkpoint's codes and scales sliced with their weights
(a tensor's one scale whole, a row's with its row, a tile's with its tile); tiles make the very model of one
device (inputs rounded per 32-wide group, which a rank's slice holds whole); a 16-bit checkpoint quantised on
each rank keeps every column-parallel row's codes and scale, and a row-parallel slice takes its own row
scales. FP8 MoE models split too: a block-wise checkpoint's experts by width (each rank whole tiles of every
expert's rows and columns) or whole (expert parallelism), and a 16-bit MoE's experts quantised on each rank.
What cannot split (tiles cut across, integer-weight MoE) is refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import rpc_extension
import torch
from conftest import TINY_VOCAB, assert_engines_agree, random_prompts, run_greedy
from rpc_extension import fp8_experts, fp8_layers
from test_fp8 import _fp8_checkpoint
from test_fp8_block import block_checkpoint
from test_moe import (
    WEIGHT_SCALE,
    fp8_moe_checkpoint,
    moe_models,  # noqa: F401 - the tiny MoE checkpoints
)

from plait.config import EngineConfig, ModelConfig
from plait.engine.engine import LLMEngine
from plait.layers.fp8 import quantize_rows
from plait.parallel.shard import shard_for

SPLIT_ATOL = 1e-4  # the ranks' partial sums change the order of fp32 additions
KNOBS = dict(block_size=8, max_num_batched_tokens=24, max_model_len=96, device="cpu")


def _split_agrees(folder, expert_parallel: bool = False) -> None:
    whole = LLMEngine(EngineConfig(model=str(folder), **KNOBS))
    split = LLMEngine(EngineConfig(model=str(folder), tensor_parallel_size=2,
                                   enable_expert_parallel=expert_parallel, **KNOBS))
    try:
        assert split.runner.quantization == "fp8"
        assert_engines_agree(split, whole, random_prompts(4, 3, 40, seed=17), max_tokens=6, atol=SPLIT_ATOL)
    finally:
        split.shutdown()


@pytest.mark.parametrize("method", ["compressed-tensors", "fp8"])
def test_an_fp8_checkpoint_split_in_two_keeps_its_codes_and_scales(tiny_models, tmp_path, method,
                                                                    monkeypatch):
    """Per-channel scales (llm-compressor) and one scale a tensor (AutoFP8): each rank holds the checkpoint's
    codes of its q rows and o columns, with their scales. Its answers differ from one device's by the
    rounding of its own slice of each o / down input to FP8 (one scale a token on that slice, as vLLM's ranks
    round theirs): less than FP8 moves them from the 16-bit model's, where a wrong slice would move them by
    their whole size."""
    written = _fp8_checkpoint(tiny_models["llama"], tmp_path / "ckpt", method)
    _importable_by_the_other_rank(monkeypatch)
    whole = LLMEngine(EngineConfig(model=str(tmp_path / "ckpt"), **KNOBS))
    split = LLMEngine(EngineConfig(model=str(tmp_path / "ckpt"), tensor_parallel_size=2, **KNOBS))
    try:
        for rank, layers in enumerate(split.collective_rpc(fp8_layers)):
            q_codes, q_scale = written["model.layers.1.self_attn.q_proj.weight"]
            o_codes, o_scale = written["model.layers.1.self_attn.o_proj.weight"]
            rows = q_codes.shape[0] // 2
            mine = slice(rank * rows, (rank + 1) * rows)
            qkv_codes, qkv_scale = layers["model.layers.1.self_attn.qkv_proj"]
            assert torch.equal(qkv_codes[:rows], q_codes[mine].view(torch.uint8))
            assert torch.equal(qkv_scale[:rows], q_scale.reshape(-1).expand(q_codes.shape[0])[mine])
            got_codes, got_scale = layers["model.layers.1.self_attn.o_proj"]
            assert torch.equal(got_codes, o_codes[:, mine].view(torch.uint8))
            assert torch.equal(got_scale, o_scale.reshape(-1).expand(o_codes.shape[0]))
        prompts = random_prompts(4, 3, 40, seed=17)
        unquantised = LLMEngine(EngineConfig(model=str(tiny_models["llama"]), **KNOBS))
        split_logits, whole_logits, plain_logits = (run_greedy(engine, prompts, 1, capture_logits=True)[1]
                                                    for engine in (split, whole, unquantised))
        for i in whole_logits:  # the split moves the logits less than FP8 itself does
            split_moves = (split_logits[i][0] - whole_logits[i][0]).norm()
            assert 0 < split_moves < (whole_logits[i][0] - plain_logits[i][0]).norm()
    finally:
        split.shutdown()


def _importable_by_the_other_rank(monkeypatch) -> None:
    """The other rank is a fresh interpreter: the functions collective_rpc sends must import there."""
    tests = str(Path(rpc_extension.__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))


@pytest.fixture(scope="module")
def wide_heads_llama(tmp_path_factory):
    """A tiny Llama whose every rank's slice (of 2) is whole 32-wide tiles: heads of 32, 2 KV heads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(71)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, head_dim=32)
    folder = tmp_path_factory.mktemp("llama-wide-heads")
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("fmt", ["fp8", "compressed-tensors"])
def test_a_block_fp8_checkpoint_split_in_two_is_the_model_on_one_device(wide_heads_llama, tmp_path, fmt):
    """Tile scales (DeepSeek / Qwen's weight_scale_inv, llm-compressor's 2-D weight_scale): each rank takes
    the tiles of its rows (q, k, v, gate, up) or of its columns (o, down)."""
    block_checkpoint(wide_heads_llama, tmp_path / "ckpt", fmt, block=(32, 32))
    _split_agrees(tmp_path / "ckpt")


def test_tiles_cut_across_by_a_split_are_refused(tiny_models, tmp_path):
    """tiny_models' KV heads are 16 wide: one a rank cuts a 32-row tile in two."""
    block_checkpoint(tiny_models["llama"], tmp_path / "ckpt", "fp8", block=(32, 32))
    with pytest.raises(Exception, match="does not fall on the checkpoint's 32-row blocks"):
        LLMEngine(EngineConfig(model=str(tmp_path / "ckpt"), tensor_parallel_size=2, **KNOBS))


def test_quantising_a_16_bit_checkpoint_on_each_rank(tiny_models, monkeypatch):
    """--quantization fp8 of a 16-bit checkpoint, split: each rank quantises its slices row by row. A
    column-parallel layer's rows are whole, so its codes and scales are the one-device layer's rows; a
    row-parallel layer's (o, down) are each rank's own slice of every row, rounded on that slice's scale."""
    from safetensors.torch import load_file

    _importable_by_the_other_rank(monkeypatch)
    folder = tiny_models["llama"]
    checkpoint = load_file(str(next(folder.glob("*.safetensors"))))
    whole = LLMEngine(EngineConfig(model=str(folder), quantization="fp8", **KNOBS))
    split = LLMEngine(EngineConfig(model=str(folder), quantization="fp8", tensor_parallel_size=2, **KNOBS))
    try:
        ranks = split.collective_rpc(fp8_layers)
        one = fp8_layers(whole.runner.worker)
        for rank, layers in enumerate(ranks):
            codes, scale = layers["model.layers.1.mlp.gate_up_proj"]
            half = one["model.layers.1.mlp.gate_up_proj"][0].shape[0] // 4  # gate's rows of one rank
            gate_rows = slice(rank * half, (rank + 1) * half)
            assert torch.equal(codes[:half], one["model.layers.1.mlp.gate_up_proj"][0][gate_rows])
            assert torch.equal(scale[:half], one["model.layers.1.mlp.gate_up_proj"][1][gate_rows])
            down = checkpoint["model.layers.1.mlp.down_proj.weight"]
            cols = down.shape[1] // 2
            want_codes, want_scale = quantize_rows(down[:, rank * cols:(rank + 1) * cols].float())
            got_codes, got_scale = layers["model.layers.1.mlp.down_proj"]
            assert torch.equal(got_codes, want_codes.view(torch.uint8)) and torch.equal(got_scale, want_scale)
    finally:
        split.shutdown()


# -- MoE ---------------------------------------------------------------------------------------------------

# Qwen3-30B-A3B's expert widths (768 columns, 128 experts) and tiles (128 x 128).
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
                 "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                 "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936}
QWEN3_30B_A3B_TILE = (128, "FP8 tiles")
TINY_MOE_BLOCK = (32, 32)
MOE_NEW_TOKENS = 6
# FP8 rounds every layer's input (and each expert's hidden activations): where the split's other order of
# fp32 sums moves a value across an FP8 rounding boundary (about one value in a million), that value moves by
# an FP8 step, 1/16 of itself, and the logits after it by up to ~0.1 here (one row of 24 in the block test:
# 0.103, the logits' std being 1.3), for the rest of that prompt. A wrong slice or tile scale moves every
# row by about the logits' spread.
FP8_FLIP_ATOL = 0.25
# --quantization fp8 split in two, its first logits' distance from the 16-bit model's over one device's FP8
# model's. Each rank rounds its own slice of attention's o (weight per row, input per token), which in this
# tiny model is most of what FP8 moves: measured 0.88x-1.15x. Every MoE block's output halved (a lost
# partial sum) measured 2.2x-4.5x, a rank's up rows swapped with the other's 5x-16x.
SPLIT_FP8_DISTANCE = 1.5


@pytest.fixture(scope="module")
def wide_experts(tmp_path_factory):
    """A tiny Qwen3-MoE whose experts are 256 wide: half an expert (a rank's of 2) is whole 32-wide tiles of a
    block checkpoint, and whole 128 x 128 tiles of the experts --quantization fp8 makes (so those rank
    slices are the one-device experts' own tiles); its heads (32 wide, 2 KV heads) split in whole 32-wide
    tiles too."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(83)
    cfg = Qwen3MoeConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, vocab_size=TINY_VOCAB,
                         max_position_embeddings=256, num_experts=8, num_experts_per_tok=3,
                         moe_intermediate_size=256, norm_topk_prob=True, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2)
    model = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():  # routers' logits apart, as test_moe's models (its WEIGHT_SCALE says why)
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(WEIGHT_SCALE)
    folder = tmp_path_factory.mktemp("qwen3-moe-wide-experts")
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["width", "whole-experts"])
def test_a_block_fp8_moe_checkpoint_split_in_two_is_the_model_on_one_device(wide_experts, tmp_path,
                                                                            expert_parallel, monkeypatch):
    """Qwen3-30B-A3B-FP8's form (weight_scale_inv per 32 x 32 tile here, routers 16-bit): each rank holds
    every expert's gate and up rows and down columns in whole tiles with their scales, or half the experts
    whole; either way the model of one device, up to the order of fp32 sums."""
    fp8_moe_checkpoint(wide_experts, tmp_path / "ckpt", block=TINY_MOE_BLOCK)
    _importable_by_the_other_rank(monkeypatch)
    whole = LLMEngine(EngineConfig(model=str(tmp_path / "ckpt"), **KNOBS))
    split = LLMEngine(EngineConfig(model=str(tmp_path / "ckpt"), tensor_parallel_size=2,
                                   enable_expert_parallel=expert_parallel, **KNOBS))
    try:
        assert split.runner.quantization == "fp8"
        _assert_ranks_hold_their_share(split, fp8_experts(whole.runner.worker), expert_parallel)
        _assert_same_fp8_model(split, whole, random_prompts(4, 3, 40, seed=17))
    finally:
        split.shutdown()


def _assert_same_fp8_model(split: LLMEngine, whole: LLMEngine, prompts: list[list[int]]) -> None:
    """The split runs the one-device model: the same greedy tokens, most logits rows to the order of fp32
    sums (SPLIT_ATOL), and every row within one FP8 rounding flip of it (FP8_FLIP_ATOL)."""
    got, got_logits = run_greedy(split, prompts, MOE_NEW_TOKENS, arrive_every=1, capture_logits=True)
    want, want_logits = run_greedy(whole, prompts, MOE_NEW_TOKENS, arrive_every=1, capture_logits=True)
    assert got == want
    moved = torch.tensor([float((a - b).abs().max()) for i in want_logits
                          for a, b in zip(got_logits[i], want_logits[i], strict=True)])
    assert moved.median() <= SPLIT_ATOL and moved.max() <= FP8_FLIP_ATOL, sorted(moved.tolist())


def _assert_ranks_hold_their_share(split: LLMEngine, one_device: dict, expert_parallel: bool) -> None:
    """Every rank's FP8 experts (codes and tile scales of every MoE block) are its share of one device's, bit
    for bit."""
    ranks = split.collective_rpc(fp8_experts)
    for rank, experts in enumerate(ranks):
        assert experts.keys() == one_device.keys()
        for name, stacks in one_device.items():
            want = _rank_share(stacks, rank, len(ranks), expert_parallel)
            assert all(torch.equal(a, b) for a, b in zip(experts[name], want, strict=True)), (rank, name)


def _rank_share(stacks: tuple, rank: int, world_size: int, expert_parallel: bool) -> tuple:
    """One device's FP8 experts (rpc_extension.fp8_experts' stacks) as rank ``rank`` holds them: its experts
    whole, or every expert's gate and up rows and down columns, each with its tiles' scales (the tiles
    whole, so a share of the scales is the same share of the tile rows and columns)."""
    if expert_parallel:
        return tuple(t.chunk(world_size, dim=0)[rank] for t in stacks)
    gate_up, gate_up_scale, down, down_scale = stacks

    def gate_and_up(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([half.chunk(world_size, dim=1)[rank] for half in t.chunk(2, dim=1)], dim=1)

    columns = [t.chunk(world_size, dim=2)[rank] for t in (down, down_scale)]
    return gate_and_up(gate_up), gate_and_up(gate_up_scale), *columns


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["width", "whole-experts"])
def test_quantising_a_16_bit_moe_on_each_rank(wide_experts, expert_parallel, monkeypatch):
    """--quantization fp8 of a 16-bit MoE split in two: each rank quantises its experts' slices (or its whole
    experts) in 128 x 128 tiles, which here are the one-device experts' own tiles: codes and scales bit for
    bit (and each rank's slice of down's input rounds in the one-device 128-wide groups). Attention's o is
    per-row FP8, its weight and input rounded on each rank's own slice (as vLLM's ranks do), so the split is
    another FP8 rounding of the 16-bit model, about as far from it as one device's (SPLIT_FP8_DISTANCE)."""
    _importable_by_the_other_rank(monkeypatch)
    knobs = dict(model=str(wide_experts), **KNOBS)
    whole = LLMEngine(EngineConfig(quantization="fp8", **knobs))
    split = LLMEngine(EngineConfig(quantization="fp8", tensor_parallel_size=2,
                                   enable_expert_parallel=expert_parallel, **knobs))
    try:
        one = fp8_experts(whole.runner.worker)
        assert one["model.layers.0.mlp.experts"][1].shape == (8, 4, 1)  # 128-row tiles of 2 x 256 rows
        _assert_ranks_hold_their_share(split, one, expert_parallel)
        prompts = random_prompts(4, 3, 40, seed=17)
        unquantised = LLMEngine(EngineConfig(**knobs))
        split_logits, whole_logits, plain_logits = (run_greedy(engine, prompts, 1, capture_logits=True)[1]
                                                    for engine in (split, whole, unquantised))
        for i in whole_logits:
            split_from_16_bit = (split_logits[i][0] - plain_logits[i][0]).norm()
            one_device_from_16_bit = (whole_logits[i][0] - plain_logits[i][0]).norm()
            assert not torch.equal(split_logits[i][0], whole_logits[i][0])  # o rounds on each rank's slice
            assert split_from_16_bit <= SPLIT_FP8_DISTANCE * one_device_from_16_bit
    finally:
        split.shutdown()


def test_an_expert_split_that_cuts_tiles_is_refused(moe_models, tmp_path):  # noqa: F811 - imported above
    """vLLM refuses these too. Qwen3-30B-A3B's 768-wide experts take 384 (3 tiles) a rank over 2 and 192 over
    4, which is not whole 128-wide tiles; the tiny Qwen3-MoE's 32-wide experts, 16 a rank, are not whole
    32-wide tiles, from a block checkpoint or from --quantization fp8. Whole experts a rank always are."""
    cfg = ModelConfig.from_hf(QWEN3_30B_A3B)
    assert shard_for(cfg, 1, 2, expert_tile=QWEN3_30B_A3B_TILE).local.moe.intermediate_size == 384
    with pytest.raises(ValueError, match=r"gives each rank 192 .* 768 .*not a whole number of its 128-wide"):
        shard_for(cfg, 1, 4, expert_tile=QWEN3_30B_A3B_TILE)
    assert shard_for(cfg, 1, 4, expert_parallel=True, expert_tile=QWEN3_30B_A3B_TILE).expert_range == (32, 64)
    folder = moe_models["qwen3_moe"][0]
    fp8_moe_checkpoint(folder, tmp_path / "ckpt", block=TINY_MOE_BLOCK)
    fix = r"32-wide FP8 tiles.*enable_expert_parallel=True.*splits 32 into multiples of 32"
    for model, knobs in ((tmp_path / "ckpt", {}), (folder, dict(quantization="fp8"))):
        with pytest.raises(ValueError, match=fix):
            LLMEngine(EngineConfig(model=str(model), tensor_parallel_size=2, **knobs, **KNOBS))
