"""Pooling models (embeddings): plait's pooled vectors against HF transformers' hidden states, whatever the
chunking, batching, prefix cache or preemption; sentence-transformers configs, base-model checkpoints,
Matryoshka dimensions, and refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from plait import LLM
from plait.config import PoolerConfig
from plait.engine.engine import GENERATE_MODEL_MESSAGE, POOLING_MODEL_MESSAGE
from plait.pooling_params import PoolingParams
from plait.sampling_params import SamplingParams
from tests.conftest import TINY_VOCAB

ATOL = 2e-5


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, TINY_VOCAB, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def hf_trunks(tiny_models) -> dict:
    """family -> transformers' base model (LlamaModel, Qwen3Model, ...) of the tiny checkpoint, fp32."""
    from transformers import AutoModel

    return {family: AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
            for family, folder in tiny_models.items() if family in ("llama", "qwen3")}


def _reference(trunk, ids: list[int], kind: str = "LAST", normalize: bool = True) -> torch.Tensor:
    """What a pooling model should give for ``ids``: HF's final hidden states (after the final norm),
    pooled."""
    with torch.no_grad():
        hidden = trunk(torch.tensor([ids])).last_hidden_state[0]  # [n, hidden]
    vector = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[kind]
    return F.normalize(vector, dim=-1) if normalize else vector


def _check(outputs, trunk, prompts, kind="LAST", normalize=True) -> None:
    assert [o.prompt_token_ids for o in outputs] == prompts
    for out, ids in zip(outputs, prompts):
        got = torch.tensor(out.outputs.embedding)
        torch.testing.assert_close(got, _reference(trunk, ids, kind, normalize), atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_last_token_embeddings_match_transformers(tiny_models, hf_trunks, family):
    """The default pooler (LAST, normalised) of a generative checkpoint run with runner='pooling', in one
    batch of prompts whose chunks share steps."""
    llm = LLM(str(tiny_models[family]), runner="pooling", max_num_batched_tokens=64)
    prompts = _prompts(1, [1, 5, 17, 40, 63, 100])
    outputs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    _check(outputs, hf_trunks[family], prompts)
    assert all(abs(torch.tensor(o.outputs.embedding).norm().item() - 1) < 1e-5 for o in outputs)
    assert outputs[0].outputs.hidden_size == 64
    assert llm.engine.is_idle_and_clean()


def test_convert_embed_is_the_pooling_runner(tiny_llama):
    """vLLM's convert="embed" (--convert embed): a generative checkpoint served as an embedding model, the
    same embeddings as runner="pooling"; with runner "generate", or an unknown conversion, refused."""
    from plait.config import EngineConfig

    prompts = [{"prompt_token_ids": p} for p in _prompts(2, [3, 30])]
    converted = LLM(str(tiny_llama), convert="embed", max_num_batched_tokens=64)
    assert converted.engine.config.runner == "pooling"
    pooled = LLM(str(tiny_llama), runner="pooling", max_num_batched_tokens=64)
    for a, b in zip(converted.embed(prompts, use_tqdm=False), pooled.embed(prompts, use_tqdm=False)):
        assert a.outputs.embedding == b.outputs.embedding
    with pytest.raises(ValueError, match="cannot run with runner 'generate'"):
        EngineConfig(convert="embed", runner="generate")
    with pytest.raises(ValueError, match="convert must be one of auto, none, embed"):
        EngineConfig(convert="reward")


@pytest.mark.parametrize("kind", ["MEAN", "CLS"])
def test_chunked_mean_and_cls_pooling_match_transformers(tiny_llama, hf_trunks, kind):
    """MEAN and CLS read positions before the last: a prompt pooled over chunks of 8 tokens (its sum or its
    first token's state carried between its steps) equals HF's, beside other prompts' chunks, with and
    without overlapping steps; normalize off per request."""
    prompts = _prompts(2, [3, 8, 9, 30, 71])
    for overlap in (True, False):
        llm = LLM(str(tiny_llama), runner="pooling", pooler_config={"pooling_type": kind},
                  max_num_batched_tokens=8, async_scheduling=overlap)
        assert llm.engine.kv_cache.enable_prefix_caching is False  # MEAN / CLS read every position
        raw = llm.embed(prompts, PoolingParams(normalize=False), use_tqdm=False)
        _check(raw, hf_trunks["llama"], prompts, kind, normalize=False)
        assert llm.engine.num_steps >= sum(-(-len(p) // 8) for p in prompts) // 2  # really chunked
        _check(llm.embed(prompts, use_tqdm=False), hf_trunks["llama"], prompts, kind)


def test_embeddings_do_not_depend_on_batching(tiny_llama):
    """Alone, in a batch, in big or small chunks: the same embedding (to fp32 rounding)."""
    prompts = _prompts(3, [13, 29, 50, 7])
    big = LLM(str(tiny_llama), runner="pooling", max_num_batched_tokens=512)
    small = LLM(str(tiny_llama), runner="pooling", max_num_batched_tokens=4, enable_prefix_caching=False)
    batched = big.embed(prompts, use_tqdm=False)
    for prompt, out in zip(prompts, batched):
        for llm in (big, small):
            alone = llm.embed([prompt], use_tqdm=False)[0]
            torch.testing.assert_close(torch.tensor(alone.outputs.embedding),
                                       torch.tensor(out.outputs.embedding), atol=ATOL, rtol=0)


def test_last_pooling_keeps_the_prefix_cache(tiny_llama, hf_trunks):
    """LAST pooling always computes the prompt's last token, so a shared prefix is served from the cache and
    the embedding is unchanged."""
    llm = LLM(str(tiny_llama), runner="pooling", max_num_batched_tokens=64, block_size=8)
    prompt = _prompts(4, [70])[0]
    first = llm.encode([prompt], use_tqdm=False)[0]
    again = llm.encode([prompt], use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 64
    torch.testing.assert_close(again.outputs.data, first.outputs.data, atol=ATOL, rtol=0)
    torch.testing.assert_close(again.outputs.data, _reference(hf_trunks["llama"], prompt), atol=ATOL, rtol=0)


def test_preempted_prompts_are_pooled_from_scratch(tiny_llama, hf_trunks):
    """Too few KV blocks for every prompt at once: prompts mid-way are preempted (their partial sums
    dropped) and restarted, and every MEAN embedding still equals HF's."""
    llm = LLM(str(tiny_llama), runner="pooling", pooler_config={"pooling_type": "MEAN"},
              max_num_batched_tokens=32, block_size=4, num_kv_blocks=40, max_num_partial_prefills=4)
    prompts = _prompts(5, [100, 90, 80, 70, 60, 50])
    outputs = llm.encode(prompts, use_tqdm=False)
    assert sum(o.metrics["num_preemptions"] for o in outputs) > 0
    for out, ids in zip(outputs, prompts):
        torch.testing.assert_close(out.outputs.data, _reference(hf_trunks["llama"], ids, "MEAN"), atol=ATOL,
                                   rtol=0)
    assert llm.engine.is_idle_and_clean()


def test_aborted_embedding_request_frees_everything(tiny_llama):
    llm = LLM(str(tiny_llama), runner="pooling", max_num_batched_tokens=8,
              pooler_config={"pooling_type": "MEAN"})
    engine = llm.engine
    engine.add_request(_prompts(6, [60])[0], request_id="a")
    engine.add_request(_prompts(7, [20])[0], request_id="b")
    done = []
    for _ in range(3):
        done += engine.step()
    engine.abort_request("a")
    while engine.has_unfinished_requests():
        done += engine.step()
    assert [o.request_id for o in done] == ["b"]
    assert engine.is_idle_and_clean()


def test_base_model_checkpoint_runs_as_a_pooling_model(tmp_path):
    """An HF base model's checkpoint (architectures ["Qwen3Model"], names without "model.", no lm_head), as
    embedding models such as e5-mistral ship, is a pooling model by default; it cannot generate."""
    from transformers import AutoModel, Qwen3Config

    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, vocab_size=TINY_VOCAB, max_position_embeddings=256)
    torch.manual_seed(7)
    trunk = AutoModel.from_config(cfg, dtype=torch.float32).eval()
    trunk.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Qwen3Model"]
    llm = LLM(str(tmp_path))
    assert llm.engine.runner.runner_type == "pooling" and llm.engine.runner.model.lm_head is None
    prompts = _prompts(8, [6, 33])
    _check(llm.embed(prompts, use_tqdm=False), trunk, prompts)
    with pytest.raises(ValueError, match="cannot generate text"):
        LLM(str(tmp_path), runner="generate")


def _sentence_transformers_folder(src, dst, pooling_mode: str, normalize: bool, extra: dict | None = None):
    shutil.copytree(src, dst)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    for module in (extra or {}).get("modules", []):
        modules.append(module)
    (dst / "modules.json").write_text(json.dumps(modules))
    (dst / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": 64, "pooling_mode_cls_token": False,
               "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
               "pooling_mode_lasttoken": False, pooling_mode: True}
    (dst / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return dst


def test_sentence_transformers_config_chooses_the_pooler(tiny_llama, hf_trunks, tmp_path):
    """modules.json's Pooling mode and the presence of a Normalize module decide the pooler, as vLLM reads
    them; pooler_config's fields win; a module that is none of the known ones is refused by name."""
    folder = _sentence_transformers_folder(tiny_llama, tmp_path / "st", "pooling_mode_mean_tokens", False)
    llm = LLM(str(folder), runner="pooling")
    spec = llm.engine.pooler.spec
    assert (spec.pooling_type, spec.normalize) == ("MEAN", False)
    prompts = _prompts(9, [12, 40])
    _check(llm.embed(prompts, use_tqdm=False), hf_trunks["llama"], prompts, "MEAN", normalize=False)
    overridden = LLM(str(folder), runner="pooling",
                     pooler_config='{"pooling_type": "cls", "normalize": true}')
    _check(overridden.embed(prompts, use_tqdm=False), hf_trunks["llama"], prompts, "CLS")
    other = {"modules": [{"idx": 3, "name": "3", "path": "3_LayerNorm",
                          "type": "sentence_transformers.models.LayerNorm"}]}
    bad = _sentence_transformers_folder(tiny_llama, tmp_path / "other", "pooling_mode_lasttoken", True, other)
    with pytest.raises(ValueError, match="sentence_transformers.models.LayerNorm"):
        LLM(str(bad), runner="pooling")


def _dense_folder(src, dst, activation: str, weight: torch.Tensor, bias: torch.Tensor, normalize_first=False):
    """A sentence-transformers folder: the trunk, LAST pooling, a Dense module (64 -> out), Normalize."""
    from safetensors.torch import save_file

    folder = _sentence_transformers_folder(src, dst, "pooling_mode_lasttoken", False)
    modules = json.loads((folder / "modules.json").read_text())
    dense = {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
    norm = {"idx": 3, "name": "3", "path": "3_Normalize", "type": "sentence_transformers.models.Normalize"}
    modules += [norm, dense] if normalize_first else [dense, norm]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "2_Dense").mkdir()
    (folder / "2_Dense" / "config.json").write_text(json.dumps({
        "in_features": weight.shape[1], "out_features": weight.shape[0], "bias": True,
        "activation_function": activation}))
    save_file({"linear.weight": weight, "linear.bias": bias}, folder / "2_Dense" / "model.safetensors")
    return folder


def test_sentence_transformers_dense_modules_project_the_pooled_vector(tiny_llama, hf_trunks, tmp_path):
    """A Dense module after the pooling (as stella-style models have) projects the vector on the device
    before it is normalised: tanh(W h + b), as sentence-transformers computes it; an activation or an
    order plait does not apply is refused by name."""
    gen = torch.Generator().manual_seed(5)
    weight, bias = torch.randn(32, 64, generator=gen) * 0.3, torch.randn(32, generator=gen)
    folder = _dense_folder(tiny_llama, tmp_path / "dense", "torch.nn.modules.activation.Tanh", weight, bias)
    llm = LLM(str(folder), runner="pooling", max_num_batched_tokens=16)
    assert llm.engine.pooler.spec.output_size == 32
    prompts = _prompts(12, [7, 30])
    for out, ids in zip(llm.embed(prompts, use_tqdm=False), prompts):
        want = F.normalize(torch.tanh(weight @ _reference(hf_trunks["llama"], ids, normalize=False) + bias),
                           dim=-1)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, atol=ATOL, rtol=0)
    relu = _dense_folder(tiny_llama, tmp_path / "relu", "torch.nn.modules.activation.ReLU", weight, bias)
    with pytest.raises(ValueError, match="torch.nn.modules.activation.ReLU"):
        LLM(str(relu), runner="pooling")
    late = _dense_folder(tiny_llama, tmp_path / "late", "torch.nn.modules.linear.Identity", weight, bias,
                         normalize_first=True)
    with pytest.raises(ValueError, match="after its Normalize module"):
        LLM(str(late), runner="pooling")


def test_matryoshka_dimensions(tiny_llama, hf_trunks, tmp_path):
    """``dimensions`` keeps the first d entries and then normalises, on a model whose config says it is a
    Matryoshka model (only the listed sizes where it lists them); other models refuse it in vLLM's words."""
    prompt = _prompts(10, [21])[0]
    plain = LLM(str(tiny_llama), runner="pooling")
    with pytest.raises(ValueError, match="does not support matryoshka representation"):
        plain.embed([prompt], PoolingParams(dimensions=16), use_tqdm=False)
    folder = tmp_path / "mrl"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32, 64]}))
    llm = LLM(str(folder), runner="pooling")
    out = llm.embed([prompt], PoolingParams(dimensions=16), use_tqdm=False)[0]
    raw = _reference(hf_trunks["llama"], prompt, normalize=False)
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), F.normalize(raw[:16], dim=-1), atol=ATOL,
                               rtol=0)
    with pytest.raises(ValueError, match=r"only supports \[16, 32, 64\] matryoshka dimensions"):
        llm.embed([prompt], PoolingParams(dimensions=20), use_tqdm=False)
    with pytest.raises(ValueError, match="Dimensions must be greater than 0"):
        PoolingParams(dimensions=0)


def test_pooling_requests_and_config_are_checked(tiny_llama, tiny_models):
    llm = LLM(str(tiny_llama), runner="pooling", max_model_len=64)
    with pytest.raises(ValueError, match="runs a pooling model") as err:
        llm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert str(err.value) == POOLING_MODEL_MESSAGE
    # A prompt may fill the whole context (nothing follows it), not one token more.
    assert len(llm.embed([[5] * 64], use_tqdm=False)[0].outputs.embedding) == 64
    with pytest.raises(ValueError, match="maximum context length is 64 tokens"):
        llm.embed([[5] * 65], use_tqdm=False)
    kept = llm.encode([list(range(3, 103))], PoolingParams(truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert kept.prompt_token_ids == list(range(39, 103))
    assert llm.encode([list(range(3, 13))], truncate_prompt_tokens=4, use_tqdm=False)[0].prompt_token_ids == [
        9, 10, 11, 12]
    with pytest.raises(ValueError, match="greater than max_model_len"):
        llm.embed([[5, 6]], PoolingParams(truncate_prompt_tokens=65), use_tqdm=False)
    with pytest.raises(ValueError, match="out of range"):
        llm.embed([[TINY_VOCAB]], use_tqdm=False)
    generator = LLM(str(tiny_models["qwen3"]))
    assert generator.engine.pooler is None
    with pytest.raises(ValueError) as err:
        generator.embed(["hello"], use_tqdm=False)
    assert str(err.value) == GENERATE_MODEL_MESSAGE
    with pytest.raises(ValueError, match="needs runner 'pooling'"):
        LLM(str(tiny_llama), runner="generate", pooler_config={"pooling_type": "MEAN"})
    with pytest.raises(ValueError, match="runner must be one of"):
        LLM(str(tiny_llama), runner="embed")
    with pytest.raises(ValueError, match="pooling_type must be one of"):
        PoolerConfig(pooling_type="MAX")
    with pytest.raises(ValueError, match="unknown pooler_config key"):
        PoolerConfig.parse({"pooling": "MEAN"})
    with pytest.raises(ValueError, match="speculative decoding needs a generating model"):
        LLM(str(tiny_llama), runner="pooling",
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_default_model_embeddings_match_transformers(hf_gguf_model):
    """The bundled SmolLM2 GGUF run as a pooling model: its LAST embeddings of real text equal those of
    transformers' own GGUF load (its trunk's final hidden state, normalised)."""
    llm = LLM(runner="pooling")
    texts = ["The cat sat on the mat.", "A cat was sitting on a mat.", "Quarterly revenue rose by 4 percent."]
    outputs = llm.embed(texts, use_tqdm=False)
    prompts = [o.prompt_token_ids for o in outputs]
    assert prompts == [llm.get_tokenizer().encode(t) for t in texts]
    _check(outputs, hf_gguf_model.model, prompts)


def test_cli_flags_take_vllm_forms():
    """`plait serve MODEL --runner pooling --pooler-config JSON`, as vllm serve takes them."""
    from plait.entrypoints.cli import _engine_config, parse_args

    args = parse_args(["serve", "m", "--runner", "pooling", "--pooler-config", '{"pooling_type": "mean"}'])
    config = _engine_config(args)
    assert (config.runner, config.pooler_config) == ("pooling", PoolerConfig(pooling_type="MEAN"))
    assert _engine_config(parse_args(["serve", "m"])).runner == "auto"


def test_score_is_the_cosine_of_the_embeddings(tiny_llama):
    """LLM.score with an embedding model: each pair's cosine similarity, one first input against every second
    one or the two lists in pairs; mismatched lists are refused."""
    llm = LLM(str(tiny_llama), runner="pooling", pooler_config={"normalize": False})
    a, b, c = _prompts(11, [7, 19, 33])
    vectors = {tuple(p): torch.tensor(o.outputs.embedding) for p, o in zip((a, b, c), llm.embed([a, b, c],
                                                                                             use_tqdm=False))}
    cosine = lambda x, y: F.cosine_similarity(vectors[tuple(x)], vectors[tuple(y)], dim=0).item()  # noqa: E731
    one_to_many = llm.score([a], [b, c], use_tqdm=False)
    assert [o.outputs.score for o in one_to_many] == pytest.approx([cosine(a, b), cosine(a, c)], abs=1e-6)
    assert one_to_many[1].prompt_token_ids == a + c
    pairs = llm.score([a, b], [c, a], use_tqdm=False)
    assert [o.outputs.score for o in pairs] == pytest.approx([cosine(a, c), cosine(b, a)], abs=1e-6)
    assert llm.score([b], [b], use_tqdm=False)[0].outputs.score == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(ValueError, match="pairs the inputs in order"):
        llm.score([a, b], [a, b, c], use_tqdm=False)
