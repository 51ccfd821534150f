"""`kvforge serve --data-parallel-size 2`, end to end: two replica processes
behind one server give what one engine gives (greedy and seeded), both get
work, a disconnect reaches the replica, prefix routing keeps a prefix on one
replica, a killed replica fails only its own requests and /health says so, and
shutdown leaves no process. The router itself is tested in test_serving_router.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

sys.path.insert(0, str(Path(__file__).parent))
from serve_process import ServerProcess, openai_client, running_server  # noqa: E402

from kvforge import LLM, SamplingParams  # noqa: E402

MODEL = "kvforge-tiny"
PROMPTS = [f"def f{i}(x):\n    return" for i in range(12)]
SYSTEM = "# a module of small helpers, one per line\n"  # longer than one 16-token block


@pytest.fixture(scope="module")
def offline():
    return LLM(model=MODEL)


def health(server) -> dict:
    status, body = server.get("/health")
    return {"status_code": status, **json.loads(body)}


def gone(pid: int) -> bool:
    """No such process, or only its zombie (exited; its parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def per_engine(server, name: str, **labels) -> list[float]:
    return [server.metric(name, engine=str(i), **labels) for i in range(2)]


async def stream_text(aclient, **kwargs) -> str:
    stream = await aclient.completions.create(model=MODEL, stream=True, **kwargs)
    return "".join([chunk.choices[0].text async for chunk in stream])


@pytest.mark.slow
def test_two_replicas_serve_concurrent_requests_as_one_engine_would_and_both_get_work(offline):
    greedy = [o.text for o in offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10))]
    seeded = [o.text for o in offline.generate(PROMPTS[:4], [SamplingParams(temperature=1.0, seed=100 + i,
                                                                            max_tokens=10) for i in range(4)])]
    with running_server("--data-parallel-size", "2") as server:
        before = health(server)
        assert before["status_code"] == 200 and before["status"] == "ok"
        pids = [r["pid"] for r in before["replicas"]]
        assert len(set(pids)) == 2 and server.proc.pid not in pids

        async def main():
            aclient = openai_client(server, async_=True)
            try:
                return await asyncio.gather(
                    *(stream_text(aclient, prompt=p, max_tokens=10, temperature=0) for p in PROMPTS),
                    *(stream_text(aclient, prompt=p, max_tokens=10, temperature=1.0, seed=100 + i)
                      for i, p in enumerate(PROMPTS[:4])))
            finally:
                await aclient.close()

        results = asyncio.run(main())
        assert results[:len(PROMPTS)] == greedy
        assert results[len(PROMPTS):] == seeded
        served = per_engine(server, "vllm:request_success_total", finished_reason="length")
        assert sum(served) == len(PROMPTS) + 4 and min(served) > 0, served  # least-tokens spread them
        assert per_engine(server, "kvforge:replica_outstanding_tokens") == [0, 0]
        assert per_engine(server, "vllm:request_params_n_count") == served  # labelled by the replica it went to

        # A client that goes away: the abort reaches its replica, which frees the blocks.
        client = openai_client(server)
        stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=500, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        stream.close()
        server.wait_for(lambda: sum(per_engine(server, "vllm:request_success_total", finished_reason="abort")) == 1,
                        "the abort to reach the replica")
        server.wait_for(lambda: per_engine(server, "vllm:kv_cache_usage_perc") == [0, 0], "blocks to be freed")
        assert server.stop() == 0
    assert all(gone(pid) for pid in pids)


@pytest.mark.slow
def test_prefix_routing_then_a_killed_replica_fails_only_its_requests(offline):
    prompts = [SYSTEM + f"def g{i}(y):\n" for i in range(4)]
    expected = [o.text for o in offline.generate(prompts, SamplingParams(temperature=0, max_tokens=6))]
    with running_server("--data-parallel-size", "2", "--data-parallel-routing", "prefix") as server:
        pids = [r["pid"] for r in health(server)["replicas"]]
        client = openai_client(server)
        for prompt, text in zip(prompts, expected):
            assert client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0) \
                .choices[0].text == text
        served = per_engine(server, "vllm:request_success_total", finished_reason="length")
        assert sorted(served) == [0, 4], served  # same first block: same replica
        home = served.index(4)
        assert server.metric("vllm:prefix_cache_hits_total", engine=str(home)) > 0

        # A long request on the prefix's replica, then that replica is killed mid-stream.
        events: list[str] = []
        started = threading.Event()

        def long_stream() -> None:
            stream = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=900, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            try:
                for chunk in stream:
                    started.set()
                    events.append(chunk.choices[0].text)
            except openai.APIError as exc:  # the error event arrives as an APIError from the client
                events.append(f"ERROR {exc}")
            finally:
                started.set()

        reader = threading.Thread(target=long_stream)
        reader.start()
        assert started.wait(120)
        os.kill(pids[home], signal.SIGKILL)
        reader.join(120)
        assert not reader.is_alive()
        assert events[-1].startswith("ERROR") and f"replica {home}" in events[-1], events[-1:]
        assert "signal 9" in events[-1]

        state = health(server)
        assert state["status_code"] == 200 and state["status"] == "degraded"
        dead = state["replicas"][home]
        assert not dead["alive"] and "signal 9" in dead["error"]
        assert state["replicas"][1 - home]["alive"]
        assert server.metric("kvforge:replica_alive", engine=str(home)) == 0
        # The same prefix now goes to the survivor, which answers as one engine would.
        assert client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=6, temperature=0) \
            .choices[0].text == expected[1]
        assert server.stop() == 0
    assert all(gone(pid) for pid in pids)


@pytest.mark.parametrize("args, message", [
    (["--data-parallel-size", "0"], "--data-parallel-size must be >= 1, got 0"),
    (["--data-parallel-size", "2", "--set", "cache.block_size=banana"], "cache.block_size"),
])
def test_bad_data_parallel_settings_are_refused_before_any_replica_starts(args, message):
    result = subprocess.run([sys.executable, "-m", "kvforge", "serve", MODEL, "--port", "1", *args],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]
    assert "data parallel over" not in result.stderr  # no replica was started


@pytest.mark.slow
def test_replicas_leave_when_their_server_is_killed_outright():
    server = ServerProcess(["--data-parallel-size", "2"])
    try:
        server.wait_ready()
        pids = [r["pid"] for r in health(server)["replicas"]]
        server.proc.kill()  # no shutdown runs: the replicas must notice their pipes close
        server.proc.wait()
        server.wait_for(lambda: all(gone(pid) for pid in pids), "the replicas to exit")
    finally:
        server.stop()
