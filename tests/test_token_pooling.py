"""vLLM's per-token pooling tasks: token_embed (every prompt token's hidden state, each normalised as an
embedding is) and token_classify (LLM.reward: a classifier's score head at every token, through its
activation), against transformers, with prompts chunked, preempted and beside whole-prompt requests; the
prefix cache never serves them; /pooling's ``task``."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_classify import _prompts, classifiers  # noqa: F401 - the fixture, shared
from test_embeddings import hf_trunks  # noqa: F401 - the fixture, shared
from test_encoder_embeddings import _prompts as encoder_prompts
from test_encoder_embeddings import encoders  # noqa: F401 - the fixture, shared

from plait import LLM
from plait.pooling_params import PoolingParams

ATOL = 2e-5
ACTIVATE = {"softmax": lambda x: x.softmax(-1), "sigmoid": torch.sigmoid, "none": lambda x: x}


def _hidden(trunk, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return trunk(torch.tensor([ids])).last_hidden_state[0]  # [n, hidden]


def _token_rewards(model, ids: list[int], activation: str) -> torch.Tensor:
    """A ...ForSequenceClassification model's score head at every token (transformers computes them all,
    then reads the last), through the activation: [n, labels]."""
    with torch.no_grad():
        return ACTIVATE[activation](model.score(model.model(torch.tensor([ids])).last_hidden_state[0]))


def test_token_embed_matches_transformers_chunked_preempted_and_beside_embed(tiny_llama, hf_trunks):  # noqa: F811
    """token_embed rows (normalised, or not where asked) equal transformers' final hidden states, prompts
    chunked 32 tokens at a time with too few KV blocks for all (preempted ones start again), beside embed
    requests in the same steps, whose vectors are unchanged."""
    llm = LLM(str(tiny_llama), runner="pooling", max_num_batched_tokens=32, block_size=4, num_kv_blocks=40,
              max_num_partial_prefills=4)
    prompts = _prompts(7, [100, 90, 80, 70, 60, 50, 1])
    params = [PoolingParams(task=task, normalize=norm) for task, norm in
              [("token_embed", None), ("embed", None), ("token_embed", False), ("token_embed", None),
               ("embed", None), ("token_embed", None), ("token_embed", True)]]
    outputs = llm.encode(prompts, params, use_tqdm=False)
    assert sum(o.metrics["num_preemptions"] for o in outputs) > 0
    trunk = hf_trunks["llama"]
    for out, ids, p in zip(outputs, prompts, params):
        hidden = _hidden(trunk, ids)
        if p.task == "embed":
            want = F.normalize(hidden[-1], dim=-1)
        else:
            want = hidden if p.normalize is False else F.normalize(hidden, dim=-1)
        assert out.outputs.data.shape == want.shape
        torch.testing.assert_close(out.outputs.data, want, atol=ATOL, rtol=0)
    assert llm.engine.is_idle_and_clean()


def test_an_encoder_gives_every_token_its_vector(encoders):  # noqa: F811
    """bge-m3-style multi-vector output: an encoder's token_embed rows are its last hidden states (whole
    prompts, bidirectional), normalised."""
    folder, hf, _ = encoders["xlmr"]
    llm = LLM(str(folder))
    prompts = encoder_prompts(11, [3, 20, 47])
    outputs = llm.encode(prompts, pooling_task="token_embed", use_tqdm=False)
    for out, ids in zip(outputs, prompts):
        torch.testing.assert_close(out.outputs.data, F.normalize(_hidden(hf, ids), dim=-1), atol=1e-5, rtol=0)


def test_per_token_tasks_take_no_prefix_cache_hit(tiny_llama, hf_trunks):  # noqa: F811
    """LAST pooling keeps the prefix cache; a token_embed request of the same prompt computes every position
    (none of them cached), and an embed request after it is served from the cache again."""
    llm = LLM(str(tiny_llama), runner="pooling", max_num_batched_tokens=64, block_size=8)
    prompt = _prompts(8, [70])[0]
    llm.encode([prompt], use_tqdm=False)
    tokens = llm.encode([prompt], pooling_task="token_embed", use_tqdm=False)[0]
    assert tokens.num_cached_tokens == 0
    torch.testing.assert_close(tokens.outputs.data, F.normalize(_hidden(hf_trunks["llama"], prompt), dim=-1),
                               atol=ATOL, rtol=0)
    assert llm.encode([prompt], pooling_task="embed", use_tqdm=False)[0].num_cached_tokens == 64


@pytest.mark.parametrize("name", ["llama-3-labels", "qwen3-score", "qwen2-regression"])
def test_reward_is_the_score_head_at_every_token(classifiers, name):  # noqa: F811
    """LLM.reward (token_classify): each prompt token's probabilities (the model's activation) equal
    transformers' score head over its hidden states, prompts chunked beside classify requests."""
    folder, model, activation = classifiers[name]
    llm = LLM(str(folder), max_num_batched_tokens=16)
    prompts = _prompts(9, [1, 9, 33, 50])
    rewards = llm.reward(prompts, use_tqdm=False)
    for out, ids in zip(rewards, prompts):
        torch.testing.assert_close(out.outputs.data, _token_rewards(model, ids, activation), atol=ATOL,
                                   rtol=0)
    mixed = llm.encode(prompts, [PoolingParams(task=t) for t in ("classify", "token_classify") * 2],
                       use_tqdm=False)
    for k, (out, ids) in enumerate(zip(mixed, prompts)):
        want = _token_rewards(model, ids, activation)
        torch.testing.assert_close(out.outputs.data, want if k % 2 else want[-1], atol=ATOL, rtol=0)


def test_per_token_tasks_are_checked(classifiers, tiny_llama):  # noqa: F811
    folder, _, _ = classifiers["llama-3-labels"]
    with pytest.raises(ValueError, match="is a classification model: it does not support the token_embed"):
        LLM(str(folder)).encode([[5, 6]], pooling_task="token_embed", use_tqdm=False)
    embedder = LLM(str(tiny_llama), runner="pooling")
    with pytest.raises(ValueError, match="is an embedding model: it does not support the token_classify"):
        embedder.reward([[5, 6]], use_tqdm=False)
    with pytest.raises(ValueError, match="task must be one of"):
        embedder.encode([[5, 6]], pooling_task="token_score", use_tqdm=False)


def test_pooling_endpoint_takes_a_per_token_task(classifiers):  # noqa: F811
    """vLLM's /pooling ``task``: token_classify gives each input a [tokens, labels] matrix (floats, or base64
    of its float32 rows one after another), equal to LLM.reward's; a task the model cannot do is a 400."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine
    from plait.entrypoints.server import BackgroundServer, OpenAIServer, ServerConfig

    folder, model, activation = classifiers["llama-3-labels"]
    engine = LLMEngine(EngineConfig(model=str(folder), max_num_batched_tokens=16))
    prompts = _prompts(10, [5, 30])
    with BackgroundServer(OpenAIServer(engine, ServerConfig(log_level="warning"))) as url:
        floats = httpx.post(f"{url}/pooling", json={"input": prompts, "task": "token_classify"}, timeout=60)
        packed = httpx.post(f"{url}/pooling", json={"input": prompts, "task": "token_classify",
                                                    "encoding_format": "base64"}, timeout=60)
        refused = httpx.post(f"{url}/pooling", json={"input": prompts, "task": "token_embed"}, timeout=60)
    assert floats.status_code == 200, floats.text
    for item, b64, ids in zip(floats.json()["data"], packed.json()["data"], prompts):
        want = _token_rewards(model, ids, activation)
        torch.testing.assert_close(torch.tensor(item["data"]), want, atol=ATOL, rtol=0)
        rows = np.frombuffer(base64.b64decode(b64["data"]), dtype="<f4").reshape(len(ids), -1)
        assert rows.tolist() == item["data"]
    assert refused.status_code == 400 and "does not support Pooling API" in refused.json()["error"]["message"]
