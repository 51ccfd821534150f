"""The structured bench scenario: its workload (long schemas, so constrained and
unconstrained runs generate the same token counts), the output checker, and a
quick run end to end through `kvforge bench`'s harness. No timing is asserted."""

from __future__ import annotations

import json
import sys

import pytest

from kvforge.benchmarks import scenarios, structured
from kvforge.benchmarks.model_dirs import QUICK_MODEL, model_dir

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")


def test_every_request_carries_a_corpus_schema_no_document_completes_within_max_tokens():
    s = scenarios.build("structured", 512, quick=True)
    items = [json.loads(case.spec.value) for case in structured.cases(quick=True)]
    assert len(items) == 4 and len(structured.cases(quick=False)) == len(structured.SCHEMAS)
    for i, r in enumerate(s.requests):
        schema = r["json_schema"]
        assert schema["minItems"] * 2 > r["max_tokens"]  # an item and its comma are at least two tokens
        assert structured.item_schema(schema) == items[i % len(items)]
    # the same prompts and max_tokens for every run; only the options differ
    labels = {run.label: run for run in s.runs}
    assert labels["kvforge structured b32"].options["structured_outputs"] == {"backend": "xgrammar"}
    assert "structured_outputs" not in labels["kvforge unconstrained b32"].options
    assert labels["vLLM CPU structured"].options["structured_outputs_backend"] == "xgrammar"
    assert s.requests == scenarios.build("structured", 512, quick=True).requests


def test_a_schema_with_defs_keeps_its_references_when_wrapped():
    tree = next(c for c in structured.cases(quick=True) if c.name == "tree_defs")
    long = structured.long_schema(json.loads(tree.spec.value))
    assert "$defs" in long and "$defs" not in long["items"]
    good = {"left": [{"v": 1}, {"v": 2}], "right": {"v": 3}}
    jsonschema.Draft202012Validator(long).validate([good] * structured.MIN_ITEMS)
    item = jsonschema.Draft202012Validator(structured.item_schema(long))
    assert item.is_valid(good) and not item.is_valid({"left": [{"v": 1}], "right": {"v": 3}})


@pytest.mark.parametrize("text, items, well_formed", [
    ('[1, 2, 3', [1, 2], True),  # the last number may go on
    ('[{"a": 1}, {"a"', [{"a": 1}], True),
    (' [ "x" ,"y",', ["x", "y"], True),
    ('', [], True),
    ('[1 2,', [], False),
    ('{"a": 1}', [], False),
    ('[1, 2] ', [1], False),  # the array may not close before minItems
])
def test_complete_items_are_the_ones_followed_by_a_comma(text, items, well_formed):
    assert structured.complete_items(text) == (items, well_formed)


def test_the_checker_counts_items_that_break_their_schema():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir(QUICK_MODEL)))
    person = json.loads(next(c for c in structured.cases(True) if c.name == "person").spec.value)
    request = {"id": "r0", "max_tokens": 99, "json_schema": structured.long_schema(person)}
    text = '[{"name": "a", "age": 3}, {"name": "b"}, {"name": "c", "age": 1}, {"na'
    record = {"id": "r0", "output_tokens": 99, "token_ids": tokenizer.encode(text, add_special_tokens=False)}
    report = structured.check_outputs({"requests": [record]}, {"r0": request}, tokenizer)
    assert report == {"requests": 1, "complete_items": 3, "invalid_items": 1, "malformed": 0,
                      "all_max_tokens": True, "valid": False}
    record["output_tokens"] = 98  # one request cut short (e.g. ended by an error)
    assert structured.check_outputs({"requests": [record]}, {"r0": request}, tokenizer)["all_max_tokens"] is False


def test_quick_run_reports_ratios_checked_outputs_compile_times_and_compile_within_ttft(tmp_path):
    from kvforge.benchmarks import harness
    from kvforge.cli_bench import bench

    peers = harness.peer_pythons(["transformers=none"])  # kvforge with this Python; vLLM not given
    results = bench(["structured"], quick=True, out=tmp_path, peers=peers, model=QUICK_MODEL, machine_model=None,
                    kv_cache_gib=0.25, timeout=300, command="test", max_requests=4, log=lambda line: None)
    summary = results["scenarios"][0]
    runs = {run["label"]: run for run in summary["runs"]}
    kvforge_runs = [label for label, run in runs.items() if run["peer"] == "kvforge"]
    assert len(kvforge_runs) == 4 and all(runs[label]["status"] == "ok" for label in kvforge_runs)
    assert runs["vLLM CPU structured"]["status"].startswith("not run")
    figures = summary["structured"]

    # every constrained output: max_tokens generated, well formed, every complete item valid
    assert set(figures["outputs"]) == {"kvforge structured b32", "kvforge structured b1"}
    for checked in figures["outputs"].values():
        assert checked["requests"] == 4 and checked["all_max_tokens"] and checked["valid"]
    for label in kvforge_runs:
        assert runs[label]["metrics"]["output_tokens"] == 4 * 48

    # the ratios: both kvforge pairs, positive; the vLLM pair absent without vLLM
    assert set(figures["overhead"]) == {"kvforge batch 32", "kvforge batch 1"}
    for pair in figures["overhead"].values():
        assert pair["ratio"] > 0 and pair["mask_ms_per_step"] > 0 and pair["mask_steps"] >= 48
    assert summary["ratios"]["kvforge unconstrained b32"]["throughput"] > 0
    assert [t["status"] for t in summary["targets"]][1] == "not measured"

    # compile times per backend and schema: xgrammar compiles all four, every figure positive
    compiled = figures["compile"]
    assert set(compiled["xgrammar"]["specs"]) == set(figures["schemas"])
    for backend in compiled.values():
        for spec in backend["specs"].values():
            assert "refused" in spec or (spec["cold_ms"]["median"] > 0 and spec["cached_ms"]["median"] > 0)
    person = compiled["xgrammar"]["specs"]["person"]["cold_ms"]
    assert person["min"] <= person["median"] <= person["max"]
    profile = figures["mask_profile"]["xgrammar"]
    assert profile["batch"] == 32
    assert min(profile["fill_ms"], profile["apply_ms"], profile["apply_reference_ms"]) > 0

    # compile within TTFT, per backend: the engine recorded a compile for every spec'd
    # request and none for the others, and no compile outlasts its request's TTFT
    parts = figures["compile_in_ttft"]
    assert set(parts) == set(compiled)
    for part in parts.values():
        assert part["requests"] >= 1 and part["first_request_ms"] > 0
        assert part["compile_ms"]["none"]["max"] == 0
        for kind in ("cold", "cached"):
            assert part["compile_ms"][kind]["min"] > 0 and 0 < part["compile_share"][kind] <= 1
            assert part["compile_ms"][kind]["median"] <= part["ttft_ms"][kind]["median"]

    report = (tmp_path / "report.md").read_text()
    assert "| kvforge batch 32 |" in report and "xgrammar cold" in report
    assert "Compile latency within TTFT" in report and "| xgrammar |" in report
    assert "| kvforge structured b1 | 4 | yes |" in report
