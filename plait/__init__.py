"""plait: an LLM inference and serving engine where every step plaits prefill chunks and decodes."""

from plait.config import EngineConfig
from plait.inputs import EmbedsPrompt, TextPrompt, TokensPrompt
from plait.lora.request import LoRARequest
from plait.outputs import (
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
)
from plait.pooling_params import PoolingParams
from plait.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it lazily so `import plait` stays light.
    if name == "LLM":
        from plait.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'plait' has no attribute {name!r}")


__all__ = ["LLM", "BeamSearchParams", "ClassificationRequestOutput", "CompletionOutput",
           "EmbeddingRequestOutput", "EngineConfig", "LoRARequest", "PoolingParams", "PoolingRequestOutput",
           "RequestOutput", "SamplingParams", "StructuredOutputsParams", "TextPrompt", "TokensPrompt",
           "EmbedsPrompt"]
