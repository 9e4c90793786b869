"""Content parts in chat messages (text, and OpenAI-style images: ``image_url``, or a PIL image under
``image_pil``) handed to the chat template in the form it takes: parts, or text (vLLM's content formats)."""

from __future__ import annotations

import functools
from typing import Any

import jinja2
from jinja2 import nodes

IMAGE_PART_TYPES = ("image_url", "image_pil", "image")
# OpenAI-style video parts (vLLM's): refused by name, plait takes no video.
VIDEO_PART_TYPES = ("video_url", "video")
# A template that takes text gets a message's text parts joined by newlines, as vLLM's chat parser joins them.
TEXT_PART_SEPARATOR = "\n"
# vLLM's --chat-template-content-format: what a template gets as a message's content. "string": text, before
# which an image token is written for each image; "openai": OpenAI-style parts ({"type": "text", "text": ..}
# and {"type": "image"}, for which LLaVA's template writes an image token); "auto": "openai" for a template
# that loops over a message's content, else "string".
AUTO_CONTENT_FORMAT = "auto"
STRING_CONTENT_FORMAT = "string"
OPENAI_CONTENT_FORMAT = "openai"
CONTENT_FORMATS = (AUTO_CONTENT_FORMAT, STRING_CONTENT_FORMAT, OPENAI_CONTENT_FORMAT)
_CONTENT_KEY = "content"
_MESSAGES_VAR = "messages"


def content_format(template: str | None, chosen: str = AUTO_CONTENT_FORMAT) -> str:
    """The content format a template gets: ``chosen``, or for "auto" what the template's code reads."""
    if chosen not in CONTENT_FORMATS:
        raise ValueError(f"unknown chat template content format {chosen!r}: one of "
                         f"{', '.join(CONTENT_FORMATS)}")
    if chosen != AUTO_CONTENT_FORMAT:
        return chosen
    return OPENAI_CONTENT_FORMAT if template_takes_parts(template) else STRING_CONTENT_FORMAT


@functools.lru_cache(maxsize=64)
def template_takes_parts(template: str | None) -> bool:
    """Whether the template loops over a message's content (``for part in message['content']``), read from
    its syntax tree as vLLM's "auto" reads it: through the names the template gives messages and their
    content (``{% set loop_messages = messages[1:] %}``, ``{% set content = message.content %}``), the
    message lists filtered or sliced. A template that does not parse takes text; rendering it says why."""
    if not isinstance(template, str) or not template:
        return False
    try:
        tree = _template_environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return False
    names = _ContentNames()
    names.collect(tree)
    return any(names.is_content(loop.iter) for loop in tree.find_all(nodes.For))


def _template_environment() -> jinja2.Environment:
    """The environment HF renders chat templates in (its extensions' tags parse), else plain Jinja's."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        return _compile_jinja_template("").environment
    except Exception:  # a transformers without it: its tags are rare in templates that loop over content
        return jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])


class _ContentNames:
    """The template's names for message lists, single messages and message contents."""

    def __init__(self) -> None:
        self.lists = {_MESSAGES_VAR}
        self.messages: set[str] = set()
        self.contents: set[str] = set()

    def collect(self, tree: nodes.Template) -> None:
        # A name may be bound before the statement that gives it its meaning appears, so go round until no
        # new name is learnt.
        while True:
            known = self._count()
            for node in tree.find_all((nodes.Assign, nodes.For)):
                self._learn(node)
            if self._count() == known:
                return

    def _count(self) -> int:
        return len(self.lists) + len(self.messages) + len(self.contents)

    def _learn(self, node: nodes.Assign | nodes.For) -> None:
        if isinstance(node, nodes.For):
            if self.is_list(node.iter) and isinstance(node.target, nodes.Name):
                self.messages.add(node.target.name)
            return
        if not isinstance(node.target, nodes.Name):
            return
        for test, names in ((self.is_list, self.lists), (self.is_message, self.messages),
                            (self.is_content, self.contents)):
            if test(node.node):
                names.add(node.target.name)

    def is_list(self, expr: nodes.Node) -> bool:
        expr = _unfiltered(expr)
        if isinstance(expr, nodes.Name):
            return expr.name in self.lists
        return (isinstance(expr, nodes.Getitem) and isinstance(expr.arg, nodes.Slice)
                and self.is_list(expr.node))

    def is_message(self, expr: nodes.Node) -> bool:
        expr = _unfiltered(expr)
        if isinstance(expr, nodes.Name):
            return expr.name in self.messages
        return (isinstance(expr, nodes.Getitem) and not isinstance(expr.arg, nodes.Slice)
                and self.is_list(expr.node))

    def is_content(self, expr: nodes.Node) -> bool:
        expr = _unfiltered(expr)
        if isinstance(expr, nodes.Name):
            return expr.name in self.contents
        if isinstance(expr, nodes.Getattr):
            return expr.attr == _CONTENT_KEY and self.is_message(expr.node)
        return (isinstance(expr, nodes.Getitem) and isinstance(expr.arg, nodes.Const)
                and expr.arg.value == _CONTENT_KEY and self.is_message(expr.node))


def _unfiltered(expr: nodes.Node) -> nodes.Node:
    """``messages | selectattr(..)`` is still the messages."""
    while isinstance(expr, nodes.Filter) and expr.node is not None:
        expr = expr.node
    return expr


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
            elif kind in VIDEO_PART_TYPES:
                raise ValueError(f"video inputs are not supported ({kind!r} part): send images or text")
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
                 model: str, chosen_format: str = AUTO_CONTENT_FORMAT
                 ) -> tuple[list[dict[str, Any]], list[Any]]:
    """A conversation as ``template`` takes it under ``chosen_format`` (content_format), and its images in
    order (split_chat_images). ``image_text``: the image token's text and a newline, for an image model;
    None for a text model, which refuses images (ValueError)."""
    takes_parts = content_format(template, chosen_format) == OPENAI_CONTENT_FORMAT
    if image_text is None and has_image_parts(conversation):
        raise ValueError(f"{model} takes no images: send text messages")
    return split_chat_images(conversation, takes_parts, image_text or "")


def image_token_text(tokenizer: Any, image_token_ids: list[int]) -> str:
    """What a text-taking chat template writes for one image: its tokens (the image token, or Qwen2-VL's
    vision start, image pad and vision end: ImageProcessor.prompt_token_ids), and a newline."""
    return tokenizer.decode(image_token_ids) + "\n"
