"""The driver's handle on the other ranks' processes, and the loop each of them runs: every step the driver
sends its inputs (the host arrays it staged), each rank runs the same forward, and the driver's sampled ids
reach the others by a broadcast on the device, where their next step reads its pending inputs."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import time
import traceback
import weakref
from collections.abc import Iterator
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

import plait
from plait.lora.slots import NO_LORA_SLOT
from plait.parallel.group import ParallelRank

if TYPE_CHECKING:
    from plait.config import EngineConfig
    from plait.runner.model_runner import ModelRunner

# Messages, driver -> rank: (FORWARD, (StepArrays, pending sources, whether a step is in flight, the step's
# prompt-embedding rows or None: their token indices and a tensor_message of their values)),
# (IDS, number of sampled ids to receive), (SLEEP, level), (WAKE_UP, tags), (LOAD_WEIGHTS, None) followed by
# that rank's (name, tensor) slices one message each and then END_OF_WEIGHTS, (RPC, a pickled (method, args,
# kwargs) for its Worker), (KV_TRANSFER, the prefix cache's block copies to make before the next FORWARD),
# (LORA_LOAD, a LoRA slot's adapter slices: lora_message),
# (STOP, None), and at start-up the agreed KV blocks (an int). Rank -> driver, at
# start-up: (LOADED, None), (BLOCKS, the KV blocks it has room for), (READY, None); after SLEEP and WAKE_UP:
# (DONE, None); after a LOAD_WEIGHTS: (DONE, None or the ValueError's message: a set the model refused); after
# an RPC: (DONE, (True, the pickled result) or (False, the method's traceback)); at any time (FAILED, its
# traceback: the rank is gone).
FORWARD, IDS, SLEEP, WAKE_UP, STOP, RPC = "forward", "ids", "sleep", "wake_up", "stop", "rpc"
KV_TRANSFER, LORA_LOAD = "kv_transfer", "lora_load"
LOAD_WEIGHTS, END_OF_WEIGHTS = "load_weights", "end_of_weights"
LOADED, BLOCKS, READY, DONE, FAILED = "loaded", "blocks", "ready", "done", "failed"
# How often the driver looks at its workers while it waits for them (a dead one fails the wait).
POLL_SECONDS = 0.1
# prctl(2)'s option: the signal a process gets when its parent dies.
PR_SET_PDEATHSIG = 1
# How long a stopping worker may take to free its device before it is killed.
STOP_GRACE_SECONDS = 30.0


class WorkerError(RuntimeError):
    """A tensor-parallel rank failed: its traceback, or how its process ended."""


class Workers:
    """Ranks 1..N-1, seen from the driver (rank 0): started first, so every rank loads its slice at once.

    Each is a fresh interpreter (``python -m plait.parallel.workers``), not a multiprocessing child: a
    user's script then needs no ``if __name__ == "__main__"`` guard, since nothing re-imports it. Each
    inherits its end of a socket pair, so nothing connects (here, one of two workers connecting to the
    driver's Unix socket at once was now and then refused while it listened)."""

    def __init__(self, config: EngineConfig, world_size: int) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="plait-tp-")
        self.driver = ParallelRank(0, world_size, os.path.join(self._dir.name, "store"))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(Path(plait.__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")]))
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        self._out_of_step: str | None = None  # why the ranks no longer answer in turn (a timed-out wait)
        # Stops the workers when the engine is dropped or the interpreter exits, whichever comes first.
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._conns, self._dir)
        for rank in range(1, world_size):
            ours, theirs = Pipe()
            fd = theirs.fileno()
            self._procs.append(subprocess.Popen([sys.executable, "-m", "plait.parallel.workers", str(fd)],
                                                env=env, stdin=subprocess.DEVNULL, pass_fds=[fd]))
            theirs.close()
            ours.send((config, ParallelRank(rank, world_size, self.driver.store_path)))
            self._conns.append(ours)

    def _check_alive(self, state: str) -> None:
        for rank, proc in enumerate(self._procs, start=1):
            if proc.poll() is not None:
                raise WorkerError(f"tensor-parallel rank {rank} exited (code {proc.returncode}) before it "
                                  f"{state}")

    # -- start-up: the driver's side of DriverLink's calls ------------------------------------

    def loaded(self) -> None:
        """Every rank holds its slice: only now may the driver enter a collective (one that a rank which
        failed to load never joins would hang it)."""
        self._gather(LOADED)

    def agree_min(self, num_blocks: int) -> int:
        """The KV blocks every rank has room for (each measured its own memory), told to every rank."""
        agreed = min([num_blocks, *self._gather(BLOCKS)])
        for conn in self._conns:
            conn.send(agreed)
        return agreed

    def ready(self) -> None:
        """Every rank has its KV cache and graphs: steps may come."""
        self._gather(READY)

    def done(self, timeout: float | None = None) -> list[Any]:
        """Every rank has run the SLEEP, WAKE_UP, LOAD_WEIGHTS or RPC sent last (its memory handed back, or
        taken back and its graphs captured again; its slices loaded; the method run); what each said of it.
        ``timeout``: seconds to wait in all (None: no limit), then TimeoutError, after which the ranks are out
        of step and every later message is refused."""
        return self._gather(DONE, None if timeout is None else time.monotonic() + timeout)

    def send_to(self, rank: int, payload: Any) -> None:
        """One raw message to worker ``rank`` (a slice of a LOAD_WEIGHTS, END_OF_WEIGHTS, or a LORA_LOAD of
        that rank's adapter slices)."""
        self._conns[rank - 1].send(payload)

    def _gather(self, state: str, deadline: float | None = None) -> list[Any]:
        """Each worker's next message, which must be ``state``; one that fails or dies first raises
        WorkerError (the wait looks at the processes, so it never hangs on a dead one), one that has not
        answered by ``deadline`` (time.monotonic()) TimeoutError."""
        details = []
        for rank, conn in enumerate(self._conns, start=1):
            while not conn.poll(POLL_SECONDS):
                self._check_alive(f"was {state}")
                if deadline is not None and time.monotonic() > deadline:
                    self._out_of_step = f"tensor-parallel rank {rank} did not answer in time"
                    raise TimeoutError(f"{self._out_of_step}: the ranks are out of step; start a new engine")
            kind, detail = self._receive(rank, conn)
            if kind != state:
                raise WorkerError(f"tensor-parallel rank {rank} said {kind!r}, expected {state!r}")
            details.append(detail)
        return details

    def _receive(self, rank: int, conn: Connection) -> tuple[str, Any]:
        """A worker's message that poll() said is there, or WorkerError for a failure or a connection
        closed by a process that ended."""
        try:
            kind, detail = conn.recv()
        except (EOFError, OSError):
            self._procs[rank - 1].wait(STOP_GRACE_SECONDS)
            self._check_alive("said why")
            raise WorkerError(f"tensor-parallel rank {rank} closed its connection") from None
        if kind == FAILED:
            raise WorkerError(f"tensor-parallel rank {rank} failed:\n{detail}")
        return kind, detail

    def send(self, kind: str, payload: Any = None) -> None:
        """One message to every worker, after checking that each is still there to take it."""
        if self._out_of_step is not None:
            raise WorkerError(f"{self._out_of_step} (collective_rpc's timeout): start a new engine")
        self.check()
        for conn in self._conns:
            conn.send((kind, payload))

    def check(self) -> None:
        """Raise WorkerError if a worker has died or reported a failure (the driver must not then wait on a
        collective that rank will never join)."""
        for rank, conn in enumerate(self._conns, start=1):
            if conn.poll():
                kind, _ = self._receive(rank, conn)
                raise WorkerError(f"tensor-parallel rank {rank} sent {kind!r} unasked")
        self._check_alive("was stopped")

    def close(self) -> None:
        """Stop the workers, wait for them to exit, and kill any that does not."""
        self._finalizer()

    def kill(self) -> None:
        """Kill the workers at once (close then only waits for them and cleans up)."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()


class DriverLink:
    """A worker's side of start-up: what it tells the driver, and the KV blocks the ranks agree on."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def loaded(self) -> None:
        self._conn.send((LOADED, None))

    def agree_min(self, num_blocks: int) -> int:
        self._conn.send((BLOCKS, num_blocks))
        return self._conn.recv()

    def ready(self) -> None:
        self._conn.send((READY, None))


def _stop(procs: list[subprocess.Popen], conns: list[Connection], folder: Any) -> None:
    for conn in conns:
        try:
            conn.send((STOP, None))
        except (OSError, ValueError):  # the worker is gone already
            pass
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for conn in conns:
        conn.close()
    folder.cleanup()


def _worker_main(fd: int) -> None:
    """A worker process: take its config from the driver through the inherited ``fd``, build this rank's
    runner, then run the driver's steps until told to stop. It ends with the driver: killed with it (a
    worker blocked in a collective would otherwise hold its GPU forever), and on STOP, once it has let go of
    its group."""
    _die_with_parent()
    conn = Connection(fd)
    config, where = conn.recv()
    try:
        from plait.runner.model_runner import ModelRunner

        _share_cpu_threads(config, where.world_size)

        runner = ModelRunner(config, parallel=where, link=DriverLink(conn))
        serve(runner, conn)
        runner.close()
        code = 0
    except BaseException:  # noqa: BLE001 - the driver reports it; this process ends anyway
        code = 1
        try:
            conn.send((FAILED, traceback.format_exc()))
        except OSError:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _share_cpu_threads(config: EngineConfig, world_size: int) -> None:
    """On the CPU, a worker takes its share of the host's cores for torch's intra-op threads (by default
    each process takes them all, so every rank's OpenMP threads spun on the same cores: a two-rank step of a
    tiny model was ~3x slower on 2 cores than with one thread a worker), unless OMP_NUM_THREADS sets them."""
    from plait.loader.model_loader import resolve_device_dtype

    if "OMP_NUM_THREADS" in os.environ or resolve_device_dtype(config)[0].type != "cpu":
        return
    torch.set_num_threads(max(1, torch.get_num_threads() // world_size))


def _die_with_parent() -> None:
    """Ask Linux to kill this process when its parent (the driver) dies (prctl PR_SET_PDEATHSIG)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the driver died before the request took effect
        os._exit(1)


def serve(runner: ModelRunner, conn: Connection) -> None:
    """Run the driver's messages in order until STOP: each FORWARD as the driver ran it, each IDS a broadcast
    of the driver's sampled ids into the tensor the next step's pending inputs read, each SLEEP and WAKE_UP
    as the driver's runner runs it (graph captures meet in the same collectives)."""
    prev_ids = None
    while True:
        kind, payload = conn.recv()
        if kind == STOP:
            return
        if kind == FORWARD:
            arrays, pending_sources, in_flight, embeds, images, mrope = payload
            if embeds is not None:
                embeds = (embeds[0], tensor_from_message(embeds[1])[1])
            if images is not None:  # (token indices, embeddings) of the step's image placeholders
                images = tuple(tensor_from_message(part)[1] for part in images)
            runner.stage_step_extras(embeds, images, mrope)
            # LoRA rows: any token with an adapter's slot (the driver's LoRAModel.prepare set them).
            lora = runner.lora is not None and bool((arrays.lora_slots != NO_LORA_SLOT).any())
            runner.forward(arrays, pending_sources, prev_ids if in_flight else None, lora)
        elif kind == IDS:
            prev_ids = runner.receive_sampled_ids(payload)
        elif kind == LOAD_WEIGHTS:
            slices, refused = _ReceivedSlices(conn), None
            try:
                runner.load_weights(iter(slices), in_model_layout=True)
            except ValueError as err:  # the driver's load says the same of its own slices
                refused = str(err)
            finally:
                slices.drain()  # the next message is the driver's next command
            conn.send((DONE, refused))
        elif kind == RPC:
            conn.send((DONE, _run_rpc(runner, payload)))
        elif kind == KV_TRANSFER:
            runner.transfer_kv(payload)
        elif kind == LORA_LOAD:
            runner.lora.load_slices(*lora_from_message(payload))
        elif kind in (SLEEP, WAKE_UP):
            prev_ids = None  # its storage goes to sleep; no step is in flight across a sleep
            if kind == SLEEP:
                runner.sleep(payload)
            else:
                runner.wake_up(payload)
            conn.send((DONE, None))
        else:
            raise WorkerError(f"unknown message {kind!r}")


def _run_rpc(runner: ModelRunner, call: bytes) -> tuple[bool, Any]:
    """A collective_rpc's method on this rank's Worker: (True, the pickled result), or (False, the traceback
    of what it raised); the rank keeps serving either way."""
    try:
        method, args, kwargs = pickle.loads(call)
        return True, pickle.dumps(runner.worker.execute(method, args, kwargs))
    except Exception:  # noqa: BLE001 - the driver raises it
        return False, traceback.format_exc()


def lora_message(payload: tuple[int, int, float, dict[str, list[Any]]]) -> tuple:
    """A LoRA slot's slices (LoRAModel.load's payload) as plain data for a worker's pipe (tensor_message)."""
    slot, lora_id, scaling, layers = payload
    return slot, lora_id, scaling, {name: [(s.index, tensor_message("a", s.a), tensor_message("b", s.b))
                                           for s in shards] for name, shards in layers.items()}


def lora_from_message(message: tuple) -> tuple[int, int, float, dict[str, list[Any]]]:
    from plait.lora.adapter import LoRAShard

    slot, lora_id, scaling, layers = message
    return slot, lora_id, scaling, {
        name: [LoRAShard(index, tensor_from_message(a)[1], tensor_from_message(b)[1])
               for index, a, b in shards]
        for name, shards in layers.items()}


def tensor_message(name: str, tensor: Any) -> tuple[str, str, tuple[int, ...], bytes]:
    """A checkpoint slice as plain data for a worker's pipe: torch's pickling of a tensor would hand over
    shared memory through multiprocessing's resource sharer, whose key a worker (a fresh interpreter, not a
    multiprocessing child) does not hold."""
    host = tensor.detach().to("cpu").contiguous()
    data = host.view(-1).view(torch.uint8).numpy().tobytes()
    return name, str(host.dtype).removeprefix("torch."), tuple(host.shape), data


def tensor_from_message(message: tuple[str, str, tuple[int, ...], bytes]) -> tuple[str, Any]:
    name, dtype, shape, data = message
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return name, flat.view(getattr(torch, dtype)).reshape(shape)


class _ReceivedSlices:
    """This rank's (name, tensor) slices of a LOAD_WEIGHTS, as they arrive, up to END_OF_WEIGHTS."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._ended = False

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        while not self._ended:
            item = self._conn.recv()
            self._ended = item == END_OF_WEIGHTS
            if not self._ended:
                yield tensor_from_message(item)

    def drain(self) -> None:
        """Read what a refused load left unread, up to END_OF_WEIGHTS."""
        while not self._ended:
            self._ended = self._conn.recv() == END_OF_WEIGHTS


if __name__ == "__main__":
    _worker_main(int(sys.argv[1]))
