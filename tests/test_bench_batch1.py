"""The `batch1` scenario (kvforge beside llama.cpp, one sequence at a time)
without llama.cpp: kvforge's side on a tiny model, the llama.cpp peer skipped
with its reason, and llama-bench's JSON (a recorded sample) read into the
speeds the report compares. No timing is asserted."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvforge.benchmarks import batch1, harness, report
from kvforge.benchmarks.peers import common, llama_cpp_peer
sys.path.insert(0, str(Path(__file__).parent))  # the test-local helpers sit beside this file
from model_driver import save_bench_llama  # noqa: E402

transformers = pytest.importorskip("transformers")

SAMPLE = Path(__file__).parent / "data" / "llama_bench_sample.json"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return save_bench_llama(tmp_path_factory.mktemp("bench-llama"), vocab=128, hidden=32, positions=256)


def test_requests_arrive_one_at_a_time_with_the_prompt_and_decode_lengths():
    scenario = batch1.scenario(vocab=128, quick=False)
    prompt, decode, count = batch1.sizes(quick=False)
    assert (prompt, decode) == (512, 128)
    assert [len(r["prompt_token_ids"]) for r in scenario.requests] == [prompt] * count + [1] * count
    assert [r["cls"] for r in scenario.requests] == [batch1.PROMPT] * count + [batch1.TG] * count
    assert scenario.latency_class == batch1.PROMPT  # the bench's TTFT/TPOT columns: the prompt requests
    assert {r["max_tokens"] for r in scenario.requests} == {decode + 1}  # the first token comes from the prefill
    # each arrives after the previous one's prefill (at most its prompt's steps) and decode steps are done
    for a, b in zip(scenario.requests, scenario.requests[1:]):
        assert b["arrival_step"] - a["arrival_step"] > len(a["prompt_token_ids"]) + decode
    assert scenario.default_model == batch1.MODEL
    assert {run.label for run in scenario.runs} == set(batch1.KVFORGE) | set(batch1.LLAMA_CPP)


def test_the_bench_model_has_the_24_65m_shape():
    from kvforge.benchmarks.model_dirs import SYNTHETIC

    c = SYNTHETIC[batch1.MODEL]
    layer = 2 * c["hidden_size"] ** 2 * (1 + c["num_key_value_heads"] / c["num_attention_heads"]) \
        + 3 * c["hidden_size"] * c["intermediate_size"] + 2 * c["hidden_size"]
    total = c["num_hidden_layers"] * layer + 2 * c["vocab_size"] * c["hidden_size"] + c["hidden_size"]
    assert total == 24_650_240


def make_program(path: Path, executable: bool) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    program = path / "llama-bench"
    program.write_text("#!/bin/sh\nexit 0\n")
    mode = program.stat().st_mode
    program.chmod(mode | stat.S_IXUSR if executable else mode & ~(stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH))
    return program


def test_the_peer_is_skipped_with_its_reason_when_llama_bench_is_absent_or_not_executable(tmp_path):
    assert "no llama-bench at" in harness.program_missing(str(tmp_path / "nowhere"))
    program = make_program(tmp_path / "src" / "build" / "bin", executable=False)
    if os.access(program, os.X_OK):
        pytest.skip("running as a user who may execute any file")
    assert "is not executable" in harness.program_missing(str(program.parent))
    program.chmod(program.stat().st_mode | stat.S_IXUSR)
    # executable, but outside a llama.cpp tree: no converter to make its GGUF
    assert "no convert_hf_to_gguf.py" in harness.program_missing(str(program.parent))
    (tmp_path / "src" / "convert_hf_to_gguf.py").write_text("")
    assert harness.program_missing(str(program)) is None
    found = llama_cpp_peer.locate(str(program.parent))
    assert found["source"] == str((tmp_path / "src").resolve()) and found["batched"] is None


def test_a_peer_path_with_a_tilde_is_expanded():
    peers = harness.peer_pythons(["llama.cpp=~/llama.cpp/build/bin"])
    assert peers["llama.cpp"] == os.path.expanduser("~/llama.cpp/build/bin")


def speeds_of(parse, sample: list[dict]) -> list[tuple[float, float]]:
    """(pp tok/s, tg tok/s) of each repetition as the bench reads them: records through the harness's metrics."""
    tests = parse(sample)
    prompt = tests["pp"]["n_prompt"]
    out = []
    for record in llama_cpp_peer.records(tests):
        m = harness.metrics({"elapsed_s": record["latency_s"], "requests": [record]})
        out.append((prompt / m["ttft_p50_s"], 1 / m["tpot_p50_s"] if m["tpot_p50_s"] else 0.0))
    return out


def parse_mismatches(parse) -> list[str]:
    """Where `parse` reads the recorded sample into speeds other than llama-bench's own per-repetition tok/s
    (`samples_ts`, which llama-bench rounds to two decimals)."""
    sample = json.loads(SAMPLE.read_text())
    pp = next(e for e in sample if e["n_gen"] == 0)
    tg = next(e for e in sample if e["n_prompt"] == 0)
    wrong = []
    speeds = speeds_of(parse, sample)
    if len(speeds) != len(pp["samples_ts"]):
        wrong.append(f"{len(speeds)} repetitions, recorded {len(pp['samples_ts'])}")
    for i, ((prefill, decode), pp_ts, tg_ts) in enumerate(zip(speeds, pp["samples_ts"], tg["samples_ts"])):
        if prefill != pytest.approx(pp_ts, rel=1e-4):
            wrong.append(f"repetition {i}: pp {prefill:.1f} tok/s, llama-bench says {pp_ts:.1f}")
        if decode != pytest.approx(tg_ts, rel=1e-4):
            wrong.append(f"repetition {i}: tg {decode:.1f} tok/s, llama-bench says {tg_ts:.1f}")
    return wrong


def test_a_recorded_llama_bench_report_reads_as_its_own_tok_per_s():
    assert parse_mismatches(llama_cpp_peer.bench_tests) == []


def test_a_planted_wrong_parse_is_caught():
    def swapped(report: list[dict]) -> dict:  # pp and tg the wrong way round
        tests = llama_cpp_peer.bench_tests(report)
        return {"pp": tests["tg"], "tg": tests["pp"]}

    def first_sample_only(report: list[dict]) -> dict:  # one repetition taken for all
        tests = llama_cpp_peer.bench_tests(report)
        return {k: {**v, "samples_ns": v["samples_ns"][:1] * len(v["samples_ns"])} for k, v in tests.items()}

    assert parse_mismatches(swapped)
    assert parse_mismatches(first_sample_only)


def test_a_report_without_a_tg_test_is_refused():
    sample = [e for e in json.loads(SAMPLE.read_text()) if e["n_gen"] == 0]
    with pytest.raises(ValueError, match="no tg test"):
        llama_cpp_peer.bench_tests(sample)


def test_quick_run_measures_kvforge_and_skips_llama_cpp_with_its_reason(tmp_path, tiny_model):
    scenario = batch1.scenario(vocab=128, quick=True)
    # three of the kvforge runs (their process start dominates this test's time) and one llama.cpp run
    keep = {"kvforge float32", "kvforge float32" + batch1.STEPPED, "kvforge int8_weight W8A8", "llama.cpp f32",
            "llama.cpp Q8_0"}
    scenario.runs = [run for run in scenario.runs if run.label in keep]
    peers = {"kvforge": sys.executable, "llama.cpp": str(tmp_path / "no-llama")}
    summary = harness.run_scenario(scenario, tiny_model, tmp_path, peers=peers, kv_cache_gib=0.05, timeout=300,
                                   log=lambda line: None)
    summary.update(scenario.figures(summary, tmp_path / "batch1", Path(tiny_model)))
    runs = {run["label"]: run for run in summary["runs"]}
    assert runs["kvforge float32"]["status"] == "ok", runs["kvforge float32"]["status"]
    assert runs["kvforge int8_weight W8A8"]["status"] == "ok", runs["kvforge int8_weight W8A8"]["status"]
    stepped = runs["kvforge float32" + batch1.STEPPED]
    assert stepped["status"] == "ok", stepped["status"]
    assert stepped["metrics"]["output_tokens"] == runs["kvforge float32"]["metrics"]["output_tokens"]
    assert stepped["info"]["metrics"]["steps"] > runs["kvforge float32"]["info"]["metrics"]["steps"]  # bursts ran by default
    assert runs["llama.cpp f32"]["status"].startswith("not run: llama.cpp: no llama-bench at")
    prompt, decode, count = batch1.sizes(quick=True)
    m = runs["kvforge float32"]["metrics"]
    assert m["requests"] == 2 * count and m["output_tokens"] == 2 * count * (decode + 1)
    by_class = runs["kvforge float32"]["metrics_by_class"]
    assert by_class[batch1.PROMPT]["tpot_p50_s"] == m["tpot_p50_s"]  # the bench's columns: the prompt requests
    assert by_class[batch1.TG]["tpot_p50_s"] != m["tpot_p50_s"]
    # a one-token prompt's first token comes sooner than a `prompt`-token one's
    assert by_class[batch1.TG]["ttft_p50_s"] < by_class[batch1.PROMPT]["ttft_p50_s"]
    speeds = summary["batch1"]["runs"]["kvforge float32"]
    assert speeds["prefill_tps"] == pytest.approx(prompt / m["ttft_p50_s"])
    assert speeds["tg_after_prompt_tps"] == pytest.approx(1 / m["tpot_p50_s"])
    assert speeds["tg_tps"] == pytest.approx(1 / by_class[batch1.TG]["tpot_p50_s"])
    assert summary["batch1"]["runs"]["llama.cpp f32"] is None
    # memory: the process's peak (loading included) and now, its KV cache sized to KV_TOKENS, not the harness budget
    info = runs["kvforge float32"]["info"]
    config = json.loads((Path(tiny_model) / "config.json").read_text())
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    budget = batch1.KV_TOKENS * config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head * 4
    block = info["kv_cache_bytes"] // info["num_blocks"]
    assert budget - block < info["kv_cache_bytes"] <= budget < 0.05 * 2**30
    assert speeds["peak_rss_bytes"] >= speeds["rss_bytes"] > speeds["kv_cache_bytes"] > 0
    assert 0 < speeds["startup_s"] < 300  # launch to a first token, inside the harness's timeout
    pair = summary["batch1"]["pairs"]["float32"]
    assert pair["decode"] is None and pair["prefill"] is None
    targets = {t["target"]: t for t in summary["targets"]}
    assert len(targets) == 3 * len(batch1.PAIRS)
    assert {t["status"] for t in targets.values()} == {"not measured"}
    text = "\n".join(report.scenario_section({**summary, "status": "ok"}))
    assert "| float32 | kvforge float32 |" in text and "no llama-bench at" in text


def test_targets_are_the_like_for_like_ratios_of_each_pair():
    # kvforge: decode after the prompt 250 tok/s, from an empty context 400; llama.cpp: tg 320, tg after 512 200
    kvforge = {"label": "kvforge float32", "peer": "kvforge", "status": "ok", "info": {},
               "metrics": {"ttft_p50_s": 0.1, "tpot_p50_s": 0.004},
               "metrics_by_class": {batch1.PROMPT: {"ttft_p50_s": 0.1, "tpot_p50_s": 0.004},
                                    batch1.TG: {"ttft_p50_s": 0.001, "tpot_p50_s": 0.0025}}}
    kvforge["info"] = {"peak_rss_bytes": 600e6, "rss_bytes": 450e6, "kv_cache_bytes": 16e6, "startup_s": 2.5}
    llama = {"label": "llama.cpp f32", "peer": "llama.cpp", "status": "ok",
             "info": {"tg_after_prompt_tps": 200.0, "peak_rss_bytes": 150e6, "startup_s": 0.1},
             "metrics": {"ttft_p50_s": 0.2, "tpot_p50_s": 1 / 320}}
    figures = batch1.figures({"targets": [], "runs": [kvforge, llama]}, prompt=512)
    pair = figures["batch1"]["pairs"]["float32"]
    assert pair["prefill"] == pytest.approx(2.0)
    assert pair["decode"] == pytest.approx(400 / 320)  # tg against tg, not kvforge's after-prompt 250
    assert pair["decode_after_prompt"] == pytest.approx(250 / 200)
    status = {t["target"]: t["status"] for t in figures["targets"]}
    assert status["batch1 float32: tg >= 1.0x llama.cpp f32"] == "met"
    assert status["batch1 float32: tg >= 1.2x llama.cpp f32 (stretch)"] == "met"
    assert status["batch1 float32: prefill >= 1.5x llama.cpp f32"] == "met"
    assert status["batch1 bfloat16: tg >= 1.0x llama.cpp bf16"] == "not measured"
    text = "\n".join(batch1.markdown(figures["batch1"]))
    assert "| float32 | kvforge float32 | 5120.0 | 400.0 | 250.0 | llama.cpp f32 | 2560.0 | 320.0 | 200.0 " in text
    assert pair["peak_memory"] == pytest.approx(4.0)
    assert pair["startup"] == pytest.approx(25.0)
    assert "| float32 | 600 | 450 | 16 | 150 | 4.00 | 2.50 | 0.10 | 25.0 |" in text


def test_process_age_counts_from_the_interpreter_s_launch():
    script = ("import sys, time; sys.path.insert(0, sys.argv[1]); time.sleep(0.5); import common; "
              "print(common.process_age())")
    peers = str(Path(llama_cpp_peer.__file__).parent)
    start = time.perf_counter()
    age = float(subprocess.run([sys.executable, "-c", script, peers], capture_output=True, text=True, check=True,
                               timeout=120).stdout)
    assert 0.5 <= age <= time.perf_counter() - start + 0.02  # (/proc counts in 10 ms ticks)


def test_llama_cpp_start_up_is_one_short_run_without_warm_up(tmp_path):
    fake = tmp_path / "llama-bench"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'args'}\nsleep 0.3\necho '[]'\n")
    fake.chmod(0o755)
    seconds = llama_cpp_peer.run_startup(str(fake), tmp_path / "m.gguf")
    args = (tmp_path / "args").read_text().split()
    assert seconds >= 0.3
    assert "--no-warmup" in args and args[args.index("-p") + 1] == str(common.STARTUP_PROMPT)
    assert args[args.index("-n") + 1] == "1" and args[args.index("-r") + 1] == "1"


def test_a_peer_command_s_own_peak_memory_is_measured():
    # from a small launcher, as the peer runs llama-bench: its own peak, not the launcher's
    launcher = ("import sys; sys.path.insert(0, sys.argv[1]); import llama_cpp_peer as p; "
                "print(p.run_measured([sys.executable, '-c', sys.argv[2], sys.argv[3]])[1])")
    touch = "import sys; b = bytearray(int(sys.argv[1])); b[::4096] = b'x' * len(b[::4096]); print('done')"
    peers = str(Path(llama_cpp_peer.__file__).parent)

    def peak(size: int) -> int | None:
        done = subprocess.run([sys.executable, "-c", launcher, peers, touch, str(size)], capture_output=True,
                              text=True, check=True, timeout=120)
        return None if done.stdout.strip() == "None" else int(done.stdout)

    big, bigger = peak(200 * 2**20), peak(400 * 2**20)
    assert big is not None and bigger is not None
    assert 190 * 2**20 < big < 300 * 2**20 and bigger - big > 190 * 2**20
    # below the launching process's own peak a run's peak cannot be told: this test's process is larger
    out, unknown = llama_cpp_peer.run_measured([sys.executable, "-c", touch, "1"])
    assert out.strip() == "done" and unknown is None
    with pytest.raises(SystemExit, match="(?s)failed: .*ZeroDivisionError"):
        llama_cpp_peer.run_measured([sys.executable, "-c", "1 / 0"])


def test_llama_bench_records_carry_the_requests_they_stand_for():
    tests = llama_cpp_peer.bench_tests(json.loads(SAMPLE.read_text()))
    requests = [{"id": f"r{i}", "cls": batch1.PROMPT} for i in range(len(tests["pp"]["samples_ns"]))]
    rows = llama_cpp_peer.records(tests, requests)
    assert [(r["id"], r["cls"]) for r in rows] == [(r["id"], r["cls"]) for r in requests]
