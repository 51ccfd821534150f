"""Parity with transformers: every architecture, every CPU attention backend, paged.

Each architecture is built small and random from a transformers config, saved
with `save_pretrained`, loaded by kvforge, and compared in float32 with
transformers' own forward pass: prefill logits, step-by-step decode logits
(relative error = max |kvforge - hf| / max |hf| <= 1e-4) and greedy ids over 32
new tokens. The reference greedy ids come from repeated full forward passes of
the transformers model (no cache), so nothing of the KV-cache path is shared.
Prompts of 3, 17 and 37 tokens cross the 16- and 32-token block boundaries.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers

from kvforge.models import load_model
from kvforge.models.cpp_linear import cpp_linear_unavailable
from kvforge.models.packed_linear import LINEAR_KERNELS, onednn_unavailable

sys.path.insert(0, str(Path(__file__).parent))  # the test-local driver sits beside this file
from model_driver import PagedDriver, block_sizes_for, cpu_backends

NEW_TOKENS = 32
VOCAB = 128
PROMPT_LENS = (3, 17, 37)
TOLERANCE = 1e-4

SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
CONFIGS = {
    # Llama-3 rope scaling with a short original context, so the scaled bands matter.
    "llama": lambda: transformers.LlamaConfig(**SMALL, rope_scaling={
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}),
    # A 12-token window: shorter than two of the prompts.
    "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=12, head_dim=16),
    # Layer 0 full, layer 1 sliding: two layer specs, so two backend instances.
    "qwen2": lambda: transformers.Qwen2Config(**SMALL, tie_word_embeddings=True, use_sliding_window=True,
                                              sliding_window=12, max_window_layers=1),
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=32),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128),
}
BACKENDS = cpu_backends(torch.float32)


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Biases and norm weights start as zeros and ones; make them matter."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                noise = torch.randn(param.shape, generator=generator) * 0.1
                param.copy_(param + noise)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request, tmp_path_factory):
    """(architecture, saved model directory, prompts, reference logits and ids)."""
    arch = request.param
    torch.manual_seed(0)
    config = CONFIGS[arch]()
    config.eos_token_id = None  # never stop early
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    randomise(hf, seed=1)
    path = tmp_path_factory.mktemp(arch)
    hf.save_pretrained(path)
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in PROMPT_LENS]
    references = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(NEW_TOKENS):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            logits = hf(torch.tensor([ids[:-1]])).logits[0]
            references.append((logits, ids[len(prompt):]))
    return arch, path, prompts, references


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def check_parity(path, prompts, references, backend, block_size, permute=False, chunk=None, linear_kernel="auto"):
    model = load_model(path, dtype=torch.float32, device="cpu", attention_backend=backend, linear_kernel=linear_kernel)
    driver = PagedDriver(model, block_size, len(prompts), max(PROMPT_LENS) + NEW_TOKENS, permute=permute)
    prompt_logits, decode_logits, ids = driver.greedy(prompts, NEW_TOKENS, chunk=chunk)
    for b, (prompt, (ref_logits, ref_ids)) in enumerate(zip(prompts, references)):
        n = len(prompt)
        assert relative_error(prompt_logits[b], ref_logits[:n]) <= TOLERANCE, f"prefill logits of prompt {b}"
        assert relative_error(decode_logits[b], ref_logits[n - 1:]) <= TOLERANCE, f"decode logits of prompt {b}"
        assert ids[b].tolist() == ref_ids, f"greedy ids of prompt {b}"


@pytest.mark.parametrize("backend", BACKENDS, ids=[b.name for b in BACKENDS])
def test_matches_transformers_with_permuted_blocks_of_16(case, backend):
    _, path, prompts, references = case
    check_parity(path, prompts, references, backend, 16, permute=True)


@pytest.mark.parametrize("backend", BACKENDS, ids=[b.name for b in BACKENDS])
def test_matches_transformers_with_blocks_of_32_and_chunked_prefill(case, backend):
    _, path, prompts, references = case
    check_parity(path, prompts, references, backend, 32, chunk=13)


@pytest.mark.parametrize("backend", BACKENDS, ids=[b.name for b in BACKENDS])
def test_matches_transformers_with_blocks_of_1(case, backend):
    if 1 not in block_sizes_for(backend):
        pytest.skip(f"{backend.name} does not declare block size 1")
    _, path, prompts, references = case
    check_parity(path, prompts, references, backend, 1)


@pytest.mark.parametrize("linear_kernel", LINEAR_KERNELS)
def test_matches_transformers_with_every_linear_kernel(case, linear_kernel):
    if linear_kernel == "onednn" and onednn_unavailable(torch.float32, torch.device("cpu")):
        pytest.skip(onednn_unavailable(torch.float32, torch.device("cpu")))
    if linear_kernel == "cpp" and cpp_linear_unavailable(torch.float32, torch.device("cpu")):
        pytest.skip(cpp_linear_unavailable(torch.float32, torch.device("cpu")))
    _, path, prompts, references = case
    check_parity(path, prompts, references, BACKENDS[0], 16, permute=True, linear_kernel=linear_kernel)


BF16_TOLERANCE = 0.05  # relative error of bfloat16 logits against float32 transformers (8 significant bits)


@pytest.mark.parametrize("linear_kernel", ["torch", "cpp"])
def test_bfloat16_stays_within_tolerance_with_each_kernel(case, linear_kernel):
    """The model in bfloat16, against transformers in float32 on the prompts: with
    kvforge's C++ linears, RMSNorm and rotary ("cpp") no further from float32 than
    torch's bfloat16 path (which rounds after every op), and both within BF16_TOLERANCE."""
    if linear_kernel == "cpp" and cpp_linear_unavailable(torch.bfloat16, torch.device("cpu")):
        pytest.skip(cpp_linear_unavailable(torch.bfloat16, torch.device("cpu")))
    arch, path, prompts, references = case
    errors = {}
    for kernel in dict.fromkeys(["torch", linear_kernel]):
        model = load_model(path, dtype=torch.bfloat16, device="cpu", attention_backend=cpu_backends(torch.bfloat16)[0],
                           linear_kernel=kernel)
        driver = PagedDriver(model, 16, len(prompts), max(PROMPT_LENS) + 1)
        prompt_logits, _, _ = driver.greedy(prompts, 1)
        errors[kernel] = max(relative_error(prompt_logits[b].float(), ref_logits[:len(prompt)])
                             for b, (prompt, (ref_logits, _)) in enumerate(zip(prompts, references)))
    assert errors[linear_kernel] <= BF16_TOLERANCE, errors
    assert errors[linear_kernel] <= 1.5 * errors["torch"] + 1e-3, errors


def test_some_backend_is_available_on_cpu():
    assert BACKENDS, "no registered attention backend runs on CPU in float32; parity is untested"
