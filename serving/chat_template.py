"""Chat messages to prompt token ids.

A tokenizer with a chat template (Hugging Face's `apply_chat_template`) renders
the messages its own way, with the request's tools (OpenAI's `function`
objects) when it has any. A model without one, such as the built-in
`kvforge-tiny` and its byte tokenizer, gets the documented default: one line
per message, `"{role}: {content}\\n"`, then `"assistant:"` to prompt the reply;
with tools, a first `tools:` line lists them (OpenAI's `function` objects as JSON)
and `tool_format:` then a call block shows how to call one: a Hermes-style
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block, the form the
server reads calls in (see `tool_call_format`).
"""

from __future__ import annotations

import json

from .errors import bad_request
from .tool_call_format import hermes_call_text

DEFAULT_GENERATION_PROMPT = "assistant:"


def default_chat_prompt(messages: list[dict], tools: list[dict] | None = None) -> str:
    """The default template: the tools and how to call them, if any; `role: content`
    lines; then the generation prompt."""
    head = ""
    if tools:
        head = (f"tools: {json.dumps([t['function'] for t in tools])}\n"
                f"tool_format: {hermes_call_text('<name>', '{<arguments>}')}\n")
    return head + "".join(f"{m['role']}: {m['content']}\n" for m in messages) + DEFAULT_GENERATION_PROMPT


def chat_prompt_token_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The prompt for `messages` (dicts with `role` and text `content`) and `tools`."""
    if tokenizer is None:
        raise bad_request("this model has no tokenizer, so it cannot read chat messages; use /v1/completions "
                          "with token ids as the prompt", param="messages")
    if getattr(tokenizer, "chat_template", None) and hasattr(tokenizer, "apply_chat_template"):
        extra = {"tools": tools} if tools else {}
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
        return list(tokenizer.encode(text, add_special_tokens=False))  # the template wrote any special tokens
    return list(tokenizer.encode(default_chat_prompt(messages, tools)))
