"""Qwen3-VL: a tiny random checkpoint with its processor (saved in the Hub's form), against transformers'
Qwen3VLForConditionalGeneration in fp32 on CPU: images of different sizes (0, 1 and 2 a prompt), chunks that
split an image (its DeepStack features staged a piece at a time with its embeddings), the prefix cache,
preemption, tensor parallelism, interleaved M-RoPE, and the server's image_url parts."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import server_image_chat
from safetensors.torch import load_file, save_file

from plait import LLM, SamplingParams
from tests.test_multimodal import _data_url, _image, _image_prompts, _saved
from tests.test_qwen2_vl import (
    QWEN_VL_TEMPLATE,
    SPAN,
    HfQwenVL,
    _hf_greedy,
    _request,
    _tokenizer,
    assert_triton_kernels_answer_as_hf,
)

# Tiny images stay tiny: 4 to 20 placeholders (32 x 32 pixels each: 16-pixel patches, merged 2 x 2).
MIN_PIXELS, MAX_PIXELS = 4 * 32 * 32, 20 * 32 * 32
# head_dim 16: 8 frequencies, interleaved t h w t h w t t (mrope_section [4, 2, 2]).
TEXT_DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
                 vocab_size=256, bos_token_id=1, eos_token_id=3,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                                  "mrope_interleaved": True})
# A 4 x 4 table of learned positions (resampled to every grid), DeepStack from the first two of three blocks
# into the first two of three decoder layers.
VISION_DIMS = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                   num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
SEED = 3
# (prompt, its images' sizes (height, width)): images of different sizes
PROMPTS = [
    (f"<|im_start|>user {SPAN} w3 w17 w5 <|im_end|> <|im_start|>assistant", [(40, 48)]),
    (f"<|im_start|>user w8 {SPAN} w9 w90 {SPAN} w91 w92 <|im_end|> <|im_start|>assistant",
     [(100, 140), (70, 40)]),
    ("<|im_start|>user w100 w101 w102 <|im_end|> <|im_start|>assistant", []),
]


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory):
    """(folder, transformers' model, its processor): the folder as a Hub checkpoint is, its
    preprocessor_config.json naming Qwen2VLImageProcessorFast (which transformers serves with its PIL
    processor where torchvision is missing, as here)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    cfg = Qwen3VLConfig(text_config=TEXT_DIMS, vision_config=VISION_DIMS, **_vision_token_ids(_tokenizer()))
    return _qwen3_vl_folder(tmp_path_factory, "tiny-qwen3-vl", Qwen3VLForConditionalGeneration, cfg)


def _vision_token_ids(tokenizer) -> dict[str, int]:
    return {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in [
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")]}


def _qwen3_vl_folder(tmp_path_factory, name: str, model_class: type, cfg):
    """(folder, a random transformers ``model_class`` of ``cfg`` saved there, its processor)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = _tokenizer()
    folder, model = _saved(model_class, cfg, SEED, name, tmp_path_factory)
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})
    image_processor.save_pretrained(folder)
    path = folder / "preprocessor_config.json"
    saved = json.loads(path.read_text())
    path.write_text(json.dumps(saved | {"image_processor_type": "Qwen2VLImageProcessorFast",
                                        "processor_class": "Qwen3VLProcessor"}))
    tokenizer.chat_template = QWEN_VL_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder, model, HfQwenVL(image_processor, tokenizer)


@pytest.fixture(scope="module")
def qwen3_vl_moe(tmp_path_factory):
    """(folder, transformers' model, its processor): a Qwen3-VL-MoE of 4 experts (2 a token, 48 wide: its
    stacked experts saved [experts, in, out] as the Hub's are), the last decoder layer a dense MLP."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    text = dict(TEXT_DIMS, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                mlp_only_layers=[2])
    cfg = Qwen3VLMoeConfig(text_config=text, vision_config=VISION_DIMS, **_vision_token_ids(_tokenizer()))
    folder, model, processor = _qwen3_vl_folder(tmp_path_factory, "tiny-qwen3-vl-moe",
                                                Qwen3VLMoeForConditionalGeneration, cfg)
    # transformers 5 saves its own [experts, out, in]; the Hub's checkpoints hold [experts, in, out]
    path = folder / "model.safetensors"
    tensors = load_file(path)
    stacked = [name for name in tensors if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert tensors[stacked[0]].shape[1:] in ((96, 64), (64, 48))
    save_file(tensors | {name: tensors[name].transpose(1, 2).contiguous() for name in stacked}, path,
              metadata={"format": "pt"})
    return folder, model, processor


def _prompts(seed: int = 0) -> list[tuple[str, list]]:
    return _image_prompts(PROMPTS, seed)


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_moe_greedy_matches_transformers(qwen3_vl_moe):
    """Qwen3-VL-MoE: its experts loaded from the Hub's [experts, in, out] stacks, routed as transformers'
    (top-k renormalised); images split across chunks get transformers' greedy tokens."""
    folder, hf, processor = qwen3_vl_moe
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=7, enable_prefix_caching=False)
    prompts = _prompts()
    outs = llm.generate([_request(text, images) for text, images in prompts], GREEDY, use_tqdm=False)
    for out, (text, images) in zip(outs, prompts):
        ids, want = _hf_greedy(hf, processor, text, images, 8)
        assert out.prompt_token_ids == ids and out.outputs[0].token_ids == want


@pytest.mark.parametrize("budget", [512, 7])
def test_greedy_matches_transformers(qwen3_vl, budget):
    """Each prompt's ids are the processor's and its greedy tokens transformers': images of different sizes,
    0, 1 and 2 a prompt, batched together; at 7 tokens a step the images (6, 12 and 6 placeholders) are split
    across chunks, beside other requests' tokens, so each chunk's DeepStack rows must land on that chunk's
    placeholders."""
    folder, hf, processor = qwen3_vl
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=budget, enable_prefix_caching=False)
    prompts = _prompts()
    want = [_hf_greedy(hf, processor, text, images, 8) for text, images in prompts]
    outs = llm.generate([_request(text, images) for text, images in prompts], GREEDY, use_tqdm=False)
    for out, (ids, tokens) in zip(outs, want):
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == tokens
    runner = llm.engine.runner
    assert runner.image_embeddings.num_cached == 0
    # the staged rows carry the embedding and both DeepStack levels
    assert runner.image_embeddings.values.shape[1] == 3 * TEXT_DIMS["hidden_size"]


def test_skipping_deepstack_changes_the_answers(qwen3_vl):
    """DeepStack matters to these prompts: with the DeepStack mergers' outputs zeroed (the decoder adds
    nothing, as if it skipped them) the image prompts' answers leave transformers', so the test above fails
    where DeepStack is skipped or added at the wrong rows; the text prompt's stays."""
    folder, hf, processor = qwen3_vl
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=7, enable_prefix_caching=False)
    with torch.no_grad():
        for merger in llm.engine.runner.model.visual.deepstack_merger_list:
            merger.linear_fc2.weight.zero_()
            merger.linear_fc2.bias.zero_()
    prompts = _prompts()
    outs = llm.generate([_request(text, images) for text, images in prompts], GREEDY, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    want = [_hf_greedy(hf, processor, text, images, 8)[1] for text, images in prompts]
    assert got[0] != want[0] and got[1] != want[1]
    assert got[2] == want[2]


def test_hub_config_and_triton_kernels_match_transformers(qwen3_vl, tmp_path, monkeypatch):
    """The Hub's Qwen3-VL config form (transformers 4.57's: text_config's rope_scaling {"mrope_interleaved":
    true, "mrope_section": ...} and rope_theta) served through the Triton backend (its interpreter on CPU:
    the fused q/k norm + rotary + KV store on interleaved M-RoPE's per-step table, the fused add + RMSNorm
    beside DeepStack's adds) gives transformers' greedy tokens, images split across chunks."""
    import shutil


    folder, hf, processor = qwen3_vl
    copy = tmp_path / "hub-config"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    rope = config["text_config"].pop("rope_parameters")
    config["text_config"].update(rope_theta=rope.pop("rope_theta"), rope_scaling=rope)
    assert config["text_config"]["rope_scaling"]["mrope_interleaved"]
    (copy / "config.json").write_text(json.dumps(config))
    assert_triton_kernels_answer_as_hf(copy, hf, processor, monkeypatch)


def test_lora_adapter_changes_the_decoder_as_transformers_merged(qwen3_vl, tmp_path):
    """An adapter on every projection of the decoder (transformers 5's names), beside base rows, images split
    across chunks: transformers' tokens with the adapter merged into its weights (W + 2 B A), base rows its
    own."""
    import copy

    from plait.lora.request import LoRARequest
    from tests.test_qwen2_vl import _random_adapter

    folder, hf, processor = qwen3_vl
    hidden, inter, head_dim = TEXT_DIMS["hidden_size"], TEXT_DIMS["intermediate_size"], TEXT_DIMS["head_dim"]
    q, kv = TEXT_DIMS["num_attention_heads"] * head_dim, TEXT_DIMS["num_key_value_heads"] * head_dim
    projections = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
                   "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
                   "down_proj": (inter, hidden)}
    pairs = _random_adapter(tmp_path / "adapter", "model.language_model", 4, seed=9, projections=projections,
                            num_layers=TEXT_DIMS["num_hidden_layers"])
    merged = copy.deepcopy(hf)
    with torch.no_grad():
        state = merged.state_dict()
        for module, (a, b) in pairs.items():
            state[f"{module}.weight"] += 2.0 * (b @ a)  # lora_alpha / r = 2
    lora = LoRARequest("tiny-qwen3-vl", 1, str(tmp_path / "adapter"))
    llm = LLM(str(folder), dtype="float32", enable_lora=True, max_lora_rank=8, max_num_batched_tokens=7,
              enable_prefix_caching=False)
    prompts = _prompts()
    requests = [_request(text, images) for text, images in prompts]
    outs = llm.generate(requests * 2, GREEDY, lora_request=[lora] * len(requests) + [None] * len(requests),
                        use_tqdm=False)
    for (text, images), with_lora, without in zip(prompts, outs[:len(requests)], outs[len(requests):]):
        assert with_lora.outputs[0].token_ids == _hf_greedy(merged, processor, text, images, 8)[1]
        assert without.outputs[0].token_ids == _hf_greedy(hf, processor, text, images, 8)[1]
        assert with_lora.outputs[0].token_ids != without.outputs[0].token_ids


def test_image_embeddings_and_deepstack_features_are_transformers(qwen3_vl):
    """Two images of different sizes through the encoder at once (learned positions resampled to each
    grid): each placeholder's row is transformers' merged embedding, then its DeepStack features."""
    folder, hf, processor = qwen3_vl
    images = _prompts()[1][1]
    inputs = processor(text=PROMPTS[1][0], images=images)
    with torch.no_grad():
        want = hf.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
    llm = LLM(str(folder), dtype="float32", device="cpu")  # the encoder called directly, on host pixels
    pixels = llm.engine.images.preprocess(images)
    assert [p.grid for p in pixels] == [tuple(g) for g in inputs["image_grid_thw"].tolist()]
    with torch.no_grad():
        got = llm.engine.runner.model.embed_image_list([p.tensor for p in pixels], [p.grid for p in pixels])
    hidden = TEXT_DIMS["hidden_size"]
    got = torch.cat(got).split(hidden, dim=-1)
    torch.testing.assert_close(got[0], want.pooler_output, rtol=1e-4, atol=1e-4)
    assert len(got) == 1 + len(want.deepstack_features) == 3
    for mine, theirs in zip(got[1:], want.deepstack_features):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


def test_interleaved_mrope_is_transformers():
    """MRopeRotary on interleaved_mrope_columns rotates q and k as transformers' Qwen3-VL text rotary does,
    at three different positions a token: the tiny test's bands and Qwen3-VL-8B's [24, 20, 20] of 64."""
    from transformers import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import (
        Qwen3VLTextRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    from plait.layers.rotary import MRopeRotary, RotaryEmbedding, interleaved_mrope_columns

    for section, head_dim in (([4, 2, 2], 16), ([24, 20, 20], 128), ([2, 3, 3], 16)):
        cfg = Qwen3VLTextConfig(hidden_size=64, num_attention_heads=4, head_dim=head_dim, rope_parameters={
            "rope_type": "default", "rope_theta": 5e6, "mrope_section": section, "mrope_interleaved": True})
        positions = torch.randint(0, 100, (3, 9))
        q, k = torch.randn(9, 4, head_dim), torch.randn(9, 2, head_dim)
        cos, sin = Qwen3VLTextRotaryEmbedding(cfg)(q, positions[:, None])  # each [1, T, head_dim]
        want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        rotary = MRopeRotary(RotaryEmbedding(head_dim, 128, 5e6).cos_sin, positions,
                             interleaved_mrope_columns(section, head_dim))
        got_q, got_k = rotary(rotary.token_positions, q, k)
        torch.testing.assert_close(got_q, want_q[0].transpose(0, 1))
        torch.testing.assert_close(got_k, want_k[0].transpose(0, 1))


def test_mrope_positions_are_transformers(qwen3_vl):
    """The prompt's (t, h, w) positions and the decode delta are Qwen3-VL's get_rope_index's."""
    folder, hf, processor = qwen3_vl
    text, images = _prompts()[1]
    inputs = processor(text=text, images=images, return_tensors="pt")
    want, delta = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                          image_grid_thw=inputs["image_grid_thw"])
    llm = LLM(str(folder), dtype="float32")
    got, got_delta = llm.engine.runner.model.mrope_positions(*llm.engine.images.expand(
        inputs["input_ids"][0].tolist(), images))
    np.testing.assert_array_equal(got, want[:, 0].numpy())
    assert got_delta == int(delta)


def test_prefix_cache_and_preemption(qwen3_vl):
    """The same image again hits the cache past its placeholders and answers alike; another image of the
    same size hits only the text before it. Then a KV cache too small for every request preempts some: each
    embeds its image (and DeepStack features) again and answers as transformers does."""
    folder, hf, processor = qwen3_vl
    words = " ".join(f"w{i}" for i in range(1, 17))
    text = f"<|im_start|>user {words} w18 w19 {SPAN} w3 w17 w5 <|im_end|> <|im_start|>assistant"
    first, second = _image(1, (90, 130)), _image(2, (90, 130))
    llm = LLM(str(folder), dtype="float32", block_size=8, enable_prefix_caching=True)
    a, b, again = (llm.generate([_request(text, [image])], GREEDY, use_tqdm=False)[0]
                   for image in (first, second, first))
    assert a.outputs[0].token_ids == _hf_greedy(hf, processor, text, [first], 8)[1]
    assert b.outputs[0].token_ids == _hf_greedy(hf, processor, text, [second], 8)[1]
    assert b.num_cached_tokens == 16  # the 16 text tokens' blocks before the image, and nothing after
    # every full block but the prompt's last (its placeholders are tokens 21 to 32)
    assert again.num_cached_tokens == 32 and again.outputs[0].token_ids == a.outputs[0].token_ids

    text = PROMPTS[0][0]
    images = [_image(seed, (60 + 10 * seed, 50)) for seed in range(4)]
    want = [_hf_greedy(hf, processor, text, [image], 16)[1] for image in images]
    llm = LLM(str(folder), dtype="float32", block_size=8, num_kv_blocks=9, max_num_batched_tokens=16,
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([_request(text, [image]) for image in images], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe"])
def test_split_over_two_ranks_answers_as_one_device(request, family):
    """Tensor parallelism: the decoder split in two (gloo; the MoE's experts by width), the vision side run by
    the driver alone, which sends each step's placeholder rows (embeddings and DeepStack features) and M-RoPE
    positions; prompts with images, split across chunks, get transformers' tokens."""
    folder, hf, processor = request.getfixturevalue(family)
    llm = LLM(str(folder), dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=7,
              enable_prefix_caching=False)
    try:
        prompts = _prompts()
        outs = llm.generate([_request(text, images) for text, images in prompts], GREEDY, use_tqdm=False)
        for out, (text, images) in zip(outs, prompts):
            assert out.outputs[0].token_ids == _hf_greedy(hf, processor, text, images, 8)[1]
    finally:
        llm.engine.shutdown()


def test_server_chat_with_image_url(qwen3_vl):
    """/v1/chat/completions with the openai client against a real server: a data-URL image part gets the
    answer transformers gives the chat template's prompt, streamed or not; /tokenize counts the same ids."""
    folder, hf, processor = qwen3_vl
    image = _image(8, (70, 50))
    content = [{"type": "image_url", "image_url": {"url": _data_url(image)}},
               {"type": "text", "text": "w3 w17 w5"}]
    parts = [{"type": "image"}, {"type": "text", "text": "w3 w17 w5"}]
    text = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)
    ids, want = _hf_greedy(hf, processor, text, [image], 6)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    offline = LLM(str(folder), dtype="float32").chat([{"role": "user", "content": content}], params,
                                                      use_tqdm=False)[0]
    assert offline.prompt_token_ids == ids and offline.outputs[0].token_ids == want
    assert server_image_chat(folder, content, ids) == offline.outputs[0].text


def test_videos_are_refused_by_name(qwen3_vl):
    folder, _, _ = qwen3_vl
    llm = LLM(str(folder), dtype="float32")
    with pytest.raises(ValueError, match="video inputs are not supported"):
        llm.generate([{"prompt": "w1", "multi_modal_data": {"video": [_image(0)]}}], use_tqdm=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_graphs_match_cpu_fp32(qwen3_vl, dtype):
    """On the GPU path (Triton attention with the fused q/k norm + rotary + KV store on interleaved M-RoPE's
    table, CUDA graphs reading the wide image rows, DeepStack's adds in the captured steps, images split
    across chunks beside decodes) against the CPU fp32 engine, as tests/test_qwen2_vl.py's Qwen2.5-VL check:
    fp32 equal, bf16 forking only at near-ties; decode and image steps replay graphs. (Written without a GPU
    to run it on.)"""
    from tests.test_qwen2_vl import BF16_NEAR_TIE, FORK_LOGPROBS, _fork_gap

    folder, _, _ = qwen3_vl
    prompts = [_request(text, images) for text, images in _prompts(seed=3)] * 2
    cpu = LLM(str(folder), dtype="float32", device="cpu", enable_prefix_caching=False)
    reference = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=FORK_LOGPROBS)
    want = [o.outputs[0] for o in cpu.generate(prompts, reference, use_tqdm=False)]
    llm = LLM(str(folder), dtype=dtype, max_num_batched_tokens=12, enable_prefix_caching=False,
              usage="serve")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    forked = [gap for gap in (_fork_gap(g, w) for g, w in zip(got, want)) if gap is not None]
    if dtype == "float32":
        assert not forked
    else:
        assert all(gap <= BF16_NEAR_TIE for gap in forked), forked
    b = llm.engine.runner.breakdown
    assert b.single_token_steps > 0 and b.graph_single_token_steps == b.single_token_steps
    assert b.image_steps > 0 and b.graph_image_steps == b.image_steps


# Qwen3-VL-2B-Instruct's config.json as the Hub has it (transformers 4.57's form), cut to 3 decoder layers
# (as many as its DeepStack levels).
HUB_CONFIG = {
    "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl", "image_token_id": 151655,
    "video_token_id": 151656, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "tie_word_embeddings": True,
    "text_config": {"model_type": "qwen3_vl_text", "hidden_size": 2048, "intermediate_size": 6144,
                    "num_hidden_layers": 3, "num_attention_heads": 16, "num_key_value_heads": 8,
                    "head_dim": 128,
                    "vocab_size": 151936, "max_position_embeddings": 262144, "rope_theta": 5000000,
                    "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20],
                                     "rope_type": "default"}, "tie_word_embeddings": True},
    "vision_config": {"model_type": "qwen3_vl", "depth": 24, "hidden_size": 1024, "intermediate_size": 4096,
                      "num_heads": 16, "out_hidden_size": 2048, "num_position_embeddings": 2304,
                      "deepstack_visual_indexes": [5, 11, 17], "patch_size": 16, "spatial_merge_size": 2,
                      "temporal_patch_size": 2, "hidden_act": "gelu_pytorch_tanh", "in_channels": 3},
}


@pytest.mark.parametrize("moe", [False, True])
def test_hub_sized_configs_take_transformers_tensors(moe):
    """Qwen3-VL-2B's Hub config (and a Qwen3-VL-30B-A3B-shaped MoE one: 128 experts, 8 a token), built on the
    meta device: every tensor transformers' model holds (the MoE's stacked experts as the Hub's [experts, in,
    out]) loads by name and shape, the tied lm_head left out; DeepStack's three levels widen the rows 4x."""
    import copy

    import transformers

    from plait.config import ModelConfig
    from plait.models.base import checkpoint_layout
    from plait.models.registry import get_model_class

    raw = copy.deepcopy(HUB_CONFIG)
    if moe:
        raw.update(architectures=["Qwen3VLMoeForConditionalGeneration"], model_type="qwen3_vl_moe",
                   tie_word_embeddings=False)
        raw["text_config"].update(model_type="qwen3_vl_moe_text", tie_word_embeddings=False,
                                  moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8)
        raw["vision_config"].update(model_type="qwen3_vl_moe", depth=27, hidden_size=1152,
                                    intermediate_size=4304, deepstack_visual_indexes=[8, 16, 24])
    hf_config = (transformers.Qwen3VLMoeConfig if moe else transformers.Qwen3VLConfig)(
        **{k: v for k, v in raw.items() if k != "architectures"})
    cfg = ModelConfig.from_hf(raw)
    assert cfg.qk_norm and cfg.rope_theta == 5e6 and cfg.rope_scaling is None
    assert (cfg.moe is not None and cfg.moe.renormalize) if moe else cfg.moe is None
    with torch.device("meta"):
        hf = getattr(transformers, raw["architectures"][0])(hf_config)
        model = get_model_class(cfg.architecture)(cfg, 4096)
    assert model.image_embed_width == 4 * 2048
    stacked = ("experts.gate_up_proj", "experts.down_proj")
    tensors = {name: t.transpose(1, 2) if name.endswith(stacked) else t for name, t in hf.state_dict().items()
               if not (cfg.tie_word_embeddings and name == "lm_head.weight")}
    # every parameter covered by a tensor of its shape, every tensor placed, or it raises
    model.load_weights(checkpoint_layout(model, iter(tensors.items())))
