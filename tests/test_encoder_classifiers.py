"""Encoder classifiers (BertForSequenceClassification, XLMRobertaForSequenceClassification): cross-encoder
rerankers such as ms-marco-MiniLM and bge-reranker-v2-m3, on the pooling runner. Their probabilities, their
pair scores (a BERT pair's second segment read as token type 1) and /rerank against transformers'."""

from __future__ import annotations

import pytest
import torch

from plait import LLM

ATOL = 1e-5
WORDS = ["the", "capital", "of", "france", "is", "paris", "bananas", "are", "rich", "in", "potassium", "what",
         "borders", "spain", "a", "city", "fruit", "##s", "yellow", "?", "."]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
QUERY = "what is the capital of france?"
DOCUMENTS = ["paris is the capital of france.", "bananas are rich in potassium.", "france borders spain."]


def _randomised(model) -> None:
    """Random LayerNorms and biases (every parameter's loading counts) and a score head of some weight."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.normal_(0.5 if name.endswith("weight") else 0.0, 0.3)
            elif "classifier" in name or "token_type" in name:  # segments that move the score
                p.mul_(20.0)


@pytest.fixture(scope="module")
def cross_encoders(tmp_path_factory) -> dict:
    """name -> (folder, transformers' model fp32, activation): a BERT reranker of one label with a WordPiece
    tokenizer (pairs as [CLS] a [SEP] b [SEP], the second segment of type 1), a BERT classifier of three
    labels, and an XLM-RoBERTa reranker of one label."""
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        BertTokenizerFast,
        XLMRobertaConfig,
        XLMRobertaForSequenceClassification,
    )

    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    made = {}
    tokenizer = BertTokenizerFast(vocab={word: i for i, word in enumerate(SPECIALS + WORDS)})
    for i, (name, config, activation) in enumerate([
        ("bert-reranker", BertConfig(vocab_size=len(SPECIALS + WORDS), num_labels=1,
                                     max_position_embeddings=64, **common), "sigmoid"),
        ("bert-3-labels", BertConfig(vocab_size=len(SPECIALS + WORDS), num_labels=3,
                                     max_position_embeddings=64, **common), "softmax"),
        ("xlmr-reranker", XLMRobertaConfig(vocab_size=300, num_labels=1, max_position_embeddings=130,
                                           pad_token_id=1, type_vocab_size=1, **common), "sigmoid"),
    ]):
        torch.manual_seed(3000 + i)
        xlmr = name.startswith("xlmr")
        model = (XLMRobertaForSequenceClassification if xlmr else BertForSequenceClassification)(config)
        model = model.float().eval()
        _randomised(model)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        if name.startswith("bert"):
            tokenizer.save_pretrained(folder)
        made[name] = (folder, model, activation)
    return made


def _reference(model, activation: str, **encoded) -> torch.Tensor:
    with torch.no_grad():
        logits = model(**{k: torch.tensor([v]) for k, v in encoded.items()}).logits[0]
    return torch.sigmoid(logits) if activation == "sigmoid" else logits.softmax(-1)


def test_bert_reranker_scores_pairs_as_transformers_does(cross_encoders):
    """llm.score(query, documents): each pair through the tokenizer as a pair, its second segment of type 1,
    [CLS] through BERT's pooler and the classifier, a sigmoid: transformers' scores. A pair read with every
    token of type 0 scores otherwise, so the segments count."""
    from transformers import AutoTokenizer

    folder, model, activation = cross_encoders["bert-reranker"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    llm = LLM(str(folder))
    assert llm.engine.runner.model.segment_separator_id == tokenizer.sep_token_id
    scores = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    for out, document in zip(scores, DOCUMENTS):
        encoded = tokenizer(QUERY, text_pair=document)
        assert 1 in encoded["token_type_ids"] and out.prompt_token_ids == encoded["input_ids"]
        want = _reference(model, activation, **encoded)
        assert out.outputs.score == pytest.approx(want.item(), abs=ATOL)
        one_segment = dict(encoded, token_type_ids=[0] * len(encoded["input_ids"]))
        assert abs(_reference(model, activation, **one_segment).item() - want.item()) > 10 * ATOL


def test_rerank_endpoint_orders_documents_by_the_cross_encoder(cross_encoders):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from transformers import AutoTokenizer

    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine
    from plait.entrypoints.server import BackgroundServer, OpenAIServer, ServerConfig

    folder, model, activation = cross_encoders["bert-reranker"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    engine = LLMEngine(EngineConfig(model=str(folder)))
    with BackgroundServer(OpenAIServer(engine, ServerConfig(log_level="warning"))) as url:
        got = httpx.post(f"{url}/rerank", json={"query": QUERY, "documents": DOCUMENTS}, timeout=60)
    assert got.status_code == 200, got.text
    want = [_reference(model, activation, **tokenizer(QUERY, text_pair=d)).item() for d in DOCUMENTS]
    results = got.json()["results"]
    assert [r["index"] for r in results] == sorted(range(3), key=lambda k: -want[k])
    for r in results:
        assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=ATOL)


def test_bert_classifier_probabilities_match_transformers(cross_encoders):
    """Single texts (one segment: type 0 throughout), batched: the softmax over three labels."""
    from transformers import AutoTokenizer

    folder, model, activation = cross_encoders["bert-3-labels"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    llm = LLM(str(folder))
    outputs = llm.classify(DOCUMENTS + [QUERY], use_tqdm=False)
    for out, text in zip(outputs, DOCUMENTS + [QUERY]):
        want = _reference(model, activation, **tokenizer(text))
        torch.testing.assert_close(torch.tensor(out.outputs.probs), want, atol=ATOL, rtol=0)


def test_xlm_roberta_reranker_matches_transformers(cross_encoders):
    """XLM-RoBERTa's head (dense, tanh, out_proj at <s>), pairs given as token ids the way its tokenizer
    joins them (<s> a </s></s> b </s>), one token type."""
    folder, model, activation = cross_encoders["xlmr-reranker"]
    gen = torch.Generator().manual_seed(4)
    pairs = [(torch.randint(3, 300, (a,), generator=gen).tolist(), torch.randint(3, 300, (b,), generator=gen)
              .tolist()) for a, b in [(5, 17), (9, 3), (30, 60)]]
    prompts = [[0, *a, 2, 2, *b, 2] for a, b in pairs]
    llm = LLM(str(folder))
    outputs = llm.classify([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for out, ids in zip(outputs, prompts):
        want = _reference(model, activation, input_ids=ids)
        torch.testing.assert_close(torch.tensor(out.outputs.probs), want, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="encoder pooling model"):
        LLM(str(folder), runner="generate")
