"""Fuzz the OpenAI-compatible server from its OpenAPI schema (schemathesis): no input may cause a 5xx.

    PYTHONPATH=. .venv/bin/python scripts/fuzz_server.py --max-examples 150

By default it serves a tiny random Llama that carries the default model's tokenizer and chat template
(so every request runs in milliseconds and max_model_len is short enough that any max_tokens ends
quickly); ``--model PATH`` fuzzes a real model instead. Each operation gets ``--max-examples``
schema-valid cases and as many schema-violating ones. Exits 1 and prints the failing cases if any.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

API_KEY = "fuzz-key"
# A context this short bounds every generation; the limit is still checked (400) above it.
FUZZ_MAX_MODEL_LEN = 128
FUZZ_KV_BLOCKS = 256
TINY_HIDDEN = 64
TINY_LAYERS = 2
TINY_HEADS = 4
TINY_KV_HEADS = 2
TINY_INTERMEDIATE = 128
REQUEST_TIMEOUT_S = 60.0
SSE_DONE = "data: [DONE]"
# The Responses API's streams end, as OpenAI's, with the event that finishes the response (no [DONE]); an
# error in one is an event of its own.
RESPONSES_STREAM_ENDS = ("event: response.completed", "event: response.incomplete", "event: response.failed")
RESPONSES_STREAM_ERROR = "event: error"


@dataclass
class Failure:
    case: str  # operation and generation mode
    status: int | None
    problem: str
    request: str

    def __str__(self) -> str:
        return f"{self.case} status={self.status}: {self.problem}\n    request: {self.request}"


def make_tiny_model(folder: Path, max_positions: int = FUZZ_MAX_MODEL_LEN) -> Path:
    """A random 2-layer Llama with the default model's vocabulary, tokenizer and chat template, and a context
    of ``max_positions``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from plait.loader.source import default_model_path
    from plait.loader.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=TINY_HIDDEN,
                         intermediate_size=TINY_INTERMEDIATE, num_hidden_layers=TINY_LAYERS,
                         num_attention_heads=TINY_HEADS,
                         num_key_value_heads=TINY_KV_HEADS, max_position_embeddings=max_positions,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def fuzz(url: str, api_key: str | None, max_examples: int, verbose: bool = False,
         max_examples_by_operation: Mapping[str, int] | None = None
         ) -> tuple[list[Failure], dict[str, Counter]]:
    """Run schema-valid and schema-violating cases against every operation (``max_examples`` of each, or
    what ``max_examples_by_operation`` gives an operation's label, such as "POST /v1/responses").

    Returns the failures and, per operation and mode, how many responses had each status.

    Derandomized: the same schema gives the same cases on every run.
    """
    import requests
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=headers)
    failures: list[Failure] = []
    statuses: dict[str, Counter] = {}
    session = requests.Session()
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            label = f"{operation.label} [{mode.value}]"
            statuses[label] = Counter()
            run = _case_runner(url, headers, session, label, failures, statuses[label], verbose)
            examples = (max_examples_by_operation or {}).get(operation.label, max_examples)
            counter = settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                               phases=[Phase.explicit, Phase.generate],
                               suppress_health_check=list(HealthCheck))(
                given(case=operation.as_strategy(generation_mode=mode))(run))
            try:
                counter()
            except Unsatisfiable:
                pass  # nothing to violate: a GET without parameters has no negative cases
    return failures, statuses


def _case_runner(url: str, headers: dict, session: Any, label: str, failures: list[Failure],
                 statuses: Counter, verbose: bool) -> Any:
    def run(case: Any) -> None:
        problem, status, detail = _check_case(case, url, headers, session)
        statuses[status] += 1
        if verbose:
            print(f"  {label} {status}: {json.dumps(case.body, default=str)[:150]} -> {detail[:150]}")
        if problem is not None:
            request = json.dumps(case.body, default=str)[:500] if case.body is not None else ""
            failures.append(Failure(label, status, problem, request))

    return run


def _check_case(case: Any, url: str, headers: dict, session: Any) -> tuple[str | None, int | None, str]:
    """(what is wrong or None, the status, the error message or the start of the body)."""
    import requests

    try:
        response = case.call(base_url=url, headers=headers, session=session, timeout=REQUEST_TIMEOUT_S)
    except requests.RequestException as err:  # a dropped connection or a broken stream is a failure too
        return f"transport error: {err!r}", None, ""
    status = response.status_code
    if status >= 500:
        return f"server error: {response.text[:300]}", status, response.text
    content_type = response.headers.get("content-type") or ""
    if isinstance(content_type, list):  # schemathesis keeps every value of a header
        content_type = content_type[0] if content_type else ""
    if status >= 400:
        try:
            error = response.json()["error"]
            assert isinstance(error["message"], str) and {"type", "param", "code"} <= set(error)
        except (ValueError, KeyError, TypeError, AssertionError):
            return f"error without OpenAI's error JSON: {response.text[:300]}", status, response.text
        return None, status, error["message"]
    elif content_type.startswith("text/event-stream"):
        lines = [line for line in response.text.splitlines() if line]
        if any(line.startswith("data: {\"error\"") or line == RESPONSES_STREAM_ERROR for line in lines):
            return f"stream carries an error: {response.text[-300:]}", status, response.text
        # schemathesis hangs up after a few events: a client disconnect, which the server must survive
        # (and whose requests it must abort: checked once the run is over).
        ended = bool(lines) and lines[-1] == SSE_DONE or len(lines) > 1 and lines[-2] in RESPONSES_STREAM_ENDS
        if not response.stream_cut_short and not ended:
            return f"stream does not end as it should: {response.text[-300:]}", status, response.text
    return None, status, response.text


def wait_idle_and_clean(server: Any, timeout_s: float = REQUEST_TIMEOUT_S) -> bool:
    """True once the engine has no requests and every KV block is free (aborts land asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        clean = server.engine.call_threadsafe(lambda e: e.is_idle_and_clean(), timeout_s)
        if clean or time.monotonic() > deadline:
            return clean
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="fuzz this model instead of a tiny random one")
    parser.add_argument("--max-examples", type=int, default=100, help="cases per operation and mode")
    parser.add_argument("--log-level", default="critical", help="the server's log level")
    parser.add_argument("--verbose", action="store_true", help="print every case and its answer")
    args = parser.parse_args(argv)

    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine
    from plait.entrypoints.server import BackgroundServer, OpenAIServer, ServerConfig

    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="plait-fuzz-") as tmp:
        model = args.model or str(make_tiny_model(Path(tmp)))
        config = EngineConfig(model=model, max_model_len=FUZZ_MAX_MODEL_LEN, num_kv_blocks=FUZZ_KV_BLOCKS)
        engine = LLMEngine(config)
        server = OpenAIServer(engine, ServerConfig(api_key=API_KEY, log_level=args.log_level))
        with BackgroundServer(server) as url:
            failures, statuses = fuzz(url, API_KEY, args.max_examples, args.verbose)
            alive = server.engine.is_alive
            clean = wait_idle_and_clean(server)
    for label, counts in statuses.items():
        print(f"{label}: " + ", ".join(f"{n} x {status}" for status, n in sorted(counts.items(), key=str)))
    count = sum(sum(c.values()) for c in statuses.values())
    print(f"{count} cases in {time.monotonic() - start:.0f} s; {len(failures)} failure(s); "
          f"engine alive: {alive}; idle and clean: {clean}")
    for failure in failures:
        print(failure)
    return 0 if not failures and alive and clean else 1


if __name__ == "__main__":
    sys.exit(main())
