"""KV offloading (vLLM's --kv-offloading-size): the prefix cache's evicted blocks kept in host memory and
copied back when a later prompt shares their prefix. The manager's bookkeeping (what is copied where, in which
order, LRU in the host pool), and end to end: prompts whose blocks the device evicted are served from the host
pool with the very answers they had, and an engine without the pool recomputes them."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts

from plait import LLM, SamplingParams
from plait.engine.kv_cache import KVCacheManager
from plait.engine.kv_offload import HostBlockPool, KVTransfer, transfer_runs
from plait.engine.request import Request

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _request(ids: list[int], rid: str = "r") -> Request:
    return Request(rid, ids, GREEDY, max_tokens=4)


def _compute(kv: KVCacheManager, request: Request) -> None:
    """Admit ``request``, give it blocks for its whole prompt, and cache them as a step would."""
    kv.match_prefix(request)
    assert kv.allocate(request, request.num_tokens - request.num_computed_tokens)
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)


def test_evicted_blocks_go_to_the_host_pool_and_come_back_in_order():
    kv = KVCacheManager(num_blocks=5, block_size=BLOCK, enable_prefix_caching=True, num_host_blocks=8)
    first = _request(list(range(10, 23)))  # 13 tokens: 3 full blocks, cached, and a partial one
    _compute(kv, first)
    kv.free(first)
    assert kv.take_transfers() == []  # nothing evicted yet: no copy
    other = _request(list(range(50, 63)), "o")  # takes the 4 blocks (its own tokens), evicting first's
    _compute(kv, other)
    out = kv.take_transfers()
    # first's cached blocks 3, 2, 1 (freed tail first) leave for host blocks before other's tokens land
    assert out == [KVTransfer(True, 3, 7), KVTransfer(True, 2, 6), KVTransfer(True, 1, 5)]
    assert kv.stats.offloaded_blocks == 3 and len(kv.host) == 3
    kv.free(other)
    again = _request(list(range(10, 23)), "a")
    assert kv.match_prefix(again) == 12  # every full block but the last token's, from the host pool
    # Into the free blocks in turn: block 1 held nothing cached; blocks 2 and 3 held other's, which go out
    # to the host first, so that each copy reads what it should.
    assert kv.take_transfers() == [KVTransfer(False, 1, 5), KVTransfer(True, 2, 4), KVTransfer(False, 2, 6),
                                   KVTransfer(True, 3, 3), KVTransfer(False, 3, 7)]
    assert again.block_ids == [1, 2, 3] and kv.stats.host_hits == 12
    # A block held by the host pool already is not copied again when the device evicts it once more.
    kv.free(again)
    _compute(kv, _request(list(range(50, 63)), "o2"))
    assert [t for t in kv.take_transfers() if t.to_host] == []


def test_host_pool_is_lru_and_a_reset_forgets_it():
    pool = HostBlockPool(2)
    a, b = pool.store(b"a"), pool.store(b"b")
    assert pool.store(b"a") is None and pool.find(b"a") == a  # held: nothing to copy; now most recent
    assert pool.store(b"c") == b and pool.find(b"b") is None  # b was the least recently used
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK, enable_prefix_caching=True, num_host_blocks=1)
    for rid, start in (("r", 10), ("r2", 30)):  # r2 evicts r's two blocks into the pool (of one)
        request = _request(list(range(start, start + 8)), rid)
        _compute(kv, request)
        kv.free(request)
    assert len(kv.host) == 1 and kv.stats.offloaded_blocks == 2
    assert kv.reset_prefix_cache() and len(kv.host) == 0 and kv.take_transfers() == []
    assert KVCacheManager(3, BLOCK, enable_prefix_caching=False, num_host_blocks=4).host is None


def test_a_pool_of_one_block_never_loads_what_it_just_lost():
    """The device block taken for a load held a cached block of its own, which takes the pool's only
    block: the load is dropped (its data is gone) and the block goes back to the free queue."""
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK, enable_prefix_caching=True, num_host_blocks=1)
    a = _request(list(range(10, 18)))
    _compute(kv, a)
    kv.free(a)
    b = _request(list(range(30, 38)), "b")
    _compute(kv, b)  # evicts a's blocks 2 then 1: the pool ends up holding a's first block
    kv.free(b)
    assert kv.take_transfers() == [KVTransfer(True, 2, 0), KVTransfer(True, 1, 0)]
    again = _request(list(range(10, 18)), "a2")
    assert kv.match_prefix(again) == 0 and again.block_ids == []
    assert kv.take_transfers() == [KVTransfer(True, 1, 0)]  # b's block went out; nothing came back
    assert kv.num_free_blocks == 2


def _engine(tiny_llama, offload_blocks: int, **knobs) -> LLM:
    """A cache of 24 device blocks of 4 tokens; a host pool of ``offload_blocks`` such blocks."""
    probe = LLM(str(tiny_llama), block_size=BLOCK, num_kv_blocks=24, enable_prefix_caching=True)
    caches = probe.engine.runner.kv_caches
    block_bytes = len(caches) * caches[0][:, 0].numel() * caches[0].element_size()
    size = offload_blocks * block_bytes / 2**30 if offload_blocks else None
    return LLM(str(tiny_llama), block_size=BLOCK, num_kv_blocks=24, enable_prefix_caching=True,
               kv_offloading_size=size, max_num_seqs=2, **knobs)


def _answers(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


@pytest.mark.parametrize("knobs", [{}, dict(max_num_batched_tokens=16), dict(kv_cache_dtype="fp8")],
                         ids=["whole", "chunked", "fp8-cache"])
def test_prompts_evicted_from_the_device_come_back_from_host_memory(tiny_llama, knobs):
    """Two conversations' prompts, then others that evict them from the device's 24 blocks, then the first
    two again: with a host pool their prefixes are copied back (no recompute; an FP8 cache's codes as
    bytes) and the answers are the first run's, bit for bit; without one they are recomputed (no hit)."""
    first = random_prompts(2, 30, 40, seed=41)
    others = random_prompts(4, 30, 40, seed=42)
    offloading = _engine(tiny_llama, 64, **knobs)
    want, _ = _answers(offloading, first)
    _answers(offloading, others)
    got, cached = _answers(offloading, first)
    assert got == want
    assert all(c >= 28 for c in cached), cached
    stats = offloading.engine.kv_cache.stats
    assert stats.host_hits >= 56 and stats.offloaded_blocks > 0
    plain = _engine(tiny_llama, 0, **knobs)
    _answers(plain, first)
    _answers(plain, others)
    again, plain_cached = _answers(plain, first)
    assert again == want and plain_cached == [0, 0]
    assert offloading.engine.is_idle_and_clean()


def test_host_hits_are_vllms_external_prefix_cache_metrics(tiny_llama, caplog):
    """As vLLM with its offloading connector: tokens copied back from host memory count as external hits
    (vllm:external_prefix_cache_hits, out of vllm:external_prefix_cache_queries), not as the device's
    vllm:prefix_cache_hits; the periodic log line gains vLLM's external hit rate; and an engine without a
    host pool has none of these."""
    pytest.importorskip("prometheus_client")
    import logging

    from plait.entrypoints.async_engine import EngineStats, _offload_stats
    from plait.entrypoints.metrics import ServerMetrics
    from plait.entrypoints.stat_logger import StatLogger, TokenTotals

    first = random_prompts(2, 30, 40, seed=41)
    llm = _engine(tiny_llama, 64)
    _answers(llm, first)
    _answers(llm, random_prompts(4, 30, 40, seed=42))
    kv = llm.engine.kv_cache
    before = EngineStats(prefix_cache_queries=kv.stats.queries, prefix_cache_hits=kv.stats.local_hits,
                         **_offload_stats(llm.engine))
    _, cached = _answers(llm, first)
    stats = kv.stats
    assert stats.external_hits == sum(cached) and stats.local_hits == 0  # each prefix came back from the host
    now = EngineStats(prefix_cache_queries=stats.queries, prefix_cache_hits=stats.local_hits,
                      **_offload_stats(llm.engine))
    text = ServerMetrics(lambda: now, "tiny").render().decode()
    for name, value in (("external_prefix_cache_hits", stats.external_hits),
                        ("external_prefix_cache_queries", stats.queries), ("prefix_cache_hits", 0)):
        assert f'vllm:{name}_total{{model_name="tiny"}} {float(value)}' in text, name
    assert f"plait_kv_offloaded_blocks_total {float(stats.offloaded_blocks)}" in text
    caplog.set_level(logging.INFO, logger="plait.entrypoints.stat_logger")
    stat_logger = StatLogger(lambda: now, TokenTotals(prompt=1))
    stat_logger._last = before
    assert stat_logger.log(1.0)
    asked = sum(len(p) for p in first)
    assert caplog.records[-1].getMessage().endswith(
        f"External prefix cache hit rate: {100 * sum(cached) / asked:.1f}%")
    plain = _engine(tiny_llama, 0)
    assert "external" not in ServerMetrics(lambda: EngineStats(**_offload_stats(plain.engine)), "tiny"
                                           ).render().decode()


def test_split_over_two_ranks_each_copies_its_heads(tiny_llama):
    """Two gloo ranks, each with its heads' share of every block in its own host pool: the driver sends each
    step's copies to the other rank before the forward, and the returning prompts answer as before."""
    first = random_prompts(2, 30, 40, seed=45)
    others = random_prompts(4, 30, 40, seed=46)
    llm = _engine(tiny_llama, 64, tensor_parallel_size=2)
    try:
        want, _ = _answers(llm, first)
        _answers(llm, others)
        got, cached = _answers(llm, first)
        assert got == want and all(c >= 28 for c in cached), cached
        assert llm.engine.kv_cache.stats.host_hits >= 56
        assert llm.engine.runner.num_host_kv_blocks == 64  # half of each block a rank, in half the memory
    finally:
        llm.engine.shutdown()


CONNECTOR = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"num_cpu_blocks": 64}}


def test_vllms_offloading_connector_config_is_the_same_host_tier(tiny_llama):
    """vLLM's --kv-transfer-config form of its native CPU offloading (OffloadingConnector, num_cpu_blocks)
    from the command line: that many host blocks, and the returning prompts answer from them as with
    --kv-offloading-size."""
    import json

    from plait.entrypoints.cli import _engine_config, build_parser

    args = build_parser().parse_args(["serve", str(tiny_llama), "--block-size", str(BLOCK), "--num-kv-blocks",
                                      "24", "--kv-transfer-config", json.dumps(CONNECTOR)])
    config = _engine_config(args)
    assert config.kv_offloading_blocks == 64 and config.kv_offloading_size is None
    llm = LLM(str(tiny_llama), block_size=BLOCK, num_kv_blocks=24, enable_prefix_caching=True,
              kv_transfer_config=json.dumps(CONNECTOR), max_num_seqs=2)
    assert llm.engine.runner.num_host_kv_blocks == 64
    first = random_prompts(2, 30, 40, seed=41)
    want, _ = _answers(llm, first)
    _answers(llm, random_prompts(4, 30, 40, seed=42))
    got, cached = _answers(llm, first)
    assert got == want and all(c >= 28 for c in cached), cached
    assert llm.engine.kv_cache.stats.external_hits == sum(cached)


@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(kv_connector="NixlConnector"), "kv_connector 'NixlConnector' is not supported"),
    (lambda c: c.update(kv_connector="LMCacheConnectorV1"), "no disaggregated prefill or external KV stores"),
    (lambda c: c.update(kv_role="kv_producer"), "kv_role 'kv_producer'"),
    (lambda c: c.update(kv_port=14579), r"keys \['kv_port'\] are not supported"),
    (lambda c: c["kv_connector_extra_config"].update(block_size=64), "block_size 64"),
    (lambda c: c["kv_connector_extra_config"].update(num_cpu_blocks=0), "num_cpu_blocks must be"),
    (lambda c: c["kv_connector_extra_config"].update(cpu_bytes=1), r"keys \['cpu_bytes'\] are not supported"),
    (lambda c: c["kv_connector_extra_config"].update(spec_name="DiskSpec"), "spec_name 'DiskSpec'"),
])
def test_other_kv_transfer_configs_are_refused_by_name(tiny_llama, change, message):
    import copy

    config = copy.deepcopy(CONNECTOR)
    change(config)
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_llama), block_size=BLOCK, kv_transfer_config=config)
    with pytest.raises(ValueError, match="both size the host tier"):
        LLM(str(tiny_llama), block_size=BLOCK, kv_transfer_config=CONNECTOR, kv_offloading_size=1)


def test_offloading_is_checked(tiny_llama):
    with pytest.raises(ValueError, match="kv_offloading_size must be a number of GiB > 0"):
        LLM(str(tiny_llama), kv_offloading_size=0)
    with pytest.raises(ValueError, match="kv_offloading_backend 'lmcache' is not supported"):
        LLM(str(tiny_llama), kv_offloading_size=1, kv_offloading_backend="lmcache")
    with pytest.raises(ValueError, match="holds no KV block"):
        LLM(str(tiny_llama), kv_offloading_size=1e-12)
    llm = LLM(str(tiny_llama), kv_offloading_size=0.001, enable_prefix_caching=False)
    assert llm.engine.runner.num_host_kv_blocks > 0 and llm.engine.kv_cache.host is None  # ignored, logged


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_blocks_copied_back_answer_as_blocks_never_evicted(tmp_path):
    """bf16, CUDA graphs, overlapped steps, copies between pinned host memory and the device on the step's
    stream: prompts whose blocks were evicted and copied back answer exactly as on an engine whose cache
    never evicted them (the same cached prefix, so the same step shapes)."""
    import json

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
           "intermediate_size": 2816, "num_hidden_layers": 4, "num_attention_heads": 16,
           "num_key_value_heads": 4, "vocab_size": 8192, "max_position_embeddings": 2048,
           "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    knobs = dict(load_format="dummy", seed=3, dtype="bfloat16", block_size=16, enable_prefix_caching=True,
                 max_num_seqs=8)
    first = random_prompts(8, 200, 300, seed=43)
    others = random_prompts(8, 200, 300, seed=44)
    runs = {}
    for name, extra in (("offloading", dict(num_kv_blocks=160, kv_offloading_size=0.5)),
                        ("roomy", dict(num_kv_blocks=4096))):
        llm = LLM(str(tmp_path), **knobs, **extra)
        _answers(llm, first)
        _answers(llm, others)
        runs[name] = _answers(llm, first)
        stats = llm.engine.kv_cache.stats
        assert (stats.host_hits > 0) == (name == "offloading"), stats
    assert runs["offloading"] == runs["roomy"]
    assert min(runs["offloading"][1]) >= 192


def test_copies_out_go_first_where_that_changes_nothing():
    out_a, in_a, out_b, in_b = (KVTransfer(True, 2, 4), KVTransfer(False, 1, 5), KVTransfer(True, 3, 3),
                                KVTransfer(False, 2, 6))
    assert transfer_runs([in_a, out_a, in_b, out_b]) == [[out_a, out_b], [in_a, in_b]]
    # A copy out that writes a host block an earlier copy in reads, or reads a device block it wrote: as given
    clobbers = KVTransfer(True, 3, 5)
    assert transfer_runs([in_a, clobbers, in_b]) == [[in_a], [clobbers], [in_b]]
    reads_loaded = KVTransfer(True, 1, 7)
    assert transfer_runs([in_a, reads_loaded]) == [[in_a], [reads_loaded]]
    assert transfer_runs([]) == []
