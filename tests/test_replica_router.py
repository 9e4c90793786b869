"""The data-parallel front's routing (plait.entrypoints.replica_router): a request naming a stored response
goes to the replica that stores it; one that begins as an earlier one did goes where that one went, unless
that replica is much busier than the least busy; anything else goes to the least busy."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

import plait.entrypoints.replica_router as router_module
from plait.entrypoints.replica_router import (
    AFFINITY_CHUNK_CHARS,
    AFFINITY_SLACK_REQUESTS,
    ReplicaRouter,
    replica_response_id_prefix,
)

SYSTEM = "You are a careful assistant who answers in French. " * 12  # ~600 characters: two whole chunks


@dataclass
class FakeReplica:
    index: int
    in_flight: int = 0


def _router(n: int = 3) -> tuple[ReplicaRouter, list[FakeReplica]]:
    replicas = [FakeReplica(i) for i in range(n)]
    return ReplicaRouter(replicas), replicas


def _chat(*turns: str, model: str = "m") -> bytes:
    messages = [{"role": "system", "content": SYSTEM}]
    messages += [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    return json.dumps({"model": model, "messages": messages}).encode()


def _route(router: ReplicaRouter, body: bytes, path: str = "/v1/chat/completions") -> int:
    return router.choose(path, body).index


def test_a_conversation_follows_its_replica_and_another_goes_to_the_least_busy():
    router, replicas = _router()
    replicas[0].in_flight, replicas[1].in_flight, replicas[2].in_flight = 3, 1, 2
    first = _route(router, _chat("Bonjour"))
    assert first == 1  # nothing known: the least busy
    replicas[1].in_flight += 1  # it runs there now, and replica 2 has gone idle
    replicas[2].in_flight = 0
    # The next turn repeats the whole conversation: it goes where its beginning is cached.
    assert _route(router, _chat("Bonjour", "Salut !", "Comment vas-tu ?")) == 1
    # The same system prompt with another first message shares only the system prompt's whole chunks: still
    # that replica (the longest known beginning wins).
    assert _route(router, _chat("Autre chose")) == 1
    # Another model (a LoRA adapter's name) never shares KV with this one: the least busy.
    assert _route(router, _chat("Bonjour", model="adapter")) == 2


def test_affinity_yields_to_a_much_busier_replica():
    router, replicas = _router(2)
    assert _route(router, _chat("Bonjour")) == 0
    replicas[0].in_flight = AFFINITY_SLACK_REQUESTS  # within the slack of the idle replica 1
    assert _route(router, _chat("Bonjour", "Salut")) == 0
    replicas[0].in_flight = AFFINITY_SLACK_REQUESTS + 1
    assert _route(router, _chat("Bonjour", "Salut")) == 1
    # From then on replica 1 holds that beginning too, and is the one it remembers.
    replicas[0].in_flight, replicas[1].in_flight = 0, 4
    assert _route(router, _chat("Bonjour", "Salut", "Encore")) == 1
    # Relative slack: at 40 in flight against 30, 1.5x the least busy still lets it follow.
    replicas[0].in_flight, replicas[1].in_flight = 30, 40
    assert _route(router, _chat("Bonjour", "Salut", "Encore", "Fin")) == 1


def test_short_prompts_batches_and_other_paths_go_to_the_least_busy():
    router, replicas = _router()
    replicas[0].in_flight = 1
    short = json.dumps({"model": "m", "prompt": "x" * (AFFINITY_CHUNK_CHARS - 20)}).encode()
    assert _route(router, short, "/v1/completions") == 1
    replicas[1].in_flight = 5
    assert _route(router, short, "/v1/completions") == 2  # nothing keyed: load alone decides
    long_prompt = {"model": "m", "prompt": "y" * (3 * AFFINITY_CHUNK_CHARS)}
    assert _route(router, json.dumps(long_prompt).encode(), "/v1/completions") == 2
    replicas[2].in_flight = 2
    assert _route(router, json.dumps(long_prompt).encode(), "/v1/completions") == 2  # followed
    batch = json.dumps({"model": "m", "prompt": [long_prompt["prompt"], "z"]}).encode()
    assert _route(router, batch, "/v1/completions") == 0
    assert _route(router, json.dumps(long_prompt).encode(), "/v1/embeddings") == 0
    assert _route(router, b"{not json", "/v1/completions") == 0  # the replica says what is wrong


def test_requests_naming_a_stored_response_go_to_the_replica_storing_it():
    router, replicas = _router()
    replicas[2].in_flight = 50
    stored = f"{replica_response_id_prefix(2)}0123abcd"
    assert _route(router, b"", f"/v1/responses/{stored}") == 2
    assert _route(router, b"", f"/v1/responses/{stored}/cancel") == 2
    follow_up = json.dumps({"model": "m", "input": "and then?", "previous_response_id": stored}).encode()
    assert _route(router, follow_up, "/v1/responses") == 2
    # An id no replica made (or of a replica that is not there): the least busy, which answers 404.
    assert _route(router, b"", "/v1/responses/resp_0123abcd") == 0
    assert _route(router, b"", f"/v1/responses/{replica_response_id_prefix(7)}0123") == 0
    # The storing replica failed the request: another answers (its 404 is the truth by then).
    assert router.choose(f"/v1/responses/{stored}", b"", exclude=frozenset({2})).index == 0


def test_the_remembered_beginnings_are_bounded(monkeypatch):
    monkeypatch.setattr(router_module, "AFFINITY_MAX_KEYS", 4)
    router, replicas = _router(2)
    for i in range(10):
        body = json.dumps({"model": "m", "prompt": f"{i}" * (2 * AFFINITY_CHUNK_CHARS)}).encode()
        router.choose("/v1/completions", body)
    assert len(router._owners) == 4


@pytest.mark.parametrize("index", [0, 1, 12])
def test_replica_response_ids_keep_openais_prefix(index):
    assert replica_response_id_prefix(index).startswith("resp_")


def test_least_busy_routing_keeps_only_the_stored_responses_rule():
    """--data-parallel-routing least-busy: a conversation's turns go wherever load says; a request naming a
    stored response still goes to the replica storing it."""
    replicas = [FakeReplica(i) for i in range(2)]
    router = ReplicaRouter(replicas, prefix_affinity=False)
    assert _route(router, _chat("Bonjour")) == 0
    replicas[0].in_flight = 1
    assert _route(router, _chat("Bonjour", "Salut")) == 1
    stored = f"{replica_response_id_prefix(0)}abc"
    assert _route(router, b"", f"/v1/responses/{stored}") == 0


def test_the_routing_flag_reaches_the_front(monkeypatch):
    import plait.entrypoints.data_parallel as data_parallel
    from plait.entrypoints import cli

    seen = []
    monkeypatch.setattr(data_parallel, "serve_data_parallel",
                        lambda e, s, size, prefix_affinity, **_: seen.append((size, prefix_affinity)))
    assert cli.main(["serve", "-dp", "2"]) == 0
    assert cli.main(["serve", "-dp", "3", "--data-parallel-routing", "least-busy"]) == 0
    assert seen == [(2, True), (3, False)]
