"""Perplexity of a text through the engine's paged path, in strided windows.

A text longer than the model's context is read in windows of `max_length` tokens
that start `stride` tokens apart (transformers' perplexity guide): each window
scores only the tokens the previous window did not reach, with up to
`max_length - stride` tokens before them as context, so every token is scored
at most once: all but the first when windows overlap (`stride < max_length`),
all but each window's first when they do not. Each window is one request with prompt logprobs
(`SamplingParams(prompt_logprobs=0)`); the engine batches them as any requests.

    perplexity = exp(-(sum of the scored tokens' logprobs) / (number scored))
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvforge.core import RequestError


@dataclass(frozen=True)
class Window:
    """Tokens `begin..end-1` run as one prompt; tokens `first_scored..end-1` are scored."""

    begin: int
    end: int
    first_scored: int


@dataclass(frozen=True)
class Perplexity:
    perplexity: float
    negative_log_likelihood: float  # summed over the scored tokens, in nats
    num_scored_tokens: int
    num_windows: int

    @property
    def bits_per_token(self) -> float:
        return self.negative_log_likelihood / self.num_scored_tokens / math.log(2)


def strided_windows(num_tokens: int, max_length: int, stride: int) -> list[Window]:
    """The windows over `num_tokens` tokens; token 0 is never scored (nothing precedes it)."""
    if not (isinstance(max_length, int) and max_length >= 2):
        raise RequestError(f"max_length must be an integer >= 2 (tokens per window), got {max_length!r}")
    if not (isinstance(stride, int) and 1 <= stride <= max_length):
        raise RequestError(f"stride must be an integer in [1, max_length={max_length}], got {stride!r}")
    if num_tokens < 2:
        raise RequestError(f"the text has {num_tokens} token(s); perplexity needs at least 2")
    windows, scored_to = [], 1
    for begin in range(0, num_tokens, stride):
        end = min(begin + max_length, num_tokens)
        windows.append(Window(begin, end, max(scored_to, begin + 1)))  # a window's first token has no context
        scored_to = end
        if end == num_tokens:
            break
    return windows


def perplexity(llm, token_ids: list[int], max_length: int | None = None, stride: int | None = None,
               progress: bool = False) -> Perplexity:
    """The perplexity of `token_ids` under `llm` (a `kvforge.LLM`). `max_length`
    defaults to the model's context, `stride` to half of `max_length`."""
    total, count, windows = score_tokens(llm, token_ids, max_length, stride, progress)
    return Perplexity(math.exp(-total / count), -total, count, windows)


def score_tokens(llm, token_ids: list[int], max_length: int | None = None, stride: int | None = None,
                 progress: bool = False) -> tuple[float, int, int]:
    """`(sum of logprobs, tokens scored, windows)` of `token_ids` in strided windows."""
    from kvforge.engine.sampling_params import SamplingParams

    max_length = max_length or llm.engine.max_model_len
    if max_length > llm.engine.max_model_len:
        raise RequestError(f"max_length {max_length} is more than the model's context of "
                           f"{llm.engine.max_model_len} tokens; lower --max-length")
    stride = stride or max(1, max_length // 2)
    windows = strided_windows(len(token_ids), max_length, stride)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, detokenize=False)
    outputs = llm.generate(prompt_token_ids=[token_ids[w.begin:w.end] for w in windows], sampling_params=params,
                           use_tqdm=progress)
    total, count = 0.0, 0
    for window, output in zip(windows, outputs):
        if output.error:
            raise RequestError(f"window of tokens {window.begin}..{window.end - 1} failed: {output.error}")
        for position in range(window.first_scored, window.end):
            token = token_ids[position]
            total += output.prompt_logprobs[position - window.begin][token].logprob
            count += 1
    return total, count, len(windows)
