"""One choice's output read as the request's tool choice asks: `ToolCallReader`, whole or delta by
delta, the auto choice through a parser (parsers.py), a forced one read back (choice.py)."""

from __future__ import annotations

from dataclasses import dataclass

from common.api.tools.choice import ToolChoice, tool_call_from_named, tool_calls_from_required
from common.api.tools.parsers import ToolParser
from common.api.tools.types import ToolCall, ToolStreamDelta


@dataclass
class ChoiceCalls:
    """What a finished choice answers: content, tool calls, and the finish reason."""

    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str | None


class ToolCallReader:
    """One choice's output read as the tool choice asks, whole (`whole`) or delta by delta
    (`feed`, then `finish` with the engine's finish reason):
        none      content as it is;
        auto      the parser's calls, content around them;
        required  the forced JSON array read back into calls;
        named     the forced JSON object as the one call's arguments.
    A forced output that does not read back (cut short by max_tokens) is content. Calls make the
    finish reason "tool_calls", except a named choice's, which stays as it is (as OpenAI's)."""

    def __init__(self, choice: ToolChoice, parser: ToolParser):
        self.choice = choice
        self._parser = parser
        self._stream = parser.stream() if choice.mode == "auto" else None
        self._held: list[str] = []  # a forced output, read at the end
        self.num_calls = 0

    @property
    def is_holding(self) -> bool:
        """Text may be held back (a tool call may be forming)."""
        return self.choice.mode != "none"

    def whole(self, text: str, finish_reason: str | None) -> ChoiceCalls:
        mode = self.choice.mode
        if mode == "none":
            return ChoiceCalls(text, [], finish_reason)
        if mode == "auto":
            found = self._parser.extract(text)
            calls, content = found.tool_calls, found.content
        elif mode == "required":
            calls, content = tool_calls_from_required(text), None
        else:
            calls, content = [tool_call_from_named(self.choice.name, text)], None
        if mode in ("required", "named") and (not calls or finish_reason == "length"):
            return ChoiceCalls(text, [], finish_reason)
        reason = "tool_calls" if calls and mode != "named" else finish_reason
        return ChoiceCalls(content, calls, reason)

    def feed(self, delta_text: str) -> ToolStreamDelta:
        if self.choice.mode == "none":
            return ToolStreamDelta(content=delta_text)
        if self._stream is not None:
            return self._counted(self._stream.feed(delta_text))
        self._held.append(delta_text)
        return ToolStreamDelta()

    def finish(self, finish_reason: str | None) -> tuple[ToolStreamDelta, str | None]:
        """The last delta, and the finish reason the client sees."""
        if self._stream is not None:
            last = self._counted(self._stream.finish())
            return last, "tool_calls" if self.num_calls else finish_reason
        if self.choice.mode == "none":
            return ToolStreamDelta(), finish_reason
        whole = self.whole("".join(self._held), finish_reason)
        deltas = [call.to_delta(i) for i, call in enumerate(whole.tool_calls)]
        self.num_calls = len(deltas)
        return ToolStreamDelta(content=whole.content or "", tool_calls=deltas), whole.finish_reason

    def _counted(self, delta: ToolStreamDelta) -> ToolStreamDelta:
        self.num_calls += len(delta.tool_calls)
        return delta
