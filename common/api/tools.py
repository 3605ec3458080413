"""OpenAI tool calling, the pure parts: output parsers, forced-choice schemas, prompt rendering.

Parsers (`PARSERS`, named as vLLM's `--tool-call-parser`; `get_parser(name)`):
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

Forced tool choice (vLLM's way: the grammar forces the output, then it is read back):
    "required"  `required_tool_schema` -> `tool_calls_from_required`
    named       `named_tool_schema` -> `tool_call_from_named`
`check_tool_choice` validates the request's `tool_choice` into a `ToolChoice` (400s otherwise).

Rendering: `messages_for_template` turns a history into the dicts `Tokenizer.apply_chat_template`
takes. For a template without tool support (`template_supports_tools`), the tools are described
in a system message in the Hermes style, and past calls and results become text blocks, so the
model still sees them.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import secrets
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from common.api.errors import InvalidRequestError
from common.api.limits import loads_bounded


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    """One of a chat request's `tools` (protocol.py's request models use it)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class HistoryMessage(Protocol):
    """What the rendering reads of a history message (protocol.py's `ChatMessage`)."""

    role: str
    name: str | None
    tool_calls: list[dict[str, Any]] | None

    @property
    def text(self) -> str: ...

    def model_dump(self, *, exclude_none: bool = False) -> dict[str, Any]: ...


_ID_ALPHABET = string.ascii_letters + string.digits


def tool_call_id() -> str:
    """`call_` and 24 random letters and digits, as OpenAI's ids look."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


class FunctionCall(BaseModel):
    name: str
    arguments: str  # the JSON text of the arguments object


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ToolCall(BaseModel):
    id: str = Field(default_factory=tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall

    def to_delta(self, index: int) -> DeltaToolCall:
        """The whole call as one stream delta, the `index`-th call of the choice."""
        function = DeltaFunctionCall(name=self.function.name, arguments=self.function.arguments)
        return DeltaToolCall(index=index, id=self.id, type=self.type, function=function)


@dataclass(frozen=True)
class ExtractedToolCalls:
    content: str | None
    tool_calls: list[ToolCall]


@dataclass
class ToolStreamDelta:
    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Parsers


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
    return _call_from_object(value, arguments_keys)


def _call_from_object(value: Any, arguments_keys: tuple[str, ...]) -> ToolCall | None:
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
        call = _call_from_object(value, _LLAMA3_KEYS)
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


# ---------------------------------------------------------------------------------------------
# tool_choice and the schemas that force it

ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolChoice:
    mode: Literal["none", "auto", "required", "named"]
    name: str | None = None  # the forced function, with mode "named"

    def __post_init__(self):
        assert (self.mode == "named") == (self.name is not None), f"bad tool choice {self}"


def check_tool_choice(tools: list[ChatTool] | None, tool_choice: str | dict | None) -> ToolChoice:
    """The request's `tool_choice` checked against its `tools`; a 400 naming tool_choice if bad.

    Unset, it is "auto" with tools and "none" without (OpenAI's rule); "auto" without tools is
    "none" too, as there is nothing to call.
    """
    if tool_choice is None or tool_choice == "auto":
        return ToolChoice("auto" if tools else "none")
    if tool_choice == "none":
        return ToolChoice("none")
    if tool_choice == "required":
        if not tools:
            raise _choice_error('tool_choice "required" needs tools')
        return ToolChoice("required")
    if isinstance(tool_choice, str):
        raise _choice_error(
            f"tool_choice {tool_choice!r} is not supported: use none, auto, required "
            'or {"type": "function", "function": {"name": ...}}'
        )
    name = _named_choice(tool_choice)
    _find_tool(tools, name)
    return ToolChoice("named", name)


def _named_choice(tool_choice: dict) -> str:
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if tool_choice.get("type") != "function" or not isinstance(name, str):
        raise _choice_error(
            'tool_choice must be none, auto, required or {"type": "function", '
            '"function": {"name": ...}}'
        )
    return name


def _find_tool(tools: list[ChatTool] | None, name: str) -> ChatTool:
    for tool in tools or []:
        if tool.function.name == name:
            return tool
    if not tools:
        raise _choice_error(f"tool_choice names function {name!r} but the request has no tools")
    raise _choice_error(f"tool_choice names function {name!r}, which is not among the tools")


def _choice_error(message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param="tool_choice")


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters or ANY_OBJECT


def required_tool_schema(tools: list[ChatTool], parallel_tool_calls: bool | None) -> dict:
    """A JSON schema of `[{"name": ..., "parameters": {...}}, ...]`, calls of the given tools
    (one call only when parallel_tool_calls is False)."""
    assert tools, "tool_choice 'required' without tools is refused by check_tool_choice"
    call_schemas = [
        {
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": _parameters(tool),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": call_schemas},
    }
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


def named_tool_schema(tools: list[ChatTool] | None, name: str) -> dict:
    """The JSON schema of the arguments of function `name` (a 400 if no tool has that name)."""
    return _parameters(_find_tool(tools, name))


def tool_calls_from_required(text: str) -> list[ToolCall]:
    """The calls in an output forced by `required_tool_schema`; [] if it is not such an array
    (the output was cut short, e.g. by max_tokens): the caller then sends the text as content."""
    try:
        value = loads_bounded(text)
    except ValueError:  # also: nested deeper than any call's arguments may be
        return []
    if not isinstance(value, list):
        return []
    calls = [_call_from_object(item, ("parameters",)) for item in value]
    return [] if None in calls else calls  # type: ignore[return-value]


def tool_call_from_named(name: str, text: str) -> ToolCall:
    """The call of `name` whose arguments are an output forced by `named_tool_schema`; an
    output that is not a JSON object (cut short) is passed on as the arguments text as it is."""
    try:
        arguments = json.dumps(loads_bounded(text), ensure_ascii=False)
    except ValueError:
        arguments = text
    return ToolCall(function=FunctionCall(name=name, arguments=arguments))


# ---------------------------------------------------------------------------------------------
# Reading one choice's output by the request's tool choice


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


# ---------------------------------------------------------------------------------------------
# Rendering a history with tools

_JINJA_CODE = re.compile(r"\{[{%](.*?)[%}]\}", re.DOTALL)
_TOOLS_NAME = re.compile(r"\btools\b|\btool_calls\b")


def template_supports_tools(template: str) -> bool:
    """Whether the jinja template's code (not its text) reads `tools` or `tool_calls`."""
    return any(_TOOLS_NAME.search(code) for code in _JINJA_CODE.findall(template))


def messages_for_template(
    messages: list[HistoryMessage], tools: list[ChatTool] | None, supports_tools: bool
) -> list[dict]:
    """The history as plain dicts for `Tokenizer.apply_chat_template`, every content a string.

    A template with tool support gets the messages as they are (arguments parsed to objects,
    as such templates `tojson` them) and the tools through its `tools` variable; one without
    gets the tools described in a system message and calls and results as text blocks.
    """
    if supports_tools:
        return [_message_dict(message) for message in messages]
    plain = [_message_as_text(message) for message in messages]
    if not tools:
        return plain
    system = tools_system_prompt(tools)
    if plain and plain[0]["role"] == "system":
        first = plain[0]["content"]
        plain[0]["content"] = f"{first}\n\n{system}" if first else system
        return plain
    return [{"role": "system", "content": system}, *plain]


def _message_dict(message: HistoryMessage) -> dict:
    plain = message.model_dump(exclude_none=True)
    plain["content"] = message.text
    if message.tool_calls:
        plain["tool_calls"] = [_with_parsed_arguments(call) for call in message.tool_calls]
    return plain


def _with_parsed_arguments(call: dict[str, Any]) -> dict[str, Any]:
    call = copy.deepcopy(call)
    function = call.get("function")
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        # not JSON: the template gets the text as the client sent it
        with contextlib.suppress(ValueError):
            function["arguments"] = loads_bounded(function["arguments"])
    return call


def _message_as_text(message: HistoryMessage) -> dict:
    content = message.text
    if message.role == "tool":
        content = f"<tool_response>\n{content}\n</tool_response>"
    elif message.tool_calls:
        blocks = "\n".join(_call_block(call) for call in message.tool_calls)
        content = f"{content}\n{blocks}" if content else blocks
    plain = {"role": message.role, "content": content}
    if message.name is not None:
        plain["name"] = message.name
    return plain


def _call_block(call: dict[str, Any]) -> str:
    """A past call as the Hermes block the model is asked to write."""
    function = _with_parsed_arguments(call).get("function") or {}
    payload = {"name": function.get("name"), "arguments": function.get("arguments", {})}
    return f"{HERMES_START}\n{json.dumps(payload, ensure_ascii=False)}\n{HERMES_END}"


def tools_system_prompt(tools: list[ChatTool]) -> str:
    """The tools and how to call them, in the Hermes format the `hermes` parser reads."""
    signatures = "\n".join(
        json.dumps(tool.model_dump(exclude_none=True), ensure_ascii=False) for tool in tools
    )
    return (
        "You can call functions to help with the user's request. Their signatures, as JSON, "
        f"are inside <tools></tools>:\n<tools>\n{signatures}\n</tools>\n\n"
        "To call a function, answer with one block per call:\n"
        f'{HERMES_START}\n{{"name": <function name>, "arguments": <the arguments as a JSON '
        f"object>}}\n{HERMES_END}\n"
        "Each result comes back to you inside <tool_response></tool_response>."
    )
