"""The offline API: ``LLM(model).generate(prompts, params)``, ``.chat(messages)`` and, for pooling models,
``.embed(prompts)``, as in vLLM."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from plait.config import EngineConfig
from plait.engine.engine import LLMEngine
from plait.engine.request import Request
from plait.entrypoints.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    advance_all,
    check_logprobs_mode,
    pending_beams,
    step_params,
)
from plait.entrypoints.metrics_reader import Metric, OfflineMetrics
from plait.inputs import PromptType
from plait.lora.request import LoRARequest
from plait.multimodal.chat import AUTO_CONTENT_FORMAT, image_token_text, prepare_chat
from plait.multimodal.images import MultiModalPrompt
from plait.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from plait.pooling_params import PoolingParams, score_pairs
from plait.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

LoRAInput = LoRARequest | Sequence[LoRARequest | None] | None  # one adapter for all prompts, or one each
Message = dict[str, Any]


class LLM:
    """An engine for offline batches. ``model=None`` runs the default model (SmolLM2-135M-Instruct).

    Engine knobs (``max_num_batched_tokens``, ``scheduling_policy``, ``device``, ``dtype``...) are
    keyword arguments; see ``plait.config.EngineConfig``.
    """

    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_kwargs))
        self._batch_ids = 0
        # What get_metrics reports: every request this LLM ran to its end.
        self._metrics = OfflineMetrics(self.engine.model_name)

    def get_metrics(self) -> list[Metric]:
        """vLLM's LLM.get_metrics: Counter, Gauge, Histogram and Vector values under vLLM's metric names
        (``vllm:prompt_tokens``, ``vllm:time_to_first_token_seconds``, ``vllm:kv_cache_usage_perc``...), for
        the requests run so far."""
        return self._metrics.read(self.engine)

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache, as vLLM's (False while requests hold blocks: nothing is forgotten then)."""
        return self.engine.reset_prefix_cache()

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Replace the model's weights in place with HF-named tensors, e.g. ``policy.state_dict().items()``
        of an RL loop's trained model between rollouts (every tensor of the checkpoint, as the model loads
        them at start), and empty the prefix cache. CUDA graphs stay valid: no weight moves. Under tensor
        parallelism each rank gets its slices. Not for quantised, LoRA or pooling engines."""
        self.engine.load_weights(weights)

    def reload_weights(self, path: str | None = None) -> None:
        """load_weights from a checkpoint on disk: ``path`` (an HF folder, a GGUF file or a cached Hub id),
        else the model the engine started with, as vLLM's ``collective_rpc("reload_weights")``."""
        self.engine.reload_weights(path)

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list[Any]:
        """vLLM's LLM.collective_rpc: run ``method`` on every rank's worker (one per GPU of a split model) and
        return each rank's result, rank 0's first. ``method``: the name of a method of plait's Worker
        (``load_weights``, ``get_model``) or of the ``worker_extension_cls`` the LLM was made with, or a
        function called with the worker first (under tensor parallelism it must be importable by name). The
        worker has ``model_runner``, ``rank``, ``world_size`` and ``device``; weights it loads replace the
        old ones in place (any subset), and the prefix cache is emptied after."""
        return self.engine.collective_rpc(method, timeout, args, kwargs)

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (under ``enable_sleep_mode=True``): free the device memory of the weights and
        the KV cache, e.g. while an RL loop trains on the same GPU. Level 1 parks the weights in host
        memory; level 2 drops them, for load_weights to bring new ones after wake_up. The prefix cache is
        forgotten."""
        self.engine.sleep(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Take back the weights and the KV cache (``tags``: ["weights"] or ["kv_cache"] for one of them, so
        that new weights can be loaded before the KV cache takes its memory again)."""
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping

    def _check_awake(self) -> None:
        if self.engine.is_sleeping:
            raise ValueError("the engine is asleep: wake_up() before generating")

    def start_profile(self, folder: str | None = None) -> None:
        """Start the torch profiler, as vLLM's: the trace covers the steps until stop_profile. ``folder``
        defaults to $PLAIT_TORCH_PROFILER_DIR (or vLLM's $VLLM_TORCH_PROFILER_DIR)."""
        self.engine.start_profile(folder)

    def stop_profile(self) -> Path:
        """Stop the profiler and write its Chrome trace (open it in https://ui.perfetto.dev); its path."""
        return self.engine.stop_profile()

    def get_default_sampling_params(self) -> SamplingParams:
        """The params generate and chat use when given none, as vLLM's: SamplingParams' defaults under the
        sampling defaults of the model's generation_config.json (none with ``generation_config="vllm"``)."""
        return SamplingParams(**self.engine.generation_defaults.sampling)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRAInput = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        A prompt is a string, ``{"prompt": str}``, ``{"prompt_token_ids": [...]}``, a list of token ids,
        or (under ``enable_prompt_embeds``) ``{"prompt_embeds": tensor}``, [tokens, hidden] in place of the
        embedding layer's output; an image model's prompt dict may add ``"multi_modal_data": {"image": image
        or [images]}`` (PIL images, bytes or data URLs), one image token in the prompt for each, and any
        prompt dict a ``"cache_salt"`` (vLLM's: its prefix-cache blocks are shared only with prompts of the
        same salt). All prompts are validated before any enters the engine. Without sampling_params,
        get_default_sampling_params() (the model's generation_config.json may set them, as in vLLM).
        ``lora_request`` (under ``enable_lora``): the LoRA adapter of every prompt, or a list with one per
        prompt (None: the base model), as vLLM's. ``priority`` (under ``scheduling_policy="priority"``): one
        per prompt, lower served first, as vLLM's.
        """
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _as_params_list(sampling_params, len(prompts))
        loras = _as_lora_list(lora_request, len(prompts))
        priorities = _as_priority_list(priority, len(prompts))
        batch = self._batch_ids
        self._batch_ids += 1
        children: list[tuple[int, Request, str | None]] = []
        payloads = self._preprocessed([_prompt_payload(prompt) for prompt in prompts])
        salts = [_cache_salt(prompt) for prompt in prompts]
        # Only each request's final output is read here (vLLM's LLM asks for FINAL_ONLY too): the engine
        # then builds no output for the steps in between. One copy per distinct params object.
        distinct = {id(p): p for p in params}
        final_only = {key: dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                      for key, p in distinct.items()}
        for i, (payload, p, lora, rank, salt) in enumerate(zip(payloads, params, loras, priorities, salts)):
            for k, child in enumerate(_fan_out(final_only[id(p)])):
                request_id = f"{batch}-{i}-{k}"
                request, text = self.engine.make_request(payload, child, request_id, lora, rank, salt)
                children.append((i, request, text))
        self._check_awake()
        for _, request, text in children:
            self.engine.enqueue(request, text)
        finished = self._run_to_completion(len(children), use_tqdm)
        return _gather(prompts, params, finished, batch)

    def _preprocessed(self, payloads: list) -> list:
        """The payloads with their images through the image processor, in threads (PIL decodes and resizes
        outside the GIL): a batch's images are read side by side, not one after another."""
        images = self.engine.images
        todo = [i for i, p in enumerate(payloads) if isinstance(p, MultiModalPrompt) and p.images]
        if images is None or len(todo) < 2:
            return payloads
        with ThreadPoolExecutor(min(len(todo), os.cpu_count() or 1)) as pool:
            done = list(pool.map(lambda i: images.preprocess(payloads[i].images), todo))
        out = list(payloads)
        for i, pixels in zip(todo, done):
            out[i] = MultiModalPrompt(payloads[i].prompt, pixels)
        return out

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
        lora_request: LoRAInput = None,
        pooling_task: str | None = None,
    ) -> list[PoolingRequestOutput]:
        """A pooling model's output for every prompt, in prompt order (vLLM's ``LLM.encode``): each
        ``outputs.data`` is the prompt's pooled vector, or with ``pooling_task`` "token_embed" or
        "token_classify" a matrix of one row per prompt token. Prompts as generate's; all are validated before
        any enters the engine. ``truncate_prompt_tokens`` (where given) keeps each prompt's last k tokens;
        ``lora_request`` as generate's (an embedding model under ``enable_lora``). ``pooling_task`` (vLLM's:
        "embed", "classify", "token_embed", "token_classify") sets every PoolingParams' task."""
        prompts = _as_prompt_list(prompts)
        loras = _as_lora_list(lora_request, len(prompts))
        params = pooling_params if pooling_params is not None else PoolingParams()
        if pooling_task is not None:
            params = _with_task(params, pooling_task)
        params = [params] * len(prompts) if isinstance(params, PoolingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} pooling params for {len(prompts)} prompts")
        if truncate_prompt_tokens is not None:
            params = [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in params]
        batch = self._batch_ids
        self._batch_ids += 1
        made = [self.engine.make_request(_prompt_payload(prompt), p, f"{batch}-{i}", lora,
                                         cache_salt=_cache_salt(prompt))
                for i, (prompt, p, lora) in enumerate(zip(prompts, params, loras))]
        self._check_awake()
        for request, text in made:
            self.engine.enqueue(request, text)
        finished = self._run_to_completion(len(made), use_tqdm, desc="embedding")
        return [finished[request.request_id] for request, _ in made]

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
        lora_request: LoRAInput = None,
    ) -> list[EmbeddingRequestOutput]:
        """Every prompt's embedding, in prompt order (vLLM's ``LLM.embed``): ``outputs.embedding`` is a list
        of floats, L2-normalised unless the pooler or ``PoolingParams.normalize`` says otherwise, of
        ``PoolingParams.dimensions`` entries where a Matryoshka model is asked for fewer. Needs a pooling
        model (``LLM(model, runner="pooling")``, or a base model's checkpoint). ``lora_request``: as
        encode's."""
        outputs = self.encode(prompts, _with_task(pooling_params, "embed"), use_tqdm, truncate_prompt_tokens,
                              lora_request)
        return [EmbeddingRequestOutput.from_base(out) for out in outputs]

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Every prompt's class probabilities, in prompt order (vLLM's ``LLM.classify``): ``outputs.probs``,
        one per label of the model's config (``id2label``). Needs a classifier or reward model's checkpoint
        (``...ForSequenceClassification``): the score head's logits at the prompt's last token, through a
        softmax, or a sigmoid for a single label or a multi-label problem (none for regression)."""
        params = PoolingParams(task="classify")
        outputs = self.encode(prompts, params, use_tqdm, truncate_prompt_tokens)
        return [ClassificationRequestOutput.from_base(out) for out in outputs]

    def reward(self, prompts: PromptType | Sequence[PromptType], *, truncate_prompt_tokens: int | None = None,
               use_tqdm: bool = True, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               lora_request: LoRAInput = None) -> list[PoolingRequestOutput]:
        """Every prompt token's reward, in prompt order (vLLM's ``LLM.reward``: ``encode`` with the
        ``token_classify`` task, what token and process reward models give): ``outputs.data`` is a
        [prompt tokens, labels] matrix, the score head at every position through the model's activation.
        Needs a classifier's checkpoint (``...ForSequenceClassification``). Keyword arguments as vLLM's."""
        return self.encode(prompts, pooling_params, use_tqdm, truncate_prompt_tokens, lora_request,
                           pooling_task="token_classify")

    def score(
        self,
        data_1: PromptType | Sequence[PromptType],
        data_2: PromptType | Sequence[PromptType],
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringRequestOutput]:
        """How alike each pair of inputs is, as vLLM's ``LLM.score``: with an embedding model, the cosine
        similarity of their embeddings; with a cross-encoder (a classifier of one label, e.g. Qwen3-Reranker
        under hf_overrides), its probability for the pair read as one prompt (``cross_encoder_prompt``). One
        ``data_1`` input is paired with every ``data_2`` input; otherwise the two lists pair up in order
        (score_pairs)."""
        first, second = _as_prompt_list(data_1), _as_prompt_list(data_2)
        pairs = score_pairs(len(first), len(second))  # refuse lists that do not pair before anything runs
        if cross_encodes(self.engine.pooler.spec if self.engine.pooler is not None else None):
            prompts = [{"prompt_token_ids": cross_encoder_prompt(self.engine, first[i], second[j])}
                       for i, j in pairs]
            scored = self.encode(prompts, PoolingParams(task="classify"), use_tqdm, truncate_prompt_tokens)
            return [ScoringRequestOutput(str(k), out.prompt_token_ids,
                                         ScoringOutput(out.outputs.data[0].item()))
                    for k, out in enumerate(scored)]
        embedded = self.encode(first + second, PoolingParams(task="embed"), use_tqdm, truncate_prompt_tokens)
        ids = [out.prompt_token_ids for out in embedded]
        return [ScoringRequestOutput(str(k), ids[i] + ids[len(first) + j], ScoringOutput(similarity))
                for k, (i, j, similarity) in enumerate(pair_scores(embedded, len(first), len(second)))]

    def beam_search(
        self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams, use_tqdm: bool = False,
        lora_request: LoRAInput = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: the ``params.beam_width`` most likely sequences of each prompt, best first.

        Each step scores every live beam of every prompt in one batch of 1-token requests (prefix caching
        makes their shared prefixes cheap). As vLLM's, a sequence's ``tokens`` start with the prompt's, a
        finished one's end with its EOS, and ``text`` is all of them decoded, special tokens included.
        ``lora_request``: as generate's; every beam of a prompt runs with that prompt's adapter (and its
        prompt dict's ``cache_salt``).
        """
        check_logprobs_mode(self.engine.config.logprobs_mode)
        step = step_params(params)
        prompts = _as_prompt_list(prompts)
        loras = _as_lora_list(lora_request, len(prompts))
        prompt_ids = [self._tokenize(prompt, step, lora) for prompt, lora in zip(prompts, loras)]
        salts = [_cache_salt(prompt) for prompt in prompts]  # every beam of a prompt keeps its salt
        searches = [BeamSearch(ids, params, self.engine.eos_token_ids, self.engine.max_model_len)
                    for ids in prompt_ids]
        with tqdm(total=params.max_tokens, desc="beam search", unit="step", disable=not use_tqdm) as bar:
            while any(pending := pending_beams(searches)):
                beams = [{"prompt_token_ids": tokens, **({"cache_salt": salt} if salt is not None else {})}
                         for salt, beam_list in zip(salts, pending) for tokens in beam_list]
                beam_loras = [lora for lora, beam_list in zip(loras, pending) for _ in beam_list]
                advance_all(searches, pending, self.generate(beams, step, use_tqdm=False,
                                                             lora_request=beam_loras))
                bar.update(1)
        outputs = [BeamSearchOutput(search.best()) for search in searches]
        tokenizer = self.engine.tokenizer
        for sequence in (s for out in outputs for s in out.sequences if tokenizer is not None):
            sequence.text = tokenizer.decode(sequence.tokens, skip_special_tokens=False)
        return outputs

    def _tokenize(self, prompt: PromptType, params: SamplingParams, lora: LoRARequest | None = None
                  ) -> list[int]:
        """A prompt's token ids, as the engine makes them for ``params`` (validated, nothing queued)."""
        request, _ = self.engine.make_request(_prompt_payload(prompt), params, lora_request=lora,
                                              cache_salt=_cache_salt(prompt))
        if request.prompt_embeds is not None:  # its ids are placeholders, which beams would extend
            raise ValueError("beam search takes text or token-id prompts, not prompt_embeds")
        return list(request.prompt_token_ids)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRAInput = None,
        chat_template_content_format: str = AUTO_CONTENT_FORMAT,
    ) -> list[RequestOutput]:
        """Apply the chat template (the model's, or ``chat_template``) to one conversation (a list of
        messages) or many, and generate; each output's ``prompt`` is its rendered conversation.

        A message's content may be text or a list of OpenAI-style parts (text; images for an image model),
        which the template gets as ``chat_template_content_format`` says, as in vLLM: "string" (text parts
        joined by newlines), "openai" (the list), or "auto" (the list for a template that loops over it).

        ``continue_final_message`` leaves the last message open, so the model continues it (an assistant
        prefill) instead of starting a new one; it excludes ``add_generation_prompt``, as in vLLM.
        ``chat_template_kwargs`` become variables of the template; ``tools`` (OpenAI-style function
        definitions) its ``tools``, as in vLLM. ``truncate_prompt_tokens`` cuts the rendered conversation.
        ``lora_request``: as generate's, one per conversation.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.engine.tokenizer
        with_images = [chat_with_images(self.engine, c, chat_template, chat_template_content_format)
                       for c in conversations]
        texts = [render_chat(tokenizer, c, add_generation_prompt, chat_template_kwargs,
                             continue_final_message=continue_final_message, chat_template=chat_template,
                             tools=tools)
                 for c, _ in with_images]
        ids = [encode_rendered(tokenizer, text) for text in texts]
        prompts = [{"prompt_token_ids": i, "multi_modal_data": {"image": images} if images else None}
                   for i, (_, images) in zip(ids, with_images)]
        outputs = self.generate(prompts, sampling_params, use_tqdm, lora_request)
        for out, text, whole, (_, images) in zip(outputs, texts, ids, with_images, strict=True):
            # A conversation truncate_prompt_tokens cut is shown as the part the model saw (images refuse
            # truncation; their placeholders make the ids longer than the text's).
            kept = out.prompt_token_ids
            shown_whole = kept == whole or images
            out.prompt = text if shown_whole else tokenizer.decode(kept, skip_special_tokens=False)
        return outputs

    def apply_chat_template(
        self, conversation: list[Message], add_generation_prompt: bool = True, kwargs: dict | None = None
    ) -> list[int]:
        return apply_chat_template(self.engine.tokenizer, conversation, add_generation_prompt, kwargs)

    def _run_to_completion(self, total: int, use_tqdm: bool, desc: str = "generating"
                           ) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=total, desc=desc, unit="req", disable=not use_tqdm) as bar:
            for out in self._drain():
                finished[out.request_id] = out
                bar.update(1)
        return finished

    def _drain(self) -> Iterator[RequestOutput]:
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    if isinstance(out, RequestOutput):
                        self._metrics.observe(out)
                    yield out


def apply_chat_template(
    tokenizer: Any, conversation: list[Message], add_generation_prompt: bool = True,
    kwargs: dict | None = None, **options: Any,
) -> list[int]:
    """Token ids of a conversation: render_chat's text (``options``: its keyword-only ones), encoded."""
    return encode_rendered(tokenizer, render_chat(tokenizer, conversation, add_generation_prompt, kwargs,
                                                  **options))


def render_chat(
    tokenizer: Any,
    conversation: list[Message],
    add_generation_prompt: bool = True,
    kwargs: dict | None = None,
    *,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """A conversation as prompt text under the model's chat template (or ``chat_template``).

    continue_final_message: end on the last message's text, without the template's end-of-turn after it.
    tools: OpenAI-style tool definitions, the template's ``tools`` (a template that knows tools lists them).
    """
    if add_generation_prompt and continue_final_message:
        # As vLLM: opening a new assistant turn and leaving the last message open exclude each other.
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true; "
                         "pass add_generation_prompt=False to continue the final message")
    if tokenizer is None or not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise ValueError("this model has no chat template; use generate() with a plain prompt")
    for m in conversation:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"each chat message needs 'role' and 'content', got {m!r}")
    return tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message, chat_template=chat_template, tools=tools,
        **(kwargs or {}),
    )


def chat_with_images(engine: Any, conversation: list[Message], chat_template: str | None = None,
                     chosen_format: str = AUTO_CONTENT_FORMAT) -> tuple[list[Message], list[Any]]:
    """A conversation as the chat template takes it under ``chosen_format`` (plait.multimodal.chat's
    content formats), and its images in order."""
    tokenizer = engine.tokenizer
    template = chat_template or getattr(tokenizer, "chat_template", None)
    image_text = image_token_text(tokenizer, engine.images.prompt_token_ids) if engine.images else None
    return prepare_chat(conversation, template, image_text, engine.model_config.architecture, chosen_format)


def encode_rendered(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a prompt render_chat wrote."""
    # The template already wrote any special tokens; adding them again would double BOS.
    return list(tokenizer.encode(text, add_special_tokens=False))


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # a single prompt given as token ids
    if isinstance(prompts, (list, tuple)):
        return list(prompts)
    raise TypeError(f"prompts must be a string, a dict, or a list of them, got {type(prompts).__name__}")


def _as_params_list(params: SamplingParams | Sequence[SamplingParams], n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params


def _as_lora_list(lora: LoRAInput, n: int) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * n
    if not isinstance(lora, (list, tuple)):
        raise TypeError(f"lora_request must be a LoRARequest or a list of them, got {type(lora).__name__}")
    if len(lora) != n:
        raise ValueError(f"got {len(lora)} LoRA requests for {n} prompts")
    return list(lora)


def _as_priority_list(priority: Sequence[int] | None, n: int) -> list[int]:
    if priority is None:
        return [0] * n
    if isinstance(priority, (int, str)) or not isinstance(priority, Sequence):
        raise TypeError(f"priority must be a list with one integer per prompt, got {type(priority).__name__}")
    if len(priority) != n:  # vLLM's check
        raise ValueError(f"got {len(priority)} priorities for {n} prompts")
    return list(priority)


def _prompt_payload(prompt: PromptType) -> str | list[int] | MultiModalPrompt | torch.Tensor:
    if isinstance(prompt, dict):
        if "prompt_embeds" in prompt:
            embeds = prompt["prompt_embeds"]
            if not isinstance(embeds, torch.Tensor):
                raise TypeError(f"prompt_embeds must be a torch.Tensor, got {type(embeds).__name__}")
            return embeds
        if "prompt_token_ids" in prompt:
            payload = list(prompt["prompt_token_ids"])
        elif "prompt" in prompt:
            payload = prompt["prompt"]
        else:
            raise ValueError(f"a prompt dict needs 'prompt', 'prompt_token_ids' or 'prompt_embeds', got keys "
                             f"{sorted(prompt)}")
        data = prompt.get("multi_modal_data")
        return payload if not data else MultiModalPrompt(payload, _images_of(data))
    if isinstance(prompt, (str, MultiModalPrompt)):
        return prompt
    return list(prompt)


def _cache_salt(prompt: PromptType) -> str | None:
    """A prompt dict's ``cache_salt`` (None for other prompts); the engine checks it."""
    return prompt.get("cache_salt") if isinstance(prompt, dict) else None


def _images_of(data: dict) -> tuple[Any, ...]:
    """The images of vLLM's ``multi_modal_data`` ({"image": an image or a list of them})."""
    if isinstance(data, dict) and "video" in data:
        raise ValueError("video inputs are not supported (the Qwen-VL models take images only): send "
                         "multi_modal_data={'image': ...}")
    if not isinstance(data, dict) or set(data) - {"image"}:
        given = sorted(data) if isinstance(data, dict) else data
        raise ValueError(f"multi_modal_data takes 'image' alone, got {given}")
    images = data.get("image")
    if images is None:
        return ()
    return tuple(images) if isinstance(images, (list, tuple)) else (images,)


def cross_encodes(spec: Any) -> bool:
    """Whether a model of this PoolingSpec (None: a generating model) scores pairs itself: a classifier of
    one label (a cross-encoder), as vLLM serves /score with one. An embedding model scores by the cosine of
    two embeddings instead."""
    return spec is not None and spec.task == "classify" and len(spec.labels) == 1


def cross_encoder_prompt(engine: Any, first: PromptType, second: PromptType) -> list[int]:
    """A pair as one prompt for a cross-encoder, as vLLM forms it: two texts through the tokenizer as a pair
    (its pair template, e.g. [BOS] a [SEP] b; plain concatenation where it has none), token ids joined."""
    if isinstance(first, str) and isinstance(second, str):
        if engine.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids to score")
        ids = list(engine.tokenizer(first, text_pair=second)["input_ids"])
        if not ids:
            raise ValueError("prompt is empty")
        return ids
    return [*_prompt_ids(engine, first), *_prompt_ids(engine, second)]


def _prompt_ids(engine: Any, prompt: PromptType) -> list[int]:
    if isinstance(prompt, str):
        return engine.encode_text(prompt)
    if isinstance(prompt, dict):
        return list(prompt["prompt_token_ids"])
    return list(prompt)


def pair_scores(outputs: Sequence[PoolingRequestOutput], num_first: int, num_second: int
                ) -> list[tuple[int, int, float]]:
    """Each scored pair's (first input's index, second input's index, cosine similarity of their
    embeddings), paired as score_pairs pairs them; ``outputs`` holds the first inputs' embeddings, then the
    second ones'."""
    vectors = torch.stack([out.outputs.data for out in outputs])
    first, second = vectors[:num_first], vectors[num_first:]
    pairs = score_pairs(num_first, num_second)
    a, b = first[[i for i, _ in pairs]], second[[j for _, j in pairs]]
    similarity = torch.nn.functional.cosine_similarity(a, b, dim=-1).tolist()
    return [(i, j, s) for (i, j), s in zip(pairs, similarity)]


def _with_task(params: PoolingParams | Sequence[PoolingParams] | None, task: str
               ) -> PoolingParams | list[PoolingParams]:
    """Pooling params that ask the model for ``task`` (each of a list, or the defaults)."""
    if params is None or isinstance(params, PoolingParams):
        return dataclasses.replace(params or PoolingParams(), task=task)
    return [dataclasses.replace(p, task=task) for p in params]


def _fan_out(params: SamplingParams) -> list[SamplingParams]:
    """n > 1 becomes n single-sequence requests; seeded ones get distinct seeds (seed + index)."""
    if params.n == 1:
        return [params]
    return [
        dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + k)
        for k in range(params.n)
    ]


def _gather(prompts: list[PromptType], params: list[SamplingParams],
            finished: dict[str, RequestOutput], batch: int) -> list[RequestOutput]:
    results = []
    for i in range(len(prompts)):
        outs = [finished[f"{batch}-{i}-{k}"] for k in range(params[i].n)]
        completions = []
        for k, out in enumerate(outs):
            completion = out.outputs[0]
            completion.index = k
            completions.append(completion)
        first = outs[0]
        results.append(RequestOutput(str(i), first.prompt, first.prompt_token_ids, completions, True,
                                     num_cached_tokens=first.num_cached_tokens,
                                     prompt_logprobs=first.prompt_logprobs, metrics=first.metrics))
    return results
