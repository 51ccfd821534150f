"""Run a kvforge CausalLM over a paged cache without an engine.

Not an engine: a fixed set of sequences, each with its own fixed block table,
stepped by hand. It builds the `AttentionBatch` and slot mapping the way an
engine would, so model tests and model-level benchmarks (teacher-forced logits,
quality of a quantized cache) need nothing from `kvforge.engine`.
"""

from __future__ import annotations

import torch

from kvforge.core import AttentionBatch, cdiv


class PagedDriver:
    """Steps `num_seqs` sequences of up to `max_len` tokens through `model`.

    Blocks are assigned contiguously, or in a shuffled order with `permute=True`
    (physical block ids then bear no relation to logical order)."""

    def __init__(self, model, block_size: int, num_seqs: int, max_len: int, permute: bool = False, seed: int = 0):
        self.model = model
        self.block_size = block_size
        per_seq = cdiv(max_len, block_size)
        num_blocks = num_seqs * per_seq + 2  # two spare blocks that no sequence uses
        order = torch.arange(num_blocks)
        if permute:
            order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
        self.block_table = order[: num_seqs * per_seq].view(num_seqs, per_seq).to(torch.int32)
        self.kv_caches = model.allocate_kv_cache(num_blocks, block_size)
        self.lens = torch.zeros(num_seqs, dtype=torch.int64)

    def inputs(self, new_tokens: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        """(input_ids, positions, batch) of a step feeding each sequence its new tokens;
        a sequence given none is left out of the batch, as an engine would."""
        active = torch.tensor([b for b, t in enumerate(new_tokens) if t], dtype=torch.int64)
        query_lens = torch.tensor([len(new_tokens[b]) for b in active.tolist()], dtype=torch.int64)
        rows = torch.repeat_interleave(torch.arange(len(active)), query_lens)  # batch row of each token
        starts = torch.zeros(len(active) + 1, dtype=torch.int64)
        torch.cumsum(query_lens, 0, out=starts[1:])
        context = self.lens[active]
        positions = context[rows] + torch.arange(int(starts[-1])) - starts[:-1][rows]
        table = self.block_table[active]
        blocks = table[rows, positions // self.block_size].to(torch.int64)
        seq_lens = context + query_lens
        batch = AttentionBatch(
            query_start_loc=starts.to(torch.int32),
            seq_lens=seq_lens.to(torch.int32),
            context_lens=context.to(torch.int32),
            block_table=table,
            slot_mapping=blocks * self.block_size + positions % self.block_size,
            block_size=self.block_size,
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
        )
        input_ids = torch.tensor([t for tokens in new_tokens for t in tokens], dtype=torch.int64)
        return input_ids, positions, batch

    def step(self, new_tokens: list[list[int]]) -> list[torch.Tensor]:
        """Feed each sequence its new tokens; float32 logits of every new token, per sequence.

        A sequence given no tokens is left out of the step's batch, as an engine would."""
        input_ids, positions, batch = self.inputs(new_tokens)
        with torch.no_grad():
            hidden = self.model.forward(input_ids, positions, self.kv_caches, self.model.plan(batch))
            logits = self.model.compute_logits(hidden)
        self.advance(new_tokens)
        split = iter(logits.split([len(t) for t in new_tokens if t]))
        return [next(split) if t else logits[:0] for t in new_tokens]

    def advance(self, new_tokens: list[list[int]]) -> None:
        """Count the tokens a step fed as cached."""
        self.lens += torch.tensor([len(t) for t in new_tokens], dtype=torch.int64)

    def greedy(self, prompts: list[list[int]], new_tokens: int, chunk: int | None = None):
        """Prefill (in chunks of `chunk` tokens when given), then decode greedily.

        Returns (prompt logits per sequence, decode logits `[seqs, new_tokens, vocab]`, ids `[seqs, new_tokens]`)."""
        prompt_logits = [[] for _ in prompts]
        longest = max(len(p) for p in prompts)
        size = chunk or longest
        for begin in range(0, longest, size):
            for b, logits in enumerate(self.step([p[begin:begin + size] for p in prompts])):
                prompt_logits[b].append(logits)
        prompt_logits = [torch.cat(parts) for parts in prompt_logits]
        last = torch.stack([logits[-1] for logits in prompt_logits])
        decode_logits, ids = [], []
        for _ in range(new_tokens):
            decode_logits.append(last)
            next_ids = last.argmax(-1)
            ids.append(next_ids)
            last = torch.stack([logits[0] for logits in self.step([[int(i)] for i in next_ids])])
        return prompt_logits, torch.stack(decode_logits, 1), torch.stack(ids, 1)
