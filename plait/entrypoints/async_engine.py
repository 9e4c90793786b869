"""AsyncLLMEngine: the engine's step loop in its own thread, fed by and streaming to asyncio."""

from __future__ import annotations

import abc
import asyncio
import collections
import copy
import dataclasses
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import torch

from plait.config import EngineConfig
from plait.engine.engine import LLMEngine, StepStats
from plait.engine.request import Request
from plait.generation_config import GenerationDefaults
from plait.loader.hf import ModelSource
from plait.lora.request import LoRARequest
from plait.outputs import PoolingRequestOutput, RequestOutput
from plait.pooling_params import PoolingParams
from plait.runner.pooler import PoolingSpec
from plait.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")
# A prompt as the engine takes it, or a function that builds one on the loop thread (for work that
# needs the engine's tokenizer, which only the loop thread may use once the loop runs).
PromptInput = str | Sequence[int] | torch.Tensor | Callable[[LLMEngine], "str | list[int]"]
# Extra checks on a made request before it is queued; raise ValueError to refuse it.
Validator = Callable[[Request, LLMEngine], None]
StepCallback = Callable[[StepStats], None]

# How long shutdown waits for the loop thread to finish the step it is in.
SHUTDOWN_JOIN_TIMEOUT_S = 60.0


class EngineDeadError(RuntimeError):
    """The step loop is not running (never started, shut down, or crashed)."""


class RequestFailedError(RuntimeError):
    """The engine failed while running a request (a step raised); the request was aborted."""


class RequestTimeoutError(TimeoutError):
    """A request ran past its deadline and was aborted."""


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of engine state, published by the loop thread for readers on other threads."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_usage: float = 0.0  # fraction of usable KV blocks held by requests
    num_steps: int = 0
    num_failed_steps: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached on the device
    # KV offloading (None: off): vLLM's external tier, here the host pool: prompt tokens looked up with it
    # on, and tokens of those copied back from it.
    external_prefix_cache_queries: int | None = None
    external_prefix_cache_hits: int = 0
    kv_offloaded_blocks: int = 0  # evicted device blocks copied to the host pool
    prefix_cache_blocks: int = 0  # blocks findable by hash (held, or free but cached)
    prefix_cache_evicted_blocks: int = 0
    # Speculative decoding (None: off): rows that carried drafts, draft tokens, kept ones, kept by position.
    spec_num_drafts: int | None = None
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    # LoRA (None: off): the adapter slots, and the adapters of the running and of the waiting requests.
    max_loras: int | None = None
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
    sleep_level: int | None = None  # None: sleep mode off; 0 awake; else the level of the sleep it is in


@dataclass(frozen=True)
class EngineInfo:
    """What a server reads from its engine, all fixed once the model is loaded: read here from an engine in
    this process, or sent whole by an engine process once it has loaded."""

    config: EngineConfig  # as the engine resolved it (its token budget, prompt cap, KV dtype)
    model_source: ModelSource
    max_model_len: int
    vocab_size: int
    pooling_spec: PoolingSpec | None  # None for a model that generates
    eos_token_ids: frozenset[int]
    generation_defaults: GenerationDefaults  # the model's generation_config.json
    tokenizer: Any  # a copy: the server's own, never the one the engine detokenizes with
    image_processor: Any  # None for a text model; stateless, so it may be shared
    max_logprobs: int
    num_kv_blocks: int  # usable KV blocks

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineInfo:
        return cls(config=engine.config, model_source=engine.model_source, max_model_len=engine.max_model_len,
                   vocab_size=engine.model_config.vocab_size,
                   pooling_spec=engine.pooler.spec if engine.pooler is not None else None,
                   eos_token_ids=engine.eos_token_ids, generation_defaults=engine.generation_defaults,
                   tokenizer=copy.deepcopy(engine.tokenizer), image_processor=engine.images,
                   max_logprobs=engine.max_logprobs, num_kv_blocks=engine.kv_cache.num_usable_blocks)


# What a RequestStream hands its reader: an engine output, or the error that ended its requests.
StreamItem = RequestOutput | PoolingRequestOutput | BaseException


class RequestStream:
    """Outputs of one HTTP request's engine requests (several for n > 1 or a prompt batch).

    Iterate with ``async for index, output in stream``; ``index`` is the child's position in the list
    given to ``AsyncLLMEngine.add``. Leaving ``async with stream`` aborts whatever is unfinished, so a
    cancelled consumer (client gone) frees its KV blocks at the next step.
    """

    def __init__(self, owner: EngineClient, request_ids: list[str], deadline: float | None) -> None:
        self._owner = owner
        self.request_ids = request_ids
        self._index = {rid: i for i, rid in enumerate(request_ids)}
        self._items: collections.deque[StreamItem] = collections.deque()
        self._arrived = asyncio.Event()
        self._unfinished = set(request_ids)
        self._deadline = deadline
        # Set by AsyncLLMEngine.add: the prompt token ids of each child, as the engine tokenized them.
        self.prompt_token_ids: list[list[int]] = []
        self.aborted: list[int] = []  # indices of children aborted before they finished
        # Each child's prompt tokens served from the prefix cache, as its outputs report them.
        self.num_cached_tokens = [0] * len(request_ids)
        # Called with (index, output) as each child's final output is consumed (a server's output log).
        self.on_finished: Callable[[int, RequestOutput | PoolingRequestOutput], None] | None = None
        # Set by a server that sends a chunk per output read: a child's outputs that pile up while the reader
        # is behind (a busy event loop) merge into one, so one chunk carries them, as vLLM's streams do; what
        # the merged output's reader sees of each step is in metrics["output_times"].
        self.merge_backlog = False
        # vLLM's --stream-interval, set by a server that streams: after a child's first tokens (sent at once,
        # for the time to first token), its outputs are held and merged until they carry this many new
        # tokens, or it finishes: fewer, fuller chunks.
        self.stream_interval = 1
        self._held: dict[str, RequestOutput] = {}  # a child's merged outputs not yet released
        self._released: set[str] = set()  # children whose first tokens went out

    def read_as_chunks(self, stream_interval: int) -> None:
        """Set by a server that sends a chunk per output read: outputs piled up behind the reader merge
        (merge_backlog), and after a child's first tokens they wait for ``stream_interval`` new ones."""
        self.merge_backlog = True
        self.stream_interval = stream_interval

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput | PoolingRequestOutput]:
        if not self._unfinished:
            raise StopAsyncIteration
        if self._deadline is None:
            item = await self._next()
        else:
            try:
                item = await asyncio.wait_for(self._next(), max(0.0, self._deadline - time.monotonic()))
            except asyncio.TimeoutError:
                self.abort()
                raise RequestTimeoutError("the request timed out and was aborted") from None
        if isinstance(item, BaseException):
            self.abort()
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
        index = self._index[item.request_id]
        self.num_cached_tokens[index] = item.num_cached_tokens or 0
        if item.finished and self.on_finished is not None:
            self.on_finished(index, item)
        return index, item

    def abort(self) -> None:
        """Abort the unfinished children (idempotent)."""
        if not self._unfinished:
            return
        ids = sorted(self._unfinished, key=self._index.__getitem__)
        self.aborted.extend(self._index[rid] for rid in ids)
        self._unfinished.clear()
        self._owner._forget(ids)
        self._owner.abort(ids)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.abort()

    async def _next(self) -> StreamItem:
        while not self._items:
            self._arrived.clear()
            await self._arrived.wait()
        return self._items.popleft()

    # Called on the event loop by the engine client.
    def _put(self, item: StreamItem) -> None:
        if self.stream_interval > 1 and isinstance(item, RequestOutput):
            item = self._held_until_interval(item)
            if item is None:
                return
        if self.merge_backlog and isinstance(item, RequestOutput):
            for k in range(len(self._items) - 1, -1, -1):  # this child's last unread output, if any
                queued = self._items[k]
                if isinstance(queued, BaseException):
                    break
                if queued.request_id == item.request_id:
                    merged = _merged(queued, item)
                    if merged is not None:
                        self._items[k] = merged
                        return
                    break
        self._items.append(item)
        self._arrived.set()

    def _held_until_interval(self, item: RequestOutput) -> RequestOutput | None:
        """``item`` merged with the child's held outputs: released (returned) once it is the child's first
        output with tokens, carries stream_interval new tokens or finishes; held (None) otherwise."""
        rid = item.request_id
        held = self._held.pop(rid, None)
        if held is not None:
            item = _merged(held, item) or item
        new_tokens = len(item.outputs[0].delta_token_ids) if item.outputs else 0
        if item.finished or (rid not in self._released and new_tokens) or new_tokens >= self.stream_interval:
            self._released.add(rid)
            return item
        self._held[rid] = item
        return None


def _merged(old: RequestOutput | PoolingRequestOutput, new: RequestOutput) -> RequestOutput | None:
    """``new`` as the output of both its step and ``old``'s, both steps' times kept: a CUMULATIVE one with
    old's deltas before its own, a DELTA one with old's text, ids and logprobs before its own; None unless
    ``old`` is an unfinished output of the same kind."""
    if not isinstance(old, RequestOutput) or old.finished:
        return None
    before, after = old.outputs[0], new.outputs[0]
    prompt_logprobs = new.prompt_logprobs
    if len(after.token_ids) == len(before.token_ids) + len(after.delta_token_ids):  # cumulative
        completion = after
    elif before.token_ids == before.delta_token_ids and after.token_ids == after.delta_token_ids:  # deltas
        logprobs = (None if before.logprobs is None and after.logprobs is None
                    else [*(before.logprobs or ()), *(after.logprobs or ())])
        completion = dataclasses.replace(after, text=before.text + after.text,
                                         token_ids=before.token_ids + after.token_ids, logprobs=logprobs)
        prompt_logprobs = old.prompt_logprobs if new.prompt_logprobs is None else new.prompt_logprobs
    else:
        return None
    completion = dataclasses.replace(completion, delta_text=before.delta_text + after.delta_text,
                                     delta_token_ids=before.delta_token_ids + after.delta_token_ids)
    times = [t for out in (old, new) for t in (out.metrics.get("output_times") or (out.metrics.get("now"),))
             if t is not None]
    return dataclasses.replace(new, outputs=[completion], prompt_logprobs=prompt_logprobs,
                               metrics={**new.metrics, "output_times": times})


_STOP = object()  # command that ends the loop thread


class EngineClient(abc.ABC):
    """What a server holds of its engine, on the event loop: add requests and stream their outputs, abort
    them, call functions on the engine between steps, and read its stats. Subclasses say where the step
    loop runs (AsyncLLMEngine: a thread of this process; EngineProcess: a process of its own) and how
    commands reach it; the loop's answers come back to this class's callbacks on the event loop."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: str | None = "not started"
        # Event-loop side: live request id -> its stream.
        self._streams: dict[str, RequestStream] = {}
        self._id_prefix = uuid.uuid4().hex[:8]
        self._ids = itertools.count()
        self.stats = EngineStats()
        self.on_step: StepCallback | None = None  # each step's StepStats, where the server wants them
        # Called once, on the event loop, if the step loop dies unasked (a crash; a dead engine process).
        self.on_dead: Callable[[str], None] | None = None
        self._death_told = False

    def _report_step(self, stats: StepStats) -> None:
        if self.on_step is None:
            return
        try:
            self.on_step(stats)
        except Exception:
            logger.exception("on_step callback failed")

    @abc.abstractmethod
    def start(self) -> None:
        """Start serving; call from the event loop that will consume the outputs."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Stop the step loop after its current step; unfinished requests are aborted."""

    @property
    @abc.abstractmethod
    def is_alive(self) -> bool:
        """The step loop runs and takes requests."""

    @property
    @abc.abstractmethod
    def is_sleeping(self) -> bool:
        """The engine's sleep state (LLMEngine.sleep), known before a sleep or wake_up call returns, so a
        caller that awaited one reads its effect."""

    def _check_alive(self) -> None:
        if not self.is_alive:
            raise EngineDeadError(f"the engine loop is not running ({self._dead or 'thread exited'})")

    # -- requests (event loop) ---------------------------------------------------------------

    async def add(
        self,
        children: Sequence[tuple[PromptInput, SamplingParams | PoolingParams]],
        validate: Validator | None = None,
        timeout_s: float | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Validate and queue one engine request per (prompt, params), all with ``lora_request``'s adapter
        (None: the base model), ``priority`` (under the "priority" scheduling policy; lower is served
        first) and ``cache_salt`` (their prefix-cache blocks shared only under the same salt); all or none
        are queued.

        Validation errors (ValueError, TypeError, or what a prompt builder raises) are raised here,
        before any of the requests enters the engine.
        """
        self._check_alive()
        base = f"{self._id_prefix}-{next(self._ids)}"
        ids = [f"{base}-{k}" for k in range(len(children))]
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        stream = RequestStream(self, ids, deadline)
        for rid in ids:
            self._streams[rid] = stream
        future: asyncio.Future[list[list[int]]] = asyncio.get_running_loop().create_future()
        self._send_add(list(zip(ids, children)), validate, future, lora_request, priority, cache_salt)
        try:
            stream.prompt_token_ids = await future
        except asyncio.CancelledError:
            # The caller left while the add was queued; the loop may still run it, so abort after it.
            self._forget(ids)
            self.abort(ids)
            raise
        except BaseException:
            self._forget(ids)
            raise
        return stream

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests at the next gap between steps (thread-safe, never blocks)."""
        if request_ids:
            self._send_abort(list(request_ids))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the loop thread between steps and return its result."""
        self._check_alive()
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._send_call(fn, future)
        return await future

    def call_threadsafe(self, fn: Callable[[LLMEngine], T], timeout_s: float | None = None) -> T:
        """``call`` from a thread other than the event loop's (tests, tools); blocks for the result."""
        self._check_alive()
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(self.call(fn), self._loop).result(timeout_s)

    @abc.abstractmethod
    def _send_add(self, children: list[tuple[str, tuple[PromptInput, SamplingParams | PoolingParams]]],
                  validate: Validator | None, future: asyncio.Future, lora_request: LoRARequest | None,
                  priority: int, cache_salt: str | None) -> None:
        """Queue _do_add on the loop; its answer resolves ``future``."""

    @abc.abstractmethod
    def _send_abort(self, request_ids: list[str]) -> None:
        """Queue _do_abort on the loop."""

    @abc.abstractmethod
    def _send_call(self, fn: Callable[[LLMEngine], Any], future: asyncio.Future) -> None:
        """Queue _do_call on the loop; its answer resolves ``future``."""

    def _forget(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._streams.pop(rid, None)

    # -- event-loop callbacks, posted by the loop thread ----------------------------------------

    @staticmethod
    def _resolve(future: asyncio.Future, result: Any) -> None:
        if future.done():  # cancelled by a caller that left
            return
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)

    def _deliver(self, outputs: list[RequestOutput | PoolingRequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted by its consumer; this output was made before the abort ran
            if out.finished:
                del self._streams[out.request_id]
            stream._put(out)

    def _fail_all(self, error: BaseException) -> None:
        self._fail(list(self._streams), error)

    def _died(self, reason: str) -> None:
        """The step loop died unasked: fail everything waiting on it, and tell ``on_dead`` (once)."""
        self._dead = reason
        self._fail_all(EngineDeadError(reason))
        if self.on_dead is not None and not self._death_told:
            self._death_told = True
            self.on_dead(reason)

    def _fail(self, request_ids: list[str], error: BaseException) -> None:
        for rid in request_ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream._put(error)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        """Schedule ``fn(*args)`` on the event loop from the loop thread."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)  # type: ignore[union-attr]
        except RuntimeError:
            pass  # the event loop is closed: nobody is left to tell


class AsyncLLMEngine(EngineClient):
    """Runs ``LLMEngine.step()`` in a dedicated thread; add, abort and stream from asyncio.

    Only the loop thread touches the engine once ``start()`` has run: requests, aborts and any
    other engine work are commands on a thread-safe queue, run between steps. Outputs go back to
    the event loop with one ``call_soon_threadsafe`` per step, into per-request streams.
    A step that raises aborts the requests it was running (their streams raise RequestFailedError)
    and the loop goes on serving.
    """

    def __init__(self, engine: LLMEngine, on_step: StepCallback | None = None) -> None:
        super().__init__()
        self._engine = engine
        self.on_step = on_step
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        # Loop-thread side: ids this engine enqueued that have not finished.
        self._live: set[str] = set()

    # -- lifecycle (event loop) --------------------------------------------------------------

    def start(self) -> None:
        """Start the loop thread; call from the event loop that will consume the outputs."""
        if self._thread is not None:
            raise RuntimeError("AsyncLLMEngine already started")
        self._loop = asyncio.get_running_loop()
        if self.on_step is not None:
            self._engine.record_timeline = True
        self._dead = None
        self._publish_stats(0, 0)
        self._thread = threading.Thread(target=self._run, name="plait-engine-loop", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop the loop thread after its current step; unfinished requests are aborted."""
        if self._thread is None:
            return
        self._commands.put(_STOP)
        await asyncio.to_thread(self._thread.join, SHUTDOWN_JOIN_TIMEOUT_S)
        if not self._thread.is_alive():  # a step still running keeps its workers until it ends
            self._engine.shutdown()
        self._dead = "shut down"
        self._fail_all(EngineDeadError("the server is shutting down"))

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def is_sleeping(self) -> bool:
        """The engine's sleep state (LLMEngine.sleep), set on the loop thread before a sleep or wake_up
        call returns, so a caller that awaited one reads its effect."""
        return self._engine.is_sleeping

    # Commands reach the loop thread through a queue it reads between steps.
    def _send_add(self, children: list[tuple[str, tuple[PromptInput, SamplingParams | PoolingParams]]],
                  validate: Validator | None, future: asyncio.Future, lora_request: LoRARequest | None,
                  priority: int, cache_salt: str | None) -> None:
        self._commands.put(partial(self._do_add, children, validate, future, lora_request, priority,
                                   cache_salt))

    def _send_abort(self, request_ids: list[str]) -> None:
        self._commands.put(partial(self._do_abort, request_ids))

    def _send_call(self, fn: Callable[[LLMEngine], Any], future: asyncio.Future) -> None:
        self._commands.put(partial(self._do_call, fn, future))

    # -- the loop thread -----------------------------------------------------------------------

    def _run(self) -> None:
        engine = self._engine
        num_failed = 0
        try:
            while True:
                # Asleep, queued requests wait for the command that wakes the engine.
                runnable = engine.has_unfinished_requests() and not engine.is_sleeping
                if not self._run_commands(block=not runnable):
                    break
                if runnable and not self._step():
                    num_failed += 1
                self._publish_stats(engine.num_steps + num_failed, num_failed)
        except BaseException as err:  # a bug in the loop itself: say so, and fail every waiter
            logger.exception("the engine loop crashed")
            self._dead = f"crashed: {err!r}"
            self._post(self._died, self._dead)
            return
        self._abort_all(engine)
        self._publish_stats(engine.num_steps + num_failed, num_failed)

    def _run_commands(self, block: bool) -> bool:
        """Run queued commands (waiting for one if ``block``); False once told to stop."""
        try:
            command = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command is _STOP:
                return False
            try:
                command(self._engine)
            except Exception:  # commands report their own errors; this is a last resort
                logger.exception("engine command failed")
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _step(self) -> bool:
        engine = self._engine
        try:
            outputs = engine.step()
        except Exception as err:
            # The step cannot say which request broke it, so every request it may have touched is
            # aborted (freeing its blocks); the loop keeps serving new requests.
            logger.exception("engine step failed; aborting the %d requests in flight", len(self._live))
            failed = self._abort_all(engine)
            error = RequestFailedError(f"the engine failed while running this request: {err}")
            self._post(self._fail, failed, error)
            if engine.has_unfinished_requests():
                # Requests this loop does not know about would fail every step from now on.
                self._dead = "the engine holds requests it cannot run after a failed step"
                raise RuntimeError(self._dead) from err
            return False
        for out in outputs:
            if out.finished:
                self._live.discard(out.request_id)
        if engine.record_timeline and engine.timeline:
            # The engine appends to an unbounded list; a server keeps only what it reports.
            stats = engine.timeline[-1]
            engine.timeline.clear()
            self._report_step(stats)
        if outputs:
            self._post(self._deliver, outputs)
        return True

    def _abort_all(self, engine: LLMEngine) -> list[str]:
        failed = sorted(self._live)
        for rid in failed:
            try:
                engine.abort_request(rid)
            except Exception:
                logger.exception("could not abort request %s", rid)
        self._live.clear()
        return failed

    def _publish_stats(self, num_steps: int, num_failed: int) -> None:
        engine = self._engine
        self.stats = EngineStats(
            num_running=engine.num_running,
            num_waiting=engine.num_waiting,
            kv_blocks_used=engine.kv_cache.num_used_blocks,
            kv_usage=engine.kv_cache.usage,
            num_steps=num_steps,
            num_failed_steps=num_failed,
            prefix_cache_queries=engine.kv_cache.stats.queries,
            prefix_cache_hits=engine.kv_cache.stats.local_hits,
            **_offload_stats(engine),
            prefix_cache_blocks=engine.kv_cache.num_cached_blocks,
            prefix_cache_evicted_blocks=engine.kv_cache.stats.evicted_blocks,
            **_spec_stats(engine),
            **_lora_stats(engine),
            sleep_level=engine.sleep_level if engine.config.enable_sleep_mode else None,
        )

    # -- commands (run on the loop thread) ------------------------------------------------------

    def _do_add(
        self,
        children: list[tuple[str, tuple[PromptInput, SamplingParams | PoolingParams]]],
        validate: Validator | None,
        future: asyncio.Future,
        lora_request: LoRARequest | None,
        priority: int,
        cache_salt: str | None,
        engine: LLMEngine,
    ) -> None:
        made: list[tuple[Request, str | None]] = []
        try:
            for rid, (prompt, params) in children:
                if callable(prompt):
                    prompt = prompt(engine)
                request, text = engine.make_request(prompt, params, rid, lora_request, priority, cache_salt)
                if validate is not None:
                    validate(request, engine)
                made.append((request, text))
        except Exception as err:  # nothing was queued: the caller gets the error
            self._post(self._resolve, future, err)
            return
        try:
            for request, text in made:
                engine.enqueue(request, text)
                self._live.add(request.request_id)
        except Exception as err:  # all or none: take back what was queued
            self._do_abort([r.request_id for r, _ in made])
            self._post(self._resolve, future, err)
            return
        self._post(self._resolve, future, [list(r.prompt_token_ids) for r, _ in made])

    def _do_call(self, fn: Callable[[LLMEngine], Any], future: asyncio.Future, engine: LLMEngine) -> None:
        try:
            result: Any = fn(engine)
        except Exception as err:  # returned to the caller, never raised in the loop
            result = err
        self._post(self._resolve, future, result)

    def _do_abort(self, request_ids: list[str], engine: LLMEngine | None = None) -> None:
        for rid in request_ids:
            if rid in self._live:
                self._live.discard(rid)
                try:
                    self._engine.abort_request(rid)
                except Exception:
                    logger.exception("could not abort request %s", rid)


def _lora_stats(engine: LLMEngine) -> dict:
    """The LoRA fields of EngineStats: adapter names by request state, each once, in queue order."""
    if not engine.config.enable_lora:
        return {}
    sched = engine.scheduler

    def names(requests: Any) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r.lora.request.lora_name for r in requests if r.lora is not None))

    return {"max_loras": engine.config.max_loras, "running_loras": names(sched.running),
            "waiting_loras": names(sched.waiting)}


def _offload_stats(engine: LLMEngine) -> dict:
    """EngineStats' KV-offloading fields (none where no host pool backs the prefix cache). As vLLM's
    connector, the host pool is asked about every admitted prompt the device is."""
    stats = engine.kv_cache.stats
    if engine.kv_cache.host is None:
        return {}
    return dict(external_prefix_cache_queries=stats.queries, external_prefix_cache_hits=stats.external_hits,
                kv_offloaded_blocks=stats.offloaded_blocks)


def _spec_stats(engine: LLMEngine) -> dict:
    """EngineStats' speculative-decoding fields (none where it is off)."""
    if engine.drafter is None:
        return {}
    spec = engine.spec_stats
    return dict(spec_num_drafts=spec.num_drafts, spec_num_draft_tokens=spec.num_draft_tokens,
                spec_num_accepted_tokens=spec.num_accepted_tokens,
                spec_accepted_per_position=tuple(spec.accepted_per_position))
