"""The work a workload asks of a model, counted from the model's config and each
request's lengths: the FLOPs any engine must do for it, however it runs them. A
run's useful GFLOP/s (these FLOPs over its elapsed time) can then stand beside
the machine's GEMM peak: how close an engine came to the compute bound.

Counting (useful FLOPs, the convention of benchmarks/prefill_attention.py):
* a matmul costs 2 FLOPs per weight per token row it is applied to;
* attention costs 4 * head_dim per query head per (query, key) pair the query
  sees (2 for q.k, 2 for p.v); the token at position p sees p + 1 keys;
* a request is computed from scratch: its prompt and every output token but the
  last pass through the layers (the last is sampled, never fed back);
* the last layer needs only its key and value projections on rows no one
  samples: the rest of it, and the logits, run on the sampled rows alone (one
  per output token; models/output_rows.py). An engine that runs the last layer
  on every prompt token does up to a layer's worth more than is counted;
* norms, rotary, activations, softmax and sampling are not counted (a few FLOPs
  per element, against thousands per row in the matmuls).

The count describes kvforge's Llama family (q, k, v and o projections, a gated
MLP of three matrices: every bench model) with full attention; `counts` says
whether it describes a model, and the bench reports no figure for one it does
not (GPT-2, a sliding window). Prefix caching skips work counted
here, so a cached run's figure counts the skipped work as done. Memory time
(decode reading the KV cache, small batches reading the weights) is not
counted: the compute bound is a bound, not a prediction.
"""

from __future__ import annotations


# The architectures of models/llama.py, whose layers the count below describes.
COUNTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def counts(hf_config: dict) -> bool:
    """Whether this module's count describes the model: a Llama-family decoder
    with full attention on every layer (no `sliding_window` set)."""
    return (any(name in COUNTED_ARCHITECTURES for name in hf_config.get("architectures") or [])
            and not hf_config.get("sliding_window"))


def layer_weights(hf_config: dict) -> tuple[int, int]:
    """(the weights of one decoder layer's matmuls, those of its key and value projections)."""
    hidden = hf_config["hidden_size"]
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads") or heads
    head = hf_config.get("head_dim") or hidden // heads
    key_value = 2 * hidden * kv_heads * head
    return 2 * hidden * heads * head + key_value + 3 * hidden * hf_config["intermediate_size"], key_value


def attention_pair_flops(hf_config: dict) -> int:
    """One layer's attention FLOPs for one (query token, key) pair, every query head."""
    heads = hf_config["num_attention_heads"]
    return 4 * heads * (hf_config.get("head_dim") or hf_config["hidden_size"] // heads)


def logits_flops(hf_config: dict) -> int:
    """The LM head's FLOPs for one sampled row."""
    return 2 * hf_config["hidden_size"] * hf_config["vocab_size"]


def request_flops(hf_config: dict, prompt_tokens: int, output_tokens: int) -> int:
    """Useful FLOPs of one request computed from scratch (see the module doc)."""
    if prompt_tokens < 1 or output_tokens < 1:
        raise ValueError(f"a request has at least one prompt and one output token, got {prompt_tokens} and "
                         f"{output_tokens}")
    layers = hf_config["num_hidden_layers"]
    weights, key_value = layer_weights(hf_config)
    pair = attention_pair_flops(hf_config)
    rows = prompt_tokens + output_tokens - 1  # token rows through the layers
    pairs = rows * (rows + 1) // 2  # keys seen, summed over positions 0 .. rows - 1
    # sampled rows: positions prompt_tokens - 1 .. rows - 1, seeing prompt_tokens .. rows keys
    sampled_pairs = (prompt_tokens + rows) * output_tokens // 2
    every_row = (layers - 1) * (2 * weights * rows + pair * pairs)
    last_layer = 2 * key_value * rows + 2 * (weights - key_value) * output_tokens + pair * sampled_pairs
    return every_row + last_layer + logits_flops(hf_config) * output_tokens


def run_flops(hf_config: dict, prompt_lengths: dict[str, int], records: list[dict]) -> int:
    """Useful FLOPs of a run: every request record (`id`, `output_tokens`) with
    its prompt length from `prompt_lengths`; records with no output did no counted work."""
    return sum(request_flops(hf_config, prompt_lengths[r["id"]], r["output_tokens"])
               for r in records if r["output_tokens"] > 0)
