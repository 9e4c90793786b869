"""Maps an HF ``architectures`` name to the plait class that implements it."""

from __future__ import annotations

from torch import nn

_MODELS: dict[str, tuple[str, str]] = {
    # architecture: (module, class)
    "LlamaForCausalLM": ("plait.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("plait.models.llama", "LlamaForCausalLM"),
    "Ministral3ForCausalLM": ("plait.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("plait.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("plait.models.llama", "LlamaForCausalLM"),
    "Phi3ForCausalLM": ("plait.models.llama", "Phi3ForCausalLM"),
    "GemmaForCausalLM": ("plait.models.gemma", "Gemma1ForCausalLM"),
    "Gemma2ForCausalLM": ("plait.models.gemma", "GemmaForCausalLM"),
    "GraniteForCausalLM": ("plait.models.granite", "GraniteForCausalLM"),
    "GraniteMoeForCausalLM": ("plait.models.granite", "GraniteMoeForCausalLM"),
    "GraniteMoeSharedForCausalLM": ("plait.models.granite", "GraniteMoeForCausalLM"),
    "OlmoeForCausalLM": ("plait.models.olmo", "OlmoeForCausalLM"),
    "Gemma3ForCausalLM": ("plait.models.gemma", "GemmaForCausalLM"),
    "Gemma3ForConditionalGeneration": ("plait.models.gemma3_vision", "Gemma3ForConditionalGeneration"),
    "Olmo2ForCausalLM": ("plait.models.olmo", "OlmoForCausalLM"),
    "Olmo3ForCausalLM": ("plait.models.olmo", "OlmoForCausalLM"),
    "Exaone4ForCausalLM": ("plait.models.olmo", "Exaone4ForCausalLM"),
    "Mistral3ForConditionalGeneration": ("plait.models.pixtral", "Mistral3ForConditionalGeneration"),
    "LlavaForConditionalGeneration": ("plait.models.llava", "LlavaForConditionalGeneration"),
    "LlavaNextForConditionalGeneration": ("plait.models.llava", "LlavaNextForConditionalGeneration"),
    "Qwen2VLForConditionalGeneration": ("plait.models.qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("plait.models.qwen2_vl", "Qwen2_5_VLForConditionalGeneration"),
    "Idefics3ForConditionalGeneration": ("plait.models.idefics3", "Idefics3ForConditionalGeneration"),
    "SmolVLMForConditionalGeneration": ("plait.models.idefics3", "Idefics3ForConditionalGeneration"),
    "Qwen3VLForConditionalGeneration": ("plait.models.qwen3_vl", "Qwen3VLForConditionalGeneration"),
    "Qwen3VLMoeForConditionalGeneration": ("plait.models.qwen3_vl", "Qwen3VLMoeForConditionalGeneration"),
    "MixtralForCausalLM": ("plait.models.llama", "MoeForCausalLM"),
    "Qwen2MoeForCausalLM": ("plait.models.llama", "MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("plait.models.llama", "MoeForCausalLM"),
    "Glm4MoeForCausalLM": ("plait.models.glm4_moe", "Glm4MoeForCausalLM"),
    "DeepseekV2ForCausalLM": ("plait.models.deepseek", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("plait.models.deepseek", "DeepseekV2ForCausalLM"),
    "Mamba2ForCausalLM": ("plait.models.mamba2", "Mamba2ForCausalLM"),
    "BambaForCausalLM": ("plait.models.bamba", "BambaForCausalLM"),
    "NemotronHForCausalLM": ("plait.models.nemotron_h", "NemotronHForCausalLM"),
    "GraniteMoeHybridForCausalLM": ("plait.models.granite4", "GraniteMoeHybridForCausalLM"),
    "SmolLM3ForCausalLM": ("plait.models.smollm3", "SmolLM3ForCausalLM"),
    "SeedOssForCausalLM": ("plait.models.llama", "SeedOssForCausalLM"),
    "GlmForCausalLM": ("plait.models.glm", "GlmForCausalLM"),
    "Ernie4_5ForCausalLM": ("plait.models.llama", "PairedRotaryForCausalLM"),
    "Glm4ForCausalLM": ("plait.models.glm", "Glm4ForCausalLM"),
    "GptOssForCausalLM": ("plait.models.gpt_oss", "GptOssForCausalLM"),
    "CohereForCausalLM": ("plait.models.cohere", "CohereForCausalLM"),
    "Cohere2ForCausalLM": ("plait.models.cohere", "Cohere2ForCausalLM"),
    # EAGLE draft heads, run only as speculative_config's "eagle" / "eagle3" model (plait.engine.eagle).
    "EagleLlamaForCausalLM": ("plait.models.eagle", "EagleLlamaForCausalLM"),
    "Eagle3LlamaForCausalLM": ("plait.models.eagle", "Eagle3LlamaForCausalLM"),
    "LlamaForCausalLMEagle3": ("plait.models.eagle", "Eagle3LlamaForCausalLM"),
    # MTP draft heads: a checkpoint's own multi-token-prediction layer, run only as speculative_config's
    # "mtp" (plait.models.mtp; vLLM's names).
    "Glm4MoeMTPModel": ("plait.models.mtp", "Glm4MoeMTPModel"),
    "DeepSeekMTPModel": ("plait.models.mtp", "DeepSeekMTPModel"),
    # Base models (no LM head; their checkpoints' names lack the "model." prefix): embedding models such as
    # e5-mistral (MistralModel) or a Qwen3Model, run only by the pooling runner.
    "LlamaModel": ("plait.models.llama", "LlamaForCausalLM"),
    "MistralModel": ("plait.models.llama", "LlamaForCausalLM"),
    "Qwen2Model": ("plait.models.llama", "LlamaForCausalLM"),
    "Qwen3Model": ("plait.models.llama", "LlamaForCausalLM"),
}
BASE_MODEL_ARCHITECTURES = frozenset({"LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model"})
# Encoders (bidirectional attention, no LM head): embedding models such as bge, e5, all-MiniLM and bge-m3, run
# only by the pooling runner.
ENCODER_ARCHITECTURES = frozenset({"BertModel", "RobertaModel", "XLMRobertaModel"})
_MODELS.update({arch: ("plait.models.bert", "BertModel") for arch in ENCODER_ARCHITECTURES})
# Encoder classifiers: cross-encoder rerankers (ms-marco-MiniLM, bge-reranker-base / -v2-m3), pooling only.
ENCODER_CLASSIFIERS = {"BertForSequenceClassification": "BertForSequenceClassification",
                       "RobertaForSequenceClassification": "RobertaForSequenceClassification",
                       "XLMRobertaForSequenceClassification": "RobertaForSequenceClassification"}
_MODELS.update({arch: ("plait.models.bert", cls) for arch, cls in ENCODER_CLASSIFIERS.items()})
ENCODER_ARCHITECTURES = ENCODER_ARCHITECTURES | frozenset(ENCODER_CLASSIFIERS)
# Classifiers and reward models (a score head on the last token), run only by the pooling runner.
CLASSIFIER_ARCHITECTURES = frozenset({"LlamaForSequenceClassification", "MistralForSequenceClassification",
                                      "Qwen2ForSequenceClassification", "Qwen3ForSequenceClassification"})
_MODELS.update({arch: ("plait.models.llama", "LlamaForSequenceClassification")
                for arch in CLASSIFIER_ARCHITECTURES})


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_runner(runner: str, architecture: str) -> str:
    """"generate" or "pooling" for EngineConfig.runner: "auto" pools a base model's, an encoder's or a
    classifier's checkpoint and generates with any other; none of those can generate (no LM head)."""
    pools = architecture in BASE_MODEL_ARCHITECTURES | CLASSIFIER_ARCHITECTURES | ENCODER_ARCHITECTURES
    if runner == "auto":
        return "pooling" if pools else "generate"
    if runner == "generate" and architecture in ENCODER_ARCHITECTURES:
        raise ValueError(f"{architecture} is an encoder pooling model (bidirectional attention, no LM "
                         "head): it cannot generate text; serve it with runner 'pooling' (plait serve "
                         "--runner pooling)")
    if runner == "generate" and pools:
        raise ValueError(f"{architecture} has no LM head: it cannot generate text; serve it with runner "
                         "'pooling' (plait serve --runner pooling)")
    return runner


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {supported_architectures()}"
        )
    import importlib

    module, cls = _MODELS[architecture]
    return getattr(importlib.import_module(module), cls)
