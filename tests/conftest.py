"""Shared fixtures: tiny random HF checkpoints of each supported family, and engine helpers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without CUDA, Triton kernels run in its CPU interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Two cores: more threads than that only adds contention.
torch.set_num_threads(min(2, os.cpu_count() or 1))

TINY_VOCAB = 512


def _tiny_configs() -> dict:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

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
        folder = tmp_path_factory.mktemp(f"tiny-{family}")
        model.save_pretrained(folder)
        folders[family] = folder
    return folders


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> Path:
    return tiny_models["llama"]


def random_prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, TINY_VOCAB, (k,), generator=g).tolist() for k in lens]


def run_greedy(engine, prompts: list[list[int]], max_tokens: int, arrive_every: int = 0,
               capture_logits: bool = False) -> tuple[dict[int, list[int]], dict[int, list[torch.Tensor]]]:
    """Run prompts through ``engine`` greedily; request i is added after ``i * arrive_every`` steps.

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
                    logits[int(s.request.request_id.split("-")[1])].append(out.logits[k].clone())
            return out

        engine.runner.collect = capturing
    outputs: dict[int, list[int]] = {}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and (arrive_every == 0 or step >= pending[0][0] * arrive_every):
            i, p = pending.pop(0)
            ids[i] = engine.add_request(p, params, request_id=f"r-{i}")
        for out in engine.step():
            if out.finished:
                outputs[int(out.request_id.split("-")[1])] = out.outputs[0].token_ids
        step += 1
    if capture_logits:
        engine.runner.collect = collect
    return outputs, logits


# Structured outputs' test constraints (the engine's and the server's tests): a JSON schema and a regex.
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "color": {"enum": ["red", "green", "blue"]}},
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
PHONE = r"[0-9]{3}-[0-9]{4}"
