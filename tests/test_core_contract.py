"""The core is self-contained and its shared helpers are right."""

import ast
from pathlib import Path

import torch

from kvforge.core import INTERFACES, KINDS, AttentionBatch, KVCacheSpec, paged_csr

CORE = Path(__file__).resolve().parents[1] / "core"


def test_core_imports_nothing_else_from_the_project():
    for path in CORE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                assert not node.module.startswith("kvforge") or node.module.startswith("kvforge.core"), (path, node.module)
            if isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.startswith("kvforge") or alias.name.startswith("kvforge.core"), (path, alias.name)


def test_every_kind_has_an_interface_that_names_it():
    assert set(INTERFACES) == set(KINDS)
    for kind, interface in INTERFACES.items():
        assert interface.kind == kind
        assert "Guarantees" in (interface.__doc__ or ""), f"{interface.__name__} must state its guarantees"


def test_paged_csr_lists_each_sequences_blocks_in_order():
    block_size = 4
    seq_lens = torch.tensor([5, 4, 1, 9], dtype=torch.int32)
    table = torch.tensor([[7, 2, 0], [3, 0, 0], [9, 0, 0], [1, 6, 8]], dtype=torch.int32)
    csr = paged_csr(table, seq_lens, block_size)
    assert csr.indptr.tolist() == [0, 2, 3, 4, 7]
    assert csr.indices.tolist() == [7, 2, 3, 9, 1, 6, 8]
    assert csr.last_page_len.tolist() == [1, 4, 1, 1]


def test_attention_batch_csr_view_uses_the_same_derivation():
    batch = AttentionBatch(
        query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32), seq_lens=torch.tensor([3, 6], dtype=torch.int32),
        context_lens=torch.tensor([0, 5], dtype=torch.int32), block_table=torch.tensor([[4, 0], [2, 5]], dtype=torch.int32),
        slot_mapping=torch.arange(4), block_size=4, max_query_len=3, max_seq_len=6)
    assert batch.query_lens().tolist() == [3, 1]
    assert batch.csr_view().indices.tolist() == [4, 2, 5]
    assert (batch.num_seqs, batch.num_tokens) == (2, 4)


def test_kv_cache_spec_counts_keys_values_and_layers():
    spec = KVCacheSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, num_layers=3)
    assert spec.bytes_per_block() == 2 * 16 * 2 * 64 * 2 * 3


def test_kv_views_reads_the_nhd_layout_and_asks_other_layouts_to_say_how():
    from kvforge.backends.reference import ReferenceAttentionBackend
    from kvforge.core import AttentionLayerSpec

    spec = KVCacheSpec(4, 2, 8, torch.float32)
    backend = ReferenceAttentionBackend(AttentionLayerSpec(4, 2, 8), spec)
    cache = torch.zeros(ReferenceAttentionBackend.kv_cache_shape(3, spec))
    key, value = torch.randn(1, 2, 8), torch.randn(1, 2, 8)
    backend.write_kv(key, value, cache, torch.tensor([6]))  # block 1, offset 2
    keys, values = backend.kv_views(cache)
    assert keys.shape == values.shape == (3, 4, 2, 8)
    assert torch.equal(keys[1, 2], key[0]) and torch.equal(values[1, 2], value[0])
    assert keys.count_nonzero() == key.count_nonzero()

    class OwnLayout(ReferenceAttentionBackend):
        kv_layout = "mine"

    try:
        OwnLayout(AttentionLayerSpec(4, 2, 8), spec).kv_views(cache)
    except NotImplementedError as exc:
        assert "override kv_views" in str(exc)
    else:
        raise AssertionError("a backend with its own layout must say how to read it")


def _head_major(wrong_write: bool):
    """A backend keeping its cache `[num_blocks, 2, num_kv_heads, block_size, head_size]`, read
    through `kv_views`; with `wrong_write`, its write forgets the layout and stores NHD-ordered."""
    from kvforge.backends.reference import ReferenceAttentionBackend

    class HeadMajor(ReferenceAttentionBackend):
        kv_layout = "head_major"

        @classmethod
        def kv_cache_shape(cls, num_blocks, cache):
            return (num_blocks, 2, cache.num_kv_heads, cache.block_size, cache.head_size)

        def kv_views(self, kv_cache):
            return kv_cache[:, 0].transpose(1, 2), kv_cache[:, 1].transpose(1, 2)

        def write_kv(self, key, value, kv_cache, slot_mapping):
            if wrong_write:
                flat = kv_cache.view(kv_cache.shape[0], 2, kv_cache.shape[3], kv_cache.shape[2], kv_cache.shape[4])
                super().write_kv(key, value, flat, slot_mapping)
                return
            keys, values = self.kv_views(kv_cache)
            keep = slot_mapping >= 0
            blocks, offsets = slot_mapping[keep] // keys.shape[1], slot_mapping[keep] % keys.shape[1]
            keys[blocks, offsets] = key[keep].to(keys.dtype)
            values[blocks, offsets] = value[keep].to(values.dtype)

    return HeadMajor


def test_the_kv_write_check_reads_an_own_layout_through_kv_views_and_catches_a_wrong_write():
    import types

    from kvforge.conformance.check_attention_kv_write import write_once

    for wrong_write, fails in ((False, False), (True, True)):
        tgt = types.SimpleNamespace(cls=_head_major(wrong_write), device="cpu")
        problems = [write_once(tgt, torch.float32, block_size, 32, seed, skipped=1)
                    for seed, block_size in enumerate((4, 16))]
        assert any(problems) == fails, problems
