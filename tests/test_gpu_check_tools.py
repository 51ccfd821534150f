"""The pieces of benchmarks/gpu_check.sh that run without a GPU: the closing report
read from a stage folder, the generation-parity comparison, and the sweep's refusal."""

from __future__ import annotations

import json

import pytest
import torch

from kvforge.benchmarks import generate_parity, gpu_check_report, triton_sweep

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="kvforge.conformance.check_attention_decode" name="test_decode[triton-bf16]"/>
<testcase classname="kvforge.conformance.check_attention_decode" name="test_decode[triton-fp16]">
  <failure message="AssertionError: 1 failing case(s):&#10;decode ...">trace</failure></testcase>
<testcase classname="kvforge.conformance.check_attention_features" name="test_alibi[triton]">
  <skipped message="declares no ALiBi"/></testcase>
</testsuite></testsuites>"""


def test_report_counts_each_backends_checks_and_names_failures(tmp_path, capsys):
    (tmp_path / "conformance_triton.xml").write_text(JUNIT)
    (tmp_path / "conformance_sdpa.xml").write_text("<testsuites><testsuite")  # cut off: the run died
    (tmp_path / "generate.json").write_text(json.dumps([
        dict(model="kvforge-tiny", dtype="float32", kv_cache_dtype="auto", weights=None, backend="triton",
             identical=12, requests=12, prefix=1.0),
        dict(model="kvforge-tiny", dtype="bfloat16", kv_cache_dtype="int8", weights=None, backend="sdpa",
             error="RuntimeError: boom")]))
    (tmp_path / "bandwidth.txt").write_text("4000.0\n")
    (tmp_path / "bench.log").write_text("skip x\nshape backend time GB/s ratio\ndecode triton 0.300 3200.0 1.1x\n")
    gpu_check_report.main([str(tmp_path), "1", "0"])
    out = capsys.readouterr().out
    assert "triton       FAIL     checks passed 1  failed 1  skipped 1" in out
    assert "check_attention_decode::test_decode[triton-fp16]: AssertionError: 1 failing case(s):" in out
    assert "skipped: declares no ALiBi" in out
    assert "sdpa         FAIL     no results" in out
    assert "12/12" in out and "FAILED: RuntimeError: boom" in out
    assert "triton decode bandwidth / copy bandwidth: 0.80 (target >= 0.70)" in out
    assert "gpu_check: FAIL" in out


def test_agreement_counts_identical_requests_and_the_prefix_before_the_first_difference():
    same, prefix = generate_parity.agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 3, 4], [5, 9, 7, 8]])
    assert same == 1
    assert prefix == pytest.approx((1.0 + 0.25) / 2)


def test_prompts_are_reproducible_and_share_a_prefix_on_every_other_one():
    a, b = generate_parity.prompts(259), generate_parity.prompts(259)
    assert a == b
    assert a[1][:48] == a[3][:48] and a[0][:48] != a[1][:48]
    assert max(max(p) for p in a) < 259 - 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_the_sweep_refuses_to_run_without_cuda(capsys):
    assert triton_sweep.main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_generation_parity_runs_every_backend_on_the_cpu_and_matches_in_float32(tmp_path, capsys):
    out = tmp_path / "rows.json"
    code = generate_parity.main(["--device", "cpu", "--models", "kvforge-tiny", "--max-tokens", "3",
                                 "--json", str(out)])
    rows = json.loads(out.read_text())
    assert code == 0, capsys.readouterr().out
    assert {r["backend"] for r in rows} >= {"sdpa", "cpp"}
    exact = [r for r in rows if r["dtype"] == "float32" and r["kv_cache_dtype"] == "auto"]
    assert exact and all(r["identical"] == r["requests"] for r in exact)
