"""KV cache events (vLLM's --kv-events-config): the blocks the prefix cache stored, removed and cleared, and
the ZMQ publisher that sends them in vLLM's wire format, so KV-aware routers (llm-d, Dynamo) follow plait."""

from __future__ import annotations

import dataclasses
import functools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# A KV block's content hash, as events carry it (plait's are bytes; vLLM's may be ints).
BlockHash = bytes
# Where the blocks live (vLLM's medium): the device's memory.
DEVICE_MEDIUM = "GPU"
# The replay socket's answer that ends a replay (vLLM's -1 sequence number, then an empty payload).
END_OF_REPLAY = -1
SEQ_BYTES = 8


@dataclass(frozen=True)
class BlockStored:
    """Blocks that became findable by their hashes: consecutive blocks of one request, each chained to the
    one before (``parent_block_hash``: the hash before the first, None at a prompt's start)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]  # the blocks' tokens, block after block
    block_size: int
    lora_id: int | None
    medium: str | None = DEVICE_MEDIUM


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks no longer findable (evicted for a new allocation)."""

    block_hashes: list[BlockHash]
    medium: str | None = DEVICE_MEDIUM


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every cached block forgotten (reset_prefix_cache)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@functools.cache  # classes made once: encode_batch runs every step
def _wire_types() -> tuple[Any, dict[type, Any]]:
    """vLLM's msgspec structs (tagged, array-like): (the batch type, plait event type -> struct type)."""
    import msgspec

    class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    class WireBlockStored(KVCacheEvent, tag="BlockStored"):
        block_hashes: list[bytes]
        parent_block_hash: bytes | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None

    class WireBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
        block_hashes: list[bytes]
        medium: str | None

    class WireAllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
        pass

    class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[WireBlockStored | WireBlockRemoved | WireAllBlocksCleared]
        data_parallel_rank: int | None = None

    return KVEventBatch, {BlockStored: WireBlockStored, BlockRemoved: WireBlockRemoved,
                          AllBlocksCleared: WireAllBlocksCleared}


def encode_batch(events: list[KVEvent], data_parallel_rank: int | None = None, ts: float | None = None
                 ) -> bytes:
    """A step's events as vLLM's KVEventBatch, msgpack-encoded: [ts, [[tag, fields...], ...], rank?]."""
    import msgspec

    batch_type, structs = _wire_types()
    wire = [structs[type(e)](**{f.name: getattr(e, f.name) for f in dataclasses.fields(e)}) for e in events]
    return msgspec.msgpack.encode(batch_type(time.time() if ts is None else ts, wire, data_parallel_rank))


class ZmqEventPublisher:
    """vLLM's "zmq" publisher: a thread sends each step's batch on a PUB socket as (topic, sequence number,
    payload), and keeps the last ``buffer_steps`` payloads for a ROUTER socket at ``replay_endpoint`` that
    answers a subscriber's "from sequence N" with every kept (sequence, payload) from N on, then
    (END_OF_REPLAY, b""). Encoding and sending stay off the engine's step loop."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, buffer_steps: int = 10_000,
                 hwm: int = 100_000, max_queue_size: int = 100_000, topic: str = "",
                 data_parallel_rank: int | None = None) -> None:
        import zmq

        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.bind(endpoint)
        self._replay = None
        if replay_endpoint is not None:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.bind(replay_endpoint)
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._sent: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.Queue[list[KVEvent] | None] = queue.Queue(maxsize=max_queue_size)
        self._thread = threading.Thread(target=self._run, name="plait-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVEvent]) -> None:
        """Queue a step's events; dropped (and logged) where the queue is full rather than stall the step."""
        try:
            self._queue.put_nowait(events)
        except queue.Full:
            logger.warning("KV events queue full: a step's %d events dropped", len(events))

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, then stop the thread and close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._context.term()

    def _run(self) -> None:
        import zmq

        seq = 0
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            if self._replay is not None and poller.poll(0):
                self._answer_replay()
            try:
                events = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if events is None:
                return
            payload = encode_batch(events, self._rank)
            self._pub.send_multipart((self._topic, seq.to_bytes(SEQ_BYTES, "big"), payload))
            self._sent.append((seq, payload))
            seq += 1

    def _answer_replay(self) -> None:
        identity, _, start = self._replay.recv_multipart()
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._sent):
            if seq >= first:
                self._replay.send_multipart((identity, b"", seq.to_bytes(SEQ_BYTES, "big"), payload))
        self._replay.send_multipart((identity, b"", END_OF_REPLAY.to_bytes(SEQ_BYTES, "big", signed=True),
                                     b""))
