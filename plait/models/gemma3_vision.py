"""Image-text Gemma 3 (Gemma3ForConditionalGeneration: gemma-3-4b-it, 12b, 27b): a SigLIP tower (learned
position embeddings, its post-norm) on one 896px tile, its patch grid average-pooled to mm_tokens_per_image
features, Gemma-normed and projected into the decoder; each image's placeholders attend to each other both
ways (ForwardBatch.key_limits), in sliding and global layers alike, as transformers' token_type_ids mask."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait.config import ModelConfig
from plait.layers.norm import GemmaRMSNorm
from plait.models.gemma import GemmaForCausalLM
from plait.models.llava import VisionTower, embed_with_images
from plait.models.weights import load_image_model_weights
from plait.runner.forward_batch import ForwardBatch

# Gemma3Config's defaults, for what a checkpoint's config leaves out.
DEFAULT_MM_TOKENS_PER_IMAGE = 256
DEFAULT_BOI_TOKEN_ID = 255_999
DEFAULT_EOI_TOKEN_ID = 256_000
DEFAULT_IMAGE_TOKEN_ID = 262_144
# SiglipVisionConfig's defaults (Gemma 3's Hub configs give the rest: 896px, patch 14, 27 layers).
VISION_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                       num_channels=3, image_size=224, patch_size=16, hidden_act="gelu_pytorch_tanh",
                       layer_norm_eps=1e-6)
# Gemma3Processor writes each image as "\n\n<start_of_image>" + soft tokens + "<end_of_image>\n\n".
IMAGE_NEWLINES = "\n\n"
# Newline runs tokenized as one token each (Gemma's vocabulary has runs of up to 31): the processor's "\n\n"
# merges with the newlines beside it in the text it tokenizes whole.
MAX_NEWLINE_RUN = 32
# Checkpoint prefixes of the vision side (the Hub's, and transformers 5's as it saves and names them),
# longest first -> the model's.
_VISION_PREFIXES = (("model.vision_tower.vision_model.", "vision_tower."),
                    ("vision_tower.vision_model.", "vision_tower."),
                    ("model.vision_tower.", "vision_tower."), ("vision_tower.", "vision_tower."),
                    ("model.multi_modal_projector.", "multi_modal_projector."),
                    ("multi_modal_projector.", "multi_modal_projector."))


class Gemma3MultiModalProjector(nn.Module):
    """Each tile's patch features [side * side, vision hidden] average-pooled to tokens_per_side^2, normed
    (Gemma's 1 + weight RMSNorm) and projected by ``mm_input_projection_weight`` [vision hidden, hidden]."""

    def __init__(self, vision_hidden: int, text_hidden: int, patches_per_side: int, tokens_per_image: int,
                 eps: float) -> None:
        super().__init__()
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(vision_hidden, text_hidden))
        self.mm_soft_emb_norm = GemmaRMSNorm(vision_hidden, eps)
        self.patches_per_side = patches_per_side
        tokens_per_side = math.isqrt(tokens_per_image)
        if tokens_per_side**2 != tokens_per_image or patches_per_side % tokens_per_side:
            raise ValueError(f"mm_tokens_per_image ({tokens_per_image}) must be a square whose side divides "
                             f"the tower's {patches_per_side} patches a side")
        self.kernel = patches_per_side // tokens_per_side

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [tiles, side * side, vision hidden] -> [tiles, tokens_per_image, hidden]
        tiles, _, width = x.shape
        side = self.patches_per_side
        grid = x.transpose(1, 2).reshape(tiles, width, side, side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        normed = self.mm_soft_emb_norm(pooled.flatten(0, 1)).view(pooled.shape)
        return torch.matmul(normed, self.mm_input_projection_weight.to(normed.dtype)).to(x.dtype)


class Gemma3ImagePrompt:
    """Writes images into a token prompt as Gemma3Processor writes them into its text: each
    ``<start_of_image>`` becomes "\\n\\n" + the image's span (``<start_of_image>``, its placeholders,
    ``<end_of_image>``) + "\\n\\n", the newlines merged with the newline tokens beside them as the tokenizer
    merges them in the processor's text; a prompt already so written is taken as it is, and one without
    images as it is (its placeholders, which nothing would fill, refused)."""

    def __init__(self, tokenizer: Any, boi: int, placeholder: int) -> None:
        self.boi, self.placeholder = boi, placeholder
        self.tokenizer = tokenizer
        # newline-run token id -> its newline count, for the runs the tokenizer writes as one token
        self.runs: dict[int, int] = {}
        if tokenizer is not None:
            for n in range(1, MAX_NEWLINE_RUN):
                ids = tokenizer.encode("\n" * n, add_special_tokens=False)
                if len(ids) == 1:
                    self.runs.setdefault(ids[0], n)

    def _newlines(self, count: int) -> list[int]:
        return list(self.tokenizer.encode("\n" * count, add_special_tokens=False))

    def __call__(self, token_ids: Sequence[int], spans: list[list[int]]) -> tuple[list[int], list[int]]:
        """(the prompt with each image written, each span's first token); ValueError where the image tokens
        do not match the images."""
        ids = list(token_ids)
        if ids.count(self.placeholder):  # already written as the processor writes it
            return ids, self._offsets(ids, spans)
        if not spans:  # a <start_of_image> without an image is an ordinary token, as in transformers and vLLM
            return ids, []
        found = ids.count(self.boi)
        if found != len(spans):
            raise ValueError(f"the prompt has {found} <start_of_image> token(s) (id {self.boi}) for "
                             f"{len(spans)} image(s): put one in the prompt for each image")
        if self.tokenizer is None:
            raise ValueError("Gemma 3 writes newlines around each image, which needs its tokenizer: the "
                             "model folder has none")
        todo = iter(spans)
        out: list[int] = []
        for tok in ids:
            if tok != self.boi:
                out.append(tok)
                continue
            out += self._newlines(len(IMAGE_NEWLINES))
            out += next(todo)
            out += self._newlines(len(IMAGE_NEWLINES))
        return self._merge_runs(out), self._offsets(self._merge_runs(out), spans)

    def _merge_runs(self, ids: list[int]) -> list[int]:
        """Adjacent newline-run tokens joined into the tokens the tokenizer gives their newlines together."""
        out: list[int] = []
        run: list[int] = []
        for tok in [*ids, None]:
            if tok is not None and tok in self.runs:
                run.append(tok)
                continue
            if len(run) > 1:
                out += self._newlines(sum(self.runs[t] for t in run))
            else:
                out += run
            run = []
            if tok is not None:
                out.append(tok)
        return out

    def _offsets(self, ids: list[int], spans: list[list[int]]) -> list[int]:
        offsets, at = [], 0
        for span in spans:
            start = _find(ids, span, at)
            if start is None:
                raise ValueError(f"an image's {span.count(self.placeholder)} placeholder tokens must stand "
                                 "together between <start_of_image> and <end_of_image>, one image each")
            offsets.append(start)
            at = start + len(span)
        if ids.count(self.placeholder) != sum(span.count(self.placeholder) for span in spans):
            raise ValueError(f"the prompt's image placeholders (id {self.placeholder}) do not match its "
                             f"{len(spans)} image(s)")
        return offsets


def _find(ids: list[int], span: list[int], start: int) -> int | None:
    """The first index >= start where ``span`` stands in ``ids``."""
    first = span[0]
    for i in range(start, len(ids) - len(span) + 1):
        if ids[i] == first and ids[i:i + len(span)] == span:
            return i
    return None


class Gemma3ForConditionalGeneration(GemmaForCausalLM):
    """Gemma 3's decoder with image inputs: ``embed_images`` runs the tower and projector on 896px tiles (one
    an image: pan-and-scan is refused), the runner stages a step's placeholder embeddings in
    ``ForwardBatch.image_embeds``, and every step carries ``key_limits`` (``bidirectional_image_spans``):
    an image's placeholders see its last one, and the scheduler never ends a chunk inside them."""

    # On the decoder's projections (plait.lora.model.lora_targets); adapters name them as transformers names
    # this model's decoder (model.language_model.layers..., 4's language_model.model...: language_model_name).
    supports_lora = True
    supports_images = True
    bidirectional_image_spans = True

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        raw = cfg.raw
        vision = {**VISION_DEFAULTS, **(raw.get("vision_config") or {}), "model_type": "siglip_vision_model"}
        self.image_size, patch = vision["image_size"], vision["patch_size"]
        if not isinstance(self.image_size, int) or not isinstance(patch, int):
            raise ValueError(f"the vision tower's image_size and patch_size must be single numbers, got "
                             f"{self.image_size} and {patch}")
        self.vision_tower = VisionTower(vision, vision["num_hidden_layers"], post_norm=True)
        self.tokens_per_image = int(raw.get("mm_tokens_per_image") or DEFAULT_MM_TOKENS_PER_IMAGE)
        self.multi_modal_projector = Gemma3MultiModalProjector(
            vision["hidden_size"], cfg.hidden_size, self.image_size // patch, self.tokens_per_image,
            vision["layer_norm_eps"])
        self.image_token_id = int(raw.get("image_token_index",
                                          raw.get("image_token_id", DEFAULT_IMAGE_TOKEN_ID)))
        self.boi_token_id = int(raw.get("boi_token_index", DEFAULT_BOI_TOKEN_ID))
        self.eoi_token_id = int(raw.get("eoi_token_index", DEFAULT_EOI_TOKEN_ID))
        # what a prompt writes for one image (the chat template's "<start_of_image>")
        self.image_prompt_token_ids = [self.boi_token_id]

    def num_image_tokens_for(self, size: tuple[int, int]) -> int:
        """Placeholders of an image of any size: mm_tokens_per_image."""
        return self.tokens_per_image

    def num_tiles_for(self, size: tuple[int, int]) -> int:
        return 1

    def image_placeholders(self, processor: Any, tokenizer: Any) -> Callable[[tuple[int, int]], list[int]]:
        """An image's span, whatever its size: <start_of_image>, its placeholders, <end_of_image> (only the
        placeholders are ``embedded``). Refuses pan-and-scan, whose crops would each be an image of their
        own with text between them."""
        if getattr(processor, "do_pan_and_scan", None):
            raise ValueError("Gemma 3's pan-and-scan (the image processor's do_pan_and_scan=True) is not "
                             "supported: set do_pan_and_scan to false in preprocessor_config.json")
        span = [self.boi_token_id] + [self.image_token_id] * self.tokens_per_image + [self.eoi_token_id]
        return lambda size: span

    def image_prompt_expander(self, tokenizer: Any) -> Gemma3ImagePrompt:
        """How ImageProcessor writes images into a token prompt (Gemma3ImagePrompt)."""
        return Gemma3ImagePrompt(tokenizer, self.boi_token_id, self.image_token_id)

    @property
    def tile_shape(self) -> tuple[int, int, int]:
        """(channels, size, size): one tile's pixel values, as the vision tower takes them."""
        return self.vision_tower.embeddings.patch_embedding.in_channels, self.image_size, self.image_size

    def default_image_processor(self) -> object:
        """The image processor of a folder that ships none (dummy weights): Gemma 3's at the tower's size,
        the PIL one, which needs no torchvision."""
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        size = self.image_size
        return Gemma3ImageProcessorPil(size={"height": size, "width": size}, do_pan_and_scan=False)

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values: [tiles, channels, size, size] -> [tiles, mm_tokens_per_image, hidden]."""
        return self.multi_modal_projector(self.vision_tower.last_hidden_state(pixel_values))

    def pack_image(self, features: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """An image's one tile's features [1, tokens, hidden] -> its placeholders' rows [tokens, hidden]."""
        return features.flatten(0, 1)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden: [T, hidden]. The placeholder id may lie past the vocabulary
        # (262144 in a 262144-row table, as transformers' OOV case): its own embedding is never read.
        ids = input_ids.clamp(max=self.model.embed_tokens.num_embeddings - 1)
        return self.model(ids, batch, inputs_embeds=embed_with_images(self, ids, batch))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The decoder's tensors (``language_model.model.*`` / ``model.language_model.*``); the tower's and
        projector's by name, each checked; the tower's pooling head (never read) skipped."""
        load_image_model_weights(self, weights, ("vision_tower.", "multi_modal_projector."), _vision_name,
                                 skip=lambda name: name.startswith("vision_tower.head."))


def _vision_name(name: str) -> str | None:
    for prefix, to in _VISION_PREFIXES:
        if name.startswith(prefix):
            return to + name[len(prefix):]
    return None
