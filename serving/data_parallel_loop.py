"""The engine loop of a server with data-parallel replicas (`--data-parallel-size N`).

It offers handlers what `EngineLoop` offers (`submit`, `abort`, `outputs`,
`alive`, `num_queued`), so the endpoints are the same code; behind it each
request goes to one replica process, chosen by the `Router`, and its outputs
come back on the handler's queue. Everything here runs on the event loop (it
reads the replicas' results pipes itself), so the router's books need no lock.

A replica that dies fails only the requests it held, with an error naming it;
the others keep serving, and /health says the server is degraded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

from kvforge.core import RequestError
from kvforge.engine.outputs import RequestOutput
from kvforge.engine.process_exit import describe_exit
from kvforge.engine.sampling_params import SamplingParams

from .engine_loop import EngineDeadError, stream_outputs
from .metrics import ServerMetrics
from .replica_pool import ReplicaPool
from .replica_process import AddRequest
from .router import NoReplicaError, Router, outstanding_tokens


class DataParallelLoop:
    """Routes requests over the replicas of `pool` and streams their outputs back."""

    def __init__(self, pool: ReplicaPool, router: Router, metrics: ServerMetrics):
        self.pool = pool
        self.router = router
        self.metrics = metrics
        self.waiting = [0] * len(pool.replicas)  # each replica's waiting queue, as of its last report
        self._accepting: dict[str, asyncio.Future] = {}  # sent, not yet taken by the replica
        self._queues: dict[str, asyncio.Queue] = {}
        self._sizes: dict[str, tuple[int, int]] = {}  # request id: (prompt tokens, max_tokens)
        self._started = False
        self._stopping = False

    # Life

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        for replica in self.pool.replicas:
            replica.attach(loop, self._on_message, self._on_death)
        self._started = True

    async def stop(self) -> None:
        """Stop every replica (each aborts what it holds) and end the streams left."""
        self._stopping = True
        for replica in self.pool.replicas:
            replica.detach()
        await asyncio.get_running_loop().run_in_executor(None, self.pool.stop)
        error = EngineDeadError("the server is shutting down")
        for future in self._accepting.values():
            if not future.done():
                future.set_exception(error)
        self._accepting.clear()
        for queue in self._queues.values():
            queue.put_nowait(error)
        self._queues.clear()

    @property
    def alive(self) -> bool:
        """True while any replica serves."""
        return self._started and not self._stopping and any(self.router.alive)

    @property
    def num_queued(self) -> int:
        """Requests accepted but not yet scheduled, over every live replica."""
        return len(self._accepting) + sum(w for w, ok in zip(self.waiting, self.router.alive) if ok)

    def health(self) -> tuple[int, dict]:
        """200 while every replica serves ("ok") or some do ("degraded", naming the
        dead ones and why); 503 once none does."""
        replicas = [{"index": r.index, "pid": r.pid, "alive": self.router.alive[r.index],
                     **({"error": self.router.dead_reason[r.index]} if r.index in self.router.dead_reason else {})}
                    for r in self.pool.replicas]
        live = sum(self.router.alive)
        status = "ok" if live == len(replicas) else "degraded" if live else "dead"
        if self._stopping:
            status = "stopping"
        return (200 if status in ("ok", "degraded") else 503), {"status": status, "replicas": replicas}

    # Handlers' side

    async def submit(self, request_id: str, token_ids: Sequence[int], params: SamplingParams,
                     queue: asyncio.Queue, *, priority: int = 0, cache_salt: str | None = None) -> int:
        """As `EngineLoop.submit`: returns once the chosen replica took the request,
        with the replica's index."""
        if not self.alive:
            raise EngineDeadError("the server is not serving (stopping, or every replica died)")
        try:
            index = self.router.choose(token_ids, cache_salt)
        except NoReplicaError as exc:
            raise EngineDeadError(str(exc)) from None
        sizes = (len(token_ids), params.max_tokens)
        self.router.add(request_id, index, outstanding_tokens(*sizes, [(0, False)] * params.n))
        self._sizes[request_id] = sizes
        self._queues[request_id] = queue
        accepted = asyncio.get_running_loop().create_future()
        self._accepting[request_id] = accepted
        self.pool.replicas[index].send(("add", AddRequest(request_id, list(token_ids), params, priority, cache_salt,
                                                          time.monotonic())))
        self._show_load()
        try:
            await accepted
        except BaseException:
            if not accepted.done():  # cancelled while waiting: it must never start
                self.abort(request_id)
            self._forget(request_id)
            raise
        return index

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; one already finished is left alone."""
        accepting = self._accepting.pop(request_id, None)
        if accepting is not None and not accepting.done():
            accepting.cancel()
        index = self.router.replica_of(request_id)
        self._forget(request_id)
        if index is not None and self.router.alive[index]:
            self.pool.replicas[index].send(("abort", request_id))

    def outputs(self, queue: asyncio.Queue, request_ids: Sequence[str]) -> AsyncIterator[RequestOutput]:
        """As `EngineLoop.outputs`."""
        return stream_outputs(queue, request_ids, self.abort)

    # Replicas' side (on the event loop)

    def _on_message(self, index: int, message: tuple) -> None:
        kind = message[0]
        if kind == "applied":
            _, accepted, refused, aborted, snapshot = message
            for request_id in accepted:
                future = self._accepting.pop(request_id, None)
                if future is not None and not future.done():
                    future.set_result(None)
            for request_id, reason in refused:
                future = self._accepting.pop(request_id, None)
                self._forget(request_id)
                if future is not None and not future.done():
                    future.set_exception(RequestError(reason))
            self._on_outputs(index, aborted, snapshot)
        elif kind == "step":
            self._on_outputs(index, message[1], message[2])
        elif kind == "failed":
            self._replica_died(index, f"failed: {message[1]}")

    def _on_outputs(self, index: int, outputs: list[RequestOutput], snapshot) -> None:
        self.waiting[index] = snapshot.waiting
        self.metrics.on_snapshot(index, snapshot, outputs, time.monotonic())
        for output in outputs:
            request_id = output.request_id
            queue = self._queues.get(request_id)
            if queue is not None:
                queue.put_nowait(output)
            if output.finished:
                self._forget(request_id)
            elif request_id in self._sizes:
                samples = [(len(c.token_ids), c.finished) for c in output.outputs]
                self.router.update(request_id, outstanding_tokens(*self._sizes[request_id], samples))
        self._show_load()

    def _on_death(self, index: int, exitcode: int | None) -> None:
        if not self._stopping and self.router.alive[index]:
            self._replica_died(index, describe_exit(self.pool.replicas[index].pid, exitcode))

    def _replica_died(self, index: int, reason: str) -> None:
        error = EngineDeadError(f"data-parallel replica {index} {reason}; its requests failed, the other replicas "
                                "keep serving")
        for request_id in self.router.mark_dead(index, reason):
            future = self._accepting.pop(request_id, None)
            if future is not None and not future.done():
                future.set_exception(error)
            queue = self._queues.pop(request_id, None)
            if queue is not None:
                queue.put_nowait(error)
            self._sizes.pop(request_id, None)
            self.metrics.forget(request_id)
        self.waiting[index] = 0
        self.metrics.replica_alive[index].set(0)
        self.metrics.running[index].set(0)
        self.metrics.waiting[index].set(0)
        self._show_load()

    def _forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self._sizes.pop(request_id, None)
        self.router.release(request_id)

    def _show_load(self) -> None:
        for index, tokens in enumerate(self.router.load):
            self.metrics.outstanding[index].set(tokens)
