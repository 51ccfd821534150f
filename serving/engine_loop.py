"""The server's one engine loop.

A single asyncio task owns the `LLMEngine`: it runs each `step()` on one worker
thread (so the event loop, and every HTTP handler, stays responsive while the
model runs) and, between steps, applies the adds and aborts that handlers
queued, and runs the engine calls they asked for (`call`: loading or removing a
LoRA adapter) on that same thread. Nothing else touches the engine, so it needs
no lock. Each step's outputs go to the asyncio queue of the handler that owns
the request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvforge.core import RequestError
from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine.lora_request import LoRARequest
from kvforge.engine.outputs import RequestOutput
from kvforge.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """A step raised: the engine's state is unknown, so no request can be served."""


@dataclass
class _PendingAdd:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    arrival_time: float
    accepted: asyncio.Future = field(repr=False)
    lora_request: LoRARequest | None = None


class EngineLoop:
    """Drives `engine.step()` while requests are unfinished; handlers call
    `generate` (or `submit` + `abort`) and never the engine itself.

    `on_step(engine, outputs, now)` is called on the event loop after every step
    and after aborts are applied (for metrics)."""

    def __init__(self, engine: LLMEngine, on_step=None):
        self.engine = engine
        self.on_step = on_step
        self.error: BaseException | None = None
        self.num_waiting = 0  # the engine's waiting queue, as of the last step
        self._adds: list[_PendingAdd] = []
        self._aborts: list[str] = []
        self._calls: list[tuple[Callable, asyncio.Future]] = []
        self._queues: dict[str, asyncio.Queue] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvforge-engine")

    # Life

    def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvforge-engine-loop")

    async def stop(self) -> None:
        """Stop stepping, abort what is left (its blocks are freed) and end its streams."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown)  # lets a running step end
        for future in [add.accepted for add in self._adds] + [future for _, future in self._calls]:
            if not future.done():
                future.set_exception(EngineDeadError("the server is shutting down"))
        self._adds.clear()
        self._calls.clear()
        for request_id in list(self.engine.groups):
            self.engine.abort_request(request_id)
        self._end_streams(EngineDeadError("the server is shutting down"))

    @property
    def alive(self) -> bool:
        return self.error is None and self._task is not None and not self._task.done()

    @property
    def num_queued(self) -> int:
        """Requests accepted but not yet scheduled: the backpressure figure."""
        return len(self._adds) + self.num_waiting

    # Handlers' side

    async def submit(self, request_id: str, token_ids: Sequence[int], params: SamplingParams,
                     queue: asyncio.Queue, *, priority: int = 0, cache_salt: str | None = None,
                     lora_request: LoRARequest | None = None) -> int:
        """Queue a request (run with `lora_request`'s adapter, None: the base model);
        returns once the engine took it, with the engine's number (its metrics'
        `engine` label: 0, the one). Its outputs (and, if the engine dies, the
        error) arrive on `queue`. Raises `RequestError` if the engine refuses it,
        `EngineDeadError` if the engine is dead."""
        if not self.alive:
            raise EngineDeadError(f"the engine is not running ({self.error or 'stopped'})")
        accepted = asyncio.get_running_loop().create_future()
        self._queues[request_id] = queue
        self._adds.append(_PendingAdd(request_id, list(token_ids), params, priority, cache_salt, time.monotonic(),
                                      accepted, lora_request))
        self._wake.set()
        try:
            await accepted
        except BaseException:
            self._queues.pop(request_id, None)
            if not accepted.done():  # cancelled while waiting: it must never start
                self.abort(request_id)
            raise
        return 0

    async def call(self, fn: Callable[[LLMEngine], object]) -> object:
        """`fn(engine)`'s result (or its exception), run between two steps on the
        engine's thread: how handlers load and remove LoRA adapters without
        touching the engine themselves. Raises `EngineDeadError` if the engine is dead."""
        if not self.alive:
            raise EngineDeadError(f"the engine is not running ({self.error or 'stopped'})")
        done = asyncio.get_running_loop().create_future()
        self._calls.append((fn, done))
        self._wake.set()
        return await done

    def abort(self, request_id: str) -> None:
        """Stop a request (before or after the engine took it); its blocks are
        freed before the next step. One already finished or aborted is left alone."""
        for add in self._adds:
            if add.request_id == request_id:
                self._adds.remove(add)
                self._queues.pop(request_id, None)
                if not add.accepted.done():
                    add.accepted.cancel()
                return
        if self._queues.pop(request_id, None) is None:  # every unfinished submitted request has its queue
            return
        self._aborts.append(request_id)
        if self._wake is not None:
            self._wake.set()

    def outputs(self, queue: asyncio.Queue, request_ids: Sequence[str]) -> AsyncIterator[RequestOutput]:
        """Every output of the requests submitted with `queue`, as they come, until
        all are finished. Whatever is unfinished when the caller stops (a client
        disconnected) is aborted."""
        return stream_outputs(queue, request_ids, self.abort)

    def health(self) -> tuple[int, dict]:
        """200 and `{"status": "ok"}` while the loop runs; 503 and `"dead"` (with
        the step's error) after it failed, `"stopping"` once it is stopped."""
        if self.alive:
            return 200, {"status": "ok"}
        if self.error is not None:
            return 503, {"status": "dead", "error": f"{type(self.error).__name__}: {self.error}"}
        return 503, {"status": "stopping"}

    # The loop

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._apply_pending()
            if self._calls:
                await self._run_calls(loop)
                continue
            if not self.engine.has_unfinished_requests():
                self._wake.clear()
                if not self._adds and not self._aborts and not self._calls:
                    await self._wake.wait()
                continue
            try:
                outputs = await loop.run_in_executor(self._executor, self.engine.step)
            except Exception as exc:  # a bug in a step: fail every request rather than hang them
                log.exception("engine step failed; the engine is stopped")
                self.error = exc
                self._end_streams(EngineDeadError(f"the engine failed: {type(exc).__name__}: {exc}"))
                for future in [add.accepted for add in self._adds] + [future for _, future in self._calls]:
                    if not future.done():
                        future.set_exception(EngineDeadError(f"the engine failed: {exc}"))
                self._adds.clear()
                self._calls.clear()
                return
            self.num_waiting = len(self.engine.scheduler.waiting)
            if self.on_step is not None:
                self.on_step(self.engine, outputs, time.monotonic())
            for output in outputs:
                queue = self._queues.get(output.request_id)
                if queue is not None:
                    queue.put_nowait(output)
                if output.finished:
                    self._queues.pop(output.request_id, None)

    def _apply_pending(self) -> None:
        """Adds and aborts queued since the last step, on the loop's side (no step runs now)."""
        aborts, self._aborts = self._aborts, []
        aborted = [self.engine.abort_request(request_id) for request_id in aborts]
        adds, self._adds = self._adds, []
        for add in adds:
            if add.accepted.done():  # cancelled by its handler
                continue
            try:
                self.engine.add_request(add.request_id, prompt_token_ids=add.token_ids, params=add.params,
                                        priority=add.priority, arrival_time=add.arrival_time,
                                        cache_salt=add.cache_salt, lora_request=add.lora_request)
            except Exception as exc:  # RequestError: refused; anything else is a bug, failing this request only
                if not isinstance(exc, RequestError):
                    log.exception("the engine could not add request %s; the other requests go on", add.request_id)
                self._queues.pop(add.request_id, None)
                add.accepted.set_exception(exc)
                continue
            add.accepted.set_result(None)
        if adds or aborts:
            self.num_waiting = len(self.engine.scheduler.waiting)
            if aborts and self.on_step is not None:
                self.on_step(self.engine, [output for output in aborted if output is not None], time.monotonic())

    async def _run_calls(self, loop) -> None:
        """The queued `call`s, one after another on the engine's thread (no step runs
        meanwhile); each one's exception goes to its caller only."""
        calls, self._calls = self._calls, []
        for fn, done in calls:
            if done.done():  # its caller went away
                continue
            try:
                result = await loop.run_in_executor(self._executor, fn, self.engine)
            except Exception as exc:
                if not done.done():
                    done.set_exception(exc)
                continue
            if not done.done():
                done.set_result(result)

    def _end_streams(self, error: BaseException) -> None:
        for queue in self._queues.values():
            queue.put_nowait(error)
        self._queues.clear()


async def stream_outputs(queue: asyncio.Queue, request_ids: Sequence[str], abort) -> AsyncIterator[RequestOutput]:
    """What `outputs` returns, for any loop: outputs from `queue` until every one of
    `request_ids` finished (an exception put on the queue is raised); `abort(id)`
    for each one left unfinished when the caller stops reading."""
    unfinished = list(request_ids)
    try:
        while unfinished:
            output = await queue.get()
            if isinstance(output, BaseException):
                raise output
            if output.finished:
                unfinished.remove(output.request_id)
            yield output
    finally:
        for request_id in unfinished:
            abort(request_id)
