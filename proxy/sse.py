"""Server-sent events the proxy writes itself: P's first token as the stream's first chunk(s),
and an error event when an upstream fails after the stream has begun. D's events pass through
proxy/journey/relay.py, which reads them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator

from starlette.responses import Response

from common.api.errors import StreamError, StreamErrorInfo

DONE = b"data: [DONE]\n\n"


def event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def error_event(
    message: str, status: int = 502, error_type: str = "server_error", code: str = "upstream_failed"
) -> bytes:
    """The proxy's own error inside a stream, in the workers' shape (common/api/errors.py: the
    `openai` client raises it as an APIError): `code` a stable name, `status` the HTTP status
    it would have had."""
    info = StreamErrorInfo(message=message, type=error_type, code=code, status=status)
    return event(StreamError(error=info).model_dump()) + DONE


def passed_on_event(error: dict, status: int) -> bytes:
    """A worker's error answer (`error`, the "error" of its body; `status`, its HTTP status) as
    the event that ends a stream the proxy had already begun: as the worker wrote it, with the
    status it had."""
    return event({"error": {**error, "status": status}}) + DONE


def first_token_events(is_chat: bool, request_id: str, answer: dict, body: dict) -> bytes:
    """P's answer (one token) as the chunks a worker would have streamed first: for chat, the
    role chunk and then the content; for completions, the text."""
    choice = (answer.get("choices") or [{}])[0]
    created = int(answer.get("created") or time.time())
    model = answer.get("model") or body.get("model")
    token_ids = body.get("return_token_ids") and choice.get("token_ids")
    if is_chat:
        head = {
            "id": f"chatcmpl-{request_id}",
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
        }
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        if body.get("return_token_ids") and answer.get("prompt_token_ids") is not None:
            head_role = {**head, "prompt_token_ids": answer["prompt_token_ids"]}
        else:
            head_role = head
        text = (choice.get("message") or {}).get("content") or ""
        content = {"index": 0, "delta": {"content": text}, "finish_reason": None}
        if token_ids:
            content["token_ids"] = token_ids
        return event({**head_role, "choices": [role]}) + event({**head, "choices": [content]})
    out = {"index": 0, "text": choice.get("text") or "", "logprobs": None, "finish_reason": None}
    if token_ids:
        out["token_ids"] = token_ids
        if choice.get("prompt_token_ids") is not None:
            out["prompt_token_ids"] = choice["prompt_token_ids"]
    head = {"id": f"cmpl-{request_id}", "object": "text_completion", "created": created}
    return event({**head, "model": model, "choices": [out]})


class EventStreamResponse(Response):
    """Sends an async generator's chunks as they come, the headers with the first. A client
    that goes away cancels the generator at once (its `finally` closes the upstream stream),
    with one watcher task per stream instead of Starlette's task group."""

    def __init__(self, chunks: AsyncGenerator[bytes, None]):
        self.chunks = chunks
        self.status_code = 200
        self.media_type = "text/event-stream"
        self.background = None
        self.init_headers(None)

    async def __call__(self, scope, receive, send) -> None:
        task = asyncio.current_task()
        is_done = False

        def on_disconnect(watcher: asyncio.Task) -> None:
            if not (is_done or watcher.cancelled()):
                task.cancel()

        watcher = asyncio.create_task(_until_disconnect(receive))
        watcher.add_done_callback(on_disconnect)
        try:
            # NOTE: the generator starts before the first await a leaving client can interrupt
            # (a server's send may wait to drain): a generator that never started would never
            # run its `finally`, which frees what the request holds upstream
            chunk = await anext(self.chunks, None)
            start = {"type": "http.response.start", "status": 200, "headers": self.raw_headers}
            await send(start)
            while chunk is not None:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                chunk = await anext(self.chunks, None)
            await send({"type": "http.response.body", "body": b""})
        except asyncio.CancelledError:
            if not watcher.done() or watcher.cancelled():
                raise  # cancelled from outside, not by the client leaving
            task.uncancel()
        finally:
            is_done = True
            watcher.cancel()
            await self.chunks.aclose()


async def _until_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
