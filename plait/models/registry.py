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
    # Base models (no LM head; their checkpoints' names lack the "model." prefix): embedding models such as
    # e5-mistral (MistralModel) or a Qwen3Model, run only by the pooling runner.
    "LlamaModel": ("plait.models.llama", "LlamaForCausalLM"),
    "MistralModel": ("plait.models.llama", "LlamaForCausalLM"),
    "Qwen2Model": ("plait.models.llama", "LlamaForCausalLM"),
    "Qwen3Model": ("plait.models.llama", "LlamaForCausalLM"),
}
BASE_MODEL_ARCHITECTURES = frozenset({"LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model"})


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_runner(runner: str, architecture: str) -> str:
    """"generate" or "pooling" for EngineConfig.runner: "auto" pools a base model's checkpoint and generates
    with any other; a base model cannot generate (it has no LM head)."""
    if runner == "auto":
        return "pooling" if architecture in BASE_MODEL_ARCHITECTURES else "generate"
    if runner == "generate" and architecture in BASE_MODEL_ARCHITECTURES:
        raise ValueError(f"{architecture} is a base model without an LM head: it cannot generate text; "
                         "serve it with runner 'pooling' (plait serve --runner pooling) for embeddings")
    return runner


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {supported_architectures()}"
        )
    import importlib

    module, cls = _MODELS[architecture]
    return getattr(importlib.import_module(module), cls)
