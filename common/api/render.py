"""vLLM's render endpoints: what the engine would run for a request, without running it.

- `POST /v1/completions/render`: a /v1/completions body → a list, one item per prompt.
- `POST /v1/chat/completions/render`: a /v1/chat/completions body → one item.

Each item has the shape of vLLM 0.32's `GenerateRequest`, as its render endpoints answer it
(vllm/entrypoints/scale_out/token_in_token_out/protocol.py): chiefly `token_ids`, the prompt's
token ids after any chat template, and `sampling_params`. KV-aware routers ask for them before
each decision (vllm-router 0.1.17's `kv_aware` reads `token_ids` and hashes them into blocks to
match against the workers' KV events; docs/interop.md).

The ids are the ones generation prefills: both come from the same preparation (`prepare_prompts`,
`prepare_chat`), validation included, so a body that generation answers with a 400 gets the same
400 here. The fields vLLM fills for what this server lacks (multimodal features, reasoning
parsers, cache salts, priorities, token offsets) are null or their defaults.
"""

from __future__ import annotations

from typing import Literal, TypeVar

from fastapi import FastAPI, Request
from pydantic import BaseModel

from common.api.chat import prepare_chat
from common.api.completions import prepare_prompts
from common.api.http import json_body_openapi, read_json_body
from common.api.limits import check_body
from common.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    StreamOptions,
    parse_request,
)
from common.api.serving import PreparedPrompt
from common.api.state import ServerState
from common.engine.sampling_params import SamplingParams

BodyT = TypeVar("BodyT", CompletionRequest, ChatCompletionRequest)

COMPLETIONS_RENDER = "/v1/completions/render"
CHAT_RENDER = "/v1/chat/completions/render"


class RenderedRequest(BaseModel):
    """vLLM's `GenerateRequest`: a prompt as token ids, and how to sample its continuation."""

    request_id: str
    token_ids: list[int]
    token_offsets: None = None
    features: None = None
    content_parts: None = None
    sampling_params: SamplingParams
    model: str | None
    reasoning_ended: None = None
    reasoning_parser_kwargs: None = None
    return_token_ids: None = None
    output_mode: Literal["tokens"] = "tokens"
    stream: bool
    stream_options: StreamOptions | None
    cache_salt: None = None
    priority: int = 0
    kv_transfer_params: None = None
    ec_transfer_params: None = None


def install_render_routes(app: FastAPI, state: ServerState) -> None:
    @app.post(COMPLETIONS_RENDER, openapi_extra=json_body_openapi(CompletionRequest))
    async def render_completion(request: Request) -> list[RenderedRequest]:
        req = await _parse(state, request, CompletionRequest, COMPLETIONS_RENDER)
        prompts = await prepare_prompts(state, state.require_ready(), req)
        base_id = f"cmpl-{request.state.request_id}"
        return [
            _rendered(f"{base_id}-{i}" if len(prompts) > 1 else base_id, prompt, req)
            for i, prompt in enumerate(prompts)
        ]

    @app.post(CHAT_RENDER, openapi_extra=json_body_openapi(ChatCompletionRequest))
    async def render_chat_completion(request: Request) -> RenderedRequest:
        req = await _parse(state, request, ChatCompletionRequest, CHAT_RENDER)
        prompt = await prepare_chat(state, state.require_ready(), req)
        return _rendered(f"chatcmpl-{request.state.request_id}", prompt, req)


async def _parse(state: ServerState, request: Request, model: type[BodyT], endpoint: str) -> BodyT:
    """The body as `model`, as the generation routes parse it: 503 until ready, 413, 400, and
    404 for a model this server does not serve."""
    state.require_ready()
    limits = state.cfg.limits
    body = await read_json_body(
        request, state.cfg.max_body_bytes, limits.max_json_depth, limits.max_fields
    )
    check_body(body, is_chat=model is ChatCompletionRequest, limits=limits)
    req = parse_request(model, body)
    state.ignored_fields.note(req.ignored_fields, endpoint)
    state.check_model(req.model)
    return req


def _rendered(
    request_id: str, prompt: PreparedPrompt, req: CompletionRequest | ChatCompletionRequest
) -> RenderedRequest:
    return RenderedRequest(
        request_id=request_id,
        token_ids=prompt.token_ids,
        sampling_params=prompt.params,
        model=req.model,
        stream=req.stream,
        stream_options=req.stream_options if req.stream else None,
    )
