"""The data-parallel engine loop over fake replicas (no processes, no model):
requests reach the routed replica, outputs reach their handler, a refusal is the
handler's alone, an abort reaches the replica, and a dead replica fails only the
requests it held while the other keeps serving."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi")
from kvforge.core import RequestError  # noqa: E402
from kvforge.engine.outputs import CompletionOutput, RequestOutput, RequestTimings  # noqa: E402
from kvforge.engine.sampling_params import SamplingParams  # noqa: E402
from kvforge.serving.data_parallel_loop import DataParallelLoop  # noqa: E402
from kvforge.serving.engine_loop import EngineDeadError  # noqa: E402
from kvforge.serving.metrics import EngineSnapshot, ServerMetrics  # noqa: E402
from kvforge.serving.router import Router  # noqa: E402

IDLE = EngineSnapshot(0, 0, 0.0, 0, 0, 0, 0, 0, 0, 0, 0)


class FakeReplica:
    def __init__(self, index: int):
        self.index, self.pid, self.sent = index, 1000 + index, []

    def attach(self, loop, on_message, on_death):
        self.on_message, self.on_death = on_message, on_death

    def send(self, message):
        self.sent.append(message)

    def detach(self):
        pass


class FakePool:
    def __init__(self, size: int):
        self.replicas = [FakeReplica(i) for i in range(size)]
        self.stopped = False

    def stop(self):
        self.stopped = True


def output(request_id: str, tokens: list[int], finished: bool) -> RequestOutput:
    completion = CompletionOutput(0, "", tokens, finish_reason="length" if finished else None,
                                  new_token_ids=tokens[-1:])
    return RequestOutput(request_id, None, [1, 2, 3], [completion], finished, RequestTimings(arrival_time=0.0))


async def start_loop(size: int = 2):
    pool = FakePool(size)
    loop = DataParallelLoop(pool, Router(size), ServerMetrics("m", 64, 4, num_engines=size))
    loop.start()
    return loop, pool


async def submit(loop, pool, request_id, max_tokens=8):
    """Submit and let the routed replica accept it; returns (queue, replica)."""
    queue: asyncio.Queue = asyncio.Queue()
    task = asyncio.ensure_future(loop.submit(request_id, [1, 2, 3], SamplingParams(max_tokens=max_tokens), queue))
    await asyncio.sleep(0)
    replica = next(r for r in pool.replicas if any(m[0] == "add" and m[1].request_id == request_id for m in r.sent))
    replica.on_message(replica.index, ("applied", [request_id], [], [], IDLE))
    assert await task == replica.index  # the metrics' engine label of the request
    return queue, replica


def test_requests_spread_and_outputs_reach_their_own_handlers():
    async def scenario():
        loop, pool = await start_loop()
        qa, ra = await submit(loop, pool, "a")
        qb, rb = await submit(loop, pool, "b")
        assert (ra.index, rb.index) == (0, 1)  # the second went to the idle replica
        assert loop.router.load == [11, 11]
        rb.on_message(1, ("step", [output("b", [7], False)], IDLE))
        assert loop.router.load == [11, 7]  # prefilled, one of eight generated
        rb.on_message(1, ("step", [output("b", [7, 8], True)], IDLE))
        got = [o.token_ids async for o in loop.outputs(qb, ["b"])]
        assert got == [[7], [7, 8]] and qa.empty()
        assert loop.router.load == [11, 0]
        await loop.stop()
        assert pool.stopped

    asyncio.run(scenario())


def test_a_refusal_fails_only_its_handler():
    async def scenario():
        loop, pool = await start_loop()
        queue: asyncio.Queue = asyncio.Queue()
        task = asyncio.ensure_future(loop.submit("bad", [1], SamplingParams(max_tokens=4), queue))
        await asyncio.sleep(0)
        pool.replicas[0].on_message(0, ("applied", [], [("bad", "token 99 is outside the vocabulary")], [], IDLE))
        with pytest.raises(RequestError, match="outside the vocabulary"):
            await task
        assert loop.router.load == [0, 0] and loop.alive

    asyncio.run(scenario())


def test_an_abort_reaches_the_replica_that_holds_the_request():
    async def scenario():
        loop, pool = await start_loop()
        await submit(loop, pool, "a")
        _, replica = await submit(loop, pool, "b")
        loop.abort("b")
        assert replica.sent[-1] == ("abort", "b") and loop.router.load[replica.index] == 0
        loop.abort("b")  # twice: nothing more is sent
        assert sum(m == ("abort", "b") for m in replica.sent) == 1

    asyncio.run(scenario())


def test_a_dead_replica_fails_only_its_requests_and_the_other_keeps_serving():
    async def scenario():
        loop, pool = await start_loop()
        qa, ra = await submit(loop, pool, "a")
        qb, rb = await submit(loop, pool, "b")
        ra.on_death(ra.index, -9)
        with pytest.raises(EngineDeadError, match=r"replica 0 \(pid 1000\) was killed by signal 9"):
            async for _ in loop.outputs(qa, ["a"]):
                pass
        assert qb.empty() and loop.alive
        status, body = loop.health()
        assert status == 200 and body["status"] == "degraded"
        assert [r["alive"] for r in body["replicas"]] == [False, True] and "signal 9" in body["replicas"][0]["error"]
        _, rc = await submit(loop, pool, "c")
        assert rc.index == 1  # never the dead one again
        rb.on_death(rb.index, 1)
        assert loop.health()[0] == 503 and not loop.alive
        with pytest.raises(EngineDeadError, match="not serving"):
            await loop.submit("d", [1], SamplingParams(max_tokens=4), asyncio.Queue())

    asyncio.run(scenario())
