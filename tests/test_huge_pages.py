"""Weights and KV caches on 2 MiB pages (models/huge_pages.py): same values,
placed where the kernel was advised to use huge pages, nothing aliased."""

from __future__ import annotations

import gc
import mmap
import sys

import pytest
import torch

from kvforge.models.huge_pages import ALIGN, HUGE_PAGE, huge_page_bytes, on_huge_pages, zeros_on_huge_pages

pytestmark = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE") or not sys.platform.startswith("linux"),
                                reason="madvise(MADV_HUGEPAGE) is Linux only")


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address`."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_copies_keep_values_and_sit_on_advised_aligned_memory():
    tensors = [torch.randn(3, 1000), torch.arange(7, dtype=torch.int64), torch.randn(5, 16).bfloat16(),
               torch.randn(2, 3).t()]  # not contiguous: the copy is
    copies = on_huge_pages(tensors)
    assert copies[0].data_ptr() % HUGE_PAGE == 0
    for original, copy in zip(tensors, copies):
        assert copy.dtype == original.dtype and copy.shape == original.shape
        assert torch.equal(copy, original) and copy.is_contiguous()
        assert copy.data_ptr() % ALIGN == 0
        assert "hg" in vm_flags(copy.data_ptr())
    ends = [(c.data_ptr(), c.data_ptr() + c.nbytes) for c in copies]
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ends, ends[1:])), "copies overlap"


def test_copies_do_not_alias_the_originals_and_outlive_them():
    tensors = [torch.randn(64, 64) for _ in range(3)]
    expected = [t.clone() for t in tensors]
    copies = on_huge_pages(tensors)
    tensors[1].zero_()
    copies[0].add_(1)
    assert torch.equal(copies[1], expected[1])
    assert torch.equal(tensors[0], expected[0])
    del tensors
    gc.collect()
    assert torch.equal(copies[2], expected[2])  # the mapping lives as long as a view of it


def test_tensors_off_the_cpu_are_left_alone():
    tensors = [torch.empty(4, device="meta")]
    assert on_huge_pages(tensors) is tensors
    assert on_huge_pages([]) == []


def test_zeros_are_zero_separate_and_advised():
    shapes = [(3, 5, 7), (3, 5, 7), (1,)]
    caches = zeros_on_huge_pages(shapes, torch.float32)
    assert [tuple(c.shape) for c in caches] == shapes
    assert all(c.dtype == torch.float32 and not c.any() for c in caches)
    caches[0].fill_(1)
    assert not caches[1].any() and not caches[2].any()
    assert "hg" in vm_flags(caches[1].data_ptr())
    assert huge_page_bytes(0) is None


def test_model_weights_and_kv_cache_land_on_huge_pages(tmp_path):
    from kvforge.models import load_model
    from kvforge.models.cpp_linear import CppGateUp, CppLinear, cpp_linear_unavailable
    from tests.model_driver import cpu_backends, save_llama

    unavailable = cpp_linear_unavailable(torch.float32, torch.device("cpu"))
    if unavailable:
        pytest.skip(unavailable)
    model = load_model(save_llama(tmp_path, tied=False), dtype=torch.float32, linear_kernel="cpp",
                       attention_backend=cpu_backends()[0])
    packed = [m.packed for m in model.modules() if isinstance(m, (CppLinear, CppGateUp))]
    assert packed and all("hg" in vm_flags(p.data_ptr()) for p in packed)
    caches = model.allocate_kv_cache(4, 16)
    assert all("hg" in vm_flags(c.data_ptr()) and not c.any() for c in caches)


def test_int8_weights_land_on_huge_pages(tmp_path):
    from kvforge.models import load_model
    from kvforge.models.quantized_linear import Int8Linear, quantize_linears
    from kvforge.plugins.quantizers import Int8WeightQuantizer
    from tests.model_driver import cpu_backends, save_llama

    model = load_model(save_llama(tmp_path, tied=False), dtype=torch.float32, linear_kernel="torch",
                       attention_backend=cpu_backends()[0])
    assert quantize_linears(model, Int8WeightQuantizer()) > 0
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert all("hg" in vm_flags(m.weight_int8.data_ptr()) and m.weight_int8.dtype == torch.int8 for m in layers)
    assert all(m._buffers["weight_int8"] is m.weight_int8 for m in layers)  # still a buffer (state_dict, .to)


def test_int8_weights_are_placed_once_and_a_load_with_fused_gate_up_ends_placed(tmp_path):
    from kvforge.models import load_model
    from kvforge.models.quantized_linear import Int8GateUp, Int8Linear, place_on_huge_pages, quantize_linears
    from kvforge.plugins.quantizers import Int8WeightQuantizer
    from tests.model_driver import save_llama

    model = load_model(save_llama(tmp_path, tied=False), dtype=torch.float32, linear_kernel="torch")
    quantize_linears(model, Int8WeightQuantizer(), place=False)
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    on_heap = [m.weight_int8.data_ptr() for m in layers]
    assert len({m.weight_int8.untyped_storage().data_ptr() for m in layers}) == len(layers)  # not placed yet
    place_on_huge_pages(layers)
    placed = [m.weight_int8.data_ptr() for m in layers]
    assert placed != on_heap and all("hg" in vm_flags(p) for p in placed)
    assert placed == sorted(placed) and len({m.weight_int8.untyped_storage().data_ptr() for m in layers}) == 1
    place_on_huge_pages(layers)  # placed already: nothing moves (a move would hold two mappings at once)
    assert [m.weight_int8.data_ptr() for m in layers] == placed
    # load_model with int8 weights ends with every int8 weight in one mapping, in order: with the C++
    # kernels (gate and up fused into new weights after quantizing) and without
    for kernel in ("cpp", "torch"):
        loaded = load_model(save_llama(tmp_path / kernel, tied=False), dtype=torch.float32, linear_kernel=kernel,
                            weight_quantizer=Int8WeightQuantizer())
        assert any(isinstance(m, Int8GateUp) for m in loaded.modules()) == (kernel == "cpp")
        weights = [m.weight_int8 for m in loaded.modules() if isinstance(m, Int8Linear)]
        assert len({w.untyped_storage().data_ptr() for w in weights}) == 1
        assert all("hg" in vm_flags(w.data_ptr()) for w in weights)
        assert [w.data_ptr() for w in weights] == sorted(w.data_ptr() for w in weights)
