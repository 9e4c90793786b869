"""Weights replaced in place (an RL loop's update between rollouts), and the prefix cache emptied: after
LLM.load_weights(B's tensors), an engine of model A answers as an engine of B does, cached prefixes of A's
KV included; any subset of the tensors replaces those alone, folded norms included; the prefix cache emptied
alone (LLM.reset_prefix_cache, the server's dev-mode endpoint)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts

from plait import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
KNOBS = dict(block_size=8, max_model_len=128, num_kv_blocks=128)  # a fixed cache: engines share a GPU too


def greedy_answers(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's greedy tokens (test_collective_rpc's too)."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_loaded_weights_answer_as_that_model_and_the_cache_is_emptied(tiny_llama, other_llama):
    folder_b, weights_b = other_llama
    prompts = random_prompts(4, 30, 60, seed=21)
    llm = LLM(str(tiny_llama), **KNOBS)
    before = greedy_answers(llm, prompts)
    assert llm.engine.kv_cache.num_cached_blocks > 0  # A's prompts are cached: they must not serve B
    llm.load_weights(weights_b.items())
    assert llm.engine.kv_cache.num_cached_blocks == 0
    want = greedy_answers(LLM(str(folder_b), **KNOBS), prompts)
    assert want != before, "B should answer otherwise than A"
    assert greedy_answers(llm, prompts) == want
    # And back: A's own tensors (a generator of them, as a trainer may stream them) restore A's answers.
    from transformers import AutoModelForCausalLM

    weights_a = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).state_dict()
    llm.load_weights((name, t) for name, t in weights_a.items())
    assert greedy_answers(llm, prompts) == before


def test_a_subset_replaces_those_tensors_alone(tiny_llama, other_llama):
    """vLLM's load_weights takes any subset of the checkpoint (an RL loop may send one tensor at a time): B's
    tensors but layer 1's into A answer as A's whole state dict with those tensors replaced does."""
    from transformers import AutoModelForCausalLM

    _, weights_b = other_llama
    weights_a = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).state_dict()
    prompts = random_prompts(4, 20, 40, seed=25)
    subset = {n: t for n, t in weights_b.items() if "layers.1." not in n}
    llm = LLM(str(tiny_llama), **KNOBS)
    for name, tensor in subset.items():  # one at a time, as a trainer's broadcast loop sends them
        llm.load_weights([(name, tensor)])
    merged = LLM(str(tiny_llama), **KNOBS)
    merged.load_weights({**weights_a, **subset}.items())
    want = greedy_answers(merged, prompts)
    assert greedy_answers(llm, prompts) == want
    assert want != greedy_answers(LLM(str(tiny_llama), **KNOBS), prompts)


def test_a_subset_folds_into_folded_norms_or_says_why_not(tiny_llama, other_llama, monkeypatch):
    """On a 16-bit GPU the MLP norms' weights live in gate/up (ModelRunner._folds_norms; patched on here): a
    subset's gate/up rows take the kept norm weight, a norm with its whole gate/up folds again, each equal
    bit for bit to folding the merged weights; a norm without its gate/up is refused and its layer left as
    it was (the other rows hold the old norm's product)."""
    from transformers import AutoModelForCausalLM

    from plait.runner.model_runner import ModelRunner

    g = torch.Generator().manual_seed(26)

    def with_random_norms(weights: dict) -> dict:  # random checkpoints' norms are ones: folding them is moot
        return {n: 0.5 + torch.rand(t.shape, generator=g) if "layernorm" in n else t
                for n, t in weights.items()}

    hf_a = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    weights_a, weights_b = with_random_norms(hf_a.state_dict()), with_random_norms(other_llama[1])
    layer = "model.layers.{}."
    gate = layer.format(0) + "mlp.gate_proj.weight"
    whole = [layer.format(1) + f"{n}.weight"
             for n in ("mlp.gate_proj", "mlp.up_proj", "post_attention_layernorm")]

    def folded_model(weights: dict) -> LLM:
        llm = LLM(str(tiny_llama), **KNOBS, dtype="bfloat16")
        llm.load_weights(weights.items())
        llm.engine.runner.model.fold_norm_weights()
        return llm

    llm = folded_model(weights_a)
    monkeypatch.setattr(ModelRunner, "_folds_norms", lambda self: True)
    llm.load_weights([(gate, weights_b[gate])])
    llm.load_weights([(n, weights_b[n]) for n in whole])
    model = llm.engine.runner.model
    before = {n: p.clone() for n, p in model.named_parameters() if n.startswith(layer.format(0))}
    norm_alone = layer.format(0) + "post_attention_layernorm.weight"
    with pytest.raises(ValueError, match="came without all of gate_proj and up_proj"):
        llm.load_weights([(norm_alone, weights_b[norm_alone])])
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], p) for n, p in before.items())

    monkeypatch.setattr(ModelRunner, "_folds_norms", lambda self: False)
    reference = folded_model({**weights_a, **{n: weights_b[n] for n in [gate, *whole]}})
    assert not torch.equal(after[gate.replace("gate_proj", "gate_up_proj")],
                           folded_model(weights_a).engine.runner.model.get_parameter(
                               gate.replace("gate_proj", "gate_up_proj")))
    for name, param in reference.engine.runner.model.named_parameters():
        assert torch.equal(after[name], param), name


def test_load_weights_refuses_a_busy_engine_an_unknown_tensor_and_lora(tiny_llama, other_llama):
    _, weights_b = other_llama
    llm = LLM(str(tiny_llama), **KNOBS)
    llm.engine.add_request(random_prompts(1, 10, 10, seed=1)[0], GREEDY)
    with pytest.raises(ValueError, match="needs an idle engine"):
        llm.load_weights(weights_b.items())
    assert not llm.reset_prefix_cache()  # a request holds blocks: nothing forgotten
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.reset_prefix_cache() and llm.engine.kv_cache.num_cached_blocks == 0
    with pytest.raises(ValueError, match="has no place"):
        llm.load_weights([*weights_b.items(), ("model.layers.9.mlp.up_proj.weight", torch.zeros(2, 2))])
    with pytest.raises(ValueError, match="not supported for an engine with LoRA"):
        LLM(str(tiny_llama), enable_lora=True, **KNOBS).load_weights(weights_b.items())


def test_dev_mode_resets_the_prefix_cache(tiny_llama, monkeypatch):
    """vLLM's VLLM_SERVER_DEV_MODE=1 adds POST /reset_prefix_cache: the cache is emptied (a 409 while
    requests hold blocks); without the switch there is no such endpoint."""
    httpx = pytest.importorskip("httpx")
    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine
    from plait.entrypoints.server import BackgroundServer, OpenAIServer, ServerConfig

    engine = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=8, max_model_len=64))
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    with BackgroundServer(OpenAIServer(engine, ServerConfig(log_level="warning"))) as url:
        assert httpx.post(f"{url}/reset_prefix_cache").status_code == 404
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    with BackgroundServer(OpenAIServer(engine, ServerConfig(log_level="warning"))) as url:
        body = {"model": engine.model_name, "prompt": list(range(3, 40)), "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        assert engine.kv_cache.num_cached_blocks > 0
        assert httpx.post(f"{url}/reset_prefix_cache").status_code == 200
        assert engine.kv_cache.num_cached_blocks == 0


def split_greedy_answers(folder, prompts: list[list[int]], knobs: dict) -> dict[int, list[int]]:
    """The greedy answers of an engine of ``folder`` split as ``knobs`` say (test_collective_rpc's too)."""
    from conftest import run_greedy

    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(folder), **knobs))
    try:
        return run_greedy(engine, prompts, GREEDY.max_tokens)[0]
    finally:
        engine.shutdown()


def test_load_weights_sends_each_tensor_parallel_rank_its_slices(tiny_llama, other_llama):
    """Two ranks: the driver streams each rank its slices of B's tensors, and the split engine answers as a
    split engine of B, the tensors coming in two subsets. A set the model refuses is refused on every rank
    alike (a ValueError, no rank left waiting), and sets load after it."""
    from conftest import run_greedy

    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine

    folder_b, weights_b = other_llama
    prompts = random_prompts(4, 10, 40, seed=23)
    knobs = dict(KNOBS, tensor_parallel_size=2)
    want = split_greedy_answers(folder_b, prompts, knobs)
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), **knobs))
    try:
        assert run_greedy(engine, prompts, GREEDY.max_tokens)[0] != want
        with pytest.raises(ValueError, match="has no place"):
            engine.load_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(2, 2))])
        layer_1 = [(n, t) for n, t in weights_b.items() if "layers.1." in n]
        engine.load_weights(layer_1)  # a subset first: each rank takes its slices of those alone
        assert run_greedy(engine, prompts, GREEDY.max_tokens)[0] != want
        engine.load_weights((n, t) for n, t in weights_b.items() if "layers.1." not in n)
        assert run_greedy(engine, prompts, GREEDY.max_tokens)[0] == want
    finally:
        engine.shutdown()


def test_reload_weights_reads_a_checkpoint_from_disk(tiny_llama, other_llama):
    """vLLM's collective_rpc("reload_weights"): LLM.reload_weights(folder) answers as that checkpoint's model;
    with no path, the engine's own model comes back; a missing folder is a FileNotFoundError."""
    folder_b, _ = other_llama
    prompts = random_prompts(3, 20, 40, seed=24)
    llm = LLM(str(tiny_llama), **KNOBS)
    own = greedy_answers(llm, prompts)
    want = greedy_answers(LLM(str(folder_b), **KNOBS), prompts)
    llm.reload_weights(str(folder_b))
    assert greedy_answers(llm, prompts) == want
    llm.reload_weights()
    assert greedy_answers(llm, prompts) == own
    with pytest.raises(FileNotFoundError):
        llm.reload_weights(str(folder_b / "nowhere"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_subsets_fold_into_the_norms_and_an_extension_keeps_them_apart(tmp_path):
    """bf16 with CUDA graphs, the MLP norms folded into gate/up: B's tensors loaded a layer at a time (each
    layer's together, as a trainer's bucketed sync sends them) answer as an engine of B does; a norm alone is
    refused. An engine with a worker extension keeps its norms apart, so B's tensors one at a time through
    the extension answer as B does there."""
    from rpc_extension import WeightSyncExtension
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                      num_key_value_heads=4, vocab_size=8192, max_position_embeddings=1024,
                      tie_word_embeddings=False)
    folders = {}
    for name in ("a", "b"):
        LlamaForCausalLM(cfg).save_pretrained(tmp_path / name)
        state = LlamaForCausalLM.from_pretrained(tmp_path / name).state_dict()
        # Random checkpoints' norms are ones, which folding leaves as they are.
        state = {n: 0.5 + torch.rand(t.shape) if "norm" in n else t.contiguous() for n, t in state.items()}
        save_file(state, str(tmp_path / name / "model.safetensors"))
        folders[name] = (str(tmp_path / name), state)
    knobs = dict(dtype="bfloat16", max_model_len=1024, num_kv_blocks=1024)
    prompts = random_prompts(16, 20, 300, seed=4)
    (folder_a, _), (folder_b, weights_b) = folders["a"], folders["b"]
    want = greedy_answers(LLM(folder_b, **knobs), prompts)
    llm = LLM(folder_a, **knobs)
    assert llm.engine.runner._folds_norms() and llm.engine.runner.graphs is not None
    assert greedy_answers(llm, prompts) != want
    layers = [[(n, t) for n, t in weights_b.items() if f"layers.{i}." in n] for i in range(4)]
    llm.load_weights((n, t) for n, t in weights_b.items() if ".layers." not in n)
    for layer in layers:
        llm.load_weights(layer)
    assert greedy_answers(llm, prompts) == want
    norm = "model.layers.2.post_attention_layernorm.weight"
    kept = {n: p.clone() for n, p in llm.engine.runner.model.named_parameters()}
    with pytest.raises(ValueError, match="came without all of gate_proj and up_proj"):
        llm.load_weights([(norm, torch.rand(weights_b[norm].shape))])
    assert all(torch.equal(p, kept[n]) for n, p in llm.engine.runner.model.named_parameters())

    apart = dict(knobs, worker_extension_cls=WeightSyncExtension)
    want_apart = greedy_answers(LLM(folder_b, **apart), prompts)
    llm = LLM(folder_a, **apart)
    assert not llm.engine.runner._folds_norms()
    for name, tensor in weights_b.items():
        llm.collective_rpc("update_named_param", args=(name, tensor))
    assert greedy_answers(llm, prompts) == want_apart
