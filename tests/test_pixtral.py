"""Pixtral's encoder: a tiny random Mistral3ForConditionalGeneration (Mistral-Small-3.1 / 3.2's build) and a
LLaVA with a Pixtral tower (pixtral-12b's), with their processors, against transformers in fp32 on CPU:
images of different sizes at their own resolution (0, 1 and 2 a prompt), chunked prefill through an image,
the prefix cache, the server's image_url parts, and bad input."""

from __future__ import annotations

import pytest
import torch
from conftest import server_image_chat

from plait import LLM, SamplingParams
from tests.test_multimodal import _data_url, _hf_greedy, _image, _image_prompts, _request, _saved

WORDS = [f"w{i}" for i in range(200)]
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]
TEXT_DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, bos_token_id=1, eos_token_id=2,
                 max_position_embeddings=512, sliding_window=None, tie_word_embeddings=False)
PATCH = 8
# Mistral 3: 2x2 patches a placeholder, images fit in 64 x 64 (at most 4 rows of 4); LLaVA: a patch each, 32
LONGEST_EDGE = {"mistral3": 64, "llava": 32}
MERGE = {"mistral3": 2, "llava": 1}
# Mistral-Small's chat template, cut to what the tests send: an image part is [IMG].
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}[INST]"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}[IMG]"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}[/INST]"
    "{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
# (prompt, its images' (height, width)): sizes that are not multiples of the patch, wider than the longest
# edge (scaled down), and of different shapes
PROMPTS = [
    ("<s> [INST] [IMG] w3 w17 w5 [/INST]", [(45, 61)]),
    ("<s> [INST] w8 [IMG] w9 w90 [IMG] w91 w92 [/INST]", [(90, 130), (30, 70)]),
    ("<s> [INST] w100 w101 w102 [/INST]", []),
]


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", additional_special_tokens=SPECIALS[4:])


class HfPixtral:
    """transformers' PixtralProcessor, which needs torchvision (not installed here): its image processor
    called with patch x merge as the patch, and each [IMG] of the text replaced by the image's rows of [IMG]
    (one a merged patch), each row ended by [IMG_BREAK], the last by [IMG_END] (its replace_image_token)."""

    def __init__(self, image_processor, tokenizer, merge: int) -> None:
        self.image_processor, self.tokenizer = image_processor, tokenizer
        self.unit = PATCH * merge

    def __call__(self, text: str, images: list | None = None, return_tensors: str = "pt") -> dict:
        out = {}
        if images:
            out = dict(self.image_processor(images=images, return_tensors="pt",
                                            patch_size={"height": self.unit, "width": self.unit}))
            pieces = text.split("[IMG]")
            assert len(pieces) == len(images) + 1
            text = pieces[0]
            for (height, width), piece in zip(out["image_sizes"].tolist(), pieces[1:]):
                rows = [["[IMG]"] * (width // self.unit) + ["[IMG_BREAK]"]] * (height // self.unit)
                flat = [tok for row in rows for tok in row]
                flat[-1] = "[IMG_END]"
                text += "".join(flat) + piece
        input_ids = torch.tensor([self.tokenizer(text)["input_ids"]])
        out.update(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
        return out

    def apply_chat_template(self, messages: list, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False)


def _pixtral_model(tmp_path_factory, family: str):
    """A random checkpoint saved as transformers saves it, with its image processor, tokenizer and chat
    template (and the processor_config.json the Hub's have)."""
    import json

    from transformers import (
        LlavaConfig,
        LlavaForConditionalGeneration,
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        MistralConfig,
        PixtralVisionConfig,
    )
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    tokenizer = _tokenizer()
    image_token = tokenizer.convert_tokens_to_ids("[IMG]")
    vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, image_size=LONGEST_EDGE[family], patch_size=PATCH,
                                 rope_parameters={"rope_type": "axial", "rope_theta": 1000.0})
    text = MistralConfig(**TEXT_DIMS)
    if family == "mistral3":
        cfg = Mistral3Config(text_config=text, vision_config=vision, image_token_index=image_token,
                             spatial_merge_size=MERGE[family], tie_word_embeddings=False)
        folder, model = _saved(Mistral3ForConditionalGeneration, cfg, 3, "tiny-mistral3", tmp_path_factory)
    else:  # pixtral-12b's: the last layer's features, every patch, LLaVA's projector with biases
        cfg = LlavaConfig(text_config=text, vision_config=vision, image_token_index=image_token,
                          vision_feature_layer=-1, vision_feature_select_strategy="full",
                          projector_hidden_act="gelu", tie_word_embeddings=False)
        folder, model = _saved(LlavaForConditionalGeneration, cfg, 5, "tiny-pixtral-llava", tmp_path_factory)
    image_processor = PixtralImageProcessorPil(size={"longest_edge": LONGEST_EDGE[family]},
                                               patch_size={"height": PATCH, "width": PATCH})
    image_processor.save_pretrained(folder)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    (folder / "processor_config.json").write_text(json.dumps({
        "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]", "image_token": "[IMG]",
        "patch_size": PATCH, "processor_class": "PixtralProcessor", "spatial_merge_size": MERGE[family]}))
    return folder, model, HfPixtral(image_processor, tokenizer, MERGE[family])


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory):
    return _pixtral_model(tmp_path_factory, "mistral3")


@pytest.fixture(scope="module")
def pixtral_llava(tmp_path_factory):
    return _pixtral_model(tmp_path_factory, "llava")


def _prompts(seed: int = 0) -> list[tuple[str, list]]:
    return _image_prompts(PROMPTS, seed)


@pytest.mark.parametrize("budget", [512, 7])
@pytest.mark.parametrize("family", ["mistral3", "pixtral_llava"])
def test_greedy_matches_transformers(request, family, budget):
    """Each prompt's ids are the processor's ([IMG] rows, [IMG_BREAK], [IMG_END]) and its greedy tokens
    transformers': images of different sizes, 0, 1 and 2 a prompt, batched together; at a budget of 7
    tokens a step every image is split across chunks. A prompt already expanded (the processor's ids) runs as
    it is."""
    folder, hf, processor = request.getfixturevalue(family)
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=budget, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = _prompts()
    want = [_hf_greedy(hf, processor, text, images, 8) for text, images in prompts]
    assert len({len(ids) for ids, _ in want}) == len(want)
    requests = [_request(text, images) for text, images in prompts]
    expanded = {"prompt_token_ids": want[1][0], "multi_modal_data": {"image": prompts[1][1]}}
    outs = llm.generate(requests + [expanded], params, use_tqdm=False)
    for out, (ids, tokens) in zip(outs, want + [want[1]]):
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == tokens
    assert llm.engine.runner.image_embeddings.num_cached == 0


@pytest.mark.parametrize("family", ["mistral3", "pixtral_llava"])
def test_image_embeddings_are_transformers(request, family):
    """Two images of different sizes through the encoder and projector at once: transformers' image features
    (each image's own grid of patches, 2D rotary, attention within its own image), one row for each [IMG]
    token of its span (the break and end tokens keep their own embeddings). The same images alone in a call:
    the same embeddings (no image sees another)."""
    folder, hf, processor = request.getfixturevalue(family)
    images = _prompts()[1][1]
    inputs = processor(text=PROMPTS[1][0], images=images)
    with torch.no_grad():
        want = hf.model.get_image_features(inputs["pixel_values"], image_sizes=inputs["image_sizes"],
                                           vision_feature_layer=-1).pooler_output
    llm = LLM(str(folder), dtype="float32", device="cpu")  # the encoder called directly, on host pixels
    model, image_token = llm.engine.runner.model, model_image_token(llm)
    pixels = llm.engine.images.preprocess(images)
    spans = llm.engine.images.image_spans(images)
    with torch.no_grad():
        together = model.embed_image_list([p.tensor for p in pixels], [None, None])
        alone = [model.embed_image_list([p.tensor], [None])[0] for p in pixels]
    for got, single, span, features in zip(together, alone, spans, want):
        assert got.shape[0] == span.count(image_token) == features.shape[0]  # one row an [IMG] token
        torch.testing.assert_close(got, features, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(single, got, rtol=1e-5, atol=1e-5)


def model_image_token(llm) -> int:
    return llm.engine.runner.model.image_token_id


def test_images_change_the_answer_and_the_prefix_cache_tells_them_apart(mistral3):
    """The same text with different images of one size (the same placeholder ids): each answer is
    transformers' for its own image, and they differ; a cached block holding placeholders is served only to
    the same image there (the text before it to any)."""
    folder, hf, processor = mistral3
    words = " ".join(f"w{i}" for i in range(1, 15))
    text = f"<s> [INST] {words} [IMG] w3 w17 w5 [/INST]"
    images = [_image(seed, (60, 50)) for seed in (1, 2, 3)]
    want = [_hf_greedy(hf, processor, text, [image], 8)[1] for image in images]
    assert len({tuple(w) for w in want}) > 1, "the test images do not move this model's answer"
    llm = LLM(str(folder), dtype="float32", block_size=8, enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    a, b, c, again = (llm.generate([_request(text, [image])], params, use_tqdm=False)[0]
                      for image in images + images[:1])
    assert [o.outputs[0].token_ids for o in (a, b, c)] == want
    assert b.num_cached_tokens == 16  # the 16 text tokens' blocks before the image, and nothing after
    assert again.num_cached_tokens > 24 and again.outputs[0].token_ids == want[0]


def test_server_chat_with_image_url(mistral3):
    """/v1/chat/completions with the openai client against a real server: a data-URL image part gets the
    answer transformers gives the chat template's prompt, streamed or not; /tokenize counts the processor's
    ids."""
    folder, hf, processor = mistral3
    image = _image(8, (70, 50))
    content = [{"type": "image_url", "image_url": {"url": _data_url(image)}},
               {"type": "text", "text": "w3 w17 w5"}]
    parts = [{"type": "image"}, {"type": "text", "text": "w3 w17 w5"}]
    text = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)
    ids, want = _hf_greedy(hf, processor, text, [image], 6)
    assert server_image_chat(folder, content, ids).split() == processor.tokenizer.decode(want).split()


def test_bad_image_prompts_are_refused(mistral3):
    """As LLaVA's: image tokens that do not match the images, unreadable images, URLs to fetch; and a prompt
    whose expanded placeholders are broken, or an image too thin to keep a row once scaled down."""
    folder, hf, processor = mistral3
    llm = LLM(str(folder), dtype="float32")
    image = _image(1, (45, 61))
    ids = processor(text="[INST] [IMG] w1 [/INST]", images=[image])["input_ids"][0].tolist()
    assert ids[1:6] == [model_image_token(llm)] * 4 + [ids[5]]  # [INST], a row of 4 [IMG], [IMG_BREAK]
    broken = ids[:4] + ids[5:6] + ids[4:5] + ids[6:]  # the row's last [IMG] and its [IMG_BREAK] swapped
    cases = [
        ({"prompt": "[INST] w1 [/INST]", "multi_modal_data": {"image": image}}, "0 image token"),
        ({"prompt": "[INST] [IMG] [IMG] [/INST]", "multi_modal_data": {"image": image}}, "2 image"),
        ("[INST] [IMG] [/INST]", "1 image token"),
        ({"prompt": "[IMG]", "multi_modal_data": {"image": b"not an image"}}, "cannot read"),
        ({"prompt": "[IMG]", "multi_modal_data": {"image": "https://example.com/a.png"}}, "fetch"),
        ({"prompt": "[IMG]", "multi_modal_data": {"image": _image(2, (1, 400))}}, "too thin"),
        ({"prompt_token_ids": broken, "multi_modal_data": {"image": image}}, "must stand together"),
    ]
    for prompt, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    good = {"prompt_token_ids": ids, "multi_modal_data": {"image": image}}
    assert llm.generate([good], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_split_over_two_ranks_answers_as_transformers(mistral3):
    """Tensor parallelism (gloo): the Mistral decoder split in two, the Pixtral encoder and projector whole on
    each rank (their layers.N.attention / feed_forward are not the decoder's to slice) and run by the driver,
    which sends the other rank each step's image embeddings; images split across chunks give transformers'
    tokens."""
    folder, hf, processor = mistral3
    llm = LLM(str(folder), dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=7,
              enable_prefix_caching=False)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        prompts = _prompts(seed=4)
        outs = llm.generate([_request(text, images) for text, images in prompts], params, use_tqdm=False)
        for out, (text, images) in zip(outs, prompts):
            assert out.outputs[0].token_ids == _hf_greedy(hf, processor, text, images, 8)[1]
    finally:
        llm.engine.shutdown()


def test_lora_and_fp8_change_the_decoder_alone(mistral3, tmp_path):
    """LoRA on Mistral 3's decoder (an adapter named as transformers 5 names it, model.language_model.*): a
    prompt with images gets transformers' greedy tokens with the adapter merged into its weights, beside the
    same prompt without it. --quantization fp8 makes the decoder's projections FP8 and leaves the encoder and
    projector 16-bit, whose image embeddings are the 16-bit engine's to the bit."""
    import copy

    from test_qwen2_vl import _random_adapter

    from plait.layers.fp8 import Fp8Linear
    from plait.lora.request import LoRARequest

    folder, hf, processor = mistral3
    hidden, inter = TEXT_DIMS["hidden_size"], TEXT_DIMS["intermediate_size"]
    kv = TEXT_DIMS["num_key_value_heads"] * hidden // TEXT_DIMS["num_attention_heads"]
    projections = {"q_proj": (hidden, hidden), "v_proj": (hidden, kv), "o_proj": (hidden, hidden),
                   "down_proj": (inter, hidden)}
    pairs = _random_adapter(tmp_path / "adapter", "model.language_model", 4, seed=3, projections=projections,
                            num_layers=TEXT_DIMS["num_hidden_layers"])
    merged = copy.deepcopy(hf)
    with torch.no_grad():
        state = merged.state_dict()
        for module, (a, b) in pairs.items():
            state[f"{module}.weight"] += 2.0 * (b @ a)
    llm = LLM(str(folder), dtype="float32", enable_lora=True, max_lora_rank=8, max_num_batched_tokens=7,
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    text, images = _prompts(seed=6)[1]
    prompt = _request(text, images)
    lora = LoRARequest("tiny-mistral3", 1, str(tmp_path / "adapter"))
    with_lora, without = llm.generate([prompt, prompt], params, use_tqdm=False, lora_request=[lora, None])
    assert with_lora.outputs[0].token_ids == _hf_greedy(merged, processor, text, images, 8)[1]
    assert without.outputs[0].token_ids == _hf_greedy(hf, processor, text, images, 8)[1]
    assert with_lora.outputs[0].token_ids != without.outputs[0].token_ids
    embeddings = []
    for quantization in (None, "fp8"):
        engine = LLM(str(folder), dtype="float32", quantization=quantization, enable_prefix_caching=False)
        model = engine.engine.runner.model
        pixels = engine.engine.images.preprocess(images)
        with torch.no_grad():
            embeddings.append(torch.cat(model.embed_image_list([p.tensor for p in pixels], [None, None])))
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, Fp8Linear)
    assert not any(isinstance(m, Fp8Linear) for side in (model.vision_tower, model.multi_modal_projector)
                   for m in side.modules())
    assert torch.equal(embeddings[0], embeddings[1])
    assert len(engine.generate(prompt, SamplingParams(max_tokens=3, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0].token_ids) == 3
