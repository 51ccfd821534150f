"""Tool calls streamed as OpenAI streams them: the first delta of a call carries
its `index`, `id`, `type`, `function.name` and the arguments so far; later deltas
carry only argument fragments. Content outside calls streams as `content`."""

from __future__ import annotations

from .tool_call_format import Scan, ToolCallReader
from .tool_calls import call_id


class ToolCallDeltas:
    """One choice's stream: give it the whole text so far at each step; it answers
    the delta that step adds (None when nothing new is safe to send)."""

    def __init__(self, reader: ToolCallReader):
        self.reader = reader
        self.content_sent = 0
        self.arguments_sent: list[int] = []  # per call begun
        self.ids: list[str] = []

    @property
    def num_calls(self) -> int:
        return len(self.ids)

    def delta(self, text: str, final: bool) -> dict | None:
        return self._delta(self.reader.scan(text, final))

    def _delta(self, scan: Scan) -> dict | None:
        delta: dict = {}
        if len(scan.content) > self.content_sent:
            delta["content"] = scan.content[self.content_sent:]
            self.content_sent = len(scan.content)
        calls = []
        for index, call in enumerate(scan.calls):
            if index == len(self.ids):
                self.ids.append(call_id())
                self.arguments_sent.append(len(call.arguments))
                calls.append({"index": index, "id": self.ids[index], "type": "function",
                              "function": {"name": call.name, "arguments": call.arguments}})
            elif len(call.arguments) > self.arguments_sent[index]:
                calls.append({"index": index, "function": {"arguments": call.arguments[self.arguments_sent[index]:]}})
                self.arguments_sent[index] = len(call.arguments)
        if calls:
            delta["tool_calls"] = calls
        return delta or None
