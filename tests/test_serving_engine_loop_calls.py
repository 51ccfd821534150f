"""`EngineLoop.call`: how handlers reach the engine (loading and removing LoRA
adapters) without touching it. A call runs on the engine's own thread between
steps, never while one runs; its exception reaches its caller only, and the
requests being served go on."""

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

sys.path.insert(0, str(Path(__file__).parent))
from engine_fakes import FakeCausalLM, fake_engine, reference_greedy  # noqa: E402

PROMPT = [1, 2, 3, 4, 5]


def test_calls_run_on_the_engines_thread_between_steps_and_requests_go_on():
    model = FakeCausalLM()
    engine = fake_engine(model)
    stepping = threading.Event()
    step = engine.step
    overlaps, threads = [], []

    def tracked_step():
        stepping.set()
        try:
            return step()
        finally:
            stepping.clear()

    engine.step = tracked_step

    def probe(e):
        overlaps.append(stepping.is_set())
        threads.append(threading.current_thread().name)
        return e is engine

    async def main():
        loop = EngineLoop(engine)
        loop.start()
        try:
            queue: asyncio.Queue = asyncio.Queue()
            await loop.submit("r", PROMPT, SamplingParams(temperature=0, max_tokens=12), queue)
            results = []
            tokens = []
            async for output in loop.outputs(queue, ["r"]):
                tokens = output.token_ids
                results.append(await loop.call(probe))
            return tokens, results
        finally:
            await loop.stop()

    tokens, results = asyncio.run(main())
    assert tokens == reference_greedy(model, PROMPT, 12), "calls between steps leave the request's tokens as they are"
    assert results and all(results)
    assert not any(overlaps), "no call ran while a step did"
    assert all(name.startswith("kvforge-engine") for name in threads), threads


def test_a_calls_exception_reaches_its_caller_only():
    engine = fake_engine(FakeCausalLM())

    def refuse(_):
        raise RequestError("no such adapter")

    async def main():
        loop = EngineLoop(engine)
        loop.start()
        try:
            with pytest.raises(RequestError, match="no such adapter"):
                await loop.call(refuse)
            assert loop.alive
            return await loop.call(lambda e: "still serving")
        finally:
            await loop.stop()

    assert asyncio.run(main()) == "still serving"


def test_a_call_to_a_stopped_loop_is_refused():
    async def main():
        loop = EngineLoop(fake_engine(FakeCausalLM()))
        loop.start()
        await loop.stop()
        with pytest.raises(EngineDeadError):
            await loop.call(lambda e: None)

    asyncio.run(main())
