"""FP8 models split across ranks (CPU, gloo): an FP8 checkpoint's codes and scales sliced with their weights
(a tensor's one scale whole, a row's with its row, a tile's with its tile); tiles make the very model of one
device (inputs rounded per 32-wide group, which a rank's slice holds whole); a 16-bit checkpoint quantised on
each rank keeps every column-parallel row's codes and scale, and a row-parallel slice takes its own row
scales; what cannot split (tiles cut across, FP8 MoE) is refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import rpc_extension
import torch
from conftest import assert_engines_agree, random_prompts, run_greedy
from rpc_extension import fp8_layers
from test_fp8 import _fp8_checkpoint
from test_fp8_block import block_checkpoint
from test_moe import moe_models  # noqa: F401 - the tiny MoE checkpoints

from plait.config import EngineConfig
from plait.engine.engine import LLMEngine
from plait.layers.fp8 import quantize_rows

SPLIT_ATOL = 1e-4  # the ranks' partial sums change the order of fp32 additions
KNOBS = dict(block_size=8, max_num_batched_tokens=24, max_model_len=96, device="cpu")


def _split_agrees(folder, **knobs) -> None:
    whole = LLMEngine(EngineConfig(model=str(folder), **KNOBS, **knobs))
    split = LLMEngine(EngineConfig(model=str(folder), tensor_parallel_size=2, **KNOBS, **knobs))
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


def test_fp8_moe_models_are_refused(moe_models):  # noqa: F811 - the fixture imported above
    with pytest.raises(ValueError, match="fp8 MoE models cannot be split across devices yet"):
        LLMEngine(EngineConfig(model=str(moe_models["qwen3_moe"][0]), quantization="fp8",
                               tensor_parallel_size=2, **KNOBS))
