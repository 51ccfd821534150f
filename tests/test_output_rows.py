"""A model planned with output rows (models/output_rows.py) runs its last layer on
those rows only: same hidden states for them, the same KV cache for every token."""

from __future__ import annotations

import pytest
import torch

from kvforge.core import AttentionBatch, ConfigError
from kvforge.models import load_model
from kvforge.models.output_rows import output_rows_batch
from kvforge.models.paged_driver import PagedDriver
from tests.model_driver import cpu_backends

# One step of every kind: a prompt chunk that ends mid-prompt (no row), a prompt's
# last chunk (its last token), a decode (its one token) and a verify of two drafts
# (its last three tokens). Rows of the flat batch: 0-4, 5-8, 9, 10-12.
CONTEXT = [0, 3, 10, 6]
NEW = [5, 4, 1, 3]
ROWS = [8, 9, 10, 11, 12]


def a_batch() -> AttentionBatch:
    starts = torch.tensor([0, 5, 9, 10, 13], dtype=torch.int32)
    context = torch.tensor(CONTEXT, dtype=torch.int32)
    seq_lens = context + torch.tensor(NEW, dtype=torch.int32)
    return AttentionBatch(query_start_loc=starts, seq_lens=seq_lens, context_lens=context,
                          block_table=torch.arange(8, dtype=torch.int32).view(4, 2), slot_mapping=torch.arange(13) * 3,
                          block_size=16, max_query_len=5, max_seq_len=16)


def test_the_rows_batch_keeps_the_sequences_with_rows_and_their_whole_context():
    batch = a_batch()
    rows = output_rows_batch(batch, torch.tensor(ROWS))
    assert rows.query_start_loc.tolist() == [0, 1, 2, 5]
    assert rows.seq_lens.tolist() == [7, 11, 9]
    assert rows.context_lens.tolist() == [6, 10, 6]
    assert rows.block_table.tolist() == [[2, 3], [4, 5], [6, 7]]
    assert rows.slot_mapping.tolist() == [3 * r for r in ROWS]
    assert (rows.num_tokens, rows.max_query_len, rows.max_seq_len) == (5, 3, 11)
    empty = output_rows_batch(batch, torch.tensor([], dtype=torch.int64))
    assert (empty.num_seqs, empty.num_tokens, empty.max_query_len) == (0, 0, 0)


@pytest.mark.parametrize("rows", [[7], [10, 11], [8, 10, 12], [12, 11], [13], [-1]],
                         ids=["not-last-of-prompt", "not-last-of-verify", "gap", "decreasing", "past-end", "negative"])
def test_rows_that_are_not_trailing_tokens_are_refused(rows):
    with pytest.raises(ValueError, match="output rows must"):
        output_rows_batch(a_batch(), torch.tensor(rows))


def save_model(tmp_path, family: str):
    import transformers

    torch.manual_seed(0)
    if family == "llama":
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                          num_attention_heads=4, num_key_value_heads=2)
        transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    else:
        config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=3, n_head=4, n_positions=64,
                                         bos_token_id=0, eos_token_id=0)
        transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("backend", cpu_backends(), ids=lambda b: b.name)
def test_last_layer_on_output_rows_matches_every_row(tmp_path, family, backend):
    model = load_model(save_model(tmp_path, family), dtype=torch.float32, attention_backend=backend)
    block = 16 if backend.block_sizes is None or 16 in backend.block_sizes else backend.block_sizes[0]
    drivers = [PagedDriver(model, block, num_seqs=4, max_len=32, permute=True, seed=3) for _ in range(2)]
    generator = torch.Generator().manual_seed(1)

    def tokens(n):
        return torch.randint(0, 64, (n,), generator=generator).tolist()

    first, second = [tokens(n) for n in CONTEXT], [tokens(n) for n in NEW]
    for driver in drivers:
        driver.step(first)
    with torch.no_grad():
        everything = [d.inputs(second) for d in drivers]
        full = model.forward(*everything[0][:2], drivers[0].kv_caches, model.plan(everything[0][2]))
        rows = torch.tensor(ROWS)
        pruned = model.forward(*everything[1][:2], drivers[1].kv_caches, model.plan(everything[1][2], rows))
        assert pruned.shape == (len(ROWS), full.shape[1])
        torch.testing.assert_close(pruned, full[rows], rtol=1e-5, atol=1e-5)
        for ours, theirs in zip(drivers[1].kv_caches, drivers[0].kv_caches):  # the last layer's keys too
            assert torch.equal(ours, theirs)
        nothing = model.forward(*everything[1][:2], drivers[1].kv_caches,
                                model.plan(everything[1][2], torch.tensor([], dtype=torch.int64)))
        assert nothing.shape == (0, full.shape[1])


def test_a_model_without_the_last_layer_switch_refuses_output_rows(tmp_path):
    model = load_model(save_model(tmp_path, "llama"), dtype=torch.float32, attention_backend=cpu_backends()[0])
    model.computes_output_rows_only = False
    with pytest.raises(ConfigError, match="computes every row"):
        model.plan(a_batch(), torch.tensor(ROWS))
