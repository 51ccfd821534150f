"""`benchmarks/sampled_decode.py`: its decode table has every setting with its
ratio to greedy and to the tensor path, and that path really is the tensor ops
(no `sample_rows` call, sampled bursts pass by pass) and is undone after; its
draw table times both paths per vocabulary."""

import pytest
import torch

from kvforge.benchmarks import sampled_decode
from kvforge.benchmarks.model_dirs import model_dir
from kvforge.engine import decode_bursts, sampler
from kvforge.kernels import build

if build.missing_tools() and build.cached_library() is None:
    pytest.skip(f"kvforge's C++ library cannot be built here: {build.missing_tools()}", allow_module_level=True)


def test_the_tensor_path_leaves_out_the_kernel_and_is_undone():
    build.load()
    logits, u = torch.randn(1, 50), torch.rand(1, dtype=torch.float64)
    burst = decode_bursts.cpp_burst
    with sampled_decode.tensor_path():
        assert not sampler.compiled_sample_ready(logits, u)
        assert decode_bursts.cpp_burst is not burst
    assert sampler.compiled_sample_ready(logits, u) and decode_bursts.cpp_burst is burst


def test_the_decode_table_has_every_setting_against_greedy_and_the_tensor_path():
    rows = sampled_decode.decode_rows(str(model_dir("bench-llama-tiny")), "float32", tokens=20, repeats=1,
                                      with_tensor_path=True)
    assert [r["setting"] for r in rows] == list(sampled_decode.SETTINGS)
    assert rows[0]["x greedy"] == 1.0 and "x tensor" not in rows[0]
    assert all(r["tok/s"] > 0 and r["tensor tok/s"] > 0 and r["x tensor"] > 0 for r in rows[1:])
    table = sampled_decode.markdown(rows)
    assert table.count("\n") == len(rows) + 1 and "| top-p 0.95 |" in table


def test_the_draw_table_times_both_paths():
    rows = sampled_decode.draw_rows(repeats=1, vocabularies=(100,))
    assert len(rows) == len(sampled_decode.SETTINGS) - 2  # greedy and the penalised setting draw nothing apart
    assert all(r["sample_rows µs"] > 0 and r["tensor ops µs"] > 0 for r in rows)
