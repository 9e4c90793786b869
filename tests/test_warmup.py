"""The start-up warm-up (plait/engine/warmup.py): it drives the step kinds a server's first requests take,
and leaves no trace: an engine that warmed up answers every request as a fresh one does."""

from __future__ import annotations

import pytest
import torch

from plait.config import EngineConfig
from plait.engine.engine import LLMEngine
from plait.engine.warmup import REQUEST_ID_PREFIX, SAMPLING_OPTIONS, warm_up
from plait.entrypoints.cli import _engine_config, build_parser
from plait.sampling_params import SamplingParams

BUDGET = 64  # small steps, so the long prompts are chunked beside the streams


def _engine(model, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), device="cpu", dtype="float32",
                                  max_num_batched_tokens=BUDGET, max_prefill_tokens_beside_decodes=32, **kw))


def _state(engine: LLMEngine) -> dict:
    """What earlier requests could leave behind in an idle engine."""
    kv = engine.kv_cache
    return {"free_order": list(kv._free), "cached_blocks": kv.num_cached_blocks,
            "stats": vars(kv.stats).copy(), "num_steps": engine.num_steps, "timeline": list(engine.timeline),
            "spec": vars(engine.spec_stats), "breakdown_steps": engine.runner.breakdown.steps,
            "unfinished": engine.has_unfinished_requests()}


def _answers(engine: LLMEngine) -> list[tuple[list[int], list]]:
    """Greedy, seeded and unseeded random requests (the unseeded ones follow the engine's own stream of
    draws), with logprobs, all at once; then a prompt that repeats another's beginning (a prefix-cache hit in
    either engine)."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 40, 90, 130)]
    params = [SamplingParams(temperature=0.0, max_tokens=12, logprobs=2),
              SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12),
              SamplingParams(temperature=1.0, max_tokens=12),
              SamplingParams(temperature=0.8, top_k=20, max_tokens=12, logprobs=1)]
    outs = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(p, sp, request_id=f"r{i}")
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
    hit = prompts[3][:64] + [7, 8, 9]
    engine.add_request(hit, SamplingParams(temperature=0.0, max_tokens=6), request_id="hit")
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs, o.num_cached_tokens)
            for _, o in sorted(outs.items())]


def test_warm_up_drives_the_step_kinds_of_first_requests_and_leaves_no_trace(tiny_llama):
    """The mixes take prompt chunks over a cached context beside decodes, prefix-cache hits and every sampling
    option; afterwards the engine's blocks, counters and draws are a fresh engine's, so it answers the same
    requests (greedy, seeded and unseeded random, a prefix hit) with the same tokens and logprobs."""
    engine = _engine(tiny_llama)
    fresh = _engine(tiny_llama)
    assert engine.warm_up_report is None  # CPU: no kernel compiles, so no warm-up at start
    engine.record_timeline = True
    seen = []
    add = engine.add_request
    engine.add_request = lambda p, params, **kw: seen.append((len(p), params)) or add(p, params, **kw)
    report = warm_up(engine)
    del engine.add_request
    assert report.requests == len(seen) > len(SAMPLING_OPTIONS) and report.skipped == 0
    assert report.steps == len(engine.timeline) == engine.num_steps
    steps = engine.timeline
    # Prompt chunks beside decodes, and more prompt tokens than one step's budget in flight (chunked).
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in steps)
    assert max(n for n, _ in seen) > BUDGET
    assert max(n for n, _ in seen) + 1 + max(p.max_tokens for _, p in seen) >= engine.max_model_len - 1
    assert engine.kv_cache.stats.hits > 0  # later prompts found the shared prefix
    for option in SAMPLING_OPTIONS:  # each option ran (alone and beside the others)
        assert sum(all(getattr(p, k) == v for k, v in option.items()) for _, p in seen) == 2
    assert all(p.seed is not None or p.temperature == 0 for _, p in seen), "an unseeded draw moves the stream"

    engine.forget_warm_up()
    engine.record_timeline = False
    assert _state(engine) == _state(fresh)
    assert _answers(engine) == _answers(fresh)


def test_forget_warm_up_refuses_a_busy_engine(tiny_llama):
    engine = _engine(tiny_llama)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=4), request_id=f"{REQUEST_ID_PREFIX}-x")
    with pytest.raises(ValueError, match="idle"):
        engine.forget_warm_up()
    with pytest.raises(ValueError, match="idle"):
        warm_up(engine)


def test_warm_up_fits_a_small_context_and_cache(tiny_llama):
    """Every mix is clipped to the context length and half the KV cache, and asks for no more logprobs than
    the engine returns: nothing is refused or preempted."""
    engine = _engine(tiny_llama, max_model_len=96, num_kv_blocks=24, max_logprobs=0)
    engine.record_timeline = True
    report = warm_up(engine)
    assert report.requests > 0 and report.skipped == 0
    assert not any(s.num_preempted for s in engine.timeline)
    engine.forget_warm_up()
    assert engine.kv_cache.num_used_blocks == 0 and engine.num_steps == 0


def test_warm_up_knob():
    assert EngineConfig().warm_up is True
    with pytest.raises(ValueError, match="warm_up"):
        EngineConfig(warm_up="no")
    parser = build_parser()
    assert _engine_config(parser.parse_args(["serve", "--no-warm-up"])).warm_up is False
    assert _engine_config(parser.parse_args(["serve"])).warm_up is True


def _gpu_model(tmp_path) -> str:
    """A Llama-shaped random model (Llama-8B's head dim and grouping) for the GPU tests."""
    import json

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
           "intermediate_size": 2816, "num_hidden_layers": 2, "num_attention_heads": 8,
           "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 8192, "max_position_embeddings": 4096,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
           "torch_dtype": "bfloat16"}
    model = tmp_path / "llama"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(cfg))
    return str(model)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_a_warmed_up_engine_answers_as_a_cold_one_on_the_gpu(tmp_path):
    """Graphs, overlap, prefix caching, Triton kernels: after the warm-up the same requests get the same
    tokens and logprobs, bit for bit, as from an engine that never warmed up."""
    model = _gpu_model(tmp_path)
    answers, reports = {}, {}
    for warm in (True, False):
        engine = LLMEngine(EngineConfig(model=model, load_format="dummy", max_model_len=2048,
                                        num_kv_blocks=1024, max_num_batched_tokens=256, warm_up=warm))
        reports[warm] = engine.warm_up_report
        answers[warm] = _answers(engine)
        del engine
    assert reports[True].requests > 0 and reports[True].skipped == 0 and reports[False] is None
    assert answers[True] == answers[False]


@pytest.mark.gpu
@needs_cuda
def test_no_kernel_compiles_after_a_warmed_up_start(tmp_path):
    """In a fresh process the server's request mixes (benchmarks/first_requests.py: other sizes than the
    warm-up's) meet Triton specialisations that start-up alone never compiled, and none once the engine
    warmed up. Counted by Triton's compile hook, which fires for every specialisation a process builds or
    loads from the disk cache, so a warm cache hides nothing."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    model = _gpu_model(tmp_path)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    compiled = {}
    for warm in (False, True):
        out = tmp_path / f"warm_{warm}.json"
        subprocess.run([sys.executable, str(root / "benchmarks/first_requests.py"), "--config", model,
                        "--rounds", "1", "--keep-triton-cache", "--out", str(out),
                        *([] if warm else ["--no-warm-up"])], check=True, env=env, timeout=600)
        compiled[warm] = json.loads(out.read_text())["compiled_after_startup"]
    assert compiled[False], "the mixes met no kernel that start-up had not compiled: this test shows nothing"
    assert compiled[True] == [], [(c["phase"], c["kernel"]) for c in compiled[True]]
