"""Data parallelism for serving (vLLM's --data-parallel-size): N engine replicas behind one address.

Each replica is a `plait serve` process of its own (its own GPUs: CUDA_VISIBLE_DEVICES, tensor_parallel_size
of them each) listening on a free loopback port; the front process proxies every request to the replica its
ReplicaRouter picks (the one storing a response the request names, else the one that served its beginning,
else the one with the fewest requests in flight), streams its answer back unchanged (a client that hangs up
closes the replica's stream, which aborts the request there), sends LoRA adapter loads and the development
endpoints (prefix-cache reset, profiling, sleep, weight reload) to every replica, and merges their /metrics
under an ``engine`` label, as vLLM's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import pickle
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from plait.config import EngineConfig
from plait.entrypoints.replica_router import ReplicaRouter, replica_response_id_prefix

logger = logging.getLogger(__name__)

# How long a replica may take to load its model and print its address.
REPLICA_START_TIMEOUT_S = 600.0
# How long a stopping replica may take to finish its graceful shutdown before it is killed.
REPLICA_STOP_TIMEOUT_S = 30.0
# Requests that change every replica, not one: a LoRA adapter must be servable wherever a request lands, and
# the development endpoints act on the whole server.
BROADCAST_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/reset_prefix_cache",
                   "/start_profile", "/stop_profile", "/sleep", "/wake_up", "/reload_weights")
# Headers that describe one hop of a connection, not the message: never passed on (RFC 9110, 7.6.1).
HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                         "trailer", "transfer-encoding", "upgrade", "host", "content-length"})
_BANNER_URL = re.compile(r"on (http://127\.0\.0\.1:\d+) ")
_METRIC_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?( .*)$")


@dataclass
class Replica:
    """One engine replica's process, its address, and the requests the front has in flight there."""

    index: int
    process: subprocess.Popen
    url: str = ""
    banner: str = ""  # what its `plait serve` printed: where it listens, and a curl to try
    in_flight: int = 0


def replica_devices(index: int, tensor_parallel_size: int, visible: str | None) -> str:
    """The CUDA_VISIBLE_DEVICES of replica ``index``: its tensor_parallel_size GPUs among those visible
    (all of the machine's where ``visible`` is None), in order."""
    if visible is not None:
        devices = [d.strip() for d in visible.split(",") if d.strip()]
    else:
        import torch

        devices = [str(i) for i in range(torch.cuda.device_count())]
    mine = devices[index * tensor_parallel_size:(index + 1) * tensor_parallel_size]
    if len(mine) < tensor_parallel_size:
        raise ValueError(f"data parallel replica {index} needs GPUs {index * tensor_parallel_size}.."
                         f"{(index + 1) * tensor_parallel_size - 1}, but only {len(devices)} are visible")
    return ",".join(mine)


def start_replicas(engine_config: EngineConfig, server_config: Any, size: int, engine_process: bool = True
                   ) -> list[Replica]:
    """Start ``size`` replicas at once and wait until each prints its address; any failure stops them all
    (``engine_process``: each replica's engine loop in a process of its own, as serve's)."""
    on_cuda = _uses_cuda(engine_config)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    # Replicas listen on loopback, plain HTTP; the front terminates TLS, serves under root_path and bounds
    # requests' heads (what it forwards carries headers of its own, which a replica must not count).
    replica_config = dataclasses.replace(server_config, host="127.0.0.1", port=0, uds=None, ssl_keyfile=None,
                                         ssl_certfile=None, ssl_ca_certs=None, root_path="",
                                         h11_max_incomplete_event_size=None, h11_max_header_count=None)
    fd, config_path = tempfile.mkstemp(prefix="plait-dp-", suffix=".pickle")  # mode 0600: it holds the key
    with os.fdopen(fd, "wb") as f:
        pickle.dump((engine_config, replica_config, engine_process), f)
    replicas: list[Replica] = []
    try:
        for index in range(size):
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            if on_cuda:
                env["CUDA_VISIBLE_DEVICES"] = replica_devices(index, engine_config.tensor_parallel_size,
                                                              visible)
            process = subprocess.Popen([sys.executable, "-m", "plait.entrypoints.data_parallel", config_path,
                                        str(index)],
                                       stdout=subprocess.PIPE, text=True, env=env)
            replicas.append(Replica(index, process))
        for replica in replicas:
            replica.url, replica.banner = _wait_for_banner(replica)
    except BaseException:
        stop_replicas(replicas)
        raise
    finally:
        os.unlink(config_path)
    return replicas


def _uses_cuda(config: EngineConfig) -> bool:
    from plait.loader.model_loader import resolve_device_dtype

    return resolve_device_dtype(config)[0].type == "cuda"


def _wait_for_banner(replica: Replica) -> tuple[str, str]:
    """The replica's URL and its banner (server.banner's lines on its stdout, from the address to the curl's
    payload), read on a thread so a silent replica times out."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in replica.process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True, name=f"plait-dp-{replica.index}").start()
    deadline = time.monotonic() + REPLICA_START_TIMEOUT_S
    url, banner = None, []
    while True:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise RuntimeError(f"data parallel replica {replica.index} printed no address within "
                               f"{REPLICA_START_TIMEOUT_S:.0f} s") from None
        if line is None:
            code = replica.process.wait()
            raise RuntimeError(f"data parallel replica {replica.index} exited (code {code}) before serving; "
                               "its error is above")
        found = _BANNER_URL.search(line)
        if found and url is None:
            url = found.group(1)
        if url is not None:
            banner.append(line.rstrip("\n"))
            if line.lstrip().startswith("-d '"):  # the curl's payload: the banner's last line
                return url, "\n".join(banner)


def stop_replicas(replicas: list[Replica]) -> None:
    """SIGINT (a replica's graceful shutdown) to each, then wait; kill what does not stop."""
    for replica in replicas:
        if replica.process.poll() is None:
            replica.process.send_signal(signal.SIGINT)
    deadline = time.monotonic() + REPLICA_STOP_TIMEOUT_S
    for replica in replicas:
        try:
            replica.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            replica.process.kill()
            replica.process.wait()


class DataParallelFront:
    """The front server's app: proxies to the replica its router picks (see the module's docstring)."""

    def __init__(self, replicas: list[Replica], api_key: str | None, max_body_bytes: int,
                 prefix_affinity: bool = True) -> None:
        from plait.entrypoints.middleware import GuardMiddleware

        self.replicas = replicas
        self.router = ReplicaRouter(replicas, prefix_affinity=prefix_affinity)
        # No pool limit: every client request holds one replica connection, as it would hold the engine.
        self.client = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None,
                                                                          max_keepalive_connections=None))
        app = FastAPI(title="plait (data parallel)", openapi_url=None, docs_url=None, redoc_url=None)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.metrics, methods=["GET"])
        for path in BROADCAST_PATHS:
            app.add_api_route(path, self.broadcast, methods=["POST"])
        app.add_api_route("/{path:path}", self.proxy,
                          methods=["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
        app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes)
        self.app = app

    async def proxy(self, request: Request) -> Response:
        """Pass the request to its replica (ReplicaRouter: the one storing the response it names, else the one
        that served its beginning, else the least busy) and stream its answer back. A replica that fails
        before answering (a connection refused or dropped: seen for 3 of 2,000 requests arriving at once on
        an H200 pair) gets the request's retry elsewhere; a copy it may have started is aborted there when
        its connection closes, so the client gets one answer."""
        payload = await request.body()
        tried: frozenset[int] = frozenset()
        while True:
            replica = self.router.choose(request.url.path, payload, exclude=tried)
            replica.in_flight += 1
            try:
                upstream = await self.client.send(self._request_to(replica, request, payload), stream=True)
                break
            except httpx.TransportError as err:
                replica.in_flight -= 1
                tried |= {replica.index}
                if len(tried) == len(self.replicas):
                    return _unavailable(replica, err)
                logger.warning("data parallel replica %d did not answer (%r): retrying elsewhere",
                               replica.index, err)

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:  # also when the client hung up: closing the replica's stream aborts its request there
                await upstream.aclose()
                replica.in_flight -= 1

        return StreamingResponse(body(), status_code=upstream.status_code,
                                 headers=_passed_on(upstream.headers))

    async def broadcast(self, request: Request) -> Response:
        """Each replica in turn; the first refusal (or else the last answer) is the client's."""
        payload = await request.body()
        answer = None
        for replica in self.replicas:
            try:
                answer = await self.client.send(self._request_to(replica, request, payload))
            except httpx.HTTPError as err:
                return _unavailable(replica, err)
            if answer.status_code >= 400:
                break
        return Response(answer.content, status_code=answer.status_code, headers=_passed_on(answer.headers))

    async def health(self) -> Response:
        codes = await asyncio.gather(*(self._status(r, "/health") for r in self.replicas))
        ok = all(code == 200 for code in codes)
        return JSONResponse({"status": "ok" if ok else "unavailable", "replicas": codes},
                            status_code=200 if ok else 503)

    async def metrics(self) -> Response:
        """Every replica's Prometheus text, each sample labelled with its replica (``engine="i"``)."""
        texts = await asyncio.gather(*(self.client.get(f"{r.url}/metrics") for r in self.replicas))
        return Response(merge_metrics([t.text for t in texts]),
                        media_type=texts[0].headers.get("content-type"))

    async def _status(self, replica: Replica, path: str) -> int:
        try:
            return (await self.client.get(f"{replica.url}{path}", timeout=10)).status_code
        except httpx.HTTPError:
            return 503

    def _request_to(self, replica: Replica, request: Request, payload: bytes) -> httpx.Request:
        url = f"{replica.url}{request.url.path}"
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_HEADERS]
        return self.client.build_request(request.method, url, params=request.query_params, headers=headers,
                                         content=payload)


def merge_metrics(texts: list[str]) -> str:
    """Prometheus exposition texts of the replicas as one: each metric's HELP and TYPE once, then every
    replica's samples with an ``engine`` label added."""
    comments: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    order: list[str] = []
    for index, text in enumerate(texts):
        family = None
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split()[2]
                if family not in comments:
                    comments[family], samples[family] = [], []
                    order.append(family)
                if index == 0 or line not in comments[family]:
                    comments[family].append(line)
                continue
            found = _METRIC_SAMPLE.match(line)
            if not found or family is None:
                continue
            name, labels, rest = found.groups()
            inner = labels[1:-1] if labels else ""
            labelled = f'{name}{{engine="{index}"{"," + inner if inner else ""}}}{rest}'
            samples[family].append(labelled)
    return "".join("\n".join(comments[f] + samples[f]) + "\n" for f in order)


def _passed_on(headers: httpx.Headers) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in HOP_HEADERS}


def _unavailable(replica: Replica, err: Exception) -> Response:
    from plait.entrypoints.errors import error_body

    message = f"data parallel replica {replica.index} did not answer: {type(err).__name__}: {err}"
    return Response(error_body(message, "service_unavailable"), status_code=503,
                    media_type="application/json")


def serve_data_parallel(engine_config: EngineConfig, server_config: Any, size: int,
                        prefix_affinity: bool = True, engine_process: bool = True) -> None:
    """`plait serve --data-parallel-size N`: start the replicas, then serve the front until interrupted
    (``prefix_affinity``: ReplicaRouter's, or the least busy replica always)."""
    from plait.entrypoints.launcher import closing_socket, serving_socket
    from plait.entrypoints.server import base_url, uvicorn_server

    uds = server_config.uds
    with closing_socket(serving_socket(server_config.host, server_config.port, uds), uds) as sock:
        replicas = start_replicas(engine_config, server_config, size, engine_process)
        try:
            front = DataParallelFront(replicas, server_config.api_key, server_config.max_request_body_bytes,
                                      prefix_affinity=prefix_affinity)
            url = base_url(sock, https=server_config.ssl_certfile is not None)
            print(_front_banner(replicas, url, uds), flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                uvicorn_server(front.app, server_config).run(sockets=[sock])
        finally:
            stop_replicas(replicas)


def _front_banner(replicas: list[Replica], url: str, uds: str | None = None) -> str:
    """A replica's banner (the model's name, and the curl its kind of model takes) at the front's address
    (``url``, through the Unix domain socket ``uds`` where given)."""
    from plait.entrypoints.server import curl_command, listening_at

    replica = replicas[0]
    first, _, rest = replica.banner.partition("\n")
    first = first.replace(listening_at(replica.url, None), listening_at(url, uds))
    rest = rest.replace(f"{curl_command(None)} {replica.url}", f"{curl_command(uds)} {url}", 1)
    return f"{first}, {len(replicas)} data parallel replicas behind it\n{rest}"


def _replica_main(config_path: str, index: int) -> None:
    """Replica ``index``: `plait serve` with the configs the front pickled, its response ids its own."""
    from plait.entrypoints.server import serve

    engine_config, server_config, engine_process = pickle.loads(Path(config_path).read_bytes())
    timeline = replica_timeline_file(server_config.step_timeline_file, index)
    # A config remade, not just unpickled: its checks run here, and so do its parser plugins, whose parsers
    # this process's server reads its answers with.
    own = dataclasses.replace(server_config, response_id_prefix=replica_response_id_prefix(index),
                              step_timeline_file=timeline)
    events = engine_config.kv_events_config
    if events is not None:  # each replica's publisher on its own port, its batches carrying its rank
        engine_config = dataclasses.replace(engine_config, kv_events_config=events.for_replica(index))
    serve(engine_config, own, engine_process=engine_process)


def replica_timeline_file(path: str | None, index: int) -> str | None:
    """Replica ``index``'s step timeline file: ``--step-timeline-file`` with ``.dp<index>`` before its suffix
    (each replica runs an engine of its own)."""
    if path is None:
        return None
    p = Path(path)
    return str(p.with_name(f"{p.stem}.dp{index}{p.suffix}"))


if __name__ == "__main__":
    _replica_main(sys.argv[1], int(sys.argv[2]))
