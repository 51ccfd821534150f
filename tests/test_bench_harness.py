"""The benchmark harness: figures computed right from known inputs, a tiny
workload end to end through a peer process, reports written, missing peers
said to be not run. Sizes are tiny: no timing is asserted anywhere."""

from __future__ import annotations

import json
import os
from pathlib import Path
import sys

import pytest
import torch

from kvforge.benchmarks import harness, report, scenarios, work
from kvforge.benchmarks.scenarios import Run, Scenario, Target
from kvforge.core import QUANTIZER, SPECULATIVE_PROPOSER, ConfigError, build_registry
sys.path.insert(0, str(Path(__file__).parent))  # the test-local helpers sit beside this file
from model_driver import save_bench_llama  # noqa: E402

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return save_bench_llama(tmp_path_factory.mktemp("bench-llama"), vocab=64, hidden=16, positions=128)


def result(elapsed: float, requests: list[tuple[int, float, float, str | None]], peak=None) -> dict:
    return {"elapsed_s": elapsed, "peak_kv_bytes": peak,
            "requests": [{"id": f"r{i}", "output_tokens": n, "ttft_s": ttft, "latency_s": latency, "cls": cls}
                         for i, (n, ttft, latency, cls) in enumerate(requests)]}


def ok_run(label: str, tokens_per_s: float, ttft: float) -> dict:
    return {"label": label, "status": "ok", "metrics": {"tokens_per_s": tokens_per_s, "ttft_p50_s": ttft}}


def test_metrics_count_every_output_token_and_take_latency_of_the_class_only():
    m = harness.metrics(result(2.0, [(11, 0.1, 1.1, "high"), (21, 0.3, 2.3, "high"), (30, 1.0, 1.5, "low")],
                               peak=3 * 2**20), latency_class="high")
    assert m["output_tokens"] == 62 and m["tokens_per_s"] == pytest.approx(31.0)
    assert m["ttft_p50_s"] == pytest.approx(0.2)  # between 0.1 and 0.3; the low request is left out
    assert m["tpot_p50_s"] == pytest.approx(0.1)  # (1.1 - 0.1) / 10 and (2.3 - 0.3) / 20
    assert m["peak_kv_mib"] == pytest.approx(3.0)


def test_ratios_divide_the_subject_by_each_peer_that_ran():
    runs = [ok_run("kvforge", 300.0, 0.2), ok_run("generate", 100.0, 0.8), ok_run("vllm", 600.0, 0.1),
            {"label": "generate_batch", "status": "not run: no --peer given"}]
    table = harness.ratios(runs, "kvforge")
    assert set(table) == {"generate", "vllm"}
    assert table["generate"]["throughput"] == pytest.approx(3.0)
    assert table["generate"]["ttft_p50"] == pytest.approx(0.25)
    assert table["vllm"]["throughput"] == pytest.approx(0.5)


def test_targets_are_met_missed_or_not_measured():
    table = {"off": {"throughput": 2.0, "ttft_p50": 0.4}}
    missed = harness.check_target(Target("x", "on", "off", "throughput", 2.4), table)
    met = harness.check_target(Target("y", "on", "off", "ttft_reduction", 0.5), table)
    absent = harness.check_target(Target("z", "on", "vllm", "throughput", 1.0), table)
    assert (missed["status"], missed["value"]) == ("missed", 2.0)
    assert met["status"] == "met" and met["value"] == pytest.approx(0.6)
    assert absent["status"] == "not measured"
    assert report._status(missed) == "missed: 83% of the target"


def test_a_target_compares_its_own_subject_not_the_scenario_s():
    def run(label, tokens_per_s):
        return {"label": label, "status": "ok", "metrics": {"tokens_per_s": tokens_per_s, "ttft_p50_s": 1.0}}

    runs = [run("main", 100.0), run("base", 200.0), run("variant", 190.0)]
    scenario = Scenario("s", [], [], "main", [Target("main vs base", "main", "base", "throughput", 1.0),
                                              Target("variant vs base", "variant", "base", "throughput", 0.9)])
    first, second = harness.scenario_targets(scenario, runs)
    assert first["value"] == pytest.approx(0.5) and first["status"] == "missed"
    assert second["value"] == pytest.approx(0.95) and second["status"] == "met"


def test_peer_arguments_map_names_to_pythons():
    pythons = harness.peer_pythons(["transformers=/py/a", "vllm=/py/b"])
    assert pythons == {"kvforge": sys.executable, "generate": "/py/a", "generate_batch": "/py/a", "vllm": "/py/b"}
    with pytest.raises(ConfigError, match="not a known peer"):
        harness.peer_pythons(["sglang=/py/c"])
    with pytest.raises(ConfigError, match="NAME=PATH"):
        harness.peer_pythons(["vllm"])


def test_transformers_peers_run_with_this_python_unless_turned_off():
    # transformers is a dependency, so both of its peers run out of the box; vLLM needs its own Python
    assert harness.peer_pythons([]) == {"kvforge": sys.executable, "generate": sys.executable,
                                        "generate_batch": sys.executable}
    off = harness.peer_pythons(["transformers=none"])
    assert off["generate"] is None and off["generate_batch"] is None and off["kvforge"] == sys.executable
    assert harness.peer_pythons(["generate=None"])["generate_batch"] == sys.executable  # one peer alone
    with pytest.raises(ConfigError, match="kvforge is what every scenario measures"):
        harness.peer_pythons(["kvforge=none"])


def test_relative_peer_paths_are_taken_from_where_the_bench_starts(tmp_path, monkeypatch):
    # each peer runs from its scenario's output folder, where ".venv/bin/python" would name nothing
    monkeypatch.chdir(tmp_path)
    pythons = harness.peer_pythons(["transformers=.venv/bin/python", "vllm=python3"])
    assert pythons["generate"] == pythons["generate_batch"] == str(tmp_path / ".venv" / "bin" / "python")
    assert pythons["vllm"] == "python3"  # a bare name is looked up on PATH, as given


def test_workloads_are_fixed_by_the_seed():
    a, b = scenarios.mixed(512, quick=True), scenarios.mixed(512, quick=True)
    assert a.requests == b.requests and len(a.requests) == 32
    full = scenarios.mixed(512, quick=False).requests
    assert len(full) == 256 and all(16 <= len(r["prompt_token_ids"]) <= 512 and 16 <= r["max_tokens"] <= 512
                                    for r in full)
    shared = scenarios.prefix(512, quick=False).requests
    assert len(shared) == 64 and all(r["prompt_token_ids"][:512] == shared[0]["prompt_token_ids"][:512] for r in shared)


def test_tiny_workload_runs_end_to_end_and_reports(tmp_path, tiny_model):
    requests = [scenarios.request(i, [3 + i, 4, 5, 6 + i], 3 + i) for i in range(3)]
    scenario = Scenario("tiny", requests, [Run("kvforge", "kvforge", {"cache": {"num_blocks": 32}}),
                                           Run("transformers generate", "generate"), Run("vLLM CPU", "vllm")],
                        "kvforge",
                        [Target("tiny: >= 3x generate", "kvforge", "transformers generate", "throughput", 3.0)])
    summary = harness.run_scenario(scenario, tiny_model, tmp_path, peers=harness.peer_pythons(["transformers=none"]),
                                   kv_cache_gib=0.01, timeout=120, log=lambda line: None)
    kvforge, generate, vllm = summary["runs"]
    assert kvforge["status"] == "ok", kvforge["status"]
    assert kvforge["metrics"]["output_tokens"] == 3 + 4 + 5 and kvforge["metrics"]["tokens_per_s"] > 0
    assert kvforge["metrics"]["peak_kv_mib"] > 0
    hf_config = json.loads((Path(tiny_model) / "config.json").read_text())
    flops = sum(work.request_flops(hf_config, 4, 3 + i) for i in range(3))
    assert kvforge["metrics"]["useful_gflops"] == pytest.approx(flops / kvforge["metrics"]["elapsed_s"] / 1e9)
    assert generate["status"] == "not run: turned off (--peer generate=none)"
    assert vllm["status"] == "not run: no --peer given"
    assert summary["targets"][0]["status"] == "not measured"
    assert json.loads((tmp_path / "tiny" / "workload.json").read_text())["requests"] == requests

    results = {"command": "test", "model": "tiny", "dtype": "float32", "quick": True,
               "peers": {"kvforge": "py", "generate": None, "generate_batch": None}, "scenarios": [summary]}
    text = report.markdown(results)
    assert "not run: no --peer given" in text and "Peers: none (" in text
    assert f"| {kvforge['metrics']['useful_gflops']:.1f} |" in text  # no GEMM peak measured: no fraction of it
    assert text.rindex("## Comparison") > text.rindex("## tiny")  # the comparison table comes last
    (png,) = report.plots(results, tmp_path)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_transformers_peers_sweep_their_batch_settings_and_generate_every_token(tmp_path, tiny_model):
    requests = [scenarios.request(i, [3 + i, 4, 5, 6 + i], 3 + i) for i in range(3)]
    scenario = Scenario("tiny", requests, [Run("generate", "generate", {"batch_sizes": [1, 2]}),
                                           Run("generate_batch", "generate_batch", {"max_requests_per_batch": [1, 2]})],
                        "generate")
    summary = harness.run_scenario(scenario, tiny_model, tmp_path, peers=harness.peer_pythons([f"transformers={sys.executable}"]),
                                   kv_cache_gib=0.01, timeout=300, log=lambda line: None)
    generate, generate_batch = summary["runs"]
    for run in summary["runs"]:
        assert run["status"] == "ok", run["status"]
        assert run["metrics"]["output_tokens"] == 3 + 4 + 5
    assert generate["info"]["batch_size"] in (1, 2) and set(generate["info"]["sweep_tokens_per_s"]) == {"1", "2"}
    info = generate_batch["info"]
    assert info["max_requests_per_batch"] in (1, 2) and set(info["sweep_tokens_per_s"]) == {"1", "2"}


def test_cli_writes_json_and_markdown_and_reports_missing_plugin_kinds(tmp_path, tiny_model, capsys):
    from kvforge.cli import main

    # neither scenario has a transformers configuration: the default peers cost nothing here
    assert main(["bench", "speculative", "kv-quant", "--quick", "--no-machine", "--model", tiny_model,
                 "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert [s["scenario"] for s in results["scenarios"]] == ["speculative", "kv-quant"]
    registry = build_registry()
    for summary, kind in zip(results["scenarios"], [SPECULATIVE_PROPOSER, QUANTIZER]):
        if not registry.implementations(kind):
            assert summary["status"] == f"not available: needs a {kind} plugin"
    assert (tmp_path / "report.md").read_text().startswith("# kvforge bench")
    err = capsys.readouterr().err
    assert "peers not given, not run: llama.cpp, vllm" in err
    for run in results["scenarios"][0]["runs"]:  # draft_model without a draft of this model's vocabulary fails
        if run["status"].startswith("failed"):
            assert f"note: speculative: configuration {run['label']!r} failed" in err


def test_max_requests_keeps_the_first_requests_of_every_workload(tmp_path, tiny_model):
    from kvforge.cli import main

    assert main(["bench", "mixed", "--quick", "--no-machine", "--model", tiny_model, "--max-requests", "3",
                 "--peer", "transformers=none", "--out", str(tmp_path)]) == 0
    written = json.loads((tmp_path / "mixed" / "workload.json").read_text())["requests"]
    assert written == scenarios.mixed(json.loads((Path(tiny_model) / "config.json").read_text())["vocab_size"],
                                      quick=True).requests[:3]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["max_requests"] == 3 and results["scenarios"][0]["runs"][0]["metrics"]["requests"] == 3
    assert "only the first 3 requests of each workload" in (tmp_path / "report.md").read_text()

def test_relative_out_and_model_are_taken_from_where_the_bench_starts(tmp_path, tiny_model, monkeypatch):
    # every peer runs from DIR/<scenario>/, where a relative DIR or model directory would name nothing
    from kvforge.cli import main

    start = tmp_path / "start"
    start.mkdir()
    monkeypatch.chdir(start)
    assert main(["bench", "mixed", "--quick", "--no-machine", "--model", os.path.relpath(tiny_model, start),
                 "--max-requests", "2", "--peer", "transformers=none", "--out", "results"]) == 0
    (run,) = [r for r in json.loads((start / "results" / "results.json").read_text())["scenarios"][0]["runs"]
              if r["peer"] == "kvforge"]
    assert run["status"] == "ok" and run["metrics"]["requests"] == 2


def test_a_failed_subject_configuration_fails_the_bench_and_is_named(tmp_path, tiny_model, monkeypatch, capsys):
    from kvforge.cli import main

    broken = Scenario("mixed", [scenarios.request(0, [3, 4, 5], 2)],
                      [Run("no such policy", "kvforge", {"scheduler": {"policy": "no-such-policy"}})], "no such policy")
    monkeypatch.setattr(scenarios, "build", lambda name, vocab, quick: broken)
    assert main(["bench", "mixed", "--quick", "--no-machine", "--model", tiny_model, "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "error: mixed: subject configuration 'no such policy' failed (exit 1)" in err
    assert (tmp_path / "report.md").is_file()  # the results are still written, the failure in them


def test_a_failed_configuration_other_than_the_subject_is_named_but_passes(tmp_path, tiny_model, monkeypatch,
                                                                           capsys):
    # e.g. a peer whose venv is gone, or a proposer that cannot serve the model: one comparison lost
    from kvforge.cli import main

    missing = tmp_path / "no-venv" / "bin" / "python"
    lone_peer = Scenario("mixed", [scenarios.request(0, [3, 4, 5], 2)], [Run("vLLM CPU", "vllm")], "kvforge")
    monkeypatch.setattr(scenarios, "build", lambda name, vocab, quick: lone_peer)
    assert main(["bench", "mixed", "--quick", "--no-machine", "--model", tiny_model, "--peer", f"vllm={missing}",
                 "--out", str(tmp_path)]) == 0
    assert f"note: mixed: configuration 'vLLM CPU' failed: no Python at {missing}" in capsys.readouterr().err


def test_without_peer_the_transformers_peers_run_with_this_python(tmp_path, tiny_model, monkeypatch):
    from kvforge.cli import main

    ran = []

    def fake_run_one(python, peer, workload, config, out, *rest):
        ran.append((peer, python))
        return {"status": "ok", "result": result(1.0, [(2, 0.1, 0.2, None)])}

    monkeypatch.setattr(harness, "run_one", fake_run_one)
    assert main(["bench", "mixed", "--quick", "--no-machine", "--model", tiny_model, "--max-requests", "1",
                 "--out", str(tmp_path)]) == 0
    assert ran == [("kvforge", sys.executable), ("generate", sys.executable), ("generate_batch", sys.executable)]
    assert f"Peers: generate={sys.executable}, generate_batch={sys.executable}." in (tmp_path / "report.md").read_text()


def test_one_percentile_interpolates_linearly_like_numpy():
    from kvforge import cli_generate

    assert cli_generate.percentile is harness.percentile  # `kvforge generate` reports the same figures as bench
    assert harness.percentile([], 50) is None
    assert harness.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert harness.percentile([1.0, 2.0, 3.0], 99) == pytest.approx(2.98)  # nearest rank would say 3.0
    assert harness.percentile([10.0, 0.0], 25) == pytest.approx(2.5)


def test_max_requests_below_one_is_refused(capsys):
    from kvforge.cli import main

    assert main(["bench", "mixed", "--quick", "--max-requests", "0"]) != 0
    assert "--max-requests must be at least 1, got 0" in capsys.readouterr().err


def test_unknown_scenario_lists_the_valid_ones():
    with pytest.raises(ConfigError, match="mixed, prefix, speculative, priority, kv-quant"):
        scenarios.build("nope", 64, quick=True)


def test_gemm_peak_measures_every_gemm_kernel_the_models_can_use():
    from kvforge.benchmarks import machine
    from kvforge.models.packed_linear import onednn_unavailable

    kernels = machine.gemm_peak((64,))
    expected = {"torch"} | (set() if onednn_unavailable(torch.float32, torch.device("cpu")) else {"onednn"})
    assert set(kernels) == expected and all(v > 0 for v in kernels.values())
    results = {"machine": {"cpu": "x", "cores": 2, "torch": "t", "torch_threads": 1, "python": "3", "load_average": None},
               "gemm_gflops": max(kernels.values()), "gemm_kernels": kernels, "model_dir": "/m",
               "decode": {"batch": 64, "step_ms": 1.0, "achieved_gflops": 1.0, "mfu": 0.5, "mfu_model_only": 0.6},
               "overhead": {}}
    text = "\n".join(report.machine_section(results))
    assert "(torch " in text


def test_dtype_reaches_every_engine_through_the_workload_and_the_report(tmp_path, tiny_model):
    from kvforge.cli import main

    assert main(["bench", "mixed", "--quick", "--no-machine", "--model", tiny_model, "--max-requests", "2",
                 "--dtype", "bfloat16", "--peer", "transformers=none", "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "mixed" / "workload.json").read_text())["dtype"] == "bfloat16"
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["dtype"] == "bfloat16"
    assert any(r["status"] == "ok" for r in results["scenarios"][0]["runs"] if r["peer"] == "kvforge")
    assert "(bfloat16)" in (tmp_path / "report.md").read_text()


def test_bench_serve_refuses_a_dtype_it_does_not_run(capsys):
    from kvforge.cli import main

    assert main(["bench", "serve", "--quick", "--dtype", "bfloat16"]) != 0
    assert "runs both servers in float32 only" in capsys.readouterr().err


def test_repeats_run_the_configurations_in_turn_and_keep_each_ones_fastest_round(tmp_path, tiny_model,
                                                                                 monkeypatch):
    # a machine that slows down over the run: in turn, both configurations see the drift alike
    calls = []
    elapsed = {"kvforge": [3.0, 2.0, 4.0], "vllm": [6.0, 5.0, 2.5]}

    def fake_run_one(python, peer, workload, config, out, timeout, kv_cache_gib, threads):
        calls.append(peer)
        took = elapsed[peer][calls.count(peer) - 1]
        return {"status": "ok", "result": result(took, [(10, 0.1, 1.0, None), (20, 0.2, 2.0, None)])}

    monkeypatch.setattr(harness, "run_one", fake_run_one)
    scenario = Scenario("turns", [scenarios.request(0, [3, 4], 10), scenarios.request(1, [5, 6], 20)],
                        [Run("kvforge", "kvforge"), Run("vLLM CPU", "vllm")], "kvforge")
    summary = harness.run_scenario(scenario, tiny_model, tmp_path, peers={"kvforge": "py", "vllm": "py"},
                                   repeats=3, log=lambda line: None)
    assert calls == ["kvforge", "vllm"] * 3
    kvforge, vllm = summary["runs"]
    assert kvforge["metrics"]["elapsed_s"] == 2.0 and vllm["metrics"]["elapsed_s"] == 2.5  # each one's fastest
    assert kvforge["rounds_tokens_per_s"] == pytest.approx([10.0, 15.0, 7.5])
    ratio = summary["ratios"]["vLLM CPU"]
    assert ratio["throughput"] == pytest.approx(1.25)
    assert ratio["throughput_rounds"] == pytest.approx([2.0, 2.5, 0.625])
    results = {"command": "test", "model": "m", "dtype": "float32", "quick": True, "peers": {}, "scenarios": [summary]}
    assert "| vLLM CPU | 1.25 | – | 1 | 2.00, 2.50, 0.62 |" in report.markdown(results)


def test_a_configuration_that_fails_is_not_run_again_in_later_rounds(tmp_path, tiny_model, monkeypatch):
    calls = []

    def fake_run_one(python, peer, workload, config, out, timeout, kv_cache_gib, threads):
        calls.append(peer)
        if peer == "vllm":
            return {"status": "failed (exit 1): boom"}
        return {"status": "ok", "result": result(1.0, [(4, 0.1, 1.0, None)])}

    monkeypatch.setattr(harness, "run_one", fake_run_one)
    scenario = Scenario("turns", [scenarios.request(0, [3, 4], 2)],
                        [Run("kvforge", "kvforge"), Run("vLLM CPU", "vllm")], "kvforge")
    summary = harness.run_scenario(scenario, tiny_model, tmp_path, peers={"kvforge": "py", "vllm": "py"},
                                   repeats=3, log=lambda line: None)
    assert calls == ["kvforge", "vllm", "kvforge", "kvforge"]
    assert summary["runs"][1]["status"] == "failed (exit 1): boom" and summary["ratios"] == {}


def test_the_vllm_peer_gets_tcmalloc_preloaded_where_the_system_has_it(monkeypatch):
    monkeypatch.setattr(harness, "tcmalloc", lambda: "libtcmalloc_minimal.so.4")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert harness.peer_env("vllm", 1.0, 1)["LD_PRELOAD"] == "libtcmalloc_minimal.so.4"
    assert "LD_PRELOAD" not in harness.peer_env("kvforge", 1.0, 1)  # kvforge runs with its own malloc settings
    monkeypatch.setenv("LD_PRELOAD", "libfoo.so")
    assert harness.peer_env("vllm", 1.0, 1)["LD_PRELOAD"] == "libtcmalloc_minimal.so.4:libfoo.so"
    monkeypatch.setenv("LD_PRELOAD", "/opt/libtcmalloc.so")  # one the user chose stays the only one
    assert harness.peer_env("vllm", 1.0, 1)["LD_PRELOAD"] == "/opt/libtcmalloc.so"
    assert "TCMalloc preloaded" in harness.allocator_note({"vllm": "py"})
    assert harness.allocator_note({"kvforge": "py"}) is None


def test_without_tcmalloc_the_vllm_peer_runs_on_glibc_and_the_report_says_so(monkeypatch):
    monkeypatch.setattr(harness, "tcmalloc", lambda: None)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert "LD_PRELOAD" not in harness.peer_env("vllm", 1.0, 1)
    note = harness.allocator_note({"vllm": "py"})
    assert "apt install libtcmalloc-minimal4" in note
    results = {"command": "test", "model": "m", "dtype": "float32", "quick": True, "peers": {"vllm": "py"},
               "allocator_note": note, "scenarios": []}
    assert note in report.markdown(results)
