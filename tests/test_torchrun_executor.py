"""The torchrun executor: `torchrun --standalone --nproc-per-node 2 -m kvforge generate
--tensor-parallel-size 2` prints what one process prints, rank 1 serving as a worker
and exiting cleanly; outside torchrun the executor says how to launch it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvforge.cli import main
from kvforge.core import ConfigError
from kvforge.distributed.torchrun_executor import ENV, LaunchedRank

COMMON = ["--set", "device='cpu'", "--set", "dtype='float32'", "--set", "cache.num_blocks=64",
          "--set", "parallel.collective_timeout_s=60", "--max-tokens", "5", "--jsonl", "Hello", "The cat"]


def outputs(jsonl: str) -> list[str]:
    """The generated lines without their timings."""
    return [line.split('"ttft_s"')[0] for line in jsonl.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_torchrun_ranks_generate_what_one_process_generates(capsys):
    assert main(["generate", *COMMON]) == 0
    one = outputs(capsys.readouterr().out)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
              "-m", "kvforge", "generate", "--tensor-parallel-size", "2", *COMMON]
    done = subprocess.run(launch, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(one) == 2 and outputs(done.stdout) == one  # printed once: by rank 0, the driver


NO_SHUTDOWN = """
from kvforge import LLM, SamplingParams
llm = LLM("kvforge-tiny", device="cpu", parallel={"tensor_parallel_size": 2, "collective_timeout_s": 60})
print("tokens", llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0.0))[0].outputs[0].token_ids)
"""


@pytest.mark.slow
def test_a_driver_that_exits_without_shutdown_still_stops_its_ranks_cleanly(tmp_path):
    """A server stopped by a signal never calls shutdown(): the driver still tells the
    other ranks to stop at exit, so they exit 0 rather than fail their next collective."""
    script = tmp_path / "no_shutdown.py"
    script.write_text(NO_SHUTDOWN)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    done = subprocess.run(launch, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    from kvforge import LLM, SamplingParams

    one = LLM("kvforge-tiny", device="cpu").generate(["Hello"], SamplingParams(max_tokens=4, temperature=0.0))
    assert [line for line in done.stdout.splitlines() if line.startswith("tokens")] == \
        [f"tokens {one[0].outputs[0].token_ids}"]


def test_outside_torchrun_the_executor_says_how_to_launch(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="torchrun --nproc-per-node 2 -m kvforge generate --tensor-parallel-size 2"):
        LaunchedRank.from_environment(2)


def test_a_launch_of_another_size_is_refused(monkeypatch):
    for name, value in zip(ENV, ["0", "4", "0", "127.0.0.1", "29500"]):
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=r"started 4 processes \(WORLD_SIZE\) but .* = 2"):
        LaunchedRank.from_environment(2)
