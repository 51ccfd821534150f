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
