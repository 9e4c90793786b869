"""LoRARequest: which adapter a request runs with (vLLM's fields), and the server's named adapters."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's LoRARequest: a name for people, an id unique per adapter, and the adapter's PEFT folder.

    The id keys everything the engine keeps of an adapter (its slot, its prefix-cache key); two requests
    with one id must name the same folder. ``base_model_name`` is what the server's /v1/models reports as
    the adapter's parent (None: the first served model name).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        lora_id = self.lora_int_id
        if isinstance(lora_id, bool) or not isinstance(lora_id, int) or lora_id < 1:
            # vLLM's rule too: 0 would read as "no adapter" in places that test the id's truth.
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty path, got {self.lora_path!r}")

    @property
    def cache_key(self) -> bytes:
        """Extra prefix-cache hash input: KV blocks computed under one adapter are never another's."""
        return f"lora:{self.lora_int_id}".encode()


@dataclass(frozen=True)
class LoRAModulePath:
    """One of `plait serve --lora-modules`: a model name clients may send, and the adapter it runs."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, text: str) -> LoRAModulePath:
        """vLLM's two forms: ``name=path``, or JSON ``{"name": ..., "path": ..., "base_model_name": ...}``."""
        text = text.strip()
        if text.startswith("{"):
            try:
                spec = json.loads(text)
            except json.JSONDecodeError as err:
                raise ValueError(f"invalid JSON in LoRA module {text!r}: {err}") from err
            fields = set(spec) if isinstance(spec, dict) else set()
            if not {"name", "path"} <= fields or fields - {"name", "path", "base_model_name"}:
                raise ValueError(f"a LoRA module as JSON needs 'name' and 'path' (and may have "
                                 f"'base_model_name'), got {text!r}")
            return cls(str(spec["name"]), str(spec["path"]), spec.get("base_model_name"))
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"a LoRA module is name=path or a JSON object, got {text!r}")
        return cls(name, path)
