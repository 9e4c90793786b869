"""Invariant 3: every supported family matches HF transformers (fp32 CPU): logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_greedy_matches_hf, random_prompts

from plait.config import EngineConfig
from plait.engine.engine import LLMEngine

LOGITS_ATOL = 1e-4
MAX_TOKENS = 12


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "qwen3-yarn", "granite", "olmo2",
                                    "olmo3", "gemma", "gemma2", "gemma3", "phi3", "phi3-longrope", "smollm3",
                                    "smollm3-sliding", "ministral3", "seed_oss", "exaone4", "glm",
                                    "glm4", "ernie4_5", "gpt_oss"])
def test_logits_and_greedy_match_hf(tiny_models, family):
    from transformers import AutoModelForCausalLM

    folder = tiny_models[family]
    # Eager attention: the one transformers soft-caps Gemma 2's scores in.
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    # Several prompts at once, some longer than the step budget, so rows mix chunks and decodes.
    prompts = random_prompts(6, 1, 70, seed=7)
    engine = LLMEngine(EngineConfig(model=str(folder), max_num_batched_tokens=48, block_size=8))
    assert_greedy_matches_hf(engine, hf, prompts, MAX_TOKENS, LOGITS_ATOL, family)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_prompt_logprobs_match_hf(tiny_llama, prefix_caching):
    """prompt_logprobs: each prompt token's logprob given the tokens before it, and the top-n there, as
    HF's log_softmax gives them; prompts split over several chunks, and (with prefix caching on) a
    second request sharing a cached prefix still gets every position."""
    from transformers import AutoModelForCausalLM

    from plait.sampling_params import SamplingParams

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    shared = random_prompts(1, 40, 40, seed=3)[0]
    prompts = [shared + [5, 6, 7], random_prompts(1, 70, 70, seed=4)[0], shared + [9], [11]]
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), max_num_batched_tokens=32, block_size=8,
                                    enable_prefix_caching=prefix_caching))
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    finals = {}
    for i, prompt in enumerate(prompts):  # one after another, so later ones could hit the cache
        engine.add_request(prompt, params, request_id=str(i))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
    for i, prompt in enumerate(prompts):
        got = finals[str(i)].prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)  # [L, V]
        for pos in range(1, len(prompt)):
            entry, row = got[pos], ref[pos - 1]
            assert entry.token_id == prompt[pos]
            assert abs(entry.logprob - row[prompt[pos]].item()) < LOGITS_ATOL, (i, pos)
            top = torch.topk(row, 3)
            assert list(entry.top) == top.indices.tolist(), (i, pos)
            assert entry.rank in _vocabulary_ranks(row, entry.logprob), (i, pos)
            torch.testing.assert_close(torch.tensor(list(entry.top.values())), top.values,
                                       atol=LOGITS_ATOL, rtol=0)
    assert engine.is_idle_and_clean()


def _vocabulary_ranks(reference: torch.Tensor, logprob: float) -> range:
    """The ranks (how many ids have a logprob >= it, vLLM's) ``reference`` ([V]) allows a token of logprob
    ``logprob``: ids within LOGITS_ATOL of it may fall either side of it in another summation order."""
    above = int((reference > logprob + LOGITS_ATOL).sum())
    return range(above + 1, int((reference >= logprob - LOGITS_ATOL).sum()) + 1)


def _image_text_model(kind: str):
    """A random image-text model of ``kind`` with a tiny vision tower beside its text decoder: (HF model, the
    transformers config class its text_config completes from)."""
    import transformers
    from conftest import TINY_VOCAB

    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, vocab_size=TINY_VOCAB, max_position_embeddings=512)
    if kind == "gemma3":
        text_class = transformers.Gemma3TextConfig
        vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                 num_attention_heads=2, image_size=28, patch_size=14)
        kinds = ["sliding_attention", "full_attention"]
        config = transformers.Gemma3Config(
            text_config=text_class(**text, sliding_window=16, layer_types=kinds),
            vision_config=vision, mm_tokens_per_image=4, image_token_index=TINY_VOCAB - 1,
            boi_token_index=TINY_VOCAB - 3, eoi_token_index=TINY_VOCAB - 2)
        model_class = transformers.Gemma3ForConditionalGeneration
    else:
        # Mistral-Small-3.1 / 3.2's decoder is Mistral's; the Ministral 3 models' adds YaRN and Llama 4's
        # query scaling, over a period the test prompts cross.
        if kind == "ministral3":
            text_class = transformers.Ministral3Config
            text |= dict(pad_token_id=None, rope_parameters={
                "rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "original_max_position_embeddings": 8,
                "beta_fast": 32.0, "beta_slow": 1.0, "llama_4_scaling_beta": 0.5})
        else:
            text_class = transformers.MistralConfig
        vision = transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                  num_attention_heads=2, image_size=28, patch_size=14,
                                                  head_dim=16)
        config = transformers.Mistral3Config(text_config=text_class(**text, sliding_window=None),
                                             vision_config=vision, image_token_index=TINY_VOCAB - 1)
        model_class = transformers.Mistral3ForConditionalGeneration
    torch.manual_seed(11)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(8.0)
            elif kind == "gemma3":  # 1 + weight norms, zero-initialised: make them count
                p.normal_(0.0, 0.3)
    return model, text_class


@pytest.fixture(scope="module")
def image_text_models(tmp_path_factory):
    """kind -> (folder of the checkpoint as transformers saves it, HF model, text config class)."""
    made = {}
    for kind in ("gemma3", "mistral3", "ministral3"):
        model, text_class = _image_text_model(kind)
        folder = tmp_path_factory.mktemp(f"tiny-{kind}-image-text")
        model.save_pretrained(folder)
        made[kind] = folder, model, text_class
    return made


@pytest.mark.parametrize("layout", ["saved", "transformers5-names-and-hub-config"])
@pytest.mark.parametrize("kind", ["gemma3", "mistral3", "ministral3"])
def test_image_text_checkpoint_serves_text_like_hf(image_text_models, tmp_path, kind, layout):
    """An image-text checkpoint on text prompts (Gemma3ForConditionalGeneration: Gemma 3 4B, 12B, 27B,
    served text-only; Mistral3ForConditionalGeneration: Mistral-Small-3.1 / 3.2, and the Ministral 3 models
    with their own decoder, whose Pixtral side loads too: tests/test_pixtral.py): its language model under
    either naming (``language_model.model.*`` as saved, ``model.language_model.*`` as transformers 5 names it
    in memory), Gemma 3's vision tower left out, and a
    Hub-style text_config that lists only its model_type and what differs from transformers' defaults;
    greedy tokens and logits equal HF's."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    folder, hf, text_class = image_text_models[kind]
    if layout != "saved":
        copy = tmp_path / kind
        shutil.copytree(folder, copy)
        tensors = load_file(copy / "model.safetensors")
        renamed = {n.replace("language_model.model.", "model.language_model."): t for n, t in tensors.items()}
        # the image side too, as transformers 5 names it in memory (Mistral 3 loads it: tests/test_pixtral.py)
        renamed = {("model." + n if n.startswith(("vision_tower.", "multi_modal_projector.")) else n): t
                   for n, t in renamed.items()}
        save_file(renamed, copy / "model.safetensors")
        config = json.loads((copy / "config.json").read_text())
        defaults = text_class().to_dict()
        config["text_config"] = {k: v for k, v in config["text_config"].items()
                                 if k == "model_type" or defaults.get(k) != v}
        assert config["text_config"]["hidden_size"] == 64 and "rms_norm_eps" not in config["text_config"]
        (copy / "config.json").write_text(json.dumps(config))
        folder = copy
    prompts = random_prompts(4, 1, 40, seed=5)
    engine = LLMEngine(EngineConfig(model=str(folder), max_num_batched_tokens=32, block_size=8))
    assert type(engine.runner.model).__name__ == type(hf).__name__
    assert_greedy_matches_hf(engine, hf, prompts, MAX_TOKENS, LOGITS_ATOL)


def _greedy_matches_hf_through_triton(folder, num_prompts: int = 3, max_len: int = 40, max_tokens: int = 4
                                      ) -> None:
    """A few prompts through the triton backend (Triton's interpreter on CPU, fp32): greedy tokens and logits
    as HF's eager model of ``folder``."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    prompts = random_prompts(num_prompts, max_len // 2, max_len, seed=9)
    engine = LLMEngine(EngineConfig(model=str(folder), max_num_batched_tokens=32, block_size=8,
                                    attention_backend="triton"))
    assert_greedy_matches_hf(engine, hf, prompts, max_tokens, LOGITS_ATOL)


@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3"])
def test_gemma_through_the_triton_kernels_matches_hf(tiny_models, monkeypatch, family):
    """The GPU path's kernels (Triton's interpreter on CPU, fp32): 1 + weight norms fused with the add (Gemma
    2 / 3's sandwich: post-norm, add, pre-norm in one launch), 1 + weight q/k norms in the rotary launch,
    GeGLU, windowed and soft-capped paged attention; greedy tokens and logits as HF's."""

    from plait.kernels import dispatch, rms_norm

    monkeypatch.setattr(dispatch, "_cpu_interpreter", True)
    sandwiches = []
    fused = rms_norm.fused_add_rms_norm

    def counting(*args, **kwargs):
        sandwiches.append(kwargs.get("pre_weight") is not None)
        return fused(*args, **kwargs)

    monkeypatch.setattr(rms_norm, "fused_add_rms_norm", counting)
    _greedy_matches_hf_through_triton(tiny_models[family])
    # Every add-and-normalise took its post-norm along (Gemma 1 has none).
    assert sandwiches and (not any(sandwiches) if family == "gemma" else all(sandwiches))


# family -> (unrotated stores, fused rotary + stores) of one step through its layers
TRITON_KV_STORES = {"smollm3-sliding": (1, 2), "ministral3": (0, 2)}


@pytest.mark.parametrize("family", sorted(TRITON_KV_STORES))
def test_rotary_variants_through_the_triton_kernels_match_hf(tiny_models, monkeypatch, family):
    """The GPU path's kernels (Triton's interpreter on CPU, fp32): SmolLM3's NoPE layer stores K/V unrotated
    through the store kernel beside its layers that rotate and store in one launch, and attends through a
    window; Ministral 3's q comes out of the fused launch scaled by position (Llama 4's scaling). Greedy
    tokens and logits as HF's, and each layer took the launch it should."""

    import plait.attention.triton_backend as triton_backend
    from plait.kernels import dispatch

    monkeypatch.setattr(dispatch, "_cpu_interpreter", True)
    launches = {"store": 0, "rope_store": 0}
    for name in launches:
        kernel = getattr(triton_backend, f"{name}_kv")

        def counted(*args, _kernel=kernel, _name=name, **kwargs):
            launches[_name] += 1
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(triton_backend, f"{name}_kv", counted)
    _greedy_matches_hf_through_triton(tiny_models[family])
    plain, fused = TRITON_KV_STORES[family]
    assert launches["rope_store"] > 0 and launches["store"] * fused == launches["rope_store"] * plain


def test_gpt_oss_through_the_triton_kernels_matches_hf(tiny_models, monkeypatch):
    """The GPU path's kernels (Triton's interpreter on CPU, fp32): each query head's sink in every paged
    attention launch, the experts' biases and clamped SwiGLU in every fused MoE launch; greedy tokens and
    logits as HF's."""
    import plait.attention.triton_backend as triton_backend
    from plait.kernels import dispatch, fused_moe

    monkeypatch.setattr(dispatch, "_cpu_interpreter", True)
    sinks, activations = [], []
    attend, experts = triton_backend.paged_attention, fused_moe.fused_moe

    def attend_counted(*args, **kwargs):
        sinks.append(kwargs.get("sinks") is not None)
        return attend(*args, **kwargs)

    def experts_counted(*args, **kwargs):
        activations.append(kwargs.get("activation"))
        return experts(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "paged_attention", attend_counted)
    monkeypatch.setattr(fused_moe, "fused_moe", experts_counted)
    # Decode steps' few entries on the GEMV kernel, prompt chunks on the grouped GEMMs (the interpreter runs
    # the GEMV's one program per entry slowly).
    monkeypatch.setattr(fused_moe, "GEMV_MAX_ENTRIES", 4)
    # Two prompts, one past the sliding layer's window of 24, one chunk and two decode steps each: the
    # interpreter runs the MoE kernels slowly.
    _greedy_matches_hf_through_triton(tiny_models["gpt_oss"], num_prompts=2, max_len=30, max_tokens=3)
    assert sinks and all(sinks)
    assert activations and set(activations) == {fused_moe.SWIGLU_OAI}


def test_max_logprobs_caps_requests_and_can_allow_the_vocabulary(tiny_llama):
    """vLLM's --max-logprobs: 20 by default; any cap the engine is made with, and -1 for the whole vocabulary,
    whose logprobs then come back at every position: HF's log_softmax, every id, most likely first."""
    from conftest import TINY_VOCAB
    from transformers import AutoModelForCausalLM

    from plait.sampling_params import SamplingParams

    prompt = random_prompts(1, 12, 12, seed=8)[0]
    small = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=8, max_model_len=64, max_logprobs=3))
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"{field} 4 is more than the 3 this engine returns"):
            small.add_request(prompt, SamplingParams(max_tokens=1, **{field: 4}))
    default = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=8, max_model_len=64))
    with pytest.raises(ValueError, match="logprobs 21 is more than the 20"):
        default.add_request(prompt, SamplingParams(max_tokens=1, logprobs=21))

    every = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=8, max_model_len=64, max_logprobs=-1))
    with pytest.raises(ValueError, match=f"more than the {TINY_VOCAB}"):
        every.add_request(prompt, SamplingParams(max_tokens=1, logprobs=TINY_VOCAB + 1))
    every.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, logprobs=TINY_VOCAB))
    while every.has_unfinished_requests():
        for out in every.step():
            final = out
    (entry,) = final.outputs[0].logprobs
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
    ids = list(entry.top)
    assert sorted(ids) == list(range(TINY_VOCAB)) and ids[0] == int(want.argmax())
    assert entry.rank in _vocabulary_ranks(want, entry.logprob) and entry.rank <= 2  # greedy: the best
    torch.testing.assert_close(torch.tensor(list(entry.top.values())), want[ids], atol=1e-4, rtol=0)
