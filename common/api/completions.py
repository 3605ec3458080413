"""POST /v1/completions: prompts (text or token ids, one or a batch) → completions.

Choice indices follow OpenAI: prompt i's j-th sample is choice `i * n + j`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from common.api.errors import InvalidRequestError
from common.api.kv_params import resolve_kv_params
from common.api.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    UsageInfo,
    completion_logprobs,
)
from common.api.serving import (
    Job,
    PreparedPrompt,
    admit,
    check_structured,
    check_token_ids,
    final_kv_params,
    new_request_id,
    num_chars_sent_before,
    num_tokens_sent_before,
    resolve_resume,
    respond,
    run_jobs,
    sse,
    validate_params,
    wants_usage,
)
from common.api.state import ServerState
from common.engine.client import EngineClient


async def create_completion(
    state: ServerState, request: Request, req: CompletionRequest
) -> Response:
    engine = state.require_ready()
    state.check_model(req.model)
    prepared = await prepare_prompts(state, engine, req)
    jobs = [
        Job(new_request_id(request), p.token_ids, p.params, choice_offset=i * req.n)
        for i, p in enumerate(prepared)
    ]
    jobs[0].resume = await resolve_resume(state, request, req.resume, prepared)
    if req.kv_transfer_params is not None and len(jobs) > 1:
        raise InvalidRequestError(
            "kv_transfer_params need a single prompt", param="kv_transfer_params"
        )
    jobs[0].kv_transfer_params = await resolve_kv_params(state, req.kv_transfer_params, request)
    admit(state, engine, jobs, request)
    response_id = f"cmpl-{request.state.request_id}"
    outputs = run_jobs(state, engine, jobs)
    stream = _stream(state, req, response_id, jobs, outputs) if req.stream else None
    return await respond(
        request,
        outputs,
        stream,
        lambda items: _response(state, req, response_id, jobs, items),
        resumed=jobs[0].resume is not None,
    )


async def prepare_prompts(
    state: ServerState, engine: EngineClient, req: CompletionRequest
) -> list[PreparedPrompt]:
    """What the engine runs for each prompt, validated (400 if bad): its token ids and sampling
    params. /v1/completions/render answers with the same."""
    prepared = []
    for prompt in req.prompts:
        ids = await state.run_blocking(_prompt_ids, engine, prompt)
        params = req.to_sampling_params(engine.max_model_len - len(ids))
        validate_params(params, engine.vocab_size)
        await check_structured(engine, params, req.structured_param)
        prepared.append(PreparedPrompt(ids, params))
    return prepared


def _prompt_ids(engine: EngineClient, prompt: str | list[int]) -> list[int]:
    """The prompt's token ids, each in the vocabulary (400 if not). Blocking: tokenizes."""
    ids = engine.tokenize(prompt)
    check_token_ids(ids, engine.vocab_size, "prompt")
    return ids


def _response(
    state: ServerState, req: CompletionRequest, response_id: str, jobs: list[Job], items: list
) -> dict:
    tokenizer = state.engine.tokenizer
    finals = {}
    for job, out in items:
        for c in out.outputs:
            finals[job.choice_offset + c.index] = (job, c)
    choices = []
    for index in sorted(finals):
        job, c = finals[index]
        logprobs = (
            completion_logprobs(tokenizer, c.logprobs, 0) if req.logprobs is not None else None
        )
        choices.append(
            CompletionChoice(
                index=index,
                text=c.text,
                logprobs=logprobs,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                prompt_token_ids=job.prompt_token_ids if req.return_token_ids else None,
                token_ids=c.token_ids if req.return_token_ids else None,
            )
        )
    usage = _usage(jobs, sum(len(c.token_ids) for _, c in finals.values()))
    body = CompletionResponse(
        id=response_id,
        model=state.model_name,
        choices=choices,
        usage=usage,
        kv_transfer_params=final_kv_params(items),
    )
    return body.model_dump(exclude_none=True)


async def _stream(
    state: ServerState,
    req: CompletionRequest,
    response_id: str,
    jobs: list[Job],
    outputs: AsyncIterator,
) -> AsyncIterator[str]:
    tokenizer = state.engine.tokenizer
    num_chars: dict[int, int] = {}  # text offset per choice (a resumed one: from the client's)
    num_tokens = num_tokens_sent_before(jobs[0])
    created = int(time.time())  # one for every chunk of the stream, as OpenAI and vLLM
    async for job, out in outputs:
        for c in out.outputs:
            if not (c.delta_text or c.delta_token_ids or c.finish_reason):
                continue
            index = job.choice_offset + c.index
            first = index not in num_chars
            offset = num_chars[index] if not first else num_chars_sent_before(job)
            logprobs = (
                completion_logprobs(tokenizer, c.delta_logprobs, offset)
                if req.logprobs is not None
                else None
            )
            num_chars[index] = offset + len(c.delta_text)
            num_tokens += len(c.delta_token_ids)
            choice = CompletionStreamChoice(
                index=index,
                text=c.delta_text,
                logprobs=logprobs,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                prompt_token_ids=(job.prompt_token_ids if req.return_token_ids and first else None),
                token_ids=c.delta_token_ids if req.return_token_ids else None,
            )
            chunk = CompletionStreamResponse(
                id=response_id, created=created, model=state.model_name, choices=[choice]
            )
            yield sse(chunk.model_dump_json(exclude_none=True))
    if wants_usage(req):
        chunk = CompletionStreamResponse(
            id=response_id,
            created=created,
            model=state.model_name,
            choices=[],
            usage=_usage(jobs, num_tokens),
        )
        yield sse(chunk.model_dump_json(exclude_none=True))


def _usage(jobs: list[Job], completion_tokens: int) -> UsageInfo:
    return UsageInfo.from_counts(
        prompt_tokens=sum(len(j.prompt_token_ids) for j in jobs),
        completion_tokens=completion_tokens,
        cached_tokens=sum(j.num_cached_tokens for j in jobs),
    )
