"""One request (one sample of a prompt) and the states it moves through.

    WAITING --schedule--> RUNNING --finish/abort/error--> FINISHED
       ^                     |
       +----- PREEMPTED <----+   (blocks freed; its tokens are recomputed later)

A preempted request waits again under the key it was submitted with, so it
returns to its original place in the waiting order.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvforge.core import RequestView

from .sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens, the model's context, or the whole KV cache
    ABORT = "abort"
    ERROR = "error"  # the request was invalid or failed; see `Request.error`

    def __str__(self) -> str:
        return self.value


def token_slice(request, start: int, end: int) -> list[int]:
    """`request.all_token_ids[start:end]` (0 <= start <= end) without concatenating
    the whole sequence."""
    prompt, output = request.prompt_token_ids, request.output_token_ids
    if start >= len(prompt):
        return output[start - len(prompt): end - len(prompt)]
    return prompt[start:end] + output[: max(0, end - len(prompt))]


class TokenIds(Sequence):
    """A request's prompt and output as one read-only sequence, without the copy
    `all_token_ids` makes: the prefix cache hashes a block of it only when one
    fills, while a copy every step would cost O(length) per request."""

    __slots__ = ("request",)

    def __init__(self, request: "Request"):
        self.request = request

    def __len__(self) -> int:
        return self.request.num_tokens

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step == 1:
                return token_slice(self.request, start, max(start, stop))
            return self.request.all_token_ids[index]
        return self.request.all_token_ids[index]


@dataclass(eq=False)  # requests compare by identity: ids are unique, state changes
class Request:
    """The state of one sample. `group_id` is the user's request id; a prompt with
    `n` samples has `n` Requests, sample `i > 0` with id `f"{group_id}#{i}"`."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_index: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    group_id: str = ""
    sample_index: int = 0
    prompt: str | None = None
    eos_token_id: int | None = None
    cache_salt: str | None = None  # mixed into its prefix-cache block hashes: different salts never share blocks
    lora_request: Any = None  # a LoRARequest, or None for the base model
    lora_adapter: Any = None  # its loaded LoRAAdapter, kept until the request ends

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    admitted_index: int = -1
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    text: str = ""
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    # with params.prompt_logprobs (sample 0 only): one entry per prompt token scored so far, None for the first
    prompt_logprobs: list | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    generator: torch.Generator | None = None
    detokenizer: Any = None  # an IncrementalDetokenizer when the engine has a tokenizer
    sort_key: tuple | None = None  # the policy's waiting key, computed once
    forked: bool = False  # sample > 0 that already shares its parent's blocks
    forks: list["Request"] = field(default_factory=list)  # samples > 0 to fork from this one's prompt
    # structured outputs: its grammar (advanced over every output token), the backend that
    # compiled it, and while compiling the job (a `structured_outputs.CompileJob`)
    grammar: Any = None
    grammar_backend: Any = None
    grammar_job: Any = None

    def __post_init__(self) -> None:
        self.group_id = self.group_id or self.request_id
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.sample_index == 0:
            self.prompt_logprobs = [None]
        if self.params.seed is not None:
            # Sample i of a seeded prompt gets its own stream, derived from the seed.
            self.generator = torch.Generator().manual_seed(self.params.seed + 1_000_003 * self.sample_index)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens known so far: prompt plus output."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether it asks for prompt logprobs and some prompt token is not scored yet
        (then it takes no prefix-cache hits: cached tokens have no logits)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def prompt_logit_rows(self, start: int, end: int) -> int:
        """How many of positions `start..end-1` score a prompt token not yet scored
        (position p scores token p + 1): the last positions of the span, or the last
        but its sampling row."""
        if self.prompt_logprobs is None:
            return 0
        first = max(start, len(self.prompt_logprobs) - 1)
        return max(0, min(end, self.num_prompt_tokens - 1) - first)

    @property
    def token_view(self) -> TokenIds:
        """`all_token_ids` as a view: no copy."""
        return TokenIds(self)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def lora_id(self) -> int:
        """Its adapter's `lora_int_id`; 0 for the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    def prefix_extra_keys(self) -> tuple:
        """What goes into the hash of each of its prefix-cache blocks beside the tokens:
        its cache salt, and its adapter's name and weights fingerprint."""
        keys = () if self.cache_salt is None else (("cache_salt", self.cache_salt),)
        if self.lora_request is not None:
            keys += (("lora", self.lora_request.lora_name, self.lora_adapter.fingerprint),)
        return keys

    def view(self) -> RequestView:
        return RequestView(
            request_id=self.request_id, priority=self.priority, arrival_time=self.arrival_time,
            arrival_index=self.arrival_index, admitted_index=self.admitted_index,
            num_prompt_tokens=self.num_prompt_tokens, num_computed_tokens=self.num_computed_tokens,
            num_output_tokens=len(self.output_token_ids),
        )

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None, error: str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error
        self.finish_time = time.monotonic()
