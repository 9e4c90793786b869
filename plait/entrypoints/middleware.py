"""The server's ASGI middleware (pure ASGI, so streams and disconnects pass straight through): the API key and
body size, the header count, the model-running requests in flight, and request ids; and the user's own
(--middleware)."""

from __future__ import annotations

import contextvars
import importlib
import inspect
import secrets
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from plait.entrypoints.errors import error_body

# As vLLM's --api-key: the key guards the OpenAI API under /v1 only, so /health, /metrics (Prometheus
# scrapes), /tokenize, /detokenize and /version stay open.
API_KEY_GUARDED_PREFIX = "/v1"
# Browsers send a CORS preflight as OPTIONS without credentials; like vLLM's, the key check lets every
# OPTIONS through (one that is not a preflight reaches the app and gets a 405).
API_KEY_EXEMPT_METHOD = "OPTIONS"


async def send_error(send: Send, status: int, body: bytes, extra_headers: Sequence[tuple[bytes, bytes]] = ()
                      ) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *extra_headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# The endpoints that run the model: what vLLM's --enable-server-load-tracking counts (GET /load).
LOAD_TRACKED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses",
                                "/classify", "/pooling", "/score", "/v1/score", "/rerank", "/v1/rerank",
                                "/v2/rerank", "/invocations"})


@dataclass
class ServerLoad:
    """Requests to LOAD_TRACKED_PATHS in flight: from arrival to their response's last byte (GET /load)."""

    in_flight: int = 0


class LoadTrackingMiddleware:
    """Counts the model-running requests in flight into a ServerLoad (pure ASGI: a streamed response counts
    until it ends, or its client leaves)."""

    def __init__(self, app: ASGIApp, load: ServerLoad) -> None:
        self.app = app
        self.load = load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if scope["type"] != "http" or scope.get("method") != "POST" or path not in LOAD_TRACKED_PATHS:
            await self.app(scope, receive, send)
            return
        self.load.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.in_flight -= 1


REQUEST_ID_HEADER = b"x-request-id"


@dataclass
class RequestIds:
    """One HTTP request's id: the X-Request-Id it came with, and the id the server gave its response."""

    incoming: str | None = None
    given: str | None = None


# The RequestIds of the HTTP request being served (set by RequestIdMiddleware for each request's task).
_request_ids: contextvars.ContextVar[RequestIds | None] = contextvars.ContextVar("plait_request_ids",
                                                                                  default=None)


def new_response_id(prefix: str, body_request_id: str | None = None) -> str:
    """A response's id, as vLLM makes them: ``prefix``-, then the request's X-Request-Id header, else the
    body's ``request_id``, else a fresh uuid; remembered, so --enable-request-id-headers echoes the same."""
    ids = _request_ids.get()
    base = (ids.incoming if ids is not None else None) or body_request_id or uuid.uuid4().hex
    if ids is not None and ids.given is None:
        ids.given = base
    return f"{prefix}-{base}"


def _header_safe(value: str) -> bool:
    return value.isascii() and value.isprintable()


class RequestIdMiddleware:
    """Reads each request's X-Request-Id for the ids of its response (new_response_id) and, with
    ``echo`` (vLLM's --enable-request-id-headers), sends X-Request-Id back on every response (pure ASGI, so
    a stream's header goes with its first byte)."""

    def __init__(self, app: ASGIApp, echo: bool) -> None:
        self.app = app
        self.echo = echo

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = dict(scope.get("headers") or []).get(REQUEST_ID_HEADER)
        ids = RequestIds(incoming.decode("latin-1") if incoming else None)
        token = _request_ids.set(ids)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                # A body's request_id is echoed only where it is a valid header value (printable ASCII).
                given = ids.given if ids.given is not None and _header_safe(ids.given) else None
                rid = ids.incoming or given or uuid.uuid4().hex
                headers = [h for h in message.get("headers", []) if h[0].lower() != REQUEST_ID_HEADER]
                message = {**message, "headers": [*headers, (REQUEST_ID_HEADER, rid.encode("latin-1"))]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id if self.echo else send)
        finally:
            _request_ids.reset(token)


class GuardMiddleware:
    """Checks the API key, then buffers the body up to a size limit, before the app sees a request.

    Pure ASGI (no BaseHTTPMiddleware), so streamed responses and disconnects pass straight through.
    """

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self._needs_key(scope):
            if not self._authorized(headers.get(b"authorization", b"")):
                body = error_body("invalid or missing API key: send 'Authorization: Bearer <key>'",
                                   "invalid_request_error", code="invalid_api_key")
                await send_error(send, 401, body, [(b"www-authenticate", b"Bearer")])
                return
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            await self._too_large(send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:  # the declared length may be absent (chunked) or a lie: count what arrives
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._too_large(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: waits for the client to disconnect

        await self.app(scope, replay, send)

    def _needs_key(self, scope: Scope) -> bool:
        return (self.api_key is not None and scope["method"] != API_KEY_EXEMPT_METHOD
                and scope["path"].startswith(API_KEY_GUARDED_PREFIX))

    def _authorized(self, header: bytes) -> bool:
        scheme, _, token = header.partition(b" ")
        assert self.api_key is not None
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.api_key)

    async def _too_large(self, send: Send) -> None:
        body = error_body(f"the request body is larger than the limit of {self.max_body_bytes} bytes",
                           "invalid_request_error", code="request_too_large")
        await send_error(send, 413, body)


# The status of a request whose headers are too many (RFC 6585's "Request Header Fields Too Large").
TOO_MANY_HEADERS_STATUS = 431


class HeaderCountMiddleware:
    """vLLM's --h11-max-header-count: a request with more than ``max_headers`` headers is answered 431 before
    the app sees it (uvicorn has no such setting; this counts them under either of its HTTP protocols)."""

    def __init__(self, app: ASGIApp, max_headers: int) -> None:
        self.app = app
        self.max_headers = max_headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        count = len(scope.get("headers") or ())
        if scope["type"] == "http" and count > self.max_headers:
            body = error_body(f"the request has {count} headers, more than the limit of {self.max_headers}",
                              "invalid_request_error", code="too_many_headers")
            await send_error(send, TOO_MANY_HEADERS_STATUS, body, [(b"connection", b"close")])
            return
        await self.app(scope, receive, send)




def add_user_middleware(app: Any, path: str) -> None:
    """vLLM's --middleware: ``path`` (module.name) names an ASGI middleware class, which wraps the app, or an
    ``async def (request, call_next)`` function, which runs on every HTTP request; anything else, or a name
    that does not import, is a ValueError at start-up."""
    module_name, _, name = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), name) if module_name else None
    except (ImportError, AttributeError) as err:
        raise ValueError(f"middleware {path!r} does not import: {err}") from err
    if inspect.isclass(found):
        app.add_middleware(found)
    elif inspect.iscoroutinefunction(found):
        app.middleware("http")(found)
    else:
        raise ValueError(f"middleware {path!r} must name an ASGI middleware class or an async function "
                         "(request, call_next), as module.name")
