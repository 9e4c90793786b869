"""Per-request pooling parameters (embeddings), with vLLM's field names and validation."""

from __future__ import annotations

from dataclasses import dataclass

from plait.sampling_params import TRUNCATE_TO_CONTEXT

# What a pooling model gives: an embedding, or a classifier's probabilities, for the whole prompt; or, as
# vLLM's token_embed and token_classify (LLM.reward: token and process reward models), one per prompt token.
POOLING_TASKS = ("embed", "classify", "token_embed", "token_classify")
TOKEN_TASKS = ("token_embed", "token_classify")
# The sequence task that each token task is the per-token form of (what the model must be).
SEQUENCE_TASK_OF = {"embed": "embed", "classify": "classify",
                    "token_embed": "embed", "token_classify": "classify"}


@dataclass
class PoolingParams:
    """What an embedding request asks of a pooling model (``LLM.embed``, ``/v1/embeddings``).

    ``dimensions``: keep the first d of the pooled vector (a Matryoshka model's shorter embedding), before
    it is normalised. ``normalize``: L2-normalise the embedding (None: the model's pooler decides; on by
    default, off where a sentence-transformers config has no Normalize module). ``truncate_prompt_tokens``:
    keep the prompt's last k tokens (-1: as many as the context holds), as SamplingParams' does. ``task``:
    what the caller expects of the model (LLM.embed, LLM.classify and LLM.reward set it; None: whatever the
    model does): "embed" or "classify" one output for the prompt, "token_embed" or "token_classify" one per
    prompt token (an embedding model's each normalised as an embedding is, a classifier's each its
    probabilities).
    """

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    task: str | None = None

    @property
    def per_token(self) -> bool:
        """Whether the output has a row per prompt token (token_embed, token_classify): every prompt position
        is computed, none served from the prefix cache."""
        return self.task in TOKEN_TASKS

    def __post_init__(self) -> None:
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int)):
            raise ValueError(f"dimensions must be an int or None, got {d!r}")
        if d is not None and d < 1:
            raise ValueError("Dimensions must be greater than 0")  # vLLM's words
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true, false or None, got {self.normalize!r}")
        if self.task not in (None, *POOLING_TASKS):
            raise ValueError(f"task must be one of {POOLING_TASKS} or None, got {self.task!r}")
        k = self.truncate_prompt_tokens
        if k is not None:
            if isinstance(k, bool) or not isinstance(k, int):
                raise ValueError(f"truncate_prompt_tokens must be an int or None, got {k!r}")
            if k < 1 and k != TRUNCATE_TO_CONTEXT:
                raise ValueError(f"truncate_prompt_tokens must be >= 1 or {TRUNCATE_TO_CONTEXT}, got {k}")


def score_pairs(num_first: int, num_second: int) -> list[tuple[int, int]]:
    """The (first, second) input indices a score request compares, as vLLM pairs them: one first input with
    every second one, else the two lists in order (they must then be as long)."""
    if num_first == 0 or num_second == 0:
        raise ValueError("scoring needs at least one input on each side")
    if num_first == 1:
        return [(0, j) for j in range(num_second)]
    if num_first != num_second:
        raise ValueError(f"scoring pairs the inputs in order: got {num_first} first inputs and {num_second} "
                         "second ones (give one first input to compare with every second one)")
    return [(i, i) for i in range(num_first)]
