"""The OpenAI generation routes: parse the body ourselves (413 / 400 in OpenAI's shape), check
it against the request limits (common/api/limits.py), then hand over to the completions or chat
handler."""

from __future__ import annotations

from fastapi import FastAPI, Request

from common.api.chat import create_chat_completion
from common.api.completions import create_completion
from common.api.http import json_body_openapi, read_json_body
from common.api.limits import check_body
from common.api.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from common.api.state import ServerState


def install_openai_routes(app: FastAPI, state: ServerState) -> None:
    def _read_body(request: Request):
        limits = state.cfg.limits
        return read_json_body(
            request, state.cfg.max_body_bytes, limits.max_json_depth, limits.max_fields
        )

    @app.post("/v1/completions", openapi_extra=json_body_openapi(CompletionRequest))
    async def completions(request: Request):
        state.require_ready()
        with state.arriving(request):
            body = await _read_body(request)
            check_body(body, is_chat=False, limits=state.cfg.limits)
            req = parse_request(CompletionRequest, body)
            state.ignored_fields.note(req.ignored_fields, "/v1/completions")
            return await create_completion(state, request, req)

    @app.post("/v1/chat/completions", openapi_extra=json_body_openapi(ChatCompletionRequest))
    async def chat_completions(request: Request):
        state.require_ready()
        with state.arriving(request):
            body = await _read_body(request)
            check_body(body, is_chat=True, limits=state.cfg.limits)
            req = parse_request(ChatCompletionRequest, body)
            state.ignored_fields.note(req.ignored_fields, "/v1/chat/completions")
            return await create_chat_completion(state, request, req)
