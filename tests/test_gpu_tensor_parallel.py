"""Tensor parallelism on GPUs (pytest -m gpu, 2 or more GPUs): a bf16 checkpoint split over two GPUs (NCCL,
Triton attention, CUDA graphs with the all-reduces captured, overlapped steps) runs the model one GPU runs: a
dense Llama, and sparse MoE models (Qwen3-MoE, Mixtral, GPT-OSS: every expert's width split, or under expert
parallelism half the experts whole on each GPU; routers replicated); and quantised checkpoints (block FP8, a
block-FP8 Qwen3-MoE too, and GPTQ, a GPTQ Qwen3-MoE too)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import random_prompts, run_greedy

from plait.config import EngineConfig
from plait.engine.engine import LLMEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

NUM_PROMPTS = 32
NEW_TOKENS = 32
# bf16: the split sums o_proj's and down_proj's (or the experts') halves in another order, so logits move by a
# few bf16 steps of the activations; a wrong slice (a head, a column block) moves them by their whole spread.
FIRST_LOGITS_TOL = 0.1  # in logit std, every prompt
FIRST_LOGITS_MEDIAN_TOL = 0.05  # over the prompts
NEAR_TIE = 0.02  # a fork is rounding where the one-GPU logits' top two were this close (logit std)
MIN_AGREEMENT = 0.5
# A sparse MoE model has a second kind of near-tie: its router's. bf16 router logits tie often, and a step of
# rounding then swaps one of a token's k experts for another (on CPU, bf16, TP 2 vs 1: 1.6-1.9% of routings
# here), moving that row's next logits by up to ~0.09 std (Mixtral: one of 32 prompts' first logits, 0.089 on
# CPU and 0.094 on two H200s, where the median prompt's were 0.008). Halving every MoE block's output (a
# missing half-sum) moves the median prompt's first logits by 0.11 (Qwen3-MoE) to 0.15 (Mixtral) std, with 11
# and 3 of 32 prompts agreeing: the median and the agreement catch it.
MOE_FIRST_LOGITS_TOL = 0.25
MOE_NEAR_TIE = 0.1
# FP8 inputs amplify rounding: a value that the split's other order of bf16 sums moves across an FP8
# rounding step changes by 1/16 of itself, and the halves of down's K (2,816) take the Triton FP8 kernel
# where one GPU's 5,632 takes cuBLASLt's. Measured on two H200s: first logits within 0.18 std (median
# 0.11), forks at gaps under 0.1, 8 of 32 prompts agreeing over 32 tokens; a wrong slice of codes or scales
# moved them ~6 std.
FP8_FIRST_LOGITS_TOL = 0.4
FP8_FIRST_LOGITS_MEDIAN_TOL = 0.2
FP8_NEAR_TIE = 0.2
FP8_MIN_AGREEMENT = 0.1
# A random adapter's A and B entries: big enough that its delta moves the logits well past the split's
# rounding (the test checks it does).
LORA_STD = 0.05
# Pooled hidden states of two GPUs against one: bf16 rounding of the split's sums leaves them this alike;
# two different prompts' are far less.
POOLED_MIN_COSINE = 0.999
# Shared by every model here: GQA, 16 query and 4 KV heads of 128.
ATTENTION = dict(num_attention_heads=16, num_key_value_heads=4, head_dim=128, vocab_size=8192,
                 max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=False)


def _save_random(tmp_path_factory, cfg, name: str):
    """A random model of ``cfg`` saved in bf16, its embeddings scaled up so a token's own embedding leads the
    residual stream, as in trained models (tests/test_gpu_engine.py says why)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(100.0)
    folder = tmp_path_factory.mktemp(name)
    model.to(torch.bfloat16).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random Llama."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, **ATTENTION)
    return _save_random(tmp_path_factory, cfg, "llama-tp")


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "gpt_oss"])
def moe_checkpoint(request, tmp_path_factory):
    """(family, folder): a random Qwen3-MoE (16 experts, top 4, renormalised; q/k norms), Mixtral (8
    experts, top 2) or GPT-OSS (8 experts, top 4, with biases and the clamped SwiGLU; sinks; every other
    layer's window shorter than the prompts)."""
    from transformers import GptOssConfig, MixtralConfig, Qwen3MoeConfig

    if request.param == "qwen3_moe":
        cfg = Qwen3MoeConfig(hidden_size=1024, num_hidden_layers=4, moe_intermediate_size=512, num_experts=16,
                             num_experts_per_tok=4, norm_topk_prob=True, **ATTENTION)
    elif request.param == "gpt_oss":
        yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 150_000.0, "beta_fast": 32.0,
                "beta_slow": 1.0, "original_max_position_embeddings": 512, "truncate": False}
        cfg = GptOssConfig(hidden_size=1024, intermediate_size=512, num_hidden_layers=4, num_local_experts=8,
                           num_experts_per_tok=4, sliding_window=128, rope_parameters=yarn,
                           **(ATTENTION | {"rope_theta": 150_000.0}))
    else:
        cfg = MixtralConfig(hidden_size=1024, intermediate_size=512, num_hidden_layers=4, num_local_experts=8,
                            num_experts_per_tok=2, **ATTENTION)
    return request.param, _save_random(tmp_path_factory, cfg, f"{request.param}-tp")


def _engine(folder, tp: int, expert_parallel: bool = False, **knobs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(folder), dtype="bfloat16", tensor_parallel_size=tp,
                                  max_model_len=1024, max_num_seqs=64, max_num_batched_tokens=256,
                                  enable_prefix_caching=False, num_kv_blocks=4096,
                                  enable_expert_parallel=expert_parallel, **knobs))


def _greedy(folder, tp: int, prompts, expert_parallel: bool = False, loras: list | None = None, **knobs):
    """(index -> greedy ids, index -> the logits each was sampled from, the runner's step breakdown); request
    i with LoRA adapter ``loras[i]`` where given."""
    engine = _engine(folder, tp, expert_parallel, **knobs)
    try:
        ids, logits = run_greedy(engine, prompts, NEW_TOKENS, arrive_every=2, capture_logits=True,
                                 loras=loras)
        return ids, logits, engine.runner.breakdown
    finally:
        engine.shutdown()


def _agreement(want, want_logits, got, got_logits) -> tuple[int, list[float], list[float]]:
    """(prompts whose greedy ids agree, each fork's gap between the one-GPU logits of its two tokens, each
    prompt's largest first-logits difference), the last two in logit std of the one-GPU row."""
    agree, gaps, first = 0, [], []
    for i in range(len(want)):
        first_want, first_got = want_logits[i][0], got_logits[i][0]  # the prompt's own logits: same inputs
        first.append(float((first_got - first_want).abs().max() / first_want.std()))
        fork = next((j for j, (a, c) in enumerate(zip(got[i], want[i])) if a != c), None)
        if fork is None:
            agree += 1
            continue
        row = want_logits[i][fork]
        gaps.append(float(row[want[i][fork]] - row[got[i][fork]]) / float(row.std()))
    return agree, gaps, first


def _check_two_gpus_run_the_one_gpu_model(folder, what: str, first_tol: float = FIRST_LOGITS_TOL,
                                          near_tie: float = NEAR_TIE, expert_parallel: bool = False,
                                          median_tol: float = FIRST_LOGITS_MEDIAN_TOL,
                                          min_agreement: float = MIN_AGREEMENT, loras: list | None = None,
                                          **knobs) -> dict:
    """Greedy ids and logits of two GPUs against one's (bf16, graphs); returns the one GPU's logits."""
    prompts = random_prompts(NUM_PROMPTS, 1, 400, seed=3)
    want, want_logits, _ = _greedy(folder, 1, prompts, loras=loras, **knobs)
    got, got_logits, b = _greedy(folder, 2, prompts, expert_parallel, loras=loras, **knobs)
    assert b.single_token_steps > 0 and b.graph_single_token_steps == b.single_token_steps
    agree, gaps, first = _agreement(want, want_logits, got, got_logits)
    median = float(torch.tensor(first).median())
    print(f"\n{what}, tensor parallel 2 vs 1 GPU, bf16: {agree}/{NUM_PROMPTS} agree over {NEW_TOKENS} "
          f"tokens; first logits within {max(first):.4f} std (median {median:.4f}); fork gaps (logit std) "
          f"{sorted(round(g, 4) for g in gaps)}")
    assert max(first) <= first_tol and median <= median_tol
    assert all(0 <= g <= near_tie for g in gaps), f"a fork at a confident token: {sorted(gaps)}"
    assert agree >= min_agreement * NUM_PROMPTS
    return want_logits


def test_two_gpus_run_the_one_gpu_model(checkpoint):
    _check_two_gpus_run_the_one_gpu_model(checkpoint, "llama")


def test_two_gpus_run_the_one_gpu_moe_model(moe_checkpoint):
    """Every routed expert's width split: each GPU runs half of each expert's columns in the Triton experts
    (plait.kernels.fused_moe), and the block's output is summed once; the router, replicated, routes alike."""
    family, folder = moe_checkpoint
    _check_two_gpus_run_the_one_gpu_model(folder, family, MOE_FIRST_LOGITS_TOL, MOE_NEAR_TIE)


def test_two_gpus_holding_whole_experts_run_the_one_gpu_moe_model(moe_checkpoint):
    """Expert parallelism (enable_expert_parallel): each GPU holds half the routed experts whole (Qwen3-MoE's
    8 of 16, Mixtral's and GPT-OSS's 4 of 8) and runs them for every token in the Triton experts, the
    entries of the other GPU's experts skipped inside the kernels (decode steps in CUDA graphs); the block's
    output is summed once, as under the split in width."""
    family, folder = moe_checkpoint
    _check_two_gpus_run_the_one_gpu_model(folder, f"{family} (expert parallel)", MOE_FIRST_LOGITS_TOL,
                                          MOE_NEAR_TIE, expert_parallel=True)


def test_symmetric_memory_all_reduce_sums_as_nccl(checkpoint):
    """Decode steps' all-reduces go through symmetric memory (one-shot, in the graphs), prompt-sized ones
    through NCCL; on two GPUs a + b rounds once whichever sums it, so the tokens and logits equal those of
    the same engine with NCCL alone, bit for bit. In a fresh interpreter: torch lets a process take part in
    one symmetric-memory rendezvous (plait.parallel.symmetric_memory says why), and this one made TP engines
    already; a second engine there falls back to NCCL, as the script's second engine checks."""
    script = textwrap.dedent(f"""
        import json, os, sys
        import torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from conftest import random_prompts, run_greedy
        from plait.config import EngineConfig
        from plait.engine.engine import LLMEngine

        prompts = random_prompts(8, 1, 400, seed=5)
        runs = {{}}
        for switch in ("1", "0"):
            os.environ["PLAIT_SYMM_ALL_REDUCE"] = switch  # the workers inherit it
            engine = LLMEngine(EngineConfig(model={str(checkpoint)!r}, dtype="bfloat16",
                                            tensor_parallel_size=2, max_model_len=1024, max_num_seqs=64,
                                            max_num_batched_tokens=256, enable_prefix_caching=False,
                                            num_kv_blocks=4096))
            symmetric = engine.runner.group.symmetric
            ids, logits = run_greedy(engine, prompts, {NEW_TOKENS}, arrive_every=2, capture_logits=True)
            b = engine.runner.breakdown
            runs[switch] = dict(ids=ids, logits=logits, symmetric=symmetric is not None,
                                calls=symmetric.num_calls if symmetric else 0,
                                graphed=b.graph_single_token_steps == b.single_token_steps > 0)
            engine.shutdown()
        again = LLMEngine(EngineConfig(model={str(checkpoint)!r}, dtype="bfloat16", tensor_parallel_size=2,
                                       max_model_len=256, num_kv_blocks=64))
        second_engine_symmetric = again.runner.group.symmetric is not None
        again.shutdown()
        on, off = runs["1"], runs["0"]
        print(json.dumps(dict(
            symmetric=[on["symmetric"], off["symmetric"], second_engine_symmetric], calls=on["calls"],
            graphed=[on["graphed"], off["graphed"]], same_ids=on["ids"] == off["ids"],
            same_logits=all(torch.equal(torch.stack(on["logits"][i]), torch.stack(off["logits"][i]))
                            for i in off["logits"]))))
    """)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"\nsymmetric-memory all-reduce: {got}")
    # On in the first engine, off by the switch, and off in a second engine with the switch on (no hang).
    assert got["symmetric"] == [True, False, False]
    assert got["calls"] > 0 and got["graphed"] == [True, True]
    assert got["same_ids"] and got["same_logits"]


def test_two_gpus_take_prompt_embeddings_as_their_token_ids(checkpoint):
    """Prompts given as embeddings (the rows of token prompts' embeddings) on two GPUs: the driver sends each
    step's rows to the other rank, whose graphs and eager steps stage them as the driver's do, so they answer
    as the token prompts do on the same engine. A rank that looked its placeholder ids up instead would
    compute other hidden states and fork."""
    from plait.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(checkpoint), tensor_parallel_size=2, max_model_len=1024,
                                    num_kv_blocks=512, enable_prompt_embeds=True, usage="serve"))
    try:
        prompts = random_prompts(8, 20, 200, seed=5)
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        want = [o.outputs[0].token_ids for o in _run(engine, prompts, params)]
        weight = engine.runner.model.model.embed_tokens.weight
        embeds = [weight[torch.tensor(p, device=weight.device)].cpu() for p in prompts]
        assert [o.outputs[0].token_ids for o in _run(engine, embeds, params)] == want
    finally:
        engine.shutdown()


def _run(engine: LLMEngine, prompts: list, params) -> list:
    """Every prompt (token ids or a tensor of embeddings) at once, outputs in prompt order."""
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=f"p-{i}")
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    return [finals[f"p-{i}"] for i in range(len(prompts))]


def test_two_gpus_run_the_one_gpu_block_fp8_model(checkpoint, tmp_path):
    """A block-wise FP8 checkpoint (128 x 128 tiles, as Qwen's and DeepSeek's FP8 releases): each GPU holds
    whole tiles of its rows and columns with their scales (Shard.checkpoint), and its slice of each input
    holds whole 128-wide groups, so its inputs round as on one GPU: the Triton and cuBLASLt FP8 paths of two
    GPUs run the one-GPU model."""
    from test_fp8_block import block_checkpoint

    block_checkpoint(checkpoint, tmp_path / "fp8", "fp8", block=(128, 128))
    _check_two_gpus_run_the_one_gpu_model(tmp_path / "fp8", "llama, block FP8", FP8_FIRST_LOGITS_TOL,
                                          FP8_NEAR_TIE, median_tol=FP8_FIRST_LOGITS_MEDIAN_TOL,
                                          min_agreement=FP8_MIN_AGREEMENT)


@pytest.fixture(scope="module")
def qwen3_moe_16_bit(tmp_path_factory):
    """A random Qwen3-MoE (16 experts 512 wide, top 4) in bf16: what the quantised MoE checkpoints hold."""
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(hidden_size=1024, num_hidden_layers=4, moe_intermediate_size=512, num_experts=16,
                         num_experts_per_tok=4, norm_topk_prob=True, **ATTENTION)
    return _save_random(tmp_path_factory, cfg, "qwen3-moe-16-bit")


@pytest.fixture(scope="module")
def block_fp8_moe_checkpoint(qwen3_moe_16_bit, tmp_path_factory):
    """The random Qwen3-MoE as Qwen3-30B-A3B-FP8 is written: 128 x 128 tiles with weight_scale_inv, routers
    16-bit."""
    from test_moe import fp8_moe_checkpoint

    folder = qwen3_moe_16_bit
    fp8 = tmp_path_factory.mktemp("qwen3-moe-fp8") / "ckpt"
    fp8_moe_checkpoint(folder, fp8, block=(128, 128))
    return fp8


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["width", "whole-experts"])
def test_two_gpus_run_the_one_gpu_block_fp8_moe_model(block_fp8_moe_checkpoint, expert_parallel):
    """A block-wise FP8 MoE checkpoint: each GPU holds every expert's gate and up rows and down columns in
    whole 128 x 128 tiles (256 of 512 a GPU: 2 tiles) with their scales, or half the experts whole, and runs
    them in the Triton FP8 experts; its slice of an expert's hidden activations holds whole 128-wide groups,
    so they round as on one GPU. Judged as the dense block-FP8 model is: FP8's rounding amplifies the split's
    other order of sums (and the router's near-ties with it)."""
    what = "qwen3_moe, block FP8" + (" (expert parallel)" if expert_parallel else "")
    _check_two_gpus_run_the_one_gpu_model(block_fp8_moe_checkpoint, what, FP8_FIRST_LOGITS_TOL, FP8_NEAR_TIE,
                                          expert_parallel=expert_parallel,
                                          median_tol=FP8_FIRST_LOGITS_MEDIAN_TOL,
                                          min_agreement=FP8_MIN_AGREEMENT)


def test_two_gpus_run_the_one_gpu_gptq_model(checkpoint, tmp_path):
    """A GPTQ checkpoint (4-bit, groups of 128): each GPU takes whole packed words and groups of its columns
    or inputs, and its WNA16 kernels run the one-GPU model's weights."""
    from test_wna16 import _quantized_checkpoint

    _quantized_checkpoint(checkpoint, tmp_path / "gptq", "gptq", 4, 128, sym=True, act_order=False)
    _check_two_gpus_run_the_one_gpu_model(tmp_path / "gptq", "llama, GPTQ")


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["width", "whole-experts"])
def test_two_gpus_run_the_one_gpu_gptq_moe_model(qwen3_moe_16_bit, tmp_path, expert_parallel):
    """A GPTQ Qwen3-MoE (4-bit, groups of 128, as Qwen3-30B-A3B-GPTQ-Int4): each GPU holds whole packed words
    and groups of every expert's gate and up columns and down inputs (256 of 512: two groups), or half the
    experts whole, and dequantises them in the fused MoE kernels' K loops; routers 16-bit."""
    from test_wna16 import _quantized_checkpoint

    _quantized_checkpoint(qwen3_moe_16_bit, tmp_path / "gptq", "gptq", 4, 128, sym=True, act_order=False)
    what = "qwen3_moe, GPTQ" + (" (expert parallel)" if expert_parallel else "")
    _check_two_gpus_run_the_one_gpu_model(tmp_path / "gptq", what, MOE_FIRST_LOGITS_TOL, MOE_NEAR_TIE,
                                          expert_parallel=expert_parallel)


def test_two_gpus_run_the_one_gpu_model_with_lora_adapters(checkpoint, tmp_path):
    """LoRA under tensor parallelism: each GPU holds its slices of every adapter (B's rows of the column-
    parallel projections, A's columns of o/down, whose partial deltas the all-reduce sums with the layer's),
    and its graphs capture the deltas. Base rows and two adapters' rows, interleaved in every step, run as on
    one GPU; and the adapters move the logits far more than the split does (so a rank ignoring its slices
    would show)."""
    from conftest import make_lora_adapter

    from plait.lora.request import LoRARequest

    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    kinds = [("all", every, 8), ("qv-o-down", ["q_proj", "v_proj", "o_proj", "down_proj"], 16)]
    adapters = []
    for i, (name, targets, rank) in enumerate(kinds):
        folder = make_lora_adapter(tmp_path / name, checkpoint, targets, rank=rank, alpha=2 * rank,
                                   seed=i + 5, std=LORA_STD)
        adapters.append(LoRARequest(name, i + 1, str(folder)))
    loras = [(None, *adapters)[i % 3] for i in range(NUM_PROMPTS)]
    knobs = dict(enable_lora=True, max_loras=2, max_lora_rank=16)
    with_adapters = _check_two_gpus_run_the_one_gpu_model(checkpoint, "llama, 2 LoRA adapters", loras=loras,
                                                          **knobs)
    _, base, _ = _greedy(checkpoint, 1, random_prompts(NUM_PROMPTS, 1, 400, seed=3))
    moved = [float((with_adapters[i][0] - base[i][0]).abs().max() / base[i][0].std())
             for i in range(NUM_PROMPTS)]
    adapted = [m for m, lora in zip(moved, loras) if lora is not None]
    unadapted = [m for m, lora in zip(moved, loras) if lora is None]
    print(f"LoRA adapters move the first logits by {min(adapted):.3f} to {max(adapted):.3f} std; base rows "
          f"of the LoRA engine by at most {max(unadapted):.4f}")
    assert min(adapted) > 2 * FIRST_LOGITS_TOL and max(unadapted) <= FIRST_LOGITS_TOL


def test_two_gpus_pool_as_one(checkpoint):
    """Pooling models under tensor parallelism: the driver pools (or keeps per token) the hidden states the
    GPUs' summed slices make; embeddings and per-token rows within bf16 rounding of the split's other
    summation order (cosine similarity), unlike another prompt's."""
    from plait.pooling_params import PoolingParams

    prompts = random_prompts(16, 1, 400, seed=7)
    for task in ("embed", "token_embed"):
        params = PoolingParams(task=task)
        one, two = (_pooled(_engine(checkpoint, tp, runner="pooling"), prompts, params) for tp in (1, 2))
        cos = [float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).min())
               for a, b in zip(one, two)]
        print(f"pooling {task}, tensor parallel 2 vs 1 GPU, bf16: least cosine similarity {min(cos):.5f}")
        assert min(cos) >= POOLED_MIN_COSINE
        if task == "embed":
            others = float(torch.nn.functional.cosine_similarity(one[0].float(), one[1].float(), dim=-1))
            assert others < POOLED_MIN_COSINE


def _pooled(engine: LLMEngine, prompts: list[list[int]], params) -> list[torch.Tensor]:
    """Each prompt's pooled output, in prompt order; the engine shut down after."""
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, params, request_id=str(i))
        done = {}
        while engine.has_unfinished_requests():
            done.update({int(o.request_id): o.outputs.data.cpu() for o in engine.step() if o.finished})
        return [done[i] for i in range(len(prompts))]
    finally:
        engine.shutdown()
