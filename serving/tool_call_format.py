"""Reading tool calls out of generated text, complete or still being generated.

The form of the output depends on `tool_choice`:

* a named function: the whole output is that function's arguments;
* `"required"`: a JSON array of calls `[{"name": ..., "parameters": {...}}]`;
* `"auto"`: free text in which each call is a Hermes-style block
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (the format
  the default chat template tells the model, and the one Hermes- and Qwen-style
  chat templates use).

A call's `arguments` is the raw text of its arguments as the model wrote it, so
the fragments a stream sends concatenate to exactly the non-streamed answer. A
block that is not a well-formed call to one of the request's functions stays
content, as does an output cut short before its calls parsed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
HERMES_CALL_HEAD = '{{"name": {name}, "arguments": '  # with the function's name as a JSON string
HERMES_CALL_TAIL = "}"

NAMED, REQUIRED, AUTO = "named", "required", "auto"
_NAME = r'"((?:[^"\\]|\\.)*)"'
_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*' + _NAME + r'\s*,\s*"arguments"\s*:\s*')
_ARRAY_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*' + _NAME + r'\s*,\s*"parameters"\s*:\s*')
_SCALAR = re.compile(r'[^\s,\]}]*')


@dataclass
class ScannedCall:
    name: str
    arguments: str  # so far; only grows as the text does


@dataclass
class Scan:
    """What a text holds so far: `content` (text outside calls, safe to send: it
    never turns into part of a call) and the calls begun, in order."""

    content: str = ""
    calls: list[ScannedCall] = field(default_factory=list)


@dataclass(frozen=True)
class ToolCallReader:
    """How one request's output carries its calls. `constrained`: a grammar made
    the output a well-formed call from its first token (named, required) or from
    each `<tool_call>` on (auto), so a call's arguments may be sent before it
    closes; unconstrained, a block is held back until it closes and parses."""

    form: str  # NAMED, REQUIRED or AUTO
    names: frozenset[str]
    max_calls: int | None = None  # 1 without parallel_tool_calls
    constrained: bool = True

    def scan(self, text: str, final: bool) -> Scan:
        """The content and calls of `text`; `final`: the output is complete (a call
        not closed by then is content)."""
        if self.form == NAMED:
            (name,) = self.names
            return Scan("", [ScannedCall(name, text)]) if not final or _parses(text) else Scan(text, [])
        if self.form == REQUIRED:
            calls = _scan_array(text, final)
            if calls is None or final and not (_parses(text) and all(c.name in self.names for c in calls)):
                return Scan(text, [])
            return Scan("", calls[:self.max_calls])
        return self._scan_tagged(text, final)

    def _scan_tagged(self, text: str, final: bool) -> Scan:
        scan, pos = Scan(), 0
        while True:
            start = text.find(TOOL_CALL_START, pos)
            if start < 0:
                tail = text[pos:]
                scan.content += tail if final else tail[:len(tail) - _marker_prefix_len(tail)]
                return scan
            scan.content += text[pos:start]
            body_at = start + len(TOOL_CALL_START)
            end = text.find(TOOL_CALL_END, body_at)
            if end < 0:  # a call still open
                if final:
                    scan.content += text[start:]
                elif self.constrained and self._may_add_call(scan):
                    partial = _partial_hermes(text[body_at:], self.names)
                    if partial is not None:
                        scan.calls.append(partial)
                return scan
            call = _hermes_call(text[body_at:end], self.names) if self._may_add_call(scan) else None
            if call is None:
                scan.content += text[start:end + len(TOOL_CALL_END)]
            else:
                scan.calls.append(call)
            pos = end + len(TOOL_CALL_END)

    def _may_add_call(self, scan: Scan) -> bool:
        return self.max_calls is None or len(scan.calls) < self.max_calls


def hermes_call_text(name: str, arguments: str) -> str:
    """A call as the `<tool_call>` block the model is told to write."""
    head = HERMES_CALL_HEAD.format(name=json.dumps(name))
    return f"{TOOL_CALL_START}\n{head}{arguments}{HERMES_CALL_TAIL}\n{TOOL_CALL_END}"


def value_end(text: str, start: int) -> int | None:
    """Where the JSON value starting at `text[start]` ends (one past it); None while
    `text` holds only its beginning. Assumes well-formed JSON; json.loads judges."""
    if start >= len(text):
        return None
    first = text[start]
    if first not in '{["':
        match = _SCALAR.match(text, start)
        return match.end() if match.end() < len(text) else None
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        char = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
                if depth == 0:
                    return i + 1
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _marker_prefix_len(text: str) -> int:
    """How long a tail of `text` could still grow into `<tool_call>` (held back from content)."""
    for size in range(min(len(text), len(TOOL_CALL_START) - 1), 0, -1):
        if TOOL_CALL_START.startswith(text[-size:]):
            return size
    return 0


def _hermes_call(body: str, names: frozenset[str]) -> ScannedCall | None:
    """The call a closed `<tool_call>` block holds; None when it is not JSON, lacks a
    name or object arguments, or names a function the request does not have."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or call.get("name") not in names or not isinstance(call.get("arguments"), dict):
        return None
    head = _HERMES_HEAD.match(body)
    if head is not None:
        end = value_end(body, head.end())
        if end is not None and re.fullmatch(r"\s*\}\s*", body[end:]):
            return ScannedCall(call["name"], body[head.end():end])
    return ScannedCall(call["name"], json.dumps(call["arguments"], ensure_ascii=False))


def _partial_hermes(body: str, names: frozenset[str]) -> ScannedCall | None:
    """The call an open block has begun, once its name is known and is one of `names`."""
    head = _HERMES_HEAD.match(body)
    if head is None:
        return None
    name = _json_string(head.group(1))
    if name not in names:
        return None
    end = value_end(body, head.end())
    return ScannedCall(name, body[head.end():] if end is None else body[head.end():end])


def _scan_array(text: str, final: bool) -> list[ScannedCall] | None:
    """The calls of a `[{"name": ..., "parameters": ...}, ...]` output so far; None
    when it is not that form (or, `final`, not all of it)."""
    calls: list[ScannedCall] = []
    opening = re.match(r"\s*\[", text)
    if opening is None:
        return None if final or text.strip() else calls
    pos = opening.end()
    while True:
        closing = re.match(r"\s*\]\s*$", text[pos:])
        if closing is not None:
            return calls
        head = _ARRAY_HEAD.match(text, pos)
        if head is None:
            return None if final else calls
        end = value_end(text, head.end())
        name = _json_string(head.group(1))
        if end is None:
            if final:
                return None
            calls.append(ScannedCall(name, text[head.end():]))
            return calls
        calls.append(ScannedCall(name, text[head.end():end]))
        after = re.match(r"\s*\}\s*,?", text[end:])
        if after is None:
            return None if final else calls
        pos = end + after.end()


def _json_string(raw: str) -> str | None:
    try:
        return json.loads(f'"{raw}"')
    except ValueError:
        return None


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
