"""An image prompt: the images a user passes (PIL images, bytes, data URLs; file URLs under a folder the
server allows), turned into pixel values by the model's image processor, and the placeholder tokens each one
fills in the prompt."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import numpy as np
import torch

_KEY_BYTES = 16
FILE_URL_PREFIX = "file://"
# A file URL's host: none, or this machine by name (file://localhost/path).
_LOCAL_FILE_HOSTS = ("", "localhost")


@dataclass(frozen=True)
class ImageInput:
    """One image of a request: its span is prompt tokens [offset, offset + length); its placeholders are the
    span's tokens, or those ``embedded`` marks where the span has text between them (Idefics3's tile tags)."""

    offset: int
    length: int
    # [tiles, channels, size, size] fp32 on the host, as the image processor made it (LLaVA-1.5: one tile;
    # LLaVA-NeXT: the whole image, then the tiles of its best grid; Pixtral: [channels, height, width] at
    # the size the processor resized it to)
    pixel_values: torch.Tensor
    size: tuple[int, int]  # the image's own (height, width), before the processor resized it
    key: bytes  # a hash of the pixel values: the prefix cache tells apart prompts that differ only here
    # Qwen2-VL: (temporal, height, width) of its patches; pixel_values is then [t h w, patch values]
    grid: tuple[int, int, int] | None = None
    # [length] bool: which of the span's tokens take the image's embeddings, in order (the rest keep their
    # own: Idefics3's tile tags, Pixtral's row breaks); None: every one (LLaVA, Qwen2-VL)
    embedded: np.ndarray | None = None


@dataclass(frozen=True)
class PixelValues:
    """An image already through the model's image processor: the server makes these off the engine's thread
    (ImageProcessor.pixel_values), so the step loop never decodes an image."""

    # [tiles, channels, size, size] fp32; Qwen2-VL: [t h w, patch values]; Pixtral: [channels, height, width]
    tensor: torch.Tensor
    size: tuple[int, int]  # the image's own (height, width)
    grid: tuple[int, int, int] | None = None  # Qwen2-VL: (temporal, height, width) of its patches


@dataclass(frozen=True)
class MultiModalPrompt:
    """A prompt (text, or token ids) with images: each image token in it stands for one image, in order."""

    prompt: str | list[int]
    images: tuple[Any, ...]


def load_image(source: Any) -> Any:
    """A PIL image (RGB) from a PIL image, raw bytes, or a ``data:image/...;base64,`` URL."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(source, Image.Image):
        return source.convert("RGB")
    if isinstance(source, str):
        source = _data_url_bytes(source)
    if not isinstance(source, (bytes, bytearray)):
        raise ValueError(f"an image must be a PIL image, bytes or a data URL, got {type(source).__name__}")
    try:
        image = Image.open(io.BytesIO(source))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise ValueError(f"cannot read the image: {err}") from err
    return image.convert("RGB")


def local_image_bytes(url: str, allowed_folder: str) -> bytes:
    """The bytes of the file a ``file://`` image URL names, which must lie inside ``allowed_folder`` once both
    are resolved (vLLM's --allowed-local-media-path; links out of it do not count as inside). ValueError
    otherwise, or where the file cannot be read."""
    parsed = urlparse(url)
    if parsed.scheme != "file" or parsed.netloc not in _LOCAL_FILE_HOSTS:
        raise ValueError(f"not a file URL of this machine: {url[:80]!r}")
    path = os.path.realpath(unquote(parsed.path))
    folder = os.path.realpath(allowed_folder)
    if os.path.commonpath([path, folder]) != folder:
        raise ValueError(f"the image file {unquote(parsed.path)!r} is outside the folder the server reads "
                         "images from (--allowed-local-media-path)")
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as err:
        raise ValueError(f"cannot read the image file {unquote(parsed.path)!r}: "
                         f"{err.strerror or err}") from err


def _data_url_bytes(url: str) -> bytes:
    if url.startswith(("http://", "https://")):
        raise ValueError("plait does not fetch image URLs; send the image inline as a data URL "
                         "(data:image/png;base64,...)")
    if url.startswith(FILE_URL_PREFIX):
        raise ValueError("this server reads no image files; send the image inline as a data URL "
                         "(data:image/png;base64,...), or start it with --allowed-local-media-path FOLDER")
    if not url.startswith("data:"):
        raise ValueError(f"an image URL must be a data URL (data:image/...;base64,...), got {url[:40]!r}")
    header, sep, payload = url[len("data:"):].partition(",")
    if not sep or not header.endswith(";base64"):
        raise ValueError("an image data URL must be base64-encoded (data:image/...;base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ValueError(f"the image data URL is not valid base64: {err}") from err


class ImageProcessor:
    """Turns a token prompt and its images into the prompt the model runs: each image token expanded to
    that image's span (``model.num_image_tokens_for(size)`` placeholders; a tiling model's, Idefics3's, the
    text its ``image_prompt_layout`` writes, tile tags between its tiles' placeholders, as the tokenizer
    reads it; Pixtral's, the rows of placeholders and breaks ``model.image_placeholders`` gives), and each
    image's pixel values (``model.num_tiles_for(size)`` tiles)."""

    def __init__(self, hf_processor: Any, model: Any, tokenizer: Any = None) -> None:
        self.hf_processor = hf_processor
        self.image_token_id = model.image_token_id
        # The tokens a prompt writes for one image (Qwen2-VL wraps its image token in vision start / end).
        self.prompt_token_ids: list[int] = list(getattr(model, "image_prompt_token_ids", None)
                                                or [model.image_token_id])
        # pure functions of an image's size (Qwen2-VL's counts follow the processor's pixel bounds)
        counter = getattr(model, "image_token_counter", None)
        self._tokens_for = model.num_image_tokens_for if counter is None else counter(hf_processor)
        self._tiles_for = model.num_tiles_for
        # A tiling model (Idefics3): the grid, tile count and prompt text of an image of a size, under this
        # processor's settings; the text is tokenized, since its newlines may merge ("\n\n" is one token in
        # SmolLM2's vocabulary), as transformers' processor tokenizes the prompt it writes.
        layout = getattr(model, "image_prompt_layout", None)
        self.layout = None if layout is None else layout(hf_processor)
        if self.layout is not None:
            self._tiles_for = self.layout.tiles
        # Pixtral: an image's span is rows of image tokens, each ended by a break token (the last by an end
        # token), whose ids the tokenizer knows: a function of the size; None where the span is all image
        # tokens
        placeholders = getattr(model, "image_placeholders", None)
        self._placeholders_for = None if placeholders is None else placeholders(hf_processor, tokenizer)
        # Gemma 3: how images are written into a token prompt, where it is more than the image token replaced
        # by its span (newlines around each, merged with those beside it); None: expand_placeholders' own way
        expander = getattr(model, "image_prompt_expander", None)
        self._expander = None if expander is None else expander(tokenizer)
        # what the model's processor is called with beside the images (Pixtral: its resize unit)
        self._call_kwargs: dict[str, Any] = dict(getattr(model, "image_processor_kwargs", None) or {})
        # Pixtral's processor pads a batch to its largest image: each is cut back to its own size
        self._own_sizes = bool(getattr(model, "images_at_own_size", False))
        self._tokenizer = tokenizer
        self._spans: dict[str, list[int]] = {}  # prompt text -> its ids (one per grid seen)

    @classmethod
    def for_model(cls, folder: Path | None, model: Any, tokenizer: Any = None) -> ImageProcessor:
        """The model folder's image processor (its preprocessor_config.json, or the image_processor of its
        processor_config.json, where transformers 5 saves it), else the model's default (a config-only
        folder: dummy weights)."""
        from transformers import AutoImageProcessor

        if folder is not None and _has_image_processor(Path(folder)):
            return cls(AutoImageProcessor.from_pretrained(str(folder)), model, tokenizer)
        return cls(model.default_image_processor(), model, tokenizer)

    def expand(self, token_ids: Sequence[int], images: Sequence[Any]
               ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """The prompt with each image token made its image's span, and its images. A prompt already
        expanded (as transformers' processor writes it) is taken as it is."""
        pixels = self.preprocess(images)
        spans = [self.span(p.size) for p in pixels]
        ids, offsets = self.expand_placeholders(token_ids, spans)
        return ids, tuple(ImageInput(offset, len(span), p.tensor, p.size, _key(p.tensor), p.grid,
                                     self._embedded(span))
                          for offset, span, p in zip(offsets, spans, pixels))

    def span(self, size: tuple[int, int]) -> list[int]:
        """The prompt tokens an image of ``size`` (height, width) stands for."""
        if self._placeholders_for is not None:
            return self._placeholders_for(size)
        if self.layout is None:
            return [self.image_token_id] * self._tokens_for(size)
        text = self.layout.prompt_text(size)
        ids = self._spans.get(text)
        if ids is None:
            if self._tokenizer is None:
                raise ValueError("this image model writes each image's tiles into the prompt as text, which "
                                 "needs its tokenizer: the model folder has none")
            ids = list(self._tokenizer.encode(text, add_special_tokens=False))
            if ids.count(self.image_token_id) != self.layout.num_placeholders(size):
                raise ValueError("the tokenizer does not read the image token of this model's prompts as "
                                 f"its id {self.image_token_id}")
            self._spans[text] = ids
        return ids

    def _embedded(self, span: list[int]) -> np.ndarray | None:
        """ImageInput.embedded of a span: None where every token is a placeholder."""
        mask = np.asarray(span) == self.image_token_id
        return None if mask.all() else mask

    def image_spans(self, images: Sequence[Any]) -> list[list[int]]:
        """Each image's span, from its size alone (its pixels are not processed)."""
        return [self.span(image.size if isinstance(image, PixelValues) else _hw(load_image(image)))
                for image in images]

    def expand_placeholders(self, token_ids: Sequence[int], spans: list[list[int]]
                            ) -> tuple[list[int], list[int]]:
        """(the prompt with each image token made the k-th image's span ``spans[k]``, each span's first
        token); ValueError where the image tokens do not match the images."""
        if self._expander is not None:
            return self._expander(token_ids, spans)
        ids, token = list(token_ids), self.image_token_id
        found = ids.count(token)
        counts = [span.count(token) for span in spans]
        if found == len(spans):
            todo = iter(spans)
            ids = [t for tok in ids for t in (next(todo) if tok == token else [tok])]
        elif found != sum(counts) or not spans:
            raise ValueError(f"the prompt has {found} image token(s) for {len(spans)} image(s): put one "
                             f"image token (id {token}) in the prompt for each image")
        at = [i for i, tok in enumerate(ids) if tok == token]
        offsets, k = [], 0
        for span, n in zip(spans, counts):
            start = at[k] - span.index(token)  # a span may open with tile tags before its first placeholder
            if start < 0 or ids[start:start + len(span)] != span:
                tags = "" if len(span) == n else ", with its tile tags as the model's processor writes them"
                raise ValueError(f"an image's {n} placeholder tokens must stand together in the prompt{tags}")
            offsets.append(start)
            k += n
        return ids, offsets

    def preprocess(self, images: Sequence[Any]) -> tuple[PixelValues, ...]:
        """Each image's pixel values and size, in order (ValueError for one that cannot be read; a PixelValues
        is taken as it is): the server calls this off the step loop."""
        todo = [i for i, image in enumerate(images) if not isinstance(image, PixelValues)]
        out: list[Any] = list(images)
        if todo:
            pil = [load_image(images[i]) for i in todo]
            if self.layout is not None:
                made = self.layout.process(self.hf_processor, pil)
            else:
                for image in pil:  # the model's refusals (Pixtral's image too thin) before the processor's
                    self.span(_hw(image))
                made = self.hf_processor(images=pil, return_tensors="pt", **self._call_kwargs)
            if self._own_sizes:  # Pixtral: the batch padded to its largest image; each cut to its own size
                sizes = made["image_sizes"].tolist()
                for i, image, pixels, (h, w) in zip(todo, pil, made["pixel_values"], sizes):
                    out[i] = PixelValues(pixels[:, :h, :w].float().contiguous(), _hw(image))
                return tuple(out)
            if "image_grid_thw" in made:  # Qwen2-VL: every image's patches in one tensor, and their grids
                grids = [tuple(g) for g in made["image_grid_thw"].tolist()]
                patches = made["pixel_values"].split([t * h * w for t, h, w in grids])
                for i, image, pixels, grid in zip(todo, pil, patches, grids):
                    out[i] = PixelValues(pixels.float().contiguous(), _hw(image), grid)
                return tuple(out)
            for i, image, pixels in zip(todo, pil, made["pixel_values"]):
                size = _hw(image)
                tiles = pixels if pixels.dim() == 4 else pixels[None]  # [tiles, C, H, W]; padded past its own
                out[i] = PixelValues(tiles[:self._tiles_for(size)].float().contiguous(), size)
        return tuple(out)


def _has_image_processor(folder: Path) -> bool:
    """Whether a model folder saves an image processor's settings."""
    if (folder / "preprocessor_config.json").is_file():
        return True
    processor = folder / "processor_config.json"
    try:
        return processor.is_file() and "image_processor" in json.loads(processor.read_text())
    except (OSError, ValueError):  # unreadable: as if absent, the model's default processor
        return False


def _hw(image: Any) -> tuple[int, int]:
    """A PIL image's (height, width)."""
    return image.height, image.width


def _key(pixel_values: torch.Tensor) -> bytes:
    return hashlib.blake2b(pixel_values.numpy().tobytes(), digest_size=_KEY_BYTES).digest()
