"""Recurrent (Mamba2) models in the engine: HF parity, chunked == single-shot, first chunks start
from zero state whatever their length and slot, slot isolation, preemption, and no leaked slots."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
import torch
from conftest import TINY_VOCAB, random_prompts, run_greedy

from plait.config import EngineConfig
from plait.engine.engine import LLMEngine
from plait.engine.state_slots import NO_STATE_SLOT
from plait.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models

LOGITS_ATOL = 1e-4
MAX_TOKENS = 8
ARCHS = ["mamba2", "bamba", "nemotron_h"]
# Random init gives tiny logits; projections are scaled up so greedy has clear winners (logits of
# order 10, where fp32 still resolves 1e-4). Not the SSM's own parameters (A_log, dt_bias, D),
# which set the decay and must stay in a sane range.
WEIGHT_SCALE = {"mamba2": 4.0, "bamba": 4.0, "nemotron_h": 8.0}
_SSM_PARAMS = ("A_log", "dt_bias", ".D")


def _tiny_hf_configs() -> dict:
    from transformers import BambaConfig, Mamba2Config, NemotronHConfig

    # SSD chunk 16 so that prompts and step budgets cross chunk boundaries; n_groups 2 in Mamba2
    # so the group-to-head mapping is exercised.
    return {
        "mamba2": Mamba2Config(num_heads=8, head_dim=16, hidden_size=64, expand=2, state_size=16, n_groups=2,
                               num_hidden_layers=2, vocab_size=TINY_VOCAB, chunk_size=16, conv_kernel=4,
                               bos_token_id=1, eos_token_id=2, pad_token_id=0),
        # Attention in the middle layer: KV caches exist for one layer of three.
        "bamba": BambaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=TINY_VOCAB,
                             attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1,
                             mamba_d_state=16, mamba_chunk_size=16, max_position_embeddings=512),
        # Mamba, MLP, Mamba, attention (no rotary), MLP, Mamba. NemotronH floors dt at time_step_min
        # in HF's scan but not in its one-token decode step; a floor that never binds keeps the
        # oracle consistent with itself (the floor itself is tested on the kernels).
        "nemotron_h": NemotronHConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, vocab_size=TINY_VOCAB,
                                      hybrid_override_pattern="M-M*-M", mamba_num_heads=8, mamba_head_dim=16,
                                      ssm_state_size=16, n_groups=2, chunk_size=16, time_step_min=1e-9,
                                      max_position_embeddings=512),
    }


@pytest.fixture(scope="module")
def recurrent_models(tmp_path_factory) -> dict:
    """arch -> folder of a tiny random HF checkpoint."""
    from transformers import AutoModelForCausalLM

    folders = {}
    for i, (arch, cfg) in enumerate(_tiny_hf_configs().items()):
        torch.manual_seed(2000 + i)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" not in name and not name.endswith(_SSM_PARAMS):
                    p.mul_(WEIGHT_SCALE[arch])
        folder = tmp_path_factory.mktemp(f"tiny-{arch}")
        model.save_pretrained(folder)
        folders[arch] = folder
    return folders


def _engine(folder, **kw) -> LLMEngine:
    # The CPU fp32 torch path unless a test asks for another: the 1e-4 comparisons need it.
    kw.setdefault("device", "cpu")
    kw.setdefault("dtype", "float32")
    return LLMEngine(EngineConfig(model=str(folder), block_size=8, **kw))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    # Lengths up to 70: longer than most budgets below and several SSD chunks long.
    return random_prompts(6, 1, 70, seed=21)


@pytest.fixture(scope="module")
def single_shot(recurrent_models, prompts) -> dict:
    """arch -> (outputs, logits): each prompt alone, its whole prompt in one chunk."""
    refs = {}
    for arch in ARCHS:
        engine = _engine(recurrent_models[arch], max_num_batched_tokens=512)
        outs, logits = {}, {}
        for i, p in enumerate(prompts):
            o, lg = run_greedy(engine, [p], MAX_TOKENS, capture_logits=True)
            outs[i], logits[i] = o[0], torch.stack(lg[0])
        refs[arch] = (outs, logits)
    return refs


# -- parity with HF transformers ------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_and_greedy_match_hf(recurrent_models, prompts, arch):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(recurrent_models[arch], dtype=torch.float32).eval()
    engine = _engine(recurrent_models[arch], max_num_batched_tokens=48)
    outputs, logits = run_greedy(engine, prompts, MAX_TOKENS, capture_logits=True)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            gen = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                              eos_token_id=None, pad_token_id=0, output_logits=True,
                              return_dict_in_generate=True)
            ref_ids = gen.sequences[0, len(prompt):].tolist()
            full = hf(torch.tensor([prompt + outputs[i]])).logits[0, len(prompt) - 1 : -1]
        # The oracle first: HF's cached recurrent decode agrees with its own one-shot forward.
        torch.testing.assert_close(torch.stack(gen.logits)[:, 0], full, atol=LOGITS_ATOL, rtol=0)
        assert outputs[i] == ref_ids, f"{arch} prompt {i}: greedy tokens differ from HF"
        torch.testing.assert_close(torch.stack(logits[i]), full, atol=LOGITS_ATOL, rtol=0)
    assert engine.is_idle_and_clean()


# -- chunking -------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [7, 16, 33, 64, 256])
@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_equals_single_shot(recurrent_models, prompts, single_shot, arch, budget):
    """Budgets that are and are not multiples of the SSD chunk (16): chunks continue the state."""
    engine = _engine(recurrent_models[arch], max_num_batched_tokens=budget)
    outs, logits = run_greedy(engine, prompts, MAX_TOKENS, capture_logits=True)
    ref_outs, ref_logits = single_shot[arch]
    for i in range(len(prompts)):
        assert outs[i] == ref_outs[i], f"{arch} prompt {i}: tokens depend on chunking (budget {budget})"
        torch.testing.assert_close(torch.stack(logits[i]), ref_logits[i], atol=LOGITS_ATOL, rtol=0)
    assert engine.is_idle_and_clean()


# -- slots ----------------------------------------------------------------------------------------


@dataclass
class _Spec:
    prompt: list[int]
    max_tokens: int
    arrival_step: int


@dataclass
class _Run:
    outputs: dict[int, list[int]]  # request index -> output token ids
    logits: dict[int, list[torch.Tensor]]  # request index -> its sampled logits rows
    steps: list[list[tuple]]  # per step, per row: (index, start, num_new, is_prefill, slot)
    order: list[int]  # request indices in finishing order


def _run(engine: LLMEngine, specs: list[_Spec]) -> _Run:
    """Run requests, each added at its arrival step."""
    steps: list[list[tuple]] = []
    logits: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(specs))}
    launch, collect = engine.runner.launch, engine.runner.collect

    def recording_launch(plan, prev):
        steps.append([(int(r.request.request_id[2:]), r.start, r.num_new_tokens, r.is_prefill,
                       r.request.state_slot) for r in plan.rows])
        return launch(plan, prev)

    def recording_collect(step):
        out = collect(step)
        for k, sampled in enumerate(out.sampled):
            if not sampled.request.is_finished:  # an overlapped step's row for a finished request
                logits[int(sampled.request.request_id[2:])].append(out.logits[k].clone())
        return out

    engine.runner.launch, engine.runner.collect = recording_launch, recording_collect
    outputs, order, step = {}, [], 0
    pending = sorted(enumerate(specs), key=lambda item: item[1].arrival_step)
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1].arrival_step <= step:
            i, spec = pending.pop(0)
            params = SamplingParams(temperature=0.0, max_tokens=spec.max_tokens, ignore_eos=True)
            engine.add_request(spec.prompt, params, request_id=f"q-{i}")
        for out in engine.step():
            if out.finished:
                outputs[int(out.request_id[2:])] = out.outputs[0].token_ids
                order.append(int(out.request_id[2:]))
        step += 1
    engine.runner.launch, engine.runner.collect = launch, collect
    return _Run(outputs, logits, steps, order)


def _assert_solo(folder, specs: list[_Spec], run: _Run) -> None:
    """Every request's tokens and logits equal those it gets alone in a fresh engine."""
    engine = _engine(folder, max_num_batched_tokens=512)
    for i, spec in enumerate(specs):
        outs, logits = run_greedy(engine, [spec.prompt], spec.max_tokens, capture_logits=True)
        assert run.outputs[i] == outs[0], f"request {i}: tokens differ from its solo run"
        torch.testing.assert_close(torch.stack(run.logits[i]), torch.stack(logits[0]),
                                   atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_short_prompts_in_reused_slots_start_from_zero_state(recurrent_models, arch):
    """Prompts of 1, 2 and 3 tokens, admitted into slots other requests used, next to running
    decodes: each is a first chunk (zero state), never mistaken for a decode by its length."""
    long_prompts = random_prompts(3, 20, 40, seed=31)
    short = random_prompts(6, 1, 1, seed=32)
    specs = [_Spec(long_prompts[0], 24, 0), _Spec(long_prompts[1], 2, 0), _Spec(long_prompts[2], 3, 1),
             _Spec(short[0][:1], 5, 6), _Spec(short[1] + short[2], 5, 8),
             _Spec(short[3] + short[4] + short[5], 5, 10), _Spec(short[0][:1] + [7], 4, 14)]
    engine = _engine(recurrent_models[arch], max_num_batched_tokens=16, max_num_state_slots=3)
    run = _run(engine, specs)
    _assert_solo(recurrent_models[arch], specs, run)
    holders: dict[int, set[int]] = {}  # slot -> requests seen holding it so far
    for rows in run.steps:
        for index, start, _, _, slot in rows:
            if index >= 3 and start == 0:
                earlier = holders.get(slot, set()) - {index}
                assert earlier, f"request {index} did not reuse a slot (slot {slot})"
                assert any(not is_prefill for _, _, _, is_prefill, _ in rows), "no running decode beside it"
        for index, _, _, _, slot in rows:
            holders.setdefault(slot, set()).add(index)
    assert engine.is_idle_and_clean()


@pytest.mark.parametrize("n", [2, 4, 8])
def test_concurrent_requests_keep_their_own_state(recurrent_models, n):
    """n requests at once, finishing in a different order than they arrived: each gets its solo output."""
    prompts = random_prompts(n, 5, 40, seed=40 + n)
    max_tokens = [11, 3, 6, 14, 2, 9, 5, 12][:n]
    specs = [_Spec(p, m, 0) for p, m in zip(prompts, max_tokens)]
    for arch in ARCHS:
        engine = _engine(recurrent_models[arch], max_num_batched_tokens=24, max_num_state_slots=n)
        run = _run(engine, specs)
        assert run.order != sorted(run.order), "requests finished in arrival order; the test lost its point"
        _assert_solo(recurrent_models[arch], specs, run)
        slots = {slot for rows in run.steps for *_, slot in rows}
        assert NO_STATE_SLOT not in slots and slots <= set(range(1, n + 1))
        assert max(len(rows) for rows in run.steps) > 1
        assert engine.is_idle_and_clean()


@pytest.mark.parametrize("arch", ARCHS)
def test_preempted_request_restarts_from_zero_state(recurrent_models, arch):
    prompts = random_prompts(6, 20, 40, seed=51)
    specs = [_Spec(p, 16, 0) for p in prompts]
    # Six requests of up to 56 tokens need up to 7 blocks each; 20 blocks force preemption.
    engine = _engine(recurrent_models[arch], max_num_batched_tokens=32, num_kv_blocks=20, max_model_len=64)
    engine.record_timeline = True
    run = _run(engine, specs)
    assert sum(s.num_preempted for s in engine.timeline) > 0, "the test did not force a preemption"
    _assert_solo(recurrent_models[arch], specs, run)
    restarted = [index for index in range(len(specs))
                 if sum(1 for rows in run.steps for i, start, *_ in rows if i == index and start == 0) > 1]
    assert restarted, "no request ran a first chunk twice"
    assert engine.is_idle_and_clean()


def test_admission_waits_for_a_free_slot(recurrent_models):
    prompts = random_prompts(5, 3, 12, seed=61)
    specs = [_Spec(p, 6, 0) for p in prompts]
    engine = _engine(recurrent_models["mamba2"], max_num_batched_tokens=256, max_num_state_slots=2)
    run = _run(engine, specs)
    assert max(len(rows) for rows in run.steps) == 2, "more requests ran at once than there are slots"
    _assert_solo(recurrent_models["mamba2"], specs, run)
    assert engine.is_idle_and_clean()


def test_abort_frees_slots(recurrent_models):
    engine = _engine(recurrent_models["bamba"], max_num_batched_tokens=16, max_num_state_slots=3)
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for i, p in enumerate(random_prompts(5, 10, 30, seed=71)):
        engine.add_request(p, params, request_id=f"a-{i}")
    for _ in range(4):
        engine.step()
    assert engine.state_slots.num_used == 3 and engine.num_waiting == 2
    for i in range(5):
        engine.abort_request(f"a-{i}")
    assert engine.state_slots.num_free == 3
    assert engine.is_idle_and_clean()
    assert engine.step() == []


def test_prefix_caching_is_off_with_a_logged_reason(recurrent_models, caplog):
    for arch in ARCHS:
        with caplog.at_level(logging.WARNING, logger="plait.engine.engine"):
            engine = _engine(recurrent_models[arch], max_num_batched_tokens=64)
        assert not engine.kv_cache.enable_prefix_caching
        assert "prefix caching is off" in caplog.text


def test_kv_caches_only_for_attention_layers(recurrent_models):
    bamba = _engine(recurrent_models["bamba"], max_num_batched_tokens=64, max_num_seqs=4)
    assert len(bamba.runner.kv_caches) == 1 and len(bamba.runner.recurrent_states) == 2
    nemotron = _engine(recurrent_models["nemotron_h"], max_num_batched_tokens=64, max_num_seqs=4)
    assert len(nemotron.runner.kv_caches) == 1 and len(nemotron.runner.recurrent_states) == 3
    mamba = _engine(recurrent_models["mamba2"], max_num_batched_tokens=64, max_num_seqs=4)
    assert mamba.runner.kv_caches == [] and len(mamba.runner.recurrent_states) == 2
    # One row per slot plus the pad slot; the default capacity is max_num_seqs.
    assert mamba.runner.recurrent_states[0].ssm.shape[0] == 4 + 1
    assert mamba.state_slots.capacity == 4


@pytest.mark.parametrize("arch", ["bamba", "nemotron_h"])
def test_fp8_kv_cache_on_the_attention_layers_keeps_chunking_invisible(recurrent_models, prompts, arch):
    """kv_cache_dtype="fp8" on a hybrid: FP8 caches for its attention layers alone (one scale pair each),
    and a prompt chunked into 7-token steps answers as it does in one step."""
    engines = [_engine(recurrent_models[arch], kv_cache_dtype="fp8", max_num_batched_tokens=budget)
               for budget in (7, 512)]
    runner = engines[0].runner
    assert [c.dtype for c in runner.kv_caches] == [torch.float8_e4m3fn] and len(runner.kv_scales) == 1
    chunked, whole = (run_greedy(e, prompts, MAX_TOKENS, arrive_every=2)[0] for e in engines)
    assert chunked == whole


# -- the GPU path (Triton kernels inside the engine) -----------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("budget", [7, 33, 256])
@pytest.mark.parametrize("arch", ARCHS)
def test_gpu_engine_matches_cpu_reference(recurrent_models, prompts, single_shot, arch, budget):
    """fp32 on CUDA through the Triton kernels, mixed and chunked, against the CPU torch path."""
    # A fixed KV pool: sized from free memory, each engine of this module would take 90% of the GPU.
    engine = _engine(recurrent_models[arch], device="cuda", dtype="float32", max_num_batched_tokens=budget,
                     num_kv_blocks=512)
    outs, logits = run_greedy(engine, prompts, MAX_TOKENS, capture_logits=True)
    ref_outs, ref_logits = single_shot[arch]
    for i in range(len(prompts)):
        assert outs[i] == ref_outs[i], f"{arch} prompt {i}: GPU tokens differ from the CPU reference"
        torch.testing.assert_close(torch.stack(logits[i]).cpu(), ref_logits[i], atol=1e-3, rtol=0)
    assert engine.is_idle_and_clean()


@pytest.mark.parametrize("arch", ARCHS)
def test_sleep_drops_the_states_and_wakes_to_the_same_answers(recurrent_models, prompts, single_shot, arch):
    """Sleep mode (plait.runner.sleep) frees the recurrent states beside the KV cache; after wake_up every
    request starts from zero state again and answers as it did alone."""
    engine = _engine(recurrent_models[arch], max_num_batched_tokens=512, enable_sleep_mode=True)
    run_greedy(engine, prompts[:2], MAX_TOKENS)
    engine.sleep(1)
    states = [t for s in engine.runner.recurrent_states for t in (s.conv, s.ssm)]
    assert states and all(t.numel() == 0 for t in states)
    engine.wake_up()
    outs, _ = run_greedy(engine, prompts, MAX_TOKENS)
    assert outs == single_shot[arch][0]
