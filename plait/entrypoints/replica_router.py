"""ReplicaRouter: which data-parallel replica a request goes to: the one holding the response it names, else
the one that served its beginning last (where the prefix cache may hold it), else the least busy."""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol

from plait.entrypoints.protocol import RESPONSE_ID_PREFIX

# A replica's stored responses have ids of its own: the prefix, "dp", its index, "-", then the usual hex, so
# that GET /v1/responses/{id}, its cancel and a previous_response_id reach the replica that stores it.
_REPLICA_RESPONSE_ID = re.compile(rf"^{re.escape(RESPONSE_ID_PREFIX)}dp(\d+)-")
_RESPONSE_PATH = re.compile(r"^/v1/responses/([^/]+)")
# Requests whose beginning decides their prefix-cache hits: their text is read for affinity.
AFFINITY_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
# A request's text is keyed in chunks of this many characters (a partial last chunk is not): two requests
# share a key where their first k chunks agree. ~64 tokens of English: shorter beginnings decide nothing.
AFFINITY_CHUNK_CHARS = 256
# Chunk keys remembered (the least recently used go first); ~8 MB of keys at most.
AFFINITY_MAX_KEYS = 1 << 16
# A request follows its beginning's replica unless that one has more in flight than both the least busy
# plus this many and this many times the least busy: affinity never piles load onto one replica.
AFFINITY_SLACK_REQUESTS = 8
AFFINITY_SLACK_RATIO = 1.5


def replica_response_id_prefix(index: int) -> str:
    """The prefix of the response ids replica ``index`` makes."""
    return f"{RESPONSE_ID_PREFIX}dp{index}-"


class Loaded(Protocol):
    index: int
    in_flight: int


def request_text(body: dict) -> str | None:
    """What a generation request's prompt begins with, as text to key (None: nothing to key): a completion's
    prompt, a chat's messages, a response's instructions and input; the model (an adapter's name) first,
    since a LoRA adapter's KV is never served to another."""
    if "prompt" in body:
        parts: Any = body["prompt"]
        if isinstance(parts, list) and parts and not isinstance(parts[0], int):
            return None  # a batch of prompts: each would want its own replica
    elif "messages" in body:
        parts = body["messages"]
    elif "input" in body:
        parts = [body.get("instructions"), body["input"]]
    else:
        return None
    return json.dumps([body.get("model"), parts], ensure_ascii=False, separators=(",", ":"))


def chunk_keys(text: str) -> list[int]:
    """One key per whole chunk of ``text``, each standing for all of the text up to that chunk's end."""
    keys, key = [], 0
    for start in range(0, len(text) - AFFINITY_CHUNK_CHARS + 1, AFFINITY_CHUNK_CHARS):
        key = hash((key, text[start:start + AFFINITY_CHUNK_CHARS]))
        keys.append(key)
    return keys


class ReplicaRouter:
    """Chooses a replica per request, as the module's docstring says; remembers which replica
    served each chunk key of the requests it routed."""

    def __init__(self, replicas: Sequence[Loaded], prefix_affinity: bool = True) -> None:
        self.replicas = list(replicas)
        self.prefix_affinity = prefix_affinity  # False: the least busy, but for stored responses
        self._owners: OrderedDict[int, int] = OrderedDict()  # chunk key -> replica index

    def least_busy(self, exclude: frozenset[int] = frozenset()) -> Loaded | None:
        """The replica with the fewest requests in flight, of those not in ``exclude`` (None: no such one)."""
        candidates = [r for r in self.replicas if r.index not in exclude]
        return min(candidates, key=lambda r: (r.in_flight, r.index)) if candidates else None

    def choose(self, path: str, body: bytes, exclude: frozenset[int] = frozenset()) -> Loaded | None:
        """The replica for a request to ``path`` with ``body``, none of ``exclude`` (those that failed it)."""
        fallback = self.least_busy(exclude)
        if fallback is None:
            return None
        decoded = _json_object(body) if body else None
        stored = self._storing_replica(path, decoded)
        if stored is not None:
            return stored if stored.index not in exclude else fallback
        keyed = self.prefix_affinity and decoded is not None and path in AFFINITY_PATHS
        text = request_text(decoded) if keyed else None
        if text is None:
            return fallback
        keys = chunk_keys(text)
        chosen = self._affine(keys, fallback, exclude) or fallback
        for key in keys:
            self._owners[key] = chosen.index
            self._owners.move_to_end(key)
        while len(self._owners) > AFFINITY_MAX_KEYS:
            self._owners.popitem(last=False)
        return chosen

    def _affine(self, keys: list[int], least: Loaded, exclude: frozenset[int]) -> Loaded | None:
        """The replica that served the longest known beginning of the request, if not too busy."""
        owner = next((self._owners[k] for k in reversed(keys) if k in self._owners), None)
        if owner is None or owner in exclude or owner >= len(self.replicas):
            return None
        replica = self.replicas[owner]
        limit = max(least.in_flight + AFFINITY_SLACK_REQUESTS, least.in_flight * AFFINITY_SLACK_RATIO)
        return replica if replica.in_flight <= limit else None

    def _storing_replica(self, path: str, body: dict | None) -> Loaded | None:
        """The replica that stores the response a Responses request names (in its path, or as its
        previous_response_id), if the id is one of theirs."""
        match = _RESPONSE_PATH.match(path)
        response_id = match.group(1) if match else (body or {}).get("previous_response_id")
        if not isinstance(response_id, str):
            return None
        tagged = _REPLICA_RESPONSE_ID.match(response_id)
        if tagged is None or int(tagged.group(1)) >= len(self.replicas):
            return None  # not a replica's id: whichever replica gets it says it knows none
        return self.replicas[int(tagged.group(1))]


def _json_object(body: bytes) -> dict | None:
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None  # the replica answers it with its 400
    return value if isinstance(value, dict) else None
