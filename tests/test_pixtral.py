"""Pixtral's encoder: a tiny random Mistral3ForConditionalGeneration (Mistral-Small-3.1 / 3.2's build) and a
LLaVA with a Pixtral tower (pixtral-12b's), with their processors, against transformers in fp32 on CPU:
images of different sizes at their own resolution (0, 1 and 2 a prompt), chunked prefill through an image,
the prefix cache, the server's image_url parts, and bad input."""

from __future__ import annotations

import pytest
import torch

from plait import LLM, SamplingParams
from tests.test_multimodal import _data_url, _image, _saved

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
    vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 image_size=LONGEST_EDGE[family], patch_size=PATCH,
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


def _hf_greedy(model, processor, text: str, images: list, max_tokens: int) -> tuple[list[int], list[int]]:
    """(the processor's prompt ids, transformers' greedy tokens)."""
    inputs = processor(text=text, images=images or None)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    ids = inputs["input_ids"][0].tolist()
    return ids, out[0, len(ids):].tolist()


def _prompts(seed: int = 0) -> list[tuple[str, list]]:
    return [(text, [_image(seed + 10 * k + j, size) for j, size in enumerate(sizes)])
            for k, (text, sizes) in enumerate(PROMPTS)]


def _request(text: str, images: list) -> dict | str:
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


@pytest.mark.parametrize("budget", [512, 7])
@pytest.mark.parametrize("family", ["mistral3", "pixtral_llava"])
def test_greedy_matches_transformers(request, family, budget):
    """Each prompt's ids are the processor's ([IMG] rows, [IMG_BREAK], [IMG_END]) and its greedy tokens
    transformers': images of different sizes, 0, 1 and 2 a prompt, batched together; at a budget of 7 tokens
    a step every image is split across chunks. A prompt already expanded (the processor's ids) runs as it is."""
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
