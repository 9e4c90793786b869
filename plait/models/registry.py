"""Maps an HF ``architectures`` name to the plait class that implements it."""

from __future__ import annotations

from torch import nn

_MODELS: dict[str, tuple[str, str]] = {
    # architecture: (module, class)
    "LlamaForCausalLM": ("plait.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("plait.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("plait.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("plait.models.llama", "LlamaForCausalLM"),
    "MixtralForCausalLM": ("plait.models.llama", "MoeForCausalLM"),
    "Qwen2MoeForCausalLM": ("plait.models.llama", "MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("plait.models.llama", "MoeForCausalLM"),
    "Mamba2ForCausalLM": ("plait.models.mamba2", "Mamba2ForCausalLM"),
    "BambaForCausalLM": ("plait.models.bamba", "BambaForCausalLM"),
    "NemotronHForCausalLM": ("plait.models.nemotron_h", "NemotronHForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {supported_architectures()}"
        )
    import importlib

    module, cls = _MODELS[architecture]
    return getattr(importlib.import_module(module), cls)
