"""Prompt dicts (vLLM's TextPrompt, TokensPrompt and EmbedsPrompt): what LLM takes beside strings and ids."""

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


class EmbedsPrompt(_PromptOptions):
    """A prompt as embeddings (a [tokens, hidden] torch.Tensor), under EngineConfig.enable_prompt_embeds."""

    prompt_embeds: Any


PromptType = str | TextPrompt | TokensPrompt | EmbedsPrompt | Sequence[int]
