"""A history with tools rendered for the chat template: `messages_for_template` turns it into the
dicts `Tokenizer.apply_chat_template` takes. For a template without tool support
(`template_supports_tools`), the tools are described in a system message in the Hermes style, and
past calls and results become text blocks, so the model still sees them.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
from typing import Any

from common.api.limits import loads_bounded
from common.api.tools.parsers import HERMES_END, HERMES_START
from common.api.tools.types import ChatTool, HistoryMessage

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
