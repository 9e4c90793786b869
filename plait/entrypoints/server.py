"""The OpenAI-compatible HTTP server: completions, chat completions, models, (de)tokenize, version, health
and metrics."""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from operator import methodcaller
from pathlib import Path
from typing import Any, TypeVar

import jinja2
import prometheus_client as prom
import uvicorn
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from plait import __version__
from plait.config import EngineConfig, json_object
from plait.engine.engine import LLMEngine, StepStats, freeze_long_lived_objects, raise_gc_threshold
from plait.engine.profiler import profiler_dir_from_env
from plait.engine.request import Request as EngineRequest
from plait.entrypoints.async_engine import (
    AsyncLLMEngine,
    EngineClient,
    EngineDeadError,
    EngineInfo,
    PromptInput,
    RequestFailedError,
    RequestStream,
    RequestTimeoutError,
)
from plait.entrypoints.beam_search import (
    BeamSearch,
    advance_all,
    check_logprobs_mode,
    pending_beams,
    served_outputs,
    step_params,
)
from plait.entrypoints.engine_process import EngineProcess
from plait.entrypoints.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    CONTEXT_LENGTH_MESSAGE_START,
    APIError,
    bad_request,
    error_body,
    error_response,
    error_type,
    validation_error,
)
from plait.entrypoints.launcher import (
    StartedEngineProcess,
    bind_socket,
    closing_socket,
    launch,
    serving_config,
)
from plait.entrypoints.llm import (
    _fan_out,
    cross_encoder_prompt,
    cross_encodes,
    encode_rendered,
    pair_scores,
    render_chat,
)
from plait.entrypoints.metrics import RequestTracker, ServerMetrics
from plait.entrypoints.middleware import (
    GuardMiddleware,
    HeaderCountMiddleware,
    LoadTrackingMiddleware,
    RequestIdMiddleware,
    ServerLoad,
    add_user_middleware,
    new_response_id,
)
from plait.entrypoints.protocol import (
    MAX_SEQUENCES_PER_REQUEST,
    RESPONSE_ID_PREFIX,
    RESPONSE_ROLE,
    Admission,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogprobEntry,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTemplateRequest,
    ChatTokenLogprob,
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    CollectiveRpcRequest,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    ErrorResponse,
    FunctionCallOut,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    PoolingBody,
    PoolingData,
    PoolingInputRequest,
    PoolingRequest,
    PoolingResponse,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    ProtocolError,
    ReasoningChatResponseMessage,
    ReloadWeightsRequest,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    TokenizeRequest,
    TokenizeResponse,
    ToolCallOut,
    UnloadLoRAAdapterRequest,
    UsageInfo,
    VersionResponse,
)
from plait.entrypoints.reasoning_parsers import (
    REASONING_PARSERS,
    ReasoningDelta,
    ReasoningParser,
    get_reasoning_parser,
    split_reasoning,
)
from plait.entrypoints.stat_logger import DEFAULT_LOG_STATS_INTERVAL_S, StatLogger
from plait.entrypoints.tool_parsers import TOOL_PARSERS, ToolOutputParser, get_tool_parser
from plait.entrypoints.tools import (
    NamedToolOutput,
    RequiredToolsOutput,
    ToolCallDelta,
    ToolCallStream,
    make_tool_call_id,
)
from plait.loader.hf import ModelSource
from plait.lora.request import LoRAModulePath, LoRARequest
from plait.multimodal.chat import AUTO_CONTENT_FORMAT, content_format, image_token_text, prepare_chat
from plait.multimodal.images import FILE_URL_PREFIX, MultiModalPrompt, local_image_bytes
from plait.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput, TokenLogprobs
from plait.pooling_params import SEQUENCE_TASK_OF, PoolingParams, score_pairs
from plait.sampling_params import TRUNCATE_TO_CONTEXT, BeamSearchParams, RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_HOST = "127.0.0.1"  # loopback: exposing the server is an explicit choice (--host 0.0.0.0)
DEFAULT_PORT = 8000
API_KEY_ENV = "PLAIT_API_KEY"
# vLLM's switch for its development endpoints (here: POST /reset_prefix_cache).
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
# Request fields that count logprobs a position (chat's "logprobs" is a flag: only integer ones are bounded).
LOGPROBS_FIELDS = ("logprobs", "top_logprobs", "prompt_logprobs")
# Far above any prompt that fits a context window (128k tokens as ids is ~1 MB of JSON), far
# below what would hurt the server to buffer.
DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024
# vLLM's CORS defaults (--allowed-origins, --allowed-methods, --allowed-headers): any.
CORS_ANY = ("*",)
# What tells a --chat-template value that is template text from a file's path (vLLM's test).
JINJA_CHARS = "{}\n"
# vLLM's words for tool_choice "auto" on a server not started to parse tool calls.
AUTO_TOOL_CHOICE_MESSAGE = ('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to '
                            'be set')
# Logprobs are clamped to this so responses never hold -inf (not JSON); the same floor as vLLM.
MIN_LOGPROB = -9999.0
# How logprobs name a token under return_tokens_as_token_ids: vLLM's "token_id:<id>".
TOKEN_ID_PREFIX = "token_id:"
SSE_DONE = "data: [DONE]\n\n"
# Status for a client that left before its non-streamed answer was ready (nginx's convention;
# nobody reads it).
CLIENT_CLOSED_REQUEST = 499
GRACEFUL_SHUTDOWN_S = 5
# The API's description and its browsable pages (as vLLM's, FastAPI's; --disable-fastapi-docs drops them).
OPENAPI_PATH = "/openapi.json"
DOCS_PATH = "/docs"
REDOC_PATH = "/redoc"
# Tokenizer settings /tokenizer_info leaves out: paths of files on the server (as vLLM's).
_TOKENIZER_FILE_KEYS = frozenset({"vocab_file", "merges_file", "tokenizer_file", "name_or_path"})
# Fields of a /score body, by which /invocations tells it apart.
SCORE_INPUT_FIELDS = ("text_1", "text_2")
# The host of a Unix domain socket server's URLs: clients need one, and nothing resolves it.
UNIX_SOCKET_HOST = "localhost"


DEFAULT_ADMISSION = Admission()  # priority 0, no cache salt

# Steps step_timeline_file keeps (the last ones): ~330 MB of StepStats (measured), hours of serving.
STEP_TIMELINE_MAX_STEPS = 1_000_000

# Error responses documented in the OpenAPI schema (FastAPI's 422 is replaced by 400).
_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 408, 413, 500, 503)
}
_TOKENIZER_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 404, 413)
}
_LORA_ERROR_RESPONSES = _TOKENIZER_ERROR_RESPONSES
# The error type of vLLM's 404s (an unknown model, an unknown adapter).
_NOT_FOUND_ERROR = "NotFoundError"
# Request schemas whose "model" field the OpenAPI document restricts to the served names.
_MODEL_NAMED_REQUESTS = ("CompletionRequest", "ChatCompletionRequest", "TokenizeRequest", "DetokenizeRequest",
                         "ResponsesRequest")


# -- configuration ----------------------------------------------------------------------------


@dataclass
class ServerConfig:
    """Knobs of the HTTP server (the engine's are in EngineConfig)."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT  # 0 = any free port
    api_key: str | None = None  # when set, every /v1 endpoint needs "Authorization: Bearer <key>"
    # None: the model file's stem or folder's name. Several names (vLLM's --served-model-name a b): the
    # first is the one responses report, and "model" may be any of them.
    served_model_name: str | Sequence[str] | None = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    request_timeout_s: float | None = None  # abort requests running longer than this; None = never
    # Whether a request may bring its own chat template (a Jinja program run on the server). Off by
    # default, as vLLM's --trust-request-chat-template: only a trusted client should choose the template.
    trust_request_chat_template: bool = False
    # vLLM's --chat-template: a file, or the template's text, used instead of the model's (so a model whose
    # own template knows nothing of tools can be served with one that does); a trusted request's wins.
    chat_template: str | None = None
    # vLLM's --default-chat-template-kwargs: chat template variables every chat request gets unless it sets
    # them itself (a dict or its JSON text), e.g. {"enable_thinking": false} for Qwen3; the reasoning
    # parser reads them too.
    default_chat_template_kwargs: dict[str, Any] | str | None = None
    # vLLM's --response-role: the role chat answers carry where the request adds a generation prompt.
    response_role: str = RESPONSE_ROLE
    # vLLM's --chat-template-content-format: a message's content as the template gets it, "string" (text
    # parts joined) or "openai" (a list of parts); "auto": what the template's code reads
    # (plait.multimodal.chat).
    chat_template_content_format: str = AUTO_CONTENT_FORMAT
    # vLLM's --enable-auto-tool-choice and --tool-call-parser: tool_choice "auto" (the default where tools
    # are given) reads the model's tool calls with that parser; without them it is refused, as in vLLM.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # vLLM's --tool-parser-plugin and --reasoning-parser-plugin: Python files run once in the process that
    # makes this config (each data-parallel replica's too, which remakes it), registering parsers that
    # tool_call_parser and reasoning_parser may then name.
    tool_parser_plugin: str | None = None
    reasoning_parser_plugin: str | None = None
    # vLLM's --reasoning-parser: chat answers carry the model's reasoning in "reasoning", apart from the
    # content, and structured outputs apply after it.
    reasoning_parser: str | None = None
    # vLLM's --exclude-tools-when-tool-choice-none: a chat request's tool_choice "none" keeps its tools out
    # of the prompt (and out of /tokenize's rendering of the same body), so the model is not shown what it
    # may not call.
    exclude_tools_when_tool_choice_none: bool = False
    # vLLM's --return-tokens-as-token-ids: logprobs name tokens "token_id:<id>" unless a request's
    # return_tokens_as_token_ids says otherwise.
    return_tokens_as_token_ids: bool = False
    log_level: str = "info"
    # vLLM's periodic stats lines (throughputs, queue, KV cache, speculation) every log_stats_interval_s
    # while the engine has work; --disable-log-stats turns them off.
    disable_log_stats: bool = False
    log_stats_interval_s: float = DEFAULT_LOG_STATS_INTERVAL_S
    # CORS, as vLLM's --allowed-origins / --allowed-methods / --allowed-headers / --allow-credentials: which
    # web pages' scripts may call the server from a browser (the API key, where set, still applies).
    allowed_origins: Sequence[str] = CORS_ANY
    allowed_methods: Sequence[str] = CORS_ANY
    allowed_headers: Sequence[str] = CORS_ANY
    allow_credentials: bool = False
    # vLLM's --lora-modules (under the engine's enable_lora): each adapter is served under its own model
    # name, which /v1/models lists with the base model as its parent.
    lora_modules: Sequence[LoRAModulePath] = ()
    # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: POST /v1/load_lora_adapter and /v1/unload_lora_adapter add and
    # remove adapters while serving.
    allow_runtime_lora_updating: bool = False
    # vLLM's --ssl-keyfile / --ssl-certfile (HTTPS; both or neither) and --ssl-ca-certs (clients must then
    # present a certificate that CA signed).
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    # vLLM's --root-path: the path prefix a proxy in front of the server strips (for the OpenAPI docs' links).
    root_path: str = ""
    # vLLM's --enable-force-include-usage: every stream ends with a usage chunk, asked for or not.
    enable_force_include_usage: bool = False
    # vLLM's --enable-tokenizer-info-endpoint: GET /tokenizer_info (the tokenizer's configuration and chat
    # template; off by default, as vLLM's, since a template may hold what its owner keeps to themselves).
    enable_tokenizer_info_endpoint: bool = False
    # vLLM's --middleware: import paths (module.name) of ASGI middleware classes or async functions
    # (request, call_next) that wrap every HTTP request, outside plait's own (the key check included).
    middleware: Sequence[str] = ()
    # vLLM's --log-config-file: uvicorn's logging configuration (a JSON, YAML or INI file) instead of its own.
    log_config_file: str | None = None
    # vLLM's --ssl-cert-reqs (ssl.CERT_NONE / OPTIONAL / REQUIRED: 0 / 1 / 2); None: REQUIRED where
    # ssl_ca_certs is given, else NONE.
    ssl_cert_reqs: int | None = None
    # vLLM's --stream-interval: a streamed answer's chunks after its first carry at least this many tokens
    # (its last may carry fewer): fewer, fuller chunks, less host work per token. 1: every step's tokens.
    stream_interval: int = 1
    # vLLM's --enable-ssl-refresh: when the key, certificate or CA files change on disk, new connections get
    # them (certificate rotation without a restart); connections open keep theirs.
    enable_ssl_refresh: bool = False
    # vLLM's --allowed-local-media-path: image parts may name files in this folder by file:// URL (a client
    # then reads the server's files: for trusted clients only); None: data URLs only.
    allowed_local_media_path: str | None = None
    # vLLM's --uds: serve on a Unix domain socket at this path instead of host and port.
    uds: str | None = None
    # vLLM's --disable-fastapi-docs: no /docs, /redoc or /openapi.json.
    disable_fastapi_docs: bool = False
    # vLLM's --uvicorn-log-level (None: log_level) and --disable-uvicorn-access-log (no line per HTTP
    # request).
    uvicorn_log_level: str | None = None
    disable_uvicorn_access_log: bool = False
    # vLLM's --enable-log-requests: one log line per engine request (its id, prompt, token ids and sampling
    # params), the prompt and ids cut to max_log_len characters and ids (vLLM's --max-log-len; None: whole).
    enable_log_requests: bool = False
    # vLLM's --enable-log-outputs: one log line per finished engine request of a completion or chat (its text
    # and token ids, cut to max_log_len, and why it finished), named as its --enable-log-requests line.
    enable_log_outputs: bool = False
    max_log_len: int | None = None
    # What the ids of stored Responses begin with; a data-parallel replica's name it, so that the front can
    # send requests naming a response to the replica that stores it (plait.entrypoints.replica_router).
    response_id_prefix: str = RESPONSE_ID_PREFIX
    # vLLM's --enable-prompt-tokens-details: completions' and chats' usage says how many prompt tokens the
    # prefix cache served (prompt_tokens_details.cached_tokens, as OpenAI's).
    enable_prompt_tokens_details: bool = False
    # vLLM's --enable-server-load-tracking: GET /load gives the model-running requests in flight.
    enable_server_load_tracking: bool = False
    # vLLM's --enable-request-id-headers: every response carries X-Request-Id (the request's own header, else
    # the id its response body was given, else a new one).
    enable_request_id_headers: bool = False
    # Where to write the engine's step timeline (plait.bench.timeline's file: each step's wall time, prompt
    # and decode tokens, rows, graph replay, KV blocks, preemptions) when the server stops; None: not kept.
    # Start times stay on the host's monotonic clock, so a load generator on the same host can line its
    # requests up with the steps. ``plait bench timeline FILE`` plots it.
    step_timeline_file: str | None = None
    # vLLM's --log-error-stack: every error response the API gives (a 4xx a request's content earns, a 5xx,
    # an error chunk ending a stream) logs its exception's stack trace. The middleware's refusals before the
    # API (401 key, 413 size, 431 headers) have none. Unexpected errors' traces are logged either way.
    log_error_stack: bool = False
    # vLLM's --h11-max-incomplete-event-size: the bytes of a request's line and headers (an incomplete HTTP
    # event) the server buffers before it answers 400; given, the server runs uvicorn's h11 protocol, which
    # takes it, instead of httptools (uvicorn's "auto" where it is installed, which has no such bound).
    # None: uvicorn's choice and h11's own 16 KiB.
    h11_max_incomplete_event_size: int | None = None
    # vLLM's --h11-max-header-count: requests with more headers are answered 431 before the app reads them
    # (uvicorn has no such setting: plait's HeaderCountMiddleware counts them, under either protocol). None:
    # no limit.
    h11_max_header_count: int | None = None
    chat_template_text: str | None = field(default=None, init=False, repr=False)  # what chat_template names

    def __post_init__(self) -> None:
        if self.max_request_body_bytes < 1:
            raise ValueError(f"max_request_body_bytes must be >= 1, got {self.max_request_body_bytes}")
        if not self.log_stats_interval_s > 0:
            raise ValueError(f"log_stats_interval_s must be > 0, got {self.log_stats_interval_s}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        names = self.served_model_names
        if names is not None and (not names or not all(isinstance(n, str) and n for n in names)):
            raise ValueError(f"served_model_name must be one or more non-empty names, got {names!r}")
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"{name} must be a list of strings, got {value!r}")
        if not isinstance(self.allow_credentials, bool):
            raise ValueError(f"allow_credentials must be true or false, got {self.allow_credentials!r}")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("HTTPS needs both ssl_keyfile and ssl_certfile (--ssl-keyfile, --ssl-certfile)")
        if self.ssl_ca_certs is not None and self.ssl_certfile is None:
            raise ValueError("ssl_ca_certs checks clients' certificates over HTTPS: it needs ssl_keyfile and "
                             "ssl_certfile too")
        for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{name} {path!r} is not a file")
        folder = self.allowed_local_media_path
        if folder is not None and not os.path.isdir(folder):
            raise ValueError(f"allowed_local_media_path {folder!r} is not a folder")
        if self.log_config_file is not None and not os.path.isfile(self.log_config_file):
            raise ValueError(f"log_config_file {self.log_config_file!r} is not a file")
        if isinstance(self.stream_interval, bool) or not isinstance(self.stream_interval, int) \
                or self.stream_interval < 1:
            raise ValueError(f"stream_interval must be a whole number >= 1, got {self.stream_interval!r}")
        if self.enable_ssl_refresh and self.ssl_certfile is None:
            raise ValueError("enable_ssl_refresh reloads the HTTPS files: it needs ssl_keyfile and "
                             "ssl_certfile")
        if self.ssl_cert_reqs is not None and self.ssl_cert_reqs not in tuple(ssl.VerifyMode):
            raise ValueError(f"ssl_cert_reqs must be 0, 1 or 2 (none, optional, required), got "
                             f"{self.ssl_cert_reqs}")
        if isinstance(self.middleware, str):
            raise ValueError(f"middleware must be a list of import paths, got {self.middleware!r}")
        if self.uds is not None and (not self.uds or not hasattr(socket, "AF_UNIX")):
            raise ValueError(f"uds must be a Unix domain socket's path on a system that has them, got "
                             f"{self.uds!r}")
        for name in ("h11_max_incomplete_event_size", "h11_max_header_count"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        if self.max_log_len is not None and (isinstance(self.max_log_len, bool) or self.max_log_len < 0):
            raise ValueError(f"max_log_len must be >= 0, got {self.max_log_len!r}")
        if self.chat_template is not None:
            self.chat_template_text = load_chat_template(self.chat_template)
        content_format(None, self.chat_template_content_format)  # an unknown format fails at start-up
        self.default_chat_template_kwargs = json_object("default_chat_template_kwargs",
                                                        self.default_chat_template_kwargs)
        # The plugins run, and an unknown name fails, here at start-up rather than in a request.
        TOOL_PARSERS.load(self.tool_call_parser, self.tool_parser_plugin)
        REASONING_PARSERS.load(self.reasoning_parser, self.reasoning_parser_plugin)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser (--tool-call-parser NAME)")
        if isinstance(self.lora_modules, (str, LoRAModulePath)) or not all(
                isinstance(m, LoRAModulePath) for m in self.lora_modules):
            raise ValueError(f"lora_modules must be a list of LoRAModulePath, got {self.lora_modules!r}")

    @property
    def served_model_names(self) -> tuple[str, ...] | None:
        name = self.served_model_name
        if name is None or isinstance(name, str):
            return None if name is None else (name,)
        return tuple(name)


def load_chat_template(value: str) -> str:
    """vLLM's --chat-template: the text of the file it names, or the template itself (text with Jinja's
    braces or a newline); a path that cannot be read is a ValueError."""
    try:
        return Path(value).read_text()
    except (OSError, ValueError) as err:  # ValueError: a NUL in the name
        if not any(char in value for char in JINJA_CHARS):
            raise ValueError(f"the chat template {value!r} looks like a file's path, but it could not be "
                             f"read: {err}") from err
        return value


def default_served_model_name(source: ModelSource) -> str:
    """The name clients use in "model": the Hub id a model was found under in the HF cache (as vLLM
    serves it), else the GGUF file's stem or the HF folder's name.

    The default model is served as ``SmolLM2-135M-Instruct.Q4_1``.
    """
    if source.repo_id is not None:
        return source.repo_id  # its folder is the cache's snapshots/<commit hash>
    return source.path.stem if source.path.is_file() else Path(source.path).name


class _TokenIdStream:
    """return_token_ids in a stream: each choice's new output ids since its last chunk (a chunk held back,
    mid-character or a possible stop string, passes its ids on to the next), and its prompt's ids once."""

    def __init__(self, num_choices: int) -> None:
        self._pending: list[list[int]] = [[] for _ in range(num_choices)]
        self._prompt_sent = [False] * num_choices

    def add(self, index: int, token_ids: Sequence[int]) -> None:
        self._pending[index].extend(token_ids)

    def take(self, index: int, prompt_token_ids: Sequence[int] = ()) -> tuple[list[int] | None, list[int]]:
        """(the prompt's ids in the choice's first chunk, else None; the output ids this chunk carries)."""
        prompt = None if self._prompt_sent[index] else list(prompt_token_ids)
        self._prompt_sent[index] = True
        new, self._pending[index] = self._pending[index], []
        return prompt, new


class _EngineStreamResponse(StreamingResponse):
    """An SSE response that aborts its engine requests however it ends.

    A client may leave before the body iterator has even started, in which case the generator's
    own cleanup never runs; this wrapper's does.
    """

    def __init__(self, content: AsyncIterator[str], stream: RequestStream, tracker: RequestTracker) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._engine_stream = stream
        self._tracker = tracker

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._engine_stream.abort()
            self._tracker.close()


def _encode_embedding(vector: Any, encoding_format: str) -> list[float] | list[list[float]] | str:
    """An embedding (a host fp32 tensor; a per-token task's matrix, row by row) as a JSON list of floats, or
    as base64 of its little-endian float32 bytes (what the openai client asks for, and decodes with numpy;
    a matrix's rows one after another)."""
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def _sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


def _sse_error(err: Exception, status: int) -> str:
    body = error_body(str(err), error_type(status)).decode()
    return f"data: {body}\n\n"


_ENGINE_ERROR_STATUS: dict[type[Exception], int] = {
    RequestTimeoutError: 408, RequestFailedError: 500, EngineDeadError: 503,
}
_ENGINE_ERRORS = tuple(_ENGINE_ERROR_STATUS)


def _new_logprobs(completion: CompletionOutput) -> list[TokenLogprobs]:
    """The logprobs of the tokens this output added (the engine's list is cumulative)."""
    logprobs = completion.logprobs or []
    return logprobs[len(logprobs) - len(completion.delta_token_ids):]


# A row of a completion's logprobs: a token id and its logprobs, None for the prompt's first token (echo).
LogprobRow = tuple[int, TokenLogprobs | None]


def _without_field(component: dict[str, Any], name: str) -> None:
    """A request schema without the field ``name``, nor an alternative of its top-level anyOf requiring it."""
    component.get("properties", {}).pop(name, None)
    alternatives = [a for a in component.get("anyOf", ()) if name not in a.get("required", ())]
    if "anyOf" in component:
        component["anyOf"] = alternatives


def _completion_prompts(body: CompletionRequest) -> list[PromptInput]:
    """A completion's batch of prompts (prompt_embeds decoded); a 400 naming the field where one is bad."""
    try:
        return body.prompts()
    except ProtocolError as err:
        raise bad_request(err) from err


def _prompt_only(completion: CompletionOutput) -> CompletionOutput:
    """An echo-only completion (max_tokens 0): the one token the engine generated to get there dropped, so
    the choice is its prompt alone, ended by its length."""
    return dataclasses.replace(
        completion, text="", token_ids=[], delta_text="", delta_token_ids=[], stop_reason=None,
        logprobs=None if completion.logprobs is None else [],
        finish_reason=None if completion.finish_reason is None else "length")


def _generated_rows(entries: Sequence[TokenLogprobs]) -> list[LogprobRow]:
    return [(entry.token_id, entry) for entry in entries]


def _prompt_rows(out: RequestOutput) -> list[LogprobRow]:
    """The prompt's tokens with their logprobs, which echo lists before the generated ones (vLLM's)."""
    entries = out.prompt_logprobs
    # The engine completes them before the first generated token; the request asked for them (echo with
    # logprobs sets SamplingParams.prompt_logprobs).
    assert entries is not None and len(entries) == len(out.prompt_token_ids), "prompt logprobs missing"
    return list(zip(out.prompt_token_ids, entries))


@dataclass
class _ChoiceReader:
    """How one choice's output becomes a chat message: its reasoning split off first (--reasoning-parser),
    then, where tools are in play, tool calls read from the rest, the answer alone (as vLLM reads them)."""

    tools: ToolCallStream | None = None
    reasoning: ReasoningParser | None = None
    include_reasoning: bool = True  # the request's: false leaves the reasoning out

    def whole(self, text: str) -> tuple[str | None, str | None]:
        """A finished output's reasoning (None without a parser) and the text after it."""
        return (None, text) if self.reasoning is None else split_reasoning(self.reasoning, text)

    def feed(self, delta: str, final: bool) -> ReasoningDelta:
        """What a streamed piece of the output adds to the reasoning and to the text after it."""
        return ReasoningDelta(content=delta) if self.reasoning is None else self.reasoning.feed(delta, final)

    def shown(self, reasoning: str | None) -> str | None:
        return reasoning if self.include_reasoning else None


def _chat_message(completion: CompletionOutput, reader: _ChoiceReader
                  ) -> tuple[ChatResponseMessage, str | None]:
    """A finished choice's message and finish_reason: its text, or where tools are in play, its content
    (null when none) and tool calls; under a reasoning parser, its reasoning too."""
    reasoning, content = reader.whole(completion.text)
    calls, finish_reason = None, completion.finish_reason
    if reader.tools is not None:
        content, deltas = reader.tools.feed(content or "", final=True)
        content = content or None
        calls = [ToolCallOut(id=d.id or make_tool_call_id(),
                             function=FunctionCallOut(name=d.name or "", arguments=d.arguments))
                 for d in deltas] or None  # fed whole, each delta is a whole call, id and name included
        finish_reason = reader.tools.finish_reason(finish_reason)
    if reader.reasoning is None:
        return ChatResponseMessage(content=content, tool_calls=calls), finish_reason
    shown = reader.shown(reasoning)
    return ReasoningChatResponseMessage(content=content, tool_calls=calls, reasoning=shown), finish_reason


def _chat_delta(completion: CompletionOutput, reader: _ChoiceReader
                ) -> tuple[DeltaMessage | None, str | None]:
    """A streamed choice's new delta (None: nothing to send yet) and its finish_reason."""
    final = completion.finish_reason is not None
    piece = reader.feed(completion.delta_text, final)
    content, calls, finish_reason = piece.content, [], completion.finish_reason
    if reader.tools is not None:
        content, deltas = reader.tools.feed(content, final)
        calls = [_delta_tool_call(d) for d in deltas]
        finish_reason = reader.tools.finish_reason(finish_reason)
    reasoning = reader.shown(piece.reasoning)
    if not (content or calls or reasoning):
        return None, finish_reason
    delta = DeltaMessage(content=content or None, reasoning=reasoning or None, tool_calls=calls or None)
    return delta, finish_reason


def _delta_tool_call(delta: ToolCallDelta) -> DeltaToolCall:
    return DeltaToolCall(index=delta.index, id=delta.id, type="function" if delta.id else None,
                         function=DeltaFunctionCall(name=delta.name, arguments=delta.arguments))


def _clamp(logprob: float) -> float:
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB  # also maps NaN to the floor


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# -- the server ---------------------------------------------------------------------------------


def _cache_config_labels(info: EngineInfo) -> dict[str, str]:
    """vllm:cache_config_info's labels (vLLM's names, values as strings), fixed once the engine is built."""
    config = info.config
    num_blocks = info.num_kv_blocks
    return {"block_size": str(config.block_size), "cache_dtype": config.kv_cache_dtype,
            "num_gpu_blocks": str(num_blocks), "kv_cache_size_tokens": str(num_blocks * config.block_size),
            "enable_prefix_caching": str(config.enable_prefix_caching),
            "gpu_memory_utilization": str(config.gpu_memory_utilization)}


def _check_lora_adapter(engine: LLMEngine, lora: LoRARequest) -> None:
    """Read and check ``lora``'s adapter where the engine runs (ValueError if it cannot be served)."""
    engine.lora_adapter(lora)


def _check_writable(path: str) -> None:
    """Refuse a file the server could not write when it stops: its folder is made now and must be writable."""
    folder = Path(path).resolve().parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"cannot write {path}: {err}") from err
    if not os.access(folder, os.W_OK) or Path(path).is_dir():
        raise ValueError(f"cannot write {path}: not a writable file path")


def _answer_kind(params: SamplingParams, streamed: bool, whole_outputs: bool = False) -> SamplingParams:
    """``params`` for an answer given whole: only the final outputs are sent (vLLM's FINAL_ONLY), so the
    request's reader is not woken every step; or streamed as it is made: each output carries only what its
    step added (vLLM's DELTA: the streaming code reads nothing else, and no step copies the whole output so
    far), unless ``whole_outputs`` (the server logs each finished output whole)."""
    if not streamed:
        return dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
    return params if whole_outputs else dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)


class OpenAIServer:
    """The FastAPI app around an engine client (AsyncLLMEngine, EngineProcess); ``app`` is what uvicorn runs.

    The engine's step loop starts serving with the app's lifespan and stops with it.
    """

    def __init__(self, engine: LLMEngine | EngineProcess, config: ServerConfig | None = None) -> None:
        """Serve ``engine``: one in this process (its step loop then runs on a thread here), or an
        EngineProcess (its loop runs in that process, apart from this one's HTTP work)."""
        self.config = config if config is not None else ServerConfig()
        info = engine.info if isinstance(engine, EngineProcess) else EngineInfo.of(engine)
        self.served_model_names = (self.config.served_model_names
                                   or (default_served_model_name(info.model_source),))
        self.model_name = self.served_model_names[0]  # the one responses report
        self.max_model_len = info.max_model_len
        source = info.model_source
        self.model_root = source.repo_id or str(source.path)  # /v1/models' root, as vLLM's
        self.vocab_size = info.vocab_size
        # A pooling model's pooler, None for any other: a pooling model serves /v1/embeddings and no text
        # endpoint; any other model the reverse (as vLLM).
        self.pooling_spec = info.pooling_spec
        self.eos_token_ids = info.eos_token_ids  # beam search finishes beams on them
        # The model's generation_config.json: defaults of what requests leave out.
        self.generation_defaults = info.generation_defaults
        # The engine detokenizes with its own tokenizer; the server's (chat templates, logprob token strings)
        # is a copy, so no tokenizer object is shared between threads.
        self.tokenizer = info.tokenizer
        # An image model's image token text (chat templates that take text write it for each image); None
        # for a text model, whose messages may not hold images.
        self.image_text = (image_token_text(self.tokenizer, info.image_processor.prompt_token_ids)
                           if info.image_processor is not None else None)
        self.image_processor = info.image_processor  # stateless: shared with the engine's loop
        template = self._chat_template()
        if template:  # as vLLM, say which content format the template gets
            logger.info("chat template content format: %r",
                        content_format(template, self.config.chat_template_content_format))
        self._token_strings: dict[int, str] = {}
        name = self.config.reasoning_parser
        self.reasoning_parser = get_reasoning_parser(name) if name is not None else None
        # LoRA adapters by the model name that selects them (--lora-modules, /v1/load_lora_adapter); each is
        # read and checked here, before the loop starts, so a bad one stops the server from starting.
        self.lora_requests: dict[str, LoRARequest] = {}
        self._lora_ids = itertools.count(1)
        for module in self.config.lora_modules:
            lora = self._new_lora(module.name, module.path, module.base_model_name)
            check = functools.partial(_check_lora_adapter, lora=lora)
            if isinstance(engine, EngineProcess):
                engine.call_before_start(check)
            else:
                check(engine)
            self.lora_requests[lora.lora_name] = lora
        if isinstance(engine, EngineProcess):
            engine.on_step = self._on_step
            self.engine: EngineClient = engine
        else:
            self.engine = AsyncLLMEngine(engine, on_step=self._on_step)
        self.sleep_mode = info.config.enable_sleep_mode  # /sleep, /wake_up, /is_sleeping in dev mode
        self.logprobs_mode = info.config.logprobs_mode  # beam search refuses the logits modes
        self.load = ServerLoad()  # counted under enable_server_load_tracking
        self.max_logprobs = info.max_logprobs
        self.takes_prompt_embeds = info.config.enable_prompt_embeds
        self.metrics = ServerMetrics(lambda: self.engine.stats, self.model_name, _cache_config_labels(info))
        # The last STEP_TIMELINE_MAX_STEPS steps, for step_timeline_file (appended by on_step).
        self.step_timeline: collections.deque[StepStats] | None = None
        if self.config.step_timeline_file:
            _check_writable(self.config.step_timeline_file)  # now, not after hours of serving
            self.step_timeline = collections.deque(maxlen=STEP_TIMELINE_MAX_STEPS)
        self.app = self._build_app()

    async def _engine_call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """``fn(engine)`` on the engine's loop thread; its ValueError a 400."""
        try:
            return await self.engine.call(fn)
        except ValueError as err:
            raise APIError(400, str(err)) from err

    def _on_step(self, stats: StepStats) -> None:
        self.metrics.observe_step(stats)
        if self.step_timeline is not None:
            self.step_timeline.append(stats)

    def _write_step_timeline(self) -> None:
        if self.step_timeline is None:
            return
        from plait.bench.timeline import dump

        path = dump(list(self.step_timeline), self.config.step_timeline_file, origin=0.0)
        logger.info("wrote the step timeline (%d steps) to %s", len(self.step_timeline), path)

    async def _log_stats(self) -> None:
        stat_logger = StatLogger(lambda: self.engine.stats, self.metrics.totals)
        interval = self.config.log_stats_interval_s
        while True:
            await asyncio.sleep(interval)
            stat_logger.log(interval)

    # -- app ---------------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            self.engine.start()
            stats = None if self.config.disable_log_stats else asyncio.create_task(self._log_stats())
            try:
                yield
            finally:
                if stats is not None:
                    stats.cancel()
                await self.engine.shutdown()
                self._write_step_timeline()

        docs = not self.config.disable_fastapi_docs
        app = FastAPI(title="plait", version=__version__, lifespan=lifespan,
                      openapi_url=OPENAPI_PATH if docs else None, docs_url=DOCS_PATH if docs else None,
                      redoc_url=REDOC_PATH if docs else None)
        self._add_error_handlers(app)

        @app.get("/health", responses={503: {"model": ErrorResponse}})
        async def health() -> Response:
            if not self.engine.is_alive:
                raise APIError(503, "the engine loop is not running", error_type(503))
            return JSONResponse({"status": "ok"})

        # vLLM's /ping (SageMaker's health check), GET or POST: /health's answer.
        app.add_api_route("/ping", health, methods=["GET", "POST"], include_in_schema=False)

        if self.config.enable_server_load_tracking:
            @app.get("/load")
            async def load() -> Response:
                return JSONResponse({"server_load": self.load.in_flight})

        @app.get("/metrics", response_class=Response)
        async def metrics() -> Response:
            return Response(self.metrics.render(), media_type=prom.CONTENT_TYPE_LATEST)

        if os.environ.get(DEV_MODE_ENV, "").lower() in ("1", "true"):  # as vLLM: development endpoints
            @app.post("/reset_prefix_cache")
            async def reset_prefix_cache() -> Response:
                if not await self._engine_call(methodcaller("reset_prefix_cache")):
                    raise APIError(409, "the prefix cache is in use: requests hold blocks", "conflict_error")
                return JSONResponse({})

            @app.post("/reload_weights")
            async def reload_weights(body: ReloadWeightsRequest | None = None) -> Response:
                path = body.path if body is not None else None
                try:
                    await self._engine_call(methodcaller("reload_weights", path))
                except FileNotFoundError as err:
                    raise APIError(400, str(err)) from err
                return JSONResponse({})

            @app.post("/collective_rpc")
            async def collective_rpc(body: CollectiveRpcRequest) -> Response:
                call = methodcaller("collective_rpc", body.method, body.timeout, tuple(body.args),
                                    body.kwargs)
                try:
                    results = await self._engine_call(call)
                except (AttributeError, TypeError) as err:  # no such method, or arguments it does not take
                    raise APIError(400, str(err)) from err
                # As vLLM answers: JSON values as they are (tuples as lists), anything else as its str().
                plain = (dict, list, tuple, str, int, float)
                return JSONResponse({"results": [r if r is None or isinstance(r, plain) else str(r)
                                                 for r in results]})

            if self.sleep_mode:
                self._add_sleep_routes(app)

        if profiler_dir_from_env() is not None:  # as vLLM: only where a trace folder is set
            @app.post("/start_profile")
            async def start_profile() -> Response:
                await self._engine_call(methodcaller("start_profile"))
                return JSONResponse({})

            @app.post("/stop_profile")
            async def stop_profile() -> Response:
                path = await self._engine_call(methodcaller("stop_profile"))
                return JSONResponse({"trace": str(path)})

        @app.get("/version", response_model=VersionResponse)
        async def version() -> VersionResponse:
            return VersionResponse(version=__version__)

        @app.post("/tokenize", response_model=TokenizeResponse, responses=_TOKENIZER_ERROR_RESPONSES)
        async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
            return await self.tokenize(body)

        @app.post("/detokenize", response_model=DetokenizeResponse, responses=_TOKENIZER_ERROR_RESPONSES)
        async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
            return self.detokenize(body)

        if self.config.enable_tokenizer_info_endpoint:
            @app.get("/tokenizer_info", responses=_TOKENIZER_ERROR_RESPONSES)
            async def tokenizer_info() -> Response:
                return JSONResponse(self.tokenizer_info())

        @app.get("/v1/models", response_model=ModelList, responses={401: {"model": ErrorResponse}})
        async def models() -> ModelList:
            return self.models()

        if self.config.allow_runtime_lora_updating:
            @app.post("/v1/load_lora_adapter", response_class=Response, responses=_LORA_ERROR_RESPONSES)
            async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
                return await self.load_lora_adapter(body)

            @app.post("/v1/unload_lora_adapter", response_class=Response, responses=_LORA_ERROR_RESPONSES)
            async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
                return self.unload_lora_adapter(body)

        @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERROR_RESPONSES)
        async def completions(body: CompletionRequest, raw: Request) -> Response:
            return await self.create_completion(body, raw)

        @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERROR_RESPONSES)
        async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
            return await self.create_chat_completion(body, raw)

        @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=_ERROR_RESPONSES)
        async def embeddings(body: EmbeddingRequest, raw: Request) -> Response:
            return await self.create_embedding(body, raw)

        @app.post("/classify", response_model=ClassificationResponse, responses=_ERROR_RESPONSES)
        async def classify(body: ClassificationRequest, raw: Request) -> Response:
            return await self.create_classification(body, raw)

        @app.post("/pooling", response_model=PoolingResponse, responses=_ERROR_RESPONSES)
        async def pooling(body: PoolingRequest, raw: Request) -> Response:
            return await self.create_pooling(body, raw)

        for path in ("/score", "/v1/score"):
            @app.post(path, response_model=ScoreResponse, responses=_ERROR_RESPONSES)
            async def score(body: ScoreRequest, raw: Request) -> Response:
                return await self.create_score(body, raw)

        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            @app.post(path, response_model=RerankResponse, responses=_ERROR_RESPONSES)
            async def rerank(body: RerankRequest, raw: Request) -> Response:
                return await self.create_rerank(body, raw)

        # SageMaker's inference endpoint, as vLLM serves it: the body's fields pick the API that answers it.
        @app.post("/invocations", responses=_ERROR_RESPONSES)
        async def invocations(raw: Request) -> Response:
            return await self.invoke(raw)

        # The Responses API, on the chat path; imported here, as it builds on this module.
        from plait.entrypoints.responses import ResponsesAPI

        self.responses = ResponsesAPI(self)
        self.responses.add_routes(app)

        app.openapi = lambda: self._openapi(app, self.model_names,  # type: ignore[method-assign]
                                            self.max_logprobs, self.takes_prompt_embeds)
        app.add_middleware(GuardMiddleware, api_key=self.config.api_key,
                           max_body_bytes=self.config.max_request_body_bytes)
        if self.config.enable_server_load_tracking:
            app.add_middleware(LoadTrackingMiddleware, load=self.load)
        app.add_middleware(RequestIdMiddleware, echo=self.config.enable_request_id_headers)
        for path in self.config.middleware:  # outside plait's own, as vLLM's: they see every request
            add_user_middleware(app, path)
        # Added last, so outermost: it answers preflights before the key check, and its headers reach every
        # response, the guard's 401 and 413 included, so a page's script can read why it was refused.
        app.add_middleware(CORSMiddleware, allow_origins=list(self.config.allowed_origins),
                           allow_methods=list(self.config.allowed_methods),
                           allow_headers=list(self.config.allowed_headers),
                           allow_credentials=self.config.allow_credentials)
        return app

    @staticmethod
    def _openapi(app: FastAPI, model_names: Sequence[str], max_logprobs: int,
                 prompt_embeds: bool) -> dict[str, Any]:
        """FastAPI's schema, without its 422 responses (validation errors here are 400s), and with
        the model names this server accepts, its engine's max_logprobs as the logprobs fields' maximum, and
        completions' prompt_embeds only where the engine takes them (enable_prompt_embeds)."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path_item in schema.get("paths", {}).values():
                for operation in path_item.values():
                    operation.get("responses", {}).pop("422", None)
            components = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            for name in _MODEL_NAMED_REQUESTS:
                model = components.get(name, {}).get("properties", {}).get("model")
                if model is not None:
                    model["anyOf"] = [{"type": "string", "enum": list(model_names)}, {"type": "null"}]
            for component in components.values():
                for name in LOGPROBS_FIELDS:
                    field_schema = component.get("properties", {}).get(name, {})
                    for option in [field_schema, *field_schema.get("anyOf", ())]:
                        if option.get("type") == "integer":
                            option["maximum"] = max_logprobs
            if not prompt_embeds:
                _without_field(components.get(CompletionRequest.__name__, {}), "prompt_embeds")
            app.openapi_schema = schema
        return app.openapi_schema

    def _add_sleep_routes(self, app: FastAPI) -> None:
        """vLLM's sleep-mode endpoints: free the GPU memory of the weights and the KV cache while other work
        uses the GPU; generation answers 503 meanwhile. After level 2 (weights dropped), POST /reload_weights
        brings a checkpoint in (between waking the weights and the KV cache)."""

        @app.post("/sleep")
        async def sleep(level: int = 1) -> Response:
            await self._engine_call(methodcaller("sleep", level))
            return JSONResponse({})

        @app.post("/wake_up")
        async def wake_up(tags: list[str] | None = Query(None)) -> Response:  # noqa: B008 (FastAPI's idiom)
            await self._engine_call(methodcaller("wake_up", tags))
            return JSONResponse({})

        @app.get("/is_sleeping")
        async def is_sleeping() -> Response:
            return JSONResponse({"is_sleeping": self.engine.is_sleeping})

    def _add_error_handlers(self, app: FastAPI) -> None:
        async def on_api_error(request: Request, exc: Exception) -> Response:
            assert isinstance(exc, APIError)
            self.log_error_stack(exc.status, exc, request)
            return error_response(exc)

        async def on_validation(request: Request, exc: Exception) -> Response:
            assert isinstance(exc, RequestValidationError)
            error = validation_error(exc)
            self.log_error_stack(error.status, exc, request)
            return error_response(error)

        async def on_http(request: Request, exc: Exception) -> Response:
            assert isinstance(exc, StarletteHTTPException)
            code = "not_found" if exc.status_code == 404 else None
            error = APIError(exc.status_code, str(exc.detail), error_type(exc.status_code), code=code)
            self.log_error_stack(exc.status_code, exc, request)
            return error_response(error, exc.headers)  # e.g. Allow on a 405

        async def on_engine_error(request: Request, exc: Exception) -> Response:
            status = next(s for t, s in _ENGINE_ERROR_STATUS.items() if isinstance(exc, t))
            self.log_error_stack(status, exc, request)
            return error_response(APIError(status, str(exc), error_type(status)))

        async def on_unexpected(_: Request, exc: Exception) -> Response:
            logger.error("unhandled error", exc_info=exc)
            return error_response(APIError(500, "internal server error", "internal_error"))

        app.add_exception_handler(APIError, on_api_error)
        app.add_exception_handler(RequestValidationError, on_validation)
        app.add_exception_handler(StarletteHTTPException, on_http)
        for engine_error in _ENGINE_ERRORS:
            app.add_exception_handler(engine_error, on_engine_error)
        app.add_exception_handler(Exception, on_unexpected)

    def log_error_stack(self, status: int, exc: BaseException, request: Request | None = None) -> None:
        """vLLM's --log-error-stack: the stack trace of an exception that became an error response (or a
        stream's error chunk), logged where the server was asked to."""
        if self.config.log_error_stack:
            where = f" to {request.method} {request.url.path}" if request is not None else " in a stream"
            logger.error("error response %d%s: %s", status, where, exc, exc_info=exc)

    def _stream_error(self, err: Exception) -> str:
        """The SSE chunk that ends a stream an engine error broke (its stack logged under log_error_stack)."""
        status = _ENGINE_ERROR_STATUS[type(err)]
        self.log_error_stack(status, err)
        return _sse_error(err, status)

    # -- shared request plumbing --------------------------------------------------------------

    @property
    def model_names(self) -> list[str]:
        """Every name a request's "model" may take: the served names, then the LoRA adapters'."""
        return [*self.served_model_names, *self.lora_requests]

    def _check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's "model" names (None: the base model); vLLM's 404 for unknown names."""
        if model is None or model in self.served_model_names:
            return None
        lora = self.lora_requests.get(model)
        if lora is None:
            served = ", ".join(f"'{name}'" for name in self.model_names)
            raise APIError(404, f"The model `{model}` does not exist. This server serves {served}.",
                           _NOT_FOUND_ERROR, param="model", code="model_not_found")
        return lora

    def _reported_model(self, lora: LoRARequest | None) -> str:
        """The "model" of a response: the adapter's name where one ran (as vLLM), else the served name."""
        return lora.lora_name if lora is not None else self.model_name

    # -- LoRA adapters: /v1/models, /v1/load_lora_adapter, /v1/unload_lora_adapter --------------

    def models(self) -> ModelList:
        base = [ModelCard(id=name, root=self.model_root, max_model_len=self.max_model_len)
                for name in self.served_model_names]
        adapters = [ModelCard(id=lora.lora_name, root=lora.lora_path,
                              parent=lora.base_model_name or self.model_name)
                    for lora in self.lora_requests.values()]
        return ModelList(data=base + adapters)

    def _new_lora(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """A request for a new adapter served under ``name``, with an id of its own."""
        if name in self.lora_requests:  # vLLM's words
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        if name in self.served_model_names:
            raise ValueError(f"the LoRA adapter name '{name}' is already a served model name")
        parent = base_model_name if base_model_name in self.served_model_names else None
        return LoRARequest(name, next(self._lora_ids), path, parent)

    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest) -> Response:
        try:
            lora = self._new_lora(body.lora_name, body.lora_path)
        except ValueError as err:
            raise APIError(400, str(err), param="lora_name") from err
        try:
            # Read and checked where the engine runs.
            await self.engine.call(functools.partial(_check_lora_adapter, lora=lora))
        except (ValueError, TypeError) as err:
            raise APIError(400, str(err), param="lora_path") from err
        name = lora.lora_name
        if name in self.lora_requests:  # another load of that name finished meanwhile
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        self.lora_requests[name] = lora
        self.app.openapi_schema = None  # its model names changed
        logger.info("loaded LoRA adapter '%s' from %s", name, lora.lora_path)
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    def unload_lora_adapter(self, body: UnloadLoRAAdapterRequest) -> Response:
        """Stop serving an adapter; requests already running with it finish with it."""
        if self.lora_requests.pop(body.lora_name, None) is None:  # vLLM's words
            raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", _NOT_FOUND_ERROR,
                           param="lora_name")
        self.app.openapi_schema = None
        message = f"Success: LoRA adapter '{body.lora_name}' removed successfully."
        return Response(message, media_type="text/plain")

    def _chat_prompt_text(self, body: ChatTemplateRequest, messages: Sequence[ChatMessage]) -> str:
        """_chat_prompt's text, for the requests that take no images (a 400 where the messages have one)."""
        text, images = self._chat_prompt(body, messages)
        if images:
            raise APIError(400, "this request cannot take images: beam search and the pooling endpoints take "
                                "text (images go to /v1/chat/completions without use_beam_search)",
                           param="messages")
        return text

    def _chat_prompt(self, body: ChatTemplateRequest, messages: Sequence[ChatMessage]) -> tuple[str, list]:
        """A conversation as text under the chat template: the request's own (where trusted), else
        --chat-template's, else the model's; with the request's tools, template variables,
        add_generation_prompt and continue_final_message (/tokenize renders exactly what chat completions
        run). With it, the messages' images in order (an image model's; a 400 for any other's)."""
        template = self.config.chat_template_text
        template = body.chat_template if body.chat_template is not None else template
        if self._brings_template(body) and not self.config.trust_request_chat_template:
            raise APIError(400, "a chat template was passed with the request, but the server was not "
                                "started with --trust-request-chat-template", param="chat_template")
        conversation = [m.as_template_message(keep_parts=True) for m in messages]
        try:  # without any template (no tokenizer), render_chat refuses the chat below
            conversation, images = prepare_chat(conversation, template or self._chat_template(),
                                                self.image_text, self.model_name,
                                                self.config.chat_template_content_format)
            images = [self._local_image(image) for image in images]
        except ValueError as err:
            raise APIError(400, str(err), param="messages") from err
        try:
            return render_chat(self.tokenizer, conversation,
                               add_generation_prompt=body.add_generation_prompt,
                               kwargs=self._template_kwargs(body), chat_template=template,
                               continue_final_message=body.continue_final_message,
                               tools=body.template_tools(self.config.exclude_tools_when_tool_choice_none)
                               ), images
        except (ValueError, TypeError, RecursionError, jinja2.TemplateError) as err:
            # RecursionError: a message's tool call arguments nested too deep for the template's tojson
            raise APIError(400, f"could not apply the chat template: {err}", param="messages") from err

    def _chat_template(self) -> str | None:
        """The template chats render with unless a request brings its own: --chat-template's, else the
        tokenizer's (None without either)."""
        return self.config.chat_template_text or getattr(self.tokenizer, "chat_template", None)

    def _local_image(self, image: Any) -> Any:
        """A file URL's image read from the folder --allowed-local-media-path allows; any other as it is."""
        folder = self.config.allowed_local_media_path
        if folder is not None and isinstance(image, str) and image.startswith(FILE_URL_PREFIX):
            return local_image_bytes(image, folder)
        return image

    def _template_kwargs(self, body: ChatTemplateRequest) -> dict[str, Any]:
        """The chat template's variables: --default-chat-template-kwargs, the request's over them (its
        documents, reasoning_effort and chat_template_kwargs)."""
        return {**(self.config.default_chat_template_kwargs or {}), **body.template_variables()}

    @staticmethod
    def _brings_template(body: ChatTemplateRequest) -> bool:
        kwargs = body.chat_template_kwargs or {}
        return body.chat_template is not None or kwargs.get("chat_template") is not None

    def _params(self, body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
                logprobs: int | None, num_prompts: int) -> SamplingParams:
        """The request's SamplingParams; ``max_tokens`` is its own (None: not set), which the model's
        generation_config.json may default or cap, as its other sampling fields may default."""
        defaults = self.generation_defaults
        try:
            body.check_supported()
            params = body.sampling_params(defaults.max_tokens(max_tokens), logprobs, defaults.sampling)
        except (ValueError, TypeError) as err:
            raise bad_request(err, structured_param=body.structured_outputs_param) from err
        if params.truncate_prompt_tokens is not None:
            keep = self._tokens_to_keep(params.truncate_prompt_tokens, max_tokens, body.max_tokens_param)
            params = dataclasses.replace(params, truncate_prompt_tokens=keep)
        if num_prompts * params.n > MAX_SEQUENCES_PER_REQUEST:
            raise APIError(400, f"{num_prompts} prompt(s) x n={params.n} is more than the "
                                f"{MAX_SEQUENCES_PER_REQUEST} sequences one request may ask for", param="n")
        return params

    def _tokens_to_keep(self, k: int, max_tokens: int | None, max_tokens_param: str) -> int:
        """truncate_prompt_tokens checked as vLLM's server checks it, against the context less the request's
        own max_tokens (a default from generation_config.json is cut to the room left instead); -1 resolved
        to that, or to one token less than the context where max_tokens is not set, so one can be made."""
        limit = self.max_model_len - (max_tokens or 0)
        if limit < 1:  # max_tokens alone fills the context: _check_fits says so, in vLLM's words
            return k if k != TRUNCATE_TO_CONTEXT else 1
        if k == TRUNCATE_TO_CONTEXT:
            return min(limit, self.max_model_len - 1)
        if k > limit:  # vLLM's words
            raise APIError(400, f"truncate_prompt_tokens={k} cannot be greater than max_model_len - "
                                f"{max_tokens_param} = {limit}. Please request a smaller truncation size.",
                           param="truncate_prompt_tokens")
        return k

    @staticmethod
    def _check_fits(request: EngineRequest, engine: LLMEngine, max_tokens: int | None) -> None:
        """Runs on the loop thread: refuse prompt + the request's own max_tokens beyond the context, as vLLM
        does (a default from generation_config.json is cut to the room left instead, by the engine)."""
        num_prompt = request.num_prompt_tokens
        if max_tokens is not None and num_prompt + max_tokens > engine.max_model_len:
            raise ProtocolError(
                f"{CONTEXT_LENGTH_MESSAGE_START} {engine.max_model_len} tokens. However, you requested "
                f"{num_prompt + max_tokens} tokens ({num_prompt} in the messages, {max_tokens} in the "
                f"completion). Please reduce the length of the messages or completion.",
                param="max_tokens", code=CONTEXT_LENGTH_EXCEEDED)

    async def _start(self, children: list[tuple[PromptInput, SamplingParams | PoolingParams]],
                     prompt_param: str, max_tokens: int | None, structured_param: str,
                     lora: LoRARequest | None = None, admission: Admission = DEFAULT_ADMISSION,
                     log_id: str | None = None) -> RequestStream:
        """Queue the children, with ``lora``'s adapter where given, as ``admission`` says (priority, cache
        salt); ``log_id``: the response's id, which --enable-log-requests lines name them by (else the
        engine's ids); ``max_tokens`` is the
        request's own, checked against the context. A bad grammar (its schema, regex or grammar) is found
        here, where the engine compiles it."""
        if self.engine.is_sleeping:  # as vLLM: its weights are not there to run it
            raise APIError(503, "the model is sleeping: POST /wake_up first", error_type(503))
        validate = functools.partial(self._check_fits, max_tokens=max_tokens)
        try:
            stream = await self.engine.add(children, validate=validate,
                                           timeout_s=self.config.request_timeout_s, lora_request=lora,
                                           priority=admission.priority, cache_salt=admission.cache_salt)
        except (ValueError, TypeError) as err:
            raise bad_request(err, prompt_param, structured_param) from err
        if self.config.enable_log_requests:
            self._log_requests(stream, children, lora, admission.priority, log_id)
        if self.config.enable_log_outputs and log_id is not None:
            stream.on_finished = functools.partial(self._log_output, log_id)
        return stream

    def _log_output(self, log_id: str, index: int, out: RequestOutput) -> None:
        """vLLM's --enable-log-outputs line for a finished engine request, streamed or not."""
        cut = self.config.max_log_len
        completion = out.outputs[0]
        logger.info("Generated response %s-%d: output: %r, output_token_ids: %s, finish_reason: %s", log_id,
                    index, completion.text[:cut], list(completion.token_ids)[:cut], completion.finish_reason)

    def _log_requests(self, stream: RequestStream, children: list[tuple[PromptInput, Any]],
                      lora: LoRARequest | None, priority: int, log_id: str | None) -> None:
        """vLLM's --enable-log-requests line for each engine request, cut to max_log_len; named as vLLM's,
        ``<response id>-<index>`` (so an X-Request-Id finds its lines), where the response's id is known."""
        cut = self.config.max_log_len
        names = ([f"{log_id}-{k}" for k in range(len(children))] if log_id is not None
                 else stream.request_ids)
        for rid, ids, (prompt, params) in zip(names, stream.prompt_token_ids, children):
            text = prompt[:cut] if isinstance(prompt, str) else None  # a chat's is rendered in the engine
            logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s, "
                        "lora_request: %s, priority: %d", rid, text, params, ids[:cut],
                        lora.lora_name if lora is not None else None, priority)

    def _streamed_response(self, events: AsyncIterator[str], stream: RequestStream, tracker: RequestTracker
                           ) -> _EngineStreamResponse:
        """The SSE response of a stream that sends what each output read adds (completions', chat's and the
        Responses API's): outputs that pile up behind its reader merge, and after a child's first tokens
        they wait for --stream-interval new ones (RequestStream.read_as_chunks), so every such stream
        chunks alike. Call it before ``events`` starts reading ``stream``."""
        stream.read_as_chunks(self.config.stream_interval)
        return _EngineStreamResponse(events, stream, tracker)

    async def _collect(self, stream: RequestStream, tracker: RequestTracker) -> list[RequestOutput]:
        """Run a non-streamed request to its end; the final output of every child, in order."""
        finals: list[RequestOutput | None] = [None] * len(stream.request_ids)
        error = False
        try:
            async with stream:
                async for index, out in stream:
                    tracker.observe(index, out)
                    if out.finished:
                        finals[index] = out
        except _ENGINE_ERRORS as err:
            error = not isinstance(err, RequestTimeoutError)  # a timeout is an abort, not a failure
            raise
        finally:
            tracker.close(error)
        return [f for f in finals if f is not None]

    async def _unless_disconnected(self, raw: Request, work: Awaitable[T]) -> T | None:
        """Await ``work``, cancelling it (and so aborting its requests) if the client leaves first."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done() and watcher.exception() is not None:
                await asyncio.wait({task})  # the watcher broke, not the connection: just finish
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        return task.result() if not task.cancelled() else None

    def _usage(self, stream: RequestStream, n: int, completion_tokens: int) -> UsageInfo:
        # Each prompt is counted once however many choices it has (as OpenAI and vLLM do); its cached tokens
        # are its first choice's (the others find that one's blocks too).
        prompt_tokens = sum(len(ids) for ids in stream.prompt_token_ids[::n])
        details = (PromptTokensDetails(cached_tokens=sum(stream.num_cached_tokens[::n]))
                   if self.config.enable_prompt_tokens_details else None)
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details)

    def _token_str(self, token_id: int) -> str:
        text = self._token_strings.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer else ""
            self._token_strings[token_id] = text  # bounded by the vocabulary
        return text

    def _logprob_token(self, token_id: int, as_ids: bool) -> str:
        """A token as logprobs name it: its text, or under return_tokens_as_token_ids "token_id:<id>"."""
        return f"{TOKEN_ID_PREFIX}{token_id}" if as_ids else self._token_str(token_id)

    def _tokens_as_ids(self, body: CompletionRequest | ChatCompletionRequest) -> bool:
        """Whether logprobs name tokens by id: always without a tokenizer (no text to name them by, and
        distinct tokens must stay distinct keys of top_logprobs), else the request's
        return_tokens_as_token_ids, else the server's."""
        if self.tokenizer is None:
            return True
        asked = body.return_tokens_as_token_ids
        return asked if asked is not None else self.config.return_tokens_as_token_ids

    # -- beam search (use_beam_search on both endpoints) ----------------------------------------

    def _beam_params(self, body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None
                     ) -> BeamSearchParams:
        """The request's BeamSearchParams; its max_tokens defaulted and capped as a sampled request's, and
        where none is set, the search runs to the end of the context."""
        try:
            check_logprobs_mode(self.logprobs_mode)
            body.check_supported()
            limit = self.generation_defaults.max_tokens(max_tokens)
            return body.beam_search_params(limit if limit is not None else self.max_model_len)
        except (ValueError, TypeError) as err:
            raise bad_request(err) from err

    async def _start_beam_search(self, prompts: Sequence[PromptInput], params: BeamSearchParams,
                                 prompt_param: str, max_tokens: int | None, lora: LoRARequest | None,
                                 admission: Admission) -> RequestStream:
        """The first step of each prompt's search: the prompts themselves, so the engine validates and
        tokenizes them (a 400 here, before any answer starts)."""
        step = step_params(params)
        return await self._start([(prompt, step) for prompt in prompts], prompt_param, max_tokens,
                                 "structured_outputs", lora, admission)

    async def _finish_beam_search(self, stream: RequestStream, tracker: RequestTracker,
                                  params: BeamSearchParams, skip_special_tokens: bool,
                                  lora: LoRARequest | None, admission: Admission) -> list[RequestOutput]:
        """Run the searches the first step started, as vLLM's server runs them: every step, each live beam of
        every prompt is a 1-token request. One output per prompt, its choices the beams, best first."""
        prompt_ids = stream.prompt_token_ids
        searches = [BeamSearch(ids, params, self.eos_token_ids, self.max_model_len) for ids in prompt_ids]
        pending: list[list[list[int]]] = [[ids] for ids in prompt_ids]
        step = step_params(params)
        while True:
            advance_all(searches, pending, await self._collect(stream, tracker))
            pending = pending_beams(searches)
            if not any(pending):
                break
            stream = await self._start([(beam, step) for beams in pending for beam in beams], "prompt", None,
                                       "structured_outputs", lora, admission)
            tracker = RequestTracker(self.metrics, time.monotonic(), stream)

        def decode(ids: list[int]) -> str:
            tokenizer = self.tokenizer
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) if tokenizer else ""

        return [RequestOutput(f"beam-{i}", None, list(ids), served_outputs(search, decode), True)
                for i, (ids, search) in enumerate(zip(prompt_ids, searches))]

    @staticmethod
    def _beam_usage(results: Sequence[RequestOutput]) -> UsageInfo:
        # As vLLM: each prompt once, and every returned beam's tokens.
        prompt_tokens = sum(len(out.prompt_token_ids) for out in results)
        completion_tokens = sum(len(c.token_ids) for out in results for c in out.outputs)
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens)

    async def _beam_search_completion(self, body: CompletionRequest, raw: Request, arrival: float,
                                      lora: LoRARequest | None) -> Response:
        params = self._beam_params(body, body.requested_max_tokens)
        prompts = _completion_prompts(body)
        if len(prompts) * params.beam_width > MAX_SEQUENCES_PER_REQUEST:  # the beams of one step
            raise APIError(400, f"{len(prompts)} prompt(s) x n={params.beam_width} is more than the "
                                f"{MAX_SEQUENCES_PER_REQUEST} sequences one request may ask for", param="n")
        stream = await self._start_beam_search(prompts, params, "prompt", body.requested_max_tokens, lora,
                                                body.admission)
        tracker = RequestTracker(self.metrics, arrival, stream)
        results = await self._beam_results(raw, stream, tracker, params, body.skip_special_tokens, lora,
                                           body.admission)
        if results is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        ids = body.return_token_ids
        choices = [CompletionResponseChoice(index=i * params.beam_width + c.index, text=c.text,
                                            finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                            prompt_token_ids=list(out.prompt_token_ids) if ids else None,
                                            token_ids=list(c.token_ids) if ids else None)
                   for i, out in enumerate(results) for c in out.outputs]
        result = CompletionResponse(id=new_response_id("cmpl", body.request_id),
                                    model=self._reported_model(lora), choices=choices,
                                    usage=self._beam_usage(results))
        return Response(result.model_dump_json(), media_type="application/json")

    async def _beam_results(self, raw: Request, stream: RequestStream, tracker: RequestTracker,
                            params: BeamSearchParams, skip_special_tokens: bool, lora: LoRARequest | None,
                            admission: Admission) -> list[RequestOutput] | None:
        """A non-streamed search's results (None: the client left), its last step aborted either way."""
        try:
            work = self._finish_beam_search(stream, tracker, params, skip_special_tokens, lora, admission)
            return await self._unless_disconnected(raw, work)
        finally:
            stream.abort()

    async def _beam_search_chat(self, body: ChatCompletionRequest, raw: Request, arrival: float,
                                lora: LoRARequest | None) -> Response:
        params = self._beam_params(body, body.requested_max_tokens)
        self._check_auto_tool_choice(body)
        prompt_text = self._chat_prompt_text(body, body.messages)
        readers = [self._choice_reader(body, prompt_text) for _ in range(params.beam_width)]
        prompt = encode_rendered(self.tokenizer, prompt_text)
        stream = await self._start_beam_search([prompt], params, "messages", body.requested_max_tokens, lora,
                                                body.admission)
        tracker = RequestTracker(self.metrics, arrival, stream)
        response_id = new_response_id("chatcmpl", body.request_id)
        if body.stream:  # each beam whole at the end: nothing to chunk, so no _streamed_response
            events = self._beam_chat_events(body, stream, tracker, params, response_id, readers, lora)
            return _EngineStreamResponse(events, stream, tracker)
        results = await self._beam_results(raw, stream, tracker, params, body.skip_special_tokens, lora,
                                           body.admission)
        if results is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        (out,) = results
        choices = [self._chat_choice(body, c.index, dataclasses.replace(out, outputs=[c]), readers[c.index])
                   for c in out.outputs]
        result = ChatCompletionResponse(id=response_id, model=self._reported_model(lora), choices=choices,
                                        usage=self._beam_usage(results),
                                        prompt_token_ids=list(out.prompt_token_ids) if body.return_token_ids
                                        else None)
        return Response(result.model_dump_json(), media_type="application/json")

    async def _beam_chat_events(self, body: ChatCompletionRequest, stream: RequestStream,
                                tracker: RequestTracker, params: BeamSearchParams, response_id: str,
                                readers: Sequence[_ChoiceReader], lora: LoRARequest | None
                                ) -> AsyncIterator[str]:
        """A streamed beam search, as vLLM's chat streams it: each choice's role at once, then, when the
        search is over, each beam whole in one chunk with its finish_reason."""
        created = int(time.time())

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None,
                  prompt_token_ids: list[int] | None = None) -> str:
            return _sse(ChatCompletionStreamResponse(id=response_id, created=created, model=model,
                                                     choices=choices, usage=usage,
                                                     prompt_token_ids=prompt_token_ids))

        model = self._reported_model(lora)
        ids = body.return_token_ids
        role = DeltaMessage(role=body.answer_role(self.config.response_role), content="")
        for index in range(len(readers)):
            prompt_ids = list(stream.prompt_token_ids[0]) if ids and index == 0 else None
            yield chunk([ChatStreamChoice(index=index, delta=role)], prompt_token_ids=prompt_ids)
        try:
            (out,) = await self._finish_beam_search(stream, tracker, params, body.skip_special_tokens, lora,
                                                      body.admission)
        except _ENGINE_ERRORS as err:
            yield self._stream_error(err)
            yield SSE_DONE
            return
        for completion in out.outputs:
            delta, finish_reason = _chat_delta(completion, readers[completion.index])
            yield chunk([ChatStreamChoice(index=completion.index, delta=delta or DeltaMessage(),
                                          finish_reason=finish_reason, stop_reason=completion.stop_reason,
                                          token_ids=list(completion.token_ids) if ids else None)])
        if body.include_usage(self.config.enable_force_include_usage):
            yield chunk([], self._beam_usage([out]))
        yield SSE_DONE

    # -- /tokenize, /detokenize ---------------------------------------------------------------

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        self._check_model(body.model)
        try:
            body.check_supported()
        except ProtocolError as err:
            raise bad_request(err) from err
        tokenizer = self._require_tokenizer("messages" if body.messages is not None else "prompt")
        if body.messages is not None:
            text, images = self._chat_prompt(body, body.messages)
            tokens = encode_rendered(tokenizer, text)
            if images:  # the ids chat completions run: each image's placeholders (its pixels are not read)
                try:
                    spans = await asyncio.to_thread(self.image_processor.placeholder_ids, images)
                    tokens, _ = self.image_processor.expand_placeholders(tokens, spans)
                except ValueError as err:
                    raise APIError(400, str(err), param="messages") from err
        else:
            assert body.prompt is not None  # check_supported: one of the two
            add_special_tokens = body.add_special_tokens is not False  # a prompt's default: true
            tokens = list(tokenizer.encode(body.prompt, add_special_tokens=add_special_tokens))
        strs = list(tokenizer.convert_ids_to_tokens(tokens)) if body.return_token_strs else None
        return TokenizeResponse(count=len(tokens), max_model_len=self.max_model_len, tokens=tokens,
                                token_strs=strs)

    def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self._check_model(body.model)
        tokenizer = self._require_tokenizer("tokens")
        bad = next((t for t in body.tokens if t >= self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is out of range for a vocabulary of {self.vocab_size}",
                           param="tokens")
        return DetokenizeResponse(prompt=tokenizer.decode(body.tokens))

    def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's /tokenizer_info: the tokenizer's configuration as its tokenizer_config.json holds it
        (without file paths), its class, and the chat template the server renders with."""
        tokenizer = self._require_tokenizer("tokenizer")
        settings = getattr(tokenizer, "init_kwargs", {})
        config = {k: v for k, v in settings.items() if k not in _TOKENIZER_FILE_KEYS}
        info: dict[str, Any] = _json_safe(config)
        info["tokenizer_class"] = type(tokenizer).__name__
        template = self._chat_template()
        if template:
            info["chat_template"] = template
        return info

    def _require_tokenizer(self, param: str) -> Any:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", param=param)
        return self.tokenizer

    # -- pooling models: /v1/embeddings, /classify ------------------------------------------------

    @property
    def pooling(self) -> bool:
        return self.pooling_spec is not None

    async def invoke(self, raw: Request) -> Response:
        """vLLM's /invocations (SageMaker): the API a body's fields name answers it, as its own endpoint
        would: messages (chat; a pooling model's embeddings or classes), prompt (completions), input
        (embeddings or classes), query with documents (rerank), text_1 and text_2 (score)."""
        try:
            body = await raw.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object")
        model, handle = self._invocation_route(body)
        try:
            request = model.model_validate(body)
        except ValidationError as err:
            raise RequestValidationError(err.errors()) from err
        return await handle(request, raw)

    def _invocation_route(self, body: dict[str, Any]
                          ) -> tuple[type[BaseModel], Callable[..., Awaitable[Response]]]:
        if not self.pooling:
            if "messages" in body:
                return ChatCompletionRequest, self.create_chat_completion
            if "prompt" in body or "prompt_embeds" in body:
                return CompletionRequest, self.create_completion
            raise APIError(400, "an /invocations body for this model holds messages (chat completions) or "
                                "a prompt (completions)")
        if "query" in body and "documents" in body:
            return RerankRequest, self.create_rerank
        if any(name in body for name in SCORE_INPUT_FIELDS):
            return ScoreRequest, self.create_score
        if "input" in body or "messages" in body:
            if self.pooling_spec.task == "classify":
                return ClassificationRequest, self.create_classification
            return EmbeddingRequest, self.create_embedding
        raise APIError(400, "an /invocations body for this model holds input or messages (embeddings or "
                            "classes), query and documents (rerank), or text_1 and text_2 (score)")

    def check_generates(self, api: str) -> None:
        """vLLM's 400 for a text endpoint of a pooling model."""
        if self.pooling:
            raise APIError(400, f"The model does not support {api}: it is served as a pooling model")

    async def create_embedding(self, body: EmbeddingRequest, raw: Request) -> Response:
        """OpenAI's /v1/embeddings: each input's embedding, in input order ("float" lists, or "base64" of
        their little-endian float32 bytes, as the openai client asks by default)."""
        try:
            params = PoolingParams(dimensions=body.dimensions, normalize=body.normalize, task="embed")
        except ValueError as err:  # vLLM's 400 for dimensions below 1
            raise APIError(400, str(err), param="dimensions") from err
        pooled = await self._pool(body, params, raw, "Embeddings API")
        if isinstance(pooled, Response):
            return pooled
        finals, usage = pooled
        data = [EmbeddingData(index=i, embedding=_encode_embedding(out.outputs.data, body.encoding_format))
                for i, out in enumerate(finals)]
        return self._pooled_response(EmbeddingResponse, "embd", body, data, usage)

    async def create_classification(self, body: ClassificationRequest, raw: Request) -> Response:
        """vLLM's /classify: each input's class probabilities and most probable label, in input order."""
        pooled = await self._pool(body, PoolingParams(task="classify"), raw, "Classification API")
        if isinstance(pooled, Response):
            return pooled
        finals, usage = pooled
        labels = self.pooling_spec.labels
        data = []
        for i, out in enumerate(finals):
            probs = out.outputs.data.tolist()
            data.append(ClassificationData(index=i, label=labels[int(out.outputs.data.argmax())], probs=probs,
                                           num_classes=len(probs)))
        return self._pooled_response(ClassificationResponse, "classify", body, data, usage)

    async def create_pooling(self, body: PoolingRequest, raw: Request) -> Response:
        """vLLM's /pooling: each input's pooled output as the model's task makes it (an embedding, or a
        classifier's class probabilities), or as the body's ``task`` asks (token_embed, token_classify: one
        row per input token), in input order."""
        spec = self.pooling_spec
        api = "Pooling API"
        task = body.task or (spec.task if spec else "embed")
        pooled = await self._pool(body, PoolingParams(task=task), raw, api)
        if isinstance(pooled, Response):
            return pooled
        finals, usage = pooled
        data = [PoolingData(index=i, data=_encode_embedding(out.outputs.data, body.encoding_format))
                for i, out in enumerate(finals)]
        return self._pooled_response(PoolingResponse, "pool", body, data, usage)

    def _pooled_response(self, response_class: type, id_prefix: str, body: Any, data: list, usage: Any
                         ) -> Response:
        """A pooling endpoint's JSON answer: its data under a fresh id, named by the model (or adapter) that
        ran it."""
        result = response_class(id=new_response_id(id_prefix, body.request_id),
                                model=self._pooled_model(body),
                                data=data, usage=usage)
        return Response(result.model_dump_json(), media_type="application/json")

    async def create_score(self, body: ScoreRequest, raw: Request) -> Response:
        """vLLM's /score: each pair's score (one text_1 against every text_2, else in pairs), by
        ``_pair_scores``."""
        first, second = body.sides()
        scored = await self._pair_scores(body, first, second, raw, "Score API")
        if isinstance(scored, Response):
            return scored
        scores, usage = scored
        data = [ScoreData(index=k, score=score) for k, (_, _, score) in enumerate(scores)]
        result = ScoreResponse(id=new_response_id("score", body.request_id), model=self._pooled_model(body),
                               data=data, usage=usage)
        return Response(result.model_dump_json(), media_type="application/json")

    async def create_rerank(self, body: RerankRequest, raw: Request) -> Response:
        """The Jina / Cohere rerank API vLLM serves: the documents, best first, by their score against the
        query (``_pair_scores``); the best ``top_n`` (0: all)."""
        scored = await self._pair_scores(body, [body.query], body.documents, raw, "Rerank API")
        if isinstance(scored, Response):
            return scored
        scores, usage = scored
        ranked = sorted(scores, key=lambda pair: -pair[2])[: body.top_n or None]
        results = [RerankResult(index=j, document=RerankDocument(text=body.documents[j]),
                                relevance_score=score) for _, j, score in ranked]
        result = RerankResponse(id=new_response_id("rerank", body.request_id), model=self._pooled_model(body),
                                usage=RerankUsage(total_tokens=usage.total_tokens), results=results)
        return Response(result.model_dump_json(), media_type="application/json")

    async def _pair_scores(self, body: PoolingBody, first: list[str], second: list[str], raw: Request,
                           api: str) -> tuple[list[tuple[int, int, float]], UsageInfo] | Response:
        """Each pair's (first's index, second's index, score), paired as score_pairs pairs them, and the
        usage: with an embedding model the cosine similarity of their embeddings (both sides embedded in one
        batch); with a cross-encoder (a classifier of one label) its probability for the pair read as one
        prompt (cross_encoder_prompt, tokenized on the loop thread), as vLLM scores with either."""
        if not cross_encodes(self.pooling_spec):
            pooled = await self._pool(body, PoolingParams(task="embed"), raw, api)
            if isinstance(pooled, Response):
                return pooled
            finals, usage = pooled
            return pair_scores(finals, len(first), len(second)), usage
        try:
            pairs = score_pairs(len(first), len(second))
        except ValueError as err:
            raise APIError(400, str(err), param="text_2") from None
        prompts = [functools.partial(cross_encoder_prompt, first=first[i], second=second[j])
                   for i, j in pairs]
        pooled = await self._pool(body, PoolingParams(task="classify"), raw, api, prompts)
        if isinstance(pooled, Response):
            return pooled
        finals, usage = pooled
        return [(i, j, out.outputs.data[0].item()) for (i, j), out in zip(pairs, finals)], usage

    async def _pool(self, body: PoolingBody, params: PoolingParams, raw: Request, api: str,
                    prompts: list[PromptInput] | None = None
                    ) -> tuple[list[PoolingRequestOutput], UsageInfo] | Response:
        """Run each input of a pooling endpoint once: the outputs in input order and the usage (a Response
        where the client left first). ``params.task`` must be the model's (else vLLM's 400 naming ``api``).
        ``prompts`` replace the body's inputs (which are still checked)."""
        spec = self.pooling_spec
        if spec is None or spec.task != SEQUENCE_TASK_OF[params.task]:
            raise APIError(400, f"The model does not support {api}")
        lora = self._check_model(body.model)  # an adapter's name runs with that adapter
        arrival = time.monotonic()
        try:
            params = dataclasses.replace(params, truncate_prompt_tokens=body.truncate_prompt_tokens)
        except ValueError as err:  # 0, or below -1: vLLM's 400
            raise APIError(400, str(err), param="truncate_prompt_tokens") from err
        try:
            body.check_supported()
            inputs = self._pooling_prompts(body)
            prompts = inputs if prompts is None else prompts
            spec.check(params, self.model_name)  # named as this server serves the model
        except ValueError as err:
            param = err.param if isinstance(err, ProtocolError) else "dimensions"
            raise APIError(400, str(err), param=param) from err
        children: list[tuple[PromptInput, PoolingParams]] = [(p, params) for p in prompts]
        stream = await self._start(children, "input", None, "input", lora, body.admission)
        tracker = RequestTracker(self.metrics, arrival, stream)
        try:
            finals = await self._unless_disconnected(raw, self._collect(stream, tracker))
        finally:
            stream.abort()  # no-op unless something above failed
        if finals is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        prompt_tokens = sum(len(ids) for ids in stream.prompt_token_ids)
        return finals, UsageInfo(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)

    def _pooled_model(self, body: PoolingBody) -> str:
        """A pooling response's "model": the adapter's name where the body named one (as vLLM)."""
        return self._reported_model(self._check_model(body.model))

    def _pooling_prompts(self, body: PoolingBody) -> list[PromptInput]:
        """The body's inputs as engine prompts; messages are one input, the conversation rendered under the
        chat template (which writes the special tokens) as chat completions render it."""
        if isinstance(body, PoolingInputRequest) and body.messages is not None:
            return [self._pooling_prompt(self._chat_prompt_text(body, body.messages), False)]
        return [self._pooling_prompt(p, body.add_special_tokens is not False) for p in body.inputs()]

    @staticmethod
    def _pooling_prompt(prompt: str | list[int], add_special_tokens: bool) -> PromptInput:
        """A text input without the tokenizer's special tokens is tokenized on the loop thread (the engine's
        tokenizer belongs to it); anything else goes to the engine as it is."""
        if add_special_tokens or not isinstance(prompt, str):
            return prompt
        return functools.partial(LLMEngine.encode_text, text=prompt, add_special_tokens=False)

    # -- /v1/completions ----------------------------------------------------------------------

    async def create_completion(self, body: CompletionRequest, raw: Request) -> Response:
        self.check_generates("Completions API")
        lora = self._check_model(body.model)
        arrival = time.monotonic()
        if body.use_beam_search:
            return await self._beam_search_completion(body, raw, arrival, lora)
        prompts = _completion_prompts(body)
        params = _answer_kind(self._params(body, body.requested_max_tokens, body.logprobs, len(prompts)),
                              body.stream, self.config.enable_log_outputs)
        children: list[tuple[PromptInput, SamplingParams]] = [
            (p, child) for p in prompts for child in _fan_out(params)]
        response_id = new_response_id("cmpl", body.request_id)
        stream = await self._start(children, "prompt", body.requested_max_tokens,
                                   body.structured_outputs_param, lora, body.admission, response_id)
        tracker = RequestTracker(self.metrics, arrival, stream, params)
        try:
            if body.stream:
                events = self._completion_events(body, stream, tracker, response_id, params.n,
                                                 self._reported_model(lora))
                return self._streamed_response(events, stream, tracker)
            finals = await self._unless_disconnected(raw, self._collect(stream, tracker))
        finally:
            if not body.stream:
                stream.abort()  # no-op unless something above failed
        if finals is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        choices, completion_tokens = [], 0
        for index, out in enumerate(finals):
            completion = _prompt_only(out.outputs[0]) if body.echo_only else out.outputs[0]
            completion_tokens += len(completion.token_ids)
            text = self._prompt_text(out) + completion.text if body.echo else completion.text
            logprobs = None
            if body.logprobs is not None and completion.logprobs is not None:
                rows = _generated_rows(completion.logprobs)
                logprobs, _ = self._completion_logprobs(_prompt_rows(out) + rows if body.echo else rows,
                                                        body.logprobs, 0, self._tokens_as_ids(body))
            ids = body.return_token_ids
            choices.append(CompletionResponseChoice(
                index=index, text=text, logprobs=logprobs, finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
                prompt_logprobs=self._prompt_logprobs(out, body.prompt_logprobs),
                prompt_token_ids=list(out.prompt_token_ids) if ids else None,
                token_ids=list(completion.token_ids) if ids else None))
        usage = self._usage(stream, params.n, completion_tokens)
        result = CompletionResponse(id=response_id, model=self._reported_model(lora), choices=choices,
                                    usage=usage)
        return Response(result.model_dump_json(), media_type="application/json")

    async def _completion_events(self, body: CompletionRequest, stream: RequestStream,
                                 tracker: RequestTracker, response_id: str, n: int, model: str
                                 ) -> AsyncIterator[str]:
        created = int(time.time())
        offsets = [0] * len(stream.request_ids)  # text_offset of each choice's next token
        echoed = [not body.echo] * len(stream.request_ids)  # whether each choice's prompt went out
        ids = _TokenIdStream(len(stream.request_ids)) if body.return_token_ids else None
        as_ids = self._tokens_as_ids(body)
        completion_tokens = 0
        error = False

        def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
            return _sse(CompletionStreamResponse(id=response_id, created=created, model=model,
                                                 choices=choices, usage=usage))

        continuous = body.continuous_usage(self.config.enable_force_include_usage)

        def usage_so_far() -> UsageInfo | None:  # stream_options.continuous_usage_stats
            return self._usage(stream, n, completion_tokens) if continuous else None

        try:
            async with stream:
                async for index, out in stream:
                    tracker.observe(index, out)
                    completion = _prompt_only(out.outputs[0]) if body.echo_only else out.outputs[0]
                    completion_tokens += len(completion.delta_token_ids)
                    if ids is not None:
                        ids.add(index, completion.delta_token_ids)
                    # echo, as vLLM: the prompt (and its logprobs) goes out with the choice's first chunk.
                    echo_now, echoed[index] = not echoed[index], True
                    text = (self._prompt_text(out) if echo_now else "") + completion.delta_text
                    logprobs = None
                    if body.logprobs is not None and completion.logprobs is not None:
                        rows = _generated_rows(_new_logprobs(completion))
                        logprobs, offsets[index] = self._completion_logprobs(
                            _prompt_rows(out) + rows if echo_now else rows, body.logprobs, offsets[index],
                            as_ids)
                    held_back = not text and completion.finish_reason is None
                    # Without a tokenizer no text is ever made, so each token streams as an empty chunk
                    # (as vLLM does) rather than all of them arriving with the last one.
                    if held_back and logprobs is None and self.tokenizer is not None:
                        continue  # tokens held back mid-character or a stop string candidate
                    choice = CompletionChoice(index=index, text=text, logprobs=logprobs,
                                              finish_reason=completion.finish_reason,
                                              stop_reason=completion.stop_reason)
                    if ids is not None:
                        choice.prompt_token_ids, choice.token_ids = ids.take(index, out.prompt_token_ids)
                    yield chunk([choice], usage_so_far())
            if body.include_usage(self.config.enable_force_include_usage):
                yield chunk([], self._usage(stream, n, completion_tokens))
        except _ENGINE_ERRORS as err:
            error = not isinstance(err, RequestTimeoutError)
            yield self._stream_error(err)
        finally:
            tracker.close(error)
        yield SSE_DONE

    def _completion_logprobs(self, rows: Sequence[LogprobRow], num_top: int, offset: int, as_ids: bool
                             ) -> tuple[CompletionLogprobs, int]:
        """OpenAI's logprobs of these tokens, the first at text_offset ``offset``; and the next offset.
        ``as_ids``: tokens named "token_id:<id>" (return_tokens_as_token_ids)."""
        result = CompletionLogprobs()
        for token_id, entry in rows:
            token = self._logprob_token(token_id, as_ids)
            result.tokens.append(token)
            result.text_offset.append(offset)
            # Offsets index the text whatever names the tokens (vLLM's grow by the "token_id:<id>" names
            # unstreamed and by the text streamed; the text is the one thing both agree on).
            offset += len(self._token_str(token_id))
            if entry is None:  # the prompt's first token has no context: null and null, as in vLLM
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            top = {self._logprob_token(t, as_ids): _clamp(lp) for t, lp in list(entry.top.items())[:num_top]}
            top.setdefault(token, _clamp(entry.logprob))  # OpenAI always includes the sampled token
            result.token_logprobs.append(_clamp(entry.logprob))
            result.top_logprobs.append(top)
        return result, offset

    def _prompt_text(self, out: RequestOutput) -> str:
        """The prompt as echo shows it: its own text, or its token ids decoded (special tokens kept, as
        vLLM decodes them)."""
        if out.prompt is not None:
            return out.prompt
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)

    def _prompt_logprobs(self, out: RequestOutput, num_top: int | None) -> PromptLogprobs | None:
        """vLLM's prompt_logprobs of an output, where the request asked for them (``num_top``)."""
        if num_top is None or out.prompt_logprobs is None:
            return None
        result: PromptLogprobs = []
        for entry in out.prompt_logprobs:
            if entry is None:
                result.append(None)
                continue
            # As vLLM's: the prompt token with its rank in the whole vocabulary, then the top alternatives,
            # each ranked by its place (1-based, best first).
            top = list(entry.top.items())
            listed = {entry.token_id: self._prompt_logprob(entry.token_id, entry.logprob, entry.rank)}
            for place, (token_id, logprob) in enumerate(top[:num_top], 1):
                listed[token_id] = self._prompt_logprob(token_id, logprob, place)  # the prompt token: same
            result.append(listed)
        return result

    def _prompt_logprob(self, token_id: int, logprob: float, rank: int | None) -> PromptLogprob:
        return PromptLogprob(logprob=_clamp(logprob), rank=rank, decoded_token=self._token_str(token_id))

    # -- /v1/chat/completions -----------------------------------------------------------------

    async def create_chat_completion(self, body: ChatCompletionRequest, raw: Request) -> Response:
        self.check_generates("Chat Completions API")
        lora = self._check_model(body.model)
        arrival = time.monotonic()
        if body.use_beam_search:
            return await self._beam_search_chat(body, raw, arrival, lora)
        response_id = new_response_id("chatcmpl", body.request_id)
        params, readers, stream = await self._start_chat(body, lora, log_id=response_id, streamed=body.stream)
        tracker = RequestTracker(self.metrics, arrival, stream, params)
        try:
            if body.stream:
                events = self._chat_events(body, stream, tracker, response_id, params.n, readers,
                                           self._reported_model(lora))
                return self._streamed_response(events, stream, tracker)
            finals = await self._unless_disconnected(raw, self._collect(stream, tracker))
        finally:
            if not body.stream:
                stream.abort()
        if finals is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        choices = [self._chat_choice(body, index, out, readers[index]) for index, out in enumerate(finals)]
        usage = self._usage(stream, params.n, sum(len(o.outputs[0].token_ids) for o in finals))
        prompt_logprobs = self._prompt_logprobs(finals[0], body.prompt_logprobs) if finals else None
        prompt_ids = list(finals[0].prompt_token_ids) if finals and body.return_token_ids else None
        result = ChatCompletionResponse(id=response_id, model=self._reported_model(lora), choices=choices,
                                        usage=usage, prompt_logprobs=prompt_logprobs,
                                        prompt_token_ids=prompt_ids)
        return Response(result.model_dump_json(), media_type="application/json")

    async def _start_chat(self, body: ChatCompletionRequest, lora: LoRARequest | None,
                          prompt_param: str = "messages", log_id: str | None = None, streamed: bool = True
                          ) -> tuple[SamplingParams, list[_ChoiceReader], RequestStream]:
        """Queue a chat request (chat completions', or the Responses API's conversation as one): its
        SamplingParams, how each choice's output is read, and its engine stream (not ``streamed``: only each
        choice's final output, for a reader of nothing else)."""
        params = _answer_kind(self._params(body, body.requested_max_tokens, body.requested_logprobs, 1),
                              streamed, self.config.enable_log_outputs)
        self._check_auto_tool_choice(body)
        skip = self._skip_special_tokens(body, params.skip_special_tokens)
        if skip != params.skip_special_tokens:  # a parser whose markers are special tokens needs them kept
            params = dataclasses.replace(params, skip_special_tokens=skip)
        prompt_text, images = self._chat_prompt(body, body.messages)
        readers = [self._choice_reader(body, prompt_text) for _ in range(params.n)]  # each choice its own
        reasoning = readers[0].reasoning
        if reasoning is not None and reasoning.thinks:  # structured outputs apply after the reasoning
            params = dataclasses.replace(params, reasoning_end=reasoning.END)
        prompt = encode_rendered(self.tokenizer, prompt_text)
        if images:
            try:  # decoded and processed here, in a worker thread: never on the engine's step loop
                pixels = await asyncio.to_thread(self.image_processor.preprocess, images)
            except ValueError as err:
                raise APIError(400, str(err), param="messages") from err
            prompt = MultiModalPrompt(prompt, pixels)
        stream = await self._start([(prompt, child) for child in _fan_out(params)], prompt_param,
                                   body.requested_max_tokens, body.structured_outputs_param, lora,
                                   body.admission, log_id)
        return params, readers, stream

    def _chat_choice(self, body: ChatCompletionRequest, index: int, out: RequestOutput, reader: _ChoiceReader
                     ) -> ChatChoice:
        """A finished choice of a non-streamed chat completion."""
        completion = out.outputs[0]
        logprobs = None
        if self._shows_logprobs(body) and completion.logprobs is not None:
            num_top = body.top_logprobs or 0
            logprobs = self._chat_logprobs(completion.logprobs, num_top, self._tokens_as_ids(body))
        message, finish_reason = _chat_message(completion, reader)
        message.role = body.answer_role(self.config.response_role)
        if body.echo:  # as vLLM, whose content is then a string even with nothing to echo
            message.content = body.echo_text(self.config.response_role) + (message.content or "")
        return ChatChoice(index=index, message=message, logprobs=logprobs, finish_reason=finish_reason,
                          stop_reason=completion.stop_reason,
                          token_ids=list(completion.token_ids) if body.return_token_ids else None)

    async def _chat_events(self, body: ChatCompletionRequest, stream: RequestStream, tracker: RequestTracker,
                           response_id: str, n: int, readers: Sequence[_ChoiceReader], model: str
                           ) -> AsyncIterator[str]:
        created = int(time.time())
        num_top = body.top_logprobs or 0
        as_ids = self._tokens_as_ids(body)
        ids = _TokenIdStream(len(stream.request_ids)) if body.return_token_ids else None
        completion_tokens = 0
        error = False

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None,
                  prompt_token_ids: list[int] | None = None) -> str:
            return _sse(ChatCompletionStreamResponse(id=response_id, created=created, model=model,
                                                     choices=choices, usage=usage,
                                                     prompt_token_ids=prompt_token_ids))

        continuous = body.continuous_usage(self.config.enable_force_include_usage)

        def usage_so_far() -> UsageInfo | None:  # stream_options.continuous_usage_stats
            return self._usage(stream, n, completion_tokens) if continuous else None

        try:
            async with stream:
                role = DeltaMessage(role=body.answer_role(self.config.response_role), content="")
                for index in range(len(stream.request_ids)):
                    # return_token_ids, as vLLM: the prompt's ids (all choices share it) in the first chunk.
                    prompt_ids = list(stream.prompt_token_ids[0]) if ids is not None and index == 0 else None
                    yield chunk([ChatStreamChoice(index=index, delta=role)], usage_so_far(), prompt_ids)
                echo = DeltaMessage(content=body.echo_text(self.config.response_role))
                for index in range(len(stream.request_ids)) if echo.content else ():  # after every role's
                    yield chunk([ChatStreamChoice(index=index, delta=echo)], usage_so_far())
                async for index, out in stream:
                    tracker.observe(index, out)
                    completion = out.outputs[0]
                    completion_tokens += len(completion.delta_token_ids)
                    if ids is not None:
                        ids.add(index, completion.delta_token_ids)
                    logprobs = None
                    if self._shows_logprobs(body) and completion.logprobs is not None:
                        logprobs = self._chat_logprobs(_new_logprobs(completion), num_top, as_ids)
                    delta, finish_reason = _chat_delta(completion, readers[index])
                    if delta is None and finish_reason is None and logprobs is None:
                        continue  # nothing new, or text held back until it is known whether it is a call
                    delta = delta or DeltaMessage()
                    token_ids = ids.take(index)[1] if ids is not None else None
                    yield chunk([ChatStreamChoice(index=index, delta=delta, logprobs=logprobs,
                                                  finish_reason=finish_reason,
                                                  stop_reason=completion.stop_reason, token_ids=token_ids)],
                                usage_so_far())
            if body.include_usage(self.config.enable_force_include_usage):
                yield chunk([], self._usage(stream, n, completion_tokens))
        except _ENGINE_ERRORS as err:
            error = not isinstance(err, RequestTimeoutError)
            yield self._stream_error(err)
        finally:
            tracker.close(error)
        yield SSE_DONE

    def _skip_special_tokens(self, body: ChatCompletionRequest, requested: bool) -> bool:
        """Whether the output's text leaves special tokens out: as requested, unless the server's tool call
        parser (with tools in play) or reasoning parser reads markers that are special tokens (Mistral's
        [TOOL_CALLS], [THINK]), as vLLM's adjust_request turns it off."""
        if self.config.tool_call_parser is not None:
            in_play = bool(body.tools) and body.effective_tool_choice != "none"
            requested = get_tool_parser(self.config.tool_call_parser).skip_special_tokens(requested, in_play)
        if self.reasoning_parser is not None:
            requested = self.reasoning_parser.skip_special_tokens(requested)
        return requested

    def _check_auto_tool_choice(self, body: ChatCompletionRequest) -> None:
        if body.effective_tool_choice == "auto" and body.tools and not self.config.enable_auto_tool_choice:
            raise APIError(400, AUTO_TOOL_CHOICE_MESSAGE, param="tool_choice")

    def _choice_reader(self, body: ChatCompletionRequest, prompt_text: str) -> _ChoiceReader:
        """How one choice's output is read: reasoning (where the server has a reasoning parser; the
        template's variables and the prompt say whether there is any), then tool calls."""
        reasoning = None
        if self.reasoning_parser is not None:
            reasoning = self.reasoning_parser(self._template_kwargs(body), prompt_text)
        return _ChoiceReader(self._tool_call_stream(body), reasoning, body.include_reasoning)

    def _shows_logprobs(self, body: ChatCompletionRequest) -> bool:
        """Whether the answer carries logprobs: as vLLM, not where it leaves the reasoning out, which their
        tokens would show."""
        return body.logprobs and (self.reasoning_parser is None or body.include_reasoning)

    def _tool_call_stream(self, body: ChatCompletionRequest) -> ToolCallStream | None:
        """How one choice's output is read as tool calls (None: it is all content): the whole of it as
        the named function's arguments, "required"'s array of calls, or under "auto" the model's own
        format, by the server's tool call parser."""
        choice = body.effective_tool_choice
        if body.named_tool is not None:
            parser: ToolOutputParser = NamedToolOutput(body.named_tool)
        elif choice == "required":
            parser = RequiredToolsOutput()
        elif choice == "auto" and body.tools and self.config.tool_call_parser is not None:
            # The tools' parameter schemas: qwen3_coder types each argument's text by them.
            functions = {tool.function.name: tool.function.parameters for tool in body.tools}
            parser = get_tool_parser(self.config.tool_call_parser)(functions)
        else:
            return None
        return ToolCallStream(parser, body.max_tool_calls)

    def _chat_logprobs(self, entries: Sequence[TokenLogprobs], num_top: int, as_ids: bool) -> ChatLogprobs:
        """OpenAI's logprobs of these tokens; ``as_ids``: named "token_id:<id>" (return_tokens_as_token_ids).
        As vLLM gives them, a chosen token's bytes are its text's however it is named, and an alternative's
        are those of its name."""
        content = []
        for entry in entries:
            top = []
            for top_id, top_lp in list(entry.top.items())[:num_top]:
                top_token = self._logprob_token(top_id, as_ids)
                top.append(ChatTokenLogprob(token=top_token, logprob=_clamp(top_lp),
                                            bytes=list(top_token.encode())))
            content.append(ChatLogprobEntry(token=self._logprob_token(entry.token_id, as_ids),
                                            logprob=_clamp(entry.logprob),
                                            bytes=list(self._token_str(entry.token_id).encode()),
                                            top_logprobs=top))
        return ChatLogprobs(content=content)


# -- running it ---------------------------------------------------------------------------------


def _json_safe(value: Any) -> Any:
    """A tokenizer setting as JSON: special tokens (AddedToken) as their text, other objects as strings."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    content = getattr(value, "content", None)
    return content if isinstance(content, str) else str(value)


def base_url(sock: socket.socket, https: bool = False) -> str:
    """http(s)://host:port of a bound socket, with a wildcard address shown as loopback; for a Unix domain
    socket, the URL a client asks for through it (its host is any name: nothing resolves it)."""
    if sock.family == getattr(socket, "AF_UNIX", None):
        return f"{'https' if https else 'http'}://{UNIX_SOCKET_HOST}"
    host, port = sock.getsockname()[:2]
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1" if host == "0.0.0.0" else "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"{'https' if https else 'http'}://{host}:{port}"


def _cert_reqs(c: ServerConfig) -> int:
    if c.ssl_cert_reqs is not None:
        return c.ssl_cert_reqs
    return ssl.CERT_REQUIRED if c.ssl_ca_certs else ssl.CERT_NONE


def uvicorn_server(app: ASGIApp, c: ServerConfig) -> uvicorn.Server:
    """uvicorn serving ``app`` as ``c`` says (log levels and configuration, access log, root path, TLS, the
    h11 protocol's bound on a request's head and the header count); the data-parallel front runs on it
    too."""
    logging_config = {} if c.log_config_file is None else {"log_config": c.log_config_file}
    if c.h11_max_header_count is not None:
        app = HeaderCountMiddleware(app, c.h11_max_header_count)
    protocol: dict[str, Any] = {}
    if c.h11_max_incomplete_event_size is not None:
        # Only uvicorn's h11 protocol bounds it; "auto" would run httptools where it is installed.
        protocol = {"http": "h11", "h11_max_incomplete_event_size": c.h11_max_incomplete_event_size}
    config = uvicorn.Config(app, uds=c.uds, log_level=c.uvicorn_log_level or c.log_level, **logging_config,
                            **protocol,
                            access_log=not c.disable_uvicorn_access_log, root_path=c.root_path,
                            ssl_keyfile=c.ssl_keyfile, ssl_certfile=c.ssl_certfile,
                            ssl_ca_certs=c.ssl_ca_certs, ssl_cert_reqs=_cert_reqs(c),
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    server = uvicorn.Server(config)
    if c.enable_ssl_refresh:
        SslRefresher(server, c).start()
    return server


# How often --enable-ssl-refresh looks at the HTTPS files' modification times.
SSL_REFRESH_POLL_S = 1.0


class SslRefresher(threading.Thread):
    """vLLM's --enable-ssl-refresh: reloads the key and certificate (and the CA certificates) into the
    server's SSL context when their files change, so new connections get them; stops with the server. A
    half-written pair (the key changed, the certificate not yet) fails to load and is tried again at the next
    change, the old pair serving meanwhile."""

    def __init__(self, server: uvicorn.Server, c: ServerConfig) -> None:
        super().__init__(name="plait-ssl-refresh", daemon=True)
        self.server, self.c = server, c
        self.files = [f for f in (c.ssl_keyfile, c.ssl_certfile, c.ssl_ca_certs) if f is not None]

    def run(self) -> None:
        seen = self._stamps()
        while not self.server.should_exit:
            time.sleep(SSL_REFRESH_POLL_S)
            stamps = self._stamps()
            if stamps != seen and self._reload():
                seen = stamps

    def _stamps(self) -> list[float | None]:
        stamps = []
        for path in self.files:
            try:
                stamps.append(os.stat(path).st_mtime_ns)
            except OSError:  # replaced just now: looked at again next time
                stamps.append(None)
        return stamps

    def _reload(self) -> bool:
        context = self.server.config.ssl if self.server.config.loaded else None
        if context is None:
            return False
        try:
            context.load_cert_chain(self.c.ssl_certfile, self.c.ssl_keyfile)
            if self.c.ssl_ca_certs is not None:
                context.load_verify_locations(self.c.ssl_ca_certs)
        except (OSError, ssl.SSLError) as err:
            logger.warning("could not reload the HTTPS files (%s); the ones loaded before still serve", err)
            return False
        logger.info("reloaded the HTTPS key and certificate")
        return True


def banner(server: OpenAIServer, url: str) -> str:
    """What `plait serve` prints: where it listens and a curl to try."""
    auth = f" \\\n    -H \"Authorization: Bearer ${API_KEY_ENV}\"" if server.config.api_key else ""
    if server.pooling:
        endpoint = "embeddings"
        payload = json.dumps({"model": server.model_name, "input": ["Hello!", "Hi there."]})
    else:
        endpoint = "chat/completions"
        payload = json.dumps({"model": server.model_name, "messages": [{"role": "user", "content": "Hello!"}],
                              "max_tokens": 32})
    return (f"plait: serving '{server.model_name}' on {listening_at(url, server.config.uds)}\n"
            f"  {curl_command(server.config.uds)} {url}/v1/{endpoint} -H 'Content-Type: application/json'"
            f"{auth} \\\n    -d '{payload}'")


def listening_at(url: str, uds: str | None) -> str:
    """The banner's address: the URL, or the Unix domain socket and the URL asked for through it."""
    if uds is not None:
        return f"unix socket {uds} (OpenAI API at {url}/v1 through it)"
    return f"{url} (OpenAI API at {url}/v1)"


def curl_command(uds: str | None) -> str:
    return "curl" if uds is None else f"curl --unix-socket {uds}"


def _print_now(text: str) -> None:
    print(text, flush=True)  # stdout may be a pipe (a supervisor, a test): do not sit in its buffer


# What `plait serve` exits with when its engine died under it (not a normal stop).
ENGINE_DEAD_EXIT_CODE = 1


def serve(engine_config: EngineConfig, config: ServerConfig,
          echo: Callable[[str], None] = _print_now, engine_process: bool = True,
          launched: tuple[socket.socket, StartedEngineProcess | None] | None = None) -> None:
    """Load the model and serve until interrupted (what `plait serve` runs); ``engine_process``: the engine's
    step loop in a process of its own (EngineProcess), else on a thread of this one. ``launched``: the
    socket and engine process `launch` took before this module was imported, else they are taken here."""
    if config.api_key is None and config.uds is None and config.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("serving on %s without an API key: anyone who can reach it can use it", config.host)
    engine_config = serving_config(engine_config)
    sock, started = launched or launch(engine_config, config.host, config.port, engine_process, config.uds)
    with closing_socket(sock, config.uds):
        engine = (EngineProcess(engine_config, started=started) if engine_process
                  else LLMEngine(engine_config))
        server = OpenAIServer(engine, config)
        if engine_process:
            # What this process holds from now on (modules, the app) leaves the cyclic collector's view, and
            # its threshold goes up, as the engine's loop has them in its process: a full collection walks
            # the whole heap, a pause every stream's next chunk waits for.
            freeze_long_lived_objects()
            raise_gc_threshold()
        echo(banner(server, base_url(sock, https=config.ssl_certfile is not None)))
        _serve_until_stopped(server, sock)


def _serve_until_stopped(server: OpenAIServer, sock: socket.socket) -> None:
    """uvicorn on ``sock`` until Ctrl-C (the normal stop) or the engine's death (exit status 1)."""
    http = uvicorn_server(server.app, server.config)
    died: list[str] = []

    def stop_serving(reason: str) -> None:
        # As vLLM's server: a dead engine ends the process (non-zero), for its supervisor to start it again.
        logger.error("the engine stopped (%s): stopping the server", reason)
        died.append(reason)
        http.should_exit = True

    server.engine.on_dead = stop_serving
    try:
        http.run(sockets=[sock])
    except KeyboardInterrupt:
        pass  # uvicorn re-raises Ctrl-C after its graceful shutdown; for a server it is the normal stop
    if died:
        raise SystemExit(ENGINE_DEAD_EXIT_CODE)


class BackgroundServer:
    """Runs an OpenAIServer on a thread of this process (tests, notebooks, benchmarks).

    ``with BackgroundServer(server) as url:`` serves on a free loopback port until the block ends.
    """

    def __init__(self, server: OpenAIServer, host: str = DEFAULT_HOST, port: int = 0) -> None:
        self.server = server
        self._sock = bind_socket(host, port)
        self.url = base_url(self._sock, https=server.config.ssl_certfile is not None)
        self._uvicorn = uvicorn_server(server.app, server.config)
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [self._sock]},
                                        name="plait-http", daemon=True)

    def start(self, timeout_s: float = 60.0) -> str:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        return self.url

    def stop(self, timeout_s: float = 30.0) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(timeout_s)
        self._sock.close()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
