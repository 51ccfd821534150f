"""Prompt logprobs: how likely the model found each prompt token, given the ones before it.

A request with `SamplingParams(prompt_logprobs=k)` needs the logits of every
prompt position, not only of the last one as sampling does: the logits at
position p score prompt token p + 1. Its prefill rows are asked of the model as
extra logit rows, just before its sampling row
(`ScheduledRequest.num_prompt_logit_rows`), so the
model's last layer still runs only on the rows somebody reads. A prefill split in
chunks scores each chunk's rows as it runs: the last row of a chunk scores the
first token of the next one, which is already known, so nothing is carried over.

The figures are the model's raw distribution (log-softmax of its logits, before
logit bias, penalties, temperature or any mask), as vLLM's default `raw_logprobs`.
Prefix-cache hits have no logits, so such a request takes none until its prompt is
scored (`Request.needs_prompt_logits`); its blocks are still offered to the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .scheduler_output import ScheduledRequest


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability at one position (vLLM's `Logprob`): `rank` is
    1 for the most likely token (tokens as likely as it share its rank's count);
    `decoded_token` its text, None without a tokenizer or with `detokenize=False`."""

    logprob: float
    rank: int
    decoded_token: str | None = None


class PromptScorer:
    """Takes a step's prompt rows out of its logits and records each request's
    prompt logprobs. `token_text(id)` gives a token's text (None: no tokenizer)."""

    def __init__(self, token_text=None):
        self.token_text = token_text
        self._texts: dict[int, str] = {}

    def take(self, scheduled: Sequence[ScheduledRequest], logits: torch.Tensor) -> torch.Tensor:
        """Score the prompt rows of `logits` (laid out as `ModelRunner.execute` returns
        them: per entry its prompt rows, then its sampling rows) and return the
        sampling rows alone, as `StepSampler.sample` reads them."""
        counts = [entry.num_prompt_logit_rows for entry in scheduled]
        if not any(counts):
            return logits
        keep: list[int] = []
        score: list[int] = []
        row = 0
        for entry, count in zip(scheduled, counts):
            score.extend(range(row, row + count))
            row += count
            keep.extend(range(row, row + entry.num_logit_rows))
            row += entry.num_logit_rows
        self._score([(e, c) for e, c in zip(scheduled, counts) if c], logits[torch.tensor(score, device=logits.device)])
        return logits[torch.tensor(keep, dtype=torch.long, device=logits.device)]

    def _score(self, entries: list[tuple[ScheduledRequest, int]], logits: torch.Tensor) -> None:
        targets = [token for entry, count in entries for token in scored_tokens(entry.request, count)]
        target = torch.tensor(targets, dtype=torch.long, device=logits.device)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen = logprobs.gather(1, target.unsqueeze(1))
        ranks = (logprobs >= chosen).sum(dim=-1).tolist()
        k = max(entry.request.params.prompt_logprobs for entry, _ in entries)
        top_logprobs, top_ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
        chosen, top_logprobs, top_ids = chosen.squeeze(1).tolist(), top_logprobs.tolist(), top_ids.tolist()
        at = 0
        for entry, count in entries:
            request = entry.request
            k = request.params.prompt_logprobs
            text = self._text if request.params.detokenize else _no_text
            for i in range(at, at + count):
                record = {targets[i]: Logprob(chosen[i], ranks[i], text(targets[i]))}
                for rank, (token, logprob) in enumerate(zip(top_ids[i][:k], top_logprobs[i][:k]), start=1):
                    record.setdefault(token, Logprob(logprob, rank, text(token)))
                request.prompt_logprobs.append(record)
            at += count

    def _text(self, token_id: int) -> str | None:
        if self.token_text is None:
            return None
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.token_text(token_id)
        return text


def scored_tokens(request, count: int) -> list[int]:
    """The prompt tokens the request's next `count` prompt rows score: position p
    scores token p + 1, so they start at the first token not scored yet."""
    first = len(request.prompt_logprobs)
    return request.prompt_token_ids[first:first + count]


def _no_text(token_id: int) -> None:
    return None
