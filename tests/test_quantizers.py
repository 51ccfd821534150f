"""The built-in absmax quantizers `fp8_e4m3`, `fp8_e5m2`, `int8` and `int8_weight`:
what they do beyond the interface (the shared guarantees are checked by
kvforge.conformance), and how close they come to their declared bounds. The
static-scale ones are tests/test_quantizers_static_scale.py's."""

import json
import os
import subprocess
import sys

import pytest
import torch

from kvforge.core import PER_CHANNEL, PER_TOKEN, QUANTIZER, build_registry

BUILTINS = {  # name: (storage dtype, granularity, format max, worst error / group max, declared bound)
    "fp8_e4m3": (torch.float8_e4m3fn, PER_TOKEN, 448.0, 16 / 448, 2.0 ** -4),
    "fp8_e5m2": (torch.float8_e5m2, PER_TOKEN, 57344.0, 4096 / 57344, 2.0 ** -3),
    "int8": (torch.int8, PER_TOKEN, 127.0, 0.5 / 127, 1 / 252),
    "int8_weight": (torch.int8, PER_CHANNEL, 127.0, 0.5 / 127, 1 / 252),
}


STATIC_SCALE = ("fp8_e4m3_per_tensor", "fp8_e5m2_per_tensor")


def quantizer(name):
    return build_registry(environ={}).select(QUANTIZER, name).cls()


def test_builtins_register_through_the_quantizers_entry_point_with_their_formats():
    registry = build_registry(environ={})
    assert sorted(registry.names(QUANTIZER)) == sorted([*BUILTINS, *STATIC_SCALE])
    for name, (storage, granularity, _, _, bound) in BUILTINS.items():
        registration = registry.get(QUANTIZER, name)
        assert (registration.plugin, registration.distribution) == ("quantizers", "kvforge")
        cls = registration.cls
        assert (cls.storage_dtype, cls.granularity, cls.error_bound) == (storage, granularity, bound)


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_each_group_max_maps_to_the_format_max_and_nothing_beyond(name):
    storage, _, format_max, _, _ = BUILTINS[name]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=gen) * 10.0 ** torch.empty(64, 1).uniform_(-3, 4, generator=gen)
    codes = quantizer(name).quantize(x).data.float()
    peak = x.abs().argmax(dim=-1, keepdim=True)
    assert torch.equal(codes.gather(-1, peak), format_max * x.gather(-1, peak).sign())
    assert float(codes.abs().max()) == format_max  # int8 never spends -128: the range stays symmetric


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_zero_groups_get_scale_one_and_tiny_groups_the_smallest_normal(name):
    x = torch.zeros(3, 8)
    x[1] = 1e-44  # its exact scale (1e-44 / format max) underflows float32
    x[2] = 1.0
    scale = quantizer(name).quantize(x).scale.reshape(-1)
    assert scale[0] == 1.0 and scale[1] == torch.finfo(torch.float32).tiny and scale[2] == 1.0 / BUILTINS[name][2]


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_measured_worst_error_reaches_the_format_half_step_and_stays_under_the_bound(name):
    """The worst error relative to the group max is half a step at the top of the
    format's range: 1/254 for int8; 16/448 for e4m3 and 4096/57344 for e5m2 (half
    an ulp of the top binade over the format max). Dense random data comes within
    10% of it, so the bound is not met by luck, and never exceeds the declared bound."""
    _, _, _, worst, bound = BUILTINS[name]
    gen = torch.Generator().manual_seed(1)
    x = torch.rand(512, 128, generator=gen, dtype=torch.float64) * 2 - 1
    x[:, 0] = 1.0  # every group max is 1: the error is then relative to it
    x = x.float()
    q = quantizer(name)
    measured = float((q.dequantize(q.quantize(x)).double() - x.double()).abs().max())
    assert 0.9 * worst <= measured <= worst * (1 + 1e-4) < bound  # 1e-4: float32 rounding of x / scale


def test_kvforge_plugins_shows_each_quantizer_format_and_whether_it_serves_the_kv_cache(tmp_path):
    env = {**os.environ, "COLUMNS": "200"}
    table = subprocess.run([sys.executable, "-m", "kvforge", "plugins"], capture_output=True, text=True, env=env,
                           cwd=tmp_path, timeout=120)
    assert table.returncode == 0, table.stderr
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in table.stdout.split("quantizers")[-1].splitlines() if line.count("│") == 6}
    assert rows == {
        "fp8_e4m3": ["float8_e4m3fn", "per_token", "0.0625", "yes"],
        "fp8_e5m2": ["float8_e5m2", "per_token", "0.125", "yes"],
        "int8": ["int8", "per_token", "0.00397", "yes"],
        "int8_weight": ["int8", "per_channel", "0.00397", "no"],
        "fp8_e4m3_per_tensor": ["float8_e4m3fn", "per_tensor", "0.0625", "yes"],
        "fp8_e5m2_per_tensor": ["float8_e5m2", "per_tensor", "0.125", "yes"],
    }
    listed = subprocess.run([sys.executable, "-m", "kvforge", "plugins", "--json"], capture_output=True, text=True,
                            env=env, cwd=tmp_path, timeout=120)
    capabilities = {i["name"]: i["capabilities"] for i in json.loads(listed.stdout)["implementations"]
                    if i["kind"] == QUANTIZER}
    assert capabilities["int8_weight"] == {"storage_dtype": "int8", "granularity": "per_channel",
                                           "error_bound": 1 / 252, "static_scale": False, "kv_capable": False}
