"""OpenAI-compatible response objects (with vLLM's extensions); see `common.api.protocol`.

Dump every one with `model.model_dump_json(exclude_none=True)`. Optional fields left at None
vanish, as in OpenAI's objects, except in stream chunks, which always carry `"finish_reason": null`
and `"logprobs": null` (per choice) and `"usage": null` (per chunk), as OpenAI's streams do.
`kv_transfer_params` is an opaque dict: None values inside it are kept.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field, model_serializer

from common.api.logprobs import ChatLogprobs, CompletionLogprobs
from common.api.tools import DeltaToolCall, ToolCall


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


_NULLS_KEPT = frozenset({"finish_reason", "logprobs", "usage"})  # as in OpenAI's stream chunks


def _now() -> int:
    return int(time.time())


class _StreamPart(BaseModel):
    """Writes `null` for its fields in `_NULLS_KEPT`, even when dumped with exclude_none=True."""

    @model_serializer(mode="wrap")
    def _keep_nulls(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        for name in _NULLS_KEPT.intersection(type(self).model_fields):
            data.setdefault(name, None)
        return data


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def from_counts(
        cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
    ) -> UsageInfo:
        details = (
            None if cached_tokens is None else PromptTokensDetails(cached_tokens=cached_tokens)
        )
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=details,
        )


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM: the stop string or token id that ended it
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    token_ids: list[int] | None = None  # with return_token_ids


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = None


class CompletionStreamChoice(CompletionChoice, _StreamPart):
    pass


class CompletionStreamResponse(_StreamPart):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionStreamChoice] = []
    usage: UsageInfo | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    kv_transfer_params: dict[str, Any] | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(_StreamPart):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionStreamResponse(_StreamPart):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice] = []
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # first chunk, with return_token_ids


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "pdserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = []
