"""LLMEngine: validates requests, then runs the step loop: schedule(), launch(), collect() the step before."""

from __future__ import annotations

import gc
import hashlib
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from plait.config import FULL_VOCAB_LOGPROBS, HIDDEN_STATE_METHODS, NGRAM, EngineConfig
from plait.engine.detokenizer import Detokenizer
from plait.engine.draft_model import DraftModelDrafter
from plait.engine.drafter import Drafter, NgramDrafter
from plait.engine.eagle import EagleDrafter
from plait.engine.grammar import Grammar, GrammarCompiler
from plait.engine.kv_cache import KVCacheManager, salt_key
from plait.engine.kv_events import ZmqEventPublisher
from plait.engine.profiler import StepProfiler
from plait.engine.request import PROMPT_EMBEDS_PLACEHOLDER_ID, FinishReason, Request
from plait.engine.scheduler import Scheduler, StepPlan
from plait.engine.state_slots import StateSlotPool
from plait.engine.warmup import WarmUpReport, warm_up
from plait.generation_config import load_generation_defaults
from plait.loader.hf import config_folder, resolve_model
from plait.logits_processor import LogitsProcessor, load_logits_processors
from plait.lora.adapter import LoRAAdapter
from plait.lora.registry import LoRARegistry
from plait.lora.request import LoRARequest
from plait.lora.slots import LoRASlotPool
from plait.multimodal.images import ImageInput, MultiModalPrompt
from plait.outputs import CompletionOutput, PoolingOutput, PoolingRequestOutput, RequestOutput, TokenLogprobs
from plait.pooling_params import PoolingParams
from plait.runner.model_runner import InFlightStep, ModelRunner, SampledToken, StepOutput
from plait.runner.sampler import needs_penalties
from plait.runner.sleep import SLEEP_DISCARD_WEIGHTS, SLEEP_LEVELS, WAKE_TAGS
from plait.sampling_params import TRUNCATE_TO_CONTEXT, RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from pathlib import Path

    import torch

logger = logging.getLogger(__name__)

# What the pooling runner says to a generation request, and the generate runner to an embedding request.
POOLING_MODEL_MESSAGE = ("this engine runs a pooling model (runner 'pooling'): it makes embeddings "
                         "(LLM.embed, /v1/embeddings), not text")
GENERATE_MODEL_MESSAGE = ("embeddings need a pooling model: create the engine with runner='pooling' "
                          "(plait serve --runner pooling)")


@dataclass
class StepStats:
    """One step of the timeline (set by LLMEngine.step)."""

    index: int
    start_time: float
    duration_s: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_rows: int
    num_preempted: int
    kv_blocks_used: int
    used_cuda_graph: bool = False  # the step replayed a captured CUDA graph (set by the GPU runner)
    num_draft_tokens: int = 0  # speculative decoding's draft tokens, counted in num_decode_tokens too
    num_waiting: int = 0  # requests still waiting for admission once the step was scheduled (queueing)


@dataclass
class SpecDecodeStats:
    """Speculative decoding's counts since the engine started (vLLM's spec_decode metrics), set by
    LLMEngine._verify: rows that carried drafts, draft tokens scored, and those kept."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: drafts kept at each draft position

    def summary(self) -> dict[str, Any]:
        """The counts and the share of draft tokens kept (None before any draft), for benchmark results."""
        rate = self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "acceptance_rate": rate,
                "accepted_per_position": list(self.accepted_per_position)}


@dataclass
class _Tracked:
    """Engine-side bookkeeping of a live request."""

    request: Request
    prompt: str | None
    detokenizer: Detokenizer | None
    logprobs: list[TokenLogprobs] | None
    arrival_time: float
    first_token_time: float | None = None
    # With prompt_logprobs: entries for the prompt positions computed so far (the first is None).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # FINAL_ONLY: when each step that gave it tokens was collected (the outputs it was not sent carry these
    # times, which a server's latency metrics read from the final one).
    output_times: list[float] = field(default_factory=list)
    num_logprobs_sent: int = 0  # DELTA: the logprobs entries earlier outputs carried
    prompt_logprobs_sent: bool = False  # DELTA: the first output carried them, the later ones do not


EMBEDS_KEY_BYTES = 16  # digest of a prompt of embeddings, hashed into its first block's key


def _embeds_key(embeds: torch.Tensor | None) -> bytes:
    """The prefix-cache key part of a prompt of embeddings: a digest of its values (b"" for none), since its
    placeholder ids alone would make every such prompt of a length share blocks."""
    if embeds is None:
        return b""
    digest = hashlib.blake2b(embeds.view(torch.uint8).numpy(), digest_size=EMBEDS_KEY_BYTES,
                             person=b"plait-embeds")
    return digest.digest()


def freeze_long_lived_objects() -> None:
    """Take every object alive now (modules, weights' wrappers, graphs, imported libraries) out of the
    cyclic collector's view. The step loop allocates thousands of objects a step; each full collection
    then walked this whole heap: W1 on an H200 spent 0.35 s of its 4.5 in 1,026 collections, one of them
    0.19 s. (vLLM freezes its heap after start-up too.) Frozen objects are still freed by reference
    counting: an engine holds no reference cycle (tested), so dropping one frees its GPU memory."""
    gc.collect()
    gc.freeze()


def collect_dropped_engines() -> None:
    """Free the cyclic garbage of engines dropped before this one starts: a dropped engine is freed by
    reference counting (it holds no cycle: tested), but one its user's code ties into a cycle (a caught
    exception's traceback holds the frame that held it) waits for the cyclic collector, which the raised
    threshold makes rare and a frozen heap hides it from: its KV cache would keep the GPU memory this
    engine is about to size its own from (seen on an H200: "no GPU memory left" for a test's engine).
    Only where a heap was frozen (a CUDA engine's start): elsewhere the collector runs as usual, and a full
    collection costs ~0.1 s."""
    if gc.get_freeze_count() == 0:
        return
    gc.unfreeze()  # the next freeze_long_lived_objects freezes what is still alive again
    gc.collect()


# Python's default generation-0 threshold (700 net container allocations) made the step loop collect
# about twice a step: W1 on an H200 ran 1,028 collections, 0.23-0.45 s of a ~4.2 s run with pauses up to
# 12 ms, longer than the ~8 ms of GPU work queued ahead of the host, so the GPU idled. At 50,000 the same
# run collected never and made 31,579-31,624 out tok/s against 28,939-29,880 (one H200, runs alternated;
# benchmarks/results/gc_threshold_w1_h200.json). A step's objects die by reference counting; the
# threshold only bounds how much cyclic garbage may pile up between collections.
STEP_LOOP_GC_GEN0_THRESHOLD = 50_000


def raise_gc_threshold(gen0: int = STEP_LOOP_GC_GEN0_THRESHOLD) -> None:
    """Raise the cyclic collector's generation-0 threshold to ``gen0``. Never lowers it, and leaves
    automatic collection off where the process turned it off (threshold 0)."""
    threshold = gc.get_threshold()
    if 0 < threshold[0] < gen0:
        gc.set_threshold(gen0, *threshold[1:])


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        # Where the model is (the server names it from this too); its generation_config.json is read
        # before the weights load, so a bad one fails in a second, not after minutes.
        collect_dropped_engines()
        # Custom logits processors' classes are imported first: a bad name fails before the weights load.
        processor_classes = load_logits_processors(config.logits_processors)
        self.model_source = resolve_model(config.model, config.revision, config.download_dir)
        # vLLM's --hf-config-path: its folder's generation_config.json under "auto" / "vllm", as its config.
        self.generation_defaults = load_generation_defaults(
            config.generation_config, config_folder(config) or self.model_source.path,
            config.override_generation_config)
        self.runner = ModelRunner(config, source=self.model_source)
        # The runner chose the device's defaults (the token budget) where the config left them open.
        self.config = config = self.runner.config
        self.model_config = self.runner.model_config
        self.tokenizer = self.runner.tokenizer
        if self.tokenizer is not None:
            # truncate_prompt_tokens keeps a prompt's end, as vLLM sets its tokenizers up.
            self.tokenizer.truncation_side = "left"
        self.max_model_len = self.runner.max_model_len
        # An image model's processor (its images' pixel values and placeholder tokens); None for text models.
        self.images = self.runner.image_processor
        self.pooler = self.runner.pooler  # set under the pooling runner: requests are embedded, not generated
        self._check_pooling_config()
        self.logits_processors = self._build_logits_processors(processor_classes)
        self.kv_cache = KVCacheManager(self.runner.num_kv_blocks, config.block_size,
                                       self._prefix_caching_allowed(), config.prefix_caching_hash_algo,
                                       self.runner.num_host_kv_blocks)
        if self.runner.num_host_kv_blocks and self.kv_cache.host is None:
            logger.warning("kv_offloading_size is ignored: prefix caching is off, and the host pool "
                           "keeps its evicted blocks")
        max_len_fits = self.kv_cache.num_usable_blocks * config.block_size
        if self.max_model_len > max_len_fits:
            if config.max_model_len is not None:
                raise ValueError(
                    f"max_model_len {config.max_model_len} needs more KV blocks than the cache has "
                    f"({self.kv_cache.num_usable_blocks} blocks of {config.block_size} tokens); "
                    f"lower max_model_len or raise num_kv_blocks"
                )
            logger.warning("max_model_len lowered to %d to fit the KV cache", max_len_fits)
            self.max_model_len = max_len_fits
        # Models with recurrent layers: one state slot per request that can hold state at once.
        slots = self.runner.num_state_slots
        self.state_slots = StateSlotPool(slots) if slots else None
        # LoRA: adapters read and checked at a request's validation, served from max_loras device slots.
        lora = self.runner.lora
        cached = config.max_cpu_loras or config.max_loras
        self.loras = LoRARegistry(lora.targets, config.max_lora_rank, cached) if lora is not None else None
        self.lora_slots = LoRASlotPool(config.max_loras) if lora is not None else None
        self.drafter = self._make_drafter()
        # Steps may launch before the one in flight is collected, unless the drafter needs every token on the
        # host (a draft model: a row whose last token is still on the device would get no drafts).
        self._may_overlap = config.async_scheduling and not (self.drafter is not None
                                                              and self.drafter.needs_host_tokens)
        num_drafts = config.speculative_config.num_speculative_tokens if self.drafter is not None else 0
        self.spec_stats = SpecDecodeStats(accepted_per_position=[0] * num_drafts)
        self.scheduler = Scheduler(config, self.kv_cache, self.state_slots, self.lora_slots, self.drafter,
                                   whole_prompts=not self.runner.is_causal)
        self.eos_token_ids = self._eos_token_ids()
        self.grammars = GrammarCompiler(self.tokenizer, self.eos_token_ids)
        self._tracked: dict[str, _Tracked] = {}
        self._auto_ids = itertools.count()
        self._step_index = itertools.count()
        self.record_timeline = False
        self.profiler = StepProfiler()  # start_profile / stop_profile
        self._in_flight: tuple[StepPlan, InFlightStep] | None = None  # launched, not yet collected
        self._collect_s = 0.0  # this step's time in ModelRunner.collect (its "sample" phase): step() sets it
        # Set by sleep(level=2), cleared by load_weights: the weights are zeros, so no request may run.
        self._weights_discarded = False
        self._sleep_level = 0  # the level of the last sleep (sleep_level: 0 once awake)
        # Steps that ran a forward (a call that only collects the previous step's tokens is not one).
        self.num_steps = 0
        self.timeline: list[StepStats] = []
        # The start-up warm-up's requests (None where it did not run: off, on CPU, or a pooling model).
        self.warm_up_report: WarmUpReport | None = None
        if config.warm_up and self.runner.device.type == "cuda" and self.pooler is None:
            self.warm_up_report = warm_up(self)
            self.forget_warm_up()
            r = self.warm_up_report
            logger.info("warm-up: %d requests in %d steps, %.1f s (%d the model refused)", r.requests,
                        r.steps, r.seconds, r.skipped)
        # After the warm-up: its made-up requests' blocks are no events.
        self.kv_events = self._start_kv_events()
        if self.runner.device.type == "cuda":
            freeze_long_lived_objects()
            raise_gc_threshold()

    def _start_kv_events(self) -> ZmqEventPublisher | None:
        """vLLM's kv_events_config: the block pool records its events; a "zmq" publisher sends them."""
        cfg = self.config.kv_events_config
        if cfg is None or not cfg.enable_kv_cache_events:
            return None
        if not self.kv_cache.enable_prefix_caching:
            raise ValueError("kv_events_config: KV cache events are the prefix cache's blocks; this engine "
                             "caches none (enable_prefix_caching is off, or the model cannot take it)")
        self.kv_cache.events = []
        if not cfg.publishes:
            return None
        return ZmqEventPublisher(cfg.endpoint, cfg.replay_endpoint, cfg.buffer_steps, cfg.hwm,
                                 cfg.max_queue_size, cfg.topic, cfg.data_parallel_rank)

    def _publish_kv_events(self) -> None:
        """Hand the events recorded since the last call to the publisher (none: dropped, as vLLM's "null")."""
        events = self.kv_cache.take_events()
        if events and self.kv_events is not None:
            self.kv_events.publish(events)

    def _make_drafter(self) -> Drafter | None:
        spec = self.config.speculative_config
        if spec is None:
            return None
        if self.state_slots is not None:
            # A recurrent layer's state has taken in every draft by the time they are verified; it cannot
            # be rolled back to the last kept one as KV can.
            arch = self.model_config.architecture
            raise ValueError(f"speculative decoding needs attention-only models: {arch} has recurrent "
                             "(Mamba) layers whose state cannot drop rejected draft tokens")
        if spec.method == NGRAM:
            return NgramDrafter(spec)
        if spec.method in HIDDEN_STATE_METHODS:
            return EagleDrafter(spec, self.config, self.runner, self.kv_cache, self.max_model_len)
        return DraftModelDrafter(spec, self.config, self.model_config.vocab_size, self.runner.num_kv_blocks,
                                 self.max_model_len)

    def _check_pooling_config(self) -> None:
        if self.pooler is None:
            return
        if self.config.speculative_config is not None:
            raise ValueError("speculative decoding needs a generating model; this one runs as a pooling "
                             "model")
        if self.config.logits_processors:
            raise ValueError("custom logits processors need a generating model; this one runs as a pooling "
                             "model (as in vLLM)")

    def _build_logits_processors(self, classes: list[type[LogitsProcessor]]) -> list[LogitsProcessor]:
        """One instance of each class, on the sampling device, handed to the sampler."""
        device = self.runner.device
        pinned = device.type == "cuda"
        processors = [cls(self.config, device, pinned) for cls in classes]
        self.runner.sampler.logits_processors = processors
        return processors

    def _prefix_caching_allowed(self) -> bool:
        if not self.config.enable_prefix_caching:
            return False
        if not self.runner.is_causal:
            # An encoder's K/V of a token depends on the tokens after it: no block can serve another prompt.
            logger.info("prefix caching is off: %s attends bidirectionally", self.model_config.architecture)
            return False
        if self.pooler is not None and self.pooler.spec.needs_every_position:
            # A cached token's hidden state is never computed, and MEAN / CLS pooling read them (vLLM turns it
            # off for them too); LAST pooling always computes the last token.
            logger.info("prefix caching is off: %s pooling reads every prompt position",
                        self.pooler.spec.pooling_type)
            return False
        if not getattr(self.runner.model, "supports_prefix_caching", True):
            # Recurrent layers keep state that a cached KV block cannot restore.
            logger.warning("prefix caching is off: %s has layers whose state cannot be reused from "
                           "cached KV blocks", self.model_config.architecture)
            return False
        return True

    def _eos_token_ids(self) -> frozenset[int]:
        # generation_config.json may list more (Llama 3: end of text, of message, of turn), as vLLM reads it.
        ids = set(self.model_config.eos_token_ids) | self.generation_defaults.eos_token_ids
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | PoolingParams | None = None,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> str:
        """Validate and queue one request; raises ValueError/TypeError before it enters the engine."""
        request, text = self.make_request(prompt, params, request_id, lora_request, priority, cache_salt)
        self.enqueue(request, text)
        return request.request_id

    def make_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | PoolingParams | None = None,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> tuple[Request, str | None]:
        """Validate and tokenize without queueing, so a batch can be checked whole before any of
        it enters the engine. Returns the request and its prompt text (None for token ids).
        ``lora_request`` names the LoRA adapter it runs with (read and checked here). A pooling model's
        requests take PoolingParams (the default there), every other model's SamplingParams.
        ``priority``: lower is served first, under the "priority" scheduling policy only. ``cache_salt``
        (vLLM's): a non-empty string; the request's prefix-cache blocks are shared only with requests of the
        same salt."""
        if params is None:
            params = PoolingParams() if self.pooler is not None else SamplingParams()
        if self._weights_discarded:
            raise ValueError("the weights were discarded by sleep(level=2): load_weights (a server: POST "
                             "/reload_weights) before adding requests")
        self._validate_priority(priority)
        salt = salt_key(cache_salt)
        if isinstance(params, PoolingParams):
            return self._make_pooling_request(prompt, params, request_id, lora_request, priority, salt)
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if self.pooler is not None:
            raise ValueError(POOLING_MODEL_MESSAGE)
        if params.n != 1:
            raise ValueError("the engine runs one sequence per request; fan n > 1 out before add_request")
        request_id = self._new_request_id(request_id)
        embeds = None
        if isinstance(prompt, torch.Tensor):
            embeds = self._prompt_embeds(prompt, params)
            text, token_ids, image_inputs = None, [PROMPT_EMBEDS_PLACEHOLDER_ID] * len(embeds), ()
        else:
            text, token_ids, image_inputs = self._prompt_tokens(prompt, params)
        self._validate_prompt(token_ids)
        spans = self._attention_spans(image_inputs)
        self._validate_sampling_token_ids(params)
        self._validate_logprobs(params)
        for processor in self.logits_processors:
            type(processor).validate_params(params)
        lora = self.lora_adapter(lora_request)
        room = self.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            max_tokens=max_tokens,
            eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids,
            choice_token_ids=self._tokenize_choices(params.host_choices),
            grammar=self._compile_grammar(params),
            bad_words_token_ids=self._tokenize_bad_words(params.bad_words),
            lora=lora,
            # Blocks computed under one adapter are never served to another, nor to the base model; nor are
            # blocks of one prompt of embeddings to another.
            cache_key=(lora.request.cache_key if lora is not None else b"") + _embeds_key(embeds),
            images=image_inputs,
            attention_spans=spans,
            priority=priority,
            cache_salt=salt,
            read_by_logits_processor=any(p.reads_output_token_ids and p.applies_to(params)
                                         for p in self.logits_processors),
            prompt_embeds=embeds,
        )
        return request, text

    def _prompt_tokens(self, prompt: str | Sequence[int] | MultiModalPrompt, params: SamplingParams
                       ) -> tuple[str | None, list[int], tuple[ImageInput, ...]]:
        """A text, token-id or multimodal prompt's text (None for ids), token ids (truncated as params ask,
        image placeholders expanded) and images."""
        prompt, images = self._split_images(prompt)
        text, token_ids = self._tokenize(prompt)
        # Room for max_tokens, or for one token where it is None: a prompt that fills the context could
        # generate nothing (vLLM's -1 is the whole context, which then fails there).
        keep = self._prompt_tokens_to_keep(params.truncate_prompt_tokens, params.max_tokens or 1)
        if images and keep is not None:
            raise ValueError("truncate_prompt_tokens cannot be used with images (it could cut one)")
        text, token_ids = self._truncate(text, token_ids, keep)
        token_ids, image_inputs = self._expand_images(token_ids, images)
        return text, token_ids, image_inputs

    def _prompt_embeds(self, embeds: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """A prompt of embeddings checked, as the host tensor the runner stages: [tokens, hidden] in the
        model's dtype (pinned on a GPU, so each step's copy queues behind the step in flight)."""
        if not self.config.enable_prompt_embeds:
            raise ValueError("prompts of embeddings need enable_prompt_embeds (plait serve "
                             "--enable-prompt-embeds), as in vLLM")
        if self.runner.prompt_embeds is None:
            raise ValueError(f"{self.model_config.architecture} takes no prompt embeddings")
        hidden = self.model_config.hidden_size
        if embeds.dim() != 2 or embeds.shape[0] < 1 or embeds.shape[1] != hidden:
            raise ValueError(f"prompt_embeds must be [tokens, {hidden}] (at least one token), got "
                             f"{list(embeds.shape)}")
        if not embeds.is_floating_point() or not bool(torch.isfinite(embeds).all()):
            raise ValueError("prompt_embeds must be finite floating-point values")
        if params.prompt_logprobs is not None or params.truncate_prompt_tokens is not None:
            raise ValueError("prompt_logprobs and truncate_prompt_tokens need prompt token ids; a prompt of "
                             "embeddings has none")
        host = embeds.detach().to("cpu", self.runner.dtype).contiguous()
        return host.pin_memory() if self.runner.device.type == "cuda" else host

    def _validate_priority(self, priority: int) -> None:
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority must be an integer, got {type(priority).__name__}")
        if priority != 0 and not self.config.serves_by_priority:  # as vLLM, which says so too
            raise ValueError(f"priority must be 0 (got {priority}): priority scheduling is not enabled; "
                             "start the engine with scheduling_policy='priority' (plait serve "
                             "--scheduling-policy priority)")

    def _split_images(self, prompt: str | Sequence[int] | MultiModalPrompt
                      ) -> tuple[str | Sequence[int], tuple[Any, ...]]:
        """The prompt and its images (none for a plain prompt); ValueError where the model takes none."""
        if not isinstance(prompt, MultiModalPrompt):
            return prompt, ()
        if prompt.images and self.images is None:
            raise ValueError(f"{self.model_config.architecture} takes no images: send a text prompt")
        limit = (self.config.limit_mm_per_prompt or {}).get("image")
        if limit is not None and len(prompt.images) > limit:
            raise ValueError(f"the prompt has {len(prompt.images)} images; at most {limit} are allowed "
                             "(limit_mm_per_prompt)")
        return prompt.prompt, tuple(prompt.images)

    def _expand_images(self, token_ids: list[int], images: tuple[Any, ...]
                       ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """An image model's prompt with its image tokens expanded into placeholders (ImageProcessor.expand):
        also a prompt without images, whose stray image tokens would otherwise run unfilled."""
        if self.images is None:
            return token_ids, ()
        return self.images.expand(token_ids, images)

    def _attention_spans(self, images: tuple[ImageInput, ...]) -> tuple[tuple[int, int], ...]:
        """For a model whose images attend both ways (Gemma 3), each image's placeholders [first, last + 1):
        a chunk never splits one (Scheduler), so one longer than a step holds is refused here."""
        if not images or not self.runner.key_limits:
            return ()
        spans = []
        for image in images:
            marked = (np.arange(image.length) if image.embedded is None
                      else np.flatnonzero(image.embedded))
            first, last = image.offset + int(marked[0]), image.offset + int(marked[-1]) + 1
            limit = self.scheduler.max_span_tokens
            if last - first > limit:
                raise ValueError(f"an image's {last - first} tokens attend to each other both ways, so they "
                                 f"are computed in one step, which holds at most {limit} tokens "
                                 "(max_num_batched_tokens, long_prefill_token_threshold): raise them")
            spans.append((first, last))
        return tuple(spans)

    def _new_request_id(self, request_id: str | None) -> str:
        request_id = request_id if request_id is not None else f"req-{next(self._auto_ids)}"
        if request_id in self._tracked:
            raise ValueError(f"request id {request_id!r} is already in use")
        return request_id

    def _make_pooling_request(self, prompt: str | Sequence[int], params: PoolingParams,
                              request_id: str | None, lora_request: LoRARequest | None, priority: int,
                              salt: bytes) -> tuple[Request, str | None]:
        """An embedding request: its prompt (truncated as asked; it may fill the whole context, since nothing
        follows it), checked against the pooler (dimensions), sampling nothing; ``salt``: salt_key's."""
        if self.pooler is None:
            raise ValueError(GENERATE_MODEL_MESSAGE)
        request_id = self._new_request_id(request_id)
        text, token_ids = self._tokenize(prompt)
        keep = self._prompt_tokens_to_keep(params.truncate_prompt_tokens, reserved=0)  # nothing follows
        text, token_ids = self._truncate(text, token_ids, keep)
        self._validate_prompt(token_ids, max_len=self.max_model_len)
        self.pooler.spec.check(params, self.model_name)
        lora = self.lora_adapter(lora_request)
        request = Request(request_id=request_id, prompt_token_ids=token_ids, sampling_params=SamplingParams(),
                          max_tokens=0, pooling_params=params, lora=lora, priority=priority,
                          cache_key=lora.request.cache_key if lora is not None else b"", cache_salt=salt)
        return request, text

    @property
    def model_name(self) -> str:
        """The model's name as a user gave it: its Hub id, else its file or folder name."""
        return self.model_source.repo_id or self.model_source.path.name

    def lora_adapter(self, lora_request: LoRARequest | None) -> LoRAAdapter | None:
        """The adapter ``lora_request`` names, read and checked (ValueError if it cannot be served)."""
        if lora_request is None:
            return None
        if self.loras is None:
            raise ValueError("a LoRA adapter was requested, but LoRA is not enabled: create the engine with "
                             "enable_lora=True (plait serve --enable-lora)")
        return self.loras.get(lora_request)

    def enqueue(self, request: Request, prompt_text: str | None = None) -> None:
        """Queue a request made by make_request."""
        if request.request_id in self._tracked:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        params = request.sampling_params
        detok = None
        if self.tokenizer is not None and request.pooling_params is None and params.detokenize:
            detok = Detokenizer(self.tokenizer, request.real_prompt_token_ids, params)
        logprobs = [] if params.logprobs is not None else None
        tracked = _Tracked(request, prompt_text, detok, logprobs, time.monotonic())
        if params.prompt_logprobs is not None:
            tracked.prompt_logprobs = [None]
        self._tracked[request.request_id] = tracked
        self.scheduler.add(request)

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A text prompt's token ids, with or without the tokenizer's special tokens (a BOS, an EOS)."""
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer (the model holds none, or skip_tokenizer_init is "
                             "set): pass prompt token ids instead of text")
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _tokenize(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return prompt, self.encode_text(prompt, add_special_tokens=self._add_special_tokens())
        if isinstance(prompt, (list, tuple)):
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise TypeError("prompt token ids must all be integers")
            return None, list(prompt)
        raise TypeError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def _prompt_tokens_to_keep(self, k: int | None, reserved: int) -> int | None:
        """How many of the prompt's last tokens truncate_prompt_tokens ``k`` keeps (None: all of them), where
        ``reserved`` tokens must follow the prompt in the context (TRUNCATE_TO_CONTEXT keeps the rest)."""
        if k == TRUNCATE_TO_CONTEXT:
            return max(1, self.max_model_len - reserved)
        if k is not None and k > self.max_model_len:
            # vLLM's words (its LLM API's check)
            raise ValueError(f"truncate_prompt_tokens value ({k}) is greater than max_model_len "
                             f"({self.max_model_len}). Please, select a smaller truncation size.")
        return k

    def _truncate(self, text: str | None, token_ids: list[int], keep: int | None
                  ) -> tuple[str | None, list[int]]:
        """The prompt's last ``keep`` tokens (vLLM's left truncation) and their text (None for token ids)."""
        if keep is None or len(token_ids) <= keep:
            return text, token_ids
        if text is None:
            return None, token_ids[-keep:]
        # The tokenizer truncates a text itself (from the left, see __init__), so the special tokens it adds,
        # a BOS, stay in front, as in vLLM; the slice after it is vLLM's too, for a keep shorter than those
        # special tokens, where the tokenizer truncates nothing. The text becomes what the model sees, so
        # echo shows the same prompt that the ids, usage and prompt_logprobs describe.
        special = self._add_special_tokens()
        kept = self.tokenizer.encode(text, add_special_tokens=special, truncation=True, max_length=keep)
        kept = list(kept)[-keep:]
        return self.tokenizer.decode(kept, skip_special_tokens=False), kept

    def _add_special_tokens(self) -> bool:
        # HF tokenizers add BOS themselves when their template says so; SmolLM2 adds none.
        return True

    def _validate_prompt(self, token_ids: list[int], max_len: int | None = None) -> None:
        """A prompt of at most ``max_len`` tokens (default: one less than max_model_len, leaving room for one
        output) of the vocabulary's ids."""
        if not token_ids:
            raise ValueError("prompt is empty: it must have at least one token")
        self._check_in_vocabulary("prompt", token_ids)
        if len(token_ids) > (max_len if max_len is not None else self.max_model_len - 1):
            # vLLM's words, which OpenAI clients match to spot a prompt beyond the context.
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your request "
                f"has {len(token_ids)} input tokens. Please reduce the length of the input messages."
            )

    def _tokenize_choices(self, choices: list[str] | None) -> tuple[tuple[int, ...], ...] | None:
        if choices is None:
            return None
        if self.tokenizer is None:
            raise ValueError("guided_choice needs the model's tokenizer; this model has none")
        return tuple(tuple(self.tokenizer.encode(c, add_special_tokens=False)) for c in choices)

    def _tokenize_bad_words(self, words: list[str] | None) -> tuple[tuple[int, ...], ...] | None:
        """Each word as the tokenizer encodes it alone, and after a space (mid-sentence), as vLLM does."""
        if words is None:
            return None
        if self.tokenizer is None:
            raise ValueError("bad_words needs the model's tokenizer; this model has none")
        sequences = {tuple(self.tokenizer.encode(prefix + w.lstrip(), add_special_tokens=False))
                     for w in words for prefix in ("", " ")}
        return tuple(sorted(s for s in sequences if s))

    def _compile_grammar(self, params: SamplingParams) -> Grammar | None:
        """This sequence's own matcher for a JSON schema, JSON object, regex or grammar (a choice is
        guided_choice's, unless it waits for reasoning_end); a bad one is a ValueError here, before the
        request enters the engine."""
        spec = params.grammar_spec
        return None if spec is None else self.grammars.compile(spec, self._reasoning_end_ids(params))

    def _reasoning_end_ids(self, params: SamplingParams) -> tuple[int, ...]:
        """reasoning_end's tokens, after which the grammar applies (none: from the first token)."""
        if params.reasoning_end is None or self.tokenizer is None:  # no tokenizer: compile refuses anyway
            return ()
        return tuple(self.tokenizer.encode(params.reasoning_end, add_special_tokens=False))

    def _validate_sampling_token_ids(self, params: SamplingParams) -> None:
        """logit_bias and allowed_token_ids index the logits row on the device, where an id beyond it
        would be a device-side error, not a 400; SamplingParams does not know the vocabulary."""
        self._check_in_vocabulary("logit_bias", params.logit_bias or ())
        self._check_in_vocabulary("allowed_token_ids", params.allowed_token_ids or ())

    @property
    def max_logprobs(self) -> int:
        """The most logprobs a request may ask for at a position: config.max_logprobs (-1: the vocabulary)."""
        cap = self.config.max_logprobs
        return self.model_config.vocab_size if cap == FULL_VOCAB_LOGPROBS else cap

    def _validate_logprobs(self, params: SamplingParams) -> None:
        """logprobs and prompt_logprobs within max_logprobs (vLLM's check)."""
        cap = self.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > cap:
                raise ValueError(f"{name} {value} is more than the {cap} this engine returns at a position "
                                 "(max_logprobs; vLLM's --max-logprobs)")

    def _check_in_vocabulary(self, name: str, token_ids: Iterable[int]) -> None:
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"{name} token id {bad} is out of range for a vocabulary of {vocab}")

    def abort_request(self, request_id: str) -> None:
        """Cancel a request; its KV blocks are free before the next step is scheduled."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is not None and not tracked.request.is_finished:
            self.scheduler.finish(tracked.request, FinishReason.ABORT)

    def has_unfinished_requests(self) -> bool:
        """True while a request is queued or running. (A request in a launched, uncollected step is
        still running; an uncollected step whose requests all finished or were aborted holds
        nothing anyone waits for, and the next step drops it.)"""
        return self.scheduler.num_unfinished > 0

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- the step loop ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """One engine step; returns an output for every request that produced a token or finished.

        With ``async_scheduling`` the step launched here is collected by the next call: the host
        schedules and stages step N+1 while the device runs step N, so host work hides behind the
        GPU. Tokens still in flight count as the requests' pending tokens; a decode whose input is
        one of them reads it from the previous step's sampled ids on the device. Where step N+1's
        sampling needs step N's tokens on the host (a grammar's next mask, penalties: ``_samples_late``),
        its forward is launched first and sampled once step N is collected.
        """
        if self.is_sleeping:
            return []  # queued requests wait for wake_up
        start = time.monotonic()
        self._collect_s = 0.0
        outputs: list[RequestOutput] = []
        late = self._in_flight is not None and self._samples_late(*self._in_flight)
        if self._in_flight is not None and not late and not self._can_overlap(*self._in_flight):
            outputs += self._collect()
        draft_s = 0.0
        if self.drafter is not None:
            t0 = time.monotonic()
            self.drafter.prepare(self.scheduler.running)
            draft_s = time.monotonic() - t0
        plan = self.scheduler.schedule()
        scheduled = time.monotonic()
        collected_before_launch = self._collect_s
        launched = None
        if not plan.is_empty:
            # A row's input still on the device: the last step's sampled id (overlapped steps), or a draft
            # model's last draft (its forward runs while this step is staged).
            prev = self._in_flight[1] if self._in_flight else self._drafts_in_flight()
            transfers = self.kv_cache.take_transfers()
            if transfers:  # the prefix cache's copies to and from host memory, before this forward
                self.runner.transfer_kv(transfers)
                if self.drafter is not None:
                    self.drafter.transfer_kv(transfers)
            if late:
                forward = self.runner.launch(plan, prev, sample=False)
                self.scheduler.advance(plan)
                outputs += self._collect()  # the forward runs meanwhile
                launched = self.runner.sample(forward)
            else:
                launched = self.runner.launch(plan, prev)
                self.scheduler.advance(plan)
            for request in launched.requests:
                request.num_pending_tokens += 1
            # Once a step, here: the next step's overlap checks read it (a pass over the rows each time).
            launched.needs_last_tokens = any(needs_penalties(r.sampling_params) or r.needs_last_token
                                             for r in launched.requests)
        executed = time.monotonic()
        settle_s = 0.0
        if self.drafter is not None:
            self.drafter.settle(plan if launched is not None else None)  # before this step's _verify
            settle_s = time.monotonic() - executed
        collected_before_post = self._collect_s
        if self._in_flight is not None:
            outputs += self._collect()
        self._in_flight = (plan, launched) if launched is not None else None
        end = time.monotonic()
        breakdown = self.runner.breakdown
        # The runner's collect (the wait for a step's ids) counts as its "sample" phase, not the engine's.
        breakdown.add("draft", draft_s + settle_s)
        breakdown.add("schedule", scheduled - start - draft_s - collected_before_launch)
        breakdown.add("postprocess", end - executed - (self._collect_s - collected_before_post) - settle_s)
        breakdown.wall_s += end - start
        if launched is not None:
            breakdown.steps += 1
            self.num_steps += 1
        if self.record_timeline and launched is not None:
            self._record(plan, launched.used_cuda_graph, start, end)
        if self.kv_cache.events:
            self._publish_kv_events()
        return outputs

    def _drafts_in_flight(self) -> InFlightStep | None:
        return self.drafter.in_flight() if self.drafter is not None else None

    def _can_overlap(self, plan: StepPlan, step: InFlightStep) -> bool:
        """Whether the next step may launch before ``step``'s ids are on the host: not when overlap is off,
        nor when ``step`` carries draft tokens (a row's next position depends on how many of its drafts
        are kept). Rows with their last token in flight still draft (NgramDrafter.propose), so speculation
        costs the overlap only of steps after one that drafted. Rows whose sampling needs ``step``'s ids
        (``_samples_late``) overlap their next step's forward only."""
        return self._may_overlap and not plan.num_draft_tokens and not step.needs_last_tokens

    def _samples_late(self, plan: StepPlan, step: InFlightStep) -> bool:
        """Whether the next step launches its forward before ``step`` is collected and samples after: a
        request in ``step`` applies penalties, a guided choice, a grammar or a bad word of several tokens
        (its next sampling needs the ids themselves: a grammar's next mask depends on the token it consumes
        first). As vLLM applies structured outputs' bitmasks after the forward."""
        return self._may_overlap and not plan.num_draft_tokens and step.needs_last_tokens

    def _collect(self) -> list[RequestOutput | PoolingRequestOutput]:
        plan, launched = self._in_flight
        self._in_flight = None
        t0 = time.monotonic()
        result = self.runner.collect(launched)
        self._collect_s += time.monotonic() - t0
        for request in launched.requests:
            request.num_pending_tokens -= 1
        kept = self._verify(plan, result.sampled)
        for row in plan.rows:
            self.kv_cache.cache_full_blocks(row.request)
        return self._postprocess(result, kept) + self._finish_pooled(result.pooled)

    def _finish_pooled(self, pooled: list[tuple[Request, torch.Tensor]]) -> list[PoolingRequestOutput]:
        """Finish each embedding request whose prompt the step pooled: its embedding as it asked for it."""
        now = time.monotonic()
        outputs = []
        for request, vector in pooled:
            tracked = self._tracked.get(request.request_id)
            if tracked is None or tracked.request is not request or request.is_finished:
                continue  # aborted while its last chunk ran
            data = self.pooler.finish(vector, request.pooling_params)
            self.scheduler.finish(request, FinishReason.STOP)
            del self._tracked[request.request_id]
            metrics = {"arrival_time": tracked.arrival_time, "first_token_time": now, "now": now,
                       "num_preemptions": request.num_preemptions,
                       "first_scheduled_time": request.first_scheduled_time}
            outputs.append(PoolingRequestOutput(
                request.request_id, tracked.prompt, request.prompt_token_ids, PoolingOutput(data),
                num_cached_tokens=request.num_cached_tokens, metrics=metrics))
        return outputs

    def _verify(self, plan: StepPlan, sampled: list[SampledToken]) -> list[list[SampledToken]]:
        """Group the step's samples by row and keep, for a row with drafts, its samples up to the first that
        differs from the draft at its position (that one included: the token the model chose there). Each
        kept sample is the token the row would have sampled without speculation: same logits, same draw.
        The KV of rejected drafts is left behind ``num_computed_tokens``, to be overwritten."""
        groups: list[list[SampledToken]] = []
        for s in sampled:
            if s.draft_position == 0:
                groups.append([])
            groups[-1].append(s)
        drafts = {row.request: row.draft_token_ids for row in plan.rows if row.draft_token_ids}
        if not drafts:
            return groups
        kept_groups = []
        for group in groups:
            request = group[0].request
            draft = drafts.get(request, ())
            accepted = 0
            while accepted < len(draft) and group[accepted].token_id == draft[accepted]:
                accepted += 1
            if draft:
                request.num_computed_tokens -= len(draft) - accepted
                self._count_drafts(len(draft), accepted)
            kept_groups.append(group[: accepted + 1])
        return kept_groups

    def _count_drafts(self, num_drafts: int, accepted: int) -> None:
        stats = self.spec_stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += accepted
        for j in range(accepted):
            stats.accepted_per_position[j] += 1

    def _record(self, plan: StepPlan, used_cuda_graph: bool, start: float, end: float) -> None:
        self.timeline.append(StepStats(
            index=next(self._step_index), start_time=start, duration_s=end - start,
            num_prefill_tokens=plan.num_prefill_tokens, num_decode_tokens=plan.num_decode_tokens,
            num_rows=len(plan.rows), num_preempted=len(plan.preempted),
            kv_blocks_used=self.kv_cache.num_used_blocks, used_cuda_graph=used_cuda_graph,
            num_draft_tokens=plan.num_draft_tokens, num_waiting=self.num_waiting,
        ))

    def _record_prompt_logprobs(self, result: StepOutput) -> None:
        for run in result.prompt_logprobs:
            tracked = self._tracked.get(run.request.request_id)
            if tracked is None or tracked.request is not run.request or tracked.prompt_logprobs is None:
                continue
            prompt, have = run.request.prompt_token_ids, tracked.prompt_logprobs
            for pos, lp in enumerate(run.entries, start=run.start):
                if pos == len(have):  # positions a recompute after preemption computes again are kept once
                    top = dict(zip(lp.top_ids, lp.top_logprobs))
                    have.append(TokenLogprobs(prompt[pos], lp.token_logprob, top, lp.rank))

    def _postprocess(self, result: StepOutput, kept: list[list[SampledToken]]) -> list[RequestOutput]:
        """One output per request that got tokens: ``kept`` holds each sampling row's tokens (one, or
        several where drafts were kept), appended in turn until one finishes the request."""
        now = time.monotonic()
        outputs = []
        self._record_prompt_logprobs(result)
        for group in kept:
            request = group[0].request
            tracked = self._tracked.get(request.request_id)
            if tracked is None or tracked.request is not request or request.is_finished:
                continue  # aborted, or finished by a token collected before this overlapped step's
            if tracked.first_token_time is None:
                tracked.first_token_time = now
            delta, delta_ids = "", []
            for sampled in group:
                self._append(tracked, sampled)
                delta += self._check_stop(tracked, sampled.token_id)
                delta_ids.append(sampled.token_id)
                if request.finish_reason is not None:
                    self.scheduler.finish(request, request.finish_reason)
                    break
            if request.sampling_params.output_kind is RequestOutputKind.FINAL_ONLY:
                tracked.output_times.append(now)
                if not request.is_finished:
                    continue
                delta, delta_ids = None, None  # all of it is new to this request's reader
            outputs.append(self._make_output(tracked, delta, delta_ids, now))
            if request.is_finished:
                del self._tracked[request.request_id]
        return outputs

    @staticmethod
    def _append(tracked: _Tracked, sampled: SampledToken) -> None:
        tracked.request.output_token_ids.append(sampled.token_id)
        if tracked.logprobs is not None and sampled.logprobs is not None:
            lp = sampled.logprobs
            tracked.logprobs.append(TokenLogprobs(sampled.token_id, lp.token_logprob,
                                                  dict(zip(lp.top_ids, lp.top_logprobs)), lp.rank))

    def _check_stop(self, tracked: _Tracked, token_id: int) -> str:
        """Set the request's finish reason if it must stop; return the new text to emit."""
        request, params = tracked.request, tracked.request.sampling_params
        num_out = len(request.output_token_ids)
        min_reached = num_out >= params.min_tokens
        if min_reached and token_id in request.eos_token_ids:
            request.finish_reason = FinishReason.STOP
        elif min_reached and token_id in params.stop_token_ids:
            request.finish_reason, request.stop_reason = FinishReason.STOP, token_id
        delta = ""
        if tracked.detokenizer is not None:
            # EOS is not text; a stop token id is shown only if it is not special.
            if request.finish_reason is None or request.stop_reason is not None:
                delta = tracked.detokenizer.feed([token_id])
            if tracked.detokenizer.stop_reason is not None and request.finish_reason is None and min_reached:
                request.finish_reason = FinishReason.STOP
                request.stop_reason = tracked.detokenizer.stop_reason
        if request.grammar is not None:
            self._advance_grammar(request, token_id)
        if request.finish_reason is None and request.is_whole_choice():
            request.finish_reason = FinishReason.STOP  # nothing but EOS could follow
        if request.finish_reason is None and (
            num_out >= request.max_tokens or request.num_known_tokens >= self.max_model_len
        ):
            request.finish_reason = FinishReason.LENGTH
        if request.finish_reason is not None and tracked.detokenizer is not None:
            delta += tracked.detokenizer.flush()
        return delta

    @staticmethod
    def _advance_grammar(request: Request, token_id: int) -> None:
        """Feed the token (EOS too) to the request's grammar. Where the grammar failed (it refused the
        token, or hit a resource limit) that request alone ends with "error", even on EOS: its output
        does not match. Otherwise it stops where nothing but EOS could follow."""
        grammar = request.grammar
        grammar.consume(token_id)
        error = grammar.error
        if error is not None:
            logger.warning("request %s: structured output failed: %s", request.request_id, error)
            request.finish_reason = FinishReason.ERROR
            request.stop_reason = f"structured output failed: {error}"
        elif request.finish_reason is None and grammar.is_terminated():
            request.finish_reason = FinishReason.STOP

    def _make_output(self, tracked: _Tracked, delta: str | None, delta_ids: list[int] | None,
                     now: float) -> RequestOutput:
        """The request's output after this step; ``delta`` and ``delta_ids`` None: the whole output is new
        to its reader (FINAL_ONLY)."""
        request = tracked.request
        kind = request.sampling_params.output_kind
        reason = request.finish_reason.value if request.finish_reason is not None else None
        text = tracked.detokenizer.text if tracked.detokenizer is not None else ""
        if delta is None:
            delta, delta_ids = text, list(request.output_token_ids)
        logprobs = tracked.logprobs
        if kind is RequestOutputKind.DELTA:
            text, token_ids = delta, delta_ids
            if logprobs is not None:
                logprobs, tracked.num_logprobs_sent = logprobs[tracked.num_logprobs_sent:], len(logprobs)
        else:
            token_ids = list(request.output_token_ids)
            logprobs = list(logprobs) if logprobs is not None else None
        completion = CompletionOutput(
            index=0, text=text, token_ids=token_ids, finish_reason=reason, stop_reason=request.stop_reason,
            logprobs=logprobs, delta_text=delta, delta_token_ids=delta_ids,
        )
        metrics = {"arrival_time": tracked.arrival_time, "first_token_time": tracked.first_token_time,
                   "now": now, "num_preemptions": request.num_preemptions,
                   "first_scheduled_time": request.first_scheduled_time}
        if kind is RequestOutputKind.FINAL_ONLY:
            metrics["output_times"] = tracked.output_times
        prompt_logprobs = list(tracked.prompt_logprobs) if tracked.prompt_logprobs is not None else None
        if kind is RequestOutputKind.DELTA:
            prompt_logprobs = None if tracked.prompt_logprobs_sent else prompt_logprobs
            tracked.prompt_logprobs_sent = True
        return RequestOutput(request.request_id, tracked.prompt, request.real_prompt_token_ids, [completion],
                             finished=request.is_finished, num_cached_tokens=request.num_cached_tokens,
                             prompt_logprobs=prompt_logprobs, metrics=metrics)

    def forget_warm_up(self) -> None:
        """Leave no trace of the requests run so far: no cached block, the KV blocks in their first order, and
        zero steps, timeline, prefix-cache and speculative counters (the warm-up's requests are not the
        user's). Only while idle."""
        if self.has_unfinished_requests():
            raise ValueError("forget_warm_up needs an idle engine")
        if self._in_flight is not None:
            self._collect()  # a last launched step whose requests all finished: nobody reads its outputs
        self.kv_cache.reset()
        num_drafts = len(self.spec_stats.accepted_per_position)
        self.spec_stats = SpecDecodeStats(accepted_per_position=[0] * num_drafts)
        self.runner.breakdown.reset()
        self.num_steps = 0
        self.timeline.clear()
        self._step_index = itertools.count()

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (vLLM's LLM.reset_prefix_cache): True where it could, False while requests
        hold blocks (nothing is forgotten then)."""
        reset = not self.has_unfinished_requests() and self.kv_cache.reset_prefix_cache()
        self._publish_kv_events()
        return reset

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace weights in place with HF-named tensors (a whole checkpoint's worth, as an RL loop sends
        between rollouts, or any subset: the rest keep theirs; vLLM's model.load_weights), then empty the
        prefix cache, whose KV the old weights computed. Tensors keep their addresses, so captured CUDA
        graphs stay valid. Only while no request runs; a load that fails part-way leaves the weights mixed
        (load a whole set again)."""
        if self.has_unfinished_requests():
            raise ValueError("load_weights needs an idle engine: finish or abort its requests first")
        self.runner.load_weights(weights)
        self.kv_cache.reset_prefix_cache()
        self._weights_discarded = False

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list[Any]:
        """vLLM's collective_rpc: ``method`` run on every rank's Worker (plait.runner.worker: a Worker
        method's name, a worker_extension_cls's, or a function taking the worker first), each rank's result
        in rank order. A method that loads weights (through the runner) also empties the prefix cache, whose
        KV the old weights computed, and ends a level-2 sleep's refusal to run requests."""
        if self._in_flight is not None and not self.has_unfinished_requests():
            self._collect()  # a last launched step whose requests all finished: the method sees its effects
        loads = self.runner.weight_loads
        try:
            return self.runner.collective_rpc(method, args, kwargs, timeout)
        finally:
            if self.runner.weight_loads != loads:
                self._weights_discarded = False
                if not self.has_unfinished_requests():
                    self.reset_prefix_cache()
                else:
                    logger.warning("collective_rpc changed the weights while requests hold KV blocks: their "
                                   "cached prefixes were computed by the old weights")

    def reload_weights(self, path: str | None = None) -> None:
        """load_weights from a checkpoint on disk: ``path`` (an HF folder, a GGUF file or a cached Hub id of
        this architecture, e.g. a trainer's saved step), else the model this engine was started with (vLLM's
        ``collective_rpc("reload_weights")``)."""
        self.load_weights(self.runner.checkpoint_weights(path))

    def sleep(self, level: int = 1) -> None:
        """Free the device memory of the weights and the KV cache until wake_up (vLLM's sleep mode, for an RL
        loop that trains on the same GPUs between rollouts): level 1 parks the weights in host memory, level 2
        drops them (load_weights brings new ones after wake_up). Either way the KV cache's contents, and so
        the prefix cache, are forgotten. Only while no request runs; requests added while asleep wait."""
        if not self.config.enable_sleep_mode:
            raise ValueError("sleep mode is not enabled: start the engine with enable_sleep_mode=True "
                             "(plait serve --enable-sleep-mode)")
        if isinstance(level, bool) or level not in SLEEP_LEVELS:
            raise ValueError(f"sleep level must be one of {SLEEP_LEVELS}, got {level!r}")
        if self.has_unfinished_requests():
            raise ValueError("sleep needs an idle engine: finish or abort its requests first")
        refusal = self.runner.load_weights_refusal()
        if level == SLEEP_DISCARD_WEIGHTS and refusal is not None:
            raise ValueError(f"sleep level 2 drops the weights, and load_weights cannot bring them back for "
                             f"{refusal}: use level 1")
        if self._in_flight is not None:
            self._collect()  # a step whose requests all ended; nothing waits for it
        self.kv_cache.reset_prefix_cache()
        self.runner.sleep(level)
        self._sleep_level = level
        self._weights_discarded = self._weights_discarded or level == SLEEP_DISCARD_WEIGHTS

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Take back what sleep freed: ``tags`` of "weights" and "kv_cache" (None: both), so that an RL loop
        can load new weights before the KV cache takes its memory again. Requests run once both are back."""
        tags = WAKE_TAGS if tags is None else tags
        if isinstance(tags, str) or any(tag not in WAKE_TAGS for tag in tags):
            raise ValueError(f"wake_up tags must be a list of {WAKE_TAGS}, got {tags!r}")
        self.runner.wake_up(tags)

    @property
    def is_sleeping(self) -> bool:
        """Between sleep and the wake_up that brings back both the weights and the KV cache."""
        return self.runner.is_asleep

    @property
    def sleep_level(self) -> int:
        """0 while awake, else the level of the sleep it is in (vLLM's vllm:engine_sleep_state)."""
        return self._sleep_level if self.is_sleeping else 0

    def start_profile(self, folder: str | None = None) -> None:
        """Start the torch profiler (vLLM's start_profile): its trace covers the steps until stop_profile;
        ``folder`` defaults to $PLAIT_TORCH_PROFILER_DIR (or vLLM's $VLLM_TORCH_PROFILER_DIR)."""
        self.profiler.start(folder)

    def stop_profile(self) -> Path:
        """Stop the profiler and write its Chrome trace; returns the file's path."""
        return self.profiler.stop()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (they also stop when the engine is dropped)."""
        self.runner.close()
        if self.drafter is not None:
            self.drafter.close()
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None

    # -- introspection used by tests and tools ---------------------------------------------

    def is_idle_and_clean(self) -> bool:
        """Idle with every KV block, state slot and LoRA slot back in its pool (invariant 8)."""
        slots_free = self.state_slots is None or self.state_slots.num_used == 0
        slots_free = slots_free and (self.lora_slots is None or self.lora_slots.num_used == 0)
        drafts_free = self.drafter is None or self.drafter.is_clean()
        return (not self.has_unfinished_requests() and slots_free and drafts_free
                and self.kv_cache.num_free_blocks == self.kv_cache.num_usable_blocks)

