"""One fact in one place: the ceiling division, the dtype-name table, the backend
selection request built from layers and the pool checks' shared state each have one
definition, and the modules that use them do not import each other in a circle
(issue #14)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvforge.core import SLIDING_WINDOW, FLOAT_DTYPES, AttentionLayerSpec, EngineConfig, KVCacheSpec, attention_request
from kvforge.core.config import CacheConfig
from kvforge.engine import cache_sizing, components
from kvforge.models import loader

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("core", "engine", "models", "backends", "plugins", "conformance", "benchmarks", "serving", "kvforge",
               "tests", "examples")


def python_sources():
    for folder in SOURCE_DIRS:
        yield from (path for path in (ROOT / folder).rglob("*.py") if path.resolve() != Path(__file__).resolve())


def offenders(pattern: re.Pattern, allowed: set[str]) -> list[str]:
    found = []
    for path in python_sources():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            where = f"{path.relative_to(ROOT)}:{number}"
            if pattern.search(line) and str(path.relative_to(ROOT)) not in allowed:
                found.append(f"{where}: {line.strip()}")
    return found


def test_no_hand_written_ceiling_division_outside_cdiv():
    found = offenders(re.compile(r"-\(-"), allowed={"core/kv_cache.py"})
    assert not found, "use kvforge.core.cdiv instead of -(-a // b):\n" + "\n".join(found)


def test_no_name_to_dtype_table_outside_core_config():
    found = offenders(re.compile(r"""["']bfloat16["']\s*:\s*torch\.bfloat16"""), allowed={"core/config.py"})
    assert not found, "import kvforge.core.FLOAT_DTYPES instead of another name -> dtype table:\n" + "\n".join(found)


@pytest.mark.parametrize("name", list(FLOAT_DTYPES))
def test_every_place_that_reads_a_dtype_name_reads_the_same_table(name):
    dtype = FLOAT_DTYPES[name]
    assert components.resolve_dtype(EngineConfig(dtype=name), torch.device("cpu")) is dtype
    assert loader.resolve_dtype(name, loader.ModelConfig({})) is dtype
    spec = cache_sizing.cache_spec(CacheConfig(kv_cache_dtype=name), KVCacheSpec(16, 2, 8, torch.float32))
    assert spec.dtype is dtype


def test_engine_config_accepts_exactly_the_table_names():
    for name in FLOAT_DTYPES:
        assert EngineConfig(dtype=name).dtype == name
    with pytest.raises(ValueError, match="float32"):
        EngineConfig(dtype="float64")


def test_pool_machine_and_pool_checks_do_not_import_each_other():
    """Importing either must not drag in the other (and the checks must not import
    hypothesis, which the runner loads only once pytest starts)."""
    code = ("import sys; import kvforge.conformance.pool_machine; "
            "assert 'kvforge.conformance.check_block_allocator_pool' not in sys.modules, 'machine imports checks'; "
            "del sys.modules['kvforge.conformance.pool_machine']; "
            "[sys.modules.pop(m) for m in list(sys.modules) if m.startswith('hypothesis')]; "
            "import kvforge.conformance.check_block_allocator_pool; "
            "assert 'kvforge.conformance.pool_machine' not in sys.modules, 'checks import machine'; "
            "assert not any(m.startswith('hypothesis') for m in sys.modules), 'checks import hypothesis'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_attention_request_takes_the_shape_from_the_first_layer_and_features_from_all():
    layers = [AttentionLayerSpec(8, 2, 64), AttentionLayerSpec(8, 2, 64, sliding_window=4)]
    request = attention_request(layers, "cpu", torch.float16, block_size=16, kv_storage_dtype=torch.int8)
    assert (request.device, request.dtype, request.block_size, request.kv_storage_dtype) == \
        ("cpu", torch.float16, 16, torch.int8)
    assert (request.num_heads, request.num_kv_heads, request.head_size) == (8, 2, 64)
    assert request.features == {SLIDING_WINDOW}
    unknown = attention_request([], "cuda", None)
    assert (unknown.num_heads, unknown.head_size, unknown.features) == (None, None, frozenset())


def test_no_selection_request_is_built_from_layer_fields_outside_attention_request():
    pattern = re.compile(r"SelectionRequest\([^)]*\.head_size")
    found = [str(path.relative_to(ROOT)) for path in python_sources()
             if pattern.search(path.read_text()) and str(path.relative_to(ROOT)) != "core/attention.py"]
    assert not found, "build the request with kvforge.core.attention_request: " + ", ".join(found)


def test_no_dtype_is_named_outside_dtype_name():
    """`str(dtype).removeprefix("torch.")` is `kvforge.core.dtype_name`, written once."""
    found = offenders(re.compile(r"""str\([^)]*\)\.removeprefix\(["']torch\.["']\)"""), allowed={"core/dtypes.py"})
    assert not found, "use kvforge.core.dtype_name instead:\n" + "\n".join(found)


def test_every_allocator_check_uses_the_one_pool_shape():
    found = offenders(re.compile(r"^(NUM_BLOCKS|BLOCK_SIZE) = "), allowed={"conformance/pool_snapshot.py"})
    found = [line for line in found if line.startswith("conformance/check_block_allocator_")]
    assert not found, "import the pool shape from kvforge.conformance.pool_snapshot:\n" + "\n".join(found)
