"""The lora bench scenario: its runs (the base, LoRA on without adapters, 1/4/16
adapters at two ranks, vLLM the same), the adapters it writes (PEFT files kvforge
loads, one per seed), and a small run end to end through the harness in which
the adapters change what the model writes. No timing is asserted."""

from __future__ import annotations

import json

import pytest
import torch

from kvforge.benchmarks import harness, lora, scenarios
from kvforge.benchmarks.peers import lora_adapters
from kvforge.benchmarks.scenarios import Run, Scenario


def test_runs_cover_every_adapter_count_and_rank_on_both_engines():
    s = scenarios.build("lora", 512, quick=False)
    labels = {run.label: run for run in s.runs}
    for peer in ("kvforge", "vLLM CPU"):
        for count in lora.COUNTS:
            for rank in lora.RANKS:
                options = labels[lora.label(peer, count, rank)].options
                assert options["lora_adapters"] == {"count": count, "rank": rank}
    assert "lora_adapters" not in labels["kvforge LoRA on, no adapter"].options
    assert labels["kvforge LoRA on, no adapter"].options["lora"]["max_loras"] == max(lora.COUNTS)
    assert all(t.subject in labels and t.other in labels for t in s.targets)
    assert len(s.requests) == lora.BATCH and [r["lora_index"] for r in s.requests] == list(range(lora.BATCH))
    assert s.requests == scenarios.build("lora", 512, quick=False).requests


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> str:
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("lora-bench-model")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def test_adapters_are_peft_files_kvforge_loads_each_its_own(small_model):
    from kvforge.models import load_model
    from kvforge.models.lora_adapter import load_peft_adapter

    paths = lora_adapters.adapter_dirs(small_model, count=2, rank=4)
    assert paths == lora_adapters.adapter_dirs(small_model, count=2, rank=4)  # built once, then reused
    model = load_model(small_model, linear_kernel="torch")
    first, second = (load_peft_adapter(p, model, max_rank=4) for p in paths)
    assert first.fingerprint != second.fingerprint and first.rank == 4
    assert set(first.target_modules) == set(lora_adapters.TARGETS)
    assert json.loads((lora_adapters.Path(paths[0]) / "adapter_config.json").read_text())["r"] == 4


def test_adapter_runs_go_end_to_end_each_request_on_its_adapter(small_model, tmp_path):
    requests = [dict(scenarios.request(i, [3 + i, 4, 5, 6], 6), lora_index=i) for i in range(4)]
    lora_on = {"lora": {"max_loras": 2, "max_lora_rank": 4}, "cache": {"num_blocks": 64}}
    runs = [Run("base", "kvforge", {"cache": {"num_blocks": 64}}),
            Run("adapters", "kvforge", {**lora_on, "lora_adapters": {"count": 2, "rank": 4}})]
    summary = harness.run_scenario(Scenario("tiny-lora", requests, runs, "adapters"), small_model, tmp_path,
                                   peers=harness.peer_pythons(["transformers=none"]), kv_cache_gib=0.01,
                                   timeout=300, log=lambda line: None)
    assert [run["status"] for run in summary["runs"]] == ["ok", "ok"]
    tokens = [json.loads((tmp_path / "tiny-lora" / f"run{i}.json").read_text()) for i in range(2)]
    assert all(r["output_tokens"] == 6 for t in tokens for r in t["requests"])
    figures = tokens[1]["info"]["lora"]  # request i ran adapter i mod 2: two requests each, warm-up's too
    assert {name: f["generation_tokens"] for name, f in figures.items()} == {"adapter-0": 2 * 6 + 2 * 4,
                                                                             "adapter-1": 2 * 6 + 2 * 4}
    assert tokens[0]["info"]["lora"] == {}
