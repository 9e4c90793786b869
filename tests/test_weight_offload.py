"""cpu_offload_gb (vLLM's --cpu-offload-gb): the first layers' weights live in host memory and are copied into
one device buffer as each layer runs; the model computes exactly what it computes without offloading."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import random_prompts, run_greedy

from plait.config import EngineConfig
from plait.engine.engine import LLMEngine
from plait.entrypoints.cli import build_parser

# A few KiB: less than one tiny layer, so the first layer alone is offloaded.
ONE_TINY_LAYER_GB = 1e-6


def _engine(model, **knobs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), seed=3, num_kv_blocks=128, block_size=8,
                                  max_num_batched_tokens=48, **knobs))


@pytest.mark.parametrize("offload_gb, layers", [(ONE_TINY_LAYER_GB, 1), (1.0, 2)])
def test_offloaded_layers_compute_what_resident_ones_do(tiny_llama, offload_gb, layers):
    prompts = random_prompts(4, 3, 60, seed=41)
    want = run_greedy(_engine(tiny_llama), prompts, max_tokens=12)[0]
    engine = _engine(tiny_llama, cpu_offload_gb=offload_gb)
    offload = engine.runner.weight_offload
    assert offload.num_layers == layers
    layer = engine.runner.model.model.layers[0]
    # The layer's weights are views of the shared buffer, which the host copy refills before it runs.
    assert layer.self_attn.qkv_proj.weight.untyped_storage().data_ptr() == offload.buffer.data_ptr()
    assert run_greedy(engine, prompts, max_tokens=12)[0] == want


def test_offloaded_parameters_keep_their_strides():
    """A parameter kept transposed (column-major, as some kernels want their weights) keeps that layout in
    the buffer: the layer computes what it did, reading the host copy's bytes as it read its own."""
    from torch import nn

    from plait.runner.weight_offload import WeightOffload

    torch.manual_seed(0)
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 4)])
    first = model.model.layers[0]
    first.weight.data = first.weight.data.t().contiguous().t()  # [16, 8] with strides (1, 16)
    x = torch.randn(3, 8)
    want = model.model.layers[1](first(x))
    offload = WeightOffload(model, num_bytes=1, device=torch.device("cpu"))
    assert offload.num_layers == 1 and first.weight.stride() == (1, 16)
    assert first.weight.untyped_storage().data_ptr() == offload.buffer.data_ptr()
    assert torch.equal(model.model.layers[1](first(x)), want)


def test_cpu_offload_refusals_name_what_is_wrong(tiny_llama):
    with pytest.raises(ValueError, match="cpu_offload_gb must be a number"):
        EngineConfig(model=str(tiny_llama), cpu_offload_gb=-1)
    with pytest.raises(ValueError, match="with enable_lora is not supported"):
        EngineConfig(model=str(tiny_llama), cpu_offload_gb=1, enable_lora=True)
    with pytest.raises(ValueError, match="with enable_sleep_mode is not supported"):
        EngineConfig(model=str(tiny_llama), cpu_offload_gb=1, enable_sleep_mode=True)
    engine = _engine(tiny_llama, cpu_offload_gb=ONE_TINY_LAYER_GB)
    with pytest.raises(ValueError, match="cpu_offload_gb"):
        engine.runner.load_weights([])
    args = build_parser().parse_args(["serve", str(tiny_llama), "--cpu-offload-gb", "4"])
    assert args.cpu_offload_gb == 4.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offloaded_layers_on_the_gpu_free_their_memory_and_replay_in_graphs(tmp_path):
    """bf16 with CUDA graphs: the same greedy tokens as the resident model (the same kernels read the same
    values), the offloaded bytes less the buffer gone from the device, every decode step a graph replay."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
           "intermediate_size": 8192, "num_hidden_layers": 8, "num_attention_heads": 16,
           "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 8192, "max_position_embeddings": 2048,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    prompts = random_prompts(8, 5, 200, seed=42)

    def run(**knobs) -> tuple[list[list[int]], int, LLMEngine]:
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        engine = LLMEngine(EngineConfig(model=str(tmp_path), load_format="dummy", seed=5, num_kv_blocks=512,
                                        max_model_len=1024, max_num_seqs=16, **knobs))
        held = torch.cuda.memory_allocated() - before
        return run_greedy(engine, prompts, max_tokens=24)[0], held, engine

    want, resident_bytes, engine = run()
    del engine
    got, offloaded_bytes, engine = run(cpu_offload_gb=0.5)
    offload = engine.runner.weight_offload
    assert offload.num_layers >= 2 and offload.num_bytes >= 0.5 * 2**30
    assert got == want
    freed = resident_bytes - offloaded_bytes
    assert freed >= 0.9 * (offload.num_bytes - offload.buffer.numel()), (freed, offload.num_bytes)
    b = engine.runner.breakdown
    assert b.single_token_steps > 0 and b.graph_single_token_steps == b.single_token_steps
