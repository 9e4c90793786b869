"""What `plait serve` starts before it imports its server stack: its listening socket and its engine process.

The engine process loads the model while the server process imports torch, FastAPI and the rest (~1.4 s on
two cores) instead of after. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import pickle
import socket
import stat
import subprocess
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import plait
from plait.config import EngineConfig

PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL
ENGINE_PROCESS_MODULE = "plait.entrypoints.engine_process"
# A Unix domain socket's permissions: any local user may connect, as uvicorn's --uds (an API key guards it).
UNIX_SOCKET_MODE = 0o666


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 picks a free one."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.listen()
    sock.set_inheritable(True)
    return sock


def bind_unix_socket(path: str) -> socket.socket:
    """A listening Unix domain socket at ``path`` (vLLM's --uds), readable and writable by every local user
    as uvicorn's. A socket file no server listens on any more (one whose server was killed) is replaced;
    one a server still listens on, or a file of another kind, is an error (OSError)."""
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise FileExistsError(errno.EEXIST, "the path exists and is not a socket")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(path)
            except ConnectionRefusedError:
                os.unlink(path)  # stale: its server is gone
            else:
                raise OSError(errno.EADDRINUSE, "a server is listening on it")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, UNIX_SOCKET_MODE)
        sock.listen()
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def serving_socket(host: str, port: int, uds: str | None = None) -> socket.socket:
    """bind_socket (bind_unix_socket at ``uds``, where host and port do not matter) for a server, taken
    before its model loads (as vLLM's): an address in use is the caller's error (a ValueError, which the
    CLI prints as one line), said before minutes of loading, not after."""
    try:
        return bind_unix_socket(uds) if uds is not None else bind_socket(host, port)
    except OSError as err:
        where = f"unix socket {uds}" if uds is not None else f"{host}:{port}"
        raise ValueError(f"cannot serve on {where}: {err.strerror or err}") from err


def close_socket(sock: socket.socket, uds: str | None) -> None:
    """Close a server's socket (uvicorn may have closed it already); the file of its Unix domain socket at
    ``uds`` goes with it, so that the path can serve again."""
    sock.close()
    if uds is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(uds)


@contextlib.contextmanager
def closing_socket(sock: socket.socket, uds: str | None) -> Iterator[socket.socket]:
    """``sock`` until the block ends, then close_socket's: a server's socket for as long as it serves."""
    try:
        yield sock
    finally:
        close_socket(sock, uds)


def serving_config(engine_config: EngineConfig) -> EngineConfig:
    """An engine config with serving's defaults (the token budget differs from offline's, as in vLLM)."""
    return dataclasses.replace(engine_config, usage="serve")


def launch(engine_config: EngineConfig, host: str, port: int, engine_process: bool, uds: str | None = None
           ) -> tuple[socket.socket, StartedEngineProcess | None]:
    """`plait serve`'s socket (serving_socket's), then (``engine_process``) its engine process loading
    serving_config's engine: taken before the server stack is imported, so that the model loads meanwhile."""
    sock = serving_socket(host, port, uds)
    try:
        return sock, start_engine_process(serving_config(engine_config)) if engine_process else None
    except BaseException:
        close_socket(sock, uds)
        raise


@dataclass
class StartedEngineProcess:
    """An engine process told its config and loading it; EngineProcess adopts it and waits for it to load.
    Killed when dropped unadopted (a server that failed before adopting it)."""

    proc: subprocess.Popen
    conn: Connection
    _finalizer: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._finalizer = weakref.finalize(self, kill_engine_process, self.proc, self.conn)

    def adopt(self) -> tuple[subprocess.Popen, Connection]:
        """The process and its pipe, now the adopter's to stop."""
        self._finalizer.detach()
        return self.proc, self.conn


def start_engine_process(config: EngineConfig) -> StartedEngineProcess:
    """Start `python -m plait.entrypoints.engine_process FD` and send it ``config`` (an EngineConfig) and this
    process's log level; it loads the engine and then says READY or FAILED on the pipe."""
    ours, theirs = Pipe()
    fd = theirs.fileno()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(plait.__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", ENGINE_PROCESS_MODULE, str(fd)], env=env,
                            stdin=subprocess.DEVNULL, pass_fds=[fd])
    theirs.close()
    started = StartedEngineProcess(proc, ours)
    ours.send_bytes(pickle.dumps((config, logging.getLogger().getEffectiveLevel()), protocol=PICKLE_PROTOCOL))
    return started


def kill_engine_process(proc: subprocess.Popen, conn: Connection) -> None:
    """Kill an engine process that cannot be asked to stop (one still loading reads no command)."""
    proc.kill()
    proc.wait()
    conn.close()
