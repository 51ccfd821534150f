"""The `vllm_cpu` attention backend (vLLM's own CPU kernel): listed everywhere, and
unavailable with its reason where vLLM's CPU build is not installed; where it is,
it passes the quick conformance grid, matches the float64 reference on shapes past
the grid, writes each token exactly at its slot in its own layout, and a planted
adapter bug is caught."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys

import pytest
import torch

from kvforge.backends import vllm_cpu_ops
from kvforge.backends.vllm_cpu import VllmCpuAttentionBackend, VllmCpuPlan, unpacked_kv
from kvforge.conformance.attention_cases import (
    Target, check_case, make_case, make_layer, mismatch, oracle, run_step,
)
from kvforge.core import ATTENTION_BACKEND, KVCacheSpec, SelectionRequest, build_registry

AVAILABILITY = vllm_cpu_ops.load()
needs_vllm = pytest.mark.skipif(
    not AVAILABILITY.ok,
    reason=f"vllm_cpu unavailable here ({AVAILABILITY.reason}); it runs in an environment with vllm-cpu "
           f"{vllm_cpu_ops.VALIDATED_VERSION} and kvforge installed")
TARGET = Target(VllmCpuAttentionBackend, "cpu", reduced=False)


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Everywhere


def test_listed_and_unavailable_with_the_reason_without_vllm():
    registration = build_registry().get(ATTENTION_BACKEND, "vllm_cpu")
    availability = registration.availability()
    if importlib.util.find_spec("vllm") is None:
        assert not availability.ok
        assert "vllm._C" in availability.reason and "not importable" in availability.reason
        assert f"install vllm-cpu=={vllm_cpu_ops.VALIDATED_VERSION}" in availability.reason
    else:
        assert availability.ok, availability.reason


def test_refuses_what_vllms_kernel_does_not_run_with_reasons():
    cls = VllmCpuAttentionBackend
    for request, words in (
        (SelectionRequest(device="cpu", block_size=8), "block size 8"),  # the kernel aligns blocks to 16 tokens
        (SelectionRequest(device="cpu", block_size=24), "block size 24"),
        (SelectionRequest(device="cpu", head_size=72), "head size 72"),
        (SelectionRequest(device="cuda"), "device 'cuda'"),
        (SelectionRequest(device="cpu", dtype=torch.float64), "dtype torch.float64"),
        (SelectionRequest(device="cpu", kv_storage_dtype=torch.float8_e4m3fn), "fp8"),
    ):
        reasons = cls.unsupported_reasons(request)
        assert any(words in r for r in reasons), (request, reasons)
    assert not cls.unsupported_reasons(SelectionRequest(device="cpu", dtype=torch.bfloat16, head_size=80,
                                                        block_size=48))


def test_the_kernels_choice_follows_vllms_block_and_head_alignment():
    assert vllm_cpu_ops.attention_isa(torch.float32, 16, 128) == "vec16"
    assert vllm_cpu_ops.attention_isa(torch.float32, 32, 80) == "vec16"  # 80 is not a multiple of 32
    assert vllm_cpu_ops.attention_isa(torch.float32, 64, 128) == "vec"


# Where vLLM's CPU build is installed


@needs_vllm
def test_quick_conformance_grid_passes(tmp_path):
    report = tmp_path / "report.json"
    result = subprocess.run(
        [sys.executable, "-m", "kvforge", "conformance", "--kind", "attention_backend", "--plugin", "vllm_cpu",
         "--quick", "--report", str(report)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    groups = {r["group"]: r["status"] for r in json.loads(report.read_text())["results"]}
    assert {g for g, status in groups.items() if status == "pass"} >= {"decode", "prefill", "mixed", "features",
                                                                       "refusal"}, groups


@needs_vllm
@pytest.mark.usefixtures("one_thread")
def test_matches_the_float64_reference_on_shapes_past_the_grid():
    """Block sizes, head sizes and head ratios the conformance grid does not draw,
    with every feature on some of them."""
    rng, problems = random.Random(7), []
    for i, (block, head, ratio, dtype) in enumerate([(48, 32, 16, torch.float32), (64, 160, 1, torch.bfloat16),
                                                     (128, 512, 2, torch.float16), (16, 112, 8, torch.float32),
                                                     (32, 224, 4, torch.bfloat16)]):
        kind = rng.choice(["mixed", "chunked", "long"])
        layer = make_layer(head, ratio, sliding_window=rng.randint(1, 90) if i % 2 else None,
                           soft_cap=20.0 if i % 3 == 0 else None, alibi=i == 4)
        problems.append(check_case(TARGET, make_case(kind, layer, block, dtype, 100 + i)))
    assert not [p for p in problems if p], "\n".join(p for p in problems if p)


@needs_vllm
@pytest.mark.usefixtures("one_thread")
def test_write_kv_puts_each_token_at_its_slot_in_its_layout_and_skips_minus_one():
    for seed, (block, head, dtype) in enumerate([(16, 64, torch.float32), (32, 128, torch.bfloat16),
                                                 (48, 80, torch.float16)]):
        gen = torch.Generator().manual_seed(seed)
        spec = KVCacheSpec(block, 2, head, dtype)
        backend = VllmCpuAttentionBackend(make_layer(head, 4), spec)
        num_blocks, tokens = 5, 30
        cache = torch.randn(VllmCpuAttentionBackend.kv_cache_shape(num_blocks, spec), generator=gen).to(dtype)
        slots = torch.randperm(num_blocks * block, generator=gen)[:tokens]
        slots[[2, 7]] = -1
        keys, values = (torch.randn(tokens, 2, head, generator=gen).to(dtype) for _ in range(2))
        expected = cache.clone()
        want_keys, want_values = unpacked_kv(expected, backend.isa)
        keep = slots >= 0
        want_keys[slots[keep] // block, :, slots[keep] % block] = keys[keep]
        want_values[slots[keep] // block, :, slots[keep] % block] = values[keep]
        backend.write_kv(keys, values, cache, slots)
        assert torch.equal(cache, expected), f"block {block} head {head} {dtype} ({backend.isa})"


@needs_vllm
def test_a_plan_made_under_another_thread_count_still_serves(one_thread):
    case = make_case("mixed", make_layer(128, 4), 32, torch.float32, 11)
    backend = VllmCpuAttentionBackend(case.layer, case.cache_spec())
    torch.set_num_threads(2)
    plan = backend.plan(case.batch)
    torch.set_num_threads(1)
    assert mismatch(run_step(backend, case, "cpu", plan=plan), oracle(case), case) is None


class ContextOneShort(VllmCpuAttentionBackend):
    """Planted adapter bug: hands the kernel every sequence one token shorter (an
    off-by-one between context and sequence lengths)."""

    def plan(self, batch) -> VllmCpuPlan:
        plan = super().plan(batch)
        seq_lens = plan.seq_lens - 1
        return VllmCpuPlan(plan.query_start_loc, seq_lens, plan.block_table,
                           self.scheduler_metadata(plan.query_start_loc, seq_lens), plan.threads)


@needs_vllm
@pytest.mark.usefixtures("one_thread")
def test_a_planted_off_by_one_in_the_lengths_passed_is_caught():
    planted = Target(ContextOneShort, "cpu", reduced=True)
    case = make_case("decode", make_layer(64, 4), 16, torch.float32, 3, reduced=True)
    assert check_case(TARGET, case) is None
    problem = check_case(planted, case)
    assert problem is not None and "relative error" in problem, problem


@needs_vllm
@pytest.mark.parametrize("query_len, context_len", [(1, 37), (9, 0)], ids=["decode", "prefill"])
def test_benchmark_times_it_over_the_same_data_in_its_own_layout(query_len, context_len, one_thread):
    # bench_attention writes the workload into vllm_cpu's layout with its write_kv; the
    # side-by-side figures mean something only if that is the same data cpp reads in NHD.
    from kvforge.benchmarks.bench_attention import Shape, backend_call, registry, workload

    shape = Shape("tiny", 3, context_len, query_len, 8, 2, 64, 32, torch.float32)
    w = workload(shape, "cpu", seed=3)
    ours = backend_call(VllmCpuAttentionBackend, w, "cpu")().clone()
    cpp = backend_call(registry().get(ATTENTION_BACKEND, "cpp").cls, w, "cpu")()
    torch.testing.assert_close(ours, cpp, rtol=1e-4, atol=1e-4)


@needs_vllm
def test_the_engine_generates_the_same_greedy_tokens_as_with_cpp():
    # Through the model's cache allocation (kv_cache_shape), prefix reuse and decode steps.
    from kvforge import LLM, SamplingParams

    prompts = [[1 + (7 * i + 3 * j) % 250 for j in range(3 + 9 * i)] for i in range(4)]  # 3..30 tokens
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def tokens(backend: str) -> list[list[int]]:
        llm = LLM("kvforge-tiny", device="cpu", dtype="float32", attention={"backend": backend},
                  cache={"block_size": 16, "num_blocks": 64})
        return [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=greedy)]

    assert tokens("vllm_cpu") == tokens("cpp")
