"""A request's tokens and progress: the only state the scheduler reasons about."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from plait.engine.state_slots import NO_STATE_SLOT
from plait.lora.slots import NO_LORA_SLOT
from plait.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from plait.engine.grammar import Grammar
    from plait.lora.adapter import LoRAAdapter
    from plait.multimodal.images import ImageInput
    from plait.pooling_params import PoolingParams


# The token id a prompt of embeddings holds at each position: any id the embedding layer can look up, since
# its output there is replaced.
PROMPT_EMBEDS_PLACEHOLDER_ID = 0


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no KV blocks
    RUNNING = "running"  # holds KV blocks; scheduled every step until it finishes
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # the request's grammar failed (vLLM's name); stop_reason says why


@dataclass(eq=False)  # identity semantics: requests live in sets and as dict keys
class Request:
    """One generation. Its remaining work is always ``num_tokens - num_computed_tokens``.

    There is no prefill/decode flag: a request is mid-prompt while
    ``num_computed_tokens < num_prompt_tokens`` and decoding afterwards; a row is a first chunk iff
    ``num_computed_tokens == 0`` (set by the scheduler at admission and on preemption).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved by the engine from sampling_params and max_model_len
    eos_token_ids: frozenset[int] = frozenset()  # set by the engine from the model; empty if ignore_eos
    # sampling_params.host_choices (guided_choice), tokenized by the engine: the outputs allowed, as ids.
    choice_token_ids: tuple[tuple[int, ...], ...] | None = None
    # sampling_params.grammar_spec (json, regex, grammar, json_object, or a choice after reasoning_end),
    # compiled by the engine: this sequence's own matcher, which has seen every output token on the host.
    grammar: Grammar | None = None
    # sampling_params.bad_words, tokenized by the engine: the token sequences the output must not contain.
    bad_words_token_ids: tuple[tuple[int, ...], ...] | None = None
    # The LoRA adapter it runs with (read and checked by the engine), or None for the base model.
    lora: LoRAAdapter | None = None
    # Under the "priority" scheduling policy, lower values are served first (vLLM's meaning); the engine
    # refuses any other value than 0 under other policies.
    priority: int = 0
    arrival_index: int | None = None  # set by Scheduler.add: the order among requests of equal priority
    # Set for an embedding request (the pooling runner): its prompt is run and pooled, nothing is sampled
    # (max_tokens 0), and it finishes when the step that computes the prompt's end is collected.
    pooling_params: PoolingParams | None = None
    # The prompt's images, in order (image models): each fills its placeholder tokens. Set by the engine.
    images: tuple[ImageInput, ...] = ()
    # Prompt token ranges [start, end) whose tokens attend to each other both ways (Gemma 3's images: each
    # image's placeholders), in order: a prefill chunk never ends inside one (the scheduler's rule), so every
    # token of a range is computed with the whole range's keys. Set by the engine; () for other models.
    attention_spans: tuple[tuple[int, int], ...] = ()
    # Whether a custom logits processor that reads output ids applies to it (LogitsProcessor.applies_to and
    # reads_output_token_ids): its sampling then needs the last token on the host. Set by the engine.
    read_by_logits_processor: bool = False
    # The prompt as embeddings (EngineConfig.enable_prompt_embeds): a [num prompt tokens, hidden] host tensor
    # in the model's dtype, which replaces the embedding layer's output at the prompt's positions; its
    # prompt_token_ids are then placeholders (PROMPT_EMBEDS_PLACEHOLDER_ID) that no output shows. Set by the
    # engine.
    prompt_embeds: torch.Tensor | None = None

    # Set by the scheduler.
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in this request's blocks
    # Tokens to compute before the next sample: the prompt, or prompt + outputs after a preemption
    # by recompute. Set at creation and by the scheduler when it preempts.
    num_prefill_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)  # KV block table, in token order
    # Row of every recurrent layer's state tensors (models with Mamba layers); held from admission to
    # finish, abort or preemption.
    state_slot: int = NO_STATE_SLOT
    # The LoRA slot holding its adapter on the device; held from admission to finish, abort or preemption.
    lora_slot: int = NO_LORA_SLOT
    # Set by the KV cache manager (prefix caching).
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks, memoised
    num_hashed_blocks: int = 0  # leading blocks already registered in (or taken from) the cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at the last admission
    num_host_cached_tokens: int = 0  # of those, copied back from host memory (KV offloading)
    cache_key: bytes = b""  # extra hash input (LoRA, multimodal ids) so unlike contexts never share
    # vLLM's cache_salt: its digest keys the first block, so the request's blocks are found only by requests
    # with the same salt (a tenant's secret keeps others from timing cache hits to guess its prompts).
    cache_salt: bytes = b""
    num_preemptions: int = 0
    # When a step first admitted it (time.monotonic()), set by the scheduler: vLLM's queue time ends and its
    # prefill time starts there (a re-admission after a preemption keeps the first).
    first_scheduled_time: float | None = None

    # Set by the engine after each step that samples this request.
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens sampled by launched steps whose ids have not reached the host yet (0, 1, or 2 while one
    # step is collected as the next is launched). Set by the engine at launch and at collection.
    num_pending_tokens: int = 0
    finish_reason: FinishReason | None = None
    # The stop string or stop token id that ended it; with FinishReason.ERROR, what went wrong.
    stop_reason: str | int | None = None

    def __post_init__(self) -> None:
        self.num_prefill_tokens = len(self.prompt_token_ids)

    def block_key(self, start: int, end: int) -> bytes:
        """What beside its token ids tells the block of tokens [start, end) apart from another's: the salt
        (first block only), the cache_key, and the key of every image whose placeholders it holds (they are
        the same ids for any image)."""
        keys = [i.key for i in self.images if i.offset < end and start < i.offset + i.length]
        salt = self.cache_salt if start == 0 else b""  # the rest of the chain hangs off the first block
        return salt + self.cache_key + b"".join(keys)

    def _next_choice_tokens(self) -> set[int]:
        """Each choice's next token where the output so far is a proper prefix of it."""
        out = tuple(self.output_token_ids)
        n = len(out)
        return {c[n] for c in self.choice_token_ids or () if len(c) > n and c[:n] == out}

    def choice_continuations(self) -> list[int] | None:
        """The ids a guided-choice request may sample next: the choices' next tokens, and EOS where the
        output is already a whole choice (None: no guided choice)."""
        if self.choice_token_ids is None:
            return None
        allowed = self._next_choice_tokens()
        if tuple(self.output_token_ids) in self.choice_token_ids:
            allowed |= self.eos_token_ids
        return sorted(allowed)

    def banned_next_tokens(self) -> list[int] | None:
        """The ids that would complete a bad word here: each word's last token where the output so far
        ends with the tokens before it (None: no bad words)."""
        if self.bad_words_token_ids is None:
            return None
        out = self.output_token_ids
        return sorted({w[-1] for w in self.bad_words_token_ids if _ends_with(out, w[:-1])})

    @property
    def needs_last_token(self) -> bool:
        """Whether this step's sampling depends on the token sampled last (a guided choice, a grammar, a
        bad word longer than a token): the engine does not launch the next step before it is on the host."""
        return (self.choice_token_ids is not None or self.grammar is not None or self.read_by_logits_processor
                or any(len(w) > 1 for w in self.bad_words_token_ids or ()))

    def is_whole_choice(self) -> bool:
        """Whether the output is one of the choices and no longer choice continues it."""
        return (self.choice_token_ids is not None and tuple(self.output_token_ids) in self.choice_token_ids
                and not self._next_choice_tokens())

    @property
    def real_prompt_token_ids(self) -> list[int]:
        """The prompt's token ids as outputs, penalties and detokenizers see them: none for a prompt of
        embeddings (whose ids are placeholders)."""
        return self.prompt_token_ids if self.prompt_embeds is None else []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens plus pending ones: what the scheduler plans with."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids are on the host."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Outputs sampled so far, pending ones included."""
        return len(self.output_token_ids) + self.num_pending_tokens

    @property
    def awaits_final_token(self) -> bool:
        """Its last token (max_tokens) is sampled but not yet on the host: nothing left to run."""
        return self.num_output_tokens >= self.max_tokens

    @property
    def num_remaining_tokens(self) -> int:
        """Tokens known but not yet in the KV cache (a whole prompt, a chunk's rest, or 1 for a decode)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """True until the prompt (plus earlier outputs after a preemption) is all in the KV cache;
        decided from progress, never from how many tokens are left or a chunk's length."""
        return self.num_computed_tokens < self.num_prefill_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_ids(self, start: int, end: int) -> list[int]:
        """Known tokens [start, end) across the prompt/output boundary (end <= num_known_tokens)."""
        n_prompt = self.num_prompt_tokens
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]


def _ends_with(seq: list[int], tail: tuple[int, ...]) -> bool:
    return not tail or (len(seq) >= len(tail) and tuple(seq[len(seq) - len(tail):]) == tail)
