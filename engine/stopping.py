"""When a request is done, checked after each new token; also keeps its text."""

from __future__ import annotations

from .request import FinishReason, Request


def check_stop(request: Request, max_model_len: int) -> tuple[FinishReason | None, int | str | None]:
    """`(reason, stop_reason)` if the latest token ends `request`, else `(None, None)`.
    Updates `request.text` (the decoded output, stop token and stop string cut off)."""
    params = request.params
    output = request.output_token_ids
    token = output[-1]
    may_stop = len(output) >= params.min_tokens
    reason, stop_reason, text_ids = None, None, output
    if may_stop and request.eos_token_id is not None and token == request.eos_token_id:
        reason, text_ids = FinishReason.STOP, output[:-1]
    elif may_stop and token in params.stop_token_ids:
        reason, stop_reason, text_ids = FinishReason.STOP, token, output[:-1]
    if request.detokenizer is not None:
        previous = len(request.text)
        request.detokenizer.update(text_ids, final=reason is not None)
        request.text = request.detokenizer.text
        if reason is None and may_stop and params.stop:
            # Only occurrences reaching into the new text: earlier text was already reported.
            hits = [(request.text.find(s, max(0, previous - len(s) + 1)), s) for s in params.stop]
            hits = [(at, s) for at, s in hits if at >= 0]
            if hits:
                at, stop = min(hits)
                request.text = request.text[:at]
                reason, stop_reason = FinishReason.STOP, stop
    if reason is None and (len(output) >= params.max_tokens or request.num_tokens > max_model_len):
        # (past the context, the next token would have no position left)
        reason = FinishReason.LENGTH
        if request.detokenizer is not None:  # flush a held-back partial character
            request.detokenizer.update(output, final=True)
            request.text = request.detokenizer.text
    return reason, stop_reason
