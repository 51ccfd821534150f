"""`StructuredOutputs.mask` hands a backend its logit rows: none at all when its
grammars own every row in order (no gather and scatter), else exactly theirs,
leaving the rows of unconstrained requests as they were."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvforge.core import apply_token_bitmask
from kvforge.engine.structured_outputs import StructuredOutputs

VOCAB = 32


class OneTokenGrammar:
    """Allows only `token`."""

    def __init__(self, token: int):
        self.token = token

    def is_terminated(self) -> bool:
        return False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        value = 1 << self.token
        bitmask[row, 0] = value - (1 << 32) if value >= 1 << 31 else value


class RecordingBackend:
    def __init__(self):
        self.rows_given = []

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        return torch.full((num_rows, 1), -1, dtype=torch.int32)

    def apply_bitmask(self, logits, bitmask, rows=None) -> None:
        self.rows_given.append(None if rows is None else list(rows))
        apply_token_bitmask(logits, bitmask, rows)


def masked(requests, backend):
    outputs = StructuredOutputs(select=lambda spec: None, vocabulary=lambda: None)
    logits = torch.zeros(len(requests), VOCAB)
    outputs.mask(logits, requests)
    return logits


def allowed(row: torch.Tensor) -> list[int]:
    return torch.nonzero(torch.isfinite(row)).flatten().tolist()


def test_every_row_structured_gives_no_rows_and_masks_each_by_its_own_grammar():
    backend = RecordingBackend()
    requests = [SimpleNamespace(grammar=OneTokenGrammar(t), grammar_backend=backend) for t in (3, 31, 0)]
    logits = masked(requests, backend)
    assert backend.rows_given == [None]
    assert [allowed(row) for row in logits] == [[3], [31], [0]]


def test_unconstrained_rows_between_are_left_alone():
    backend = RecordingBackend()
    free = SimpleNamespace(grammar=None, grammar_backend=None)
    requests = [SimpleNamespace(grammar=OneTokenGrammar(5), grammar_backend=backend), free,
                SimpleNamespace(grammar=OneTokenGrammar(7), grammar_backend=backend)]
    logits = masked(requests, backend)
    assert backend.rows_given == [[0, 2]]
    assert [allowed(row) for row in logits] == [[5], list(range(VOCAB)), [7]]
