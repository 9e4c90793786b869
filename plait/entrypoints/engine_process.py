"""EngineProcess: the engine's step loop in a process of its own (vLLM's engine core), so that the server's
HTTP work and the engine's steps never take turns on one GIL.

The server keeps what it streams to clients (RequestStream, the event loop); the engine process runs
AsyncLLMEngine's loop on its main thread. Commands cross a pipe; each loop iteration's answers cross back as
one message. Outputs cross as deltas (new text and token ids; a request's prompt once), never the cumulative
lists an output carries, which would make every step's message grow with every stream's length: the server
sums them back for the requests that asked for cumulative outputs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

from plait.config import EngineConfig
from plait.engine.engine import LLMEngine, StepStats
from plait.entrypoints.async_engine import (
    _STOP,
    AsyncLLMEngine,
    EngineClient,
    EngineDeadError,
    EngineInfo,
    PromptInput,
    Validator,
)
from plait.entrypoints.launcher import (
    PICKLE_PROTOCOL,
    StartedEngineProcess,
    kill_engine_process,
    start_engine_process,
)
from plait.lora.request import LoRARequest
from plait.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput, TokenLogprobs
from plait.pooling_params import PoolingParams
from plait.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

# Messages, server -> engine process: first the (EngineConfig, log level) to load; then (kind, token, payload)
# with the payload pickled apart, so that one the engine process cannot read is refused to its caller alone:
# (ADD, token, (children, validator, LoRA request, priority, cache salt)), (ABORT, None, request ids),
# (CALL, token, function of the engine), (STOP, None, None).
ADD, ABORT, CALL, STOP = "add", "abort", "call", "stop"
# Engine process -> server: (READY, EngineInfo) once loaded, or (FAILED, (the error, its traceback)); then one
# (EVENTS, [(kind, payload), ...]) per loop iteration: STATS (EngineStats) first, then in the order they
# happened RESULT ((token, value or error)), OUTPUTS (encode_output's records), FAIL ((request ids, error)),
# STEP (StepStats), DEAD (why the loop stopped).
READY, FAILED, EVENTS = "ready", "failed", "events"
STATS, RESULT, OUTPUTS, FAIL, STEP, DEAD = "stats", "result", "outputs", "fail", "step", "dead"
# How long the engine process may take to load the model (weights, KV cache, graphs) and say it is ready.
ENGINE_START_TIMEOUT_S = 1800.0
# How long a stopping engine process may take to finish its step and exit before it is killed.
ENGINE_STOP_TIMEOUT_S = 60.0
# How often a wait on the engine process looks whether it is still there.
POLL_S = 0.1


class EngineProcess(EngineClient):
    """The server's side: starts the engine process, waits for it to load, then streams as AsyncLLMEngine
    does. ``info`` is what the server reads of the loaded engine; ``on_step`` (set before ``start``) gets
    each step's StepStats on the event loop."""

    def __init__(self, config: EngineConfig, start_timeout_s: float = ENGINE_START_TIMEOUT_S,
                 started: StartedEngineProcess | None = None) -> None:
        """``started``: the engine process `plait serve` started for ``config`` before importing the server
        (launcher.py); else one is started here."""
        super().__init__()
        self._proc, self._conn = (started or start_engine_process(config)).adopt()
        self._send_lock = threading.Lock()
        # Stops the engine process when this object is dropped or the interpreter exits, if shutdown did not.
        self._finalizer = weakref.finalize(self, _stop_process, self._proc, self._conn)
        self.info: EngineInfo = self._wait_ready(start_timeout_s)
        self._reader: threading.Thread | None = None
        self._tokens = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}  # token -> the future its RESULT resolves
        self._cumulative: set[str] = set()  # requests that asked for CUMULATIVE outputs, not yet seen
        self._requests: dict[str, _Received] = {}  # unfinished requests whose first output came
        self._stopping = False

    # -- start-up (the caller's thread) ------------------------------------------------------------

    def _wait_ready(self, timeout_s: float) -> EngineInfo:
        deadline = time.monotonic() + timeout_s
        try:
            while not self._conn.poll(POLL_S):
                # A process that failed said why before it exited: read that, if it is there.
                if self._proc.poll() is not None and not self._conn.poll():
                    raise RuntimeError(f"the engine process exited (code {self._proc.returncode}) while "
                                       "loading")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the engine process did not load within {timeout_s:.0f} s")
        except BaseException:
            # Ctrl-C or the deadline: a loading engine process reads no command, so STOP would wait out
            # ENGINE_STOP_TIMEOUT_S; it is killed instead.
            self._kill()
            raise
        kind, payload = self._receive()
        if kind == FAILED:
            self._finalizer()
            error, trace = payload
            if not isinstance(error, Exception):  # e.g. a SystemExit in the loader: not the caller's to catch
                error = RuntimeError(f"the engine process failed to load the model: {error!r}")
            # The error the engine raised (a bad model is the caller's ValueError here, as on a thread), the
            # engine process's traceback as its cause.
            raise error from RuntimeError(f"the engine process failed to load the model:\n{trace}")
        return payload

    def _kill(self) -> None:
        self._finalizer.detach()
        kill_engine_process(self._proc, self._conn)

    def call_before_start(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """``fn(engine)`` in the engine process, waited for on this thread: for set-up before ``start``
        (the server's --lora-modules checks). Its exception is raised here."""
        if self._reader is not None:
            raise RuntimeError("call_before_start after start: use call")
        token = self._send(CALL, fn, answered=True)
        while True:
            while not self._conn.poll(POLL_S):
                if self._proc.poll() is not None:
                    raise EngineDeadError(f"the engine process exited (code {self._proc.returncode})")
            kind, events = self._receive()
            for event, payload in events:
                if event == STATS:
                    self.stats = payload
                elif event == RESULT and payload[0] == token:
                    if isinstance(payload[1], BaseException):
                        raise payload[1]
                    return payload[1]

    # -- lifecycle (event loop) ---------------------------------------------------------------

    def start(self) -> None:
        if self._reader is not None:
            raise RuntimeError("EngineProcess already started")
        self._loop = asyncio.get_running_loop()
        self._dead = None
        self._reader = threading.Thread(target=self._read, name="plait-engine-reader", daemon=True)
        self._reader.start()

    async def shutdown(self) -> None:
        """Stop the engine process after its current step; unfinished requests are aborted."""
        self._stopping = True
        await asyncio.to_thread(self._finalizer)
        if self._reader is not None:
            await asyncio.to_thread(self._reader.join, ENGINE_STOP_TIMEOUT_S)
        self._dead = "shut down"
        self._fail_all(EngineDeadError("the server is shutting down"))

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._proc.poll() is None

    @property
    def is_sleeping(self) -> bool:
        """From the engine's stats, which arrive before the answer to the sleep or wake_up call that
        changed them."""
        return self.stats.sleep_level not in (None, 0)

    # -- commands (event loop) ------------------------------------------------------------------

    def _send_add(self, children: list[tuple[str, tuple[PromptInput, SamplingParams | PoolingParams]]],
                  validate: Validator | None, future: asyncio.Future, lora_request: LoRARequest | None,
                  priority: int, cache_salt: str | None) -> None:
        sent = []
        for rid, (prompt, params) in children:
            if isinstance(params, SamplingParams) and params.output_kind is RequestOutputKind.CUMULATIVE:
                self._cumulative.add(rid)  # summed back here from the deltas the engine sends
                params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
            sent.append((rid, (prompt, params)))
        token = self._send(ADD, (sent, validate, lora_request, priority, cache_salt), answered=True)
        self._pending[token] = future

    def _send_abort(self, request_ids: list[str]) -> None:
        if self._dead is None:
            with contextlib.suppress(EngineDeadError):  # a dead engine runs nothing left to abort
                self._send(ABORT, request_ids)

    def _send_call(self, fn: Callable[[LLMEngine], Any], future: asyncio.Future) -> None:
        self._pending[self._send(CALL, fn, answered=True)] = future

    def _send(self, kind: str, payload: Any, answered: bool = False) -> int | None:
        """Send a command; ``answered``: under a new token, which its RESULT will carry (the caller registers
        the future that waits for it: answers are applied on the event loop, after this call). A payload
        that cannot be pickled (a lambda, say) raises here, and nothing is sent."""
        blob = pickle.dumps(payload, protocol=PICKLE_PROTOCOL)
        token = next(self._tokens) if answered else None
        try:
            with self._send_lock:
                self._conn.send_bytes(pickle.dumps((kind, token, blob), protocol=PICKLE_PROTOCOL))
        except OSError as err:
            raise EngineDeadError(f"the engine process is gone ({err})") from None
        return token

    def _forget(self, request_ids: Any) -> None:
        super()._forget(request_ids)
        for rid in request_ids:
            self._cumulative.discard(rid)
            self._requests.pop(rid, None)

    def _fail_all(self, error: BaseException) -> None:
        super()._fail_all(error)
        pending, self._pending = self._pending, {}
        for future in pending.values():
            self._resolve(future, error)

    # -- answers (reader thread, then the event loop) -----------------------------------------------

    def _receive(self) -> tuple[str, Any]:
        return pickle.loads(self._conn.recv_bytes())

    def _read(self) -> None:
        """Hand each message of the engine process to the event loop, in order, until it closes the pipe."""
        while True:
            try:
                kind, events = self._receive()
            except (EOFError, OSError):
                break
            self._post(self._apply, events)
        if not self._stopping:
            code = self._proc.wait()
            reason = f"the engine process exited (code {code})"
            logger.error("%s", reason)
            self._post(self._died, reason)

    def _apply(self, events: list[tuple[str, Any]]) -> None:
        for kind, payload in events:
            if kind == STATS:
                self.stats = payload
            elif kind == RESULT:
                token, value = payload
                future = self._pending.pop(token, None)
                if future is not None:
                    self._resolve(future, value)
            elif kind == OUTPUTS:
                outputs = (decode_output(record, self._requests, self._cumulative) for record in payload)
                self._deliver([out for out in outputs if out is not None])
            elif kind == FAIL:
                ids, error = payload
                self._fail(ids, error)
                self._forget(ids)
            elif kind == STEP:
                self._report_step(payload)
            elif kind == DEAD:
                self._died(payload)


@dataclass
class _Received:
    """A request's prompt as its first output told it, and, for a CUMULATIVE one, its output so far."""

    prompt: str | None
    prompt_token_ids: list[int]
    cumulative: bool
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def add(self, text: str, token_ids: list[int], logprobs: list[TokenLogprobs] | None,
            prompt_logprobs: list[TokenLogprobs | None] | None) -> tuple[str, list[int], Any, Any]:
        """Append a delta; the cumulative output's text, ids, logprobs and prompt logprobs (each a new list,
        as the engine makes them)."""
        self.text += text
        self.token_ids.extend(token_ids)
        if logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(logprobs)
        if prompt_logprobs is not None:  # a delta output carries them once
            self.prompt_logprobs = prompt_logprobs
        return (self.text, list(self.token_ids), None if self.logprobs is None else list(self.logprobs),
                None if self.prompt_logprobs is None else list(self.prompt_logprobs))


class EngineCore(AsyncLLMEngine):
    """The engine process's side: AsyncLLMEngine's loop on this process's main thread, its commands read
    from the pipe by a thread of their own, and what the loop would post to an event loop collected and
    sent back once per loop iteration."""

    def __init__(self, engine: LLMEngine, conn: Connection) -> None:
        super().__init__(engine, on_step=self._queue_step)
        engine.record_timeline = True
        self._conn = conn
        self._events: list[tuple[str, Any]] = []
        self._prompt_sent: set[str] = set()  # unfinished requests whose prompt went with an output

    def run(self) -> None:
        """Serve the pipe's commands until STOP (or the server closes it), then stop the engine."""
        self._dead = None
        threading.Thread(target=self._read_commands, name="plait-engine-commands", daemon=True).start()
        self._run()
        self._flush()
        self._engine.shutdown()

    def _read_commands(self) -> None:
        while True:
            try:
                kind, token, blob = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError):  # the server is gone: stop as it would have told us to
                self._commands.put(_STOP)
                return
            if kind == STOP:
                self._commands.put(_STOP)
                return
            try:
                payload = pickle.loads(blob)
            except Exception as err:  # noqa: BLE001 - e.g. a function of a module this process cannot import
                error = RuntimeError(f"the engine process cannot read this {kind} command: {err!r}")
                self._commands.put(partial(self._refuse, token, error))
                continue
            if kind == ADD:
                children, validate, lora_request, priority, cache_salt = payload
                self._commands.put(partial(self._do_add, children, validate, token, lora_request, priority,
                                           cache_salt))
            elif kind == ABORT:
                self._commands.put(partial(self._do_abort, payload))
            elif kind == CALL:
                self._commands.put(partial(self._do_call, payload, token))

    def _refuse(self, token: int | None, error: Exception, engine: LLMEngine) -> None:
        if token is not None:
            self._post(self._resolve, token, error)

    # What AsyncLLMEngine posts to its event loop becomes an event for the server's.
    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        if fn == self._resolve:
            token, value = args
            self._events.append((RESULT, (token, _portable(value))))
        elif fn == self._deliver:
            self._events.append((OUTPUTS, [encode_output(out, self._prompt_sent) for out in args[0]]))
        elif fn == self._fail:
            ids, error = args
            self._prompt_sent.difference_update(ids)
            self._events.append((FAIL, (ids, _portable(error))))
        elif fn == self._died:
            self._events.append((DEAD, args[0]))
        else:
            raise AssertionError(f"no event for {fn!r}")

    def _queue_step(self, stats: StepStats) -> None:
        self._events.append((STEP, stats))

    def _publish_stats(self, num_steps: int, num_failed: int) -> None:
        """Called once per loop iteration, after its commands and step: the iteration's message goes now."""
        super()._publish_stats(num_steps, num_failed)
        self._flush()

    def _flush(self) -> None:
        events, self._events = [(STATS, self.stats), *self._events], []
        try:
            self._conn.send_bytes(pickle.dumps((EVENTS, events), protocol=PICKLE_PROTOCOL))
        except OSError:
            self._commands.put(_STOP)  # the server is gone

    def _do_abort(self, request_ids: list[str], engine: LLMEngine | None = None) -> None:
        super()._do_abort(request_ids, engine)
        self._prompt_sent.difference_update(request_ids)


def decode_output(record: Any, received: dict[str, _Received], cumulative: set[str]
                  ) -> RequestOutput | PoolingRequestOutput | None:
    """The output the engine made, from its wire record (encode_output's); None for a request forgotten
    here. ``received``: unfinished requests whose first output came; ``cumulative``: requests that asked for
    CUMULATIVE outputs, their deltas summed back here."""
    if isinstance(record, PoolingRequestOutput):
        return record
    rid, prompt, finished, num_cached, prompt_logprobs, metrics, completion = record
    request = received.get(rid)
    if prompt is not None:  # its first output
        request = _Received(*prompt, cumulative=rid in cumulative)
        cumulative.discard(rid)
        received[rid] = request
    if request is None:
        return None
    if finished:
        del received[rid]
    index, text, ids, reason, stop, logprobs, delta_text, delta_ids = completion
    if request.cumulative:
        text, ids, logprobs, prompt_logprobs = request.add(text, ids, logprobs, prompt_logprobs)
    completions = [CompletionOutput(index, text, ids, reason, stop, logprobs, delta_text, delta_ids)]
    return RequestOutput(rid, request.prompt, request.prompt_token_ids, completions, finished=finished,
                         num_cached_tokens=num_cached, prompt_logprobs=prompt_logprobs, metrics=metrics)


def encode_output(out: RequestOutput | PoolingRequestOutput, prompt_sent: set[str]) -> Any:
    """An output as it crosses: a pooled one whole (it comes once); a generated one as a tuple without its
    prompt, which goes with the request's first output only (``prompt_sent``: the unfinished requests whose
    prompt went). The engine makes one completion per output (n > 1 is fanned out into requests)."""
    if isinstance(out, PoolingRequestOutput):
        return out
    rid = out.request_id
    prompt = None if rid in prompt_sent else (out.prompt, list(out.prompt_token_ids))
    if out.finished:
        prompt_sent.discard(rid)
    else:
        prompt_sent.add(rid)
    c = out.outputs[0]
    completion = (c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs, c.delta_text,
                  c.delta_token_ids)
    return (rid, prompt, out.finished, out.num_cached_tokens, out.prompt_logprobs, out.metrics, completion)


def _portable(value: Any) -> Any:
    """``value`` if it survives the pipe; an error that does not keeps its message and its kind (a
    ValueError is a bad request to the server, anything else an engine failure)."""
    try:
        pickle.loads(pickle.dumps(value, protocol=PICKLE_PROTOCOL))
        return value
    except Exception:  # noqa: BLE001 - what fails to pickle varies by type
        pass
    if isinstance(value, BaseException):
        kind = ValueError if isinstance(value, ValueError) else TypeError if isinstance(value, TypeError) \
            else RuntimeError
        return kind(str(value))
    return RuntimeError(f"the engine's answer ({type(value).__name__}) cannot be sent to the server")


def _stop_process(proc: subprocess.Popen, conn: Connection) -> None:
    """Ask the engine process to stop, wait for it, and kill it if it does not exit in time."""
    try:
        conn.send_bytes(pickle.dumps((STOP, None, None), protocol=PICKLE_PROTOCOL))
    except (OSError, ValueError):  # already gone
        pass
    try:
        proc.wait(ENGINE_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        logger.warning("the engine process did not stop within %.0f s; killing it", ENGINE_STOP_TIMEOUT_S)
        proc.kill()
        proc.wait()
    conn.close()


def _main(fd: int) -> None:
    """The engine process: load the engine the server sends the config of, then run its loop."""
    from plait.parallel.workers import _die_with_parent

    _die_with_parent()
    # Ctrl-C reaches the whole process group; the server stops this process itself, after its own shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(fd)
    config, log_level = pickle.loads(conn.recv_bytes())
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    try:
        engine = LLMEngine(config)
        info = EngineInfo.of(engine)
    except BaseException as err:  # noqa: BLE001 - told to the server, which raises it
        failure = (_portable(err), traceback.format_exc())
        conn.send_bytes(pickle.dumps((FAILED, failure), protocol=PICKLE_PROTOCOL))
        sys.exit(1)
    conn.send_bytes(pickle.dumps((READY, info), protocol=PICKLE_PROTOCOL))
    EngineCore(engine, conn).run()


if __name__ == "__main__":
    _main(int(sys.argv[1]))
