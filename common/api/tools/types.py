"""The messages a tool call travels in: the request's tools (`ChatTool`), a call as OpenAI answers
it (`ToolCall`, whole or as a stream's `DeltaToolCall`), and what a parser gives back."""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field


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
