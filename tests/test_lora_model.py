"""Multi-LoRA in the models: several adapters and the base model in one batch, each
row in its own slot, against transformers + peft.

Tiny random Llama (GQA, fused q/k/v) and GPT-2 (Conv1D) models, with random
adapters (non-zero B, scaled up until they change the greedy tokens), run
through the paged driver: a prefill of the prompts, then decode steps, every row
compared with a full forward pass of transformers with that row's adapter
(peft's `PeftModel`) or none. Float32 within relative error
max |kvforge - hf| / max |hf| <= 1e-4 (what test_model_parity holds the base
model to). bfloat16 is held loosely to the float32 reference: 0.25, since the
adapters are strong enough to make these tiny random models sensitive
(transformers' own bfloat16 run of the Llama adapter is 0.18 from its float32
one; a wrong adapter is off by more than 1). Int8 weights are compared by the
adapter's delta (see `test_int8_base_adds_the_adapters_delta`), within 5e-2.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvforge.core import QUANTIZER, ConfigError, build_registry
from kvforge.models import enable_lora, load_model, load_peft_adapter
from kvforge.models.cpp_linear import cpp_linear_unavailable
from kvforge.models.lora_layers import LoRALinear
from kvforge.models.packed_linear import onednn_unavailable

sys.path.insert(0, str(Path(__file__).parent))  # the test-local helpers sit beside this file
from lora_fixtures import TARGETS, VOCAB, reference_logits, save_adapter, save_base
from model_driver import PagedDriver

pytest.importorskip("peft")
from kvforge.backends.reference import ReferenceAttentionBackend  # noqa: E402

TOLERANCE = 1e-4
BF16_TOLERANCE = 0.25
INT8_DELTA_TOLERANCE = 5e-2  # the int8 rounding of the base moves the adapter's delta by about 1e-2 here
PROMPT_LENS = (5, 11, 17, 3)
DECODE = 3
ROW_SLOTS = (0, -1, 1, 0)  # each row's slot: adapter 0, the base, adapter 1, adapter 0 again
MAX_RANK = 8


def kernels(dtype: torch.dtype = torch.float32) -> list[str]:
    """The linear kernels that run `dtype` models here."""
    found = ["torch"]
    if onednn_unavailable(dtype, torch.device("cpu")) is None:
        found.append("onednn")
    if cpp_linear_unavailable(dtype, torch.device("cpu")) is None:
        found.append("cpp")
    return found


def lora_config(max_loras: int = 3, max_rank: int = MAX_RANK):
    """What load_model reads of the engine's LoRAConfig."""
    return types.SimpleNamespace(max_loras=max_loras, max_lora_rank=max_rank)


def relative_error(found: torch.Tensor, expected: torch.Tensor) -> float:
    return float((found - expected).abs().max() / expected.abs().max())


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def case(request, tmp_path_factory):
    """(arch, base dir, adapter dirs, sequences, reference logits per adapter (None: base))."""
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    base = save_base(arch, root / "base")
    few = TARGETS[arch][::2]  # another adapter targets fewer layers, at another rank, with rsLoRA
    adapters = [save_adapter(base, root / "a0", r=4, alpha=8, seed=1),
                save_adapter(base, root / "a1", r=MAX_RANK, alpha=4, target_modules=few, use_rslora=True, seed=2)]
    generator = torch.Generator().manual_seed(3)
    sequences = [torch.randint(0, VOCAB, (n + DECODE,), generator=generator).tolist() for n in PROMPT_LENS]
    references = {None: reference_logits(base, None, sequences)}
    for i, adapter in enumerate(adapters):
        references[i] = reference_logits(base, adapter, sequences)
        changed = sum(int((references[i][b].argmax(-1) != references[None][b].argmax(-1)).sum()) for b in range(4))
        assert changed > 0, "the adapter leaves every greedy token as it is: the test would prove nothing"
    return arch, base, adapters, sequences, references


def load(base, adapters, **kwargs):
    model = load_model(base, attention_backend=ReferenceAttentionBackend, lora=lora_config(), **kwargs)
    for slot, adapter in enumerate(adapters):
        model.lora.load(slot, load_peft_adapter(adapter, model, max_rank=MAX_RANK))
    return model


def run(model, sequences, row_slots, *, output_rows: bool = False, lora: bool = True) -> list[list[torch.Tensor]]:
    """Prefill then decode every sequence, row b with slot `row_slots[b]`; each row's
    logits per step (all its new tokens', or with `output_rows` its last one's,
    the last layer computing only those rows). `lora` False: `set_step(None)`."""
    driver = PagedDriver(model, block_size=16, num_seqs=len(sequences), max_len=64)
    steps = [[s[:n] for s, n in zip(sequences, PROMPT_LENS)]]
    steps += [[[s[n + i]] for s, n in zip(sequences, PROMPT_LENS)] for i in range(DECODE)]
    out: list[list[torch.Tensor]] = [[] for _ in sequences]
    for new_tokens in steps:
        input_ids, positions, batch = driver.inputs(new_tokens)
        lens = torch.tensor([len(t) for t in new_tokens])
        rows = torch.cumsum(lens, 0) - 1 if output_rows else None
        if hasattr(model, "lora"):
            model.lora.set_step(torch.repeat_interleave(torch.tensor(row_slots), lens) if lora else None, rows)
        with torch.no_grad():
            hidden = model.forward(input_ids, positions, driver.kv_caches, model.plan(batch, rows))
            logits = model.compute_logits(hidden)
        driver.advance(new_tokens)
        for b, part in enumerate(logits.split([1] * len(sequences) if output_rows else lens.tolist())):
            out[b].append(part)
    return out


def expected(references, sequences, row_slots, *, output_rows: bool = False) -> list[list[torch.Tensor]]:
    """The reference logits cut like `run`'s output."""
    out = []
    for b, (slot, n) in enumerate(zip(row_slots, PROMPT_LENS)):
        full = references[None if slot < 0 else slot][b]
        steps = [full[n - 1:n] if output_rows else full[:n]] + [full[n + i:n + i + 1] for i in range(DECODE)]
        out.append(steps)
    return out


def worst_error(found, wanted) -> float:
    return max(relative_error(f, w) for rows_f, rows_w in zip(found, wanted) for f, w in zip(rows_f, rows_w))


@pytest.mark.parametrize("kernel", kernels())
def test_adapters_and_base_rows_in_one_batch_match_peft(case, kernel):
    _, base, adapters, sequences, references = case
    model = load(base, adapters, linear_kernel=kernel)
    error = worst_error(run(model, sequences, ROW_SLOTS), expected(references, sequences, ROW_SLOTS))
    assert error <= TOLERANCE, f"{kernel}: relative error {error:.2e}"


def test_last_layer_on_output_rows_uses_those_rows_slots(case):
    _, base, adapters, sequences, references = case
    model = load(base, adapters, linear_kernel="torch")
    found = run(model, sequences, ROW_SLOTS, output_rows=True)
    error = worst_error(found, expected(references, sequences, ROW_SLOTS, output_rows=True))
    assert error <= TOLERANCE, f"relative error {error:.2e}"


def test_swapped_slots_fail_the_comparison(case):
    """The planted bug: two requests' slots swapped; the comparison must catch it."""
    _, base, adapters, sequences, references = case
    model = load(base, adapters, linear_kernel="torch")
    swapped = (1, -1, 0, 0)
    error = worst_error(run(model, sequences, swapped), expected(references, sequences, ROW_SLOTS))
    assert error > 100 * TOLERANCE


@pytest.mark.parametrize("kernel", kernels(torch.bfloat16))
def test_bfloat16_matches_peft_loosely(case, kernel):
    _, base, adapters, sequences, references = case
    model = load(base, adapters, linear_kernel=kernel, dtype=torch.bfloat16)
    found = [[part.float() for part in row] for row in run(model, sequences, ROW_SLOTS)]
    error = worst_error(found, expected(references, sequences, ROW_SLOTS))
    assert error <= BF16_TOLERANCE, f"bfloat16, {kernel}: relative error {error:.2e}"


@pytest.mark.parametrize("kernel", kernels())
def test_step_without_adapters_is_bit_identical_to_no_lora(case, kernel):
    arch, base, adapters, sequences, _ = case
    plain = load_model(base, attention_backend=ReferenceAttentionBackend, linear_kernel=kernel)
    with_lora = load(base, adapters, linear_kernel=kernel)
    found, wanted = run(with_lora, sequences, ROW_SLOTS, lora=False), run(plain, sequences, ROW_SLOTS)
    all_base = run(with_lora, sequences, (-1,) * len(sequences))
    if kernel == "cpp" and arch == "llama":
        # LoRA keeps gate and up apart (cpp_linear: CppGateUp would fuse SiLU(gate) x up past the
        # adapter's reach), so the MLP rounds in other places than the fused kernel: close, not equal.
        assert worst_error(found, wanted) <= TOLERANCE and worst_error(all_base, wanted) <= TOLERANCE
        return
    for rows_found, rows_base, rows_wanted in zip(found, all_base, wanted):
        for f, g, w in zip(rows_found, rows_base, rows_wanted):
            assert torch.equal(f, w) and torch.equal(g, w)


def test_step_without_adapters_does_not_call_add_lora(case, monkeypatch):
    _, base, adapters, sequences, _ = case
    model = load(base, adapters, linear_kernel="torch")
    calls = []
    monkeypatch.setattr("kvforge.models.lora_layers.add_lora", lambda *args: calls.append(args))
    run(model, sequences, ROW_SLOTS, lora=False)
    run(model, sequences, (-1,) * len(sequences))
    assert calls == []
    run(model, sequences, ROW_SLOTS)
    assert calls


@pytest.mark.parametrize("kernel", kernels())
def test_every_wrapped_layer_adds_its_adapters_update(case, kernel):
    """Layer by layer, against float64 from the adapter's own A and B: each part of a
    fused layer in its output columns, each token with its slot's update (rank
    padding, scale and part placement are what this checks)."""
    _, base, adapters, _, _ = case
    model = load(base, adapters, linear_kernel=kernel)
    loaded = [load_peft_adapter(a, model, max_rank=MAX_RANK) for a in adapters]
    slots = torch.tensor([0, 0, -1, 1, 1, 1, 0, -1])
    model.lora.set_step(slots)
    generator = torch.Generator().manual_seed(4)
    for path, layer in model.lora.layers.items():
        x = torch.randn(len(slots), layer.in_features, generator=generator)
        with torch.no_grad():
            delta = (layer(x) - layer.base(x)).double()
        want = torch.zeros_like(delta)
        for target in layer.parts:
            name = next(n for n, t in model.lora.targets.items() if t is target)
            cols = slice(target.out_start, target.out_start + target.out_features)
            for slot, adapter in enumerate(loaded):
                if name in adapter.weights:
                    a, b = (w.double() for w in adapter.weights[name])
                    rows = slots == slot
                    want[rows, cols] = x[rows].double() @ a.t() @ b.t() * adapter.scale
        assert torch.allclose(delta, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())), path


def test_packing_and_quantizing_replace_the_base_and_keep_the_wrapper(case):
    _, base, adapters, _, _ = case
    int8 = build_registry().select(QUANTIZER, "int8_weight").cls()
    model = load(base, adapters, weight_quantizer=int8, linear_kernel="torch")
    wrappers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    assert wrappers and all(type(w.base).__name__ == "Int8Linear" for w in wrappers)
    for kernel, kind in (("onednn", "PackedLinear"), ("cpp", "CppLinear")):
        if kernel in kernels():
            model = load(base, adapters, linear_kernel=kernel)
            wrappers = [m for m in model.modules() if isinstance(m, LoRALinear)]
            assert wrappers and all(type(w.base).__name__ == kind for w in wrappers), kernel


def test_int8_base_adds_the_adapters_delta(case):
    """An int8 base is not transformers' model, so its adapter is checked by its effect:
    (int8 + adapter) - int8 matches (hf + adapter) - hf within the int8 error."""
    _, base, adapters, sequences, references = case
    int8 = build_registry().select(QUANTIZER, "int8_weight").cls()
    model = load(base, adapters, weight_quantizer=int8, linear_kernel="torch")
    with_adapters = run(model, sequences, ROW_SLOTS)
    base_only = run(model, sequences, ROW_SLOTS, lora=False)
    wanted = expected(references, sequences, ROW_SLOTS)
    hf_base = expected(references, sequences, (-1,) * len(sequences))
    for b, slot in enumerate(ROW_SLOTS):
        found = torch.cat(with_adapters[b]) - torch.cat(base_only[b])
        delta = torch.cat(wanted[b]) - torch.cat(hf_base[b])
        if slot < 0:
            assert torch.equal(found, torch.zeros_like(found))
        else:
            assert relative_error(found, delta) <= INT8_DELTA_TOLERANCE, f"row {b}: {relative_error(found, delta):.2e}"


@settings(max_examples=3, deadline=None, derandomize=True, phases=(Phase.explicit, Phase.generate),
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_adapters_match_peft(case, tmp_path_factory, data):
    """Random rank, targets, alpha and rsLoRA, one adapter row beside a base row (no
    shrinking: each example saves an adapter and runs two models)."""
    arch, base, _, sequences, references = case
    rank = data.draw(st.integers(1, MAX_RANK), label="rank")
    targets = data.draw(st.lists(st.sampled_from(TARGETS[arch]), min_size=1, unique=True), label="targets")
    alpha = data.draw(st.floats(0.5, 32), label="alpha")
    rslora = data.draw(st.booleans(), label="rslora")
    adapter = save_adapter(base, tmp_path_factory.mktemp("random") / "a", r=rank, alpha=alpha,
                           target_modules=targets, use_rslora=rslora, seed=5)
    model = load_model(base, attention_backend=ReferenceAttentionBackend, linear_kernel="torch")
    enable_lora(model, max_loras=2, max_rank=MAX_RANK)
    model.lora.load(1, load_peft_adapter(adapter, model, max_rank=MAX_RANK))
    sequences = sequences[:2]
    references = {None: references[None][:2], 1: reference_logits(base, adapter, sequences)}
    row_slots = (1, -1)
    error = worst_error(run(model, sequences, row_slots), expected(references, sequences, row_slots))
    assert error <= TOLERANCE, f"{arch} r={rank} {targets} alpha={alpha} rslora={rslora}: {error:.2e}"


def test_patterns_and_layers_to_transform_match_peft(case, tmp_path):
    """Per-layer rank and alpha (rank_pattern, alpha_pattern) and an adapter on one layer only."""
    arch, base, _, sequences, references = case
    first, second = TARGETS[arch][0], TARGETS[arch][-1]
    adapter = save_adapter(base, tmp_path / "a", r=2, alpha=4, target_modules=[first, second],
                           rank_pattern={second: 6}, alpha_pattern={first: 12}, layers_to_transform=[1], seed=6)
    model = load(base, [adapter], linear_kernel="torch")
    references = {None: references[None], 0: reference_logits(base, adapter, sequences)}
    error = worst_error(run(model, sequences, ROW_SLOTS), expected(references, sequences, (0, -1, -1, 0)))
    assert error <= TOLERANCE, f"relative error {error:.2e}"


def test_lora_enabled_on_a_packed_model_wraps_the_packed_layers(case):
    """A model handed over already packed (enable_lora after load_model) serves adapters too."""
    if "onednn" not in kernels():
        pytest.skip("oneDNN is unavailable here")
    _, base, adapters, sequences, references = case
    model = load_model(base, attention_backend=ReferenceAttentionBackend, linear_kernel="onednn")
    enable_lora(model, max_loras=2, max_rank=MAX_RANK)
    for slot, adapter in enumerate(adapters):
        model.lora.load(slot, load_peft_adapter(adapter, model, max_rank=MAX_RANK))
    error = worst_error(run(model, sequences, ROW_SLOTS), expected(references, sequences, ROW_SLOTS))
    assert error <= TOLERANCE, f"relative error {error:.2e}"


def test_lora_after_the_cpp_gate_up_fusion_is_refused_with_what_to_do(case):
    arch, base, _, _, _ = case
    if arch != "llama" or "cpp" not in kernels():
        pytest.skip("only a Llama on the C++ kernels fuses gate and up")
    model = load_model(base, linear_kernel="cpp")
    with pytest.raises(ConfigError, match="load_model.*lora=.*linear_kernel 'torch' or 'onednn'"):
        enable_lora(model, max_loras=1, max_rank=MAX_RANK)


def test_slots_out_of_range_are_refused(case):
    _, base, adapters, _, _ = case
    model = load(base, adapters, linear_kernel="torch")
    for slots in ([0, 3], [-2, 0]):
        with pytest.raises(ConfigError, match=r"slots 0\.\.2, and -1 for the base model"):
            model.lora.set_step(torch.tensor(slots))
    with pytest.raises(ConfigError, match=r"slot 3 is out of range"):
        model.lora.clear(3)
