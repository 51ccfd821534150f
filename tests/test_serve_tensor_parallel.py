"""`kvforge serve --tensor-parallel-size 2`: the server's engine runs its workers
like `kvforge generate` does and answers what one process answers; replicas of a
multi-rank engine are refused by name, before anything starts."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

sys.path.insert(0, str(Path(__file__).parent))
from serve_process import openai_client, running_server  # noqa: E402

from kvforge import LLM, SamplingParams  # noqa: E402

MODEL = "kvforge-tiny"
PROMPTS = [f"def g{i}(y):\n    return" for i in range(6)]


@pytest.mark.slow
def test_a_tensor_parallel_server_answers_as_one_process_does():
    expected = [o.text for o in LLM(model=MODEL).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))]
    with running_server("--tensor-parallel-size", "2") as server:
        async def main():
            aclient = openai_client(server, async_=True)
            try:
                replies = await asyncio.gather(*(aclient.completions.create(
                    model=MODEL, prompt=p, max_tokens=12, temperature=0) for p in PROMPTS))
            finally:
                await aclient.close()
            return [r.choices[0].text for r in replies]

        assert asyncio.run(main()) == expected
        assert "tensor parallel over 2 ranks" in server.output()  # really two ranks, not one process


def test_replicas_of_a_multi_rank_engine_are_refused_before_anything_starts():
    result = subprocess.run([sys.executable, "-m", "kvforge", "serve", MODEL, "--data-parallel-size", "2",
                             "--tensor-parallel-size", "2"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--data-parallel-size 2" in result.stderr and "world_size 2" in result.stderr
    assert "pids" not in result.stderr  # no replica was started
