"""Prefix caching: outputs equal cache-off outputs for every prefix length, budget and preemption;
reference counts stay sound under random arrivals, shared prefixes and aborts (hypothesis)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from conftest import TINY_VOCAB, run_greedy
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.config import EngineConfig
from plait.engine.engine import LLMEngine
from plait.engine.kv_cache import KVCacheManager
from plait.engine.request import FinishReason, Request
from plait.engine.scheduler import Scheduler
from plait.sampling_params import SamplingParams

BLOCK = 8
MAX_TOKENS = 8


def _shared_prefix_prompts(prefix_len: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, TINY_VOCAB, (prefix_len,), generator=g).tolist()
    tails = [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in (5, 1, 13, 0, 9, 2)]
    # The tail of length 0 makes one prompt exactly the prefix: the cache must still leave a token.
    return [prefix + t for t in tails if prefix + t]


@pytest.fixture(scope="module")
def engines(tiny_llama):
    def make(caching: bool, budget: int, **kw) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(tiny_llama), block_size=BLOCK, max_num_batched_tokens=budget,
                                      enable_prefix_caching=caching, **kw))
    return make


# Prefix shorter than a block, exactly one, several plus a remainder.
@pytest.mark.parametrize("prefix_len", [5, BLOCK, 3 * BLOCK + 3])
@pytest.mark.parametrize("budget", [16, 64, 512])
def test_cache_on_equals_cache_off(engines, prefix_len, budget):
    prompts = _shared_prefix_prompts(prefix_len, seed=prefix_len)
    ref, _ = run_greedy(engines(False, 512), prompts, MAX_TOKENS)
    engine = engines(True, budget)
    # Arrivals spread over steps so later requests find earlier ones' blocks cached.
    outs, _ = run_greedy(engine, prompts, MAX_TOKENS, arrive_every=3)
    assert outs == ref
    if prefix_len >= BLOCK:
        assert engine.kv_cache.stats.hits > 0
    # Second pass over the same prompts: now every full prefix block is cached.
    outs2, _ = run_greedy(engine, prompts, MAX_TOKENS)
    assert outs2 == ref
    assert engine.is_idle_and_clean()


def test_cache_with_forced_preemption(engines):
    prompts = [p for k in (0, 1) for p in _shared_prefix_prompts(3 * BLOCK + 3, seed=40 + k)]
    ref, _ = run_greedy(engines(False, 512), prompts, 24)
    engine = engines(True, 32, num_kv_blocks=16, max_model_len=64)
    engine.record_timeline = True
    outs, _ = run_greedy(engine, prompts, 24, arrive_every=1)
    assert sum(s.num_preempted for s in engine.timeline) > 0, "the test did not force a preemption"
    assert outs == ref
    assert engine.kv_cache.stats.hits > 0
    assert engine.is_idle_and_clean()


def test_hit_leaves_one_token_and_counts(engines):
    engine = engines(True, 512)
    prompt = list(range(3, 3 + 2 * BLOCK))  # exactly two blocks
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for i in range(2):
        engine.add_request(prompt, params, request_id=f"x-{i}")
        outs = []
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.finished]
    # Second time: one full block hit; the last block is recomputed so the request can sample.
    assert outs[0].num_cached_tokens == BLOCK
    stats = engine.kv_cache.stats
    assert stats.queries == 4 * BLOCK and stats.hits == BLOCK and stats.hit_rate == 0.25


def test_sha256_names_blocks_as_vllms_default_hash(engines):
    """prefix_caching_hash_algo="sha256": blocks are named by 32-byte SHA-256 chains (parent, then the
    tokens as int64), prefixes hit as under blake2b, and the answers are the cache-off ones."""
    prompts = _shared_prefix_prompts(3 * BLOCK + 3, seed=7)
    ref, _ = run_greedy(engines(False, 512), prompts, MAX_TOKENS)
    engine = engines(True, 16, prefix_caching_hash_algo="sha256")
    outs, _ = run_greedy(engine, prompts, MAX_TOKENS, arrive_every=3)
    assert outs == ref and engine.kv_cache.stats.hits > 0
    request = Request("h", prompts[0], SamplingParams(), max_tokens=1)
    first, second = engine.kv_cache._hashes(request, 2)
    tokens = [np.asarray(prompts[0][i * BLOCK:(i + 1) * BLOCK], dtype=np.int64).tobytes() for i in (0, 1)]
    assert first == hashlib.sha256(tokens[0]).digest()
    assert second == hashlib.sha256(first + tokens[1]).digest()
    assert engine.kv_cache.num_cached_blocks and all(len(h) == 32 for h in engine.kv_cache._block_of)
    with pytest.raises(ValueError, match="prefix_caching_hash_algo must be one of blake2b, sha256"):
        EngineConfig(prefix_caching_hash_algo="xxhash")


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_reference_counts_sound_under_random_traffic(data):
    block_size = data.draw(st.integers(1, 8))
    num_blocks = data.draw(st.integers(12, 40))
    config = EngineConfig(max_num_batched_tokens=data.draw(st.integers(4, 64)), max_num_seqs=6,
                          block_size=block_size)
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    sched = Scheduler(config, kv)
    prefixes = [data.draw(st.lists(st.integers(0, 5), min_size=0, max_size=20)) for _ in range(3)]
    limit = (num_blocks - 1) * block_size // 2  # any one request fits comfortably
    live: list[Request] = []
    for step in range(120):
        if step < 60 and data.draw(st.booleans()):
            prefix = data.draw(st.sampled_from(prefixes))
            tail = data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=10))
            prompt = (prefix + tail)[: limit - 4]
            r = Request(f"r{step}", prompt, SamplingParams(), max_tokens=data.draw(st.integers(1, 4)))
            sched.add(r)
            live.append(r)
        if live and data.draw(st.integers(0, 9)) == 0:
            victim = live.pop(data.draw(st.integers(0, len(live) - 1)))
            sched.finish(victim, FinishReason.ABORT)
        plan = sched.schedule()
        sched.advance(plan)
        for row in plan.rows:
            if row.samples:
                row.request.output_token_ids.append(1)
                if len(row.request.output_token_ids) >= row.request.max_tokens:
                    sched.finish(row.request, FinishReason.LENGTH)
                    live.remove(row.request)
        _check_counts(kv, sched)
        if not live and step >= 60:
            break
    for r in list(live):
        sched.finish(r, FinishReason.ABORT)
    _check_counts(kv, sched)
    assert kv.num_free_blocks == kv.num_usable_blocks  # idle: every block free or free-and-cached


def _check_counts(kv: KVCacheManager, sched: Scheduler) -> None:
    holders: dict[int, int] = {}
    for r in list(sched.running) + list(sched.waiting):
        for b in r.block_ids:
            holders[b] = holders.get(b, 0) + 1
    assert not any(r.block_ids for r in sched.waiting), "waiting requests must not pin blocks"
    for b in range(1, kv.num_blocks):
        assert kv.ref_count(b) >= 0
        assert kv.ref_count(b) == holders.get(b, 0), f"block {b}: refcount != holders"
    assert kv.num_free_blocks == sum(1 for b in range(1, kv.num_blocks) if kv.ref_count(b) == 0)


def test_models_that_cannot_reuse_kv_turn_caching_off_with_a_reason(tiny_llama, monkeypatch, caplog):
    from plait.models.llama import LlamaForCausalLM

    monkeypatch.setattr(LlamaForCausalLM, "supports_prefix_caching", False)  # as a recurrent model says
    with caplog.at_level("WARNING"):
        engine = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=BLOCK))
    assert not engine.kv_cache.enable_prefix_caching
    assert "prefix caching is off" in caplog.text


def test_switch_turns_caching_off(engines):
    engine = engines(False, 512)
    prompts = _shared_prefix_prompts(3 * BLOCK, seed=1)
    run_greedy(engine, prompts + prompts, MAX_TOKENS)
    assert engine.kv_cache.stats.queries == 0 and engine.kv_cache.num_cached_blocks == 0


def test_cache_salt_keeps_cached_blocks_within_a_salt(engines):
    """vLLM's cache_salt: the same prompt hits the cache only under the same salt (unsalted requests share
    among themselves), a salt changes no answer, and an empty or non-string salt is refused up front."""
    engine = engines(True, 64)
    prompt = _shared_prefix_prompts(5 * BLOCK, seed=3)[0]

    def run(salt: str | None) -> tuple[int, list[int]]:
        rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=4), cache_salt=salt)
        outs = {}
        while engine.has_unfinished_requests():
            outs.update((o.request_id, o) for o in engine.step())
        return outs[rid].num_cached_tokens, list(outs[rid].outputs[0].token_ids)

    cold, tokens = run("tenant-a")
    hit, again = run("tenant-a")
    assert cold == 0 and hit >= 4 * BLOCK and again == tokens
    assert run("tenant-b")[0] == 0 and run(None)[0] == 0
    assert run(None) == (hit, tokens) and run("tenant-b") == (hit, tokens)
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add_request(prompt, SamplingParams(max_tokens=2), cache_salt="")
    with pytest.raises(TypeError, match="cache_salt"):
        engine.add_request(prompt, SamplingParams(max_tokens=2), cache_salt=7)
    assert not engine.has_unfinished_requests()


def test_llm_prompt_dicts_take_a_cache_salt(tiny_llama):
    """LLM.generate's prompt dicts carry vLLM's "cache_salt" to the engine."""
    from plait.entrypoints.llm import LLM

    llm = LLM(str(tiny_llama), block_size=BLOCK)
    ids = _shared_prefix_prompts(4 * BLOCK, seed=4)[0]
    params = SamplingParams(temperature=0.0, max_tokens=2)

    def cached(salt: str) -> int:
        (out,) = llm.generate([{"prompt_token_ids": ids, "cache_salt": salt}], params, use_tqdm=False)
        return out.num_cached_tokens

    assert cached("a") == 0 and cached("a") > 0 and cached("b") == 0
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate([{"prompt_token_ids": ids, "cache_salt": ""}], params, use_tqdm=False)
    # A beam search's every step keeps its prompt's salt: its blocks serve that salt only.
    from plait.sampling_params import BeamSearchParams

    other = _shared_prefix_prompts(4 * BLOCK, seed=5)[0]
    beams = BeamSearchParams(beam_width=2, max_tokens=2)
    llm.beam_search([{"prompt_token_ids": other, "cache_salt": "c"}], beams)
    (plain,) = llm.generate([other], params, use_tqdm=False)
    (salted,) = llm.generate([{"prompt_token_ids": other, "cache_salt": "c"}], params, use_tqdm=False)
    assert plain.num_cached_tokens == 0 and salted.num_cached_tokens > 0
    with pytest.raises(ValueError, match="cache_salt"):
        llm.beam_search([{"prompt_token_ids": other, "cache_salt": ""}], beams)
