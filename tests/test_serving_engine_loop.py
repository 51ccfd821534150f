"""The server's engine loop, in process over the fake model: concurrent handlers
get exactly their own tokens, the step runs off the event loop, aborts free
blocks, and a failing step fails every waiting handler instead of hanging it."""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path

import pytest

from kvforge.core import RequestError
from kvforge.engine.sampling_params import SamplingParams

pytest.importorskip("fastapi")
from kvforge.serving.engine_loop import EngineDeadError, EngineLoop  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # the test-local fake model sits beside this file
from engine_fakes import FakeCausalLM, fake_engine, reference_greedy  # noqa: E402

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 12, 13, 14, 15, 16, 17], [20, 21]]


async def collect(loop: EngineLoop, request_id: str, prompt: list[int], max_tokens: int) -> list[int]:
    queue: asyncio.Queue = asyncio.Queue()
    await loop.submit(request_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens), queue)
    tokens = []
    async for output in loop.outputs(queue, [request_id]):
        tokens = output.token_ids
    return tokens


def run(coro_factory, engine):
    async def main():
        loop = EngineLoop(engine)
        loop.start()
        try:
            return await coro_factory(loop)
        finally:
            await loop.stop()

    return asyncio.run(main())


def test_concurrent_handlers_each_get_their_own_greedy_tokens():
    model = FakeCausalLM()
    engine = fake_engine(model)
    results = run(lambda loop: asyncio.gather(*(collect(loop, f"r{i}", p, 6) for i, p in enumerate(PROMPTS))), engine)
    assert results == [reference_greedy(model, p, 6) for p in PROMPTS]
    assert engine.kv.usage().in_use == 0


def test_the_step_runs_off_the_event_loop_so_handlers_stay_responsive():
    engine = fake_engine(FakeCausalLM())
    step = engine.step
    released = threading.Event()
    seen_while_stepping = []

    def blocking_step(*args, **kwargs):
        # Released only by a coroutine on the event loop: if the step ran on that
        # loop, nothing could release it and the wait would time out.
        seen_while_stepping.append(released.wait(timeout=30))
        return step(*args, **kwargs)

    engine.step = blocking_step

    async def scenario(loop):
        task = asyncio.ensure_future(collect(loop, "r", PROMPTS[0], 2))
        while not engine.has_unfinished_requests():
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)  # the handler side keeps running while the step waits
        released.set()
        return await task

    assert run(scenario, engine) == reference_greedy(engine.model, PROMPTS[0], 2)
    assert seen_while_stepping and all(seen_while_stepping)


def test_a_handler_that_stops_reading_aborts_its_request_and_frees_its_blocks():
    engine = fake_engine(FakeCausalLM())

    async def scenario(loop):
        queue: asyncio.Queue = asyncio.Queue()
        await loop.submit("long", PROMPTS[2], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True), queue)
        outputs = loop.outputs(queue, ["long"])
        first = await outputs.__anext__()
        await outputs.aclose()  # what a disconnected client's cancelled handler does
        while engine.has_unfinished_requests():
            await asyncio.sleep(0.001)
        return first

    first = run(scenario, engine)
    assert not first.finished
    assert engine.kv.usage().in_use == 0 and engine.stats.num_aborted == 1


def test_an_invalid_request_is_refused_to_its_handler_only():
    engine = fake_engine(FakeCausalLM(vocab_size=48))

    async def scenario(loop):
        good = asyncio.ensure_future(collect(loop, "good", PROMPTS[0], 4))
        with pytest.raises(RequestError, match="outside the vocabulary"):
            await collect(loop, "bad", [1, 99], 4)
        return await good

    assert run(scenario, engine) == reference_greedy(engine.model, PROMPTS[0], 4)


def test_a_failing_step_fails_every_waiting_handler_and_later_submits():
    engine = fake_engine(FakeCausalLM())

    def broken_step(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    engine.step = broken_step

    async def scenario(loop):
        with pytest.raises(EngineDeadError, match="kernel exploded"):
            await collect(loop, "r", PROMPTS[0], 4)
        assert not loop.alive
        with pytest.raises(EngineDeadError):
            await collect(loop, "later", PROMPTS[1], 4)

    run(scenario, engine)


def test_an_add_that_fails_unexpectedly_fails_its_handler_only_and_the_loop_goes_on():
    engine = fake_engine(FakeCausalLM())
    add_request = engine.add_request

    def add_or_fail(request_id, *args, **kwargs):
        if request_id == "bad":
            raise ValueError("Overflow when unpacking long long")  # what torch says of a seed past 64 bits
        return add_request(request_id, *args, **kwargs)

    engine.add_request = add_or_fail

    async def scenario(loop):
        with pytest.raises(ValueError, match="Overflow"):  # bounded: a dead loop would leave it waiting forever
            await asyncio.wait_for(collect(loop, "bad", PROMPTS[1], 4), timeout=60)
        assert loop.alive and loop.health() == (200, {"status": "ok"})
        return await collect(loop, "good", PROMPTS[0], 4)

    assert run(scenario, engine) == reference_greedy(engine.model, PROMPTS[0], 4)
