"""What the engine hands back: vLLM-shaped RequestOutput and CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprobs:
    """Logprob of one token (generated, or of the prompt) and the top-n alternatives at its position."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)  # token id -> logprob, best first


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
