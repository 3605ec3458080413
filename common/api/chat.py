"""POST /v1/chat/completions: messages → the chat template → one prompt with n choices."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from common.api.kv_params import resolve_kv_params
from common.api.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
    chat_logprobs,
)
from common.api.serving import (
    Job,
    PreparedPrompt,
    admit,
    check_structured,
    final_kv_params,
    new_request_id,
    num_tokens_sent_before,
    resolve_resume,
    respond,
    run_jobs,
    sse,
    validate_params,
    wants_usage,
)
from common.api.state import ServerState
from common.api.tools import ToolCallReader, get_parser, parser_for_template
from common.engine.client import EngineClient
from common.tokenizer import Tokenizer


async def create_chat_completion(
    state: ServerState, request: Request, req: ChatCompletionRequest
) -> Response:
    engine = state.require_ready()
    state.check_model(req.model)
    prompt = await prepare_chat(state, engine, req)
    job = Job(new_request_id(request), prompt.token_ids, prompt.params, choice_offset=0)
    job.resume = await resolve_resume(state, request, req.resume, [prompt])
    job.kv_transfer_params = await resolve_kv_params(state, req.kv_transfer_params, request)
    admit(state, engine, [job], request)
    response_id = f"chatcmpl-{request.state.request_id}"
    outputs = run_jobs(state, engine, [job])
    stream = _stream(state, req, response_id, job, outputs) if req.stream else None
    return await respond(
        request,
        outputs,
        stream,
        lambda items: _response(state, req, response_id, job, items),
        resumed=job.resume is not None,
    )


async def prepare_chat(
    state: ServerState, engine: EngineClient, req: ChatCompletionRequest
) -> PreparedPrompt:
    """What the engine runs for the messages, validated (400 if bad): the chat template's token
    ids and the sampling params. /v1/chat/completions/render answers with the same."""
    ids = await state.run_blocking(_prompt_ids, engine.tokenizer, req)
    params = req.to_sampling_params(engine.max_model_len - len(ids))
    validate_params(params, engine.vocab_size)
    await check_structured(engine, params, req.structured_param)
    return PreparedPrompt(ids, params)


def _prompt_ids(tokenizer: Tokenizer, req: ChatCompletionRequest) -> list[int]:
    """The rendered chat template's token ids (400 if it cannot render). Blocking."""
    return tokenizer.encode(req.render_prompt(tokenizer), add_special_tokens=False)


def _tool_reader(state: ServerState, req: ChatCompletionRequest) -> ToolCallReader:
    """How one choice's output is read for the request's tool choice."""
    template = state.engine.tokenizer.chat_template
    name = state.cfg.tool_call_parser or parser_for_template(template)
    return ToolCallReader(req.tool_choice_mode, get_parser(name))


def _response(
    state: ServerState, req: ChatCompletionRequest, response_id: str, job: Job, items: list
) -> dict:
    tokenizer = state.engine.tokenizer
    finals = {c.index: c for _, out in items for c in out.outputs}
    answers = {
        i: _tool_reader(state, req).whole(c.text, c.finish_reason) for i, c in finals.items()
    }
    choices = [
        ChatChoice(
            index=i,
            message=ChatResponseMessage(
                content=answers[i].content, tool_calls=answers[i].tool_calls or None
            ),
            logprobs=chat_logprobs(tokenizer, c.logprobs) if req.logprobs else None,
            finish_reason=answers[i].finish_reason,
            stop_reason=c.stop_reason,
            token_ids=c.token_ids if req.return_token_ids else None,
        )
        for i, c in sorted(finals.items())
    ]
    body = ChatCompletionResponse(
        id=response_id,
        model=state.model_name,
        choices=choices,
        usage=_usage(job, sum(len(c.token_ids) for c in finals.values())),
        prompt_token_ids=job.prompt_token_ids if req.return_token_ids else None,
        kv_transfer_params=final_kv_params(items),
    )
    return body.model_dump(exclude_none=True)


async def _stream(
    state: ServerState,
    req: ChatCompletionRequest,
    response_id: str,
    job: Job,
    outputs: AsyncIterator,
) -> AsyncIterator[str]:
    tokenizer = state.engine.tokenizer
    started: set[int] = set()
    readers: dict[int, ToolCallReader] = {}  # per choice: content and tool calls
    num_tokens = num_tokens_sent_before(job)
    created = int(time.time())  # one for every chunk of the stream, as OpenAI and vLLM

    def chunk(choice: ChatStreamChoice, **extra) -> str:
        body = ChatCompletionStreamResponse(
            id=response_id, created=created, model=state.model_name, choices=[choice], **extra
        )
        return sse(body.model_dump_json(exclude_none=True))

    async for _, out in outputs:
        for c in out.outputs:
            if c.index not in started:  # OpenAI: the role comes first, alone
                started.add(c.index)
                prompt_ids = job.prompt_token_ids if req.return_token_ids else None
                yield chunk(
                    ChatStreamChoice(
                        index=c.index, delta=DeltaMessage(role="assistant", content="")
                    ),
                    prompt_token_ids=prompt_ids if len(started) == 1 else None,
                )
            if not (c.delta_text or c.delta_token_ids or c.finish_reason):
                continue
            num_tokens += len(c.delta_token_ids)
            reader = readers.setdefault(c.index, _tool_reader(state, req))
            delta, finish_reason = reader.feed(c.delta_text), None
            if c.finish_reason is not None:
                last, finish_reason = reader.finish(c.finish_reason)
                delta.content += last.content
                delta.tool_calls += last.tool_calls
            shown = delta.content or delta.tool_calls or finish_reason
            if reader.is_holding and not (shown or req.return_token_ids or req.logprobs):
                continue  # the text is held back: it may be part of a tool call
            yield chunk(
                ChatStreamChoice(
                    index=c.index,
                    delta=DeltaMessage(
                        content=delta.content or None, tool_calls=delta.tool_calls or None
                    ),
                    logprobs=chat_logprobs(tokenizer, c.delta_logprobs) if req.logprobs else None,
                    finish_reason=finish_reason,
                    stop_reason=c.stop_reason,
                    token_ids=c.delta_token_ids if req.return_token_ids else None,
                )
            )
    if wants_usage(req):
        body = ChatCompletionStreamResponse(
            id=response_id,
            created=created,
            model=state.model_name,
            choices=[],
            usage=_usage(job, num_tokens),
        )
        yield sse(body.model_dump_json(exclude_none=True))


def _usage(job: Job, completion_tokens: int) -> UsageInfo:
    return UsageInfo.from_counts(
        prompt_tokens=len(job.prompt_token_ids),
        completion_tokens=completion_tokens,
        cached_tokens=job.num_cached_tokens,
    )
