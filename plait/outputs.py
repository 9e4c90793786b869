"""What the engine hands back: vLLM-shaped RequestOutput and CompletionOutput, and pooling models' outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class TokenLogprobs:
    """Logprob of one token (generated, or of the prompt) and the top-n alternatives at its position."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)  # token id -> logprob, best first
    # 1-based rank of token_id in the whole vocabulary: how many ids have a logprob >= its own (vLLM's
    # Logprob.rank; a beam search's candidate, taken from ``top``, by its place there). None: not known.
    rank: int | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str  # cumulative output text
    token_ids: list[int]  # cumulative output token ids
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    # The stop string or stop token id that ended it; with "error", what went wrong (a structured output's
    # grammar failed).
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per token when requested
    delta_text: str = ""  # text produced by the step that made this output
    delta_token_ids: list[int] = field(default_factory=list)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs: one entry per prompt token (None for the first, which has no
    # context), complete from the first output that carries a generated token on.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    metrics: dict = field(default_factory=dict)  # arrival/first-token/finish times (seconds)


@dataclass
class PoolingOutput:
    """A pooling model's output for one prompt (vLLM's name)."""

    data: torch.Tensor  # [dimensions] fp32 on the host: the embedding


@dataclass
class PoolingRequestOutput:
    """What the engine hands back for an embedding request, once, when its prompt has been pooled (vLLM's
    name); ``finished`` is always true."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)  # arrival and finish times (seconds)


@dataclass
class EmbeddingOutput:
    """One embedding as a list of floats (vLLM's ``EmbeddingOutput``)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """``LLM.embed``'s result for one prompt (vLLM's ``EmbeddingRequestOutput``)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(output.request_id, output.prompt_token_ids, EmbeddingOutput(output.outputs.data.tolist()),
                   output.finished)


@dataclass
class ClassificationOutput:
    """A classifier's probabilities for one prompt, one per label (vLLM's ``ClassificationOutput``)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """``LLM.classify``'s result for one prompt (vLLM's ``ClassificationRequestOutput``)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> ClassificationRequestOutput:
        probs = ClassificationOutput(output.outputs.data.tolist())
        return cls(output.request_id, output.prompt_token_ids, probs, output.finished)


@dataclass
class ScoringOutput:
    """How alike two inputs are (vLLM's ``ScoringOutput``): the cosine similarity of their embeddings."""

    score: float


@dataclass
class ScoringRequestOutput:
    """``LLM.score``'s result for one pair (vLLM's ``ScoringRequestOutput``): ``prompt_token_ids`` are the
    first input's then the second's."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True
