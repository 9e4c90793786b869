"""Schemathesis fuzzing of the server's OpenAPI schema: no input causes a 5xx, and nothing leaks."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("schemathesis")

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "fuzz_server.py"
# Cases per operation and generation mode (valid and schema-violating): ~700 in all, ~35 s on two cores (40
# took 50 s, 60 took 88 s once the Responses and LoRA routes joined the schema, a sixth of the suite).
# `scripts/fuzz_server.py --max-examples N` runs longer campaigns.
MAX_EXAMPLES = 20
# The Responses API runs chat completions' path, which gets the full count: its own request parsing gets
# fewer cases (each valid one runs a generation: 60 of them took ~30 s), and so do its lookups of stored ids.
RESPONSES_MAX_EXAMPLES = 10
FEWER_EXAMPLES = dict.fromkeys(("POST /v1/responses", "GET /v1/responses/{response_id}",
                                "POST /v1/responses/{response_id}/cancel"), RESPONSES_MAX_EXAMPLES)
# Against a pooling model the generating operations stop at their "does not support" 400, which the
# generating model's run already fuzzed past: a few cases each there, the full count for the pooling ones.
GENERATING_OPERATIONS = ("POST /v1/completions", "POST /v1/chat/completions", "POST /v1/responses",
                         "GET /v1/responses/{response_id}", "POST /v1/responses/{response_id}/cancel")
POOLING_RUN_FEWER_EXAMPLES = dict.fromkeys(GENERATING_OPERATIONS, 5)


def _load_script():
    spec = importlib.util.spec_from_file_location("fuzz_server", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def _fuzz_served(model: str, fuzz, fewer: dict[str, int] = FEWER_EXAMPLES) -> dict:
    """Fuzz a server of ``model``: no 5xx, the engine alive and clean after; the statuses per operation."""
    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine
    from plait.entrypoints.server import BackgroundServer, OpenAIServer, ServerConfig

    engine = LLMEngine(EngineConfig(model=model, max_model_len=fuzz.FUZZ_MAX_MODEL_LEN,
                                    num_kv_blocks=fuzz.FUZZ_KV_BLOCKS))
    server = OpenAIServer(engine, ServerConfig(api_key=fuzz.API_KEY, log_level="critical"))
    with BackgroundServer(server) as url:
        failures, statuses = fuzz.fuzz(url, fuzz.API_KEY, MAX_EXAMPLES, False, fewer)
        assert server.engine.is_alive
        assert fuzz.wait_idle_and_clean(server)  # streams the fuzzer hung up on were aborted
    assert not failures, "\n".join(map(str, failures[:10]))
    assert sum(sum(c.values()) for c in statuses.values()) >= 4 * MAX_EXAMPLES
    return statuses


def test_fuzzed_requests_never_get_a_server_error(tmp_path):
    fuzz = _load_script()
    statuses = _fuzz_served(str(fuzz.make_tiny_model(tmp_path / "tiny")), fuzz)
    # The valid cases really ran generations, not only validation errors.
    assert statuses["POST /v1/completions [positive]"][200] > 0
    assert statuses["POST /v1/chat/completions [positive]"][200] > 0
    assert statuses["POST /v1/responses [positive]"][200] > 0


def test_fuzzed_pooling_requests_never_get_a_server_error(tmp_path):
    """The same against a pooling model, whose endpoints run past validation: a longer campaign found two
    500s there (dimensions and truncate_prompt_tokens below their bounds) that a generating model's 400
    ("does not support") had hidden."""
    import json

    fuzz = _load_script()
    model = fuzz.make_tiny_model(tmp_path / "tiny")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaModel"]}))
    statuses = _fuzz_served(str(model), fuzz, fewer=POOLING_RUN_FEWER_EXAMPLES)
    assert statuses["POST /v1/embeddings [positive]"][200] > 0  # valid cases ran the pooler
