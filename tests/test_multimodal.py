"""Images in prompts (LLaVA): a tiny random LlavaForConditionalGeneration with its processor, against
transformers in fp32 on CPU; chunked, batched, prefix-cached and preempted image prompts; chat and the
server's image_url parts."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch

from plait import LLM, SamplingParams
from plait.multimodal.images import MultiModalPrompt

WORDS = [f"w{i}" for i in range(200)]
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]
IMAGE_SIZE, PATCH = 32, 8
# The tiny decoders' and vision towers' sizes, whatever their family.
TEXT_DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, bos_token_id=1, eos_token_id=2)
VISION_DIMS = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                   image_size=IMAGE_SIZE, patch_size=PATCH)
# LLaVA-1.5's chat template (llava-hf): every image of a message first, then its text.
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}"
    "{% endif %}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS + ["USER:", "ASSISTANT:"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", additional_special_tokens=["<image>"])


def _saved(model_class, cfg, seed: int, name: str, tmp_path_factory):
    """A random transformers model of ``cfg`` saved under a fresh folder: (folder, the model in eval mode)."""
    torch.manual_seed(seed)
    model = model_class(cfg)
    with torch.no_grad():  # clear argmax winners, as the other tiny models (tests/conftest.py)
        for param_name, p in model.named_parameters():
            if "norm" not in param_name:
                p.mul_(4.0)
    folder = tmp_path_factory.mktemp(name)
    model.save_pretrained(folder)
    return folder, model.eval()


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    """A random LLaVA (CLIP tower of 3 layers, features from the last but one, a Llama decoder) saved with
    its processor (CLIP image processor, tokenizer, chat template), as llava-hf checkpoints are."""
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tokenizer = _tokenizer()
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    cfg = LlavaConfig(
        text_config=LlamaConfig(**TEXT_DIMS, max_position_embeddings=512, tie_word_embeddings=False),
        vision_config=CLIPVisionConfig(**VISION_DIMS),
        image_token_index=image_token, vision_feature_layer=-2, projector_hidden_act="gelu",
    )
    folder, model = _saved(LlavaForConditionalGeneration, cfg, 7, "tiny-llava", tmp_path_factory)
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                           crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}),
        tokenizer=tokenizer, patch_size=PATCH, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, chat_template=LLAVA_TEMPLATE)
    processor.save_pretrained(folder)
    return folder, model, processor


@pytest.fixture(scope="module")
def llava_next(tmp_path_factory):
    """A random LLaVA-NeXT (tiles of a 2x2 grid at most, image_newline) with a Mistral decoder, saved with its
    processor, as llava-hf's v1.6 checkpoints are."""
    from transformers import (
        CLIPVisionConfig,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessor,
        LlavaNextProcessor,
        MistralConfig,
    )

    tokenizer = _tokenizer()
    pinpoints = [[IMAGE_SIZE, 2 * IMAGE_SIZE], [2 * IMAGE_SIZE, IMAGE_SIZE], [2 * IMAGE_SIZE, 2 * IMAGE_SIZE]]
    cfg = LlavaNextConfig(
        text_config=MistralConfig(**TEXT_DIMS, max_position_embeddings=1024, sliding_window=None,
                                  tie_word_embeddings=False),
        vision_config=CLIPVisionConfig(**VISION_DIMS),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_layer=-2,
        image_grid_pinpoints=pinpoints,
    )
    folder, model = _saved(LlavaNextForConditionalGeneration, cfg, 11, "tiny-llava-next", tmp_path_factory)
    image_processor = LlavaNextImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                              crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                                              image_grid_pinpoints=pinpoints)
    processor = LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH,
                                   vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                   chat_template=LLAVA_TEMPLATE)
    processor.save_pretrained(folder)
    return folder, model, processor


@pytest.fixture(scope="module")
def llava_siglip(tmp_path_factory):
    """A random LLaVA built like LLaVA-Interleave: a SigLIP tower (no class token, every patch kept, the last
    layer read) and a Qwen2 decoder (q/k/v biases)."""
    from transformers import (
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        Qwen2Config,
        SiglipImageProcessor,
        SiglipVisionConfig,
    )

    tokenizer = _tokenizer()
    cfg = LlavaConfig(
        text_config=Qwen2Config(**TEXT_DIMS, max_position_embeddings=512, tie_word_embeddings=True),
        vision_config=SiglipVisionConfig(**VISION_DIMS),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_layer=-1,
        vision_feature_select_strategy="full", projector_hidden_act="gelu",
    )
    folder, model = _saved(LlavaForConditionalGeneration, cfg, 13, "tiny-llava-siglip", tmp_path_factory)
    square = SiglipImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = LlavaProcessor(image_processor=square, tokenizer=tokenizer, patch_size=PATCH,
                               vision_feature_select_strategy="full", num_additional_image_tokens=0,
                               chat_template=LLAVA_TEMPLATE)
    processor.save_pretrained(folder)
    return folder, model, processor


def _image(seed: int, size: tuple[int, int] = (40, 48)):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def _data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _request(text: str, images: list) -> dict | str:
    """A prompt with its images (vLLM's multi_modal_data), or the text alone."""
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


def _image_prompts(prompts: list[tuple[str, list]], seed: int = 0) -> list[tuple[str, list]]:
    """(text, images) for each (text, image sizes) of ``prompts``: random images, seeded by their places."""
    return [(text, [_image(seed + 10 * k + j, size) for j, size in enumerate(sizes)])
            for k, (text, sizes) in enumerate(prompts)]


def _hf_greedy(model, processor, text: str, images: list, max_tokens: int) -> tuple[list[int], list[int]]:
    """(the processor's prompt ids, transformers' greedy tokens)."""
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    ids = inputs["input_ids"][0].tolist()
    return ids, out[0, len(ids):].tolist()


PROMPTS = [
    ("USER: <image>\n w3 w17 w5 ASSISTANT:", 1),
    ("USER: w8 <image>\n w9 w90 w91 w92 w93 ASSISTANT:", 1),
    ("USER: <image>\n w4 <image>\n w6 ASSISTANT:", 2),
    ("USER: w100 w101 w102 ASSISTANT:", 0),
]


@pytest.mark.parametrize("budget", [512, 12])
@pytest.mark.parametrize("family", ["llava", "llava_siglip"])
def test_greedy_matches_transformers(request, family, budget):
    """Each prompt's ids are the processor's and its greedy tokens transformers' (LLaVA-1.5: CLIP and Llama;
    LLaVA-Interleave's build: SigLIP and Qwen2); at a budget of 12 tokens a step, every image is split across
    chunks, and prompts with and without images share steps."""
    folder, hf, processor = request.getfixturevalue(family)
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=budget, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts, want = [], []
    for k, (text, num_images) in enumerate(PROMPTS):
        images = [_image(10 * k + j) for j in range(num_images)]
        ids, tokens = _hf_greedy(hf, processor, text, images, 8)
        prompts.append(_request(text, images))
        want.append((ids, tokens))
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, (ids, tokens) in zip(outs, want):
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == tokens
    assert llm.engine.runner.image_embeddings.num_cached == 0  # each image dropped after its last placeholder


@pytest.mark.parametrize("family", ["llava", "llava_next"])
def test_split_over_two_ranks_answers_as_transformers(request, family):
    """Tensor parallelism (gloo): the decoder split in two, the vision tower and projector whole on each rank
    (a CLIP tower's layers.N.self_attn are not the decoder's to slice) and run by the driver, which sends the
    other rank each step's image embeddings; images split across chunks give transformers' tokens."""
    folder, hf, processor = request.getfixturevalue(family)
    llm = LLM(str(folder), dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=12,
              enable_prefix_caching=False)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        for k, (text, num_images) in enumerate(PROMPTS):
            images = [_image(10 * k + j) for j in range(num_images)]
            prompt = _request(text, images)
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            assert out.outputs[0].token_ids == _hf_greedy(hf, processor, text, images, 8)[1]
    finally:
        llm.engine.shutdown()


def test_images_change_the_answer_and_requests_keep_their_own(llava):
    """The same text with different images: different answers, each transformers' for its own image,
    whether the requests run together or alone (a request's image never leaks into its neighbour's)."""
    folder, hf, processor = llava
    text = PROMPTS[0][0]
    images = [_image(seed) for seed in (1, 2, 3)]
    want = [_hf_greedy(hf, processor, text, [image], 8)[1] for image in images]
    assert len({tuple(w) for w in want}) > 1, "the test images do not move this model's answer"
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=20, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    together = llm.generate([{"prompt": text, "multi_modal_data": {"image": im}} for im in images], params,
                            use_tqdm=False)
    assert [o.outputs[0].token_ids for o in together] == want


def test_prefix_cache_tells_images_apart(llava):
    """Placeholders are the same ids for every image: a cached block holding them is served only to a prompt
    with the same image there. The same image again hits the cache (text and image blocks alike)."""
    folder, hf, processor = llava
    text = "USER: w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15 w16 <image>\n w3 w17 w5 ASSISTANT:"
    first, second = _image(1), _image(2)
    llm = LLM(str(folder), dtype="float32", block_size=16, enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    a = llm.generate([{"prompt": text, "multi_modal_data": {"image": first}}], params, use_tqdm=False)[0]
    b = llm.generate([{"prompt": text, "multi_modal_data": {"image": second}}], params, use_tqdm=False)[0]
    again = llm.generate([{"prompt": text, "multi_modal_data": {"image": first}}], params, use_tqdm=False)[0]
    assert a.outputs[0].token_ids == _hf_greedy(hf, processor, text, [first], 8)[1]
    assert b.outputs[0].token_ids == _hf_greedy(hf, processor, text, [second], 8)[1]
    assert b.num_cached_tokens == 16  # the text block before the image, and nothing after it
    assert again.num_cached_tokens == 32 and again.outputs[0].token_ids == a.outputs[0].token_ids


def test_preempted_image_requests_embed_again(llava):
    """A KV cache too small for every request at once preempts some; each resumes, embeds its image again,
    and still answers as transformers does."""
    folder, hf, processor = llava
    text = PROMPTS[1][0]
    images = [_image(seed) for seed in range(4)]
    want = [_hf_greedy(hf, processor, text, [image], 24)[1] for image in images]
    llm = LLM(str(folder), dtype="float32", block_size=8, num_kv_blocks=17, max_num_batched_tokens=64,
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt": text, "multi_modal_data": {"image": im}} for im in images], params,
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0


def test_a_lora_adapter_on_llavas_decoder_is_transformers_merged(llava, tmp_path):
    """LoRA on LLaVA's Llama decoder, the adapter named as transformers 4's LLaVA names it
    (language_model.model.layers.*): prompts with images get transformers' greedy tokens with the adapter
    merged into its weights, and the same prompts without it transformers' own."""
    import copy

    from test_qwen2_vl import _random_adapter

    from plait.lora.request import LoRARequest

    folder, hf, processor = llava
    hidden, inter = TEXT_DIMS["hidden_size"], TEXT_DIMS["intermediate_size"]
    kv = TEXT_DIMS["num_key_value_heads"] * hidden // TEXT_DIMS["num_attention_heads"]
    projections = {"q_proj": (hidden, hidden), "v_proj": (hidden, kv), "o_proj": (hidden, hidden),
                   "down_proj": (inter, hidden)}
    pairs = _random_adapter(tmp_path / "adapter", "language_model.model", 4, seed=3, projections=projections,
                            num_layers=TEXT_DIMS["num_hidden_layers"])
    merged = copy.deepcopy(hf)
    with torch.no_grad():
        state = merged.state_dict()
        for module, (a, b) in pairs.items():
            hf_name = module.replace("language_model.model.", "model.language_model.")
            state[f"{hf_name}.weight"] += 2.0 * (b @ a)
    llm = LLM(str(folder), dtype="float32", enable_lora=True, max_lora_rank=8, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    lora = LoRARequest("tiny-llava", 1, str(tmp_path / "adapter"))
    text, images = "USER: <image>\n w3 w17 ASSISTANT:", [_image(4)]
    prompt = {"prompt": text, "multi_modal_data": {"image": images}}
    with_lora, without = llm.generate([prompt, prompt], params, lora_request=[lora, None], use_tqdm=False)
    assert with_lora.outputs[0].token_ids == _hf_greedy(merged, processor, text, images, 8)[1]
    assert without.outputs[0].token_ids == _hf_greedy(hf, processor, text, images, 8)[1]
    assert with_lora.outputs[0].token_ids != without.outputs[0].token_ids


def test_chat_with_image_parts_matches_transformers(llava):
    """LLM.chat takes OpenAI-style image_url parts (data URLs) and PIL images; the template renders an image
    token for each, and the answer is transformers' for the processor's prompt."""
    folder, hf, processor = llava
    image = _image(5)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(image)}},
                                             {"type": "text", "text": "w3 w17 w5"}]}]
    parts = [{"type": "image"}, {"type": "text", "text": "w3 w17 w5"}]
    text = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)
    llm = LLM(str(folder), dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = llm.chat(messages, params, use_tqdm=False)[0]
    ids, want = _hf_greedy(hf, processor, text, [image], 8)
    assert out.prompt == text and out.prompt_token_ids == ids and out.outputs[0].token_ids == want
    pil = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                        {"type": "text", "text": "w3 w17 w5"}]}]
    assert llm.chat(pil, params, use_tqdm=False)[0].outputs[0].token_ids == want


def test_a_processor_chat_template_file_is_read(llava, tmp_path):
    """llava-hf's older snapshots keep the chat template in the processor's chat_template.json alone."""
    import shutil

    folder, _, _ = llava
    copy = tmp_path / "llava-old-layout"
    shutil.copytree(folder, copy)
    template = (copy / "chat_template.jinja").read_text()
    (copy / "chat_template.jinja").unlink()
    (copy / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    llm = LLM(str(copy), dtype="float32")
    assert llm.get_tokenizer().chat_template == template


def test_bad_image_prompts_are_refused_before_they_enter_the_engine(llava, tiny_llama):
    folder, _, _ = llava
    llm = LLM(str(folder), dtype="float32")
    image = _image(1)
    cases = [
        ({"prompt": "USER: w1 ASSISTANT:", "multi_modal_data": {"image": image}}, "0 image token"),
        ({"prompt": "USER: <image>\n <image>\n ASSISTANT:", "multi_modal_data": {"image": image}}, "2 image"),
        ("USER: <image>\n ASSISTANT:", "1 image token"),
        ({"prompt": "USER: <image>\n", "multi_modal_data": {"image": b"not an image"}}, "cannot read"),
        ({"prompt": "USER: <image>\n", "multi_modal_data": {"image": "https://example.com/a.png"}}, "fetch"),
        ({"prompt": "USER: <image>\n", "multi_modal_data": {"image": "data:image/png;base64,@@"}}, "base64"),
        ({"prompt": "USER: <image>\n", "multi_modal_data": {"video": image}}, "video inputs are not"),
        ({"prompt": "USER: <image>\n", "multi_modal_data": {"audio": image}}, "'image' alone"),
    ]
    for prompt, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    good = {"prompt": "USER: <image>\n", "multi_modal_data": {"image": image}}
    bad = {"prompt": "USER: <image>\n", "multi_modal_data": {"image": b"not an image"}}
    with pytest.raises(ValueError, match="cannot read"):  # a batch's images are read in threads
        llm.generate([good, bad, good], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.generate([{"prompt": "USER: <image>\n", "multi_modal_data": {"image": image}}],
                     SamplingParams(max_tokens=2, truncate_prompt_tokens=4), use_tqdm=False)
    limited = LLM(str(folder), dtype="float32", limit_mm_per_prompt={"image": 1})
    two = {"prompt": "USER: <image>\n <image>\n", "multi_modal_data": {"image": [image, image]}}
    with pytest.raises(ValueError, match="at most 1 are allowed"):
        limited.generate([two], SamplingParams(max_tokens=2), use_tqdm=False)
    assert limited.generate([good], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    from plait.layers.fp8 import Fp8Linear

    fp8 = LLM(str(folder), dtype="float32", quantization="fp8")  # the decoder alone: the image side stays
    model = fp8.engine.runner.model
    assert isinstance(model.model.layers[0].mlp.down_proj, Fp8Linear)
    assert not any(isinstance(m, Fp8Linear) for side in (model.vision_tower, model.multi_modal_projector)
                   for m in side.modules())
    assert fp8.generate([good], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    text_model = LLM(str(tiny_llama), dtype="float32")
    with pytest.raises(ValueError, match="takes no images"):
        text_model.generate([MultiModalPrompt([5, 6], (image,))], use_tqdm=False)
    with pytest.raises(ValueError, match="takes no images"):
        text_model.engine.make_request(MultiModalPrompt([5, 6], (image,)))


def _bench_serve_with_images(url: str, model: str, tmp_path, capsys) -> None:
    """`plait bench serve --images-per-prompt 1`: every chat request carries a random image, and the prompt
    tokens the server counted are its placeholders and the text."""
    import httpx

    from plait.entrypoints.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w1 w2\nw3\n")
    out = tmp_path / "images.json"
    args = ["bench", "serve", "--disable-tqdm", "--base-url", url, "--endpoint-type", "chat", "--dataset",
            "file", "--dataset-path", str(prompts), "--images-per-prompt", "1", "--image-size", "40x30",
            "--output-len", "4", "--save-detailed", "--result-file", str(out)]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"], result["total_output_tokens"]) == (2, 0, 8)
    image = {"type": "image_url", "image_url": {"url": _data_url(_image(0))}}
    want = [httpx.post(f"{url}/tokenize", json={"model": model, "messages": [
        {"role": "user", "content": [image, {"type": "text", "text": text}]}]}).json()["count"]
        for text in ("w1 w2", "w3")]
    assert result["input_lens"] == want
    capsys.readouterr()
    assert main(["bench", "serve", "--base-url", url, "--images-per-prompt", "1"]) == 2
    assert "use --endpoint-type chat" in capsys.readouterr().err


def test_server_takes_image_url_parts(llava, tiny_llama, tmp_path, capsys):
    """/v1/chat/completions with the openai client: an image_url part (a data URL, or a file:// URL in the
    folder --allowed-local-media-path allows) gets the answer LLM.chat gives, streamed or not; a bad image, a
    URL to fetch, a file outside that folder, or an image sent to a text model is a 400 and the server keeps
    serving."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine
    from plait.entrypoints.server import BackgroundServer, OpenAIServer, ServerConfig

    folder, hf, processor = llava
    image = _image(8)
    content = [{"type": "text", "text": "w3 w17 w5"},
               {"type": "image_url", "image_url": {"url": _data_url(image)}}]
    parts = [{"type": "text", "text": "w3 w17 w5"}, {"type": "image"}]
    text = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)
    want = _hf_greedy(hf, processor, text, [image], 6)[1]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    offline = LLM(str(folder), dtype="float32").chat([{"role": "user", "content": content}], params,
                                                      use_tqdm=False)[0]
    assert offline.outputs[0].token_ids == want
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="float32", max_num_batched_tokens=12))
    media, outside = tmp_path / "media", tmp_path / "outside.png"
    media.mkdir()
    image.save(media / "cat 1.png")
    image.save(outside)
    (media / "out.png").symlink_to(outside)  # a link out of the folder is outside it
    config = ServerConfig(log_level="warning", allowed_local_media_path=str(media))
    with BackgroundServer(OpenAIServer(engine, config)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        ask = dict(model=model, messages=[{"role": "user", "content": content}], max_tokens=6,
                   temperature=0.0, extra_body={"ignore_eos": True})
        reply = client.chat.completions.create(**ask)
        assert reply.choices[0].message.content == offline.outputs[0].text
        assert reply.usage.prompt_tokens == len(processor(text=text, images=[image])["input_ids"][0])
        chunks = client.chat.completions.create(**ask, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == reply.choices[0].message.content
        in_media = [{"type": "text", "text": "w3 w17 w5"},
                    {"type": "image_url", "image_url": {"url": (media / "cat 1.png").as_uri()}}]
        local = client.chat.completions.create(**{**ask, "messages": [{"role": "user", "content": in_media}]})
        assert local.choices[0].message.content == reply.choices[0].message.content
        for url_text, message in [("data:image/png;base64,AAAA", "cannot read"),
                                  ("https://example.com/cat.png", "fetch"),
                                  (outside.as_uri(), "outside the folder"),
                                  ((media / "out.png").as_uri(), "outside the folder"),
                                  ((media / "none.png").as_uri(), "cannot read the image file"),
                                  ("file://otherhost/cat.png", "not a file URL of this machine")]:
            bad = [{"type": "image_url", "image_url": {"url": url_text}}, {"type": "text", "text": "w1"}]
            with pytest.raises(openai.BadRequestError, match=message):
                client.chat.completions.create(model=model, messages=[{"role": "user", "content": bad}],
                                               max_tokens=2)
        # The Responses API's input_image parts: the answer chat gives the same conversation.
        plain = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                               max_tokens=6, temperature=0.0)
        response = client.responses.create(
            model=model, max_output_tokens=6, temperature=0.0,
            input=[{"role": "user", "content": [{"type": "input_text", "text": "w3 w17 w5"},
                                                {"type": "input_image", "image_url": _data_url(image)}]}])
        assert response.output_text == plain.choices[0].message.content
        assert response.usage.input_tokens == reply.usage.prompt_tokens
        with pytest.raises(openai.BadRequestError, match="beam search"):
            client.chat.completions.create(**{**ask, "extra_body": {"use_beam_search": True}})
        again = client.chat.completions.create(**ask)  # still serving after the 400s
        assert again.choices[0].message.content == reply.choices[0].message.content
        import httpx

        counted = httpx.post(f"{url}/tokenize", json={"model": model, "messages": ask["messages"]}).json()
        assert counted["count"] == reply.usage.prompt_tokens
        _bench_serve_with_images(url, model, tmp_path, capsys)
    text_engine = LLMEngine(EngineConfig(model=str(tiny_llama), dtype="float32"))
    with BackgroundServer(OpenAIServer(text_engine, ServerConfig(log_level="warning"))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        with pytest.raises(openai.BadRequestError, match="takes no images"):
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                           max_tokens=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_image_prompts_match_transformers(llava, dtype):
    """On the GPU path (Triton attention, CUDA graphs, overlapped steps): the answers transformers gives on
    the same GPU, with images split across chunks beside text-only prompts. Image embeddings are staged in
    static buffers, so steps that carry them replay graphs too."""
    folder, hf, processor = llava
    torch_dtype = getattr(torch, dtype)
    model = hf.to("cuda", torch_dtype)
    # Serving's prompt cap beside decodes: mixed steps then replay mixed-shape graphs, which an offline engine
    # (no cap: its big mixed steps run eager) does not capture.
    llm = LLM(str(folder), dtype=dtype, max_num_batched_tokens=12, enable_prefix_caching=False, usage="serve")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts, want = [], []
    for k, (text, num_images) in enumerate(PROMPTS):
        images = [_image(10 * k + j) for j in range(num_images)]
        inputs = processor(text=text, images=images or None, return_tensors="pt").to("cuda")
        if images:
            inputs["pixel_values"] = inputs["pixel_values"].to(torch_dtype)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        want.append(out[0, inputs["input_ids"].shape[1]:].tolist())
        prompts.append(_request(text, images))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    agree = sum(g == w for g, w in zip(got, want))
    print(f"\nLLaVA {dtype} on the GPU: {agree}/{len(want)} prompts equal transformers'")
    if dtype == "float32":
        assert got == want
    else:  # bf16: the kernels' rounding may fork a late token; the first ones are the image's answer
        assert all(g[:2] == w[:2] for g, w in zip(got, want)) and agree >= len(want) - 1
    b = llm.engine.runner.breakdown
    assert b.single_token_steps > 0 and b.graph_single_token_steps == b.single_token_steps
    assert b.image_steps > 0 and b.graph_image_steps == b.image_steps


@pytest.mark.parametrize("budget", [512, 16])
def test_llava_next_tiles_match_transformers(llava_next, budget):
    """LLaVA-NeXT: images of different shapes get different grids of tiles and placeholder counts (the padding
    the resize added cut off, a newline after each row); the prompt ids are the processor's and the greedy
    tokens transformers', whole or in chunks."""
    folder, hf, processor = llava_next
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=budget, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    shapes = [(40, 48), (30, 70), (70, 30), (64, 64), (20, 20)]  # (height, width)
    text = "USER: <image>\n w3 w17 w5 ASSISTANT:"
    prompts, want = [], []
    for k, shape in enumerate(shapes):
        image = _image(k, shape)
        want.append(_hf_greedy(hf, processor, text, [image], 8))
        prompts.append({"prompt": text, "multi_modal_data": {"image": image}})
    two = "USER: <image>\n w4 <image>\n w6 ASSISTANT:"
    images = [_image(7, (30, 70)), _image(8, (64, 40))]
    want.append(_hf_greedy(hf, processor, two, images, 8))
    prompts.append({"prompt": two, "multi_modal_data": {"image": images}})
    outs = llm.generate(prompts, params, use_tqdm=False)
    lengths = {len(ids) for ids, _ in want}
    assert len(lengths) > 2, "the test images should make different placeholder counts"
    for out, (ids, tokens) in zip(outs, want):
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == tokens


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_llava_next_tiles_match_transformers(llava_next):
    """LLaVA-NeXT on the GPU path in fp32: every image's tiles through the vision tower's graphs (padded to a
    captured count), packed, and the answers transformers gives on the same GPU."""
    folder, hf, processor = llava_next
    model = hf.to("cuda", torch.float32)
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=16, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    text = "USER: <image>\n w3 w17 w5 ASSISTANT:"
    prompts, want = [], []
    for k, shape in enumerate([(40, 48), (30, 70), (70, 30), (64, 64)]):
        image = _image(k, shape)
        inputs = processor(text=text, images=[image], return_tensors="pt").to("cuda")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        want.append(out[0, inputs["input_ids"].shape[1]:].tolist())
        prompts.append({"prompt": text, "multi_modal_data": {"image": image}})
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert llm.engine.runner.image_embeddings.tower_graphs is not None


def test_a_text_template_gets_image_tokens_then_text_parts_joined_by_newlines():
    """A template that takes text (no loop over a message's content): each image becomes the image token and a
    newline, before the message's text parts joined by newlines (vLLM's string content format); a template
    that loops over content keeps the parts, each image an {"type": "image"} part."""
    from plait.multimodal.chat import split_chat_images, template_takes_parts

    image = object()
    a, b = {"type": "text", "text": "a"}, {"type": "text", "text": "b"}
    content = [a, {"type": "image_pil", "image_pil": image}, b]
    text, images = split_chat_images([{"role": "user", "content": content}], False, "<image>\n")
    assert text == [{"role": "user", "content": "<image>\na\nb"}] and images == [image]
    looping = ("{% for message in messages %}{% for c in message['content'] %}{{ c.type }}{% endfor %}"
               "{% endfor %}")
    assert template_takes_parts(looping) and not template_takes_parts("{{ messages[0]['content'] }}")
    parts, _ = split_chat_images([{"role": "user", "content": content}], True, "<image>\n")
    assert parts[0]["content"] == [a, {"type": "image"}, b]


# (template, whether vLLM's "auto" content format gives it parts): the shapes of real chat templates' code.
CONTENT_LOOPS = [
    ("{% for message in messages %}{% if message.content is string %}{{ message.content }}{% else %}"
     "{% for content in message.content %}{% if content.type == 'text' %}{{ content.text }}{% endif %}"
     "{% endfor %}{% endif %}{% endfor %}", True),  # Qwen2.5-VL's
    ("{% for message in messages %}{% for content in message['content'] | selectattr('type', 'equalto', "
     "'image') %}<|image|>{% endfor %}{% endfor %}", True),  # Llama 3.2 Vision's, filtered
    ("{%- if messages[0]['role'] == 'system' -%}{%- set loop_messages = messages[1:] -%}{%- else -%}"
     "{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}"
     "{%- for item in message['content'] -%}{{ item['text'] }}{%- endfor -%}{%- endfor -%}", True),  # Gemma 3
    ("{% for m in messages %}{% set content = m['content'] %}{% for part in content %}{{ part.text }}"
     "{% endfor %}{% endfor %}", True),  # through a name for the content
    ("{% for part in messages[-1].content %}{{ part.text }}{% endfor %}", True),
    ("{% for m in messages %}{% generation %}{% for p in m.content %}{% endfor %}{% endgeneration %}"
     "{% endfor %}", True),  # HF's own tag
    ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>"
     "{% endfor %}", False),  # SmolLM2's
    ("{% for m in messages %}{{ m.content }}{% for call in m.tool_calls %}{{ call.function.name }}"
     "{% endfor %}{% endfor %}", False),  # loops, but not over content
    ("{% for key in tools %}{% for c in key.content %}{% endfor %}{% endfor %}", False),  # not a message's
    ("{{ messages[0]['content'][0]['text'] }}", False),
    ("{% for message in messages %", False),  # does not parse: rendering it says why
    (None, False),
]


@pytest.mark.parametrize("template,takes_parts", CONTENT_LOOPS)
def test_auto_content_format_reads_the_template_code_as_vllm(template, takes_parts):
    from plait.multimodal.chat import content_format, template_takes_parts

    assert template_takes_parts(template) is takes_parts
    assert content_format(template) == ("openai" if takes_parts else "string")
    assert content_format(template, "string") == "string" and content_format(template, "openai") == "openai"


def test_a_message_without_content_is_empty_text_or_no_parts():
    """An assistant message of tool calls alone (content null): "" for a template that takes text, no parts
    (an empty list, which a template's `if message.content` reads as empty) for one that loops over them."""
    pytest.importorskip("pydantic")
    from plait.entrypoints.protocol import ChatMessage
    from plait.multimodal.chat import prepare_chat

    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    message = ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [call]})
    kept = message.as_template_message(keep_parts=True)
    assert kept["content"] == [] and message.as_template_message()["content"] == ""
    for chosen, content in (("string", ""), ("openai", [])):
        (rendered,), _ = prepare_chat([kept], None, None, "m", chosen)
        assert rendered["content"] == content and rendered["tool_calls"]


def test_the_default_models_template_takes_text():
    from plait.loader.gguf import default_model_path
    from plait.loader.tokenizer import load_tokenizer
    from plait.multimodal.chat import content_format

    assert content_format(load_tokenizer(default_model_path()).chat_template) == "string"


def test_a_file_url_needs_the_folder_the_server_allows():
    """Without --allowed-local-media-path a file:// image is refused with the way to allow it."""
    from plait.multimodal.images import load_image

    with pytest.raises(ValueError, match="--allowed-local-media-path"):
        load_image("file:///etc/hostname")
