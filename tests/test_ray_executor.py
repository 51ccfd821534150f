"""The Ray executor on a local Ray instance (2 CPUs, no dashboard): TP=2 gives the
same greedy tokens as one process with half the KV per rank, and a killed actor
fails the engine with a DistributedError naming its rank, never a hang."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from kvforge.core import ConfigError, DistributedError, UnsupportedConfigurationError

sys.path.insert(0, str(Path(__file__).parent))  # the shared runs sit beside this file
from parallel_runs import assert_half, assert_same, run, started_engine, step_in_thread  # noqa: E402

RAY_TP2 = {"tensor_parallel_size": 2, "executor": "ray"}


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_ray_workers_give_the_same_greedy_tokens_with_half_the_kv_per_rank(local_ray):
    one, [(weights, kv)] = run("kvforge-tiny")
    two, memory = run("kvforge-tiny", RAY_TP2)
    assert_same(two, one)
    assert len(memory) == 2
    for rank_weights, rank_kv in memory:
        assert_half(rank_weights, weights, slack=0.1)
        assert rank_kv == kv // 2
    assert cpus_freed(local_ray), "the engine's actors outlived its shutdown"


def cpus_freed(ray, wait_s: float = 30.0) -> bool:
    """Whether all the instance's CPUs are free again (Ray updates its accounting a moment
    after an actor ends)."""
    deadline = time.monotonic() + wait_s
    while ray.available_resources().get("CPU") != 2:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.slow
def test_a_killed_ray_actor_fails_the_engine_naming_the_rank(local_ray):
    engine = started_engine({**RAY_TP2, "collective_timeout_s": 60})
    [pid] = engine.executor.actor_pids
    os.kill(pid, signal.SIGKILL)
    error = step_in_thread(engine)
    assert isinstance(error, DistributedError)
    assert f"distributed worker rank 1 (Ray actor, pid {pid}) died" in str(error)
    with pytest.raises(DistributedError, match="rank 1"):  # and it stays failed, without waiting again
        engine.step()


def test_without_ray_installed_the_error_says_how_to_install_it(monkeypatch):
    from kvforge.distributed import ray_executor

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'kvforge\[ray\]'"):
        ray_executor.import_ray()


def test_a_cluster_too_small_for_the_workers_is_refused_before_any_actor_waits():
    from kvforge.distributed.ray_executor import check_resources

    check_resources({"CPU": 4.0}, {"CPU": 2.0}, workers=2)
    with pytest.raises(UnsupportedConfigurationError, match=r"has 1 GPU\(s\) but 3 worker rank\(s\) need 1 each"):
        check_resources({"CPU": 8.0, "GPU": 1.0}, {"GPU": 1.0}, workers=3)
