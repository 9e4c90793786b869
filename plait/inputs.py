"""Prompt dicts (vLLM's TextPrompt and TokensPrompt): what LLM's methods take beside strings and ids."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypedDict


class _PromptOptions(TypedDict, total=False):
    # {"image": image or [images]}, for an image-text model
    multi_modal_data: dict[str, Any]
    # Prefix-cache blocks are shared only between prompts of the same salt (vLLM's).
    cache_salt: str


class TextPrompt(_PromptOptions):
    """A prompt as text, tokenized by the engine."""

    prompt: str


class TokensPrompt(_PromptOptions):
    """A prompt as token ids, as they are."""

    prompt_token_ids: list[int]


PromptType = str | TextPrompt | TokensPrompt | Sequence[int]
