"""The request's `tool_choice`, and the schemas that force it (vLLM's way: the grammar forces the
output, then it is read back):
    "required"  `required_tool_schema` -> `tool_calls_from_required`
    named       `named_tool_schema` -> `tool_call_from_named`
`check_tool_choice` validates the request's `tool_choice` into a `ToolChoice` (400s otherwise).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from common.api.errors import InvalidRequestError
from common.api.limits import loads_bounded
from common.api.tools.parsers import call_from_object
from common.api.tools.types import ChatTool, FunctionCall, ToolCall

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
    calls = [call_from_object(item, ("parameters",)) for item in value]
    return [] if None in calls else calls  # type: ignore[return-value]


def tool_call_from_named(name: str, text: str) -> ToolCall:
    """The call of `name` whose arguments are an output forced by `named_tool_schema`; an
    output that is not a JSON object (cut short) is passed on as the arguments text as it is."""
    try:
        arguments = json.dumps(loads_bounded(text), ensure_ascii=False)
    except ValueError:
        arguments = text
    return ToolCall(function=FunctionCall(name=name, arguments=arguments))
