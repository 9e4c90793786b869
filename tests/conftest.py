"""Shared fixtures: tiny random HF checkpoints of each supported family, and engine helpers."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Without CUDA, Triton kernels run in its CPU interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Two cores: more threads than that only adds contention; under pytest-xdist (-n N) the workers share them.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // _WORKERS))
if _WORKERS > 1:
    # So do the processes the tests start (engine processes, `plait serve` and its data-parallel replicas,
    # tensor-parallel workers), which would each take every core for torch's threads: their OpenMP threads
    # spinning beside the other workers' made such tests several times slower than alone (an engine
    # process's comparison with the thread engine: 80 s against 17).
    os.environ.setdefault("OMP_NUM_THREADS", "1")

TINY_VOCAB = 512
# The tiny LongRoPE Phi-3's pretraining length: past every test prompt and its outputs.
TINY_PHI3_ORIGINAL_MAX_POSITIONS = 128


# httpx's module-level calls (httpx.get / post ...) time out after 5 s by default. On a loaded 2-core machine
# a served tiny model's first request once took longer (a ReadTimeout in test_plait_serve_process while four
# processes shared the cores), so the tests' calls wait longer unless they say otherwise.
HTTP_TIMEOUT_S = 60.0


def _longer_http_timeouts() -> None:
    try:
        import httpx
    except ImportError:  # the server's extras are not installed: no HTTP tests run
        return

    def waiting_longer(call):
        @functools.wraps(call)
        def wrapped(*args, **kwargs):
            kwargs.setdefault("timeout", HTTP_TIMEOUT_S)
            return call(*args, **kwargs)
        return wrapped

    for name in ("request", "get", "post", "put", "patch", "delete", "stream"):
        setattr(httpx, name, waiting_longer(getattr(httpx, name)))


_longer_http_timeouts()


@pytest.fixture(scope="module", autouse=True)
def _gpu_memory_back_after_each_module():
    """On a GPU, a test module's engines give their memory back before the next module runs: an engine's start
    froze the heap (plait.engine.engine.freeze_long_lived_objects), so one a test dropped in a reference cycle
    waits for collect_dropped_engines, which only the next engine's start calls. A later module that allocates
    tensors without an engine (the MXFP4 real-shape kernels) met the GPU full of gpt-oss's dropped engines."""
    yield
    release_dropped_engines()


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of tiny models (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``): splitting
    their ops over threads only adds barrier waits, many times the op itself when the cores are busy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def release_dropped_engines() -> None:
    """On a GPU, give the memory of engines no longer referenced back (a test that builds a second engine
    calls it after dropping the first, whose KV cache holds 90% of the GPU); nothing on the CPU."""
    if torch.cuda.is_available():
        from plait.engine.engine import collect_dropped_engines

        collect_dropped_engines()
        torch.cuda.empty_cache()


@pytest.fixture(scope="session", autouse=True)
def _gguf_files_read_once():
    """Engines of one GGUF file get their weights from one read of it per session.

    A dozen test engines load the default model, and reading its GGUF file (parsing its metadata and
    dequantising every tensor) is ~3.5 s of each load. `plait.loader.gguf.load_gguf` is a pure function of
    the file, so the engines' loader gets a copy of the first read's config and tensors (keyed by path, size
    and mtime) instead of reading it again. test_loader calls the real function itself: its output stays
    checked bit for bit against transformers'.
    """
    try:
        from plait.loader import gguf as gguf_loader
    except ImportError:  # no gguf package: nothing reads GGUF files
        yield
        return
    import copy

    read = gguf_loader.load_gguf
    last: dict[tuple, tuple[dict, dict[str, torch.Tensor]]] = {}  # the last file read (only one is kept)

    def read_once(path):
        resolved = Path(path).resolve()
        if not resolved.is_file():
            return read(path)  # its error, as ever
        stat = resolved.stat()
        key = (resolved, stat.st_size, stat.st_mtime_ns)
        if key not in last:
            last.clear()
            last[key] = read(path)
        config, tensors = last[key]
        return copy.deepcopy(config), {name: t.clone() for name, t in tensors.items()}

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_loader, "load_gguf", read_once)
        yield


def _tiny_configs() -> dict:
    from transformers import (
        Ernie4_5Config,
        Exaone4Config,
        Gemma2Config,
        Gemma3TextConfig,
        GemmaConfig,
        Glm4Config,
        GlmConfig,
        GptOssConfig,
        GraniteConfig,
        LlamaConfig,
        Ministral3Config,
        MistralConfig,
        Olmo2Config,
        Olmo3Config,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
        SeedOssConfig,
        SmolLM3Config,
    )

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=TINY_VOCAB, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2)
    return {
        "llama": LlamaConfig(**common, tie_word_embeddings=False, rope_theta=10000.0),
        # A window shorter than the test prompts, so the sliding-window mask is really exercised.
        "mistral": MistralConfig(**common, sliding_window=24),
        "qwen2": Qwen2Config(**common, tie_word_embeddings=True),
        # head_dim != hidden / heads, as in real Qwen3 checkpoints.
        "qwen3": Qwen3Config(**common, head_dim=32, tie_word_embeddings=True),
        # Sliding layers (window 24, shorter than the test prompts) around a global one, each kind with
        # its own rotary base (the global one linearly scaled), a query scale apart from head_dim, and
        # soft-capped logits, so that every Gemma-specific piece changes the answer.
        "gemma3": Gemma3TextConfig(
            **(common | {"num_hidden_layers": 3}), head_dim=32, query_pre_attn_scalar=24, sliding_window=24,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50_000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1_000.0}},
            final_logit_softcapping=30.0, tie_word_embeddings=True),
        # Gemma 2: soft-capped attention scores (a cap low enough to bind at these weights) and logits,
        # sliding layers alternating with global ones, one rotary base for both.
        "gemma2": Gemma2Config(
            **(common | {"num_hidden_layers": 3}), head_dim=32, query_pre_attn_scalar=24, sliding_window=24,
            attn_logit_softcapping=5.0, final_logit_softcapping=30.0, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 5_000.0}),
        # Qwen3 stretched by YaRN (its long-context recipe), the original length inside the test prompts.
        "qwen3-yarn": Qwen3Config(**common, head_dim=32, tie_word_embeddings=True,
                                  rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                "original_max_position_embeddings": 48}),
        # OLMo 2: norms after the sublayers, q/k normalised across heads; OLMo 3 adds sliding layers (a window
        # shorter than the test prompts) and a YaRN-stretched global one.
        "olmo2": Olmo2Config(**common, tie_word_embeddings=False),
        "olmo3": Olmo3Config(**(common | {"num_hidden_layers": 3}), sliding_window=24,
                             layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                             rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 4.0,
                                                                 "original_max_position_embeddings": 48,
                                                                 "rope_theta": 50_000.0},
                                              "sliding_attention": {"rope_type": "default",
                                                                    "rope_theta": 5_000.0}}),
        # Ministral 3: YaRN over a 16-token original context and Llama 4's query scaling by position (beta
        # large enough that the test prompts, which cross the period several times, depend on it).
        "ministral3": Ministral3Config(**common, head_dim=16, pad_token_id=None,
                                       rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                        "original_max_position_embeddings": 16,
                                                        "beta_fast": 32.0, "beta_slow": 1.0,
                                                        "llama_4_scaling_beta": 0.5}),
        # EXAONE 4.0: OLMo 2's post-sublayer norms, per-head q/k norms, two sliding layers (a window shorter
        # than the test prompts) and a global one without rotary.
        "exaone4": Exaone4Config(**(common | {"num_hidden_layers": 3}), head_dim=16, sliding_window=24,
                                 layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
        # GLM-4: a rotary over half of each head that turns adjacent channel pairs (GPT-J's), q/k/v biases;
        # GLM-4-0414 adds a norm after each sublayer.
        "glm": GlmConfig(**common, head_dim=16, pad_token_id=None),
        "glm4": Glm4Config(**common, head_dim=16, pad_token_id=None),
        # ERNIE 4.5 (dense): the Llama decoder with GPT-J's rotary over whole heads.
        "ernie4_5": Ernie4_5Config(**common, head_dim=16, pad_token_id=None),
        # Seed-OSS: q/k/v biases by its config's default (the saved config is cut to what differs from it).
        "seed_oss": SeedOssConfig(**common, head_dim=16, pad_token_id=None),
        # SmolLM3: the middle of three layers has no rotary (NoPE); in the second, that layer alone attends
        # through a window shorter than the test prompts, as transformers derives it from the NoPE layers.
        "smollm3": SmolLM3Config(**(common | {"num_hidden_layers": 3}), pad_token_id=None,
                                 no_rope_layer_interval=2),
        "smollm3-sliding": SmolLM3Config(**(common | {"num_hidden_layers": 3}), pad_token_id=None,
                                         no_rope_layer_interval=2, use_sliding_window=True,
                                         sliding_window=24),
        # GPT-OSS: sinks, a sliding layer (a window shorter than the test prompts) between global ones, YaRN
        # over a 48-token original context (truncate off, as its checkpoints say), and 4 experts with biases
        # and the clamped SwiGLU, 2 a token. Experts 96 wide: whole MXFP4 blocks (test_gpt_oss), and
        # transformers' [E, hidden, 2 * inter] gate_up layout cannot pass for plait's [E, 2 * inter, hidden].
        "gpt_oss": GptOssConfig(**(common | {"num_hidden_layers": 3, "intermediate_size": 96}), head_dim=16,
                                pad_token_id=None, num_local_experts=4, num_experts_per_tok=2,
                                sliding_window=24,
                                layer_types=["full_attention", "sliding_attention", "full_attention"],
                                rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 150_000.0,
                                                 "original_max_position_embeddings": 48, "beta_fast": 32.0,
                                                 "beta_slow": 1.0, "truncate": False}),
        # Granite's four multipliers, each far from 1 so that leaving one out changes the answer.
        "granite": GraniteConfig(**common, embedding_multiplier=6.0, attention_multiplier=0.09,
                                 residual_multiplier=0.3, logits_scaling=4.0, tie_word_embeddings=True),
        # Phi-3 (fused qkv_proj / gate_up_proj checkpoint tensors) with a window shorter than the test
        # prompts, as Phi-3-mini-4k's 2047 of 4096 positions.
        "phi3": Phi3Config(**common, pad_token_id=None, sliding_window=24),
        # Phi-4-mini-like: 12 of 16 channels rotated, LongRoPE with distinct short and long factors (the
        # prompts stay below original_max_position_embeddings: the short ones and the attention factor of a
        # 4x stretched context apply), tied embeddings.
        "phi3-longrope": Phi3Config(
            **common, pad_token_id=None, tie_word_embeddings=True, partial_rotary_factor=0.75,
            original_max_position_embeddings=TINY_PHI3_ORIGINAL_MAX_POSITIONS,
            rope_scaling={"type": "longrope", "short_factor": [1.0, 1.3, 1.9, 2.6, 3.4, 4.5],
                          "long_factor": [2.0, 4.0, 8.0, 12.0, 20.0, 30.0]}),
        # Gemma 1: Llama's layer with 1 + weight norms, embeddings scaled by sqrt(hidden), GeGLU, head_dim
        # apart from hidden / heads, a rotary base of its own. (Last: the families above keep their seeds.)
        "gemma": GemmaConfig(**common, head_dim=32, tie_word_embeddings=True,
                             rope_parameters={"rope_type": "default", "rope_theta": 5_000.0}),
    }


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """family -> folder holding config.json + model.safetensors of a random tiny model."""
    from transformers import AutoModelForCausalLM

    folders = {}
    for i, (family, cfg) in enumerate(_tiny_configs().items()):
        torch.manual_seed(1000 + i)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        # Random init gives tiny logits; scale weights up so argmax has clear winners and greedy
        # comparisons do not hinge on 1e-7 near-ties.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" not in name:
                    p.mul_(8.0)
                elif family.startswith("gemma"):  # 1 + weight norms, zero-initialised: make them count
                    p.normal_(0.0, 0.3)
                if name.endswith("sinks"):  # large enough to take a real share of each softmax
                    p.normal_(0.0, 2.0)
        folder = tmp_path_factory.mktemp(f"tiny-{family}")
        model.save_pretrained(folder)
        if family == "seed_oss":  # as a Hub config may leave it: q/k/v biases by SeedOssConfig's default
            config = json.loads((folder / "config.json").read_text())
            assert config.pop("attention_bias") is True
            (folder / "config.json").write_text(json.dumps(config))
        folders[family] = folder
    return folders


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def other_llama(tiny_llama, tmp_path_factory) -> tuple[Path, dict]:
    """(B's folder, B's HF state dict): tiny_llama's config with other random weights, for load_weights."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=g) * p.std())
    folder = tmp_path_factory.mktemp("tiny-llama-b")
    hf.save_pretrained(folder)
    return folder, hf.state_dict()


# The token budget of serving_engine: prompts of the server tests take several steps' chunks.
SERVING_MAX_NUM_BATCHED_TOKENS = 256


@pytest.fixture(scope="session")
def serving_engine():
    """The default model's engine that the end-to-end server tests' servers serve in turn (test_bench,
    test_reasoning, test_server, test_tool_calling each wrap it in an OpenAIServer of their own config):
    one load and one 2 GB KV cache (~5 s of page faults and copies) instead of one per module.

    A server's AsyncLLMEngine runs the engine only while that server is up and aborts what is left when it
    stops, so each server starts on an idle engine; what carries over is the prefix cache and the stream of
    unseeded samples, on which no test's assertions depend. /metrics counts each server's own traffic."""
    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(max_num_batched_tokens=SERVING_MAX_NUM_BATCHED_TOKENS))


# tiny_default_vocab_model's context: room for the tool-calling tests' prompts (their tools' schemas rendered)
# and answers.
TINY_DEFAULT_VOCAB_MAX_POSITIONS = 2048


@functools.cache
def fuzz_script():
    """scripts/fuzz_server.py as a module (its make_tiny_model)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fuzz_server", ROOT / "scripts" / "fuzz_server.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """make_tiny_model's model as the `plait serve` tests serve it (its served name "tiny-model", a 128-token
    context), made once a session. No test may modify it."""
    return fuzz_script().make_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-model")


@pytest.fixture(scope="session")
def tiny_default_vocab_model(tmp_path_factory) -> Path:
    """A random 2-layer Llama (hidden 64) with the default model's vocabulary, tokenizer and chat template
    (scripts/fuzz_server.py's make_tiny_model), which decodes ~20x faster than the default model: for the
    server tests whose assertions read only the tokenizer and the chat template, such as those whose whole
    output a guided_regex forces. No test may modify it."""
    folder = tmp_path_factory.mktemp("tiny-default-vocab") / "tiny-default-vocab"
    return fuzz_script().make_tiny_model(folder, TINY_DEFAULT_VOCAB_MAX_POSITIONS)


@pytest.fixture(scope="session")
def tiny_serving_engine(tiny_default_vocab_model):
    """serving_engine's twin on tiny_default_vocab_model (the same token budget), shared as serving_engine is
    (idle_serving_engine before a server takes it)."""
    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(tiny_default_vocab_model),
                                  max_num_batched_tokens=SERVING_MAX_NUM_BATCHED_TOKENS))


def idle_serving_engine(engine):
    """serving_engine, checked idle and clean before another server takes it."""
    assert engine.is_idle_and_clean(), "a server left serving_engine with requests or blocks in use"
    return engine


@pytest.fixture(scope="session")
def hf_gguf_model() -> torch.nn.Module:
    """transformers' own GGUF load of the default model (fp32, eval): the reference for plait's GGUF loader
    and for the default model's greedy outputs. Loaded once per session (~10 s); no test may modify it."""
    import functools

    gguf = pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM

    from plait.loader.gguf import default_model_path

    path = default_model_path()
    with pytest.MonkeyPatch.context() as mp:
        # transformers rebuilds the same (arch, n_layers) name map once per submodule (~400 times, ~9 s)
        # and parses the file's header twice (config, then tensors; ~5 s): memoising these pure functions
        # of their arguments changes no result, only the load time.
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        mp.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=None)(gguf.GGUFReader))
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def add_gguf_shape(writer, cfg) -> None:
    """The hyperparameters every llama.cpp converter writes (TextModel.set_gguf_parameters) from an HF config:
    layers, context, widths and heads."""
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)


def break_next_step(engine) -> None:
    """Make the engine's next step raise (then step as before): a failing step, as a server's loop meets it.
    Module-level, so it crosses to an engine process too (this folder on its PYTHONPATH)."""
    real_step = engine.step

    def failing_step():
        engine.step = real_step  # only this once
        raise RuntimeError("injected failure")

    engine.step = failing_step


def capture_cuda_graph(fn):
    """(graph, fn's output tensor): fn compiled and warmed up on a side stream, then captured once; replaying
    the graph recomputes that output from whatever its inputs then hold."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def random_prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, TINY_VOCAB, (k,), generator=g).tolist() for k in lens]


def run_greedy(engine, prompts: list[list[int]], max_tokens: int, arrive_every: int = 0,
               capture_logits: bool = False, loras: list | None = None
               ) -> tuple[dict[int, list[int]], dict[int, list[torch.Tensor]]]:
    """Run prompts through ``engine`` greedily; request i is added after ``i * arrive_every`` steps, with
    LoRA adapter ``loras[i]`` where given.

    Returns (index -> output token ids, index -> logits rows sampled for it, if captured).
    """
    from plait.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    logits: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(prompts))}
    ids = {}
    if capture_logits:
        collect = engine.runner.collect

        def capturing(step):
            out = collect(step)
            for k, s in enumerate(out.sampled):
                if not s.request.is_finished:  # an overlapped step's row for a finished request
                    # On the CPU even from a GPU engine: the HF references are there.
                    logits[int(s.request.request_id.split("-")[1])].append(out.logits[k].cpu().clone())
            return out

        engine.runner.collect = capturing
    outputs: dict[int, list[int]] = {}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and (arrive_every == 0 or step >= pending[0][0] * arrive_every):
            i, p = pending.pop(0)
            ids[i] = engine.add_request(p, params, request_id=f"r-{i}",
                                        lora_request=loras[i] if loras is not None else None)
        for out in engine.step():
            if out.finished:
                outputs[int(out.request_id.split("-")[1])] = out.outputs[0].token_ids
        step += 1
    if capture_logits:
        engine.runner.collect = collect
    return outputs, logits


def hf_greedy_reference(hf, prompt: list[int], output: list[int], max_tokens: int
                        ) -> tuple[list[int], torch.Tensor]:
    """HF's greedy continuation of ``prompt`` (max_tokens, no EOS stop), and its logits at the positions
    that produced ``output`` (teacher-forced: [len(output), vocab])."""
    with torch.no_grad():
        ids = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        logits = hf(torch.tensor([prompt + output])).logits[0, len(prompt) - 1: -1]
    return ids, logits


def assert_greedy_matches_hf(engine, hf, prompts: list[list[int]], max_tokens: int, atol: float = 1e-4,
                             what: str = "") -> None:
    """``engine``'s greedy tokens for ``prompts`` (run together, chunked and batched) are HF model ``hf``'s,
    and its logits at each of them within atol of HF's; the engine ends idle and clean."""
    outputs, logits = run_greedy(engine, prompts, max_tokens, capture_logits=True)
    for i, prompt in enumerate(prompts):
        ref_ids, ref_logits = hf_greedy_reference(hf, prompt, outputs[i], max_tokens)
        assert outputs[i] == ref_ids, f"{what} prompt {i}: greedy tokens differ from transformers"
        got = torch.stack(logits[i])
        assert got.shape == ref_logits.shape
        torch.testing.assert_close(got, ref_logits, atol=atol, rtol=0)
    assert engine.is_idle_and_clean()


def assert_engines_agree(got_engine, want_engine, prompts: list[list[int]], max_tokens: int = 8,
                         atol: float = 0.0, loras: list | None = None) -> dict[int, list[torch.Tensor]]:
    """Both engines' greedy tokens equal, and every sampled logits row within atol (0: bit for bit), with
    request i added at step i (with LoRA adapter loras[i] where given); returns got_engine's logits rows."""
    got, got_logits = run_greedy(got_engine, prompts, max_tokens, arrive_every=1, capture_logits=True,
                                 loras=loras)
    want, want_logits = run_greedy(want_engine, prompts, max_tokens, arrive_every=1, capture_logits=True,
                                   loras=loras)
    assert got == want
    for i in want_logits:
        for a, b in zip(got_logits[i], want_logits[i], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=atol)
    return got_logits


# Structured outputs' test constraints (the engine's and the server's tests): a JSON schema and a regex.
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "color": {"enum": ["red", "green", "blue"]}},
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
PHONE = r"[0-9]{3}-[0-9]{4}"


# LoRA adapters' projections: the decoder-layer module holding each (HF names).
LORA_MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def lora_projection_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """HF projection -> (in, out) features, for an HF config.json dict of a Llama-family model (and the fused
    qkv_proj / gate_up_proj Phi-3 checkpoints name)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
            "qkv_proj": (hidden, q + 2 * kv), "gate_up_proj": (hidden, 2 * inter)}


def make_lora_adapter(folder: Path, model_folder: Path, targets: list[str], rank: int, alpha: float,
                      seed: int, use_rslora: bool = False, layers: list[int] | None = None, std: float = 0.1,
                      config_overrides: dict | None = None, modules: dict[str, str] | None = None) -> Path:
    """A random PEFT LoRA adapter for the model in ``model_folder``, as PEFT saves one: adapter_config.json
    and adapter_model.safetensors (lora_A [r, in], lora_B [out, r] per targeted projection and layer);
    ``modules``: each projection's decoder-layer module (LORA_MODULES by default)."""
    modules = modules or LORA_MODULES
    import json

    from safetensors.torch import save_file

    config = json.loads((model_folder / "config.json").read_text())
    shapes = lora_projection_shapes(config)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in layers if layers is not None else range(config["num_hidden_layers"]):
        for name in targets:
            fan_in, fan_out = shapes[name]
            prefix = f"base_model.model.model.layers.{layer}.{modules[name]}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * std
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    adapter_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
                      "target_modules": targets, "use_rslora": use_rslora, "fan_in_fan_out": False,
                      "bias": "none", "use_dora": False, "lora_dropout": 0.0,
                      "base_model_name_or_path": str(model_folder), **(config_overrides or {})}
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config))
    return folder


ROOT = Path(__file__).resolve().parent.parent
SERVE_STARTUP_TIMEOUT_S = 180.0
SERVE_SHUTDOWN_TIMEOUT_S = 30.0


def start_plait_serve(tmp_path: Path, args: list[str], env: dict[str, str] | None = None
                      ) -> tuple[subprocess.Popen, str, str, Path]:
    """Start a real `plait serve ARGS` process on a free port; (the process, its base URL, its start-up
    banner, its log file) once /health answers."""
    import httpx

    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}  # env may name a PYTHONPATH of its own
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "plait.entrypoints.cli", "serve", "--port", "0", "--log-level", "warning",
             *args], stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    try:
        banner = ""
        deadline = time.monotonic() + SERVE_STARTUP_TIMEOUT_S
        while "-d '" not in banner:
            assert proc.poll() is None, log_path.read_text()
            try:
                banner += lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no banner from `plait serve`; got {banner!r}")
        url = re.search(r"on (http://127\.0\.0\.1:\d+) ", banner).group(1)
        while httpx.get(f"{url}/health").status_code != 200:
            time.sleep(0.1)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, url, banner, log_path


@contextlib.contextmanager
def plait_serve_process(tmp_path: Path, args: list[str], env: dict[str, str] | None = None
                        ) -> Iterator[tuple[str, str]]:
    """A real `plait serve ARGS` process on a free port, yielding (its base URL, its start-up banner) once
    /health answers; stopped by SIGINT (uvicorn's graceful shutdown) afterwards, which must exit 0."""
    proc, url, banner, log_path = start_plait_serve(tmp_path, args, env)
    try:
        yield url, banner
    finally:
        stop_plait_serve(proc)
    assert proc.returncode == 0, log_path.read_text()


def stop_plait_serve(proc: subprocess.Popen) -> None:
    """SIGINT (uvicorn's graceful shutdown), then a kill if it has not exited in SERVE_SHUTDOWN_TIMEOUT_S."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(SERVE_SHUTDOWN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def server_image_chat(folder: Path, content: list[dict], ids: list[int], max_tokens: int = 6) -> str:
    """A real server over ``folder``'s image model (fp32), asked through the official openai client for
    greedy ``max_tokens`` with the user message ``content`` (a data-URL image part and text): its usage
    counts ``ids`` as the prompt, the streamed answer is the whole one, and /tokenize gives ``ids``. Returns
    the answer's text."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    import httpx

    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine
    from plait.entrypoints.server import BackgroundServer, OpenAIServer, ServerConfig

    engine = LLMEngine(EngineConfig(model=str(folder), dtype="float32", max_num_batched_tokens=16))
    with BackgroundServer(OpenAIServer(engine, ServerConfig(log_level="warning"))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        ask = dict(model=model, messages=[{"role": "user", "content": content}], max_tokens=max_tokens,
                   temperature=0.0, extra_body={"ignore_eos": True})
        reply = client.chat.completions.create(**ask)
        assert reply.usage.prompt_tokens == len(ids)
        streamed = "".join(c.choices[0].delta.content or "" for c in
                           client.chat.completions.create(**ask, stream=True) if c.choices)
        assert streamed == reply.choices[0].message.content
        counted = httpx.post(f"{url}/tokenize", json={"model": model, "messages": ask["messages"]}).json()
        assert counted["tokens"] == ids
        return reply.choices[0].message.content
