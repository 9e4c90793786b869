"""KV cache events (vLLM's --kv-events-config): the prefix cache's stored, removed and cleared blocks, sent
over ZMQ as vLLM sends them, decoded here with the structs vLLM's kv_events_subscriber example defines."""

from __future__ import annotations

import socket
import time

import msgspec
import pytest
import zmq
from conftest import random_prompts

from plait.config import EngineConfig, KVEventsConfig
from plait.engine.engine import LLMEngine
from plait.engine.kv_cache import KVCacheManager
from plait.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch
from plait.engine.request import Request
from plait.entrypoints.cli import build_parser
from plait.sampling_params import SamplingParams

BLOCK = 8


# vLLM's wire types, as its examples/online_serving/kv_events_subscriber.py defines them.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class VllmBlockStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class VllmBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None


class VllmAllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    pass


class KVEventBatch(EventBatch):
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]
    data_parallel_rank: int | None = None


def _prefilled(kv: KVCacheManager, tokens: list[int], request_id: str) -> Request:
    """A request whose prompt is computed and whose full blocks are cached."""
    request = Request(request_id, tokens, SamplingParams(max_tokens=1), max_tokens=1)
    kv.match_prefix(request)
    assert kv.allocate(request, len(tokens) - request.num_computed_tokens)
    request.num_computed_tokens = len(tokens)
    kv.cache_full_blocks(request)
    return request


def test_the_block_pool_records_what_it_stores_evicts_and_clears():
    kv = KVCacheManager(num_blocks=6, block_size=BLOCK, enable_prefix_caching=True)
    kv.events = []
    prompt = list(range(100, 121))  # two full blocks and 5 tokens
    first = _prefilled(kv, prompt, "a")
    (stored,) = kv.take_events()
    assert stored == BlockStored(first.block_hashes[:2], None, prompt[:16], BLOCK, None)
    # A request sharing the first block stores only its own second one, chained to the shared first.
    other = prompt[:8] + list(range(200, 210))
    second = _prefilled(kv, other, "b")
    (stored,) = kv.take_events()
    assert stored == BlockStored([second.block_hashes[1]], first.block_hashes[0], other[8:16], BLOCK, None)
    kv.free(first)
    kv.free(second)
    # A new request takes blocks: the least recently freed cached ones are evicted, each a removal.
    third = _prefilled(kv, list(range(300, 340)), "c")
    events = kv.take_events()
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed and set(removed) <= {*first.block_hashes[:2], second.block_hashes[1]}
    assert events[-1] == BlockStored(third.block_hashes[:5], None, list(range(300, 340)), BLOCK, None)
    assert kv.take_events() == []
    kv.free(third)
    assert kv.reset_prefix_cache()
    assert kv.take_events() == [AllBlocksCleared()]  # one event for the whole cache, no removal a block


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_engine_publishes_vllm_batches_over_zmq_and_replays_them(tiny_llama):
    """Requests sharing a prefix, then reset_prefix_cache: the SUB socket gets (topic, sequence, batch)
    messages whose BlockStored events chain the prompts' full blocks; the replay socket sends them again."""
    port, replay = _free_port(), _free_port()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}",
              "replay_endpoint": f"tcp://127.0.0.1:{replay}", "topic": "kv"}
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=BLOCK, num_kv_blocks=64,
                                    enable_prefix_caching=True, kv_events_config=config))
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    time.sleep(0.3)  # a PUB socket drops what it sends before the subscription arrives
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    try:
        shared = random_prompts(1, 24, 24, seed=51)[0]
        prompts = [shared + p for p in random_prompts(2, 9, 9, seed=52)]
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, params, request_id=f"r{i}")
            while engine.has_unfinished_requests():
                engine.step()
        assert engine.reset_prefix_cache()
        messages = []
        while sub.poll(2000):
            topic, seq, payload = sub.recv_multipart()
            messages.append((topic, int.from_bytes(seq, "big"), payload))
            if isinstance(decoder.decode(payload).events[-1], VllmAllBlocksCleared):
                break
        assert [m[0] for m in messages] == [b"kv"] * len(messages)
        assert [m[1] for m in messages] == list(range(len(messages)))
        events = [e for _, _, payload in messages for e in decoder.decode(payload).events]
        stored = [e for e in events if isinstance(e, VllmBlockStored)]
        # The first prompt's three full blocks (24 + 9 tokens, then its outputs: 36 known), chained from none;
        # the second's own block after the shared three, chained to the third.
        first = stored[0]
        assert first.parent_block_hash is None and first.block_size == BLOCK and first.lora_id is None
        assert first.token_ids[:32] == prompts[0][:32]
        hashes = [h for e in stored for h in e.block_hashes]
        assert len(hashes) == len(set(hashes)) and all(isinstance(h, bytes) for h in hashes)
        later = [e for e in stored if e.token_ids[:8] == prompts[1][24:32]]
        assert later and later[0].parent_block_hash == first.block_hashes[2]
        assert isinstance(events[-1], VllmAllBlocksCleared)
        # Replay from sequence 1: every later batch again, then the end marker.
        dealer = context.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay}")
        dealer.send_multipart((b"", (1).to_bytes(8, "big")))
        replayed = []
        while dealer.poll(2000):
            _, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            replayed.append((int.from_bytes(seq, "big"), payload))
        assert replayed == [(s, p) for _, s, p in messages[1:]]
        dealer.close(linger=0)
    finally:
        sub.close(linger=0)
        context.term()
        engine.shutdown()


def test_kv_events_config_takes_vllms_keys_and_refuses_others(tiny_llama):
    cfg = KVEventsConfig.parse('{"enable_kv_cache_events": true}')
    assert cfg.publisher == "zmq" and cfg.endpoint == "tcp://*:5557" and cfg.publishes
    assert KVEventsConfig.parse({"enable_kv_cache_events": False}).publisher == "null"
    with pytest.raises(ValueError, match="unknown kv_events_config key"):
        KVEventsConfig.parse({"enable_kv_cache_events": True, "port": 1})
    with pytest.raises(ValueError, match="publisher must be one of"):
        KVEventsConfig.parse({"enable_kv_cache_events": True, "publisher": "kafka"})
    with pytest.raises(ValueError, match="prefix cache"):
        LLMEngine(EngineConfig(model=str(tiny_llama), enable_prefix_caching=False,
                               kv_events_config={"enable_kv_cache_events": True, "publisher": "null"}))
    replica = KVEventsConfig(True, endpoint="tcp://*:5557", replay_endpoint="ipc:///tmp/kv").for_replica(2)
    assert (replica.endpoint, replica.replay_endpoint, replica.data_parallel_rank) == (
        "tcp://*:5559", "ipc:///tmp/kv_dp2", 2)
    batch = msgspec.msgpack.Decoder(type=KVEventBatch).decode(encode_batch([AllBlocksCleared()], 2, ts=1.5))
    assert (batch.ts, batch.data_parallel_rank, batch.events) == (1.5, 2, [VllmAllBlocksCleared()])
    args = build_parser().parse_args(["serve", "m", "--kv-events-config", '{"enable_kv_cache_events": true}'])
    assert EngineConfig(model="m", kv_events_config=args.kv_events_config).kv_events_config.publishes
