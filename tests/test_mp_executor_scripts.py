"""The mp executor runs a user's script as written: docs/distributed.md's first
example, saved as a plain script (no `if __name__ == "__main__":` guard, as
vLLM's examples are written), runs with two ranks; its workers never run the
script again; and they start normally after the script used torch's thread
pool (a forked worker would hang in its first parallel operation)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import os, sys
    with open(sys.argv[1], "a") as runs:  # one line per execution of this script
        runs.write(f"{os.getpid()}\\n")

    import torch
    torch.set_num_threads(2)
    x = torch.randn(256, 256)
    for _ in range(5):
        x = torch.tanh(x @ x)  # this process's OpenMP pool has run before any worker starts

    from kvforge import LLM, SamplingParams

    llm = LLM("kvforge-tiny", device="cpu", parallel={"tensor_parallel_size": 2})
    print(llm.generate(["def main("], SamplingParams(max_tokens=4, temperature=0.0))[0].outputs[0].text)
    print("workers:", " ".join(str(w.pid) for w in llm.engine.executor.workers))
    llm.engine.shutdown()
''')


@pytest.mark.slow
def test_a_script_without_a_main_guard_runs_two_ranks_and_runs_once(tmp_path):
    script, runs = tmp_path / "plain.py", tmp_path / "runs.txt"
    script.write_text(SCRIPT)
    env = {**os.environ}
    env.pop("OMP_NUM_THREADS", None)
    result = subprocess.run([sys.executable, str(script), str(runs)], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (worker,) = next(line for line in result.stdout.splitlines() if line.startswith("workers:")).split()[1:]
    (ran_in,) = runs.read_text().split()  # a worker that ran the script again would have added its pid
    assert worker != ran_in
