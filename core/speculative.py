"""The `speculative_proposer` interface: cheap guesses of the next tokens."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from .api import SPECULATIVE_PROPOSER
from .implementation import Implementation


@dataclass(frozen=True)
class ProposalRequest:
    """One request to draft for: every token it has so far (prompt and output),
    and its sampling temperature (0: greedy), for proposers that sample drafts."""

    request_id: str
    token_ids: Sequence[int]
    temperature: float = 0.0


@dataclass(frozen=True)
class ProposerTarget:
    """What the engine tells a proposer about the model it drafts for (`setup`)."""

    model: str  # the target's config.model: a built-in name or a local directory
    vocab_size: int
    max_model_len: int
    device: torch.device
    dtype: torch.dtype


@dataclass
class DraftProposal:
    """Up to k draft tokens; `probs` (`[len(token_ids), vocab]`) when the proposer
    has a distribution, None for deterministic proposers (treated as one-hot)."""

    token_ids: list[int]
    probs: torch.Tensor | None = None


class SpeculativeProposer(Implementation):
    """Guarantees every implementation keeps (the conformance suite checks each):

      1. `propose` returns one proposal per request, in order, each with at most
         `num_tokens` tokens, all inside the vocabulary.
      2. `probs`, when given, are rows of probabilities (non-negative, summing to 1)
         whose draft token has non-zero probability.
      3. Proposals are a pure function of the inputs and the proposer's state:
         the engine's rejection sampling keeps greedy output token-for-token equal
         to decoding without speculation, whatever is proposed.
      4. A request at the end of the target's context is served like any other:
         `propose` does not fail when `len(token_ids) + num_tokens` passes
         `ProposerTarget.max_model_len` (it may draft fewer tokens, or as many).

    Keeping drafts inside the context is the engine's duty, not the proposer's:
    it asks for the most drafts any request of the call may take, then cuts each
    request's drafts to what its context and `max_tokens` leave (draft `i` takes
    position `len(token_ids) + i`), so a draft past the end is never verified.
    Token-for-token equality (guarantee 3's promise) is the engine's duty too;
    the conformance group `engine` runs each proposer through the reference
    engine to show the two together keep it.
    """

    kind: ClassVar[str] = SPECULATIVE_PROPOSER
    cheap: ClassVar[bool] = False
    """True when `propose` costs next to nothing beside a model step (it runs no
    model). The engine's adaptive drafting then asks it every step, also for
    requests that verify no drafts, and scores those drafts against the tokens
    that follow; a costly proposer is asked only for drafts that will be verified."""

    def __init__(self, **options):
        """`options` are `speculative.options` from the config; each proposer names
        and documents its own, and refuses unknown ones with a ConfigError."""
        if options:
            from .errors import ConfigError

            raise ConfigError(f"speculative proposer {self.name!r} takes no options, got {sorted(options)}; "
                              "remove speculative.options")

    def setup(self, target: ProposerTarget) -> None:
        """Called once by the engine, before the first `propose`, with the target
        model's facts. Default: nothing to prepare."""

    @abstractmethod
    def propose(self, requests: Sequence[ProposalRequest], num_tokens: int) -> list[DraftProposal]:
        """Draft up to `num_tokens` tokens for each request."""

    def release(self, request_id: str) -> None:
        """Forget any state kept for a finished request. Default: nothing kept."""
