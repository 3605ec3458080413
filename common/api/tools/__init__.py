"""OpenAI tool calling, the pure parts, one module a role:

    types.py    the messages a call travels in (`ChatTool`, `ToolCall`, `DeltaToolCall`)
    parsers.py  a model's output read back into calls, whole or streamed (`PARSERS`, `get_parser`)
    choice.py   the request's `tool_choice` checked, and the schemas that force "required"/named
    reader.py   one choice's output read as its tool choice asks (`ToolCallReader`)
    prompt.py   a history with tools rendered for the chat template (`messages_for_template`)

The routes (common/api/chat.py, protocol.py, responses.py) import what they use from here.
"""

from common.api.tools.choice import (
    ToolChoice,
    check_tool_choice,
    named_tool_schema,
    required_tool_schema,
    tool_call_from_named,
    tool_calls_from_required,
)
from common.api.tools.parsers import PARSERS, ToolParser, get_parser, parser_for_template
from common.api.tools.prompt import messages_for_template, template_supports_tools
from common.api.tools.reader import ChoiceCalls, ToolCallReader
from common.api.tools.types import (
    ChatTool,
    DeltaToolCall,
    ExtractedToolCalls,
    FunctionDefinition,
    ToolCall,
)

__all__ = [
    "PARSERS",
    "ChatTool",
    "ChoiceCalls",
    "DeltaToolCall",
    "ExtractedToolCalls",
    "FunctionDefinition",
    "ToolCall",
    "ToolCallReader",
    "ToolChoice",
    "ToolParser",
    "check_tool_choice",
    "get_parser",
    "messages_for_template",
    "named_tool_schema",
    "parser_for_template",
    "required_tool_schema",
    "template_supports_tools",
    "tool_call_from_named",
    "tool_calls_from_required",
]
