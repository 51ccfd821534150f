"""What passes between the parts of one engine step: the scheduler's plan
(`SchedulerOutput` of `ScheduledRequest`s), what sampling made of the model's
logits (`SamplerOutput` of `SampledTokens`), and what applying it did
(`StepUpdate`, from `Scheduler.update_from_output`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .request import Request


@dataclass
class ScheduledRequest:
    """`num_tokens` new tokens of `request`, starting at position `start`; the last
    `len(draft_token_ids)` of them are draft tokens to verify (a decode only)."""

    request: Request
    start: int
    num_tokens: int
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None  # [len(draft_token_ids), vocab], None: one-hot
    forks: list[Request] = field(default_factory=list)  # samples > 0 forked from it after this step

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the known tokens, so a token is sampled."""
        return self.start + self.num_tokens == self.request.num_tokens + len(self.draft_token_ids)

    @property
    def num_logit_rows(self) -> int:
        """Positions whose logits the step needs: the last token and each draft when sampling."""
        return 1 + len(self.draft_token_ids) if self.samples else 0

    @property
    def num_prompt_logit_rows(self) -> int:
        """Positions before the sampling rows whose logits score prompt tokens (a
        request with prompt logprobs, in its prefill); see `engine/prompt_logprobs.py`."""
        return self.request.prompt_logit_rows(self.start, self.start + self.num_tokens)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # ended by the scheduler (cannot fit)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


@dataclass
class SampledTokens:
    """What sampling (and verification) emitted for one request in one step: the
    accepted drafts then the target's own token, with one logprob record each
    (`{token id: logprob}`, the emitted token included) when the request asks."""

    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None


@dataclass
class SamplerOutput:
    """One step's sampling: the tokens of every request that sampled (each sampling
    entry and each of its forks), and the ids of the scheduled requests whose
    logits held a NaN or an infinity, in plan order: nothing was sampled for those."""

    tokens: dict[str, SampledTokens] = field(default_factory=dict)
    non_finite: list[str] = field(default_factory=list)


@dataclass
class StepUpdate:
    """What `update_from_output` did: requests ended for non-finite logits,
    requests that gained tokens, requests that ended (the first included), and
    how many tokens were appended in all."""

    failed: list[Request] = field(default_factory=list)
    progressed: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    num_generated_tokens: int = 0
