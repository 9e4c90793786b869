"""Engine invariants on a real (tiny, random) model: chunked == single-shot, mixed == alone,
preemption by recompute, and nothing leaks."""

from __future__ import annotations

import gc
import itertools
import json
import os
import weakref

import pytest
import torch
from conftest import random_prompts, run_greedy

from plait.config import EngineConfig
from plait.engine.engine import LLMEngine
from plait.sampling_params import SamplingParams

LOGITS_ATOL = 1e-4
MAX_TOKENS = 10


def _engine(folder, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(folder), block_size=8, **kw))


@pytest.fixture(scope="module")
def prompts():
    # Lengths up to 150 so that prompts are longer than the 16/33/64 budgets.
    return random_prompts(8, 1, 150, seed=3)


@pytest.fixture(scope="module")
def single_shot(tiny_models, prompts):
    """Each prompt alone, its whole prompt in one chunk: the reference."""
    refs = {}
    for family in ("llama", "mistral"):
        engine = _engine(tiny_models[family], max_num_batched_tokens=512)
        outs, logits = {}, {}
        for i, p in enumerate(prompts):
            o, lg = run_greedy(engine, [p], MAX_TOKENS, capture_logits=True)
            outs[i], logits[i] = o[0], torch.stack(lg[0])
        refs[family] = (outs, logits)
    return refs


@pytest.mark.parametrize("budget,threshold", list(itertools.product([16, 33, 64, 512], [0, 7, 32])))
def test_chunked_equals_single_shot(tiny_models, prompts, single_shot, budget, threshold):
    # Mistral's sliding window (24) is shorter than most prompts: chunks must respect it too.
    for family in ("llama", "mistral"):
        engine = _engine(tiny_models[family], max_num_batched_tokens=budget,
                         long_prefill_token_threshold=threshold)
        outs, logits = run_greedy(engine, prompts, MAX_TOKENS, capture_logits=True)
        ref_outs, ref_logits = single_shot[family]
        for i in range(len(prompts)):
            assert outs[i] == ref_outs[i], f"{family} prompt {i}: tokens depend on chunking"
            torch.testing.assert_close(torch.stack(logits[i]), ref_logits[i], atol=LOGITS_ATOL, rtol=0)
        assert engine.is_idle_and_clean()


def test_mixed_equals_alone(tiny_llama):
    """32 requests arriving at different steps: each output equals its solo output."""
    prompts = random_prompts(32, 1, 90, seed=11)
    solo_engine = _engine(tiny_llama, max_num_batched_tokens=512)
    solo = {i: run_greedy(solo_engine, [p], MAX_TOKENS)[0][0] for i, p in enumerate(prompts)}
    engine = _engine(tiny_llama, max_num_batched_tokens=40, long_prefill_token_threshold=24)
    engine.record_timeline = True
    mixed, _ = run_greedy(engine, prompts, MAX_TOKENS, arrive_every=2)
    assert mixed == solo
    # The run really mixed: some steps carried prefill chunks and decodes together.
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in engine.timeline)
    assert engine.is_idle_and_clean()


def test_short_prompt_passes_long_ones_under_max_long_partial_prefills(tiny_llama):
    """Two long prompts then a short one, all at once, 16-token chunks: with one long partial prefill at a
    time the short prompt's first token comes before the second long prompt starts; by default (FCFS) it
    waits behind both. The answers are the same either way."""
    prompts = random_prompts(2, 100, 100, seed=7) + random_prompts(1, 6, 6, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    answers, first_token_steps, first_chunk_steps = [], [], []
    for limit in (None, 1):
        engine = _engine(tiny_llama, max_num_batched_tokens=32, long_prefill_token_threshold=16,
                         max_num_partial_prefills=3, max_long_partial_prefills=limit)
        for i, p in enumerate(prompts):
            engine.add_request(p, params, request_id=f"r-{i}")
        first_token, first_chunk, outputs, step = {}, {}, {}, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                first_token.setdefault(out.request_id, step)
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids
            for request in engine.scheduler.running:
                first_chunk.setdefault(request.request_id, step)
            step += 1
        answers.append(outputs)
        first_token_steps.append(first_token)
        first_chunk_steps.append(first_chunk)
        assert engine.is_idle_and_clean()
    assert answers[0] == answers[1]
    fcfs, limited = first_token_steps
    assert fcfs["r-2"] > first_chunk_steps[0]["r-1"], "by default the short prompt waits its turn"
    assert limited["r-2"] < first_chunk_steps[1]["r-1"], "the short prompt did not pass the long one"
    assert limited["r-2"] < fcfs["r-2"]


def test_disable_sliding_window_caps_the_context_at_the_window(tiny_models, single_shot, prompts):
    """vLLM's disable_sliding_window: the tiny Mistral's window (24) becomes its max_model_len, so no window
    binds; answers that fit are those with the window on. A model without a window keeps its length."""
    engine = _engine(tiny_models["mistral"], disable_sliding_window=True, max_num_batched_tokens=512)
    assert engine.max_model_len == 24
    short = [i for i, p in enumerate(prompts) if len(p) + MAX_TOKENS <= 24]
    assert short, "no prompt fits the window"
    outs, _ = run_greedy(engine, [prompts[i] for i in short], MAX_TOKENS)
    assert [outs[k] for k in range(len(short))] == [single_shot["mistral"][0][i] for i in short]
    with pytest.raises(ValueError, match="maximum context length is 24 tokens"):
        engine.add_request(list(range(1, 30)), SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="max_model_len 64 exceeds the model's sliding window 24"):
        _engine(tiny_models["mistral"], disable_sliding_window=True, max_model_len=64)
    assert _engine(tiny_models["llama"], disable_sliding_window=True).max_model_len == 512


def test_rope_scaling_and_theta_replace_the_checkpoints(tiny_llama, prompts):
    """vLLM's --rope-scaling / --rope-theta: the model is built with them in place of its config's (whole, as
    hf_overrides would merge them into an existing scaling), and the answers change with them."""
    scaling = {"rope_type": "linear", "factor": 2.0}
    plain, _ = run_greedy(_engine(tiny_llama), prompts, MAX_TOKENS)
    engine = _engine(tiny_llama, rope_scaling=json.dumps(scaling), rope_theta=50_000)
    assert engine.model_config.rope_scaling["factor"] == 2.0 and engine.model_config.rope_theta == 50_000
    got, _ = run_greedy(engine, prompts, MAX_TOKENS)
    same, _ = run_greedy(_engine(tiny_llama, hf_overrides={"rope_scaling": scaling, "rope_theta": 50_000}),
                         prompts, MAX_TOKENS)
    assert got == same and got != plain
    with pytest.raises(ValueError, match="rope_theta must be a positive number"):
        EngineConfig(rope_theta=-1.0)


def test_loading_an_hf_checkpoint_shows_its_shards_progress(tiny_llama, capsys):
    """vLLM's use_tqdm_on_load (on by default): a bar over the checkpoint's shards as they load; off: none."""
    _engine(tiny_llama)
    assert "Loading safetensors shards" in capsys.readouterr().err
    _engine(tiny_llama, use_tqdm_on_load=False)
    assert "Loading safetensors shards" not in capsys.readouterr().err


def test_preemption_by_recompute_keeps_outputs(tiny_llama):
    """Too few KV blocks for everyone at once: requests are preempted, resume, and still match."""
    prompts = random_prompts(12, 20, 60, seed=5)
    max_tokens = 24
    solo_engine = _engine(tiny_llama, max_num_batched_tokens=512)
    solo = {i: run_greedy(solo_engine, [p], max_tokens)[0][0] for i, p in enumerate(prompts)}
    # 12 requests of up to 84 tokens need ~11 blocks each; 40 blocks force preemption.
    engine = _engine(tiny_llama, max_num_batched_tokens=64, num_kv_blocks=40, max_model_len=128)
    engine.record_timeline = True
    outs, _ = run_greedy(engine, prompts, max_tokens)
    assert sum(s.num_preempted for s in engine.timeline) > 0, "the test did not force a preemption"
    # The timeline counts the queue: all 12 arrived at once, the first step admitted its rows' requests.
    first = engine.timeline[0]
    assert first.num_waiting == 12 - first.num_rows > 0 and engine.timeline[-1].num_waiting == 0
    assert outs == solo
    assert engine.is_idle_and_clean()


def test_prefill_first_policy_gives_same_outputs(tiny_llama):
    prompts = random_prompts(10, 1, 80, seed=9)
    ref, _ = run_greedy(_engine(tiny_llama, max_num_batched_tokens=512), prompts, MAX_TOKENS)
    engine = _engine(tiny_llama, max_num_batched_tokens=32, scheduling_policy="prefill_first")
    outs, _ = run_greedy(engine, prompts, MAX_TOKENS, arrive_every=1)
    assert outs == ref


def test_abort_frees_blocks(tiny_llama):
    from plait.sampling_params import SamplingParams

    engine = _engine(tiny_llama, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for i, p in enumerate(random_prompts(4, 10, 60, seed=2)):
        engine.add_request(p, params, request_id=f"a-{i}")
    for _ in range(3):
        engine.step()
    assert engine.kv_cache.num_used_blocks > 0
    for i in range(4):
        engine.abort_request(f"a-{i}")
    assert engine.is_idle_and_clean()
    assert engine.step() == []


def test_profiling_step_runs_at_the_full_budget(tiny_llama):
    """The step that sizes the GPU KV cache (a forward at max_num_batched_tokens on a throwaway cache,
    rows capped at max_model_len, and a top-p sampling of max_num_seqs rows) runs on any device."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), max_num_batched_tokens=100, max_model_len=64,
                                    max_num_seqs=8))
    engine.runner._profile_step()
    assert engine.is_idle_and_clean()


def freed_when_dropped(**config) -> list[bool]:
    """Build an engine, run a request, drop it with the cycle collector off: whether each thing it held
    (engine, runner, model, a KV cache, scheduler, buffers, graphs) was freed by reference counting alone,
    read before the collector is back on (a collection it runs then would hide a cycle)."""
    gc.disable()
    try:
        engine = LLMEngine(EngineConfig(**config))
        engine.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        runner = engine.runner
        held = [engine, runner, runner.model, runner.kv_caches[0], engine.scheduler, runner.buffers]
        if runner.graphs is not None:
            held.append(runner.graphs)
        refs = [weakref.ref(o) for o in held]
        del engine, runner, held
        return [r() is None for r in refs]
    finally:
        gc.enable()


def test_a_dropped_engine_caught_in_a_cycle_is_freed_when_the_next_one_starts(tiny_llama):
    """An engine its user's code ties into a cycle (here a caught exception's traceback, whose frame holds
    it), after a CUDA engine froze the heap: the next engine's start collects it, so its KV cache does not
    keep the memory the new engine sizes its own from."""
    config = dict(model=str(tiny_llama), num_kv_blocks=32, max_model_len=128)

    def check(engine: LLMEngine) -> None:
        try:
            raise ValueError("refused")
        except ValueError as err:
            caught = err  # noqa: F841 (this frame holds the error, whose traceback holds this frame)

    engine = LLMEngine(EngineConfig(**config))
    check(engine)
    ref = weakref.ref(engine)
    del engine
    gc.freeze()  # as freeze_long_lived_objects does on CUDA
    try:
        assert ref() is not None, "the cycle should keep the engine until a collection"
        LLMEngine(EngineConfig(**config))
        assert ref() is None
    finally:
        gc.unfreeze()


def test_a_dropped_engine_is_freed_without_the_cycle_collector(tiny_llama):
    """On CUDA the engine freezes the GC heap after start-up (freeze_long_lived_objects): from then on
    only reference counting frees what it holds, so it must hold no reference cycle."""
    freed = freed_when_dropped(model=str(tiny_llama), num_kv_blocks=32, max_model_len=128)
    assert freed == [True] * len(freed)


def _collections_while_decoding(folder, gen0: int) -> int:
    """Cyclic-GC runs while 256 requests decode 16 tokens each, with generation 0's threshold at gen0."""
    engine = _engine(folder, max_num_batched_tokens=4096, max_num_seqs=256, num_kv_blocks=1024)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for prompt in random_prompts(256, 4, 12, seed=5):
        engine.add_request(prompt, params)
    engine.step()  # the prompts: start counting once every request decodes
    runs = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            runs.append(info["generation"])

    saved = gc.get_threshold()
    gc.collect()
    gc.set_threshold(gen0, *saved[1:])
    gc.callbacks.append(count)
    try:
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        gc.callbacks.remove(count)
        gc.set_threshold(*saved)
    return len(runs)


def test_the_raised_gc_threshold_keeps_the_step_loop_free_of_collections(tiny_llama):
    """On CUDA the engine raises generation 0's threshold (raise_gc_threshold): at Python's default the
    step loop's short-lived objects start collections every few steps, each a pause between GPU steps."""
    from plait.engine.engine import STEP_LOOP_GC_GEN0_THRESHOLD, raise_gc_threshold

    assert _collections_while_decoding(tiny_llama, 700) > 0
    assert _collections_while_decoding(tiny_llama, STEP_LOOP_GC_GEN0_THRESHOLD) == 0
    saved = gc.get_threshold()
    try:
        gc.set_threshold(700, *saved[1:])
        raise_gc_threshold()
        assert gc.get_threshold()[0] == STEP_LOOP_GC_GEN0_THRESHOLD
        gc.set_threshold(10**6, *saved[1:])
        raise_gc_threshold()  # never lowers a larger one
        assert gc.get_threshold()[0] == 10**6
        gc.set_threshold(0)
        raise_gc_threshold()  # nor turns automatic collection back on
        assert gc.get_threshold()[0] == 0
    finally:
        gc.set_threshold(*saved)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux's /proc")
def test_a_cpu_kv_cache_is_zeros_that_take_memory_only_when_written():
    """The CPU KV cache is zeros (torch_ref multiplies padded keys' zero probabilities by their V: junk there
    could be NaN) whose pages the OS fills as blocks are first written: a 2 GiB cache costs no start-up time
    and no resident memory before use."""
    from plait.runner.model_runner import zeroed

    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        t = zeroed((2, 3, 16, 2, 8), dtype, torch.device("cpu"))
        assert t.shape == (2, 3, 16, 2, 8) and t.dtype == dtype and t.is_contiguous()
        assert not t.float().any()
        t[1, 2] = 1  # writable, in place
        assert t.float().sum() == 16 * 2 * 8
    gc.collect()
    before = _resident_bytes()
    big = zeroed((64, 1024, 1024), torch.float32, torch.device("cpu"))  # 256 MiB
    assert _resident_bytes() - before < (32 << 20)
    big[0].fill_(1.0)  # one 4 MiB slice written: roughly that much becomes resident
    assert _resident_bytes() - before < (48 << 20) and big[1].sum() == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_step_breakdown_phases_are_disjoint(tiny_llama, async_scheduling):
    """The wait for a step's ids (ModelRunner.collect) is the runner's "sample" phase only, never also the
    engine's schedule or postprocess: with each collect made 20 ms slower, the host phases still sum to no
    more than the steps' wall time."""
    import time

    engine = LLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=64, block_size=8,
                                    async_scheduling=async_scheduling))
    collect = engine.runner.collect

    class SlowCopy:  # stands for the device-to-host copy of a GPU step's ids, which collect waits for
        def synchronize(self):
            time.sleep(0.02)

    def slow_collect(step):
        step.copied = SlowCopy()
        return collect(step)

    engine.runner.collect = slow_collect
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i, p in enumerate(random_prompts(3, 4, 12, seed=31)):
        engine.add_request(p, params, request_id=str(i))
    b = engine.runner.breakdown
    b.reset()
    while engine.has_unfinished_requests():
        engine.step()
    assert b.host_s["sample"] >= 0.02 * 6
    assert sum(b.host_s.values()) <= b.wall_s
