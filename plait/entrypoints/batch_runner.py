"""Batch runner: a file of OpenAI batch requests answered offline through the server's endpoints (vLLM's
`run-batch`).

Each input line is ``{"custom_id", "method": "POST", "url", "body"}`` as in OpenAI's batch file format; each
output line is ``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``, in input
order. The requests go to an OpenAIServer's own app in this process (no socket), so every endpoint answers a
line exactly as it answers over HTTP, its 4xx included; a line that fails never stops the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from plait.entrypoints.protocol import ErrorInfo, ErrorResponse
from plait.entrypoints.server import OpenAIServer

# The endpoints a line may name: those that answer a JSON body with one JSON answer (streams are refused).
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/score", "/score",
              "/v1/rerank", "/rerank", "/v2/rerank", "/classify", "/pooling")
# Lines in flight per row the engine can run at once: enough to keep its batches full while answers are
# written out, bounded so a huge file is never all in memory (vLLM's run-batch keeps twice max_num_seqs).
IN_FLIGHT_PER_SEQ = 2
# How long the app may take to answer one line; generation of a long answer under a full batch is slow.
LINE_TIMEOUT_S = 24 * 3600.0
_URL_SCHEMES = ("http://", "https://")
_STDIO = "-"


@dataclass
class BatchLine:
    """One input line, parsed; ``error`` set where it cannot be sent (then ``url``/``body`` may be empty)."""

    index: int  # the line's place among the file's non-blank lines: the output's order
    custom_id: str | None
    url: str = ""
    body: dict = field(default_factory=dict)
    error: str | None = None
    param: str | None = None  # the input field the error is about


@dataclass
class BatchSummary:
    """What run_batch did: lines read, and of them answered 2xx and not."""

    total: int = 0
    succeeded: int = 0
    failed: int = 0


def parse_line(index: int, lineno: int, text: str, seen: dict[str, int]) -> BatchLine:
    """Line ``lineno`` (1-based) of the input file, checked as OpenAI's batch API checks it (``seen``: the
    line number of each custom id so far)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        return BatchLine(index, None, error=f"line {lineno} is not JSON: {err}")
    if not isinstance(obj, dict):
        return BatchLine(index, None, error=f"line {lineno} is not a JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BatchLine(index, None, error="custom_id must be a non-empty string", param="custom_id")
    line = BatchLine(index, custom_id)
    if custom_id in seen:
        line.error, line.param = f"custom_id {custom_id!r} repeats line {seen[custom_id]}", "custom_id"
        return line
    seen[custom_id] = lineno
    method, url, body = obj.get("method", "POST"), obj.get("url"), obj.get("body")
    if not isinstance(method, str) or method.upper() != "POST":
        line.error, line.param = f"method must be POST, got {method!r}", "method"
    elif url not in BATCH_URLS:
        line.error, line.param = f"url {url!r} is not one of {', '.join(BATCH_URLS)}", "url"
    elif not isinstance(body, dict):
        line.error, line.param = "body must be a JSON object", "body"
    elif body.get("stream"):
        line.error, line.param = "a batch line cannot stream its answer: leave stream out or false", "stream"
    else:
        line.url, line.body = url, body
    return line


def output_line(line: BatchLine, status: int, body: Any) -> dict:
    """A line of the output file. ``error`` repeats a failed answer's error object (vLLM's readers look
    there; OpenAI's look in ``response.body``, which holds it as the endpoint answered it)."""
    error = body.get("error") if status >= 400 and isinstance(body, dict) else None
    response = {"status_code": status, "request_id": f"plait-batch-{uuid.uuid4().hex}", "body": body}
    return {"id": f"plait-{uuid.uuid4().hex}", "custom_id": line.custom_id, "response": response,
            "error": error}


def failed(line: BatchLine, status: int, message: str, type_: str, param: str | None = None) -> dict:
    """The output line of a line its endpoint never answered: OpenAI's error JSON, as the server's."""
    return output_line(line, status, ErrorResponse(error=ErrorInfo(message=message, type=type_,
                                                                   param=param)).model_dump())


async def answer(client: httpx.AsyncClient, line: BatchLine) -> dict:
    """Send one line to its endpoint; whatever goes wrong in the app becomes that line's 500."""
    if line.error is not None:  # never sent
        return failed(line, 400, line.error, "invalid_request_error", line.param)
    try:
        response = await client.post(line.url, json=line.body, timeout=LINE_TIMEOUT_S)
        return output_line(line, response.status_code, response.json())
    except Exception as err:  # one line's failure is that line's answer, never the batch's end
        return failed(line, 500, f"{type(err).__name__}: {err}", "internal_server_error")


class OrderedWriter:
    """Writes answers in input order as they complete, holding back only those that overtook an earlier
    one (so memory is bounded by the lines in flight, not the file)."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.next_index = 0
        self.pending: dict[int, dict] = {}

    def add(self, index: int, answer: dict) -> None:
        self.pending[index] = answer
        while self.next_index in self.pending:
            self.out.write(json.dumps(self.pending.pop(self.next_index), ensure_ascii=False) + "\n")
            self.next_index += 1
        self.out.flush()


async def run_batch(server: OpenAIServer, lines: AsyncIterator[str], out: IO[str], max_in_flight: int,
                    progress: bool = True) -> BatchSummary:
    """Answer every non-blank line of ``lines`` through ``server``'s app, at most ``max_in_flight`` at once,
    writing the answers to ``out`` in input order. Starts and stops the server's engine loop (its app's
    lifespan)."""
    from tqdm import tqdm

    slots = asyncio.Semaphore(max_in_flight)
    writer, summary, seen = OrderedWriter(out), BatchSummary(), {}
    bar = tqdm(unit="req", desc="Running batch", disable=not progress, file=sys.stderr)

    async def run(client: httpx.AsyncClient, line: BatchLine) -> None:
        try:
            result = await answer(client, line)
            writer.add(line.index, result)
            ok = result["response"]["status_code"] < 400
            summary.succeeded += ok
            summary.failed += not ok
            bar.update()
        finally:
            slots.release()

    transport = httpx.ASGITransport(app=server.app)
    async with server.app.router.lifespan_context(server.app), \
            httpx.AsyncClient(transport=transport, base_url="http://batch") as client:
        tasks, lineno = set(), 0
        async for text in lines:
            lineno += 1
            if not text.strip():
                continue
            await slots.acquire()
            task = asyncio.create_task(run(client, parse_line(summary.total, lineno, text, seen)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            summary.total += 1
            bar.total = summary.total
        await asyncio.gather(*tasks)
    bar.close()
    return summary


async def read_lines(source: str) -> AsyncIterator[str]:
    """The lines of a local file, of standard input ("-"), or of an http(s) URL's body (streamed)."""
    if source.startswith(_URL_SCHEMES):
        async with httpx.AsyncClient(timeout=None) as client, client.stream("GET", source) as response:
            response.raise_for_status()
            async for text in response.aiter_lines():
                yield text
        return
    with (contextlib.nullcontext(sys.stdin) if source == _STDIO else open(source, encoding="utf-8")) as f:
        for text in f:
            yield text


@contextlib.contextmanager
def open_output(target: str, tmp_dir: str | None = None) -> Iterator[IO[str]]:
    """A text file to write the answers to: ``target`` itself, standard output ("-"), or for an http(s) URL a
    temporary file (in ``tmp_dir``) that is PUT there once it is complete."""
    if target == _STDIO:
        yield sys.stdout
    elif not target.startswith(_URL_SCHEMES):
        with open(target, "w", encoding="utf-8") as f:
            yield f
    else:
        with tempfile.NamedTemporaryFile("w+", encoding="utf-8", suffix=".jsonl", dir=tmp_dir) as f:
            yield f
            f.flush()
            with open(f.name, "rb") as data:
                httpx.put(target, content=data, timeout=None).raise_for_status()


def check_paths(source: str, target: str) -> None:
    """Fail before the model loads: an input file that is missing, or an output file that cannot be made."""
    if source != _STDIO and not source.startswith(_URL_SCHEMES) and not Path(source).is_file():
        raise FileNotFoundError(f"no input file {source}")
    if target != _STDIO and not target.startswith(_URL_SCHEMES):
        folder = Path(target).resolve().parent
        if not folder.is_dir():
            raise FileNotFoundError(f"no folder {folder} for the output file {target}")


def run_batch_file(server: OpenAIServer, source: str, target: str, max_in_flight: int,
                   tmp_dir: str | None = None, progress: bool = True) -> BatchSummary:
    """What `plait run-batch` runs: ``source``'s lines answered into ``target`` (paths, "-", or URLs)."""
    with open_output(target, tmp_dir) as out:
        return asyncio.run(run_batch(server, read_lines(source), out, max_in_flight, progress))
