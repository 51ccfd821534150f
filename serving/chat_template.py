"""Chat messages to prompt token ids.

A tokenizer with a chat template (Hugging Face's `apply_chat_template`) renders
the messages its own way, with the request's tools (OpenAI's `function`
objects) when it has any. A model without one, such as the built-in
`kvforge-tiny` and its byte tokenizer, gets the documented default: one line
per message, `"{role}: {content}\\n"`, then `"assistant:"` to prompt the reply
(the tools are not shown there).
"""

from __future__ import annotations

from .errors import bad_request

DEFAULT_GENERATION_PROMPT = "assistant:"


def default_chat_prompt(messages: list[dict]) -> str:
    """The default template: `role: content` lines, then the generation prompt."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + DEFAULT_GENERATION_PROMPT


def chat_prompt_token_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The prompt for `messages` (dicts with `role` and text `content`) and `tools`."""
    if tokenizer is None:
        raise bad_request("this model has no tokenizer, so it cannot read chat messages; use /v1/completions "
                          "with token ids as the prompt", param="messages")
    if getattr(tokenizer, "chat_template", None) and hasattr(tokenizer, "apply_chat_template"):
        extra = {"tools": tools} if tools else {}
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
        return list(tokenizer.encode(text, add_special_tokens=False))  # the template wrote any special tokens
    return list(tokenizer.encode(default_chat_prompt(messages)))
