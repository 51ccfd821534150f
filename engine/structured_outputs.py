"""`StructuredOutputs`: the engine's one owner of grammar backends, compilation
and masks.

Compilation runs on a pool of daemon threads, never on the step loop (and a
compile that never returns cannot keep the process from exiting): a request waits
(outside the scheduler's waiting queue) until its grammars are ready, while
others run. One job compiles the grammars of all `n` samples of a request.
Outcomes are remembered per spec (LRU): a spec that failed or timed out ends
later requests at once without compiling again, and one that compiled is
compiled again for each request (its grammar is that request's own state) --
a backend keeps its library's compiled form, so a repeat compile is cheap.

Per step the sampler asks for one bitmask row per sampling position of each
structured request and masks all rows with one batched op per backend. A request
with `close_within_max_tokens` has its rows near the end of its budget forced
onto a path that finishes the document (`structured_closing.Closer`).
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kvforge.core import DraftProposal, RequestError
from kvforge.core.structured_output import Grammar, StructuredOutputBackend, StructuredOutputSpec, Vocabulary

from .structured_closing import Closer

SPEC_ERROR = "structured_outputs ({spec}) "
"""How every error of a request's spec (refused, failed or too slow to compile) begins."""

COMPILE_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0)
"""Buckets of the compile-time histogram `kvforge serve` exports."""


@dataclass
class CompileJob:
    """The grammars of one request (one per sample), compiling; `deadline` in `time.monotonic()` seconds."""

    spec: StructuredOutputSpec
    backend: StructuredOutputBackend
    future: concurrent.futures.Future
    deadline: float | None


@dataclass
class StructuredOutputStats:
    compile_count: int = 0
    compile_seconds_sum: float = 0.0
    compile_failures: int = 0
    mask_seconds_sum: float = 0.0
    mask_steps: int = 0
    draft_tokens_cut: int = 0  # draft tokens dropped because the grammar rejects them (or one before them)
    # each compile's seconds until a metrics reader takes them (`take_compile_seconds`); bounded
    # so an engine nobody scrapes keeps only the latest
    recent_compile_seconds: deque = field(default_factory=lambda: deque(maxlen=4096))

    def take_compile_seconds(self) -> tuple[float, ...]:
        """The compile times recorded since the last call (for a histogram)."""
        taken = tuple(self.recent_compile_seconds)
        self.recent_compile_seconds.clear()
        return taken

    def record_compile(self, seconds: float) -> None:
        self.recent_compile_seconds.append(seconds)
        self.compile_count += 1
        self.compile_seconds_sum += seconds


class StructuredOutputs:
    """`select(spec)` gives the backend class for a spec (the registry's choice under
    `structured_outputs.backend`); `vocabulary()` builds the model's `Vocabulary`
    (once, on the first structured request); `options` go to every backend."""

    def __init__(self, select: Callable[[StructuredOutputSpec], type[StructuredOutputBackend]],
                 vocabulary: Callable[[], Vocabulary], *, options: Mapping | None = None,
                 compile_timeout_s: float | None = None, max_cached_grammars: int = 256,
                 max_workers: int | None = None):
        self.select = select
        self._vocabulary_factory = vocabulary
        self._vocabulary: Vocabulary | None = None
        self.options = dict(options or {})
        self.compile_timeout_s = compile_timeout_s
        self.max_cached_grammars = max_cached_grammars
        self.max_workers = max_workers or min(4, os.cpu_count() or 1)
        self.backends: dict[type, StructuredOutputBackend] = {}
        self.outcomes: OrderedDict[StructuredOutputSpec, str | None] = OrderedDict()  # spec -> error, None: compiled
        self.stats = StructuredOutputStats()
        self._pool: DaemonPool | None = None
        self._closer: Closer | None = None  # built with the first request that asks to close within max_tokens

    def closer_for(self, request) -> Closer | None:
        """The `Closer` when `request` asked for `close_within_max_tokens`, else None
        (also for a stand-in with a grammar but no params, as embedders and tests pass)."""
        params = getattr(getattr(request, "params", None), "structured_outputs", None)
        if params is None or not params.close_within_max_tokens:
            return None
        if self._closer is None:
            self._closer = Closer(self.vocabulary)
        return self._closer

    @property
    def vocabulary(self) -> Vocabulary:
        if self._vocabulary is None:
            self._vocabulary = self._vocabulary_factory()
        return self._vocabulary

    def backend_for(self, spec: StructuredOutputSpec) -> StructuredOutputBackend:
        """The backend instance that compiles `spec`; `RequestError` naming why none can."""
        try:
            cls = self.select(spec)
        except RequestError:
            raise
        except Exception as exc:  # noqa: BLE001 - a SelectionError or a config error, both the request's answer
            raise RequestError(SPEC_ERROR.format(spec=spec.describe()) + f"has no backend: {exc}") from exc
        if cls not in self.backends:
            try:
                self.backends[cls] = cls(self.vocabulary, **self.options)
            except Exception as exc:  # noqa: BLE001 - bad structured_outputs.options, or the library failed
                raise RequestError(SPEC_ERROR.format(spec=spec.describe()) + f"needs backend {cls.name!r}, which "
                                   f"could not start: {type(exc).__name__}: {exc}") from exc
        return self.backends[cls]

    # Compilation

    def start(self, spec: StructuredOutputSpec, num_grammars: int) -> CompileJob:
        """Start compiling `num_grammars` grammars for `spec` on the pool."""
        backend = self.backend_for(spec)
        deadline = None if self.compile_timeout_s is None else time.monotonic() + self.compile_timeout_s
        failed = self.outcomes.get(spec)
        if failed is not None:
            future = concurrent.futures.Future()
            future.set_exception(_KnownFailure(failed))
        else:
            future = self._executor().submit(self._compile, backend, spec, num_grammars)
        return CompileJob(spec, backend, future, deadline)

    def _executor(self) -> "DaemonPool":
        if self._pool is None:
            self._pool = DaemonPool(self.max_workers)
        return self._pool

    @staticmethod
    def _compile(backend: StructuredOutputBackend, spec: StructuredOutputSpec,
                 count: int) -> tuple[list[Grammar], float]:
        """(On a pool thread.) The grammars, and the seconds they took."""
        began = time.perf_counter()
        grammars = [backend.compile(spec) for _ in range(count)]
        return grammars, time.perf_counter() - began

    def poll(self, job: CompileJob) -> list[Grammar] | str | None:
        """The job's grammars once compiled; the error (text naming the problem) if
        it failed or ran past `compile_timeout_s`; None while it is still compiling."""
        if not job.future.done():
            if job.deadline is not None and time.monotonic() > job.deadline:
                error = (SPEC_ERROR.format(spec=job.spec.describe()) + f"compiling with {job.backend.name!r} took "
                         f"longer than structured_outputs.compile_timeout_s = {self.compile_timeout_s} s; simplify the "
                         "schema or raise the limit")
                self._remember(job.spec, error)
                job.future.cancel()
                return error
            return None
        exc = job.future.exception()
        if exc is None:
            self._remember(job.spec, None)
            grammars, seconds = job.future.result()
            self.stats.record_compile(seconds)  # here, on the step loop's thread: no lock needed
            return grammars
        if isinstance(exc, _KnownFailure):
            return str(exc)
        error = (SPEC_ERROR.format(spec=job.spec.describe()) + f"could not be compiled by {job.backend.name!r}: "
                 f"{type(exc).__name__}: {exc}")
        self.stats.compile_failures += 1
        self._remember(job.spec, error)
        return error

    def _remember(self, spec: StructuredOutputSpec, error: str | None) -> None:
        self.outcomes[spec] = error
        self.outcomes.move_to_end(spec)
        while len(self.outcomes) > self.max_cached_grammars:
            self.outcomes.popitem(last=False)

    @staticmethod
    def wait(jobs: Sequence[CompileJob], timeout: float) -> None:
        """Block until one of `jobs` finishes or `timeout` seconds pass (an idle
        engine waiting only for grammars sleeps here instead of spinning)."""
        if jobs:
            concurrent.futures.wait([j.future for j in jobs], timeout=timeout,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def figures(self, waiting_for_grammar: int) -> dict[str, float]:
        """The structured-output figures of `LLMEngine.metrics()`."""
        stats = self.stats
        return {
            "structured_waiting_for_grammar": waiting_for_grammar,
            "structured_compiles": stats.compile_count,
            "structured_compile_seconds_sum": stats.compile_seconds_sum,
            "structured_compile_failures": stats.compile_failures,
            "structured_mask_seconds_sum": stats.mask_seconds_sum,
            "structured_mask_steps": stats.mask_steps,
            "structured_draft_tokens_cut": stats.draft_tokens_cut,
            "structured_closing_forced_rows": 0 if self._closer is None else self._closer.forced_rows,
        }

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    # Speculation

    def cut_drafts(self, drafts: dict[str, DraftProposal], requests: Sequence) -> dict[str, DraftProposal]:
        """`drafts` with each structured request's draft cut before the first token
        its grammar rejects (a draft cut to nothing is dropped)."""
        for request in requests:
            draft = drafts.get(request.request_id)
            if draft is None or request.grammar is None:
                continue
            keep = request.grammar.validate_tokens(draft.token_ids)
            self.stats.draft_tokens_cut += len(draft.token_ids) - keep
            if keep == 0:
                del drafts[request.request_id]
            elif keep < len(draft.token_ids):
                probs = None if draft.probs is None else draft.probs[:keep]
                drafts[request.request_id] = DraftProposal(list(draft.token_ids[:keep]), probs)
        return drafts

    # Masks

    def mask(self, logits: torch.Tensor, requests: Sequence, drafts: Sequence[Sequence[int]] | None = None) -> None:
        """Mask `logits` in place. Without `drafts`, row `i` belongs to `requests[i]`.
        With `drafts`, request `i` owns `1 + len(drafts[i])` consecutive rows: row `j`
        is masked with its grammar advanced through the first `j` draft tokens (then
        rolled back), so every verified position has its own mask (forced to one token
        where the request's budget left there is down to its closing path)."""
        began = time.perf_counter()
        rows: dict[int, list[int]] = {}  # backend id -> logit rows
        fills: list[tuple] = []
        row = 0
        for i, request in enumerate(requests):
            width = 1 + (len(drafts[i]) if drafts is not None else 0)
            if request.grammar is not None:
                fills.append((request, row, drafts[i] if drafts is not None else ()))
            row += width
        if not fills:
            return
        by_backend: dict[int, tuple[StructuredOutputBackend, list[int], list[tuple]]] = {}
        for request, first, draft in fills:
            entry = by_backend.setdefault(id(request.grammar_backend), (request.grammar_backend, [], []))
            entry[1].extend(range(first, first + 1 + len(draft)))
            entry[2].append((request, draft))
        for backend, logit_rows, owners in by_backend.values():
            bitmask = backend.allocate_bitmask(len(logit_rows))
            at = 0
            for request, draft in owners:
                at = _fill_rows(request, draft, bitmask, at, self.closer_for(request))
            # rows rise and never repeat: as many as logits means every row in order, and
            # no rows argument spares the backend a gather and scatter of the logits
            every_row = len(logit_rows) == logits.shape[0]
            with torch.inference_mode():  # the model's logits are inference tensors
                backend.apply_bitmask(logits, bitmask, None if every_row else logit_rows)
        self.stats.mask_seconds_sum += time.perf_counter() - began
        self.stats.mask_steps += 1


def _fill_rows(request, draft: Sequence[int], bitmask: torch.Tensor, at: int, closer: Closer | None) -> int:
    """Rows `at ..` for `request`'s grammar and each position of `draft`; returns the next
    free row. A terminated grammar's row stays all-allowed (the token after an EOS is
    discarded). With a `closer`, a row whose budget is down to its closing path allows
    only that path's next token."""
    grammar = request.grammar
    advanced = 0
    for j in range(1 + len(draft)):
        if not grammar.is_terminated():
            forced = None if closer is None else closer.forced_token(request, grammar, draft[:j])
            if forced is None:
                grammar.fill_bitmask(bitmask, at + j)
            else:
                allow_only(bitmask, at + j, forced)
        if j < len(draft):
            if not grammar.accept_tokens([draft[j]]):
                raise RuntimeError(f"the grammar refused draft token {draft[j]} that validate_tokens allowed")
            advanced += 1
    if advanced:
        grammar.rollback(advanced)
    return at + 1 + len(draft)


def allow_only(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    """Row `row` of `bitmask` allows `token_id` alone."""
    word, bit = divmod(token_id, 32)
    bitmask[row].zero_()
    bitmask[row, word] = -(1 << 31) if bit == 31 else 1 << bit  # an int32 word


def is_spec_error(error: str | None) -> bool:
    """Whether a failed request's error is about its structured-output spec (the
    client's to fix, a 400 when served) rather than the engine's."""
    return error is not None and error.startswith(SPEC_ERROR.partition("{")[0])


class DaemonPool:
    """`max_workers` daemon threads running submitted calls in order. Unlike
    `ThreadPoolExecutor`, whose threads the interpreter joins at exit, a call
    that never returns (a grammar library stuck on a schema) leaves the process
    free to exit; it only keeps its thread."""

    def __init__(self, max_workers: int):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"kvforge-grammar-{i}", daemon=True)
                         for i in range(max_workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while queued
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever polls the future
                future.set_exception(exc)

    def shutdown(self) -> None:
        """Stop each idle thread after the calls queued before; a busy one stops when its call returns."""
        for _ in self._threads:
            self._jobs.put(None)


class _KnownFailure(Exception):
    """A spec whose earlier compile failed or timed out; the message is that error."""
