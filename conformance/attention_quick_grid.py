"""The reduced ("quick") grid of the `attention_backend` checks: which batches it holds.

The full grid draws its batch shapes at random, which covers much over many runs
but promises nothing in one: a sliding window drawn longer than every sequence,
or no sequence that crosses a block boundary, lets a backend that gets it wrong
pass. The reduced grid runs far fewer cases, so it cannot rely on chance. Its
batch shapes are fixed, built around the one block size `B` it uses; only the
values (queries, keys, values, block placement, garbage) are random per seed.
Every shape below is chosen so that a backend getting one thing wrong changes
its float32 output far beyond tolerance on every seed (docs/conformance.md has
the measured margins):

- decode position (query at `context_len`): every decode; one position too far
  shows through the window, which then drops a key;
- a block boundary (the token at `k * B`, the block count): a decode and a prompt
  whose last token opens block 2 (`(B, 1)`, `(0, B + 1)`), a chunk crossing from
  block 1 into 2, a decode filling exactly two blocks (`(2B - 1, 1)`);
- chunked prefill over cached context: a chunk of 3 over `B - 1` cached tokens;
- mixed batches: a prompt, a chunk and decodes in one step;
- block-table padding (block 0, NaN): a short sequence beside two-block ones;
- GQA: every case has 4 query heads per KV head;
- sliding window: `B // 2 + 1`, shorter than the context of every sequence
  reaching block 2;
- logit soft-cap: 1.5, over scores of unit variance, many of which reach it;
- ALiBi: slopes 2^-1 .. 2^-8 over distances up to `B + 1`.

`tests/test_attention_conformance.py` plants a backend with each of these bugs
and shows the reduced grid catches it on every one of several seeds.
"""

from __future__ import annotations


def quick_lengths(kind: str, block_size: int) -> list[tuple[int, int]]:
    """(context_len, query_len) of each sequence of the reduced grid's batch of `kind`."""
    b = block_size
    opens_block = (b, 1)  # the new token is the first of block 2
    fills_two_blocks = (2 * b - 1, 1)  # the new token is the last slot of block 2
    short = (2, 1)  # one block when B > 2, so its block-table row has padding
    chunk = (max(b - 1, 1), 3)  # a prefill chunk over cached context, crossing into block 2
    # Prompts stay short where a chunk already crosses a block: under an interpreter
    # (Triton's), a case costs about its number of query tokens.
    batches = {
        "decode": [opens_block, fills_two_blocks, short],
        "prefill": [(0, b + 1), (0, 3)],  # the last prompt token opens block 2
        "chunked": [chunk, (b, 2), short],  # (B, 2): a chunk starting exactly on a block
        "mixed": [(0, 5), opens_block, chunk, short],
    }
    if kind not in batches:
        raise ValueError(f"the reduced grid has no {kind!r} batches; its kinds: {', '.join(batches)} "
                         "(pass reduced=False for the full grid's kinds)")
    return list(batches[kind])


def quick_window(block_size: int) -> int:
    """The reduced grid's sliding window: shorter than the context of every sequence
    in `quick_lengths` that reaches block 2, so ignoring it (or placing a query one
    position off) changes which keys count."""
    return block_size // 2 + 1
