"""AsyncLLMEngine: the step loop in its own thread survives failing steps, bad input and aborts."""

from __future__ import annotations

import asyncio

import pytest
from conftest import break_next_step

from plait.config import EngineConfig
from plait.engine.engine import LLMEngine
from plait.entrypoints.async_engine import (
    AsyncLLMEngine,
    RequestFailedError,
    RequestStream,
    RequestTimeoutError,
)
from plait.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from plait.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(EngineConfig(model=str(tiny_llama), max_model_len=64, block_size=8))


def _run(engine: LLMEngine, scenario) -> None:
    async def main() -> None:
        aengine = AsyncLLMEngine(engine)
        aengine.start()
        try:
            await asyncio.wait_for(scenario(aengine), TIMEOUT_S)
            for _ in range(100):  # aborts land at the loop's next gap
                if await aengine.call(lambda e: e.is_idle_and_clean()):
                    break
                await asyncio.sleep(0.01)
            assert await aengine.call(lambda e: e.is_idle_and_clean())
        finally:
            await aengine.shutdown()

    asyncio.run(main())


async def _collect(stream) -> list[list[int]]:
    outs: dict[int, list[int]] = {}
    async with stream:
        async for index, out in stream:
            if out.finished:
                outs[index] = out.outputs[0].token_ids
    return [outs[i] for i in sorted(outs)]


def test_streams_match_the_offline_engine(engine, tiny_llama):
    offline = LLMEngine(EngineConfig(model=str(tiny_llama), max_model_len=64, block_size=8))
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [20] * 9]
    expected = []
    for p in prompts:
        offline.add_request(p, GREEDY)
        while offline.has_unfinished_requests():
            for out in offline.step():
                if out.finished:
                    expected.append(out.outputs[0].token_ids)

    async def scenario(aengine: AsyncLLMEngine) -> None:
        streams = [await aengine.add([(p, GREEDY)]) for p in prompts]
        results = await asyncio.gather(*(_collect(s) for s in streams))
        assert [r[0] for r in results] == expected
        assert [s.prompt_token_ids[0] for s in streams] == prompts

    _run(engine, scenario)


def test_bad_input_is_raised_before_anything_is_queued(engine):
    async def scenario(aengine: AsyncLLMEngine) -> None:
        with pytest.raises(ValueError, match="empty"):
            await aengine.add([([5, 6], GREEDY), ([], GREEDY)])  # one bad child: none is queued
        assert await aengine.call(lambda e: not e.has_unfinished_requests())

        def refuse(request, engine):
            raise ValueError("refused by the validator")

        with pytest.raises(ValueError, match="refused"):
            await aengine.add([([5, 6], GREEDY)], validate=refuse)
        assert (await _collect(await aengine.add([([5, 6], GREEDY)])))[0]  # still serving

    _run(engine, scenario)


def test_a_failing_step_fails_its_requests_but_not_the_loop(engine):
    async def scenario(aengine: AsyncLLMEngine) -> None:
        streams = [await aengine.add([([5, 6, 7], LONG)]), await aengine.add([([8, 9], LONG)])]
        await streams[0].__anext__()  # both are running

        await aengine.call(break_next_step)
        for stream in streams:
            with pytest.raises(RequestFailedError, match="injected failure"):
                async for _ in stream:
                    pass
        assert aengine.is_alive
        assert await aengine.call(lambda e: e.is_idle_and_clean())
        assert len((await _collect(await aengine.add([([5, 6, 7], GREEDY)])))[0]) == GREEDY.max_tokens

    _run(engine, scenario)


def test_leaving_a_stream_aborts_it(engine):
    async def scenario(aengine: AsyncLLMEngine) -> None:
        stream = await aengine.add([([5, 6, 7], LONG), ([8, 9], LONG)])  # n = 2, say
        async with stream:
            await stream.__anext__()
        assert sorted(stream.aborted) == [0, 1]

        # A caller cancelled while its add is still queued leaves nothing behind either.
        task = asyncio.ensure_future(aengine.add([([5, 6, 7], LONG)]))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    _run(engine, scenario)


def test_a_request_past_its_deadline_is_aborted(engine):
    async def scenario(aengine: AsyncLLMEngine) -> None:
        stream = await aengine.add([([5, 6, 7], LONG)], timeout_s=1e-6)
        with pytest.raises(RequestTimeoutError):
            async for _ in stream:
                pass
        assert stream.aborted == [0]

    _run(engine, scenario)


def _output(rid: str, token_ids: list[int], delta: list[int], now: float, finished: bool = False):
    text = "".join(chr(ord("a") + t) for t in token_ids)
    delta_text = "".join(chr(ord("a") + t) for t in delta)
    logprobs = [TokenLogprobs(t, -0.5) for t in token_ids]
    reason = "length" if finished else None
    completion = CompletionOutput(0, text, token_ids, reason, None, logprobs, delta_text, delta)
    return RequestOutput(rid, "prompt", [1, 2], [completion], finished, metrics={"now": now})


def test_a_lagging_reader_gets_its_backlog_merged():
    """Outputs a server's reader has not read yet merge into one per child: cumulative ones (a) keep the
    newest whole and join the deltas, DELTA ones (b) join text, ids and logprobs; every step's time is kept.
    A stream that did not ask gets one output per step."""

    async def read_all(stream) -> list[tuple[int, RequestOutput]]:
        return [item async for item in stream]

    async def main() -> None:
        stream = RequestStream(None, ["a", "b"], None)
        stream.merge_backlog = True
        stream._put(_output("a", [0], [0], 1.0))
        stream._put(_output("b", [3], [3], 1.0))
        stream._put(_output("a", [0, 1], [1], 2.0))
        stream._put(_output("b", [5], [5], 2.0))
        stream._put(_output("a", [0, 1, 2], [2], 3.0, finished=True))
        stream._put(_output("b", [4], [4], 3.0, finished=True))
        got = await read_all(stream)
        assert [(i, o.outputs[0].delta_token_ids) for i, o in got] == [(0, [0, 1, 2]), (1, [3, 5, 4])]
        a, b = got[0][1].outputs[0], got[1][1].outputs[0]
        assert got[0][1].finished and a.token_ids == [0, 1, 2] and a.delta_text == "abc"
        assert a.finish_reason == "length" and [lp.token_id for lp in a.logprobs] == [0, 1, 2]
        assert b.token_ids == [3, 5, 4] and b.text == b.delta_text == "dfe"
        assert [lp.token_id for lp in b.logprobs] == [3, 5, 4]
        assert got[0][1].metrics["output_times"] == [1.0, 2.0, 3.0] and got[0][1].metrics["now"] == 3.0

        plain = RequestStream(None, ["a"], None)  # a stream that did not ask: one output per step
        for k in range(3):
            plain._put(_output("a", list(range(k + 1)), [k], float(k), finished=k == 2))
        assert [o.outputs[0].delta_token_ids for _, o in await read_all(plain)] == [[0], [1], [2]]

    asyncio.run(main())


def test_a_crashed_loop_fails_its_streams_and_tells_on_dead(tiny_llama):
    """A bug in the loop itself (not a step) ends it: its streams fail with EngineDeadError, and on_dead
    hears why, once (a server stops on it, as vLLM's does)."""
    from plait.entrypoints.async_engine import EngineDeadError

    engine = LLMEngine(EngineConfig(model=str(tiny_llama), max_model_len=64, block_size=8))
    told: list[str] = []

    def crash(e: LLMEngine) -> None:
        e.has_unfinished_requests = lambda: 1 / 0  # what the loop asks before every step

    async def main() -> None:
        aengine = AsyncLLMEngine(engine)
        aengine.on_dead = told.append
        aengine.start()
        try:
            stream = await aengine.add([([5, 6, 7], LONG)])
            await aengine.call(crash)
            with pytest.raises(EngineDeadError, match="ZeroDivisionError"):
                async for _ in stream:
                    pass
            assert not aengine.is_alive
            with pytest.raises(EngineDeadError):
                await aengine.add([([5, 6], GREEDY)])
        finally:
            await aengine.shutdown()

    asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
    assert len(told) == 1 and "ZeroDivisionError" in told[0]
