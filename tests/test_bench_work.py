"""The useful FLOPs a workload asks of a model (benchmarks/work.py): the closed
forms against a row-by-row count of the same definition, the matmul weights
against what transformers' own Llama executes, the attention pairs against the
prefill benchmark's convention and one decode step against the machine
benchmark's."""

from __future__ import annotations

import pytest
import torch

from kvforge.benchmarks import machine, prefill_attention, work

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 48, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 80, "num_hidden_layers": 3,
          "vocab_size": 96}


def counted_row_by_row(hf: dict, prompt: int, output: int) -> int:
    """The module doc's definition, one token row and one layer at a time."""
    h, heads, kv, d = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    q_o, key_value, mlp = 2 * h * heads * d, 2 * h * kv * d, 3 * h * hf["intermediate_size"]
    layers, total = hf["num_hidden_layers"], 0
    for position in range(prompt + output - 1):
        sampled = position >= prompt - 1
        for layer in range(layers):
            total += 2 * key_value
            if layer < layers - 1 or sampled:
                total += 2 * (q_o + mlp) + 4 * heads * d * (position + 1)
        if sampled:
            total += 2 * h * hf["vocab_size"]
    return total


@pytest.mark.parametrize("prompt,output", [(1, 1), (1, 5), (7, 1), (7, 4), (30, 9)])
def test_closed_form_matches_the_row_by_row_count(prompt, output):
    assert work.request_flops(CONFIG, prompt, output) == counted_row_by_row(CONFIG, prompt, output)


def test_the_row_by_row_check_tells_a_count_that_runs_the_last_layer_on_every_row():
    """A broken count (every layer on every row, as an engine without the
    output-rows plan executes) is off by exactly the last layer's skipped work."""
    prompt, output = 9, 3
    weights, key_value = work.layer_weights(CONFIG)
    rows = prompt + output - 1
    skipped_rows = rows - output
    skipped = (2 * (weights - key_value) * skipped_rows
               + work.attention_pair_flops(CONFIG) * skipped_rows * (skipped_rows + 1) // 2)
    assert work.request_flops(CONFIG, prompt, output) == counted_row_by_row(CONFIG, prompt, output)
    assert work.request_flops(CONFIG, prompt, output) + skipped != counted_row_by_row(CONFIG, prompt, output)
    assert work.request_flops(CONFIG, prompt, output) + skipped == full_model_count(CONFIG, prompt, output)


def full_model_count(hf: dict, prompt: int, output: int) -> int:
    """The broken variant: every layer on every row, logits on the sampled rows."""
    rows = prompt + output - 1
    layer = 2 * work.layer_weights(hf)[0] * rows + work.attention_pair_flops(hf) * rows * (rows + 1) // 2
    return hf["num_hidden_layers"] * layer + work.logits_flops(hf) * output


def test_every_layer_but_the_last_runs_causal_attention_as_the_prefill_benchmark_counts_it():
    prompt = 33
    layers = CONFIG["num_hidden_layers"]
    weights, key_value = work.layer_weights(CONFIG)
    causal = prefill_attention.prefill_flops([prompt], CONFIG["num_attention_heads"], CONFIG["head_dim"])
    last_row_only = 2 * (weights - key_value) + work.attention_pair_flops(CONFIG) * prompt
    expected = (layers - 1) * (2 * weights * prompt + causal) + 2 * key_value * prompt + last_row_only
    assert work.request_flops(CONFIG, prompt, 1) == expected + work.logits_flops(CONFIG)


def test_one_more_output_token_costs_one_decode_step():
    for prompt, output in [(5, 1), (12, 7)]:
        step = work.request_flops(CONFIG, prompt, output + 1) - work.request_flops(CONFIG, prompt, output)
        assert step == machine.decode_flops(CONFIG, 1, context=prompt + output)


def test_matmul_weights_are_the_ones_transformers_llama_multiplies():
    transformers = pytest.importorskip("transformers")
    from torch.utils.flop_counter import FlopCounterMode

    config = transformers.LlamaConfig(vocab_size=CONFIG["vocab_size"], hidden_size=CONFIG["hidden_size"],
                                      intermediate_size=CONFIG["intermediate_size"],
                                      num_hidden_layers=CONFIG["num_hidden_layers"],
                                      num_attention_heads=CONFIG["num_attention_heads"],
                                      num_key_value_heads=CONFIG["num_key_value_heads"], head_dim=CONFIG["head_dim"],
                                      max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    tokens = 11
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(torch.arange(tokens).unsqueeze(0), logits_to_keep=1)
    matmuls = sum(flops for op, flops in counter.get_flop_counts()["Global"].items() if "mm" in str(op))
    weights, _ = work.layer_weights(config.to_dict())
    assert matmuls == 2 * weights * tokens * CONFIG["num_hidden_layers"] + work.logits_flops(config.to_dict())


def test_a_run_sums_its_requests_by_id_and_refuses_an_empty_prompt():
    records = [{"id": "a", "output_tokens": 3}, {"id": "b", "output_tokens": 1}, {"id": "c", "output_tokens": 0}]
    total = work.run_flops(CONFIG, {"a": 4, "b": 9, "c": 2}, records)
    assert total == work.request_flops(CONFIG, 4, 3) + work.request_flops(CONFIG, 9, 1)
    with pytest.raises(ValueError, match="at least one prompt and one output token"):
        work.request_flops(CONFIG, 0, 2)


def test_the_report_puts_useful_gflops_beside_a_float32_gemm_peak_only():
    from kvforge.benchmarks import report

    summary = {"scenario": "s", "status": "ok", "runs": [
        {"label": "kvforge", "status": "ok",
         "metrics": {"tokens_per_s": 1.0, "ttft_p50_s": None, "ttft_p99_s": None, "tpot_p50_s": None,
                     "tpot_p99_s": None, "peak_kv_mib": None, "useful_gflops": 88.0}}]}
    assert "| 88.0 (80%) |" in "\n".join(report.scenario_section(summary, peak_gflops=110.0))
    assert "| 88.0 |" in "\n".join(report.scenario_section(summary))


def test_only_the_llama_family_with_full_attention_is_counted():
    assert work.counts(CONFIG)
    assert work.counts({**CONFIG, "architectures": ["Qwen3ForCausalLM"], "sliding_window": None})
    assert not work.counts({"architectures": ["GPT2LMHeadModel"], "n_embd": 48, "n_layer": 2})
    assert not work.counts({**CONFIG, "architectures": ["MistralForCausalLM"], "sliding_window": 4096})
    assert not work.counts({**CONFIG, "architectures": []})
