"""Tensor parallelism on CPU (gloo): a model split over 2 (or 4) processes is the same model. Each family
matches transformers as the one-device engine does; sampling paths that read the driver's ids on the other
ranks (overlapped decodes, penalties sampled late, speculative drafts) agree with one device; a split the
model cannot take, or a feature not split yet, is refused by name; a dead worker fails the engine's step
instead of hanging it; and `plait serve --tensor-parallel-size 2` serves the openai client."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_engines_agree, assert_greedy_matches_hf, plait_serve_process, random_prompts
from test_classify import classifiers  # noqa: F401 - the tiny classifier checkpoints
from test_moe import _copy_model_folder, moe_models  # noqa: F401 - moe_models: the tiny MoE checkpoints

from plait.config import EngineConfig, ModelConfig
from plait.engine.engine import LLMEngine
from plait.layers.moe import FusedMoE, LocalExperts
from plait.parallel.workers import WorkerError
from plait.sampling_params import SamplingParams

LOGITS_ATOL = 1e-4
MAX_TOKENS = 10
# Summing o_proj's and down_proj's slices changes the order of fp32 sums: logits move by ~1e-6.
SPLIT_ATOL = 1e-4


def _engine(folder, tp: int, **knobs) -> LLMEngine:
    config = dict(model=str(folder), max_num_batched_tokens=48, block_size=8, tensor_parallel_size=tp)
    return LLMEngine(EngineConfig(**(config | knobs)))


# Seed-OSS splits as Qwen2 does (q/k/v biases), ERNIE 4.5 as GLM-4 (q/k reordered on each rank's heads, here
# over whole heads): both stay shardable, and their parity on one rank is test_hf_parity's.
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "granite", "glm4",
                                    "exaone4", "ministral3", "smollm3-sliding", "gpt_oss", "olmo3"])
def test_two_ranks_match_hf(tiny_models, family):
    """Heads, KV heads and MLP columns split in two (Qwen2's q/k/v biases, Qwen3's per-head q/k norms and
    tied embeddings, Phi-3's fused checkpoint projections, Gemma 2's sandwich norms and soft caps, Granite's
    multipliers, GPT-OSS's sinks per query head and biased experts with interleaved gate/up columns, OLMo 3's
    q/k norms across all heads, each rank normalising its slice with every rank's squares):
    greedy tokens and logits as transformers', prompts chunked beside decodes."""
    from transformers import AutoModelForCausalLM

    folder = tiny_models[family]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    engine = _engine(folder, 2)
    try:
        assert engine.runner.num_kv_heads == 1  # 2 KV heads, one a rank
        prompts = random_prompts(6, 1, 70, seed=7)
        assert_greedy_matches_hf(engine, hf, prompts, MAX_TOKENS, LOGITS_ATOL, family)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_two_ranks_split_experts(moe_models, family):  # noqa: F811 - the fixture imported above
    """Every routed expert's width split in two (and Qwen2-MoE's gated shared expert beside them, and its
    dense layer), the router replicated, the block's output summed once: transformers' tokens and logits."""
    folder, hf = moe_models[family]
    engine = _engine(folder, 2)
    try:
        prompts = random_prompts(4, 1, 60, seed=13)
        assert_greedy_matches_hf(engine, hf, prompts, MAX_TOKENS, LOGITS_ATOL, family)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["width", "whole-experts"])
def test_two_ranks_split_stacked_experts(moe_models, tmp_path, expert_parallel):  # noqa: F811
    """transformers 5's stacked experts (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]): each
    rank's gate and up rows and down columns of every expert at once, or under expert parallelism its
    experts' rows of each stack."""
    folder, hf = moe_models["qwen3_moe"]
    _copy_model_folder(folder, tmp_path / "stacked",
                       {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"})  # tied
    engine = _engine(tmp_path / "stacked", 2, enable_expert_parallel=expert_parallel)
    try:
        assert_greedy_matches_hf(engine, hf, random_prompts(3, 1, 50, seed=14), MAX_TOKENS, LOGITS_ATOL)
    finally:
        engine.shutdown()


def _hf_model(tiny_models, moe_models, family: str) -> tuple:  # noqa: F811
    """(folder, transformers' model) of a tiny MoE family: test_moe's, or conftest's GPT-OSS."""
    if family != "gpt_oss":
        return moe_models[family]
    from transformers import AutoModelForCausalLM

    folder = tiny_models[family]
    return folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                        attn_implementation="eager").eval()


# Mixtral's experts split by width above; whole experts are picked by index, whatever the tensors' names.
@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "gpt_oss"])
def test_two_ranks_hold_whole_experts(tiny_models, moe_models, family):  # noqa: F811
    """Expert parallelism (enable_expert_parallel): each rank holds half the routed experts whole (the
    driver the first half, at their full width), Qwen2-MoE's gated shared expert and dense layer still
    split in width, GPT-OSS's biased experts each biased on its own rank alone, the router replicated and
    the block's output summed once: transformers' tokens and logits."""
    folder, hf = _hf_model(tiny_models, moe_models, family)
    engine = _engine(folder, 2, enable_expert_parallel=True)
    try:
        full = ModelConfig.from_hf(hf.config.to_dict()).moe
        experts = next(m for m in engine.runner.model.modules() if isinstance(m, FusedMoE))
        assert experts.local_experts == LocalExperts(0, full.num_experts // 2, full.num_experts)
        assert experts.intermediate_size == full.intermediate_size
        assert_greedy_matches_hf(engine, hf, random_prompts(4, 1, 60, seed=13), MAX_TOKENS, LOGITS_ATOL,
                                 family)
    finally:
        engine.shutdown()


def test_four_ranks_share_kv_heads(tiny_llama):
    """More ranks than KV heads (4 and 2): each rank keeps the KV head its query heads read."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    engine = _engine(tiny_llama, 4)
    try:
        assert engine.runner.num_kv_heads == 1
        assert engine.runner.model.model.layers[0].self_attn.num_heads == 1
        assert_greedy_matches_hf(engine, hf, random_prompts(3, 1, 60, seed=8), MAX_TOKENS, LOGITS_ATOL)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def one_device(tiny_llama):
    return _engine(tiny_llama, 1)


@pytest.fixture(scope="module")
def two_ranks(tiny_llama):
    engine = _engine(tiny_llama, 2)
    yield engine
    engine.shutdown()


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, list[int]]:
    """Every prompt added at once, stepped to the end: request id -> output ids."""
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=str(i))
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return outputs


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.3,
                   presence_penalty=0.5),
    SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True),
], ids=["penalties", "seeded"])
def test_sampling_agrees_with_one_device(one_device, two_ranks, params):
    """Penalty rows sample after the next step's forward is launched (LLMEngine samples them late), so the
    workers' next forward is sent before the ids it reads are broadcast; seeded random sampling of the same
    logits draws the same tokens on the driver whatever the split."""
    prompts = random_prompts(4, 5, 40, seed=11)
    assert _run(two_ranks, prompts, params) == _run(one_device, prompts, params)


def test_speculative_drafts_agree_with_one_device(tiny_llama):
    """N-gram drafts: rows of several sampled positions, every one broadcast to the workers."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    split = _engine(tiny_llama, 2, speculative_config=spec)
    whole = _engine(tiny_llama, 1, speculative_config=spec)
    try:
        prompts = [[7, 8, 9, 7, 8, 9, 7, 8], *random_prompts(3, 4, 30, seed=12)]
        assert_engines_agree(split, whole, prompts, max_tokens=MAX_TOKENS, atol=SPLIT_ATOL)
        assert split.spec_stats.num_draft_tokens > 0
    finally:
        split.shutdown()


@pytest.mark.parametrize("knobs, message", [
    (dict(tensor_parallel_size=3), "must divide the model's attention heads"),
])
def test_refused_splits(tiny_llama, knobs, message):
    with pytest.raises(ValueError, match=message):
        LLMEngine(EngineConfig(model=str(tiny_llama), **knobs))


def test_refused_expert_parallelism(tiny_llama, moe_models):  # noqa: F811
    """Whole experts need as many on every rank (6 over 4 ranks: no), and more than one rank (plait's
    data-parallel replicas share no experts)."""
    with pytest.raises(ValueError, match="tensor_parallel_size 4 must divide the model's 6 routed experts"):
        LLMEngine(EngineConfig(model=str(moe_models["mixtral"][0]), tensor_parallel_size=4,
                               enable_expert_parallel=True))
    with pytest.raises(ValueError, match="needs tensor_parallel_size > 1"):
        EngineConfig(model=str(tiny_llama), enable_expert_parallel=True)


def test_refused_architecture():
    """A model whose layers no rank can build from a narrower config (a BERT encoder's) is refused by name."""
    from plait.parallel.shard import shard_for

    cfg = ModelConfig.from_hf({"architectures": ["BertModel"], "hidden_size": 8, "vocab_size": 8,
                               "num_attention_heads": 2, "num_hidden_layers": 1, "intermediate_size": 8})
    with pytest.raises(ValueError, match="BertModel cannot be split across devices"):
        shard_for(cfg, 0, 2)


def test_dead_worker_fails_the_step(tiny_llama):
    """A worker killed mid-run: the driver's next step raises WorkerError naming the rank, and does not wait
    on a collective that rank will never join."""
    engine = _engine(tiny_llama, 2)
    try:
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True), request_id="a")
        engine.step()
        proc = engine.runner.workers._procs[0]
        proc.kill()
        proc.wait()
        with pytest.raises(WorkerError, match="rank 1 exited"):
            for _ in range(3):
                engine.step()
    finally:
        engine.shutdown()


def test_serve_with_two_ranks(tmp_path, tiny_model):
    """`plait serve --tensor-parallel-size 2` and the openai client: greedy completion tokens equal the
    one-device engine's, streamed chat works, and SIGINT stops the server and its worker (exit 0)."""
    openai = pytest.importorskip("openai")
    model = tiny_model
    prompt = [1, 450, 3000, 77, 912, 5]
    whole = LLMEngine(EngineConfig(model=str(model), max_model_len=128, num_kv_blocks=64))
    want = _run(whole, [prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))["0"]
    args = ["--model", str(model), "--max-model-len", "128", "--num-kv-blocks", "64",
            "--tensor-parallel-size", "2"]
    with plait_serve_process(tmp_path, args) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        r = client.completions.create(model="tiny-model", prompt=prompt, max_tokens=8, temperature=0,
                                      logprobs=0, extra_body={"ignore_eos": True,
                                                              "return_tokens_as_token_ids": True})
        got = [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]
        assert got == want
        stream = client.chat.completions.create(model="tiny-model", stream=True, max_tokens=5,
                                                messages=[{"role": "user", "content": "hi"}])
        assert [c for c in stream if c.choices and c.choices[0].finish_reason]


def test_slices_of_every_rank_make_the_whole(tiny_llama):
    """Column-parallel rows and row-parallel columns of every rank, put back together, are the checkpoint's
    tensor (fused gate/up halves each split, biases too); a row-parallel bias is the driver's alone."""
    import json

    from plait.config import ModelConfig
    from plait.parallel.shard import shard_for

    full = ModelConfig.from_hf(json.loads((tiny_llama / "config.json").read_text()))
    inter, hidden = full.intermediate_size, full.hidden_size
    layer = "model.layers.0.mlp."
    tensors = {layer + "gate_up_proj.weight": torch.randn(2 * inter, hidden),
               layer + "gate_up_proj.bias": torch.randn(2 * inter),
               layer + "up_proj.bias": torch.randn(inter),
               layer + "down_proj.weight": torch.randn(hidden, inter),
               layer + "down_proj.bias": torch.randn(hidden)}
    shards = [dict(shard_for(full, r, 2).checkpoint(tensors.items())) for r in range(2)]
    for name in ("gate_up_proj.weight", "gate_up_proj.bias"):
        halves = [s[layer + name].chunk(2) for s in shards]  # each rank: [its gate rows; its up rows]
        whole = torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
        assert torch.equal(whole, tensors[layer + name]), name
    up_bias = torch.cat([s[layer + "up_proj.bias"] for s in shards])
    assert torch.equal(up_bias, tensors[layer + "up_proj.bias"])
    assert torch.equal(torch.cat([s[layer + "down_proj.weight"] for s in shards], dim=1),
                       tensors[layer + "down_proj.weight"])
    assert torch.equal(shards[0][layer + "down_proj.bias"], tensors[layer + "down_proj.bias"])
    assert not shards[1][layer + "down_proj.bias"].any()


def test_expert_parallel_slices_hold_whole_experts(tiny_llama, moe_models):  # noqa: F811
    """Under expert parallelism rank r of 2 keeps experts 3r..3r+2 of 6 (per-expert tensors, Mixtral's names
    and FP8 scales too, renumbered from 0; stacks' rows, biases included: an expert's down bias is its own
    rank's, not the driver's alone), Qwen2-MoE's shared expert still split in width, the router whole; the
    ranks' shares put back together are the checkpoint's tensors, and of_rank is shard_for's other rank. A
    dense model splits as without it (vLLM ignores the flag there)."""
    import json

    from plait.parallel.shard import experts_of_rank, shard_for

    folder, _ = moe_models["qwen2_moe"]
    full = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    moe, hidden, layer = full.moe, full.hidden_size, "model.layers.0."
    g = torch.Generator().manual_seed(0)
    stacked = {f"{layer}mlp.experts.{name}": torch.randn(moe.num_experts, *shape, generator=g)
               for name, shape in (("gate_up_proj", (2 * moe.intermediate_size, hidden)),
                                   ("down_proj", (hidden, moe.intermediate_size)),
                                   ("gate_up_bias", (2 * moe.intermediate_size,)), ("down_bias", (hidden,)))}
    one = {f"{layer}mlp.experts.4.up_proj.weight": torch.randn(moe.intermediate_size, hidden, generator=g),
           f"{layer}mlp.experts.4.up_proj.weight_scale_inv": torch.rand(1, 1, generator=g),
           f"{layer}block_sparse_moe.experts.1.w2.weight": torch.randn(hidden, moe.intermediate_size,
                                                                      generator=g)}
    replicated = {f"{layer}mlp.gate.weight": torch.randn(moe.num_experts, hidden, generator=g)}
    shared = {f"{layer}mlp.shared_expert.down_proj.weight": torch.randn(hidden, moe.shared_intermediate_size,
                                                                        generator=g)}
    tensors = stacked | one | replicated | shared
    shards = [shard_for(full, rank, 2, expert_parallel=True) for rank in range(2)]
    assert [s.expert_range for s in shards] == [experts_of_rank(6, r, 2) for r in (0, 1)] == [(0, 3), (3, 6)]
    assert shards[0].of_rank(1) == shards[1]
    assert shards[1].local.moe.intermediate_size == moe.intermediate_size
    assert shards[1].local.moe.shared_intermediate_size == moe.shared_intermediate_size // 2
    slices = [dict(s.checkpoint(tensors.items())) for s in shards]
    for name, whole in stacked.items():
        assert torch.equal(torch.cat([s[name] for s in slices]), whole), name
    every_rank = set(stacked | replicated | shared)
    assert set(slices[0]) == every_rank | {f"{layer}block_sparse_moe.experts.1.w2.weight"}  # its own number
    renamed = {f"{layer}mlp.experts.1.up_proj.weight", f"{layer}mlp.experts.1.up_proj.weight_scale_inv"}
    assert set(slices[1]) == every_rank | renamed
    for old in ("weight", "weight_scale_inv"):
        assert slices[1][f"{layer}mlp.experts.1.up_proj.{old}"] is one[f"{layer}mlp.experts.4.up_proj.{old}"]
    for s in slices:
        assert torch.equal(s[f"{layer}mlp.gate.weight"], replicated[f"{layer}mlp.gate.weight"])
    name = f"{layer}mlp.shared_expert.down_proj.weight"
    assert torch.equal(torch.cat([s[name] for s in slices], dim=1), shared[name])
    dense = ModelConfig.from_hf(json.loads((tiny_llama / "config.json").read_text()))
    assert dense.moe is None and shard_for(dense, 1, 2, expert_parallel=True) == shard_for(dense, 1, 2)


def test_lora_adapters_split_over_two_ranks(tiny_llama, tmp_path):
    """LoRA under tensor parallelism: each rank holds its slices of every adapter (B's rows of q/k/v/gate/up,
    A's columns of o/down, whose partial deltas are summed with the layer's output), sent by the driver when a
    slot is loaded; base rows, two adapters (one over all seven projections, rsLoRA) and a slot reused by
    another adapter answer as on one device."""
    from conftest import make_lora_adapter

    from plait.lora.request import LoRARequest

    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    kinds = [("all", every, 4), ("qv-o", ["q_proj", "v_proj", "o_proj"], 8)]
    adapters = []
    for i, (name, targets, rank) in enumerate(kinds):
        folder = make_lora_adapter(tmp_path / name, tiny_llama, targets, rank=rank, alpha=2 * rank,
                                   seed=i + 5, use_rslora=i == 0)
        adapters.append(LoRARequest(name, i + 1, str(folder)))
    order = [None, adapters[0], adapters[1], adapters[0], None, adapters[1]]
    prompts = random_prompts(len(order), 4, 40, seed=29)
    knobs = dict(enable_lora=True, max_loras=1)  # one slot: the adapters take it in turn
    split = _engine(tiny_llama, 2, **knobs)
    try:
        assert_engines_agree(split, _engine(tiny_llama, 1, **knobs), prompts, max_tokens=6, atol=SPLIT_ATOL,
                             loras=order)
        assert split.runner.lora.num_loads >= 3
    finally:
        split.shutdown()


def test_pooling_models_split_over_two_ranks(tiny_llama, classifiers, tmp_path):  # noqa: F811 - fixture above
    """A decoder run as an embedding model, a base model's checkpoint (LlamaModel: names without ``model.``,
    renamed before each rank takes its slices) and a ...ForSequenceClassification reward model, split in two:
    the driver pools (or scores) the whole hidden states, which the ranks' summed slices make; embeddings,
    per-token rows and probabilities are one device's."""
    from transformers import AutoModel

    from plait.pooling_params import PoolingParams

    AutoModel.from_pretrained(tiny_llama, dtype=torch.float32).save_pretrained(tmp_path / "base")
    prompts = random_prompts(4, 3, 40, seed=31)
    embeddings = [PoolingParams(task="embed"), PoolingParams(task="token_embed")]
    for folder, params in ((tiny_llama, embeddings), (tmp_path / "base", embeddings[:1]),
                           (classifiers["llama-3-labels"][0], [PoolingParams(task="classify")])):
        split = _engine(folder, 2, runner="pooling")
        try:
            for p in params:
                one = _engine(folder, 1, runner="pooling")
                got, want = (_pooled(engine, prompts, p) for engine in (split, one))
                for a, b in zip(got, want):
                    torch.testing.assert_close(a, b, atol=SPLIT_ATOL, rtol=0)
        finally:
            split.shutdown()


def _pooled(engine: LLMEngine, prompts: list[list[int]], params) -> list[torch.Tensor]:
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=str(i))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[int(out.request_id)] = out.outputs.data
    return [done[i] for i in range(len(prompts))]
