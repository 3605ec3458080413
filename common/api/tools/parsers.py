"""A model's tool-call format read back from its output (`PARSERS`, named as vLLM's
`--tool-call-parser`; `get_parser(name)`):
    hermes        `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen,
                  SmolLM). Text outside valid blocks is content (whitespace right after a valid
                  block is dropped); a block that is not a valid call stays in content as text.
                  A final block without its `</tool_call>` still counts if its JSON is a call.
    llama3_json   the whole output (optionally after `<|python_tag|>`) is `{"name": ...,
                  "parameters": {...}}` (or "arguments"), or several joined by `;`; else content.
`parser.extract(text)` parses a finished output. `parser.stream()` parses one delta at a time:
content goes out as soon as it cannot be the start of a call, and each call goes out whole, as one
`DeltaToolCall`. Over any split of a text, the content of `feed()`s plus `finish()` joins to
`extract(text).content or ""` and the calls equal extract's (ids aside). Content that is only
whitespace is None (streaming: nothing).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from typing import Any, Literal

from common.api.limits import loads_bounded
from common.api.tools.types import ExtractedToolCalls, FunctionCall, ToolCall, ToolStreamDelta


class ToolCallStream(ABC):
    """One choice's output, fed delta by delta; `finish()` once at the end."""

    @abstractmethod
    def feed(self, delta_text: str) -> ToolStreamDelta: ...

    @abstractmethod
    def finish(self) -> ToolStreamDelta: ...


class ToolParser(ABC):
    """A model's tool-call format: the whole output at once, or a stream."""

    @abstractmethod
    def extract(self, text: str) -> ExtractedToolCalls: ...

    @abstractmethod
    def stream(self) -> ToolCallStream: ...


def _call_from_json(text: str, arguments_keys: tuple[str, ...]) -> ToolCall | None:
    """The call that `text` holds as one JSON object, or None if it holds none."""
    try:
        value = loads_bounded(text)
    except ValueError:  # not JSON, or too deep to be a call
        return None
    return call_from_object(value, arguments_keys)


def call_from_object(value: Any, arguments_keys: tuple[str, ...]) -> ToolCall | None:
    """`{"name": str, <one of arguments_keys>: object}` as a call (missing arguments: `{}`)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = next((value[key] for key in arguments_keys if key in value), None)
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = loads_bounded(arguments)
        except ValueError:
            return None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return None
    text = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(function=FunctionCall(name=value["name"], arguments=text))


def _content_or_none(text: str) -> str | None:
    return text if text.strip() else None


class _ContentGate:
    """Holds content back while all of it is whitespace, which the choice would not show."""

    def __init__(self):
        self._held = ""
        self._is_open = False

    def push(self, text: str) -> str:
        if self._is_open:
            return text
        self._held += text
        if not self._held.strip():
            return ""
        self._is_open = True
        text, self._held = self._held, ""
        return text


# --- hermes ----------------------------------------------------------------------------------

HERMES_START = "<tool_call>"
HERMES_END = "</tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_HERMES_KEYS = ("arguments", "parameters")


class HermesToolParser(ToolParser):
    def extract(self, text: str) -> ExtractedToolCalls:
        content: list[str] = []
        calls: list[ToolCall] = []
        position, is_after_call = 0, False
        for block in _HERMES_BLOCK.finditer(text):
            gap = text[position : block.start()]
            content.append(gap.lstrip() if is_after_call else gap)
            call = _call_from_json(block.group(1), _HERMES_KEYS)
            if call is None:
                content.append(block.group(0))
            else:
                calls.append(call)
            position, is_after_call = block.end(), call is not None
        tail = text[position:]
        content.append(tail.lstrip() if is_after_call else tail)
        return ExtractedToolCalls(_content_or_none("".join(content)), calls)

    def stream(self) -> ToolCallStream:
        return _HermesStream()


class _HermesStream(ToolCallStream):
    """States: text (holding only a suffix that may begin `<tool_call>`), or inside a block
    (holding it all until `</tool_call>`). After a valid call, leading whitespace is dropped."""

    def __init__(self):
        self._buffer = ""
        self._is_in_block = False
        self._is_after_call = False
        self._num_calls = 0
        self._gate = _ContentGate()

    def feed(self, delta_text: str) -> ToolStreamDelta:
        self._buffer += delta_text
        out = ToolStreamDelta()
        while self._step(out):
            pass
        return out

    def finish(self) -> ToolStreamDelta:
        out = ToolStreamDelta()
        if self._is_in_block:
            self._end_block(self._buffer[len(HERMES_START) :], self._buffer, out)
        else:
            self._emit_content(self._buffer.lstrip() if self._is_after_call else self._buffer, out)
        self._buffer = ""
        return out

    def _step(self, out: ToolStreamDelta) -> bool:
        """Consume what the buffer surely holds; False when the rest must wait for more text."""
        if self._is_in_block:
            end = self._buffer.find(HERMES_END, len(HERMES_START))
            if end < 0:
                return False
            block_end = end + len(HERMES_END)
            self._end_block(self._buffer[len(HERMES_START) : end], self._buffer[:block_end], out)
            self._buffer = self._buffer[block_end:]
            return True
        if self._is_after_call:
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return False
            self._is_after_call = False
        start = self._buffer.find(HERMES_START)
        if start >= 0:
            self._emit_content(self._buffer[:start], out)
            self._buffer, self._is_in_block = self._buffer[start:], True
            return True
        num_held = _num_prefix_chars(self._buffer, HERMES_START)
        self._emit_content(self._buffer[: len(self._buffer) - num_held], out)
        self._buffer = self._buffer[len(self._buffer) - num_held :]
        return False

    def _end_block(self, body: str, block: str, out: ToolStreamDelta) -> None:
        call = _call_from_json(body, _HERMES_KEYS)
        if call is None:
            self._emit_content(block, out)
        else:
            out.tool_calls.append(call.to_delta(self._num_calls))
            self._num_calls += 1
        self._is_in_block, self._is_after_call = False, call is not None

    def _emit_content(self, text: str, out: ToolStreamDelta) -> None:
        out.content += self._gate.push(text)


def _num_prefix_chars(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


# --- llama3_json -----------------------------------------------------------------------------

PYTHON_TAG = "<|python_tag|>"
_LLAMA3_KEYS = ("parameters", "arguments")


def _llama3_calls(text: str) -> list[ToolCall] | None:
    """The calls if all of `text` is `[<|python_tag|>] {call} [; {call}]...`, else None."""
    text = text.strip().removeprefix(PYTHON_TAG).lstrip()
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    while True:
        try:
            value, end = decoder.raw_decode(text)
        except json.JSONDecodeError:
            return None
        call = call_from_object(value, _LLAMA3_KEYS)
        if call is None:
            return None
        calls.append(call)
        rest = text[end:].lstrip()
        if not rest:
            return calls
        if not rest.startswith(";"):
            return None
        text = rest[1:].lstrip()  # NOTE: raw_decode does not skip leading whitespace


def _llama3_extract(text: str) -> ExtractedToolCalls:
    calls = _llama3_calls(text)
    if calls is None:
        return ExtractedToolCalls(_content_or_none(text), [])
    return ExtractedToolCalls(None, calls)


class Llama3JsonToolParser(ToolParser):
    def extract(self, text: str) -> ExtractedToolCalls:
        return _llama3_extract(text)

    def stream(self) -> ToolCallStream:
        return _Llama3JsonStream()


class _Llama3JsonStream(ToolCallStream):
    """The output is either all calls or all content: once its start rules calls out, the text
    flows as content; if it may be calls, everything waits for `finish()`."""

    def __init__(self):
        self._text = ""
        self._mode: Literal["undecided", "content", "calls"] = "undecided"

    def feed(self, delta_text: str) -> ToolStreamDelta:
        self._text += delta_text
        if self._mode == "content":
            return ToolStreamDelta(content=delta_text)
        if self._mode == "undecided":
            start = self._text.lstrip()
            if start.startswith(("{", PYTHON_TAG)):
                self._mode = "calls"
            elif start and not PYTHON_TAG.startswith(start):
                self._mode = "content"
                return ToolStreamDelta(content=self._text)
        return ToolStreamDelta()

    def finish(self) -> ToolStreamDelta:
        if self._mode == "content":
            return ToolStreamDelta()
        extracted = _llama3_extract(self._text)
        deltas = [call.to_delta(index) for index, call in enumerate(extracted.tool_calls)]
        return ToolStreamDelta(content=extracted.content or "", tool_calls=deltas)


PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}


def parser_for_template(template: str | None) -> str:
    """The parser a chat template implies: llama3_json for Llama 3's (its header tokens),
    hermes otherwise."""
    return "llama3_json" if template and "<|start_header_id|>" in template else "hermes"


def get_parser(name: str) -> ToolParser:
    """The parser vLLM names `name`; ValueError (a startup mistake) for an unknown one."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()
