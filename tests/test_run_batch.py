"""`plait run-batch` (vLLM's): OpenAI batch files answered through the server's endpoints, in input order,
each line's failure its own."""

from __future__ import annotations

import asyncio
import http.server
import io
import json
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from conftest import idle_serving_engine  # noqa: E402

from plait.entrypoints.batch_runner import BATCH_URLS, OrderedWriter, parse_line, run_batch  # noqa: E402
from plait.entrypoints.cli import main  # noqa: E402
from plait.entrypoints.llm import LLM  # noqa: E402
from plait.entrypoints.server import BackgroundServer, OpenAIServer, ServerConfig  # noqa: E402
from plait.sampling_params import SamplingParams  # noqa: E402

CHAT = "/v1/chat/completions"


def _line(custom_id: str, body: dict, url: str = CHAT, method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def _chat(question: str, max_tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0}


@pytest.mark.parametrize("text, param, words", [
    ("not json", None, "line 7 is not JSON"),
    ("[1, 2]", None, "line 7 is not a JSON object"),
    (json.dumps({"url": CHAT, "body": {}}), "custom_id", "custom_id must be a non-empty string"),
    (_line("x", {}), "custom_id", "custom_id 'x' repeats line 3"),
    (_line("y", {}, method="GET"), "method", "method must be POST"),
    (_line("y", {}, url="/v1/models"), "url", "'/v1/models' is not one of"),
    (json.dumps({"custom_id": "y", "url": CHAT, "body": [1]}), "body", "body must be a JSON object"),
    (_line("y", {"messages": [], "stream": True}), "stream", "cannot stream"),
])
def test_lines_that_cannot_be_sent_say_why(text, param, words):
    line = parse_line(4, 7, text, {"x": 3})
    assert line.index == 4 and line.param == param and words in line.error


def test_a_good_line_is_sent_as_it_is():
    seen: dict[str, int] = {}
    for url in BATCH_URLS:
        body = {"input": "a", "stream": False}
        line = parse_line(0, len(seen) + 1, _line(f"id-{url}", body, url=url), seen)
        assert line.error is None and line.url == url and line.body == body
    assert len(seen) == len(BATCH_URLS)


def test_answers_are_written_in_input_order_as_soon_as_they_can_be():
    out = io.StringIO()
    writer = OrderedWriter(out)
    writer.add(1, {"n": 1})
    writer.add(2, {"n": 2})
    assert out.getvalue() == ""  # line 0 is still running: nothing may overtake it
    writer.add(0, {"n": 0})
    assert [json.loads(t)["n"] for t in out.getvalue().splitlines()] == [0, 1, 2]
    assert writer.pending == {}


async def _lines(texts: list[str]) -> AsyncIterator[str]:
    for text in texts:
        yield text


def test_run_batch_answers_each_line_as_the_server_does(serving_engine):
    """A batch through the default model: every line answered in input order (a long answer's line first, so
    the short ones behind it finish before it), bad lines and 400s answered beside the good ones, and every
    good answer what the live server gives the official client for the same body."""
    engine = idle_serving_engine(serving_engine)
    chats = {"long": _chat("Name a planet.", 24), "short": _chat("Name a color.", 2),
             "n2": _chat("What do bees make?", 6) | {"n": 2, "seed": 3, "temperature": 0.8},
             "after-errors": _chat("Say hello in French.", 5)}
    completion = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "logprobs": 2}
    texts = [_line("long", chats["long"]), _line("short", chats["short"]), "{oops", "",
             _line("too-many", _chat("Hi", 5) | {"max_tokens": 10**9}),
             _line("completion", completion, url="/v1/completions"), _line("short", chats["short"]),
             _line("n2", chats["n2"]), _line("after-errors", chats["after-errors"])]
    out = io.StringIO()
    server = OpenAIServer(engine, ServerConfig(log_level="warning", disable_log_stats=True))
    summary = asyncio.run(run_batch(server, _lines(texts), out, max_in_flight=2, progress=False))
    answers = [json.loads(t) for t in out.getvalue().splitlines()]

    assert [a["custom_id"] for a in answers] == ["long", "short", None, "too-many", "completion", "short",
                                                 "n2", "after-errors"]
    assert [a["response"]["status_code"] for a in answers] == [200, 200, 400, 400, 200, 400, 200, 200]
    assert (summary.total, summary.succeeded, summary.failed) == (8, 5, 3)
    assert len({a["id"] for a in answers}) == len({a["response"]["request_id"] for a in answers}) == 8
    for a in answers:
        failed = a["response"]["status_code"] >= 400
        assert (a["error"] is not None) == failed
        if failed:
            assert a["response"]["body"] == {"error": a["error"]}
    assert "line 3 is not JSON" in answers[2]["error"]["message"]
    assert answers[3]["error"]["param"] == "max_tokens"
    assert "maximum context length" in answers[3]["error"]["message"]
    assert "repeats line 2" in answers[5]["error"]["message"]
    assert engine.is_idle_and_clean()

    by_id = {a["custom_id"]: a["response"]["body"] for a in answers if a["error"] is None}
    with BackgroundServer(OpenAIServer(engine, ServerConfig(log_level="warning"))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        for custom_id, body in chats.items():
            live = client.chat.completions.create(model=server.model_name, **body).model_dump()
            got = by_id[custom_id]
            counts = ("prompt_tokens", "completion_tokens", "total_tokens")
            assert got["object"] == "chat.completion"
            assert [got["usage"][k] for k in counts] == [live["usage"][k] for k in counts]
            assert [(c["message"]["content"], c["finish_reason"]) for c in got["choices"]] == \
                [(c["message"]["content"], c["finish_reason"]) for c in live["choices"]]
        live = client.completions.create(model=server.model_name, **completion).model_dump()
        got = by_id["completion"]
        assert got["choices"][0]["text"] == live["choices"][0]["text"]
        assert got["choices"][0]["logprobs"]["tokens"] == live["choices"][0]["logprobs"]["tokens"]
    assert by_id["long"]["usage"]["completion_tokens"] > by_id["short"]["usage"]["completion_tokens"]


def _completion_lines(prompts: list[list[int]], max_tokens: int) -> str:
    return "".join(_line(f"req-{i}", {"prompt": p, "max_tokens": max_tokens, "temperature": 0,
                                      "return_token_ids": True}, url="/v1/completions") + "\n"
                   for i, p in enumerate(prompts))


def _token_ids(answers: list[dict]) -> list[list[int]]:
    return [a["response"]["body"]["choices"][0]["token_ids"] for a in answers]


PROMPTS = [[5, 9, 13, 2 + k, 40] for k in range(6)]
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def expected_ids(tiny_llama) -> list[list[int]]:
    """Greedy continuations of PROMPTS by the offline LLM: what each answer must hold."""
    llm = LLM(str(tiny_llama))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("placement", ["--engine-process", "--no-engine-process"])
def test_cli_reads_standard_input_and_writes_standard_output(tiny_llama, expected_ids, placement, monkeypatch,
                                                             capfd):
    """Standard output holds the answers alone, the engine in a process of its own (the default) or not."""
    monkeypatch.setattr("sys.stdin", io.StringIO(_completion_lines(PROMPTS, MAX_TOKENS)))
    assert main(["run-batch", "-i", "-", "-o", "-", "--model", str(tiny_llama), "--log-level", "info",
                 "--served-model-name", "tiny", "--max-num-seqs", "2", placement]) == 0
    captured = capfd.readouterr()
    answers = [json.loads(t) for t in captured.out.splitlines()]
    assert [a["custom_id"] for a in answers] == [f"req-{i}" for i in range(len(PROMPTS))]
    assert _token_ids(answers) == expected_ids
    assert {a["response"]["body"]["model"] for a in answers} == {"tiny"}
    assert f"{len(PROMPTS)} requests, {len(PROMPTS)} answered, 0 failed" in captured.err


class _FileHost(http.server.BaseHTTPRequestHandler):
    """Serves ``files[path]`` to GET and stores a PUT's body there (an object store in miniature)."""

    files: dict[str, bytes] = {}

    def do_GET(self) -> None:  # noqa: N802 (the http.server interface)
        data = self.files.get(self.path)
        self.send_response(200 if data is not None else 404)
        self.end_headers()
        self.wfile.write(data or b"")

    def do_PUT(self) -> None:  # noqa: N802
        self.files[self.path] = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_cli_gets_its_input_from_a_url_and_puts_its_output_to_one(tiny_llama, expected_ids, tmp_path):
    """With the engine in a process of its own (the default, as serve's)."""
    _FileHost.files = {"/in.jsonl": _completion_lines(PROMPTS, MAX_TOKENS).encode()}
    host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FileHost)
    threading.Thread(target=host.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{host.server_address[1]}"
    try:
        assert main(["run-batch", "-i", f"{base}/in.jsonl", "-o", f"{base}/results/out.jsonl",
                     "--output-tmp-dir", str(tmp_path), "--model", str(tiny_llama), "--log-level", "warning",
                     "--disable-log-stats"]) == 0
    finally:
        host.shutdown()
    answers = [json.loads(t) for t in _FileHost.files["/results/out.jsonl"].decode().splitlines()]
    assert _token_ids(answers) == expected_ids
    assert list(tmp_path.iterdir()) == []  # the staging file is gone once it is up


def test_cli_refuses_missing_files_before_loading_a_model(tmp_path, capsys):
    missing = tmp_path / "nothing.jsonl"
    assert main(["run-batch", "-i", str(missing), "-o", str(tmp_path / "out.jsonl"),
                 "--model", str(tmp_path / "no-model")]) == 2
    assert f"no input file {missing}" in capsys.readouterr().err
    source = tmp_path / "in.jsonl"
    source.write_text(_line("a", {}))
    target = Path(tmp_path / "no-folder" / "out.jsonl")
    assert main(["run-batch", "-i", str(source), "-o", str(target), "--model", str(tmp_path / "none")]) == 2
    assert "no folder" in capsys.readouterr().err


def test_cli_says_why_a_model_does_not_load_in_the_engine_process(tmp_path, capsys):
    """The engine process (the default) fails as the engine on a thread does: one line, exit status 2."""
    model = tmp_path / "unsupported"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"], "vocab_size": 8,
                                                   "hidden_size": 8}))
    source = tmp_path / "in.jsonl"
    source.write_text(_line("a", {}))
    for placement in ("--engine-process", "--no-engine-process"):
        assert main(["run-batch", "-i", str(source), "-o", str(tmp_path / "out.jsonl"), "--model", str(model),
                     placement]) == 2
        err = capsys.readouterr().err
        assert "plait: error: architecture 'NoSuchForCausalLM' is not supported" in err
        assert "Traceback" not in err
