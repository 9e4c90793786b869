"""Images in chat messages: OpenAI-style content parts (``image_url``, or a PIL image under ``image_pil``)
taken out of a conversation, which goes to the chat template as the template expects its content."""

from __future__ import annotations

import re
from typing import Any

IMAGE_PART_TYPES = ("image_url", "image_pil", "image")
# A template that takes text gets a message's text parts joined by newlines, as vLLM's chat parser joins them.
TEXT_PART_SEPARATOR = "\n"
# A template that loops over a message's content takes OpenAI-style parts (LLaVA's writes an image token for
# each {"type": "image"} part); any other takes text, before which an image token is written for each image
# (as vLLM renders "string" templates).
_LOOPS_OVER_CONTENT = re.compile(
    r"for\s+\w+\s+in\s+(message|messages\[[^\]]*\])(\[['\"]content['\"]\]|\.content)")


def template_takes_parts(template: str | None) -> bool:
    return bool(template) and _LOOPS_OVER_CONTENT.search(template) is not None


def split_chat_images(conversation: list[dict[str, Any]], takes_parts: bool, image_text: str
                      ) -> tuple[list[dict[str, Any]], list[Any]]:
    """(the conversation as its template takes it, its images in order). Each image part becomes
    ``{"type": "image"}`` for a template that ``takes_parts``; for one that takes text, the message's text
    is its text parts joined by newlines, after ``image_text`` (the image token, and a newline) once per
    image."""
    images: list[Any] = []
    out = []
    for message in conversation:
        if not isinstance(message, dict):  # render_chat refuses it by name
            out.append(message)
            continue
        content = message.get("content")
        if not isinstance(content, list):
            if takes_parts and isinstance(content, str):
                message = {**message, "content": [{"type": "text", "text": content}]}
            out.append(message)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": part["text"]})
            elif kind in IMAGE_PART_TYPES:
                images.append(_image_of(part, kind))
                parts.append({"type": "image"})
            else:
                raise ValueError(f"unsupported content part {part!r}: parts are 'text' or 'image_url'")
        if not takes_parts:
            count = sum(p["type"] == "image" for p in parts)
            text = TEXT_PART_SEPARATOR.join(p["text"] for p in parts if p["type"] == "text")
            parts = image_text * count + text
        out.append({**message, "content": parts})
    return out, images


def _image_of(part: dict[str, Any], kind: str) -> Any:
    value = part.get(kind)
    if kind == "image_url":
        url = value.get("url") if isinstance(value, dict) else value
        if not isinstance(url, str):
            raise ValueError(f"an image_url part needs a url, got {part!r}")
        return url
    if value is None:
        raise ValueError(f"an {kind} part needs its image, got {part!r}")
    return value


def has_image_parts(conversation: list[dict[str, Any]]) -> bool:
    return any(isinstance(m, dict) and isinstance(m.get("content"), list)
               and any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES for p in m["content"])
               for m in conversation)


def prepare_chat(conversation: list[dict[str, Any]], template: str | None, image_text: str | None,
                 model: str) -> tuple[list[dict[str, Any]], list[Any]]:
    """A conversation as ``template`` takes it, and its images in order (split_chat_images). ``image_text``:
    the image token's text and a newline, for an image model; None for a text model, whose messages' text
    parts are joined (as the server joins them), and which refuses images (ValueError)."""
    if image_text is None:
        if has_image_parts(conversation):
            raise ValueError(f"{model} takes no images: send text messages")
        return split_chat_images(conversation, False, "")[0], []
    return split_chat_images(conversation, template_takes_parts(template), image_text)


def image_token_text(tokenizer: Any, image_token_id: int) -> str:
    """What a text-taking chat template writes for one image: the image token, and a newline."""
    return tokenizer.decode([image_token_id]) + "\n"
