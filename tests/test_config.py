"""Engine defaults that depend on where and how the engine runs (the step token budget), dtype names, and how
model configs are read."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from plait.config import (
    NO_CHUNK_CAP,
    SERVING_PREFILL_CAP,
    EngineConfig,
    ModelConfig,
    default_token_budget,
    hidden_activation,
)
from plait.runner.cuda_graphs import FEW_PROMPT_ROWS, decode_buckets, graph_shapes, token_buckets

GB = 1024**3


@pytest.mark.parametrize(("usage", "device", "memory", "name", "budget"), [
    ("offline", "cuda", 141 * GB, "NVIDIA H200", 16384),  # vLLM's LLM class on an H200
    ("serve", "cuda", 141 * GB, "NVIDIA H200", 8192),  # `vllm serve` there: WORKLOADS.md's W4 peer
    ("offline", "cuda", 80 * GB, "NVIDIA H100 80GB HBM3", 16384),
    ("offline", "cuda", 80 * GB, "NVIDIA A100-SXM4-80GB", 8192),  # vLLM measured big budgets slower there
    ("serve", "cuda", 80 * GB, "NVIDIA A100-SXM4-80GB", 2048),
    ("offline", "cuda", 24 * GB, "NVIDIA L4", 8192),
    ("serve", "cuda", 24 * GB, "NVIDIA L4", 2048),
    ("offline", "cpu", 0, "", 2048),
    ("serve", "cpu", 0, "", 2048),
])
def test_default_token_budget_follows_vllm(usage, device, memory, name, budget):
    assert default_token_budget(usage, device, memory, name) == budget
    config = EngineConfig(usage=usage).with_token_budget(device, memory, name)
    assert config.max_num_batched_tokens == budget


def test_a_given_budget_is_kept_and_bad_usage_refused():
    config = EngineConfig(max_num_batched_tokens=64, max_prefill_tokens_beside_decodes=32, usage="serve")
    assert config.with_token_budget("cuda", 141 * GB, "NVIDIA H200") is config
    with pytest.raises(ValueError, match="usage"):
        EngineConfig(usage="batch")
    with pytest.raises(ValueError, match="prefill_drain_steps"):
        EngineConfig(prefill_drain_steps=-1)


def test_expert_parallel_needs_tensor_parallel_ranks():
    """vLLM's enable_expert_parallel deals a MoE model's experts out over the tensor-parallel ranks: with one
    rank it is refused (plait's data-parallel replicas share none), and it is a true or false."""
    assert EngineConfig(tensor_parallel_size=2, enable_expert_parallel=True).enable_expert_parallel
    with pytest.raises(ValueError, match="needs tensor_parallel_size > 1"):
        EngineConfig(enable_expert_parallel=True)
    with pytest.raises(ValueError, match="enable_expert_parallel must be true or false"):
        EngineConfig(tensor_parallel_size=2, enable_expert_parallel="yes")


def test_prompt_tokens_beside_decodes_are_capped_when_serving_only():
    """Serving protects running streams from a long prompt (256 prompt tokens beside decodes); offline nobody
    watches a stream, so the default is no cap (the serving cap cost LLM.generate a third of W1's throughput
    on an H200). Chosen with the budget, so a config replaced into serving after it was made takes serving's
    cap, as `serve` does; a given cap is kept either way."""
    offline = EngineConfig()
    assert offline.max_prefill_tokens_beside_decodes is None
    assert offline.with_token_budget("cpu").max_prefill_tokens_beside_decodes == NO_CHUNK_CAP
    served = dataclasses.replace(offline, usage="serve").with_token_budget("cuda", 141 * GB, "NVIDIA H200")
    assert served.max_prefill_tokens_beside_decodes == SERVING_PREFILL_CAP == 256
    for usage in ("offline", "serve"):
        given = EngineConfig(usage=usage, max_prefill_tokens_beside_decodes=64).with_token_budget("cpu")
        assert given.max_prefill_tokens_beside_decodes == 64
    with pytest.raises(ValueError, match="max_prefill_tokens_beside_decodes"):
        EngineConfig(max_prefill_tokens_beside_decodes=-1)


def test_max_long_partial_prefills_is_checked_as_vllm():
    from plait.entrypoints.cli import _engine_config, parse_args

    flags = ["--long-prefill-token-threshold", "512", "--max-num-partial-prefills", "4",
             "--max-long-partial-prefills", "1"]
    config = _engine_config(parse_args(["serve", *flags]))
    assert (config.max_long_partial_prefills, config.long_partial_prefills_limit) == (1, 1)
    assert EngineConfig(max_num_partial_prefills=3).long_partial_prefills_limit == 3
    with pytest.raises(ValueError, match=r"max_long_partial_prefills \(5\) must be at most max_num_partial"):
        EngineConfig(max_num_partial_prefills=4, max_long_partial_prefills=5, long_prefill_token_threshold=8)
    # Which prompts are long is the threshold's to say: without one the limit would mean nothing.
    with pytest.raises(ValueError, match="needs long_prefill_token_threshold"):
        EngineConfig(max_num_partial_prefills=4, max_long_partial_prefills=1)
    with pytest.raises(ValueError, match="max_long_partial_prefills"):
        EngineConfig(max_long_partial_prefills=0, long_prefill_token_threshold=8)


def test_cpu_engine_takes_the_cpu_budget(tiny_llama):
    from plait.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=16, max_model_len=64))
    assert engine.config.max_num_batched_tokens == 2048
    assert engine.scheduler.config is engine.config and engine.runner.config is engine.config


def test_kv_cache_memory_bytes_sizes_the_cache_as_vllm(tiny_llama):
    """vLLM's kv_cache_memory_bytes: the KV cache holds as many blocks as that many bytes do (num_kv_blocks
    still wins); too few bytes for two blocks (the pad block and one) is refused by name."""
    from plait.engine.engine import LLMEngine

    base = dict(model=str(tiny_llama), max_model_len=64, block_size=8)
    one = LLMEngine(EngineConfig(**base, num_kv_blocks=16))
    per_block = one.runner._bytes_per_block()
    sized = LLMEngine(EngineConfig(**base, kv_cache_memory_bytes=37 * per_block + per_block // 2))
    assert sized.runner.num_kv_blocks == 37
    assert sum(t.numel() * t.element_size() for t in sized.runner.kv_caches) == 37 * per_block
    both = LLMEngine(EngineConfig(**base, kv_cache_memory_bytes=37 * per_block, num_kv_blocks=11))
    assert both.runner.num_kv_blocks == 11
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        LLMEngine(EngineConfig(**base, kv_cache_memory_bytes=per_block))
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        EngineConfig(kv_cache_memory_bytes=0)


def test_mixed_graph_token_buckets_are_whole_row_tiles_up_to_the_cap():
    assert token_buckets(0, 0, 4096) == []
    # Whole GEMM row tiles, up to the first with room for the cap beside a full decode part.
    assert token_buckets(4, 256, 4096) == [32, 64, 128, 256, 384]
    assert token_buckets(0, 256, 4096) == [32, 64, 128, 256]
    assert token_buckets(208, 512, 4096) == [256, 384, 512, 640, 768]
    assert token_buckets(4, 28, 4096) == [32]  # small steps: the cap itself, so a full step pads nothing
    assert token_buckets(4, 10**6, 4096)[-1] == 1152  # past 1024 prompt tokens the GPU hides launches
    assert token_buckets(4, 256, 200) == [32, 64, 128, 200]  # pad tokens are one sequence: max_model_len
    shapes = graph_shapes(8, 128, 4096)
    assert {s.num_tokens for s in shapes if s.is_mixed} == {32, 64, 128, 256}
    assert all(s.num_rows == 9 for s in shapes if s.is_mixed)  # a spare row for the pad tokens
    assert {s.decode_rows for s in shapes if not s.is_mixed} == {1, 2, 4, 8}
    # No cap beside decodes (offline): prompt chunks alone still get graphs, decodes beside them do not.
    shapes = graph_shapes(8, 0, 4096, max_prompt_only_tokens=256)
    mixed = {(s.decode_rows, s.num_tokens) for s in shapes if s.is_mixed}
    assert mixed == {(0, t) for t in (32, 64, 128, 256)}
    beside = graph_shapes(8, 128, 4096, 512)
    assert {s.num_tokens for s in beside if s.decode_rows == 4 and s.is_mixed} == {32, 64, 128, 256}
    # Speculative decoding: rows of 1 + drafts alone take 8- and 16-token shapes too.
    spec = graph_shapes(8, 128, 4096, speculative=True)
    assert {s.num_tokens for s in spec if s.decode_rows == 0} == {8, 16, 32, 64, 128}
    assert {s.num_tokens for s in spec if s.decode_rows == 4 and s.is_mixed} == {32, 64, 128, 256}
    # A pooling model's steps are prompt chunks alone: no shape with a decode part is captured.
    pooling = graph_shapes(8, 128, 4096, 512, decodes=False)
    assert {(s.decode_rows, s.num_tokens) for s in pooling} == {(0, t) for t in (32, 64, 128, 256, 384, 512)}


def test_cuda_graph_sizes_choose_the_decode_buckets_as_vllm():
    """vLLM's --cuda-graph-sizes: a list is captured as given (sizes over max_num_seqs left out), one size N
    as 1, 2, 4 and every 8 up to N; the default reaches max_num_seqs, so every decode step replays."""
    assert decode_buckets(256) == [1, 2, 4, 8, *range(16, 65, 8), *range(80, 257, 16)]
    assert decode_buckets(256, [1, 3, 300, 64]) == [1, 3, 64]
    assert decode_buckets(256, [40]) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert decode_buckets(20, [64]) == [1, 2, 4, 8, 16]
    shapes = graph_shapes(8, 128, 4096, decode_sizes=[1, 2])
    assert {s.decode_rows for s in shapes if not s.is_mixed} == {1, 2}
    assert {s.decode_rows for s in shapes if s.is_mixed} == {0, 1, 2}
    for bad in ([], [0], 8, [2.5]):
        with pytest.raises(ValueError, match="cuda_graph_sizes"):
            EngineConfig(cuda_graph_sizes=bad)


def test_cli_takes_cuda_graph_sizes_as_vllm():
    from plait.entrypoints.cli import _engine_config, parse_args

    given = parse_args(["generate", "hi", "--cuda-graph-sizes", "1", "2", "4"])
    assert _engine_config(given).cuda_graph_sizes == [1, 2, 4]
    assert _engine_config(parse_args(["generate", "hi"])).cuda_graph_sizes is None


@pytest.mark.parametrize("argv,eager,sizes", [
    (["-O0"], True, None),
    (["-O", "3"], False, None),
    (["--optimization-level", "1"], False, None),
    (["-O", '{"cudagraph_capture_sizes": [1, 2, 4]}'], False, [1, 2, 4]),
    (["-O.cudagraph_mode=NONE"], True, None),
    (["-cc", '{"level": 3, "pass_config": {"fuse_norm_quant": true}}', "-cc.max_cudagraph_capture_size=40"],
     False, [40]),
    (["--compilation-config.cudagraph_capture_sizes=[8]", "--compilation-config.cudagraph_mode=FULL"],
     False, [8, 8]),
    (["--compilation-config", '{"use_cudagraph": false}'], True, None),
])
def test_vllm_compilation_flags_choose_the_graphs(argv, eager, sizes):
    """vLLM's -O levels and compilation_config (JSON, -O JSON, dotted keys) act through enforce_eager and
    cuda_graph_sizes: level 0 or cudagraph_mode NONE captures nothing, capture sizes are taken exactly (a
    lone size twice, since cuda_graph_sizes reads one size as a maximum)."""
    from plait.entrypoints.cli import _engine_config, parse_args

    config = _engine_config(parse_args(["serve", *argv]))
    assert (config.enforce_eager, config.cuda_graph_sizes) == (eager, sizes)
    assert decode_buckets(256, [8, 8]) == [8]  # one capture size is that size alone, as vLLM's
    # The offline API takes the same keys.
    assert EngineConfig(compilation_config={"cudagraph_mode": "NONE"}).enforce_eager
    assert EngineConfig(compilation_config=0).enforce_eager  # vLLM's LLM(compilation_config=level)


@pytest.mark.parametrize("kwargs,message", [
    ({"optimization_level": 4}, "optimization_level must be 0 to 3"),
    ({"compilation_config": {"cudagraph_mode": "SOMETIMES"}}, "cudagraph_mode must be one of NONE"),
    ({"compilation_config": '{"fuse_everything": true}'}, "key 'fuse_everything' is not available"),
    ({"compilation_config": "{not json"}, "compilation_config is not valid JSON"),
    ({"compilation_config": {"cudagraph_capture_sizes": [0]}}, "cudagraph_capture_sizes"),
    ({"compilation_config": {"cudagraph_capture_sizes": [1, 2]}, "cuda_graph_sizes": [4]}, "give one"),
])
def test_bad_compilation_config_is_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_mixed_graph_shapes_come_with_few_prompt_rows_first():
    """Every prompt row owns attention tiles, empty or not: each mixed size has a shape with room for
    FEW_PROMPT_ROWS prompt rows, tried before the one with room for every row."""
    shapes = graph_shapes(64, 256, 4096)
    for d in (0, 4, 64):
        rows = sorted({s.num_rows for s in shapes if s.decode_rows == d and s.num_tokens == 256})
        assert rows == sorted({min(d + FEW_PROMPT_ROWS, 64) + 1, 65})
    graphs = sorted(shapes, key=lambda s: (s.num_tokens, s.num_rows))
    assert next(s for s in graphs if s.is_mixed and s.decode_rows == 4).num_rows == 4 + FEW_PROMPT_ROWS + 1


@pytest.mark.parametrize(("given", "stored", "dtype"), [
    ("half", "float16", torch.float16),  # vLLM's aliases
    ("float", "float32", torch.float32),
    ("float16", "float16", torch.float16),
    ("bfloat16", "bfloat16", torch.bfloat16),
    ("float32", "float32", torch.float32),
    ("fp16", "float16", torch.float16),
    ("bf16", "bfloat16", torch.bfloat16),
    ("fp32", "float32", torch.float32),
    ("auto", "auto", torch.float32),  # float32 on CPU
])
def test_dtype_aliases_are_stored_under_one_name(given, stored, dtype):
    from plait.loader.model_loader import resolve_device_dtype

    config = EngineConfig(dtype=given, device="cpu")
    assert config.dtype == stored
    assert resolve_device_dtype(config) == (torch.device("cpu"), dtype)


def test_unknown_dtype_is_refused_with_the_accepted_names():
    with pytest.raises(ValueError, match="dtype must be one of .*'half'.*got 'int8'"):
        EngineConfig(dtype="int8")


def test_a_model_config_without_its_sizes_is_refused_by_name():
    """A config.json that omits what every model needs is a ValueError naming the keys (the CLI's "plait:
    error: ..."), not a KeyError from deep in the parser."""
    with pytest.raises(ValueError, match="lacks vocab_size, hidden_size"):
        ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    with pytest.raises(ValueError, match=r"\(LlamaForCausalLM\) lacks hidden_size"):
        ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 8})


def test_a_released_gemma_config_reads_as_transformers_runs_it():
    """Gemma 1's released configs say hidden_act "gelu" for the tanh approximation it was trained with, and
    leave the tied embeddings to GemmaConfig's default: plait reads both as transformers does."""
    released = {"architectures": ["GemmaForCausalLM"], "model_type": "gemma", "hidden_act": "gelu",
                "hidden_size": 2048, "intermediate_size": 16384, "num_hidden_layers": 18,
                "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 256000,
                "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 8192}
    cfg = ModelConfig.from_hf(released)
    assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.tie_word_embeddings and cfg.head_dim == 256
    # Whatever the installed transformers completes: the legacy name, under either key, is the tanh GELU.
    for key in ("hidden_act", "hidden_activation"):
        assert hidden_activation({"model_type": "gemma", key: "gelu"}) == "gelu_pytorch_tanh"
    assert hidden_activation({"model_type": "llama", "hidden_act": "gelu"}) == "gelu"
