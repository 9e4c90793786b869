"""Encoder embedding models (BertModel, RobertaModel, XLMRobertaModel) on the pooling runner: plait's pooled
vectors against transformers' hidden states, each prompt attended whole and bidirectionally whatever the
batch; the budget rules of prompts that cannot be chunked; generation refused."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
import torch.nn.functional as F

from plait import LLM
from plait.engine.engine import POOLING_MODEL_MESSAGE
from plait.pooling_params import PoolingParams

ATOL = 1e-5
VOCAB = 300
BERT_POSITIONS = 64
# More than the CPU's default token budget (2,048), so the engine must raise it for a whole prompt.
XLMR_POSITIONS = 2202
XLMR_PAD = 1  # XLM-R's positions start at pad + 1: XLMR_POSITIONS - 2 tokens fit


def _save(model, folder, pooling: str) -> None:
    """An HF folder with a sentence-transformers config: Transformer, Pooling (``pooling``), Normalize."""
    model.save_pretrained(folder)
    kinds = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
    modules = [{"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
               for i, (path, kind) in enumerate(kinds)]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, "pooling_mode_cls_token": pooling == "CLS",
        "pooling_mode_mean_tokens": pooling == "MEAN"}))
    (folder / "2_Normalize").mkdir()


@pytest.fixture(scope="module")
def encoders(tmp_path_factory) -> dict:
    """family -> (folder, transformers' model in fp32, its sentence-transformers pooling)."""
    from transformers import (
        BertConfig,
        BertModel,
        RobertaConfig,
        RobertaModel,
        XLMRobertaConfig,
        XLMRobertaModel,
    )

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    made = {}
    for i, (family, model, pooling) in enumerate([
        ("bert", lambda: BertModel(BertConfig(max_position_embeddings=BERT_POSITIONS, **common)), "CLS"),
        ("xlmr", lambda: XLMRobertaModel(XLMRobertaConfig(max_position_embeddings=XLMR_POSITIONS,
                                                          pad_token_id=XLMR_PAD, **common)), "MEAN"),
        ("roberta", lambda: RobertaModel(RobertaConfig(max_position_embeddings=BERT_POSITIONS + 2,
                                                       pad_token_id=XLMR_PAD, **common)), "MEAN"),
    ]):
        torch.manual_seed(2000 + i)
        hf = model().float().eval()
        with torch.no_grad():  # random LayerNorms and biases, so every parameter's loading counts
            for name, p in hf.named_parameters():
                if "LayerNorm" in name or name.endswith("bias"):
                    p.normal_(0.5 if name.endswith("weight") else 0.0, 0.3)
        folder = tmp_path_factory.mktemp(f"tiny-{family}")
        _save(hf, folder, pooling)
        made[family] = (folder, hf, pooling)
    return made


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Ids from 3: never a pad id (XLM-R's position ids skip pad tokens)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def _reference(hf, ids: list[int], kind: str) -> torch.Tensor:
    with torch.no_grad():
        hidden = hf(torch.tensor([ids])).last_hidden_state[0]  # [n, hidden]
    return F.normalize(hidden[0] if kind == "CLS" else hidden.mean(0), dim=-1)


def _check(outputs, hf, prompts, kind) -> None:
    assert [o.prompt_token_ids for o in outputs] == prompts
    for out, ids in zip(outputs, prompts):
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), _reference(hf, ids, kind), atol=ATOL,
                                   rtol=0)


def test_bert_cls_embeddings_match_transformers(encoders):
    """CLS (the folder's Pooling), normalised, prompts of several lengths up to max_model_len in one batch:
    each equals transformers' and is the same alone; a budget of exactly max_model_len runs them whole over
    several steps."""
    folder, hf, kind = encoders["bert"]
    prompts = _prompts(1, [1, 5, 17, 40, BERT_POSITIONS])
    llm = LLM(str(folder))  # runner "auto": an encoder pools
    engine = llm.engine
    assert engine.pooler.spec.pooling_type == "CLS" and engine.max_model_len == BERT_POSITIONS
    assert engine.kv_cache.enable_prefix_caching is False
    batched = llm.embed(prompts, use_tqdm=False)
    _check(batched, hf, prompts, kind)
    assert engine.num_steps == 1
    for prompt, out in zip(prompts, batched):
        alone = llm.embed([prompt], use_tqdm=False)[0]
        torch.testing.assert_close(torch.tensor(alone.outputs.embedding), torch.tensor(out.outputs.embedding),
                                   atol=ATOL, rtol=0)
    tight = LLM(str(folder), runner="pooling", max_num_batched_tokens=BERT_POSITIONS)
    prompts = _prompts(2, [40, 30, BERT_POSITIONS, 5])
    _check(tight.embed(prompts, use_tqdm=False), hf, prompts, kind)
    assert tight.engine.num_steps == 4  # 40 | 30 | 64 | 5, never a chunk (chunked: 40+24 | 6+58 | 6+5)
    assert tight.engine.is_idle_and_clean()


def test_xlm_roberta_mean_embeddings_match_transformers(encoders):
    """MEAN, normalised, positions from pad_token_id + 1; max_model_len is two less than the position rows,
    and the CPU's default budget is raised to it, so a prompt longer than 2,048 tokens runs whole beside the
    others (the long one attended row by row, the short ones padded together)."""
    folder, hf, kind = encoders["xlmr"]
    llm = LLM(str(folder), runner="pooling", num_kv_blocks=400)
    engine = llm.engine
    assert engine.max_model_len == XLMR_POSITIONS - XLMR_PAD - 1
    assert engine.config.max_num_batched_tokens == engine.max_model_len
    prompts = _prompts(2, [3, 9, 33, 2100, 60, engine.max_model_len])
    _check(llm.embed(prompts, use_tqdm=False), hf, prompts, kind)
    raw = llm.embed(prompts[:3], PoolingParams(normalize=False), use_tqdm=False)
    with torch.no_grad():
        want = hf(torch.tensor([prompts[1]])).last_hidden_state[0].mean(0)
    torch.testing.assert_close(torch.tensor(raw[1].outputs.embedding), want, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="maximum context length"):
        llm.embed([_prompts(3, [engine.max_model_len + 1])[0]], use_tqdm=False)


def test_roberta_mean_embeddings_match_transformers(encoders):
    """RobertaModel (all-roberta-large-v1, stsb-roberta): XLM-R's positions from pad_token_id + 1, so its 66
    rows hold 64 tokens; MEAN, normalised, batched prompts up to that as transformers'."""
    folder, hf, kind = encoders["roberta"]
    llm = LLM(str(folder))
    assert llm.engine.max_model_len == BERT_POSITIONS
    prompts = _prompts(4, [2, 11, 37, BERT_POSITIONS])
    _check(llm.embed(prompts, use_tqdm=False), hf, prompts, kind)


def test_a_budget_below_max_model_len_is_refused(encoders):
    """A prompt cannot be chunked: a given budget below max_model_len is refused at start (as vLLM does), and
    runs with max_model_len lowered to it; so is a chunk cap below it."""
    folder, hf, kind = encoders["bert"]
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(16\) is smaller than max_model_len"):
        LLM(str(folder), max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        LLM(str(folder), long_prefill_token_threshold=16)
    llm = LLM(str(folder), max_num_batched_tokens=16, max_model_len=16)
    prompts = _prompts(4, [16, 3, 16, 9])
    _check(llm.embed(prompts, use_tqdm=False), hf, prompts, kind)
    with pytest.raises(ValueError, match="maximum context length"):
        llm.embed(_prompts(5, [17]), use_tqdm=False)


def test_default_pooling_is_cls_and_generation_is_refused(encoders, tmp_path):
    """Without a sentence-transformers config a BertModel pools CLS, normalised (vLLM's default for BERT);
    a LAST pooler still keeps prefix caching off. Generation is refused by the architecture's name."""
    folder, hf, _ = encoders["bert"]
    bare = tmp_path / "bare-bert"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(folder / name, bare / name)
    llm = LLM(str(bare))
    assert (llm.engine.pooler.spec.pooling_type, llm.engine.pooler.spec.normalize) == ("CLS", True)
    prompts = _prompts(6, [7, 30])
    _check(llm.embed(prompts, use_tqdm=False), hf, prompts, "CLS")
    with pytest.raises(ValueError, match=re.escape(POOLING_MODEL_MESSAGE)):
        llm.generate([[5, 6, 7]], use_tqdm=False)
    last = LLM(str(bare), pooler_config={"pooling_type": "LAST"})
    assert last.engine.kv_cache.enable_prefix_caching is False
    with pytest.raises(ValueError, match="BertModel is an encoder pooling model"):
        LLM(str(bare), runner="generate")
    with pytest.raises(ValueError, match="XLMRobertaModel is an encoder pooling model"):
        LLM(str(encoders["xlmr"][0]), runner="generate")


def test_random_weights_of_an_encoder_config(encoders):
    """load_format dummy: LayerNorms start as the identity (weights 1, biases 0), as RMSNorms do."""
    llm = LLM(str(encoders["bert"][0]), load_format="dummy")
    model = llm.engine.runner.model
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert norms and all(torch.all(m.weight == 1) and torch.all(m.bias == 0) for m in norms)
    (out,) = llm.embed([[5, 6, 7, 8]])
    assert abs(torch.tensor(out.outputs.embedding).norm().item() - 1.0) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["bert", "xlmr"])
def test_gpu_encoder_embeddings_match_transformers(encoders, family):
    """bf16 on the GPU (torch_ref attention, the pooling runner's steps): each vector within bf16 rounding of
    transformers' fp32 one (cosine), prompts of different lengths batched."""
    folder, hf, pooling = encoders[family]
    llm = LLM(str(folder), dtype="bfloat16")
    assert llm.engine.runner.device.type == "cuda"
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, VOCAB, (int(n),), generator=g).tolist() for n in (3, 17, 40, 60)]
    for prompt, out in zip(prompts, llm.embed(prompts)):
        with torch.no_grad():
            states = hf(torch.tensor([prompt])).last_hidden_state[0]
        want = F.normalize(states[0] if pooling == "CLS" else states.mean(0), dim=-1)
        got = torch.tensor(out.outputs.embedding)
        assert F.cosine_similarity(got, want, dim=0) > 0.999
