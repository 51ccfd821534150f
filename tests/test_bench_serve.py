"""`kvforge bench serve`: Poisson arrivals, the latency target and goodput, and
one small end-to-end run against a real `kvforge serve`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvforge.benchmarks.serve_load import LatencyTarget, arrival_times, summarize


def test_arrivals_are_a_seeded_poisson_process_of_the_given_rate():
    times = arrival_times(4000, rate=5.0, seed=3)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0 and all(g > 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 5.0, rel=0.05)
    # exponential gaps: the standard deviation equals the mean (a fixed interval would give 0)
    mean = sum(gaps) / len(gaps)
    std = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5
    assert std == pytest.approx(mean, rel=0.1)
    assert arrival_times(10, 5.0, seed=3) == times[:10]


def record(ttft, tpot, tokens=10, error=None):
    return {"ttft_s": ttft, "tpot_s": tpot, "itl_s": [tpot] * (tokens - 1) if tpot else [], "e2e_s": 1.0,
            "output_tokens": tokens, "error": error}


def test_goodput_counts_only_requests_within_both_bounds():
    target = LatencyTarget(ttft_s=0.5, tpot_s=0.05)
    records = [record(0.1, 0.01), record(0.6, 0.01), record(0.1, 0.06), record(0.5, 0.05),
               record(None, None, 0, error="APIConnectionError")]
    figures = summarize(records, seconds=2.0, target=target)
    assert figures["met_target"] == 2 and figures["goodput_req_per_s"] == 1.0
    assert figures["errors"] == 1 and figures["requests"] == 5
    assert figures["output_tokens_per_s"] == 20.0
    assert figures["ttft_p50_s"] == pytest.approx(0.3)


@pytest.mark.slow
def test_bench_serve_runs_kvforge_serve_under_load(tmp_path):
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    result = subprocess.run(
        [sys.executable, "-m", "kvforge", "bench", "serve", "--quick", "--model", "kvforge-tiny", "--max-requests",
         "6", "--rates", "4,16", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    results = json.loads((tmp_path / "serve.json").read_text())
    rows = results["engines"]["kvforge"]["rates"]
    assert [r["rate"] for r in rows] == [4.0, 16.0]
    for row in rows:
        assert row["requests"] == 6 and row["errors"] == 0
        assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"] and 0 < row["itl_p50_s"] <= row["itl_p99_s"]
    assert (tmp_path / "serve.png").stat().st_size > 0
    assert "| kvforge | 16 |" in (tmp_path / "serve.md").read_text()


def test_data_parallel_sizes_become_kvforge_servers_side_by_side():
    from kvforge.benchmarks.serve_load import kvforge_engine_name, server_command

    assert [kvforge_engine_name(n) for n in (1, 2)] == ["kvforge", "kvforge-dp2"]
    one = server_command("kvforge", "python", "m", 1, 0.5, 1)
    two = server_command("kvforge-dp2", "python", "m", 1, 0.5, 1)
    assert "--data-parallel-size" not in one
    assert two[two.index("--data-parallel-size") + 1] == "2" and two[:len(one) - 2] == one[:-2]


def test_bad_data_parallel_sizes_are_refused():
    result = subprocess.run([sys.executable, "-m", "kvforge", "bench", "serve", "--data-parallel-sizes", "1,two"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--data-parallel-sizes must be integers" in result.stderr
