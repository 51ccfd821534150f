"""What the engine hands back: one `RequestOutput` per request, holding one
`CompletionOutput` per sample (vLLM's shape). Outputs are cumulative; the
`new_*` fields hold what the latest step added, for streaming."""

from __future__ import annotations

from dataclasses import dataclass, field

from .request import Request


@dataclass
class RequestTimings:
    """Seconds on `time.monotonic()`'s clock. `ttft`: arrival to first token;
    `tpot`: mean time per output token after the first."""

    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    num_output_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        if self.finish_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One request. `.text`, `.token_ids`, `.finish_reason` and `.error` are those
    of the first sample, for the common n == 1 case. `prompt_logprobs` (with
    `SamplingParams.prompt_logprobs`, once the prompt is scored): None for the first
    prompt token, then per token `{token id: Logprob}`, the token's own first."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    timings: RequestTimings
    prompt_logprobs: list | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def error(self) -> str | None:
        return self.outputs[0].error

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].logprobs


def visible_text(request: Request) -> str:
    """The text so far, less a trailing partial character (a byte-level tokenizer
    decodes half a UTF-8 sequence as U+FFFD) and less a tail that could begin a
    stop string, until the request finishes, so streamed pieces always add up to
    the final text."""
    if request.finished or not request.text:  # (no text: token ids only, detokenize=False)
        return request.text
    text = request.text.rstrip("\ufffd")
    # Hold back a tail that may yet grow into a stop string, which would be cut off.
    held = max((n for stop in request.params.stop for n in range(len(stop) - 1, 0, -1)
                if text.endswith(stop[:n])), default=0)
    return text[:len(text) - held]


def completion_of(request: Request, previous_tokens: int = 0, previous_text: int = 0) -> CompletionOutput:
    """A snapshot of one sample; `previous_*` are the lengths already reported."""
    text = visible_text(request)
    return CompletionOutput(
        index=request.sample_index,
        text=text,
        token_ids=list(request.output_token_ids),
        finish_reason=None if request.finish_reason is None else request.finish_reason.value,
        stop_reason=request.stop_reason,
        error=request.error,
        logprobs=None if request.logprobs is None else list(request.logprobs),
        cumulative_logprob=request.cumulative_logprob if request.logprobs is not None else None,
        new_token_ids=request.output_token_ids[previous_tokens:],
        new_text=text[previous_text:],
    )


def timings_of(samples: list[Request]) -> RequestTimings:
    if len(samples) == 1:  # n == 1: every step reports one, so skip the general min/max
        one = samples[0]
        return RequestTimings(one.arrival_time, one.first_token_time, one.finish_time if one.finished else None,
                              len(one.output_token_ids))
    firsts = [s.first_token_time for s in samples if s.first_token_time is not None]
    done = all(s.finished for s in samples)
    return RequestTimings(
        arrival_time=samples[0].arrival_time,
        first_token_time=min(firsts) if firsts else None,
        finish_time=max(s.finish_time for s in samples) if done else None,
        num_output_tokens=max(len(s.output_token_ids) for s in samples),
    )
