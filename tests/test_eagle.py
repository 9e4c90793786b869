"""EAGLE speculative decoding: a one-layer head drafts from the target's hidden states (EAGLE-1: the final
ones; EAGLE-3: three layers' residual streams). Heads are written in the layouts the published checkpoints
use, and every draft is checked against a plain-torch EAGLE over HF transformers' hidden states; whatever
the head, outputs equal those without speculation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_VOCAB, random_prompts
from safetensors.torch import save_file
from test_speculative import MAX_TOKENS, MIXED_PARAMS, _assert_same, _engine, _generate, _generate_aborting

from plait.engine.drafter import PENDING_DRAFT_ID
from plait.engine.eagle import EagleDrafter
from plait.models.eagle import aux_layer_ids
from plait.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 64, 4, 2, 16, 128  # the tiny Llama's (conftest)
DRAFT_VOCAB = 96  # EAGLE-3's draft vocabulary: a subset of the target's 512 ids
AUX_LAYERS = [0, 1, 1]  # of the tiny target's two layers (vLLM's default needs at least four)
# A KV cache of 8-token blocks too small for the test prompts at once (the longest needs 15 blocks).
NUM_SMALL_KV_BLOCKS = 20


def _prompts() -> list[list[int]]:
    """Short prompts and one over twice the token budget (48): the head follows its chunks step by step."""
    return random_prompts(4, 3, 30, seed=31) + random_prompts(1, 110, 110, seed=32)


def _spec_run(engine, prompts: list[list[int]], params: SamplingParams, monkeypatch
              ) -> tuple[dict, list[tuple[list[int], tuple[int, ...]]]]:
    """The engine's outputs for ``prompts`` and every (known tokens, drafts) it proposed."""
    seen: list[tuple[list[int], tuple[int, ...]]] = []
    with monkeypatch.context() as patch:
        _record_drafts(patch, lambda known, drafts: seen.append((known, drafts)))
        return _generate(engine, prompts, [params] * len(prompts)), seen


def _head_config(method: str) -> dict:
    config = {"model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": INTER,
              "num_hidden_layers": 1, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
              "vocab_size": TINY_VOCAB, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu"}
    if method == "eagle":  # as yuhuili's EAGLE-1 heads are published: a plain one-layer Llama config
        return config | {"architectures": ["LlamaForCausalLM"]}
    return config | {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": DRAFT_VOCAB,
                     "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_LAYERS}}


TINY_DIMS = dict(hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, inter=INTER,
                 vocab=TINY_VOCAB, draft_vocab=DRAFT_VOCAB)


def _random_head(method: str, seed: int, dims: dict = TINY_DIMS) -> dict[str, torch.Tensor]:
    """A head's tensors under the names its published checkpoints use (no embedding: the target's)."""
    g = torch.Generator().manual_seed(seed)
    hidden, inter, vocab, draft_vocab = dims["hidden"], dims["inter"], dims["vocab"], dims["draft_vocab"]

    def w(*shape: int, scale: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    q, kv = dims["heads"] * dims["head_dim"], dims["kv_heads"] * dims["head_dim"]
    attn_in = hidden if method == "eagle" else 2 * hidden
    layer = {"self_attn.q_proj.weight": w(q, attn_in), "self_attn.k_proj.weight": w(kv, attn_in),
             "self_attn.v_proj.weight": w(kv, attn_in), "self_attn.o_proj.weight": w(hidden, q),
             "mlp.gate_proj.weight": w(inter, hidden), "mlp.up_proj.weight": w(inter, hidden),
             "mlp.down_proj.weight": w(hidden, inter),
             "post_attention_layernorm.weight": 1 + w(hidden, scale=0.1)}
    if method == "eagle":
        return {"fc.weight": w(hidden, 2 * hidden, scale=0.2),
                **{f"layers.0.{k}": v for k, v in layer.items()}}
    layer |= {"input_layernorm.weight": 1 + w(hidden, scale=0.1),
              "hidden_norm.weight": 1 + w(hidden, scale=0.1)}
    # A draft vocabulary of draft_vocab target ids, in order; d2t holds target id - draft id.
    target_ids = torch.sort(torch.randperm(vocab, generator=g)[:draft_vocab]).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[target_ids] = True
    return {"fc.weight": w(hidden, 3 * hidden, scale=0.1), "norm.weight": 1 + w(hidden, scale=0.1),
            "lm_head.weight": w(draft_vocab, hidden, scale=1.0),
            "d2t": target_ids - torch.arange(draft_vocab), "t2d": t2d,
            **{f"midlayer.{k}": v for k, v in layer.items()}}


def _save_head(folder: Path, method: str, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(_head_config(method)))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module", params=["eagle", "eagle3"])
def head(request, tmp_path_factory) -> tuple[str, Path, dict[str, torch.Tensor]]:
    method = request.param
    tensors = _random_head(method, seed=7)
    return method, _save_head(tmp_path_factory.mktemp(f"head-{method}"), method, tensors), tensors


def _spec(method: str, folder: Path, k: int = 3) -> dict:
    return {"method": method, "model": str(folder), "num_speculative_tokens": k}


# -- a plain-torch EAGLE over transformers' hidden states ---------------------------------------------------


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D], HF's rotate-half convention
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    angles = positions[:, None].float() * inv_freq[None]  # [T, D/2]
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    half = torch.cat([-x[..., HEAD_DIM // 2:], x[..., : HEAD_DIM // 2]], -1)
    return x * cos + half * sin


def _attention(qkv: torch.Tensor, t: dict, prefix: str) -> torch.Tensor:
    # qkv: [T, input] -> [T, hidden], causal over positions 0..T-1
    n = qkv.shape[0]
    q = (qkv @ t[f"{prefix}self_attn.q_proj.weight"].T).view(n, HEADS, HEAD_DIM)
    k = (qkv @ t[f"{prefix}self_attn.k_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM)
    v = (qkv @ t[f"{prefix}self_attn.v_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM)
    positions = torch.arange(n)
    q, k = _rotate(q, positions), _rotate(k, positions)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         is_causal=True)
    return out.transpose(0, 1).reshape(n, -1) @ t[f"{prefix}self_attn.o_proj.weight"].T


def _mlp(x: torch.Tensor, t: dict, prefix: str) -> torch.Tensor:
    gate, up = x @ t[f"{prefix}mlp.gate_proj.weight"].T, x @ t[f"{prefix}mlp.up_proj.weight"].T
    return (F.silu(gate) * up) @ t[f"{prefix}mlp.down_proj.weight"].T


def _head_step(method: str, t: dict, hf, tokens: torch.Tensor, features: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The head over positions 0..T-1 (token p + 1 beside feature p): (last position's logits over the
    target vocabulary, every position's output feature)."""
    embeds = hf.model.embed_tokens(tokens)
    if method == "eagle":
        x = torch.cat([embeds, features], -1) @ t["fc.weight"].T
        r = x + _attention(x, t, "layers.0.")
        out = r + _mlp(_rms(r, t["layers.0.post_attention_layernorm.weight"]), t, "layers.0.")
        return out[-1] @ hf.lm_head.weight.T, out
    p = "midlayer."
    normed = _rms(features, t[f"{p}hidden_norm.weight"])
    r = features + _attention(torch.cat([_rms(embeds, t[f"{p}input_layernorm.weight"]), normed], -1), t, p)
    out = r + _mlp(_rms(r, t[f"{p}post_attention_layernorm.weight"]), t, p)
    draft = _rms(out[-1], t["norm.weight"]) @ t["lm_head.weight"].T
    logits = torch.full((TINY_VOCAB,), float("-inf"))
    logits[torch.arange(DRAFT_VOCAB) + t["d2t"]] = draft
    return logits, out


@torch.no_grad()
def _reference_drafts(method: str, t: dict, hf, known: list[int], k: int) -> list[int]:
    """The head's k greedy drafts after ``known`` (t0..tn): positions 0..n-1 read the target's features,
    then each draft feeds the next with the head's own output feature."""
    ids = torch.tensor([known])
    streams = []
    def tap(module, args, kwargs):
        streams.append(args[0] if args else kwargs["hidden_states"])

    hooks = [layer.register_forward_pre_hook(tap, with_kwargs=True) for layer in hf.model.layers]
    try:
        final = hf.model(ids).last_hidden_state[0]  # [n + 1, hidden], after the final norm
    finally:
        for hook in hooks:
            hook.remove()
    if method == "eagle":
        features = final[:-1]
    else:
        features = torch.cat([streams[i][0] for i in AUX_LAYERS], -1)[:-1] @ t["fc.weight"].T
    tokens = ids[0, 1:]
    drafts = []
    for _ in range(k):
        logits, out = _head_step(method, t, hf, tokens, features)
        drafts.append(int(logits.argmax()))
        tokens = torch.cat([tokens, torch.tensor(drafts[-1:])])
        features = torch.cat([features, out[-1:]])
    return drafts


def _record_drafts(patch: pytest.MonkeyPatch, record) -> None:
    """record(known tokens, drafts) for each request's drafts, once the step verifying them is launched: the
    last draft, which that step reads on the device, is on the host by then."""
    settle = EagleDrafter.settle

    def recording(self, plan):
        settle(self, plan)
        for request, drafts in self._drafts.items():
            assert PENDING_DRAFT_ID not in drafts
            record(request.token_ids(0, request.num_known_tokens), drafts)

    patch.setattr(EagleDrafter, "settle", recording)


# -- the tests -----------------------------------------------------------------------------------------------


def test_drafts_are_the_heads_continuation_over_the_targets_hidden_states(tiny_llama, head, monkeypatch):
    """Every proposal, for prompts chunked over several steps, for decodes after kept and rejected drafts and
    for requests preempted (their blocks, the head's K/V with them, recomputed) equals the plain-torch
    EAGLE's over transformers' hidden states of the same tokens; outputs and logprobs are those without
    speculation."""
    from transformers import AutoModelForCausalLM

    method, folder, tensors = head
    engine = _engine(tiny_llama, _spec(method, folder), num_kv_blocks=NUM_SMALL_KV_BLOCKS)
    engine.record_timeline = True
    assert isinstance(engine.drafter, EagleDrafter)
    seen: list[tuple[list[int], tuple[int, ...]]] = []
    _record_drafts(monkeypatch, lambda known, drafts: seen.append((known, drafts)))
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    prompts = _prompts()[:2] + _prompts()[-1:]
    got = _generate(engine, prompts, [params] * 3)
    _assert_same(got, _generate(_engine(tiny_llama, None, num_kv_blocks=NUM_SMALL_KV_BLOCKS), prompts,
                                [params] * 3))
    assert engine.drafter.num_forwards > 0 and engine.drafter.is_clean()
    assert sum(s.num_preempted for s in engine.timeline) > 0, "the test did not force a preemption"
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    assert len(seen) >= 12
    for known, drafts in seen:
        assert list(drafts) == _reference_drafts(method, tensors, hf, known, 3), f"after {len(known)} tokens"


def test_the_heads_kv_comes_back_from_host_memory_with_the_targets(tiny_llama, head, monkeypatch):
    """KV offloading beside an EAGLE head, whose K/V lives at the target's block ids: two prompts, then others
    that push them out of a 24-block device cache into host memory, then the two again, served from the host
    pool. The head's K/V of those blocks went out and came back with the target's, so every proposal of the
    returning prompts is still the plain-torch EAGLE's over transformers' hidden states."""
    from transformers import AutoModelForCausalLM

    method, folder, tensors = head
    connector = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"num_cpu_blocks": 64}}
    engine = _engine(tiny_llama, _spec(method, folder), num_kv_blocks=24, block_size=4, max_num_seqs=2,
                     enable_prefix_caching=True, kv_transfer_config=connector)
    assert engine.drafter.runner.num_host_kv_blocks == 64
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = random_prompts(2, 30, 40, seed=41)
    _generate(engine, first, [params] * 2)
    _generate(engine, random_prompts(4, 30, 40, seed=42), [params] * 4)
    _, seen = _spec_run(engine, first, params, monkeypatch)
    assert engine.kv_cache.stats.external_hits >= 56  # both prompts' prefixes came back from the host
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    assert len(seen) >= 4
    for known, drafts in seen:
        assert list(drafts) == _reference_drafts(method, tensors, hf, known, 3), f"after {len(known)} tokens"


def test_an_eagle3_head_drafts_for_gpt_oss(tiny_models, tmp_path, monkeypatch):
    """GPT-OSS (sinks, windows, YaRN, MoE: its layers are the Llama decoder's), as its published EAGLE-3 heads
    draft for it: every draft the plain-torch EAGLE's over transformers' hidden states."""
    from transformers import AutoModelForCausalLM

    target = tiny_models["gpt_oss"]
    tensors = _random_head("eagle3", seed=9)
    folder = _save_head(tmp_path / "head", "eagle3", tensors)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    _, seen = _spec_run(_engine(target, _spec("eagle3", folder)), _prompts()[:3], params, monkeypatch)
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    assert len(seen) >= 8
    for known, drafts in seen:
        want = _reference_drafts("eagle3", tensors, hf, known, 3)
        assert list(drafts) == want, f"after {len(known)} tokens"


def test_a_head_beside_a_target_split_over_two_ranks_drafts_as_on_one(tiny_llama, head, monkeypatch):
    """Tensor parallelism (gloo): the head runs whole on the driver, reading the driver's features of the
    split target, and collects its last drafts before the verifying step is staged (the other ranks read
    that step's drafts from its arrays): the drafts and outputs of one device."""
    method, folder, _ = head
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = _prompts()[:2] + _prompts()[-1:]
    want = _spec_run(_engine(tiny_llama, _spec(method, folder)), prompts, params, monkeypatch)
    engine = _engine(tiny_llama, _spec(method, folder), tensor_parallel_size=2)
    try:
        assert not engine.drafter.defers_last_draft
        outputs, drafts = _spec_run(engine, prompts, params, monkeypatch)
    finally:
        engine.shutdown()
    assert outputs == want[0]
    assert len(drafts) > 12 and drafts == want[1]


def test_aborts_while_drafting_leave_the_other_outputs_unchanged(tiny_llama, head):
    """Requests aborted between steps while the head drafts (the long prompt still catching up, rows whose
    last draft is in flight): the others' outputs are those without speculation, the head holds nothing."""
    method, folder, _ = head
    prompts, params = _prompts(), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = _generate(_engine(tiny_llama, None), prompts, [params] * len(prompts))
    engine = _engine(tiny_llama, _spec(method, folder))
    done = _generate_aborting(engine, prompts, params, {2: "r-1", 3: "r-4", 5: "r-3"})  # r-4: the long one
    assert engine.is_idle_and_clean() and engine.drafter.is_clean()
    assert set(done) == set(want) - {1, 3, 4}
    _assert_same(done, {i: w for i, w in want.items() if i in done})
    assert engine.spec_stats.num_draft_tokens > 0


def test_seeded_sampling_penalties_stops_prefix_cache_and_preemption_are_unchanged(tiny_llama, head):
    """Sampled, penalised and stopped requests, a shared prefix served from the cache and a KV cache small
    enough to preempt: the same outputs as the same engine without the head."""
    method, folder, _ = head
    shared = random_prompts(1, 40, 40, seed=33)[0]
    prompts = [shared + p for p in random_prompts(len(MIXED_PARAMS), 3, 20, seed=34)]
    knobs = dict(enable_prefix_caching=True, num_kv_blocks=40)
    want = _generate(_engine(tiny_llama, None, **knobs), prompts, MIXED_PARAMS)
    engine = _engine(tiny_llama, _spec(method, folder, k=2), **knobs)
    _assert_same(_generate(engine, prompts, MIXED_PARAMS), want)
    assert engine.spec_stats.num_draft_tokens > 0


def test_eagle_refusals_name_what_is_wrong(tiny_llama, tiny_models, head, tmp_path):
    method, folder, tensors = head
    with pytest.raises(ValueError, match="layers are the Llama decoder"):
        _engine(tiny_models["gemma3"], _spec(method, folder))
    wide = _head_config(method) | {"vocab_size": TINY_VOCAB * 2}
    _save_head(tmp_path / "wide", method, tensors)
    (tmp_path / "wide" / "config.json").write_text(json.dumps(wide))
    with pytest.raises(ValueError, match="vocabulary"):
        _engine(tiny_llama, _spec(method, tmp_path / "wide"))
    with pytest.raises(ValueError, match="needs \"model\""):
        _engine(tiny_llama, {"method": method, "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="three of the target's 2 layers"):
        aux_layer_ids({}, 2)  # vLLM's default (2, L // 2, L - 3) needs more layers
    assert aux_layer_ids({}, 32) == (2, 16, 29)


# -- on the GPU (pytest -m gpu) -----------------------------------------------------------------------------


def _gpu_folders(tmp_path: Path, method: str) -> tuple[str, str]:
    """A four-layer Llama of head dim 64 and an EAGLE head for it: config.json only (random weights)."""
    target = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
              "intermediate_size": 2816, "num_hidden_layers": 4, "num_attention_heads": 16,
              "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 8192, "max_position_embeddings": 2048,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu"}
    head = target | {"num_hidden_layers": 1, "architectures": ["LlamaForCausalLM"]}
    if method == "eagle3":
        head |= {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 2048}
    for name, cfg in (("target", target), ("head", head)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path / "target"), str(tmp_path / "head")


def _recorded_drafts(engine, prompts: list[list[int]], monkeypatch) -> dict[tuple[int, ...], tuple[int, ...]]:
    """known tokens -> the drafts proposed after them, over the engine's greedy run of ``prompts``."""
    seen = {}
    with monkeypatch.context() as patch:
        _record_drafts(patch, lambda known, drafts: seen.__setitem__(tuple(known), drafts))
        greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        _generate(engine, prompts, [greedy] * len(prompts))
    return seen


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_on_the_gpu_path_drafts_as_torch_ref_in_fp32(tmp_path, method, monkeypatch):
    """Triton attention and CUDA graphs (the head's runner replays its own) draft what the eager torch_ref
    path drafts, fp32 on the GPU; bf16 runs clean beside them."""
    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine

    target, head = _gpu_folders(tmp_path, method)
    prompts = random_prompts(12, 3, 300, seed=35)

    def engine(dtype: str, **knobs):
        config = dict(model=target, load_format="dummy", seed=7, max_model_len=1024, num_kv_blocks=512,
                      max_num_seqs=16, max_num_batched_tokens=256, enable_prefix_caching=False, dtype=dtype,
                      speculative_config=_spec(method, head))
        made = LLMEngine(EngineConfig(**{**config, **knobs}))
        with torch.no_grad():  # decisive logits: the token's own embedding dominates (test_gpu_engine)
            made.runner.model.model.embed_tokens.weight.mul_(100.0)
        return made

    ref = _recorded_drafts(engine("float32", attention_backend="torch_ref", enforce_eager=True), prompts,
                           monkeypatch)
    fast = engine("float32", attention_backend="triton")
    got = _recorded_drafts(fast, prompts, monkeypatch)
    common = set(ref) & set(got)
    assert len(common) >= 0.8 * len(ref) > 20
    assert sum(ref[k] == got[k] for k in common) >= 0.95 * len(common)
    head_steps = fast.drafter.runner.breakdown
    assert head_steps.graph_single_token_steps > 0 and fast.drafter.is_clean()
    bf16 = engine("bfloat16")
    assert len(_recorded_drafts(bf16, prompts, monkeypatch)) > 20 and bf16.drafter.is_clean()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_heads_kv_copied_back_drafts_as_never_evicted(tmp_path, monkeypatch):
    """KV offloading beside an EAGLE head on the GPU (bf16, graphs, copies between pinned host memory and the
    device on the step's stream): prompts whose blocks, the target's and the head's, went to host memory and
    came back draft and answer exactly as on an engine whose cache never evicted them (the same cached
    prefix, so the same step shapes). The CPU test compares with a plain-torch EAGLE in fp32, which a GPU's
    other summation orders fork from at the tiny random head's near-ties."""
    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine

    target, head = _gpu_folders(tmp_path, "eagle")
    first, others = random_prompts(8, 200, 300, seed=43), random_prompts(8, 200, 300, seed=44)
    runs = {}
    for name, num_blocks, offloading in (("offloading", 200, 0.5), ("roomy", 4096, None)):
        engine = LLMEngine(EngineConfig(model=target, load_format="dummy", seed=7, dtype="bfloat16",
                                        block_size=16, max_model_len=1024, max_num_seqs=8,
                                        num_kv_blocks=num_blocks, kv_offloading_size=offloading,
                                        enable_prefix_caching=True, speculative_config=_spec("eagle", head)))
        with torch.no_grad():  # decisive logits: the token's own embedding dominates (test_gpu_engine)
            engine.runner.model.model.embed_tokens.weight.mul_(100.0)
        for prompts in (first, others):
            _recorded_drafts(engine, prompts, monkeypatch)
        runs[name] = _recorded_drafts(engine, first, monkeypatch)
        stats = engine.kv_cache.stats
        print(f"\n{name}: {len(runs[name])} drafts recorded; host hits {stats.host_hits}")
        assert (stats.host_hits > 0) == (name == "offloading"), stats
        engine.shutdown()
    assert len(runs["roomy"]) > 20 and runs["offloading"] == runs["roomy"]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_eagle3_beside_a_target_split_over_two_gpus(tmp_path, monkeypatch):
    """The head on the driver's GPU beside a target split over two (NCCL, graphs), fp32: one GPU's drafts."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from plait.config import EngineConfig
    from plait.engine.engine import LLMEngine

    target, head = _gpu_folders(tmp_path, "eagle3")
    # The target's weights saved (a split engine's random draws are its ranks' own); the head's drawn.
    torch.manual_seed(0)
    config = json.loads((Path(target) / "config.json").read_text())
    AutoModelForCausalLM.from_config(LlamaConfig(**config)).save_pretrained(target)
    dims = dict(hidden=1024, heads=16, kv_heads=4, head_dim=64, inter=2816, vocab=8192, draft_vocab=2048)
    save_file(_random_head("eagle3", 8, dims), str(Path(head) / "model.safetensors"))
    prompts = random_prompts(8, 3, 300, seed=36)

    def engine(**knobs):
        return LLMEngine(EngineConfig(model=target, load_format="auto", seed=7, max_model_len=1024,
                                      num_kv_blocks=512, max_num_seqs=16, max_num_batched_tokens=256,
                                      enable_prefix_caching=False, dtype="float32",
                                      speculative_config=_spec("eagle3", head), **knobs))

    one = _recorded_drafts(engine(), prompts, monkeypatch)
    split = engine(tensor_parallel_size=2)
    try:
        two = _recorded_drafts(split, prompts, monkeypatch)
    finally:
        split.shutdown()
    common = set(one) & set(two)
    assert len(common) >= 0.8 * len(one) > 20
    assert sum(one[k] == two[k] for k in common) >= 0.95 * len(common)
