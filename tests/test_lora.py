"""Multi-LoRA serving on tiny random models (fp32 CPU): each adapter matches HF with the adapter merged into
its weights, a request's output does not depend on the adapters beside it, slots are shared in turn, and the
prefix cache keeps adapters apart; bad adapters are refused before they enter the engine."""

from __future__ import annotations

import gc
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import (
    LORA_MODULES,
    assert_engines_agree,
    hf_greedy_reference,
    make_lora_adapter,
    random_prompts,
    run_greedy,
)

from plait import LLM, BeamSearchParams, LoRARequest
from plait.config import EngineConfig
from plait.engine.engine import LLMEngine
from plait.lora.model import LoRAModel
from plait.lora.slots import NO_LORA_SLOT, LoRASlotPool
from plait.sampling_params import SamplingParams

LOGITS_ATOL = 1e-4
MAX_TOKENS = 8
ALL_TARGETS = list(LORA_MODULES)


def _adapters(model_folder: Path, root: Path, std: float = 0.1) -> dict[str, LoRARequest]:
    """Three adapters unlike each other: the classic q/v, all seven projections under rsLoRA, and an MLP-heavy
    one of rank 16 on the last layer only (k and the first layer untouched); ``std``: of their A and B."""
    made = {
        "qv": make_lora_adapter(root / "qv", model_folder, ["q_proj", "v_proj"], rank=8, alpha=16, seed=1,
                                std=std),
        "all": make_lora_adapter(root / "all", model_folder, ALL_TARGETS, rank=4, alpha=8, seed=2,
                                 use_rslora=True, std=std),
        "mlp": make_lora_adapter(root / "mlp", model_folder, ["o_proj", "gate_proj", "down_proj"], rank=16,
                                 alpha=32, seed=3, layers=[1], std=std),
    }
    return {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(made.items())}


@pytest.fixture(scope="module")
def llama_loras(tiny_llama, tmp_path_factory) -> dict[str, LoRARequest]:
    return _adapters(tiny_llama, tmp_path_factory.mktemp("llama-loras"))


def _lora_engine(folder: Path, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(folder), block_size=8, enable_lora=True, **kw))


def _merged_hf(model_folder: Path, lora: LoRARequest | None):
    """HF transformers' model with the adapter merged into a copy of its weights: W + scale * B @ A."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    # Eager attention: the one transformers soft-caps Gemma 2's scores in.
    hf = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32, attn_implementation="eager")
    hf = hf.eval()
    if lora is None:
        return hf
    config = json.loads((Path(lora.lora_path) / "adapter_config.json").read_text())
    rank, alpha = config["r"], config["lora_alpha"]
    scale = alpha / rank**0.5 if config["use_rslora"] else alpha / rank
    tensors = load_file(Path(lora.lora_path) / "adapter_model.safetensors")
    with torch.no_grad():
        for key, a in tensors.items():
            if key.endswith(".lora_A.weight"):
                module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                b = tensors[key.replace(".lora_A.", ".lora_B.")]
                hf.get_submodule(module).weight += scale * b @ a
    return hf


def _alone(engine: LLMEngine, prompts: list[list[int]], loras: list, max_tokens: int = MAX_TOKENS
           ) -> tuple[dict[int, list[int]], dict[int, torch.Tensor]]:
    """Each prompt run alone on ``engine``, one after another: (tokens, logits) by index."""
    outs, logits = {}, {}
    for i, (prompt, lora) in enumerate(zip(prompts, loras)):
        o, lg = run_greedy(engine, [prompt], max_tokens, capture_logits=True, loras=[lora])
        outs[i], logits[i] = o[0], torch.stack(lg[0])
    return outs, logits


def _lora_id(request) -> int | None:
    return request.lora.request.lora_int_id if request.lora is not None else None


def _record_plans(engine: LLMEngine) -> list[list[tuple[str, int | None]]]:
    """Every step's rows from now on, as (request id, its adapter's id)."""
    plans: list[list[tuple[str, int | None]]] = []
    schedule = engine.scheduler.schedule

    def recording():
        plan = schedule()
        plans.append([(row.request.request_id, _lora_id(row.request)) for row in plan.rows])
        return plan

    engine.scheduler.schedule = recording
    return plans


def _run_against_merged_hf(engine: LLMEngine, folder: Path, prompts: list[list[int]], order: list, what: str,
                           base_rows_atol: float | None = None) -> tuple[dict, dict]:
    """Request i (adapter order[i]) of ``prompts`` run greedily on ``engine`` beside the others: its tokens
    and logits (LOGITS_ATOL) are HF's with that adapter merged into the weights of ``folder``, and each
    adapter's logits moved from the base model's (run alone on a base engine; an adapter left out would
    leave them within float noise, ~1e-6); ``base_rows_atol``: base rows' logits also within it of the base
    engine's. Returns (tokens, the base engine's tokens), by index."""
    outs, logits = run_greedy(engine, prompts, MAX_TOKENS, capture_logits=True, loras=order)
    base_engine = LLMEngine(EngineConfig(model=str(folder), block_size=8, max_num_batched_tokens=48))
    base, base_logits = run_greedy(base_engine, prompts, MAX_TOKENS, capture_logits=True)
    references = {}
    for i, (prompt, lora) in enumerate(zip(prompts, order)):
        name = lora.lora_name if lora else None
        hf = references.setdefault(name, _merged_hf(folder, lora))
        ref_ids, ref_logits = hf_greedy_reference(hf, prompt, outs[i], MAX_TOKENS)
        assert outs[i] == ref_ids, f"{what} prompt {i} ({name}): greedy tokens differ from merged HF"
        torch.testing.assert_close(torch.stack(logits[i]), ref_logits, atol=LOGITS_ATOL, rtol=0)
        if lora is None and base_rows_atol is not None:  # base rows beside adapters' rows
            assert outs[i] == base[i]
            torch.testing.assert_close(torch.stack(logits[i]), torch.stack(base_logits[i]),
                                       atol=base_rows_atol, rtol=0)
    moved = [(torch.stack(logits[i]) - torch.stack(base_logits[i])).abs().max() for i in range(len(order))]
    assert all(m > 0.01 for m, lora in zip(moved, order) if lora), f"an adapter left its logits: {moved}"
    return outs, base


# Answers the adapters must change, where sublayer outputs reach the stream damped (others: 4 of 5).
DAMPED_FAMILIES = {"gemma2": 1, "gemma3": 1, "granite": 0}


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "granite", "olmo2", "gemma", "gemma2",
                                    "gemma3"])
def test_adapters_match_hf_with_merged_weights(tiny_models, tmp_path, family):
    """Greedy tokens and logits (1e-4, fp32) of each adapter equal HF's with that adapter merged into the
    weights; prompts are chunked, and three adapters share two slots beside base requests."""
    folder = tiny_models[family]
    loras = _adapters(folder, tmp_path)
    order = [loras["qv"], loras["all"], loras["mlp"], None, loras["all"], loras["qv"]]
    prompts = random_prompts(len(order), 1, 70, seed=7)
    engine = _lora_engine(folder, max_num_batched_tokens=48, max_loras=2)
    outs, base = _run_against_merged_hf(engine, folder, prompts, order, family)
    # Tiny Gemmas' and Granite's scaled embeddings outweigh what their post-normed or scaled-down sublayers
    # add, so fewer (Granite: no) tokens flip there; the logits above still moved.
    changed = sum(outs[i] != base[i] for i, lora in enumerate(order) if lora)
    assert changed >= DAMPED_FAMILIES.get(family, 4), "the adapters changed no answer"
    assert engine.runner.breakdown.lora_steps > 0
    assert engine.is_idle_and_clean()


# Phi-3's adapters name its fused projections, as its checkpoints do: the decoder-layer module holding each.
PHI3_LORA_MODULES = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp",
                     "down_proj": "mlp"}


def make_fused_lora_adapter(folder: Path, model_folder: Path, targets: list[str], **kw) -> Path:
    """A random PEFT LoRA adapter for a Phi-3 model: lora_A [r, in] and lora_B [out, r] of each targeted fused
    projection (``qkv_proj``: q + 2 kv rows; ``gate_up_proj``: 2 x intermediate rows)."""
    return make_lora_adapter(folder, model_folder, targets, modules=PHI3_LORA_MODULES, **kw)


@pytest.mark.parametrize("family", ["phi3", "phi3-longrope"])
def test_phi3_adapters_on_fused_layers_match_hf_with_merged_weights(tiny_models, tmp_path, family):
    """Phi-3's adapters name its fused qkv_proj and gate_up_proj (one A and one B for the whole layer) beside
    o_proj and down_proj: greedy tokens and logits (1e-4, fp32) equal HF's Phi3ForCausalLM with the adapter
    merged into its fused weights; base rows beside them are the base model's; chunked prompts, two slots."""
    folder = tiny_models[family]
    made = {
        "all": make_fused_lora_adapter(tmp_path / "all", folder, list(PHI3_LORA_MODULES), rank=4, alpha=8,
                                       seed=2, use_rslora=True),
        "fused": make_fused_lora_adapter(tmp_path / "fused", folder, ["qkv_proj", "gate_up_proj"], rank=8,
                                         alpha=16, seed=1),
        "mlp": make_fused_lora_adapter(tmp_path / "mlp", folder, ["gate_up_proj", "down_proj"], rank=16,
                                       alpha=32, seed=3, layers=[1]),
    }
    loras = {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(made.items())}
    order = [loras["fused"], None, loras["all"], loras["mlp"], None, loras["all"], loras["fused"]]
    prompts = random_prompts(len(order), 1, 70, seed=7)
    engine = _lora_engine(folder, max_num_batched_tokens=48, max_loras=2)
    # A whole-layer target is one slice (rank rows of A and one block of B spanning the layer's rows).
    qkv = engine.runner.lora.layers["model.layers.0.self_attn.qkv_proj"]
    assert qkv.target.shards == (("qkv_proj", qkv.out_features),) and qkv.lora_a.shape[1] == qkv.max_rank
    outs, base = _run_against_merged_hf(engine, folder, prompts, order, family, base_rows_atol=1e-5)
    changed = sum(outs[i] != base[i] for i, lora in enumerate(order) if lora)
    assert changed >= 3, "the adapters changed no answer"
    assert engine.runner.breakdown.lora_steps > 0
    assert engine.is_idle_and_clean()


def test_adapters_naming_another_familys_projections_are_refused(tiny_models, tmp_path):
    """Phi-3 has no q_proj .. up_proj (its adapters name the fused layers), and Llama-family models take no
    adapter on their fused qkv_proj / gate_up_proj (their adapters name the slices): each is refused by name
    before it runs, and the engine goes on serving."""
    phi3, llama = tiny_models["phi3"], tiny_models["llama"]
    fused_names = "qkv_proj, o_proj, gate_up_proj, down_proj"
    sliced_names = ", ".join(LORA_MODULES)
    cases = [
        (phi3, make_lora_adapter(tmp_path / "q", phi3, ["q_proj", "o_proj"], rank=4, alpha=8, seed=0),
         f"target_modules ['q_proj'] are not supported; an adapter of this model may target {fused_names}"),
        # A regex target: only the tensors say what it adapted.
        (phi3, make_lora_adapter(tmp_path / "up", phi3, ["up_proj"], rank=4, alpha=8, seed=0,
                                 config_overrides={"target_modules": ".*proj"}),
         f"LoRA on up_proj is not supported for this model, only on {fused_names}"),
        (phi3, make_fused_lora_adapter(tmp_path / "qkv-rank", phi3, ["qkv_proj"], rank=4, alpha=8, seed=0,
                                       config_overrides={"r": 2}),
         "expected (2, 64) and (128, 2)"),
        (llama, make_fused_lora_adapter(tmp_path / "fused", llama, ["qkv_proj"], rank=4, alpha=8, seed=0),
         f"target_modules ['qkv_proj'] are not supported; an adapter of this model may target "
         f"{sliced_names}"),
    ]
    engines = {folder: _lora_engine(folder, max_model_len=64) for folder in (phi3, llama)}
    for i, (folder, path, words) in enumerate(cases):
        engine = engines[folder]
        with pytest.raises(ValueError, match=re.escape(words)):
            engine.add_request([5, 6, 7], SamplingParams(max_tokens=2),
                               lora_request=LoRARequest(f"bad-{i}", 10 + i, str(path)))
        assert engine.is_idle_and_clean()
    good = make_fused_lora_adapter(tmp_path / "good", phi3, ["qkv_proj"], rank=8, alpha=8, seed=4)
    outs, _ = run_greedy(engines[phi3], [[5, 6, 7]], 2, loras=[LoRARequest("good", 99, str(good))])
    assert len(outs[0]) == 2 and engines[phi3].is_idle_and_clean()


def test_mixed_adapters_equal_alone(tiny_llama, llama_loras):
    """Base, adapter 1, adapter 2, adapter 1 again... of different lengths, arriving step by step and chunked
    under a small budget: each request gets the tokens (and logits) it gets alone."""
    qv, every = llama_loras["qv"], llama_loras["all"]
    order = [None, qv, every, qv, None, every, qv, None]
    prompts = random_prompts(len(order), 5, 60, seed=11)
    solo = _alone(_lora_engine(tiny_llama, max_num_batched_tokens=512, max_loras=2), prompts, order)
    engine = _lora_engine(tiny_llama, max_num_batched_tokens=16, long_prefill_token_threshold=8, max_loras=2)
    plans = _record_plans(engine)
    outs, logits = run_greedy(engine, prompts, MAX_TOKENS, arrive_every=1, capture_logits=True, loras=order)
    for i in range(len(prompts)):
        assert outs[i] == solo[0][i], f"prompt {i}: tokens depend on the adapters beside it"
        torch.testing.assert_close(torch.stack(logits[i]), solo[1][i], atol=LOGITS_ATOL, rtol=0)
    # Steps really mixed the base model and both adapters.
    assert any({lora for _, lora in plan} == {None, qv.lora_int_id, every.lora_int_id} for plan in plans)
    assert engine.is_idle_and_clean()


def test_one_slot_serves_two_adapters_in_turn(tiny_llama, llama_loras):
    """max_loras=1: a request for the second adapter waits for the slot, then both finish as they would alone;
    a base request arriving after it is admitted past it (it needs no slot)."""
    order = [llama_loras["qv"], llama_loras["mlp"], None]
    prompts = random_prompts(len(order), 10, 30, seed=5)
    solo = _alone(_lora_engine(tiny_llama, max_num_batched_tokens=512), prompts, order)
    engine = _lora_engine(tiny_llama, max_num_batched_tokens=64)
    plans = _record_plans(engine)
    outs, _ = run_greedy(engine, prompts, MAX_TOKENS, loras=order)
    assert outs == solo[0]
    assert all(len({lora for _, lora in plan} - {None}) <= 1 for plan in plans), "two adapters in one slot"
    steps = {rid: [k for k, plan in enumerate(plans) if rid in dict(plan)] for rid in ("r-0", "r-1", "r-2")}
    first, last_of_first = {rid: ks[0] for rid, ks in steps.items()}, steps["r-0"][-1]
    assert first["r-1"] > last_of_first, "the second adapter ran before the slot was free"
    assert first["r-2"] < first["r-1"], "the base request waited for a LoRA slot it does not need"
    assert engine.runner.lora.num_loads == 2
    assert engine.is_idle_and_clean()


def test_prefix_cache_keeps_adapters_apart(tiny_llama, llama_loras):
    """The same prompt under two adapters and the base model: each gets its own answer, none is served
    another's KV blocks, and a repeat under the same adapter still hits the cache."""
    prompt = random_prompts(1, 41, 41, seed=13)[0]
    order = [llama_loras["qv"], llama_loras["all"], None, llama_loras["qv"]]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    uncached = _alone(_lora_engine(tiny_llama, max_loras=2, enable_prefix_caching=False), [prompt] * 4, order)
    engine = _lora_engine(tiny_llama, max_loras=2, enable_prefix_caching=True)
    finals = []
    for i, lora in enumerate(order):  # one after another, so each could hit what the last cached
        engine.add_request(prompt, params, request_id=f"p-{i}", lora_request=lora)
        while engine.has_unfinished_requests():
            finals += [out for out in engine.step() if out.finished]
    assert [out.outputs[0].token_ids for out in finals] == [uncached[0][i] for i in range(4)]
    assert len({tuple(out.outputs[0].token_ids) for out in finals}) == 3
    assert [out.num_cached_tokens for out in finals[:3]] == [0, 0, 0]
    assert finals[3].num_cached_tokens == 40  # five full blocks of the first request's adapter
    assert engine.is_idle_and_clean()


def test_steps_with_lora_rows_ask_for_graphs_too(tiny_llama, llama_loras):
    """Graphs capture the LoRA deltas (every token's slot is an input of the step), so the runner asks its
    CUDA graphs for a shape whatever adapters the step's rows use, and hands them each token's slot; a
    stand-in for the graphs records what it was asked (no GPU here)."""
    engine = _lora_engine(tiny_llama, max_num_batched_tokens=32)
    asked: list[list[int]] = []

    class Graphs:
        def shape_for(self, arrays):
            asked.append(arrays.lora_slots.tolist())
            return None  # run eager all the same

    engine.runner.graphs = Graphs()
    plans = _record_plans(engine)
    order = [None, llama_loras["qv"], None]
    prompts = random_prompts(len(order), 5, 20, seed=17)
    run_greedy(engine, prompts, MAX_TOKENS, arrive_every=3, loras=order)
    with_lora = sum(any(lora is not None for _, lora in plan) for plan in plans if plan)
    assert engine.runner.breakdown.lora_steps == with_lora > 0
    assert len(asked) == sum(bool(plan) for plan in plans)
    assert sum(any(slot != NO_LORA_SLOT for slot in slots) for slots in asked) == with_lora
    assert all(set(slots) <= {NO_LORA_SLOT, 0} for slots in asked)  # one slot (max_loras=1) or none
    assert engine.runner.breakdown.graph_steps == 0


def _generate_one(llm: LLM, prompt: dict, lora: LoRARequest, params: SamplingParams):
    return llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0]


def test_adapters_on_an_fp8_model_are_the_fp8_model_plus_16_bit_deltas(tiny_llama, llama_loras):
    """--quantization fp8 with --enable-lora (as vLLM): each wrapped layer is the FP8 layer (weights and
    inputs rounded to FP8) plus its adapter's delta on the unrounded input, in the model's dtype; the same
    as an unquantised engine whose base layers were made the FP8 ones, tokens and logits exactly."""
    from test_fp8 import _fp8_reference

    from plait.layers.fp8 import Fp8Linear

    kw = dict(max_num_batched_tokens=24, max_model_len=96, device="cpu", max_loras=2, max_lora_rank=16)
    served = _lora_engine(tiny_llama, quantization="fp8", **kw)
    assert isinstance(served.runner.lora.layers["model.layers.0.self_attn.qkv_proj"].base, Fp8Linear)
    reference = _lora_engine(tiny_llama, **kw)
    _fp8_reference(reference)  # hooks and FP8 weights on the base layers the LoRA layers wrap
    prompts = random_prompts(5, 3, 30, seed=6)
    loras = [llama_loras["qv"], None, llama_loras["all"], llama_loras["mlp"], llama_loras["qv"]]
    logits = assert_engines_agree(served, reference, prompts, loras=loras)
    # ... and the adapters are applied: without them the FP8 model answers otherwise.
    unadapted = _lora_engine(tiny_llama, quantization="fp8", **kw)
    plain = run_greedy(unadapted, prompts, MAX_TOKENS, arrive_every=1, capture_logits=True)[1]
    assert not torch.equal(plain[0][0], logits[0][0]) and torch.equal(plain[1][0], logits[1][0])


def test_the_profiling_step_runs_a_lora_delta(tiny_llama):
    """The step that sizes the GPU KV cache runs its tokens through a LoRA slot too (the deltas' memory), and
    leaves the layers adding nothing afterwards."""
    engine = _lora_engine(tiny_llama, max_num_batched_tokens=100, max_model_len=64, max_num_seqs=8)
    calls = []
    layer = next(iter(engine.runner.lora.layers.values()))
    layer.register_forward_hook(lambda module, args, out: calls.append(module.context.batch is not None))
    engine.runner._profile_step()
    assert calls == [True] and engine.runner.lora.context.batch is None
    assert engine.is_idle_and_clean()


def test_llm_generate_takes_one_lora_request_or_one_per_prompt(tiny_llama, llama_loras):
    llm = LLM(str(tiny_llama), enable_lora=True, max_loras=2, block_size=8)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 4, 12, seed=19)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    qv, mlp = llama_loras["qv"], llama_loras["mlp"]
    each = llm.generate(prompts, params, use_tqdm=False, lora_request=[qv, None, mlp])
    same = llm.generate(prompts, params, use_tqdm=False, lora_request=qv)
    base = llm.generate(prompts, params, use_tqdm=False)
    assert each[0].outputs[0].token_ids == same[0].outputs[0].token_ids
    assert each[1].outputs[0].token_ids == base[1].outputs[0].token_ids
    assert same[2].outputs[0].token_ids != base[2].outputs[0].token_ids
    with pytest.raises(ValueError, match="2 LoRA requests for 3 prompts"):
        llm.generate(prompts, params, use_tqdm=False, lora_request=[qv, None])
    # A beam search of width 1 keeps the greedy sequence: each beam runs its prompt's adapter.
    beams = llm.beam_search(prompts[:2], BeamSearchParams(beam_width=1, max_tokens=4, ignore_eos=True),
                            lora_request=[mlp, qv])
    for out, prompt, want in zip(beams, prompts, (_generate_one(llm, prompts[0], mlp, params), same[1])):
        assert out.sequences[0].tokens == prompt["prompt_token_ids"] + want.outputs[0].token_ids


# -- bad input ------------------------------------------------------------------------------------


def _bad_adapter(root: Path, model: Path, name: str) -> tuple[str, str]:
    """An adapter folder plait must refuse, and words its error must contain."""
    folder = root / name
    good = {"targets": ["q_proj"], "rank": 4, "alpha": 8, "seed": 0}
    if name == "rank_above_max":
        make_lora_adapter(folder, model, ["q_proj"], rank=16, alpha=16, seed=0)
        return str(folder), "LoRA rank 16 is greater than max_lora_rank 8."
    if name == "missing_folder":
        return str(folder), "no adapter_config.json"
    if name == "missing_weights":
        make_lora_adapter(folder, model, **good)
        (folder / "adapter_model.safetensors").unlink()
        return str(folder), "no adapter_model.safetensors"
    if name == "lm_head_target":
        make_lora_adapter(folder, model, **good, config_overrides={"target_modules": ["q_proj", "lm_head"]})
        return str(folder), "['lm_head'] are not supported"
    if name == "embedding_weights":  # a regex target: only the tensors say what it adapted
        make_lora_adapter(folder, model, **good, config_overrides={"target_modules": ".*"})
        from safetensors.torch import load_file, save_file

        tensors = load_file(folder / "adapter_model.safetensors")
        tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.zeros(4, 512)
        save_file(tensors, folder / "adapter_model.safetensors")
        return str(folder), "not a LoRA A or B weight"
    if name == "dora":
        make_lora_adapter(folder, model, **good, config_overrides={"use_dora": True})
        return str(folder), "use_dora=True is not supported"
    if name == "bias":
        make_lora_adapter(folder, model, **good, config_overrides={"bias": "lora_only"})
        return str(folder), "bias 'lora_only' is not supported"
    if name == "modules_to_save":
        make_lora_adapter(folder, model, **good, config_overrides={"modules_to_save": ["lm_head"]})
        return str(folder), "modules_to_save"
    if name == "layer_not_in_model":
        make_lora_adapter(folder, model, ["q_proj"], rank=4, alpha=8, seed=0, layers=[7])
        return str(folder), "'model.layers.7.self_attn.q_proj' is not in the model"
    if name == "other_model_shapes":  # made for a model twice as wide
        config = json.loads((model / "config.json").read_text())
        other = root / "wide-model"
        other.mkdir(exist_ok=True)
        (other / "config.json").write_text(json.dumps({**config, "hidden_size": 128}))
        make_lora_adapter(folder, other, ["v_proj"], rank=4, alpha=8, seed=0)
        return str(folder), "expected (4, 64)"
    raise AssertionError(name)


BAD_ADAPTERS = ["rank_above_max", "missing_folder", "missing_weights", "lm_head_target", "embedding_weights",
                "dora", "bias", "modules_to_save", "layer_not_in_model", "other_model_shapes"]


@pytest.fixture(scope="module")
def small_rank_engine(tiny_llama) -> LLMEngine:
    return _lora_engine(tiny_llama, max_lora_rank=8, max_model_len=64)


@pytest.mark.parametrize("name", BAD_ADAPTERS)
def test_bad_adapters_are_refused_before_they_enter_the_engine(small_rank_engine, tiny_llama, tmp_path, name):
    path, words = _bad_adapter(tmp_path, tiny_llama, name)
    engine = small_rank_engine
    lora_id = 100 + 2 * BAD_ADAPTERS.index(name)  # the engine is shared: an id per folder
    with pytest.raises(ValueError, match=re.escape(words)):
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=2),
                           lora_request=LoRARequest(name, lora_id, path))
    assert engine.is_idle_and_clean()
    good = make_lora_adapter(tmp_path / "good", tiny_llama, ["q_proj"], rank=8, alpha=8, seed=4)
    outs, _ = run_greedy(engine, [[5, 6, 7]], 2, loras=[LoRARequest("good", lora_id + 1, str(good))])
    assert len(outs[0]) == 2 and engine.is_idle_and_clean()  # and it goes on serving


def test_lora_requests_are_checked(tiny_llama, llama_loras, tmp_path):
    """No LoRA without enable_lora; ids are >= 1 and name one folder; only Llama-family (Phi-3 included)
    models take LoRA."""
    base = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=8))
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        base.add_request([5, 6], lora_request=llama_loras["qv"])
    assert base.is_idle_and_clean()
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("zero", 0, "/x")
    engine = _lora_engine(tiny_llama)
    engine.add_request([5, 6], SamplingParams(max_tokens=1), "a", llama_loras["qv"])
    moved = shutil.copytree(llama_loras["qv"].lora_path, tmp_path / "copy")
    with pytest.raises(ValueError, match="already names the adapter"):
        engine.add_request([5, 6], SamplingParams(max_tokens=1), "b", LoRARequest("qv", 1, str(moved)))
    with pytest.raises(ValueError, match="LoRA is not supported for Linear"):
        LoRAModel(torch.nn.Linear(2, 2), num_slots=1, max_rank=4)
    with pytest.raises(ValueError, match="max_cpu_loras must be >= 2"):
        EngineConfig(enable_lora=True, max_loras=2, max_cpu_loras=1)


def test_slot_pool_keeps_adapters_and_evicts_the_least_recently_used():
    pool = LoRASlotPool(2)
    a = pool.take(10)
    assert pool.take(10) == a and pool.num_used == 1  # one slot, two users
    b = pool.take(20)
    assert {a, b} == {0, 1} and not pool.can_take(30)  # both slots busy with others' requests
    pool.give_back(a)
    assert not pool.can_take(30)  # adapter 10 still has a user
    pool.give_back(a)
    pool.give_back(b)
    assert pool.take(10) == a  # still loaded: no eviction needed
    pool.give_back(a)
    assert pool.take(30) == b  # adapter 20's slot was used least recently
    assert pool.adapter_in(b) == 30 and pool.adapter_in(a) == 10
    with pytest.raises(RuntimeError):
        pool.give_back(a)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_adapters_beside_graphed_base_steps(tiny_llama, llama_loras):
    """On CUDA in fp32 with Triton kernels, CUDA graphs and overlapped steps: adapters' logits match HF's
    merged weights (computed on the CPU), steps with adapters' rows replay graphs as base-only steps do
    (every pure-decode step), and each request's tokens are what it gets alone."""
    qv, every = llama_loras["qv"], llama_loras["all"]
    order = [None, qv, every, None, qv]
    prompts = random_prompts(len(order), 5, 40, seed=21)
    knobs = dict(dtype="float32", max_loras=2, max_num_seqs=8)
    alone = _lora_engine(tiny_llama, **knobs)
    solo = [run_greedy(alone, [p], MAX_TOKENS, loras=[lora])[0][0] for p, lora in zip(prompts, order)]
    del alone  # its KV cache holds most of the GPU (no logit hook: a dropped engine is freed at once)
    gc.collect()
    torch.cuda.empty_cache()
    engine = _lora_engine(tiny_llama, max_num_batched_tokens=32, **knobs)
    assert engine.runner.device.type == "cuda" and engine.runner.graphs is not None
    outs, logits = run_greedy(engine, prompts, MAX_TOKENS, arrive_every=1, capture_logits=True, loras=order)
    b = engine.runner.breakdown
    assert b.lora_steps > 0 and b.graph_steps > 0
    assert b.single_token_steps > 0 and b.graph_single_token_steps == b.single_token_steps
    for i, lora in enumerate(order):
        assert outs[i] == solo[i], f"prompt {i}: tokens depend on the adapters beside it"
        hf = _merged_hf(tiny_llama, lora)
        with torch.no_grad():
            ref = hf(torch.tensor([prompts[i] + outs[i]])).logits[0, len(prompts[i]) - 1: -1]
        torch.testing.assert_close(torch.stack(logits[i]).cpu(), ref, atol=1e-3, rtol=0)
    assert engine.is_idle_and_clean()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_adapters_on_an_fp8_model_replay_graphs(tiny_llama, llama_loras):
    """bf16, --quantization fp8 with adapters on CUDA: steps with adapters' rows replay graphs, and the
    graphed engine answers as the eager one (FP8 kernels under both)."""
    qv, every = llama_loras["qv"], llama_loras["all"]
    order = [None, qv, every, None, qv, every]
    prompts = random_prompts(len(order), 5, 40, seed=22)
    knobs = dict(quantization="fp8", max_loras=2, max_num_seqs=8, max_num_batched_tokens=32,
                 num_kv_blocks=256)  # two engines in one process: each sized, not from free memory
    graphed = _lora_engine(tiny_llama, **knobs)
    outs = run_greedy(graphed, prompts, MAX_TOKENS, arrive_every=1, loras=order)[0]
    b = graphed.runner.breakdown
    assert b.lora_steps > 0 and b.single_token_steps > 0
    assert b.graph_single_token_steps == b.single_token_steps
    eager = run_greedy(_lora_engine(tiny_llama, enforce_eager=True, **knobs), prompts, MAX_TOKENS,
                       arrive_every=1, loras=order)[0]
    assert sum(outs[i] == eager[i] for i in range(len(order))) >= len(order) - 1


def test_lora_layer_adds_each_tokens_own_slot_and_nothing_to_base_tokens():
    """The graph-capturable form: every token through every slot's A, other slots' columns zeroed. A base
    token's output is the base layer's exactly, and a token's delta is its own slot's x @ A.T @ B.T."""
    from types import SimpleNamespace

    from plait.layers.linear import Linear
    from plait.lora.adapter import LoRAShard, LoRATarget
    from plait.lora.layer import LoRAContext, LoRALinear

    torch.manual_seed(3)
    base = Linear(12, 10, bias=False)
    context = LoRAContext()
    layer = LoRALinear(base, LoRATarget(12, (("q", 6), ("v", 4))), num_slots=3, max_rank=4, context=context)
    pairs = {}
    for slot in (0, 2):
        shards = [LoRAShard(0, torch.randn(3, 12), torch.randn(6, 3)), LoRAShard(1, torch.randn(2, 12),
                                                                                 torch.randn(4, 2))]
        layer.load_slot(slot, shards, scaling=0.5)
        pairs[slot] = shards
    x = torch.randn(5, 12)
    slots = torch.tensor([NO_LORA_SLOT, 0, 2, 0, 1])  # slot 1 holds nothing: zeros
    context.batch = SimpleNamespace(lora_slots=slots)
    got = layer(x)
    context.batch = None
    want = base(x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[4], want[4])
    for t in (1, 2, 3):
        q, v = pairs[int(slots[t])]
        delta = torch.cat([x[t] @ q.a.T @ q.b.T, x[t] @ v.a.T @ v.b.T]) * 0.5
        torch.testing.assert_close(got[t], want[t] + delta, rtol=1e-5, atol=1e-5)


def test_speculative_decoding_with_adapters_changes_no_output(tiny_llama, llama_loras):
    """Draft tokens carry their row's adapter slot like its own token: with drafts (the adapted run's own
    outputs, so each is checked against a sample computed through the adapter) base and adapted rows decode
    exactly as without speculation, in fewer steps."""
    from plait.engine.drafter import ReplayDrafter

    kw = dict(max_num_batched_tokens=48, max_model_len=96, max_loras=2, max_lora_rank=16)
    prompts = random_prompts(4, 5, 20, seed=23)
    loras = [llama_loras["all"], None, llama_loras["qv"], llama_loras["mlp"]]
    plain = _lora_engine(tiny_llama, **kw)
    want = run_greedy(plain, prompts, 2 * MAX_TOKENS, arrive_every=1, loras=loras)[0]
    spec = _lora_engine(tiny_llama, speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **kw)
    spec.drafter = spec.scheduler.drafter = ReplayDrafter(spec.config.speculative_config,
                                                          {f"r-{i}": out for i, out in want.items()})
    assert run_greedy(spec, prompts, 2 * MAX_TOKENS, arrive_every=1, loras=loras)[0] == want
    assert spec.spec_stats.num_accepted_tokens > 0 and spec.num_steps < plain.num_steps


def test_embeddings_with_adapters_match_hf_with_merged_weights(tiny_llama, llama_loras):
    """An embedding model serves LoRA adapters as a generating one does (vLLM's LoRA for pooling models):
    each prompt's LAST-pooled, normalised embedding under its adapter equals HF's trunk with that adapter
    merged into the weights; adapters and base prompts share chunked batches, two slots for three adapters."""
    order = [llama_loras["qv"], None, llama_loras["all"], llama_loras["mlp"], llama_loras["qv"]]
    prompts = random_prompts(len(order), 3, 50, seed=11)
    llm = LLM(str(tiny_llama), runner="pooling", enable_lora=True, max_loras=2, block_size=8,
              max_num_batched_tokens=32)
    got = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False, lora_request=order)
    references = {}
    for out, prompt, lora in zip(got, prompts, order):
        name = lora.lora_name if lora else None
        hf = references.setdefault(name, _merged_hf(tiny_llama, lora))
        with torch.no_grad():
            state = hf.model(torch.tensor([prompt])).last_hidden_state[0, -1]
        want = torch.nn.functional.normalize(state, dim=-1)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, atol=2e-5, rtol=0)
    base = {lora.lora_name if lora else None: o.outputs.embedding for o, lora in zip(got, order)}
    assert all(base[name] != base[None] for name in ("qv", "all", "mlp"))  # every adapter changed something
    assert llm.engine.runner.breakdown.lora_steps > 0 and llm.engine.is_idle_and_clean()
    # The server: an adapter's name as the model of /v1/embeddings runs with that adapter.
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from plait.entrypoints.server import BackgroundServer, OpenAIServer, ServerConfig
    from plait.lora.request import LoRAModulePath

    modules = [LoRAModulePath("qv", llama_loras["qv"].lora_path)]
    with BackgroundServer(OpenAIServer(llm.engine, ServerConfig(log_level="warning", lora_modules=modules))
                          ) as url:
        served = [httpx.post(f"{url}/v1/embeddings", json={"model": model, "input": prompts[i]}, timeout=60)
                  for model, i in (("qv", 0), (None, 1))]  # order[0] is qv's, order[1] the base model's
    assert [r.status_code for r in served] == [200, 200], served[0].text
    assert [r.json()["model"] for r in served] == ["qv", llm.engine.model_name]  # as vLLM reports them
    assert served[0].json()["data"][0]["embedding"] == pytest.approx(got[0].outputs.embedding, abs=1e-6)
    assert served[1].json()["data"][0]["embedding"] == pytest.approx(base[None], abs=1e-6)
