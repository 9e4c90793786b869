"""The priority scheduling policy (vLLM's --scheduling-policy priority) end to end: the engine serves lower
values first and preempts lower priorities for higher ones' KV blocks, without changing any answer; the
LLM and the server take vLLM's ``priority`` arguments, and refuse them under other policies."""

from __future__ import annotations

import asyncio

import pytest
from conftest import random_prompts, run_greedy

from plait.config import EngineConfig
from plait.engine.engine import LLMEngine
from plait.sampling_params import SamplingParams

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _engine(folder, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 128)  # not sized from free memory: the engines of a test share a GPU too
    return LLMEngine(EngineConfig(model=str(folder), block_size=8, max_model_len=128, **kw))


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(6, 20, 60, seed=41)


@pytest.fixture(scope="module")
def alone(tiny_llama, prompts) -> dict[int, list[int]]:
    """Each prompt's greedy answer with the engine to itself: what no schedule may change."""
    engine = _engine(tiny_llama, max_num_batched_tokens=256)
    return {i: run_greedy(engine, [p], MAX_TOKENS)[0][0] for i, p in enumerate(prompts)}


def test_priority_order_and_preemption_keep_every_answer(tiny_llama, prompts, alone):
    """Six requests at once into a pool with room for about two: they start in (priority, arrival) order.
    Then an urgent one arrives while the pool is full: it preempts the lowest priority and starts at once,
    and every answer, the preempted ones' too, is the one it gets alone."""
    engine = _engine(tiny_llama, scheduling_policy="priority", max_num_batched_tokens=64, num_kv_blocks=17)
    priorities = [3, 1, 2, 1, 0, 3]
    for i in range(5):
        engine.add_request(prompts[i], GREEDY, request_id=f"r-{i}", priority=priorities[i])
    started: list[int] = []
    outputs: dict[int, list[int]] = {}
    preemptions: dict[int, int] = {}
    urgent_at = None
    step = 0
    while engine.has_unfinished_requests() or urgent_at is None:
        if step == 6:
            assert engine.scheduler.kv_cache.num_free_blocks < 8, "the pool should be full when it comes"
            engine.add_request(prompts[5], GREEDY, request_id="r-5", priority=-1)
            urgent_at = step
        for out in engine.step():
            i = int(out.request_id.split("-")[1])
            if len(out.outputs[0].token_ids) and i not in started:
                started.append(i)
            if out.finished:
                outputs[i] = out.outputs[0].token_ids
                preemptions[i] = out.metrics["num_preemptions"]
        if urgent_at is not None and 5 not in started:
            assert step <= urgent_at + 2, "the urgent request waited behind lower priorities"
        step += 1
    first_five = [i for i in started if i != 5]
    assert first_five == [4, 1, 3, 2, 0], f"first tokens in order {started}"
    assert preemptions[5] == 0 and any(preemptions[i] for i in (0, 2, 3)), preemptions
    assert outputs == alone, "an answer depended on its priority or on a preemption"
    assert engine.is_idle_and_clean()


def test_equal_priorities_are_first_come_first_served(tiny_llama, prompts, alone):
    """Under priority, requests of one priority keep arrival order, and the answers are unchanged."""
    engine = _engine(tiny_llama, scheduling_policy="priority", max_num_batched_tokens=32, max_num_seqs=1)
    for i, p in enumerate(prompts):
        engine.add_request(p, GREEDY, request_id=f"r-{i}", priority=7)
    order, outputs = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                i = int(out.request_id.split("-")[1])
                order.append(i)
                outputs[i] = out.outputs[0].token_ids
    assert order == list(range(len(prompts))) and outputs == alone


def test_priority_is_refused_unless_the_policy_serves_it(tiny_llama, prompts):
    engine = _engine(tiny_llama)
    with pytest.raises(ValueError, match="priority must be 0 .*scheduling_policy='priority'"):
        engine.add_request(prompts[0], GREEDY, priority=2)
    engine.add_request(prompts[0], GREEDY, priority=0)  # the default is always fine
    with pytest.raises(TypeError, match="priority must be an integer"):
        _engine(tiny_llama, scheduling_policy="priority").add_request(prompts[0], GREEDY, priority=1.5)
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        EngineConfig(scheduling_policy="lifo")


def test_llm_generate_takes_a_priority_per_prompt(tiny_llama, prompts, alone):
    from plait.entrypoints.llm import LLM

    llm = LLM(str(tiny_llama), scheduling_policy="priority", block_size=8, max_model_len=128,
              max_num_seqs=1, max_num_batched_tokens=64, num_kv_blocks=128)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                        priority=[5, 4, 3, 2, 1, 0])
    assert [o.outputs[0].token_ids for o in outs] == [alone[i] for i in range(len(prompts))]  # prompt order
    finished = sorted(range(len(prompts)), key=lambda i: outs[i].metrics["now"])
    assert finished == [5, 4, 3, 2, 1, 0], "one sequence at a time: the lowest value must finish first"
    with pytest.raises(ValueError, match="got 2 priorities for 6 prompts"):
        llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, priority=[0, 1])
    plain = LLM(str(tiny_llama), block_size=8, max_model_len=128, num_kv_blocks=128)
    with pytest.raises(ValueError, match="priority must be 0"):
        plain.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False, priority=[1])


def test_server_takes_priority_as_vllm(tiny_llama, prompts, alone):
    """The openai client's extra_body priority: served under --scheduling-policy priority (the same greedy
    answers, urgent or not, on completions and chat), a 400 naming the field under the default policy."""
    openai = pytest.importorskip("openai")
    from plait.entrypoints.server import BackgroundServer, OpenAIServer, ServerConfig

    engine = _engine(tiny_llama, scheduling_policy="priority", max_num_batched_tokens=64)
    with BackgroundServer(OpenAIServer(engine, ServerConfig(log_level="warning"))) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)

        async def ask(i: int, priority: int) -> list[int]:
            reply = await client.completions.create(
                model=engine.model_name, prompt=prompts[i], max_tokens=MAX_TOKENS, temperature=0.0,
                logprobs=0, extra_body={"ignore_eos": True, "priority": priority,
                                        "return_tokens_as_token_ids": True})
            return [int(t.split(":")[1]) for t in reply.choices[0].logprobs.tokens]

        async def all_at_once() -> list[list[int]]:
            return await asyncio.gather(*(ask(i, priority) for i, priority in enumerate([9, -3, 0, 2, 9, 1])))

        got = asyncio.run(all_at_once())
    assert got == [alone[i] for i in range(len(prompts))]

    with BackgroundServer(OpenAIServer(_engine(tiny_llama), ServerConfig(log_level="warning"))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="priority scheduling is not enabled") as err:
            client.completions.create(model=engine.model_name, prompt=prompts[0], max_tokens=2,
                                      extra_body={"priority": 1})
        assert err.value.body["param"] == "priority"
        reply = client.completions.create(model=engine.model_name, prompt=prompts[0], max_tokens=2,
                                          extra_body={"priority": 0})
        assert reply.usage.completion_tokens == 2
