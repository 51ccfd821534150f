"""`plain-torch`: an attention backend in plain PyTorch, one SDPA call per step.

`plan` turns the ragged batch into a padded one, once per step: every sequence's
keys are gathered through the block table into `[num_seqs, max_seq_len]`, and its
new tokens into `[num_seqs, max_query_len]`, with a boolean mask that is causal
from each sequence's context length. Every layer then runs one batched
`scaled_dot_product_attention`. Padding costs memory on uneven batches; what it
buys is a backend short enough to read in one sitting.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvforge.core import AttentionBackend, AttentionBatch, quantized_kv_views


@dataclass(frozen=True)
class PaddedPlan:
    """Where each key and query of the padded batch comes from."""

    key_blocks: torch.Tensor  # int64 [num_seqs, max_seq_len]: physical block of each key position
    key_offsets: torch.Tensor  # int64 [num_seqs, max_seq_len]: its slot inside that block
    key_valid: torch.Tensor  # bool [num_seqs, max_seq_len]: position < seq_len
    mask: torch.Tensor  # bool [num_seqs, 1, max_query_len, max_seq_len]: which keys each query sees
    token_seq: torch.Tensor  # int64 [num_tokens]: the sequence of each flat query row
    token_index: torch.Tensor  # int64 [num_tokens]: its row inside that sequence's new tokens


class PlainTorchAttentionBackend(AttentionBackend):
    """Causal attention with grouped-query heads over the NHD paged cache, float or
    int8-quantized (`cache.kv_cache_dtype = int8` or `int4_unpacked`). Computes in
    float32. No sliding window, soft-cap or ALiBi: those layers are refused with
    the reason, and `reference` serves them."""

    name = "plain-torch"
    api_version = (1, 4)
    devices = frozenset({"cpu", "cuda"})
    quantized_kv_dtypes = frozenset({torch.int8})
    quantized_kv_note = "for an fp8 KV cache choose attention.backend=reference or sdpa"

    def plan(self, batch: AttentionBatch) -> PaddedPlan:
        device = batch.block_table.device
        block_size = batch.block_size
        positions = torch.arange(batch.max_seq_len, device=device)
        seq_lens, context_lens = batch.seq_lens.long(), batch.context_lens.long()
        columns = (positions // block_size).clamp_max(batch.block_table.shape[1] - 1)
        key_blocks = batch.block_table.long()[:, columns]  # [num_seqs, max_seq_len]
        key_offsets = (positions % block_size).expand_as(key_blocks)
        key_valid = positions < seq_lens[:, None]

        query_lens = batch.query_lens().long()
        token_seq = torch.repeat_interleave(torch.arange(batch.num_seqs, device=device), query_lens)
        token_index = torch.arange(batch.num_tokens, device=device) - batch.query_start_loc.long()[token_seq]
        query_pos = context_lens[:, None] + torch.arange(batch.max_query_len, device=device)  # [num_seqs, max_q]
        mask = key_valid[:, None, :] & (positions[None, None, :] <= query_pos[:, :, None])
        return PaddedPlan(key_blocks, key_offsets, key_valid, mask.unsqueeze(1), token_seq, token_index)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, plan: PaddedPlan,
                out: torch.Tensor | None = None) -> torch.Tensor:
        keys, values = self._gather(kv_cache, plan)  # [num_seqs, max_seq_len, kv_heads, head_size] float32
        num_seqs, max_query_len = plan.mask.shape[0], plan.mask.shape[2]
        padded = query.new_zeros(num_seqs, max_query_len, *query.shape[1:], dtype=torch.float32)
        padded[plan.token_seq, plan.token_index] = query.float()
        attended = F.scaled_dot_product_attention(
            padded.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=plan.mask,
            scale=self.layer.softmax_scale, enable_gqa=True)  # [num_seqs, heads, max_q, head_size]
        result = attended.transpose(1, 2)[plan.token_seq, plan.token_index]
        if out is None:
            return result.to(query.dtype)
        out.copy_(result)
        return out

    def _gather(self, kv_cache: torch.Tensor, plan: PaddedPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of every sequence's positions as float32. Positions past a
        sequence's end are zeroed, not just masked: they may point at blocks the
        sequence does not own, whose contents (even NaN) must not reach the output."""
        if self.cache.quantized:
            data, scales = quantized_kv_views(kv_cache, self.cache)
            pages = data[plan.key_blocks, :, plan.key_offsets].float()  # [seqs, len, 2, kv_heads, head_size]
            pages = pages * scales[plan.key_blocks, :, plan.key_offsets].unsqueeze(-1)
        else:
            pages = kv_cache[plan.key_blocks, :, plan.key_offsets].float()
        pages = torch.where(plan.key_valid[:, :, None, None, None], pages, 0.0)
        return pages[:, :, 0], pages[:, :, 1]
