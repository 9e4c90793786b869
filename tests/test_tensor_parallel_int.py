"""Integer-weight checkpoints (GPTQ, AWQ, llm-compressor's pack-quantized) split across two ranks (CPU,
gloo): each rank takes whole packed words and groups of its output columns (q, k, v, gate, up) or of its
inputs (o, down), so the split model is the checkpoint's, as transformers runs the weights it stands for;
under GPTQ's act-order a row-parallel rank keeps every group's scales and zeros, its inputs' rows falling in
any group (unevenly: WNA16Linear pads them to whole words)."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_greedy_matches_hf, random_prompts
from test_moe import _dequantized_hf, moe_models  # noqa: F401 - the tiny MoE checkpoints
from test_wna16 import LOGITS_ATOL, _compressed_tensors_checkpoint, _quantized_checkpoint

from plait.config import EngineConfig
from plait.engine.engine import LLMEngine


def _hf_of(folder, weights: dict):
    """transformers' model of ``folder`` holding the weights a quantised checkpoint stands for."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    state = hf.state_dict()
    with torch.no_grad():
        for name, weight in weights.items():
            state[name].copy_(weight)
    return hf


def _split_matches_hf(dst, hf, method: str, **knobs) -> None:
    engine = LLMEngine(EngineConfig(model=str(dst), max_num_batched_tokens=48, block_size=8,
                                    tensor_parallel_size=2, **knobs))
    try:
        assert engine.runner.quantization == method
        assert_greedy_matches_hf(engine, hf, random_prompts(4, 1, 70, seed=5), 8, LOGITS_ATOL)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("method,bits,group", [("gptq", 4, 32), ("gptq", 8, -1), ("awq", 4, 16)])
def test_a_gptq_or_awq_checkpoint_split_in_two_is_its_model(tiny_models, tmp_path, method, bits, group):
    """GPTQ (codes packed along K, zero points along N; 8-bit with one group over each input) and AWQ (codes
    and zero points packed along N in AutoAWQ's interleave): transformers' logits and greedy tokens."""
    dst = tmp_path / method
    weights = _quantized_checkpoint(tiny_models["llama"], dst, method, bits, group, sym=method == "gptq",
                                    act_order=False)
    _split_matches_hf(dst, _hf_of(tiny_models["llama"], weights), method)


@pytest.mark.parametrize("bits,group,sym", [(4, 16, False), (8, 0, True)])
def test_a_compressed_tensors_checkpoint_split_in_two_is_its_model(tiny_models, tmp_path, bits, group, sym):
    """llm-compressor's pack-quantized W4A16 (groups of 16, zero points) and W8A16 (per channel), written by
    the compressed-tensors library: each rank's weight_shape is its own."""
    pytest.importorskip("compressed_tensors")
    dst = tmp_path / "ct"
    weights = _compressed_tensors_checkpoint(tiny_models["llama"], dst, bits, group, sym)
    _split_matches_hf(dst, _hf_of(tiny_models["llama"], weights), "compressed-tensors",
                      quantization="compressed-tensors")


@pytest.mark.parametrize("bits,group,sym", [(4, 32, False), (8, 16, True)])
def test_an_act_order_checkpoint_split_in_two_is_its_model(tiny_models, tmp_path, bits, group, sym):
    """GPTQ desc_act: each projection's g_idx a random permutation's groups, so each rank's half of o's and
    down's inputs holds rows of every group, unevenly; transformers' logits and greedy tokens."""
    dst = tmp_path / "act"
    weights = _quantized_checkpoint(tiny_models["llama"], dst, "gptq", bits, group, sym=sym, act_order=True)
    _split_matches_hf(dst, _hf_of(tiny_models["llama"], weights), "gptq")


@pytest.mark.parametrize("family,method,group,sym", [("qwen3_moe", "gptq", 16, True),
                                                      ("qwen2_moe", "awq", 16, False)])
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["width", "whole-experts"])
def test_an_integer_moe_checkpoint_split_in_two_is_its_model(moe_models, tmp_path, family, method,  # noqa: F811
                                                             group, sym, expert_parallel):
    """GPTQ / AWQ experts split as their 16-bit twins (each rank whole words and groups of every expert's gate
    and up columns and down inputs: the tiny models' 32-wide experts in 16-wide groups), or whole experts a
    rank; Qwen2-MoE's shared expert and dense layer split as dense integer layers: transformers' model of the
    weights the checkpoint stands for."""
    folder, _ = moe_models[family]
    weights = _quantized_checkpoint(folder, tmp_path / method, method, 4, group, sym, False)
    hf = _dequantized_hf(folder, tmp_path / "dequantized", weights)
    _split_matches_hf(tmp_path / method, hf, method, enable_expert_parallel=expert_parallel)


def test_an_integer_moe_split_that_cuts_groups_is_refused(moe_models, tmp_path):  # noqa: F811 - fixture
    """32-wide experts in groups of 32 leave each of two ranks half a group of down's inputs: refused with the
    fixes named (as vLLM refuses it); whole experts a rank are fine."""
    folder, _ = moe_models["qwen3_moe"]
    weights = _quantized_checkpoint(folder, tmp_path / "gptq", "gptq", 4, 32, True, False)
    with pytest.raises(ValueError, match=r"16 of every routed expert's 32 .* 32-wide GPTQ groups and packed "
                                         r"words.*enable_expert_parallel=True"):
        LLMEngine(EngineConfig(model=str(tmp_path / "gptq"), tensor_parallel_size=2, max_model_len=128))
    hf = _dequantized_hf(folder, tmp_path / "dequantized", weights)
    _split_matches_hf(tmp_path / "gptq", hf, "gptq", enable_expert_parallel=True)

