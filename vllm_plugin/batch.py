"""vLLM's per-step attention metadata as kvforge's `AttentionBatch`, and vLLM's
per-layer KV-cache tensor seen in a kvforge backend's own layout."""

from __future__ import annotations

import math

import torch

from kvforge.core import AttentionBatch, cdiv


def attention_batch(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                    slot_mapping: torch.Tensor, num_reqs: int, block_size: int) -> AttentionBatch:
    """The step's ragged batch from the fields of vLLM's `CommonAttentionMetadata`.

    vLLM may pad every one of them: rows past `num_reqs`, tokens past the last
    request's end (slot -1), block-table columns past the longest sequence, and
    entries past a sequence's own last block (0, -1 or stale ids). The batch keeps
    the real requests and tokens only, and zeroes every block-table entry past a
    sequence's last block, as kvforge's contract states."""
    query_start_loc = query_start_loc[:num_reqs + 1].to(device="cpu", dtype=torch.int32)
    seq_lens = seq_lens[:num_reqs].to(device="cpu", dtype=torch.int32)
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    num_tokens = int(query_start_loc[-1]) if num_reqs else 0
    max_seq_len = int(seq_lens.max()) if num_reqs else 0
    width = max(cdiv(max_seq_len, block_size), 1)
    table = block_table[:num_reqs, :width].to(device="cpu", dtype=torch.int32)
    if table.shape[1] < width:  # narrower than the longest sequence: vLLM's table is too short
        raise ValueError(f"block table of {block_table.shape[1]} columns cannot hold a sequence of {max_seq_len} "
                         f"tokens in blocks of {block_size}")
    used = torch.arange(width, dtype=torch.int32) < ((seq_lens + block_size - 1) // block_size)[:, None]
    return AttentionBatch(
        query_start_loc=query_start_loc, seq_lens=seq_lens, context_lens=seq_lens - query_lens,
        block_table=torch.where(used, table, torch.zeros((), dtype=torch.int32)),
        slot_mapping=slot_mapping[:num_tokens].to(device="cpu", dtype=torch.int64),
        block_size=block_size, max_query_len=int(query_lens.max()) if num_reqs else 0, max_seq_len=max_seq_len)


def cache_view(kv_cache: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """vLLM's per-layer cache (`[num_blocks, ...]`, one dense page of bytes per block)
    viewed as `shape`, a kvforge backend's `kv_cache_shape` for the same blocks: the
    same memory, read in the kvforge backend's layout. vLLM itself never reads the
    contents of a page, so the page's inner order is the backend's to choose."""
    page = math.prod(shape[1:])
    if kv_cache.shape[0] != shape[0] or kv_cache[0].numel() != page:
        raise ValueError(f"vLLM's KV cache {tuple(kv_cache.shape)} ({kv_cache[0].numel()} elements a block) does "
                         f"not hold the kvforge layout {shape} ({page} elements a block)")
    if kv_cache.is_contiguous():
        return kv_cache.view(shape)
    if not kv_cache[0].is_contiguous():
        raise ValueError(f"vLLM's KV cache {tuple(kv_cache.shape)} (strides {kv_cache.stride()}) does not keep "
                         "each block as one dense page; run with VLLM_KV_CACHE_LAYOUT unset (or LBHNC)")
    inner = torch.empty(shape[1:], device="meta").stride()
    return kv_cache.as_strided(shape, (kv_cache.stride(0), *inner))
