"""Conformance of every `attention_backend`'s declarations (guarantee 1 of
`kvforge.core.AttentionBackend`): every configuration outside its declared
devices, dtypes, head sizes, block sizes and features is refused by
`unsupported_reasons`, and its constructor raises `UnsupportedConfigurationError`
with those same reasons instead of computing anything."""

import json

import pytest
import torch

from kvforge.core import ALIBI, ATTENTION_BACKEND, LOGIT_SOFT_CAP, SLIDING_WINDOW, AttentionLayerSpec, KVCacheSpec
from kvforge.core import PER_TENSOR, PER_TOKEN, SelectionRequest, UnsupportedConfigurationError, attention_request
from kvforge.conformance.attention_cases import target
from kvforge.conformance.attention_cases import one_thread  # noqa: F401 (a fixture, used below)

KIND = ATTENTION_BACKEND
GROUP = "refusal"
pytestmark = pytest.mark.usefixtures("one_thread")
PROBE_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
PROBE_HEAD_SIZES = (32, 64, 72, 80, 96, 128, 192, 256)
PROBE_BLOCK_SIZES = (1, 8, 16, 32, 64)
PROBE_FEATURES = (SLIDING_WINDOW, LOGIT_SOFT_CAP, ALIBI)


def probes(tgt):
    """(what varies, layer, cache spec, device, declared?) around a declared baseline."""
    head, block, dtype = tgt.head_sizes()[0], tgt.block_sizes()[0], tgt.dtypes()[0]
    base = AttentionLayerSpec(8, 2, head)
    cls = tgt.cls
    for probe in PROBE_DTYPES:
        yield f"dtype {probe}", base, KVCacheSpec(block, 2, head, probe), tgt.device, probe in cls.dtypes
    for probe in PROBE_HEAD_SIZES:
        layer = AttentionLayerSpec(8, 2, probe)
        yield (f"head size {probe}", layer, KVCacheSpec(block, 2, probe, dtype), tgt.device,
               cls.head_sizes is None or probe in cls.head_sizes)
    for probe in PROBE_BLOCK_SIZES:
        yield (f"block size {probe}", base, KVCacheSpec(probe, 2, head, dtype), tgt.device,
               cls.block_sizes is None or probe in cls.block_sizes)
    options = {SLIDING_WINDOW: {"sliding_window": 4}, LOGIT_SOFT_CAP: {"logit_soft_cap": 30.0},
               ALIBI: {"alibi_slopes": tuple(0.5 ** (h + 1) for h in range(8))}}
    for feature in PROBE_FEATURES:
        layer = AttentionLayerSpec(8, 2, head, **options[feature])
        yield f"feature {feature}", layer, KVCacheSpec(block, 2, head, dtype), tgt.device, feature in cls.features
    for device in ("cpu", "cuda"):
        yield f"device {device}", base, KVCacheSpec(block, 2, head, dtype), device, device in cls.devices
    yield "6 query heads over 4 KV heads", AttentionLayerSpec(6, 4, head), KVCacheSpec(block, 4, head, dtype), \
        tgt.device, False


def request_for(layer, spec, device):
    return attention_request([layer], device, spec.dtype, block_size=spec.block_size)


def test_undeclared_configurations_are_refused_with_reasons(registration):
    tgt = target(registration)
    problems = []
    for what, layer, spec, device, declared in probes(tgt):
        reasons = tgt.cls.unsupported_reasons(request_for(layer, spec, device))
        if declared:
            continue
        if not reasons:
            problems.append(f"{what} is not declared, yet unsupported_reasons() gives no reason to refuse it")
            continue
        try:
            tgt.cls(layer, spec, device)
        except UnsupportedConfigurationError as exc:
            missing = [r for r in reasons if r not in str(exc)]
            if missing:
                problems.append(f"{what}: constructor's message {str(exc)!r} lacks the reasons {missing}")
        else:
            problems.append(f"{what}: refused by unsupported_reasons ({'; '.join(reasons)}) but constructed")
    assert not problems, "\n".join(problems)


def test_declared_configurations_are_accepted(registration):
    tgt = target(registration)
    problems = []
    for what, layer, spec, device, declared in probes(tgt):
        if not declared or device != tgt.device:
            continue
        reasons = tgt.cls.unsupported_reasons(request_for(layer, spec, device))
        if reasons:
            continue  # a narrower rule than the declarations; refusing is always allowed
        try:
            tgt.cls(layer, spec, device)
        except UnsupportedConfigurationError as exc:
            problems.append(f"{what}: unsupported_reasons() accepts it but the constructor refused: {exc}")
    assert not problems, "\n".join(problems)


def test_capabilities_are_plain_data(registration):
    capabilities = registration.cls.capabilities()
    json.dumps(capabilities)
    assert capabilities["kv_layout"] == registration.cls.kv_layout
    shape = registration.cls.kv_cache_shape(7, KVCacheSpec(16, 2, 64, torch.float32))
    assert shape[0] == 7, f"kv_cache_shape must put the block index first, got {shape}"


def test_forward_without_out_returns_a_fresh_tensor(registration):
    from kvforge.conformance.attention_cases import batch_to, make_case, make_layer, mismatch, oracle
    from kvforge.conformance.attention_cases import fresh_seed, prepared_cache

    tgt = target(registration)
    dtype, block_size = tgt.dtypes()[0], tgt.block_sizes()[0]
    case = make_case("decode", make_layer(tgt.head_sizes()[0], 1), block_size, dtype, fresh_seed(), reduced=True)
    if tgt.reasons(case.layer, block_size, dtype):
        pytest.skip(f"{tgt.name} refuses {case.label}")
    backend = tgt.cls(case.layer, case.cache_spec(), tgt.device)
    cache = prepared_cache(backend, case, tgt.device)
    batch = batch_to(case.batch, tgt.device)
    backend.write_kv(case.new_keys.to(tgt.device, dtype), case.new_values.to(tgt.device, dtype), cache,
                     batch.slot_mapping)
    out = backend.forward(case.query.to(tgt.device, dtype), cache, backend.plan(batch))
    assert out.device.type == torch.device(tgt.device).type
    problem = mismatch(out.cpu(), oracle(case), case)
    assert problem is None, problem


def test_undeclared_quantized_kv_dtypes_are_refused(registration):
    cls = registration.cls
    for storage in (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8):
        for granularity in (PER_TOKEN, PER_TENSOR):  # per-(token, KV head) scales, or static ones
            reasons = cls.unsupported_reasons(SelectionRequest(kv_storage_dtype=storage,
                                                               kv_scale_granularity=granularity))
            if storage in cls.quantized_kv_dtypes and granularity in cls.kv_scale_granularities:
                assert not reasons, (f"declares KV quantized to {storage} ({granularity} scales) yet refuses "
                                     f"it: {reasons}")
            else:
                assert reasons, (f"KV quantized to {storage} with {granularity} scales is not declared, "
                                 "yet nothing refuses it")
