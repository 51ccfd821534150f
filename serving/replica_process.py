"""One data-parallel replica: its own process holding its own engine.

The API process sends commands down one pipe and reads results from another
(`replica_pool.py` is its side). The replica applies adds and aborts between
steps, exactly as the single-process engine loop does, and after each step sends
the outputs with a snapshot of its counters (for /metrics and routing).

It leaves when told to stop, and also when the API process goes away (its
command pipe reaches end of file), so a killed server leaves no replica behind.
"""

from __future__ import annotations

import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from .served_model import ServedModel

# Messages, replica to API process: ("ready", ReplicaInfo), ("error", text) at start-up,
# ("applied", accepted ids, [(id, refusal)], aborted outputs, snapshot),
# ("step", outputs, snapshot), ("failed", text) when a step raised (then it exits).
# API process to replica: ("add", AddRequest), ("abort", id), ("stop",).


@dataclass
class ReplicaSpec:
    """How to build each replica's engine: what `kvforge serve` was given."""

    config_file: str | None
    overrides: list[str]
    model: str | None
    threads: int | None
    describe: Callable | None = None  # engine -> its selection line (the CLI's, passed by reference)


@dataclass
class ReplicaInfo:
    """Sent once a replica is ready."""

    model: ServedModel
    selection: str  # the engine's line naming what it selected
    pid: int


@dataclass
class AddRequest:
    request_id: str
    token_ids: list[int]
    params: object  # SamplingParams
    priority: int
    cache_salt: str | None
    arrival_time: float


def replica_main(index: int, spec: ReplicaSpec, commands, results) -> None:
    """The replica's process: build the engine, then serve commands until told to stop."""
    import os

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the API process stops us
    try:
        engine = _build_engine(spec)
    except BaseException as exc:  # anything: the API process must hear why, not wait for a ready that never comes
        results.send(("error", f"{type(exc).__name__}: {exc}"))
        sys.exit(1)
    results.send(("ready", ReplicaInfo(ServedModel.of(engine), spec.describe(engine) if spec.describe else "",
                                       os.getpid())))
    try:
        _serve(engine, commands, results)
    except (EOFError, OSError, KeyboardInterrupt):
        pass  # the API process went away: nothing to report to
    except Exception as exc:  # a bug in a step: fail this replica's requests rather than hang them
        traceback.print_exc()
        try:
            results.send(("failed", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        sys.exit(1)


def _build_engine(spec: ReplicaSpec):
    if spec.threads:
        import torch

        torch.set_num_threads(spec.threads)
    from kvforge.engine.llm import LLM
    from kvforge.engine.long_lived import long_lived_start_up

    sections = {"model": spec.model} if spec.model else {}
    with long_lived_start_up():  # the replica's process serves this engine until it exits
        return LLM(config_file=spec.config_file, overrides=spec.overrides, **sections).engine


def _serve(engine, commands, results) -> None:
    from kvforge.core import RequestError

    from .metrics import EngineSnapshot

    while True:
        adds: list[AddRequest] = []
        aborts: list[str] = []
        # Block for a command only while idle; between steps take whatever has come.
        timeout = 0 if engine.has_unfinished_requests() else None
        while commands.poll(timeout):
            message = commands.recv()
            if message[0] == "add":
                adds.append(message[1])
            elif message[0] == "abort":
                aborts.append(message[1])
            elif message[0] == "stop":
                for request_id in list(engine.groups):
                    engine.abort_request(request_id)
                return
            timeout = 0
        if adds or aborts:
            aborted = [output for output in (engine.abort_request(rid) for rid in aborts) if output is not None]
            accepted, refused = [], []
            for add in adds:
                if add.request_id in aborts:  # aborted before it was taken: it must never start
                    continue
                try:
                    engine.add_request(add.request_id, prompt_token_ids=add.token_ids, params=add.params,
                                       priority=add.priority, arrival_time=add.arrival_time,
                                       cache_salt=add.cache_salt)
                except RequestError as exc:
                    refused.append((add.request_id, str(exc)))
                    continue
                accepted.append(add.request_id)
            results.send(("applied", accepted, refused, aborted, EngineSnapshot.of(engine)))
        if engine.has_unfinished_requests():
            outputs = engine.step()
            results.send(("step", outputs, EngineSnapshot.of(engine)))
