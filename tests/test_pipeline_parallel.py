"""Pipeline parallelism, on CPU with gloo and one worker process (PP=2): the same
greedy tokens as one process, each stage holding its layers' weights and KV,
per-stage timing reported, and a dead stage named."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from kvforge.core import ConfigError, DistributedError
from kvforge.distributed.pipeline_parallel import stage_layers

sys.path.insert(0, str(Path(__file__).parent))  # the shared runs sit beside this file
from parallel_runs import assert_same, llama_dir, run, started_engine, step_in_thread  # noqa: E402

pytest.importorskip("transformers")
PP2 = {"pipeline_parallel_size": 2}


@pytest.mark.parametrize("layers, stages", [(1, 1), (3, 2), (10, 4), (7, 7), (32, 3)])
def test_stages_hold_consecutive_layers_and_never_more_than_the_first(layers, stages):
    parts = [stage_layers(layers, stages, s) for s in range(stages)]
    assert [i for part in parts for i in part] == list(range(layers))
    sizes = [len(part) for part in parts]
    assert max(sizes) - min(sizes) <= 1 and sizes[0] == max(sizes)  # rank 0's KV spec sizes every stage


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ConfigError, match="at most 3"):
        stage_layers(3, 4, 0)


@pytest.mark.slow
def test_tiny_model_in_two_stages_gives_the_same_greedy_tokens():
    one, [(weights, kv)] = run("kvforge-tiny")
    two, memory = run("kvforge-tiny", PP2)
    assert_same(two, one)
    assert [rank_kv for _, rank_kv in memory] == [kv * 2 // 3, kv // 3]  # 3 layers: 2 on rank 0, 1 on rank 1
    assert sum(w for w, _ in memory) < weights + 2 * 256 * 4  # nothing held twice but a norm's worth


@pytest.mark.slow
@pytest.mark.parametrize("num_kv_heads", [2, 1])
def test_llamas_in_two_stages_hold_half_the_kv_each(tmp_path_factory, num_kv_heads):
    model = llama_dir(tmp_path_factory, num_kv_heads)
    one, [(weights, kv)] = run(model)
    two, memory = run(model, PP2)
    assert_same(two, one)
    assert [rank_kv for _, rank_kv in memory] == [kv // 2, kv // 2]
    # rank 0: embedding, layer 0, head; rank 1: layer 1, norm; both: the rotary frequencies (8 float32)
    assert sum(w for w, _ in memory) == weights + 8 * 4
    assert memory[1][0] < weights / 2


@pytest.mark.slow
def test_every_stage_reports_its_compute_and_communication_time():
    engine = started_engine({**PP2, "collective_timeout_s": 60})
    try:
        for _ in range(3):
            engine.step()
        timings = engine.executor.timings()
    finally:
        engine.shutdown()
    with pytest.raises(DistributedError, match="shut down"):  # its request is unfinished: this step needs the workers
        engine.step()
    assert len(timings) == 2
    for timing in timings:
        assert 0 < timing.compute_seconds <= timing.forward_seconds
    # rank 0's forward includes waiting for the last stage's hidden states; rank 1's, for rank 0's
    assert all(t.forward_seconds - t.compute_seconds > 0 for t in timings)


@pytest.mark.slow
def test_a_killed_stage_fails_the_engine_naming_the_rank():
    engine = started_engine({**PP2, "collective_timeout_s": 60})
    worker = engine.executor.workers[0]
    os.kill(worker.pid, signal.SIGKILL)
    error = step_in_thread(engine)
    assert isinstance(error, DistributedError) and "rank 1" in str(error) and "SIGKILL" in str(error)
