"""The example third-party package under examples/ installs with pip and works
through entry points alone: one implementation of every kind, each discovered,
selectable by name, conformant, and generating through `kvforge.LLM`."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvforge import LLM, SamplingParams
from kvforge.core import KINDS, SCHEDULER_POLICY, RequestView, build_registry

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "kvforge-example-plugin"


@pytest.fixture(scope="module")
def installed_example(tmp_path_factory):
    target = tmp_path_factory.mktemp("example-site")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(EXAMPLE)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return target


def test_pip_installed_example_is_discovered_and_selectable(installed_example, monkeypatch):
    monkeypatch.syspath_prepend(str(installed_example))
    registry = build_registry(environ={})
    registration = registry.select(SCHEDULER_POLICY, "shortest-prompt")
    assert (registration.distribution, registration.version, registration.plugin) == ("kvforge-example-plugin", "0.1.0", "example")
    policy = registration.cls()
    long = RequestView("long", 0, 0.0, 0, num_prompt_tokens=500)
    short = RequestView("short", 0, 1.0, 1, num_prompt_tokens=5)
    assert sorted([long, short], key=policy.waiting_key) == [short, long]
    assert policy.choose_victim([short, long]) is long


NAMES = {"attention_backend": "plain-torch", "block_allocator": "free-stack", "scheduler_policy": "shortest-prompt",
         "quantizer": "int4_unpacked", "speculative_proposer": "last-follower", "structured_output": "choices"}
PER_ENGINE = [kind for kind in NAMES if kind not in ("quantizer", "structured_output")]
"""Kinds the engine selects once, by a config section (a quantizer is named as a KV cache dtype, a
structured_output backend per request)."""


def test_example_has_one_implementation_of_every_kind(installed_example, monkeypatch):
    monkeypatch.syspath_prepend(str(installed_example))
    registry = build_registry(environ={})
    for kind, name in NAMES.items():
        assert registry.select(kind, name).plugin == "example", kind
    assert set(NAMES) == set(KINDS)


def test_example_imports_nothing_of_kvforge_but_the_public_core():
    for path in (EXAMPLE / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            for module in modules:
                assert not module.startswith("kvforge") or module == "kvforge.core", f"{path.name} imports {module}"


def test_every_example_implementation_passes_the_shared_conformance_suite(installed_example, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(installed_example), "OMP_NUM_THREADS": "1"}
    plugins = [arg for name in NAMES.values() for arg in ("--plugin", name)]
    result = subprocess.run([sys.executable, "-m", "kvforge", "conformance", *plugins,
                             "--report", "report.json"],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads((tmp_path / "report.json").read_text())["results"]
    for kind, name in NAMES.items():
        mine = [r for r in rows if r["implementation"] == name]
        assert mine and all(r["kind"] == kind for r in mine), name
        assert any(r["status"] == "pass" for r in mine), name
        for r in mine:
            assert r["status"] == "pass" or (r["status"] in ("skipped", "n/a") and r["skip_reasons"]), r


PROMPTS = ["the cat sat on the mat. the cat sat on the", "def f(x):\n    return x\ndef g(x):\n    return"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def generate_with(installed_example):
    """Greedy token ids of PROMPTS on kvforge-tiny under config sections, with the
    example installed, and the implementations the engine says it selected."""
    def generate(**sections):
        with pytest.MonkeyPatch.context() as patch:
            patch.syspath_prepend(str(installed_example))
            llm = LLM("kvforge-tiny", device="cpu", dtype="float32", **sections)
        outputs = llm.generate(PROMPTS, GREEDY)
        return [o.outputs[0].token_ids for o in outputs], llm.engine.selected, llm.engine.metrics()
    return generate


def test_generates_with_each_example_implementation_selected_by_name(generate_with):
    cache = {"block_size": 4, "num_blocks": 64}
    expected, _, _ = generate_with(attention={"backend": "reference"}, cache=cache)
    got, selected, metrics = generate_with(
        attention={"backend": "plain-torch"}, cache={**cache, "allocator": "free-stack", "enable_prefix_caching": False},
        scheduler={"policy": "shortest-prompt"}, speculative={"proposer": "last-follower", "num_tokens": 3})
    assert {k: selected[k] for k in PER_ENGINE} == {k: NAMES[k] for k in PER_ENGINE}
    # Exact attention, any allocator and policy, and verified drafts leave greedy output unchanged.
    assert got == expected and all(len(tokens) == GREEDY.max_tokens for tokens in got)
    assert metrics["spec_accepted_tokens"] > 0  # the repetitive prompts let last-follower guess right


def test_generates_with_the_example_quantizer_as_the_kv_cache_dtype(generate_with):
    cache = {"block_size": 4, "num_blocks": 64, "kv_cache_dtype": "int4_unpacked"}
    got, selected, _ = generate_with(attention={"backend": "plain-torch"}, cache=cache)
    assert selected["kv_quantizer"] == "int4_unpacked" and selected["attention_backend"] == "plain-torch"
    # Both backends attend over the same dequantized int4 keys and values: same greedy tokens.
    expected, _, _ = generate_with(attention={"backend": "reference"}, cache=cache)
    assert got == expected and all(len(tokens) == GREEDY.max_tokens for tokens in got)


def test_last_follower_drafts_what_followed_the_last_occurrence(installed_example, monkeypatch):
    # Conformance only proves proposals are well-formed; this proves they are the documented guesses.
    monkeypatch.syspath_prepend(str(installed_example))
    from kvforge.core import ConfigError, ProposalRequest, SPECULATIVE_PROPOSER

    cls = build_registry(environ={}).select(SPECULATIVE_PROPOSER, "last-follower").cls
    requests = [ProposalRequest("a", [5, 6, 7, 5, 8, 9, 5]), ProposalRequest("b", [1, 2, 3]), ProposalRequest("c", [])]
    # 5 was last followed by 8, then 8 by 9, then 9 by 5: the chain repeats the earlier span.
    assert [p.token_ids for p in cls().propose(requests, 3)] == [[8, 9, 5], [], []]
    assert [p.token_ids for p in cls(window=3).propose(requests[:1], 3)] == [[]]  # only [8, 9, 5] searched
    with pytest.raises(ConfigError, match="valid options: window"):
        cls(windw=3)


def test_the_example_and_the_plugin_guides_use_the_current_api_version(installed_example, monkeypatch):
    from kvforge.core import API_VERSION

    monkeypatch.syspath_prepend(str(installed_example))
    registry = build_registry(environ={})
    example = [r for r in registry.implementations() if r.plugin == "example"]
    assert example and all(r.api_version == API_VERSION for r in example)
    docs = Path(__file__).resolve().parents[1] / "docs"
    current = ".".join(map(str, API_VERSION))
    for page in ("writing_plugins.md", "conformance.md"):
        assert f"**{current}**" in (docs / page).read_text(), f"{page} does not state the current API version"
    guide = (docs / "writing_plugins.md").read_text()
    assert guide.count("api_version = (") == guide.count(f"api_version = {API_VERSION}")


def test_choices_allows_exactly_the_bytes_that_continue_a_choice(installed_example, monkeypatch):
    # Conformance walks prove the guarantees; this proves the masks are the documented ones.
    monkeypatch.syspath_prepend(str(installed_example))
    import torch

    from kvforge.core import STRUCTURED_OUTPUT, StructuredOutputError, StructuredOutputSpec, Vocabulary

    vocabulary = Vocabulary(tuple(bytes([i]) for i in range(256)) + (b"", b"ab"), (256,), 300)
    backend = build_registry(environ={}).select(STRUCTURED_OUTPUT, "choices").cls(vocabulary)
    grammar = backend.compile(StructuredOutputSpec("choice", ("ab", "abc", "b")))
    bitmask = backend.allocate_bitmask(1)

    def allowed():
        grammar.fill_bitmask(bitmask, 0)
        bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        return torch.nonzero(bits.flatten()).flatten().tolist()

    assert allowed() == [ord("a"), ord("b"), 257]  # "a", "b" and the two-byte token "ab"
    assert grammar.accept_tokens([257]) and allowed() == [ord("c"), 256]  # "ab" is a choice: EOS, or "c"
    assert not grammar.accept_tokens([ord("c"), ord("c")]) and allowed() == [ord("c"), 256]
    assert grammar.validate_tokens([ord("c"), 256, ord("x")]) == 2
    assert grammar.accept_tokens([256]) and grammar.is_terminated() and allowed() == []
    grammar.rollback(2)
    assert allowed() == [ord("a"), ord("b"), 257] and not grammar.is_terminated()
    with pytest.raises(StructuredOutputError, match="does not compile 'json'"):
        backend.compile(StructuredOutputSpec("json", "{}"))
