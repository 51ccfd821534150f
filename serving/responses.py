"""Engine outputs to OpenAI response bodies: choices, logprobs, usage, and the
server-sent-event framing of streams."""

from __future__ import annotations

import json

from kvforge.engine.outputs import CompletionOutput, RequestOutput


def sse(payload: dict | str) -> str:
    """One server-sent event, as OpenAI streams them."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


SSE_DONE = sse("[DONE]")


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class TokenText:
    """Each token id's own text, for logprobs (cached: the same ids recur)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"token_id:{token_id}"
            self._cache[token_id] = text
        return text

    def text_of(self, token_ids: list[int]) -> str:
        """A token-id prompt's text (its ids' texts joined without a tokenizer)."""
        if self.tokenizer is not None:
            return self.tokenizer.decode(token_ids)
        return "".join(self(t) for t in token_ids)


def _records(completion: CompletionOutput, new_only: bool) -> list[tuple[int, dict[int, float]]]:
    """(token id, {id: logprob}) of each token, or of the tokens added by the latest step."""
    records = completion.logprobs or []
    token_ids = completion.token_ids
    if new_only:
        count = len(completion.new_token_ids)
        return list(zip(token_ids[len(token_ids) - count:], records[len(records) - count:]))
    return list(zip(token_ids, records))


def completion_logprobs(completion: CompletionOutput, k: int, token_text: TokenText, new_only: bool,
                        text_offset: int = 0) -> dict | None:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset."""
    if completion.logprobs is None:
        return None
    tokens, chosen, tops, offsets = [], [], [], []
    for token_id, record in _records(completion, new_only):
        text = token_text(token_id)
        tokens.append(text)
        chosen.append(record[token_id])
        tops.append({token_text(t): lp for t, lp in list(record.items())[:k]} if k else None)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": tops, "text_offset": offsets}


def echo_logprobs(prompt_ids: list[int], prompt_logprobs: list | None, token_text: TokenText,
                  generated: dict | None) -> dict:
    """The legacy completions shape over the prompt (each token's own logprob and
    its alternatives; null for the first token) and then the `generated` tokens'
    (`completion_logprobs` from the end of the prompt's text; None: none)."""
    tokens, chosen, tops, offsets = [], [], [], []
    offset = 0
    for token_id, record in zip(prompt_ids, prompt_logprobs or [None] * len(prompt_ids)):
        text = token_text(token_id)
        tokens.append(text)
        chosen.append(None if record is None else record[token_id].logprob)
        tops.append(None if record is None else {token_text(t): lp.logprob for t, lp in record.items()})
        offsets.append(offset)
        offset += len(text)
    body = {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": tops, "text_offset": offsets}
    for key, values in (generated or {}).items():
        body[key] += values
    return body


def prompt_text_length(prompt_ids: list[int], token_text: TokenText) -> int:
    """Where the generated tokens' text offsets start after an echoed prompt."""
    return sum(len(token_text(t)) for t in prompt_ids)


def chat_logprobs(completion: CompletionOutput, k: int, token_text: TokenText, new_only: bool) -> dict | None:
    """The chat shape: `content`, one entry per token with its top alternatives."""
    if completion.logprobs is None:
        return None

    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, record in _records(completion, new_only):
        item = entry(token_id, record[token_id])
        item["top_logprobs"] = [entry(t, lp) for t, lp in list(record.items())[:k]]
        content.append(item)
    return {"content": content}


def choice_index(prompt_index: int, n: int, completion: CompletionOutput) -> int:
    """Choices of prompt i come at i * n + sample, as OpenAI numbers them."""
    return prompt_index * n + completion.index


def failed(output: RequestOutput) -> str | None:
    """The engine's error for this request, if any sample failed."""
    for completion in output.outputs:
        if completion.finish_reason == "error":
            return completion.error or "the request failed"
    return None
