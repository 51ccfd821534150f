"""`kvforge generate` end to end on a built-in model."""

from __future__ import annotations

import io
import json

import pytest
import torch

from kvforge.cli import main
from kvforge.models import resolve_model_dir


def builtin(name: str) -> str:
    if not (resolve_model_dir(name) / "model.safetensors").is_file():
        pytest.skip(f"built-in model {name} is not shipped in this checkout yet")
    return name


MODEL = "kvforge-tiny-draft"
FAST = ["--set", "device='cpu'", "--set", "cache.num_blocks=64", "--max-tokens", "4", "--threads", "1"]


def test_jsonl_output_and_summary(capsys):
    assert main(["generate", "--model", builtin(MODEL), *FAST, "--jsonl", "Hello", "The cat"]) == 0
    captured = capsys.readouterr()
    records = [json.loads(line) for line in captured.out.splitlines()]
    assert [r["prompt"] for r in records] == ["Hello", "The cat"]
    assert all(len(r["token_ids"]) <= 4 and r["finish_reason"] in ("stop", "length") for r in records)
    assert "2 requests (0 errors)" in captured.err and "tokens/s" in captured.err and "TTFT p50" in captured.err


def test_prompts_from_a_file_and_streaming(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text('Hello\n\n{"prompt": "World"}\n')
    assert main(["generate", "--model", builtin(MODEL), *FAST, "--input", str(prompts), "--stream", "--jsonl",
                 "--seed", "3", "--temperature", "0.8"]) == 0
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {e["id"] for e in events} == {"0", "1"}
    assert sum(e["finished"] for e in events) == 2
    assert all(("selected" in e) == e["finished"] for e in events)  # once per request, on its last event


def test_prompts_from_stdin(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi there\n"))
    assert main(["generate", "--model", builtin(MODEL), *FAST, "--no-summary"]) == 0
    assert capsys.readouterr().err == ""


def test_invalid_setting_is_a_clear_error(capsys):
    assert main(["generate", "--model", builtin(MODEL), *FAST, "--temperature", "-1", "x"]) == 2
    assert "temperature must be >= 0" in capsys.readouterr().err


def test_without_model_it_generates_with_kvforge_tiny(capsys):
    builtin("kvforge-tiny")
    assert main(["generate", *FAST, "--jsonl", "--no-summary", "def main():"]) == 0
    [record] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert record["prompt"] == "def main():" and 1 <= len(record["token_ids"]) <= 4


def test_llm_applies_keyword_sections_over_a_config_object():
    from kvforge import LLM, EngineConfig, SamplingParams

    config = EngineConfig(device="cpu", cache={"num_blocks": 32, "block_size": 8}, seed=5)
    llm = LLM(builtin(MODEL), config=config, cache={"block_size": 4})
    assert (llm.config.cache.num_blocks, llm.config.cache.block_size, llm.config.seed) == (32, 4, 5)
    [out] = llm.generate("def f(", SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out.token_ids) == 3 and out.text == llm.tokenizer.decode(out.token_ids)


def test_embedding_example_runs(capsys):
    import runpy
    from pathlib import Path

    example = runpy.run_path(str(Path(__file__).parents[1] / "examples" / "embed_engine.py"))
    metrics = example["main"](builtin(MODEL))
    assert metrics["requests"] == 3 and metrics["aborted"] == 1 and metrics["finished"] == 2
    assert metrics["running"] == metrics["waiting"] == 0 and metrics["kv_usage"] == 0
    assert "[story] abort after" in capsys.readouterr().out


def test_generate_names_what_it_selected_on_stderr_and_in_each_record(capsys):
    assert main(["generate", "--model", builtin(MODEL), *FAST, "--jsonl", "-v", "Hello"]) == 0
    captured = capsys.readouterr()
    [record] = [json.loads(line) for line in captured.out.splitlines()]
    selected = record["selected"]
    assert set(selected) == {"attention_backend", "block_allocator", "scheduler_policy"}
    [line] = [line for line in captured.err.splitlines() if line.startswith("kvforge engine:")]
    assert line.startswith(f"kvforge engine: attention backend {selected['attention_backend']}, "
                           f"block allocator {selected['block_allocator']}, "
                           f"scheduler policy {selected['scheduler_policy']}")
    assert "device cpu, dtype float32, 64 KV blocks of 16 tokens" in line  # -v


def test_config_show_refuses_prefix_caching_with_an_allocator_without_it(capsys):
    assert main(["config", "show", "--set", "cache.allocator='nocache'"]) == 2
    assert "cache.enable_prefix_caching=false" in capsys.readouterr().err
    assert main(["config", "show", "--json", "--set", "cache.allocator='nocache'",
                 "--set", "cache.enable_prefix_caching=false"]) == 0
