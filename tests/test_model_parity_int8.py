"""Models with int8 weights against transformers' float model.

Every architecture of tests/test_model_parity.py (small, random, saved, loaded
by kvforge with `weight_quantizer=int8_weight`) runs the reference sequences of
that test teacher-forced through the paged cache (prefill of the prompt, then
one token per step), and its logits are compared with transformers' float32
logits (relative error = max |kvforge - hf| / max |hf|).

int8 rounding is real error, so the yardstick is what weight quantization alone
costs: the same model with every quantized weight replaced, in float, by its
dequantized value `w_int8 * scale` (run through `F.linear`). Weight-only int8
(the default, `activations="none"`) is that very math in float32, so it must
match the yardstick within float32 rounding. W8A8 (`activations="int8"`) also
rounds its activations per token (see `quantized_linear`), so it may be off by
more, but by a bounded factor; a kernel with a wrong scale, a transposed weight
or a lost bias is off by orders of magnitude more. Measured on these models
(2026-11-30, untied heads quantized too): weight-dequantized error 0.10-1.5%,
W8A8 model 0.20-2.1% (ratio 1.3-2.0, GPT-2 the highest); top-1 agreement with
transformers 98-100% of positions.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from kvforge.core import QUANTIZER, build_registry
from kvforge.models import load_model
from kvforge.models.packed_linear import linear_weight
from kvforge.models.quantized_linear import Int8Linear

sys.path.insert(0, str(Path(__file__).parent))  # the test-local driver and the float parity cases
from model_driver import PagedDriver, cpu_backends
from test_model_parity import CONFIGS, NEW_TOKENS, PROMPT_LENS, VOCAB, randomise, relative_error

import transformers

INT8_WEIGHT = build_registry().select(QUANTIZER, "int8_weight").cls
BACKEND = cpu_backends(torch.float32)[0]
RATIO = 4.0  # W8A8 model error <= RATIO x weight-dequantized error (measured: at most 2.0)
# Weight-only: the same math as the yardstick, only summed in another order.
RATIO_WEIGHT_ONLY = 1.02
CEILING = 0.05  # and never above 5% of the largest logit
AGREEMENT = 0.9  # top-1 agreement with transformers, teacher-forced (measured: 0.98-1.0)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request, tmp_path_factory):
    """(architecture, model directory, full sequences, transformers' float logits per sequence)."""
    arch = request.param
    torch.manual_seed(0)
    config = CONFIGS[arch]()
    config.eos_token_id = None
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    randomise(hf, seed=1)
    path = tmp_path_factory.mktemp(arch + "-int8")
    hf.save_pretrained(path)
    generator = torch.Generator().manual_seed(2)
    sequences = [torch.randint(0, VOCAB, (n + NEW_TOKENS,), generator=generator).tolist() for n in PROMPT_LENS]
    with torch.no_grad():
        logits = [hf(torch.tensor([seq[:-1]])).logits[0] for seq in sequences]
    return arch, path, sequences, logits


def teacher_forced_logits(model, sequences) -> list[torch.Tensor]:
    """Logits of every position but the last: prompts prefilled, then one token per decode step."""
    driver = PagedDriver(model, 16, len(sequences), max(len(s) for s in sequences), permute=True)
    outputs = [list(rows) for rows in driver.step([seq[:n] for seq, n in zip(sequences, PROMPT_LENS)])]
    for t in range(NEW_TOKENS - 1):
        for out, rows in zip(outputs, driver.step([[seq[n + t]] for seq, n in zip(sequences, PROMPT_LENS)])):
            out.extend(rows)
    return [torch.stack(rows) for rows in outputs]


@torch.no_grad()
def dequantize_in_float(model: nn.Module, quantizer) -> None:
    """Replace every weight `quantize_linears` quantizes (every linear, an untied head,
    not the embedding) by `w_int8 * scale`, kept in float."""
    for module in model.modules():
        found = linear_weight(module)
        if found is None:
            continue
        weight = found[0]
        weight.copy_(quantizer.dequantize(quantizer.quantize(weight)))  # `weight` may be a transposed view


def errors(ours: list[torch.Tensor], refs: list[torch.Tensor]) -> tuple[float, float]:
    """(largest relative logit error over the sequences, top-1 agreement)."""
    error = max(relative_error(o, r) for o, r in zip(ours, refs))
    agree = torch.cat([(o.argmax(-1) == r.argmax(-1)) for o, r in zip(ours, refs)]).float().mean()
    return error, float(agree)


@pytest.mark.parametrize("activations", ["none", "int8"])
def test_int8_weights_stay_within_a_bounded_factor_of_weight_rounding(case, activations):
    arch, path, sequences, refs = case
    quantizer = INT8_WEIGHT()
    model = load_model(path, attention_backend=BACKEND, weight_quantizer=quantizer, weight_activations=activations)
    assert any(isinstance(m, Int8Linear) for m in model.modules())
    dequantized = load_model(path, attention_backend=BACKEND, linear_kernel="torch")
    dequantize_in_float(dequantized, quantizer)
    int8_error, agreement = errors(teacher_forced_logits(model, sequences), refs)
    float_error, _ = errors(teacher_forced_logits(dequantized, sequences), refs)
    print(f"{arch} {activations}: int8 {int8_error:.4f}, weight-dequantized {float_error:.4f}, "
          f"agreement {agreement:.3f}")
    assert 0 < float_error  # quantization changes something
    ratio = RATIO_WEIGHT_ONLY if activations == "none" else RATIO
    assert int8_error <= ratio * float_error, f"{arch}: int8 error {int8_error:.4f} vs dequantized {float_error:.4f}"
    assert int8_error <= CEILING
    assert agreement >= AGREEMENT


@pytest.mark.parametrize("kernel", ["_weight_only_gemm", "_int8_gemm"])
def test_the_check_catches_a_kernel_with_a_per_tensor_weight_scale(case, monkeypatch, kernel):
    """One scale for the whole weight (the largest channel's) instead of one per channel
    leaves the model far outside the bound: the check above can fail."""
    arch, path, sequences, refs = case
    if arch != "llama":
        pytest.skip("one architecture shows it")
    quantizer = INT8_WEIGHT()
    dequantized = load_model(path, attention_backend=BACKEND, linear_kernel="torch")
    dequantize_in_float(dequantized, quantizer)
    float_error, _ = errors(teacher_forced_logits(dequantized, sequences), refs)

    def per_tensor(self, x):
        out = Int8Linear._widened_gemm(self, x.float())
        return out / self.weight_scale * self.weight_scale.max()

    monkeypatch.setattr(Int8Linear, kernel, per_tensor)
    activations = "none" if kernel == "_weight_only_gemm" else "int8"
    broken = load_model(path, attention_backend=BACKEND, weight_quantizer=quantizer, weight_activations=activations)
    broken_error, _ = errors(teacher_forced_logits(broken, sequences), refs)
    assert broken_error > RATIO * float_error


@pytest.mark.parametrize("activations", ["none", "int8"])
def test_greedy_decoding_with_int8_weights_mostly_follows_transformers(case, activations):
    """Free-running greedy ids (the model's own tokens fed back) agree with the float
    model's: every first token, and at least 3/4 of 8 (measured: all 24 for four
    architectures, 23 for qwen3; small random models have close runner-ups, and
    after one flip the rest may diverge)."""
    arch, path, sequences, _ = case
    model = load_model(path, attention_backend=BACKEND, weight_quantizer=INT8_WEIGHT(),
                       weight_activations=activations)
    float_model = load_model(path, attention_backend=BACKEND)
    prompts = [seq[:n] for seq, n in zip(sequences, PROMPT_LENS)]
    ids = [PagedDriver(m, 16, 3, max(PROMPT_LENS) + 8).greedy(prompts, 8)[2] for m in (model, float_model)]
    assert bool((ids[0][:, 0] == ids[1][:, 0]).all()), f"{arch}: first tokens {ids[0][:, 0]} vs {ids[1][:, 0]}"
    assert float((ids[0] == ids[1]).float().mean()) >= 0.75, f"{arch}: {ids[0]} vs {ids[1]}"
