"""The long-prompt bench scenario: its workload, the model it picks (one that
holds its longest request, never a stale cached directory), and a tiny run end
to end. No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvforge.benchmarks import model_dirs, scenarios
from kvforge.benchmarks.model_dirs import FULL_MODEL, QUICK_MODEL, scenario_model_dir
from kvforge.core import ConfigError

transformers = pytest.importorskip("transformers")


def save_tiny(path: Path, positions: int) -> str:
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=positions,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("quick, low, high, count", [(True, 512, 2048, 8), (False, 1024, 4096, 32)])
def test_long_prompts_with_short_outputs_and_prefix_caching_off_everywhere(quick, low, high, count):
    s = scenarios.build("long-prompt", 512, quick)
    lengths = [len(r["prompt_token_ids"]) for r in s.requests]
    assert len(lengths) == count and min(lengths) >= low and max(lengths) <= high
    assert max(lengths) > (low + high) // 2  # the range is used, not its floor
    assert all(r["max_tokens"] <= 32 for r in s.requests)
    assert s.requests == scenarios.build("long-prompt", 512, quick).requests  # fixed by the seed
    options = {run.label: (run.peer, run.options) for run in s.runs}
    vllm = {"enable_prefix_caching": False, "keep_token_ids": True}
    assert options == {"kvforge": ("kvforge", {"cache": {"enable_prefix_caching": False}}),
                       "vLLM CPU": ("vllm", vllm),
                       "vLLM CPU + kvforge cpp": ("vllm", {**vllm, "kvforge_attention_backend": "cpp"})}
    assert [(t.subject, t.other, t.threshold) for t in s.targets] == [("kvforge", "vLLM CPU", 1.2),
                                                                      ("vLLM CPU + kvforge cpp", "vLLM CPU", 1.0)]
    assert s.same_output == ("vLLM CPU + kvforge cpp", "vLLM CPU")
    assert s.longest() == max(len(r["prompt_token_ids"]) + r["max_tokens"] for r in s.requests)
    assert model_dirs.SYNTHETIC[s.model]["max_position_embeddings"] >= s.longest()


def test_a_default_model_too_short_gives_way_to_the_scenarios_own(tmp_path, monkeypatch):
    short = Path(save_tiny(tmp_path / "short", 128))
    s = scenarios.build("long-prompt", 64, quick=True)
    asked = []
    monkeypatch.setattr(model_dirs, "model_dir", lambda name: asked.append(name) or tmp_path / name)
    assert scenario_model_dir(s, QUICK_MODEL, short) == tmp_path / "bench-llama-tiny-8k"
    assert asked == ["bench-llama-tiny-8k"]
    full = scenarios.build("long-prompt", 64, quick=False)
    assert scenario_model_dir(full, FULL_MODEL, short) == tmp_path / "bench-llama-50m-8k"
    # a model the user named is never swapped: too short is an error that says what to pass
    with pytest.raises(ConfigError, match=rf"needs {s.longest()} positions .* admits 128 .*--model bench-llama-tiny-8k"):
        scenario_model_dir(s, str(short), short)
    # one that holds the scenario runs as it is
    mixed = scenarios.build("mixed", 64, quick=True)
    assert scenario_model_dir(mixed, QUICK_MODEL, short) == short


def test_a_changed_synthetic_config_gets_a_new_cache_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFORGE_BENCH_CACHE", str(tmp_path))
    built = []
    monkeypatch.setattr(model_dirs, "build", lambda path, arguments: built.append((path, arguments)))
    monkeypatch.setitem(model_dirs.SYNTHETIC, "bench-x", {"vocab_size": 64, "max_position_embeddings": 2048})
    first = model_dirs.model_dir("bench-x")
    monkeypatch.setitem(model_dirs.SYNTHETIC, "bench-x", {"vocab_size": 64, "max_position_embeddings": 8192})
    second = model_dirs.model_dir("bench-x")
    assert first != second and first.parent == second.parent == tmp_path
    assert [p for p, _ in built] == [first, second]
    assert model_dirs.config_digest({"a": 1, "b": 2}) == model_dirs.config_digest({"b": 2, "a": 1})


def test_long_prompt_runs_end_to_end_on_a_model_that_holds_it(tmp_path):
    from kvforge.cli import main

    model = save_tiny(tmp_path / "long", 4096)
    assert main(["bench", "long-prompt", "--quick", "--no-machine", "--model", model, "--max-requests", "2",
                 "--out", str(tmp_path / "out")]) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    (summary,) = results["scenarios"]
    assert summary["scenario"] == "long-prompt" and "model_dir" not in summary
    (run,) = [r for r in summary["runs"] if r["peer"] == "kvforge"]
    assert run["status"] == "ok" and run["metrics"]["output_tokens"] == 2 * 8
    written = json.loads((tmp_path / "out" / "long-prompt" / "workload.json").read_text())["requests"]
    assert min(len(r["prompt_token_ids"]) for r in written) >= 512
    assert "Prefix caching off in every engine" in (tmp_path / "out" / "report.md").read_text()


def test_scheduler_sweep_alternates_values_and_reports_medians(tmp_path, monkeypatch):
    from kvforge.benchmarks import harness, scheduler_sweep

    model = save_tiny(tmp_path / "m", 8192)
    monkeypatch.setattr(model_dirs, "model_dir", lambda name: Path(model))
    order, speeds = [], iter([10.0, 20.0, 30.0, 60.0, 20.0, 40.0] * 2)

    def fake_run(scenario, model_dir, out, **kwargs):
        (run,) = scenario.runs
        order.append((scenario.name, run.options["scheduler"]["max_num_batched_tokens"]))
        # the scenario's own kvforge options stay: long-prompt keeps prefix caching off
        assert scenario.name == "mixed" or run.options["cache"] == {"enable_prefix_caching": False}
        return {"runs": [{"status": "ok", "metrics": {"tokens_per_s": next(speeds), "output_tokens": 100},
                          "info": {"cpu_s": 1.0}}]}

    monkeypatch.setattr(harness, "run_scenario", fake_run)
    result = scheduler_sweep.sweep(["mixed", "long-prompt"], "max_num_batched_tokens", [2048, 8192], rounds=3,
                                   quick=True, log=lambda _: None)
    assert order[:6] == [("mixed", 2048), ("mixed", 8192)] * 3  # alternating, round by round
    mixed = result["scenarios"]["mixed"]
    assert mixed["2048"]["tokens_per_s"] == [10.0, 30.0, 20.0] and mixed["2048"]["median"] == 20.0
    assert mixed["8192"]["median"] == 40.0 and mixed["8192"]["ratio"] == 2.0
    assert "| mixed | 20.0 (1.00x) | 40.0 (2.00x) |" in scheduler_sweep.markdown(result)


def test_throughput_per_cpu_second_is_compared_where_both_peers_record_it():
    from kvforge.benchmarks import harness, report

    def result(elapsed, cpu):
        return {"elapsed_s": elapsed, "info": {} if cpu is None else {"cpu_s": cpu},
                "requests": [{"output_tokens": 10, "ttft_s": 0.1, "latency_s": 1.0}]}

    kvforge = {"label": "kvforge", "status": "ok", "metrics": harness.metrics(result(4.0, 2.0))}
    vllm = {"label": "vLLM CPU", "status": "ok", "metrics": harness.metrics(result(2.0, 3.0))}
    old = {"label": "old", "status": "ok", "metrics": harness.metrics(result(2.0, None))}
    assert kvforge["metrics"]["tokens_per_cpu_s"] == 5.0 and old["metrics"]["tokens_per_cpu_s"] is None
    table = harness.ratios([kvforge, vllm, old], "kvforge")
    # slower by the clock on the wall (a crowded machine), faster per CPU second
    assert table["vLLM CPU"]["throughput"] == 0.5 and table["vLLM CPU"]["throughput_cpu"] == 1.5
    assert table["old"]["throughput_cpu"] is None
    text = "\n".join(report.comparison_section({"scenarios": [{"scenario": "long-prompt", "subject": "kvforge",
                                                                "ratios": table, "runs": [], "status": "ok"}]}))
    assert "| long-prompt | kvforge | vLLM CPU | 0.50 | 1.50 |" in text
