"""Classifiers and reward models (HF ...ForSequenceClassification) on the pooling runner: plait's class
probabilities against transformers' for each activation, chunked and batched; vLLM's /classify."""

from __future__ import annotations

import pytest
import torch

from plait import LLM
from plait.engine.engine import POOLING_MODEL_MESSAGE
from plait.pooling_params import PoolingParams
from plait.sampling_params import SamplingParams
from tests.conftest import TINY_VOCAB

ATOL = 2e-5
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
# name -> (transformers config class, config extras, the activation transformers' losses imply)
CLASSIFIERS = {
    "llama-3-labels": ("LlamaConfig", dict(id2label=LABELS, label2id={v: k for k, v in LABELS.items()}),
                       "softmax"),
    "qwen3-score": ("Qwen3Config", dict(num_labels=1, head_dim=32), "sigmoid"),
    "mistral-multi-label": ("MistralConfig", dict(num_labels=4, problem_type="multi_label_classification"),
                            "sigmoid"),
    "qwen2-regression": ("Qwen2Config", dict(num_labels=2, problem_type="regression"), "none"),
}


@pytest.fixture(scope="module")
def classifiers(tmp_path_factory) -> dict:
    """name -> (folder of a random tiny ...ForSequenceClassification checkpoint, the HF model, activation)."""
    import transformers

    models = {}
    for i, (name, (config_cls, extra, activation)) in enumerate(CLASSIFIERS.items()):
        cfg = getattr(transformers, config_cls)(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=TINY_VOCAB, max_position_embeddings=256, **extra)
        torch.manual_seed(300 + i)
        model = transformers.AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32).eval()
        with torch.no_grad():
            model.score.weight.mul_(20.0)  # logits of a few units, so the activations are far from flat
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        models[name] = (folder, model, activation)
    return models


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, TINY_VOCAB, (n,), generator=gen).tolist() for n in lengths]


def _reference(model, ids: list[int], activation: str) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]  # batch 1: the last token's
    activate = {"softmax": lambda x: x.softmax(-1), "sigmoid": torch.sigmoid, "none": lambda x: x}
    return activate[activation](logits)


@pytest.mark.parametrize("name", list(CLASSIFIERS))
def test_class_probabilities_match_transformers(classifiers, name):
    """A classifier checkpoint is a pooling model by default; its probabilities (softmax over labels, a
    sigmoid for a single score or a multi-label problem, raw for regression) equal transformers', prompts
    chunked 16 tokens at a time beside each other."""
    folder, model, activation = classifiers[name]
    llm = LLM(str(folder), max_num_batched_tokens=16)
    spec = llm.engine.pooler.spec
    assert (spec.task, spec.activation) == ("classify", activation)
    assert llm.engine.runner.model.lm_head is None
    prompts = _prompts(1, [1, 9, 16, 41, 77])
    outputs = llm.classify(prompts, use_tqdm=False)
    for out, ids in zip(outputs, prompts):
        assert out.prompt_token_ids == ids
        assert out.outputs.num_classes == model.config.num_labels
        torch.testing.assert_close(torch.tensor(out.outputs.probs), _reference(model, ids, activation),
                                   atol=ATOL, rtol=0)
    assert llm.engine.is_idle_and_clean()


def test_classifier_requests_are_checked(classifiers, tiny_llama):
    folder, _, _ = classifiers["llama-3-labels"]
    llm = LLM(str(folder))
    assert llm.engine.pooler.spec.labels == ("negative", "neutral", "positive")
    with pytest.raises(ValueError) as err:
        llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert str(err.value) == POOLING_MODEL_MESSAGE
    with pytest.raises(ValueError, match="is a classification model: it does not support the embed task"):
        llm.embed([[5, 6]], use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions applies to embeddings"):
        llm.encode([[5, 6]], PoolingParams(dimensions=2), use_tqdm=False)
    with pytest.raises(ValueError, match="cannot generate text"):
        LLM(str(folder), runner="generate")
    embedder = LLM(str(tiny_llama), runner="pooling")
    with pytest.raises(ValueError, match="is an embedding model: it does not support the classify task"):
        embedder.classify([[5, 6]], use_tqdm=False)
    with pytest.raises(ValueError, match="task must be one of"):
        PoolingParams(task="score")


def test_classify_endpoint(classifiers):
    """vLLM's /classify: each input's probabilities and most probable label, in input order, equal to the
    engine's own (and /pooling's data); the text and embedding endpoints are closed on a classifier."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine
    from plait.entrypoints.server import BackgroundServer, OpenAIServer, ServerConfig

    folder, model, activation = classifiers["llama-3-labels"]
    engine = LLMEngine(EngineConfig(model=str(folder), max_num_batched_tokens=16))
    prompts = _prompts(2, [5, 30, 12])
    with BackgroundServer(OpenAIServer(engine, ServerConfig(log_level="warning"))) as url:
        r = httpx.post(f"{url}/classify", json={"input": prompts}, timeout=60)
        one = httpx.post(f"{url}/classify", json={"input": prompts[1], "truncate_prompt_tokens": 4},
                         timeout=60)
        pooled = httpx.post(f"{url}/pooling", json={"input": prompts}, timeout=60)  # vLLM's: the probs
        invoked = httpx.post(f"{url}/invocations", json={"input": prompts}, timeout=60)  # SageMaker's
        refused = [httpx.post(f"{url}{path}", json=body, timeout=60) for path, body in (
            ("/v1/embeddings", {"input": prompts[0]}),
            ("/v1/completions", {"prompt": prompts[0]}),
            ("/classify", {"input": []}),
            ("/score", {"text_1": "t5", "text_2": "t6"}))]
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["id"].startswith("classify-")
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == sum(map(len, prompts))
    for item, ids in zip(body["data"], prompts):
        want = _reference(model, ids, activation)
        torch.testing.assert_close(torch.tensor(item["probs"]), want, atol=ATOL, rtol=0)
        assert item["label"] == LABELS[int(want.argmax())] and item["num_classes"] == 3
    assert [item["index"] for item in body["data"]] == [0, 1, 2]
    assert [d["data"] for d in pooled.json()["data"]] == [item["probs"] for item in body["data"]]
    assert [d["probs"] for d in invoked.json()["data"]] == [item["probs"] for item in body["data"]]
    torch.testing.assert_close(torch.tensor(one.json()["data"][0]["probs"]),
                               _reference(model, prompts[1][-4:], activation), atol=ATOL, rtol=0)
    messages = ["does not support Embeddings API", "does not support Completions API", "input is empty",
                "does not support Score API"]
    for response, message in zip(refused, messages):
        assert response.status_code == 400 and message in response.json()["error"]["message"], response.text


# vLLM's recipe for Qwen3-Reranker: its causal LM read as a classifier of one label, P("yes") against "no".
RERANKER_OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"],
                      "classifier_from_token": ["no", "yes"]}
QUERY = "What is the capital of France?"
DOCUMENTS = ["Paris is the capital of France.", "Bananas are rich in potassium.", "France borders Spain."]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    """A random tiny Qwen3 causal LM over the default model's vocabulary and tokenizer (which has the words
    "yes" and "no"), saved as a checkpoint of its own: (folder, the HF model, the tokenizer)."""
    import transformers

    from plait.loader.source import default_model_path
    from plait.loader.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    cfg = transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   vocab_size=len(tokenizer), max_position_embeddings=256,
                                   tie_word_embeddings=True)
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(8.0)  # the tied head: logit gaps of a few units
    folder = tmp_path_factory.mktemp("tiny-reranker")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, model, tokenizer


def _yes_probability(model, tokenizer, query: str, document: str) -> float:
    ids = tokenizer(query, text_pair=document)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    return torch.softmax(logits[[no, yes]], dim=-1)[1].item()


def test_a_causal_lm_scores_pairs_as_a_cross_encoder_from_two_tokens(reranker):
    """vLLM's --hf-overrides recipe for Qwen3-Reranker: the causal LM as a classifier of one label whose
    score head is the LM head's "yes" row minus its "no" row, so its sigmoid is the softmax of the two
    logits at "yes". LLM.score reads each (query, document) pair as one prompt, tokenized as a pair, chunked
    here: every score equals transformers' P("yes") of the pair; /score and /rerank serve the same."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine
    from plait.entrypoints.server import BackgroundServer, OpenAIServer, ServerConfig

    folder, model, tokenizer = reranker
    want = [_yes_probability(model, tokenizer, QUERY, d) for d in DOCUMENTS]
    assert max(want) - min(want) > 0.01  # the scores tell the documents apart
    llm = LLM(str(folder), hf_overrides=RERANKER_OVERRIDES, max_num_batched_tokens=8)
    got = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    assert [o.outputs.score for o in got] == pytest.approx(want, abs=ATOL)
    pairs = llm.score(DOCUMENTS[:2], [QUERY, QUERY], use_tqdm=False)  # in pairs, either side first
    assert [o.outputs.score for o in pairs] == pytest.approx(
        [_yes_probability(model, tokenizer, d, QUERY) for d in DOCUMENTS[:2]], abs=ATOL)
    # As a classifier of one label, with a prompt formed by hand (Qwen3-Reranker's clients template theirs).
    ids = tokenizer(QUERY, text_pair=DOCUMENTS[0])["input_ids"]
    assert llm.classify([{"prompt_token_ids": ids}], use_tqdm=False)[0].outputs.probs == pytest.approx(
        [want[0]], abs=ATOL)
    engine = LLMEngine(EngineConfig(model=str(folder), hf_overrides=RERANKER_OVERRIDES,
                                    max_num_batched_tokens=16))
    with BackgroundServer(OpenAIServer(engine, ServerConfig(log_level="warning"))) as url:
        score = httpx.post(f"{url}/score", json={"text_1": QUERY, "text_2": DOCUMENTS}, timeout=60).json()
        ranked = httpx.post(f"{url}/rerank", json={"query": QUERY, "documents": DOCUMENTS}, timeout=60).json()
        unpaired = httpx.post(f"{url}/score", json={"text_1": DOCUMENTS[:2], "text_2": DOCUMENTS}, timeout=60)
        invoked = [httpx.post(f"{url}/invocations", json=body, timeout=60).json() for body in (
            {"text_1": QUERY, "text_2": DOCUMENTS}, {"query": QUERY, "documents": DOCUMENTS})]
    assert [d["score"] for d in score["data"]] == pytest.approx(want, abs=ATOL)
    assert score["usage"]["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in got)
    order = sorted(range(len(DOCUMENTS)), key=lambda j: -want[j])
    assert [r["index"] for r in ranked["results"]] == order
    assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx([want[j] for j in order],
                                                                              abs=ATOL)
    assert unpaired.status_code == 400 and unpaired.json()["error"]["param"] == "text_2"
    assert invoked[0]["data"] == score["data"] and invoked[1]["results"] == ranked["results"]


def test_classifier_from_token_needs_tokens_of_the_vocabulary(reranker):
    folder, _, _ = reranker
    with pytest.raises(ValueError, match="'zzzqqq' is not a token"):
        LLM(str(folder), hf_overrides={**RERANKER_OVERRIDES, "classifier_from_token": ["no", "zzzqqq"]})
    with pytest.raises(ValueError, match="hf_overrides must be a JSON object"):
        LLM(str(folder), hf_overrides="[1]")
