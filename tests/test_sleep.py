"""Sleep mode, as vLLM's (an RL loop trains on the GPU between rollouts): LLM.sleep frees the storage of the
weights and the KV cache, wake_up takes it back. Level 1 parks the weights and gives the same answers after;
level 2 drops them, and load_weights between wake_up(tags=["weights"]) and wake_up(tags=["kv_cache"]) serves
new ones. The KV cache's contents, and so the prefix cache, are forgotten; requests wait while asleep; the
server answers 503 meanwhile and has vLLM's /sleep, /wake_up and /is_sleeping."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts, run_greedy

from plait import LLM, SamplingParams
from plait.config import EngineConfig
from plait.engine.engine import LLMEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# num_kv_blocks: no sizing from free memory, so that the engines of one test share a GPU too.
KNOBS = dict(block_size=8, max_model_len=128, num_kv_blocks=128, enable_sleep_mode=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(4, 30, 60, seed=23)


def _answers(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _storage_elements(llm: LLM) -> tuple[int, int]:
    """Elements that the model's parameters and the KV cache hold in storage now."""
    runner = llm.engine.runner
    return (sum(p.numel() for p in runner.model.parameters()), sum(t.numel() for t in runner.kv_caches))


def test_level_1_frees_the_storage_and_wakes_to_the_same_answers(tiny_llama, prompts):
    llm = LLM(str(tiny_llama), **KNOBS)
    before = _answers(llm, prompts)
    full = _storage_elements(llm)
    assert llm.engine.kv_cache.num_cached_blocks > 0
    llm.sleep()
    assert llm.is_sleeping() and _storage_elements(llm) == (0, 0)
    with pytest.raises(ValueError, match="asleep"):
        llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False)
    llm.wake_up()
    assert not llm.is_sleeping() and _storage_elements(llm) == full
    # The cache's blocks hold zeros now: a prefix served from it would change the answers.
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0] * len(prompts)
    assert [o.outputs[0].token_ids for o in outs] == before
    # And again, now that the wake-up's tensors are the ones put to sleep.
    llm.sleep(1)
    llm.wake_up()
    assert _answers(llm, prompts) == before


def test_level_2_drops_the_weights_for_load_weights_to_replace(tiny_llama, prompts, other_llama):
    """The RL loop's order: wake the weights alone, load the trained ones, then wake the KV cache. The
    rotary tables, which no checkpoint holds, survive level 2 (B's answers need them)."""
    folder_b, weights_b = other_llama
    want = _answers(LLM(str(folder_b), block_size=8, max_model_len=128, num_kv_blocks=128), prompts)
    llm = LLM(str(tiny_llama), **KNOBS)
    assert _answers(llm, prompts) != want
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    assert llm.is_sleeping()  # the KV cache is still asleep
    assert _storage_elements(llm)[0] > 0 and _storage_elements(llm)[1] == 0
    with pytest.raises(ValueError, match="discarded by sleep"):
        llm.engine.add_request(prompts[0], GREEDY)
    llm.load_weights(weights_b.items())
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    assert _answers(llm, prompts) == want


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "olmo3"])
def test_each_layer_kinds_rotary_table_is_parked_too(tiny_models, prompts, family):
    """Models with a rotary per layer kind (sliding, global) hold them as submodules, so level 1 parks their
    tables with the weights (they once stayed on the device, out of the walk's sight) and wakes to the same
    answers."""
    from plait.layers.rotary import RotaryEmbedding

    llm = LLM(str(tiny_models[family]), **KNOBS)
    before = _answers(llm, prompts)
    tables = [m.cos_sin for m in llm.engine.runner.model.modules() if isinstance(m, RotaryEmbedding)]
    assert len(tables) >= 2
    llm.sleep(1)
    assert all(t.untyped_storage().size() == 0 for t in tables)
    llm.wake_up()
    assert _answers(llm, prompts) == before


def test_a_deeper_sleep_drops_what_a_lighter_one_parked(tiny_llama, prompts):
    llm = LLM(str(tiny_llama), **KNOBS)
    llm.sleep(1)
    llm.sleep(2)
    llm.wake_up()
    with pytest.raises(ValueError, match=r"discarded by sleep\(level=2\): load_weights"):
        llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False)
    assert all(not p.any() for p in llm.engine.runner.model.parameters())


def test_requests_added_while_asleep_wait_for_wake_up(tiny_llama, prompts):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), **KNOBS))
    alone = run_greedy(engine, [prompts[1]], GREEDY.max_tokens)[0][0]
    engine.sleep()
    engine.add_request(prompts[1], GREEDY, request_id="late")
    assert [engine.step() for _ in range(3)] == [[], [], []]
    engine.wake_up()
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert outputs[0].outputs[0].token_ids == alone
    assert engine.is_idle_and_clean()


def test_sleep_refusals(tiny_llama, prompts):
    with pytest.raises(ValueError, match="sleep mode is not enabled"):
        LLM(str(tiny_llama), block_size=8, max_model_len=128, num_kv_blocks=128).sleep()
    llm = LLM(str(tiny_llama), **KNOBS)
    for level in (0, 3, True, "1"):
        with pytest.raises(ValueError, match="sleep level must be one of"):
            llm.sleep(level)
    for tags in ("weights", ["weights", "kv"]):
        with pytest.raises(ValueError, match="wake_up tags"):
            llm.wake_up(tags)
    llm.engine.add_request(prompts[0], GREEDY)
    with pytest.raises(ValueError, match="needs an idle engine"):
        llm.sleep()
    assert not llm.is_sleeping()
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    llm.wake_up()  # awake already: nothing to do
    pooling = LLM(str(tiny_llama), runner="pooling", **KNOBS)
    with pytest.raises(ValueError, match="level 2 drops the weights.*pooling model"):
        pooling.sleep(2)
    pooling.sleep(1)
    pooling.wake_up()
    assert len(pooling.embed([{"prompt_token_ids": prompts[0]}], use_tqdm=False)[0].outputs.embedding) == 64


def test_every_tensor_parallel_rank_sleeps_and_wakes(tiny_llama, prompts, other_llama):
    """Two ranks: each hands back its slice's storage and takes it back on wake_up (the workers run the
    driver's sleep and wake-up), and the split engine answers as before; after level 2, load_weights sends
    each rank its slices of the new weights, and it answers as a split engine of those."""
    folder_b, weights_b = other_llama
    split_b = LLMEngine(EngineConfig(model=str(folder_b), tensor_parallel_size=2, **KNOBS))
    try:
        want_b = run_greedy(split_b, prompts, GREEDY.max_tokens)[0]
    finally:
        split_b.shutdown()
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), tensor_parallel_size=2, **KNOBS))
    try:
        before = run_greedy(engine, prompts, GREEDY.max_tokens)[0]
        assert before != want_b
        engine.sleep(1)
        assert engine.is_sleeping
        assert sum(p.numel() for p in engine.runner.model.parameters()) == 0
        engine.wake_up(["weights"])
        engine.wake_up(["kv_cache"])
        assert not engine.is_sleeping
        assert run_greedy(engine, prompts, GREEDY.max_tokens)[0] == before
        engine.sleep(1)  # and again, from the woken tensors
        engine.wake_up()
        assert run_greedy(engine, prompts, GREEDY.max_tokens)[0] == before
        engine.sleep(2)
        engine.wake_up(["weights"])
        engine.load_weights(weights_b.items())
        engine.wake_up(["kv_cache"])
        assert run_greedy(engine, prompts, GREEDY.max_tokens)[0] == want_b
    finally:
        engine.shutdown()


def sleep_state(url: str) -> str:
    """The sleep_state that vllm:engine_sleep_state marks 1 in the server's /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics").text
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "vllm:engine_sleep_state"]
    (state,) = [s.labels["sleep_state"] for s in family.samples if s.value == 1]
    return state


def test_server_sleeps_and_wakes_as_vllm(tiny_llama, prompts, other_llama, monkeypatch):
    """VLLM_SERVER_DEV_MODE=1 with --enable-sleep-mode: POST /sleep, GET /is_sleeping, POST /wake_up (tags one
    at a time); while asleep the openai client's completion is a 503 saying so and /v1/models still answers;
    awake again, the same answer. After level 2 a completion is a 400 until POST /reload_weights brings a
    checkpoint in (B's folder: B's answer; none given: the served model's own again)."""
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    from plait.entrypoints.server import BackgroundServer, OpenAIServer, ServerConfig

    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), **KNOBS))
    with BackgroundServer(OpenAIServer(engine, ServerConfig(log_level="warning"))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)

        def ask() -> str:
            return client.completions.create(model=engine.model_name, prompt=prompts[0], max_tokens=6,
                                             temperature=0.0).choices[0].text

        answer = ask()
        assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": False}
        assert sleep_state(url) == "awake"
        assert httpx.post(f"{url}/sleep", params={"level": 1}).status_code == 200
        assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": True}
        assert sleep_state(url) == "weights_offloaded"  # vllm:engine_sleep_state
        with pytest.raises(openai.APIStatusError, match="sleeping") as err:
            ask()
        assert err.value.status_code == 503 and err.value.body["type"] == "service_unavailable"
        assert [m.id for m in client.models.list().data] == [engine.model_name]
        assert httpx.post(f"{url}/wake_up", params={"tags": "bogus"}).status_code == 400
        assert httpx.post(f"{url}/wake_up", params={"tags": "weights"}).status_code == 200
        assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": True}
        assert httpx.post(f"{url}/wake_up", params={"tags": "kv_cache"}).status_code == 200
        assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": False}
        assert ask() == answer

        folder_b, _ = other_llama
        want_b = run_greedy(LLMEngine(EngineConfig(model=str(folder_b), **KNOBS)), [prompts[0]], 6)[0][0]
        assert httpx.post(f"{url}/sleep", params={"level": 2}).status_code == 200
        assert sleep_state(url) == "discard_all"
        assert httpx.post(f"{url}/wake_up", params={"tags": "weights"}).status_code == 200
        assert httpx.post(f"{url}/wake_up", params={"tags": "kv_cache"}).status_code == 200
        with pytest.raises(openai.BadRequestError, match="reload_weights"):
            ask()
        missing = httpx.post(f"{url}/reload_weights", json={"path": str(folder_b / "nowhere")})
        assert missing.status_code == 400 and "nowhere" in missing.json()["error"]["message"]
        assert httpx.post(f"{url}/reload_weights", json={"path": str(folder_b)}).status_code == 200
        reply = client.completions.create(model=engine.model_name, prompt=prompts[0], max_tokens=6,
                                          temperature=0.0, logprobs=0,
                                          extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        assert [int(t.split(":")[1]) for t in reply.choices[0].logprobs.tokens] == want_b
        assert httpx.post(f"{url}/reload_weights").status_code == 200  # the served model's own
        assert ask() == answer
        assert sleep_state(url) == "awake"
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE")
    with BackgroundServer(OpenAIServer(engine, ServerConfig(log_level="warning"))) as url:
        assert httpx.post(f"{url}/sleep").status_code == 404  # development endpoints only in dev mode


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sleep_hands_the_gpu_memory_back_and_recaptures_graphs(tmp_path):
    """On a GPU, bf16 with CUDA graphs: level 1 hands the weights' and the KV cache's memory back to the
    driver and wakes to the same greedy tokens, replaying graphs captured again; level 2 then load_weights
    (the norms folded into gate/up again) gives them too."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                      num_key_value_heads=4, vocab_size=8192, max_position_embeddings=1024,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    checkpoint = load_file(str(tmp_path / "model.safetensors"))
    # A sized cache, not a share of free memory: an engine of an earlier test in this process may still hold
    # GPU memory (an H200 run with test_gpt_oss and test_warmup before this file left under 30% free).
    llm = LLM(str(tmp_path), dtype="bfloat16", max_model_len=1024, num_kv_blocks=1024, enable_sleep_mode=True)
    gpu_prompts = random_prompts(16, 20, 300, seed=3)
    before = _answers(llm, gpu_prompts)
    torch.cuda.synchronize()
    free_awake = torch.cuda.mem_get_info()[0]
    weights = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
    kv = sum(t.numel() * t.element_size() for t in llm.engine.runner.kv_caches)
    llm.sleep(1)
    freed = torch.cuda.mem_get_info()[0] - free_awake
    assert freed >= 0.95 * (weights + kv), f"freed {freed / 2**30:.2f} GiB of {(weights + kv) / 2**30:.2f}"
    llm.wake_up()
    assert llm.engine.runner.graphs is not None
    replays = llm.engine.runner.breakdown.graph_steps
    assert _answers(llm, gpu_prompts) == before
    assert llm.engine.runner.breakdown.graph_steps > replays
    llm.sleep(2)
    llm.wake_up(tags=["weights"])
    llm.load_weights(checkpoint.items())
    llm.wake_up(tags=["kv_cache"])
    assert _answers(llm, gpu_prompts) == before
