"""The C++ decoder stack (models/cpp_decoder_stack.py, kernels/decoder_stack.cpp)
against the per-layer Python path and transformers.

The stack calls the very C++ functions the per-layer ops run, so with the same
weights, cache and batch its hidden states, logits and KV caches must be
*bitwise* the per-layer path's: each test runs every step twice, once through
the stack and once through the Python layer loop (`decoder_stack` set aside), on
two caches with the same block tables, and compares with `torch.equal`. Steps
mix prefill chunks and decodes, with and without output rows (the engine's
"last layer computes the sampled rows only"), over small random Llama (GQA),
Mistral (sliding window), Qwen2 (biases, one full and one sliding layer: two
layer specs) and Qwen3 (q/k norm) models, in float32 and bfloat16, with float
and int8 weights (weight-only and W8A8).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers

from kvforge.backends.cpp.backend import CppAttentionBackend
from kvforge.core import QUANTIZER, build_registry
from kvforge.models import load_model
from kvforge.models.cpp_decoder_stack import CppDecoderStack, attach_decoder_stack
from kvforge.models.cpp_norms import use_cpp_norms
from kvforge.models.cpp_linear import cpp_linear_unavailable

sys.path.insert(0, str(Path(__file__).parent))  # the test-local driver and the parity cases
from model_driver import PagedDriver
from test_model_parity import NEW_TOKENS, PROMPT_LENS, TOLERANCE, VOCAB, case, randomise, relative_error  # noqa: F401

pytestmark = pytest.mark.skipif(cpp_linear_unavailable(torch.float32, torch.device("cpu")) is not None,
                                reason="kvforge's C++ library cannot be built here")

SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SMALL),
    "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=7, head_dim=16),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=7,
                                              max_window_layers=1),
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=32),
}
INT8_WEIGHT = build_registry().select(QUANTIZER, "int8_weight").cls
# (dtype, weight quantizer, activations)
WEIGHTS = {
    "float32": (torch.float32, None, "none"),
    "bfloat16": (torch.bfloat16, None, "none"),
    "int8-weight-only": (torch.float32, INT8_WEIGHT, "none"),
    "int8-w8a8": (torch.float32, INT8_WEIGHT, "int8"),
    "bf16-int8-weight-only": (torch.bfloat16, INT8_WEIGHT, "none"),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def saved(request, tmp_path_factory):
    """(architecture, directory) of a small random model with every norm and bias made to matter."""
    torch.manual_seed(0)
    config = CONFIGS[request.param]()
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    randomise(hf, seed=3)
    path = tmp_path_factory.mktemp(request.param + "-stack")
    hf.save_pretrained(path)
    return request.param, path


def load(path, weights: str, backend=CppAttentionBackend, **kwargs):
    dtype, quantizer, activations = WEIGHTS[weights]
    return load_model(path, dtype=dtype, attention_backend=backend, linear_kernel="cpp",
                      weight_quantizer=None if quantizer is None else quantizer(), weight_activations=activations,
                      **kwargs)


# Each step: new tokens per sequence (prompt chunks, then decodes, then a mix) and
# whether the step asks for the last token of each sequence only (output rows).
def steps(generator) -> list[tuple[list[list[int]], bool]]:
    def tokens(n):
        return torch.randint(0, VOCAB, (n,), generator=generator).tolist()
    return [
        ([tokens(9), tokens(3), []], False),  # prefill, one sequence waiting
        ([tokens(1), tokens(1), tokens(13)], True),  # two decodes and a prompt, sampled rows only
        ([tokens(1), tokens(1), tokens(1)], True),  # a decode batch
        ([tokens(1), [], []], True),  # batch 1
        ([tokens(1), tokens(5), tokens(1)], False),  # mixed, every row
        ([[], tokens(4), []], True),  # a chunk that samples its last row
    ]


def forward(model, driver, new_tokens, last_rows: bool) -> torch.Tensor:
    """One step's logits; with `last_rows` the model computes each sequence's last token only."""
    input_ids, positions, batch = driver.inputs(new_tokens)
    rows = None
    if last_rows:
        rows = (batch.query_start_loc[1:].to(torch.int64) - 1)
    with torch.no_grad():
        plan = model.plan(batch) if rows is None else model.plan(batch, rows)
        if model.decoder_stack is not None:  # it serves this step: the comparison is not the loop twice
            assert model.decoder_stack.refusal(plan) is None
        hidden = model.forward(input_ids, positions, driver.kv_caches, plan)
        logits = model.compute_logits(hidden)
    driver.advance(new_tokens)
    return logits


def run_both(model, seed=0, caches=lambda caches: caches):
    """Every step through the stack and through the Python loop; (stack logits, loop
    logits, stack caches, loop caches). `caches` may reorder what the stack is given."""
    stack = model.decoder_stack
    assert stack is not None, model.decoder_stack_reason
    with_stack, without = PagedDriver(model, 4, 3, 64), PagedDriver(model, 4, 3, 64)
    given = caches(with_stack.kv_caches)
    ours, theirs = [], []
    for new_tokens, last_rows in steps(torch.Generator().manual_seed(seed)):
        real = with_stack.kv_caches
        with_stack.kv_caches = given
        ours.append(forward(model, with_stack, new_tokens, last_rows))
        with_stack.kv_caches = real
        model.decoder_stack = None
        try:
            theirs.append(forward(model, without, new_tokens, last_rows))
        finally:
            model.decoder_stack = stack
    return ours, theirs, with_stack.kv_caches, without.kv_caches


@pytest.mark.parametrize("weights", sorted(WEIGHTS))
def test_stack_is_bitwise_the_per_layer_path(saved, weights):
    arch, path = saved
    model = load(path, weights)
    assert isinstance(model.decoder_stack, CppDecoderStack), model.decoder_stack_reason
    ours, theirs, our_caches, their_caches = run_both(model)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a.shape == b.shape and torch.equal(a, b), f"{arch} {weights}: logits of step {i} differ"
    for layer, (a, b) in enumerate(zip(our_caches, their_caches)):
        assert torch.equal(a, b), f"{arch} {weights}: KV cache of layer {layer} differs"


@pytest.mark.parametrize("level", ("baseline", "avx2"))
def test_the_stack_takes_the_level_set_when_it_is_called_and_pins_it_no_longer(saved, level, monkeypatch):
    """A forward reads the instruction-set cap once and holds it for its kernels:
    under each cap it is still bitwise the Python loop, whose ops read the cap
    one by one (the levels round differently: FMA or not), and once it returns
    the cap is read afresh."""
    arch, path = saved
    best = torch.ops.kvforge_cpp.isa()
    if level == "avx2" and best == "baseline":
        pytest.skip("this CPU runs baseline only")
    model = load(path, "float32")
    monkeypatch.setenv("KVFORGE_CPP_ISA", level)
    ours, theirs, _, _ = run_both(model)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), f"{arch} under {level}"
    monkeypatch.setenv("KVFORGE_CPP_ISA", "avx512")  # no cap below the CPU's best
    assert torch.ops.kvforge_cpp.isa() == best


def test_the_comparison_catches_a_stack_given_the_wrong_layers_cache(saved):
    """The same check, with every layer of the stack handed layer 0's cache: it must fail."""
    arch, path = saved
    model = load(path, "float32")
    ours, theirs, _, _ = run_both(model, caches=lambda caches: [caches[0]] * len(caches))
    assert not all(torch.equal(a, b) for a, b in zip(ours, theirs)), arch


def test_stack_matches_transformers(case):
    """The parity cases of test_model_parity.py (prefill and decode logits within its
    tolerance, the same greedy ids), with the stack on for the Llama family."""
    arch, path, prompts, references = case
    model = load_model(path, dtype=torch.float32, attention_backend=CppAttentionBackend, linear_kernel="cpp")
    if arch == "gpt2":
        assert model.decoder_stack is None and "not a Llama-family model" in model.decoder_stack_reason
        return
    assert model.decoder_stack is not None, model.decoder_stack_reason
    driver = PagedDriver(model, 16, len(prompts), max(PROMPT_LENS) + NEW_TOKENS, permute=True)
    prompt_logits, decode_logits, ids = driver.greedy(prompts, NEW_TOKENS)
    for b, (prompt, (ref_logits, ref_ids)) in enumerate(zip(prompts, references)):
        n = len(prompt)
        assert relative_error(prompt_logits[b], ref_logits[:n]) <= TOLERANCE, f"prefill logits of prompt {b}"
        assert relative_error(decode_logits[b], ref_logits[n - 1:]) <= TOLERANCE, f"decode logits of prompt {b}"
        assert ids[b].tolist() == ref_ids, f"greedy ids of prompt {b}"


class WholeShard:
    """A ModelShard that keeps everything: enough to tell the loader the model is one rank's part."""

    def weight_slices(self, model):
        return {}

    def apply(self, model):
        pass

    def lora_slices(self, model, slices):
        return {}


def test_stack_is_not_used_and_says_why(saved, monkeypatch):
    _, path = saved
    lora = load(path, "float32", lora=SimpleNamespace(max_loras=1, max_lora_rank=4))
    assert lora.decoder_stack is None and "LoRA" in lora.decoder_stack_reason
    sharded = load(path, "float32", shard=WholeShard())
    assert sharded.decoder_stack is None and "shard" in sharded.decoder_stack_reason
    torch_linears = load_model(path, dtype=torch.float32, attention_backend=CppAttentionBackend, linear_kernel="torch")
    assert torch_linears.decoder_stack is None and "C++ kernel" in torch_linears.decoder_stack_reason
    use_cpp_norms(torch_linears)  # C++ norms and rotary, torch linears
    attach_decoder_stack(torch_linears)
    assert torch_linears.decoder_stack is None
    assert "layer 0's qkv_proj is a Linear, not a C++ linear layer" in torch_linears.decoder_stack_reason
    clipped = load(path, "float32")  # an embedding that renormalises its rows is not a row lookup
    clipped.model.embed_tokens.max_norm = 1.0
    attach_decoder_stack(clipped)
    assert clipped.decoder_stack is None and "token embedding" in clipped.decoder_stack_reason
    monkeypatch.setenv("KVFORGE_DECODER_STACK", "off")
    off = load(path, "float32")
    assert off.decoder_stack is None and "KVFORGE_DECODER_STACK=off" in off.decoder_stack_reason


@pytest.mark.parametrize("other", ["sdpa", "int8 KV cache"])
def test_steps_the_stack_cannot_serve_run_the_python_layers(saved, other):
    """Another attention backend, or a quantized KV cache (both can change after load):
    the stack refuses the step, naming why, and the step runs in Python."""
    _, path = saved
    registry = build_registry()
    if other == "sdpa":
        from kvforge.core.api import ATTENTION_BACKEND

        model = load(path, "float32", backend=registry.select(ATTENTION_BACKEND, "sdpa").cls)
        expected = "attention backend 'sdpa'"
    else:
        model = load(path, "float32")
        model.set_kv_quantizer(registry.select(QUANTIZER, "int8").cls())
        expected = "quantized KV cache"
    stack = model.decoder_stack
    driver = PagedDriver(model, 4, 1, 32)
    _, _, batch = driver.inputs([[1, 2, 3]])
    assert expected in stack.refusal(model.plan(batch))
    calls = []
    model.decoder_stack = type("Spy", (), {"refusal": staticmethod(stack.refusal),
                                           "__call__": lambda self, *a: calls.append(a)})()
    input_ids, positions, batch = driver.inputs([[1, 2, 3]])
    with torch.no_grad():
        hidden = model.forward(input_ids, positions, driver.kv_caches, model.plan(batch))
    assert calls == [] and hidden.shape == (3, 64)
