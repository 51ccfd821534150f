"""A tiny fake CausalLM that keeps the models contract faithfully, for engine tests.

Each token's value is `embed[token] + pos[position]`, written to the paged cache
through the batch's slot mapping; the hidden state of position `p` is the mean
of the values at positions `0..p` read back through the block table. So any
mistake in positions, slots, block tables, copy-on-write or recomputation
changes the logits. `reference_greedy` computes the same function without any
cache, one prompt at a time.
"""

from __future__ import annotations

import pytest
import torch

from kvforge.core import AttentionBatch, EngineConfig, KVCacheSpec
from kvforge.engine.llm_engine import LLMEngine


class FakeCausalLM(torch.nn.Module):
    def __init__(self, vocab_size: int = 48, hidden: int = 8, max_model_len: int = 256, seed: int = 0,
                 eos_token_id: int | None = None):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.hidden = hidden
        self.embed = torch.randn(vocab_size, hidden, generator=g)
        self.pos = torch.randn(max_model_len, hidden, generator=g) * 0.5
        self.head = torch.randn(hidden, vocab_size, generator=g) * 3
        self.plans = 0

    def kv_cache_spec(self, block_size: int) -> KVCacheSpec:
        return KVCacheSpec(block_size, 1, self.hidden, torch.float32, num_layers=2)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        return [torch.zeros(num_blocks, 2, block_size, 1, self.hidden) for _ in range(2)]

    def plan(self, batch: AttentionBatch) -> AttentionBatch:
        self.plans += 1
        return batch

    def forward(self, input_ids, positions, kv_caches, plan: AttentionBatch) -> torch.Tensor:
        assert input_ids.shape == positions.shape == plan.slot_mapping.shape
        values = self.embed[input_ids] + self.pos[positions]
        hidden = values
        for cache in kv_caches:  # two "layers", each reading only its own cache
            hidden = self._layer(hidden, values, cache, plan)
        return hidden

    def _layer(self, hidden, values, cache, batch: AttentionBatch) -> torch.Tensor:
        size = batch.block_size
        slots = batch.slot_mapping
        cache[slots // size, 1, slots % size, 0] = values
        out = torch.empty_like(hidden)
        starts = batch.query_start_loc.tolist()
        for b, seq_len in enumerate(batch.seq_lens.tolist()):
            positions = torch.arange(seq_len)
            table = batch.block_table[b, positions // size].long()
            cached = cache[table, 1, positions % size, 0]  # [seq_len, hidden]
            mean = cached.cumsum(0) / torch.arange(1, seq_len + 1).unsqueeze(1)
            query_len = starts[b + 1] - starts[b]
            out[starts[b]:starts[b + 1]] = torch.tanh(mean[seq_len - query_len:] + hidden[starts[b]:starts[b + 1]])
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.head).float()

    def reference_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits of every position of one sequence, without any cache."""
        ids = torch.tensor(token_ids)
        values = self.embed[ids] + self.pos[torch.arange(len(ids))]
        mean = values.cumsum(0) / torch.arange(1, len(ids) + 1).unsqueeze(1)
        hidden = torch.tanh(mean + values)
        hidden = torch.tanh(mean + hidden)
        return self.compute_logits(hidden)


def reference_greedy(model: FakeCausalLM, prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        next_token = int(model.reference_logits(tokens)[-1].argmax())
        tokens.append(next_token)
        if next_token == model.eos_token_id:
            break
    return tokens[len(prompt):]


def fake_engine(model: FakeCausalLM | None = None, *, num_blocks: int = 64, block_size: int = 4,
                max_num_seqs: int = 8, max_num_batched_tokens: int = 32, policy: str = "fcfs",
                prefix_caching: bool = True, seed: int = 0, tokenizer=None, speculative: dict | None = None,
                registry=None, warmup: bool = True, num_scheduler_steps: int | None = None) -> LLMEngine:
    """`num_scheduler_steps=1` for a test that follows the engine one decode step at a
    time; None keeps the default (multi-step decoding)."""
    steps = {} if num_scheduler_steps is None else {"num_scheduler_steps": num_scheduler_steps}
    config = EngineConfig(
        device="cpu", dtype="float32", seed=seed, speculative=speculative or {}, warmup=warmup,
        cache={"num_blocks": num_blocks, "block_size": block_size, "enable_prefix_caching": prefix_caching},
        scheduler={"policy": policy, "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
                   **steps},
    )
    return LLMEngine(config, model=model or FakeCausalLM(), tokenizer=tokenizer, registry=registry)


class FakeTokenizer:
    """Letters: token t is the letter `chr(97 + t % 26)`; encode maps letters back."""

    eos_token_id = None

    def encode(self, text: str) -> list[int]:
        return [(ord(c) - 97) % 26 for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(97 + t % 26) for t in ids)

