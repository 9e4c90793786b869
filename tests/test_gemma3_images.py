"""Gemma 3 with images: a tiny random Gemma3ForConditionalGeneration saved with its processor, against
transformers in fp32 on CPU: prompts of 0, 1 and 2 images as Gemma3Processor writes them, each image's
placeholders attending to each other both ways (sliding and global layers), chunks that never split them,
the Triton kernels, the prefix cache, the server, two tensor-parallel ranks, a LoRA adapter, fp8, bad
prompts, and the GPU path against the CPU's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import release_dropped_engines, run_greedy, server_image_chat

from plait import LLM, SamplingParams
from plait.config import EngineConfig
from plait.engine.engine import LLMEngine
from plait.multimodal.images import MultiModalPrompt
from tests.test_multimodal import _data_url, _image, _saved

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
            "<end_of_image>", "<image_soft_token>"]
# runs of newlines are tokens of their own, as in Gemma's vocabulary: the processor's "\n\n" merge
NEWLINES = ["\n" * k for k in range(1, 7)]
WORDS = [f"w{i}" for i in range(150)] + ["user", "model"]
# Gemma 3's chat template, cut to text and image parts.
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
TOKENS_PER_IMAGE = 4  # 56px tiles of 14px patches: a 4x4 grid pooled 2x2
SLIDING_WINDOW = 5  # shorter than an image's span with its tags: windows cut into images
PROMPTS = [
    ("<bos><start_of_turn>user\n<start_of_image>w3 w17 w5<end_of_turn>\n<start_of_turn>model\n", [(40, 48)]),
    ("<bos><start_of_turn>user\nw8 <start_of_image>w9 w90\n<start_of_image>w91 w92<end_of_turn>\n"
     "<start_of_turn>model\n", [(30, 70), (60, 40)]),
    ("<bos><start_of_turn>user\nw100 w101 w102<end_of_turn>\n<start_of_turn>model\n", []),
]
MAX_TOKENS = 5
LOGITS_ATOL = 1e-4


def _tokenizer():
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + NEWLINES + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.add_special_tokens(SPECIALS)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\n+|[^\s]+"), behavior="removed", invert=True)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>",
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"})


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(folder, transformers model, Gemma3Processor): one sliding and one global layer."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3Processor,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = _tokenizer()
    text = Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, vocab_size=len(tokenizer),
                            max_position_embeddings=512, sliding_window=SLIDING_WINDOW,
                            query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"],
                            bos_token_id=2, eos_token_id=1, pad_token_id=0)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=2, image_size=56, patch_size=14)
    ids = tokenizer.convert_tokens_to_ids
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=TOKENS_PER_IMAGE,
                       image_token_index=ids("<image_soft_token>"), boi_token_index=ids("<start_of_image>"),
                       eoi_token_index=ids("<end_of_image>"))
    folder, model = _saved(Gemma3ForConditionalGeneration, cfg, 7, "tiny-gemma3-images", tmp_path_factory)
    with torch.no_grad():  # zero-initialised weights made to count (as tests/test_hf_parity.py)
        for name, p in model.named_parameters():
            if "norm" in name and "language_model" in name:
                p.normal_(0.0, 0.3)
            elif name.endswith("mm_input_projection_weight"):  # zero-initialised: the images would be blank
                p.normal_(0.0, 1.0)
    model.save_pretrained(folder)
    image_processor = Gemma3ImageProcessorPil(size={"height": 56, "width": 56}, do_pan_and_scan=False)
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                image_seq_length=TOKENS_PER_IMAGE, chat_template=TEMPLATE)
    processor.save_pretrained(folder)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder, model, processor


def _prompts(seed: int = 0) -> list[tuple[str, list]]:
    return [(text, [_image(seed + 10 * k + j, size) for j, size in enumerate(sizes)])
            for k, (text, sizes) in enumerate(PROMPTS)]


def _hf(model, processor, text: str, images: list, max_tokens: int = MAX_TOKENS
        ) -> tuple[list[int], list[int], torch.Tensor]:
    """(the processor's prompt ids, transformers' greedy tokens, its logits at them [max_tokens, vocab]),
    the logits teacher-forced over prompt + output with the image mask (token_type_ids)."""
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)[0, len(ids):].tolist()
        full = torch.tensor([ids + out])
        extra = dict(pixel_values=inputs["pixel_values"]) if images else {}
        if "token_type_ids" in inputs:
            zeros = torch.zeros(1, len(out), dtype=torch.long)  # the output's tokens are text
            extra["token_type_ids"] = torch.cat([inputs["token_type_ids"], zeros], 1)
        logits = model(full, **extra).logits[0, len(ids) - 1:-1]
    return ids, out, logits


def _engine(folder, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(folder), dtype="float32", **kwargs))


def _assert_answers_as_hf(engine: LLMEngine, gemma3, prompts: list[tuple[str, list]]) -> None:
    folder, hf, processor = gemma3
    refs = [_hf(hf, processor, text, images) for text, images in prompts]
    asked = [MultiModalPrompt(ids, tuple(images)) if images else ids
             for (ids, _, _), (_, images) in zip(refs, prompts)]
    outputs, logits = run_greedy(engine, asked, MAX_TOKENS, capture_logits=True)
    for i, (_, want, want_logits) in enumerate(refs):
        assert outputs[i] == want, f"prompt {i}: greedy tokens differ from transformers"
        torch.testing.assert_close(torch.stack(logits[i]), want_logits, atol=LOGITS_ATOL, rtol=0)
    assert engine.is_idle_and_clean()


@pytest.mark.parametrize("budget", [512, 7])
def test_greedy_and_logits_match_transformers(gemma3, budget):
    """Prompts of 1 and 2 images with text around them and a text-only one, batched; at 7 tokens a step the
    chunker must end chunks before images' placeholders (6 with their tags) it cannot finish."""
    engine = _engine(gemma3[0], max_num_batched_tokens=budget)
    _assert_answers_as_hf(engine, gemma3, _prompts())


def test_text_prompts_write_images_as_the_processor(gemma3):
    """A text prompt's <start_of_image> becomes the processor's "\\n\\n" + span + "\\n\\n", its newlines
    merged with those beside it ("user\\n" + "\\n\\n" is one token), and the span's spans are recorded."""
    folder, hf, processor = gemma3
    llm = LLM(str(folder), dtype="float32")
    for text, images in _prompts():
        want = processor(text=text, images=images or None, return_tensors="pt")["input_ids"][0].tolist()
        request, _ = llm.engine.make_request(MultiModalPrompt(text, tuple(images)) if images else text,
                                             SamplingParams(max_tokens=1))
        assert request.prompt_token_ids == want
        soft = np.flatnonzero(np.asarray(want) == hf.config.image_token_id)
        assert request.attention_spans == tuple((int(s), int(s) + TOKENS_PER_IMAGE)
                                                for s in soft[::TOKENS_PER_IMAGE])


def test_chunks_never_split_an_image(gemma3):
    """At every budget from a span's length up, no chunk ends inside an image's placeholders (the
    scheduler's rule; build_step_arrays refuses such a chunk), and the answers stay transformers'."""
    folder, hf, processor = gemma3
    text, images = _prompts()[1]
    ids, want, _ = _hf(hf, processor, text, images)
    ends = []
    for budget in (TOKENS_PER_IMAGE, TOKENS_PER_IMAGE + 1, 9):
        engine = _engine(folder, max_num_batched_tokens=budget)
        launch = engine.runner.launch

        def recording(plan, *args, _launch=launch, **kwargs):
            ends.extend((row.request.attention_spans, row.start + row.num_new_tokens) for row in plan.rows)
            return _launch(plan, *args, **kwargs)

        engine.runner.launch = recording
        outputs, _ = run_greedy(engine, [MultiModalPrompt(ids, tuple(images))], MAX_TOKENS)
        assert outputs[0] == want
    assert ends and all(not (a < end < b) for spans, end in ends for a, b in spans)


def test_the_bidirectional_mask_changes_the_answer(gemma3, monkeypatch):
    """Without the image mask (every token causal), the same engine no longer answers as transformers: the
    mask is what the tests above check."""
    import plait.runner.forward_batch as forward_batch

    folder, hf, processor = gemma3
    text, images = _prompts()[1]
    ids, want, want_logits = _hf(hf, processor, text, images)
    monkeypatch.setattr(forward_batch, "_key_limits", lambda rows, positions, qsl: positions.copy())
    engine = _engine(folder)
    outputs, logits = run_greedy(engine, [MultiModalPrompt(ids, tuple(images))], MAX_TOKENS,
                                 capture_logits=True)
    assert (torch.stack(logits[0]) - want_logits).abs().max() > 100 * LOGITS_ATOL


def test_triton_kernels_answer_as_transformers(gemma3, monkeypatch):
    """Through the Triton backend (its interpreter on CPU, fp32): the key limits reach the kernel."""
    import plait.kernels.paged_attention as paged
    from plait.kernels import dispatch

    monkeypatch.setattr(dispatch, "_cpu_interpreter", True)
    limited = []
    kernel = paged.paged_attention

    def counted(*args, **kwargs):
        limited.append(kwargs.get("key_limits") is not None)
        return kernel(*args, **kwargs)

    monkeypatch.setattr("plait.attention.triton_backend.paged_attention", counted)
    engine = _engine(gemma3[0], attention_backend="triton", max_num_batched_tokens=8)
    _assert_answers_as_hf(engine, gemma3, _prompts()[:2])
    assert limited and all(limited)


def test_prefix_cache_serves_a_shared_image(gemma3):
    """The same image after the same text again: served from the cache past its first placeholders (a
    block ends inside them, so the new chunk starts there and takes them to their end), and answered as
    transformers answers; another image of the same size hits only the blocks before its span."""
    folder, hf, processor = gemma3
    text = "<bos><start_of_turn>user\nw1 w2 w3 w4 w5 w6 w7 <start_of_image>w8 w9<end_of_turn>\n"
    image, other = _image(3, (40, 48)), _image(4, (40, 48))
    llm = LLM(str(folder), dtype="float32", enable_prefix_caching=True, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = []
    for img in (image, image, other):
        ids, want, _ = _hf(hf, processor, text, [img])
        asked = {"prompt": text, "multi_modal_data": {"image": [img]}}
        out = llm.generate([asked], params, use_tqdm=False)[0]
        assert out.prompt_token_ids == ids and out.outputs[0].token_ids == want
        got.append(out.num_cached_tokens)
    boi = ids.index(hf.config.boi_token_id)
    first, last = boi + 1, boi + 1 + TOKENS_PER_IMAGE
    assert first % 4 and (last - first) > 4 - first % 4  # a block boundary falls inside the placeholders
    assert got[0] == 0 and first < got[1] and got[1] > last  # through the image
    assert got[2] == boi // 4 * 4  # the blocks before the image's span


def test_server_answers_an_image_url_part(gemma3):
    """The official openai client's chat with an image_url part: the prompt is the processor's, /tokenize
    agrees, and the answer is transformers' greedy text."""
    folder, hf, processor = gemma3
    image = _image(5, (40, 48))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "w3 w17"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    ids, want, _ = _hf(hf, processor, text, [image], max_tokens=6)
    content = [{"type": "image_url", "image_url": {"url": _data_url(image)}},
               {"type": "text", "text": "w3 w17"}]
    answer = server_image_chat(folder, content, ids)
    assert answer.split() == processor.tokenizer.decode(want, skip_special_tokens=True).split()


def test_bad_image_prompts_are_refused(gemma3, tmp_path):
    """Image tokens that do not match the images, a span cut apart, placeholders without an image, a span
    longer than a step, and a pan-and-scan processor are refused by name; <start_of_image> without an image
    is an ordinary token."""
    import json
    import shutil

    folder, hf, processor = gemma3
    llm = LLM(str(folder), dtype="float32")
    params = SamplingParams(max_tokens=1)
    text = "<bos><start_of_turn>user\n<start_of_image>w3<end_of_turn>\n"
    with pytest.raises(ValueError, match="1 <start_of_image> token.*2 image"):
        llm.engine.make_request(MultiModalPrompt(text, (_image(1), _image(2))), params)
    ids = processor(text=text, images=[_image(1)], return_tensors="pt")["input_ids"][0].tolist()
    soft = hf.config.image_token_id
    cut = ids[:ids.index(soft) + 1] + [ids[0]] + ids[ids.index(soft) + 1:]
    with pytest.raises(ValueError, match="placeholder tokens must stand together"):
        llm.engine.make_request(MultiModalPrompt(cut, (_image(1),)), params)
    with pytest.raises(ValueError, match="placeholders .* do not match its 0 image"):
        llm.engine.make_request([ids[0], soft, soft], params)  # placeholders no image fills
    plain, _ = llm.engine.make_request(ids[:ids.index(soft)], params)  # a <start_of_image> alone is text
    assert plain.attention_spans == ()
    small = LLM(str(folder), dtype="float32", max_num_batched_tokens=TOKENS_PER_IMAGE - 1)
    with pytest.raises(ValueError, match="computed in one step"):
        small.engine.make_request(MultiModalPrompt(text, (_image(1),)), params)
    copy = tmp_path / "pan-and-scan"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "processor_config.json").read_text())
    config["image_processor"]["do_pan_and_scan"] = True
    (copy / "processor_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="pan-and-scan"):
        LLM(str(copy), dtype="float32")


def test_split_over_two_ranks_answers_as_transformers(gemma3):
    """Tensor parallelism (gloo): the decoder's heads and MLP split in two, the tower and projector whole on
    each rank and run by the driver, which sends the other rank each step's placeholder embeddings and key
    limits with its arrays; at 7 tokens a step chunks stop before images, and the answers (tokens and
    logits) are transformers'."""
    engine = _engine(gemma3[0], tensor_parallel_size=2, max_num_batched_tokens=7)
    try:
        _assert_answers_as_hf(engine, gemma3, _prompts()[:2])
    finally:
        engine.shutdown()


def test_a_lora_adapter_and_fp8_change_the_decoder_alone(gemma3, tmp_path):
    """LoRA on the Gemma 3 decoder, the adapter named as transformers names it
    (model.language_model.layers.*): prompts with images, chunked before them, get transformers' greedy
    tokens and logits with the adapter merged into its weights, beside the same prompts as base rows, which
    get transformers' own.
    ``--quantization fp8`` quantises the decoder alone: the tower stays 16-bit (nn.Linear)."""
    import copy

    from test_qwen2_vl import _random_adapter

    from plait.layers.fp8 import Fp8Linear
    from plait.lora.request import LoRARequest

    folder, hf, processor = gemma3
    text = hf.config.text_config
    hidden, inter = text.hidden_size, text.intermediate_size
    q, kv = text.num_attention_heads * text.head_dim, text.num_key_value_heads * text.head_dim
    projections = {"q_proj": (hidden, q), "v_proj": (hidden, kv), "o_proj": (q, hidden),
                   "gate_proj": (hidden, inter), "down_proj": (inter, hidden)}
    pairs = _random_adapter(tmp_path / "adapter", "model.language_model", 4, seed=3, projections=projections,
                            num_layers=text.num_hidden_layers)
    merged = copy.deepcopy(hf)
    with torch.no_grad():
        state = merged.state_dict()
        for module, (a, b) in pairs.items():
            state[f"{module}.weight"] += 2.0 * (b @ a)  # lora_alpha / r = 2
    prompts = _prompts()[1:2]  # two images
    base = [_hf(hf, processor, text, images) for text, images in prompts]
    adapted = [_hf(merged, processor, text, images) for text, images in prompts]
    asked = [MultiModalPrompt(ids, tuple(images)) for (ids, _, _), (_, images) in zip(base, prompts)]
    lora = LoRARequest("tiny-gemma3", 1, str(tmp_path / "adapter"))
    engine = _engine(folder, enable_lora=True, max_lora_rank=8, max_num_batched_tokens=7)
    outputs, logits = run_greedy(engine, asked + asked, MAX_TOKENS, capture_logits=True,
                                 loras=[lora] * len(asked) + [None] * len(asked))
    for i, (_, want, want_logits) in enumerate(adapted + base):
        assert outputs[i] == want, f"row {i}: greedy tokens differ from transformers'"
        torch.testing.assert_close(torch.stack(logits[i]), want_logits, atol=LOGITS_ATOL, rtol=0)
    assert [out for _, out, _ in adapted] != [out for _, out, _ in base]  # the adapter changes the answers
    del engine
    release_dropped_engines()  # on a GPU the first engine's KV cache holds 90% of it
    fp8 = LLM(str(folder), dtype="float32", quantization="fp8")
    model = fp8.engine.runner.model
    assert isinstance(model.model.layers[0].mlp.down_proj, Fp8Linear)
    assert not any(isinstance(m, Fp8Linear) for side in (model.vision_tower, model.multi_modal_projector)
                   for m in side.modules())
    assert fp8.generate([asked[0]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_matches_cpu_fp32(gemma3):
    """The GPU engine (Triton attention with key limits, CUDA graphs, overlap) in fp32 answers as the CPU
    engine, images split by no chunk at a small budget and whole at a large one."""
    folder = gemma3[0]
    prompts = [MultiModalPrompt(text, tuple(images)) if images else text for text, images in _prompts()]
    for budget in (8, 512):
        cpu = _engine(folder, max_num_batched_tokens=budget, device="cpu")
        gpu = _engine(folder, max_num_batched_tokens=budget, device="cuda")
        want, want_logits = run_greedy(cpu, prompts, MAX_TOKENS, capture_logits=True)
        got, got_logits = run_greedy(gpu, prompts, MAX_TOKENS, capture_logits=True)
        assert got == want
        for i in want_logits:
            torch.testing.assert_close(torch.stack(got_logits[i]).cpu(), torch.stack(want_logits[i]),
                                       atol=1e-3, rtol=0)
        del cpu, gpu
        release_dropped_engines()  # the next budget's GPU engine needs the KV cache's 90% back
