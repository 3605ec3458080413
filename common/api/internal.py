"""Internal routes of a worker (not part of the OpenAI surface).

- `GET /internal/kv/handshake`: this worker's NIXL agent metadata, KV layout and compatibility
  hash, for a peer that will read from (or write to) its KV cache.
- `POST /internal/kv/release` `{"request_id"}` or `{"reservation_id"}`: end a prefill lease or
  a push reservation early (the other side gave up).
- `POST /internal/kv/reserve` `{"num_tokens"}` (or `{"completion": body}` / `{"chat": body}`, a
  client's request that this worker tokenizes): a decode worker reserves blocks for a push and
  answers the `push_to` target a prefill worker writes into.
- `POST /internal/kv/lease` `{"token_ids", "cache_salt"?}`: a decode worker holds the leading
  blocks of a prompt that it has cached (under that salt, as the request's own lookup would),
  for a prefill worker to read instead of computing them (the reverse pull); answers their
  `kv_transfer_params` and how many tokens they hold (0 and null: none are cached). The lease
  ends like a prefill lease (`/internal/kv/release` included).
- `GET /internal/kv-events`: where a router subscribes to this worker's KV events
  (`--kv-events-endpoint`): connectable endpoints, topic, block size and engine id; the
  endpoint is null when events are off (proxy/kv_events.py subscribes).

With `--internal-token`, every internal route refuses a request without the header
`X-Internal-Token: TOKEN` (401), and this worker sends it to its peers.

Every route reaches the engine through its client (common/engine/client.py), this worker's
own handshake included; meeting a peer's (fetch, check, add) is the client's too, which a
generation request reaches through api/kv_params.py.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from pydantic import BaseModel, Field, ValidationError

from common.api.errors import (
    AuthenticationError,
    InvalidRequestError,
    NotFoundError,
    UnavailableError,
)
from common.api.http import json_body_openapi, read_json_body
from common.api.protocol import (
    MAX_CACHE_SALT_CHARS,
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
)
from common.api.server_config import TOKEN_HEADER
from common.api.state import ServerState
from common.credentials import is_same_secret
from common.engine.client import EngineClient, NoFreeBlocksError
from common.kv_transfer.handshake import HandshakeInfo


class ReleaseRequest(BaseModel):
    request_id: str | None = None
    reservation_id: str | None = None


class ReserveRequest(BaseModel):
    num_tokens: int | None = Field(default=None, gt=0)
    completion: dict | None = None  # a client's /v1/completions body: its prompt's tokens
    chat: dict | None = None  # a client's /v1/chat/completions body


class LeaseRequest(BaseModel):
    token_ids: list[int] = Field(min_length=2)  # a prompt: at least one token is computed
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)


def check_internal_token(state: ServerState, request: Request) -> None:
    token = state.cfg.internal_token
    if token and not is_same_secret(request.headers.get(TOKEN_HEADER), token):
        raise AuthenticationError(f"internal routes need the cluster token ({TOKEN_HEADER})")


def local_handshake(state: ServerState) -> HandshakeInfo:
    """What a peer needs to move KV with this worker. Blocking (reads the model folder): the
    route runs it in the tokenize pool."""
    info = state.require_ready().handshake_info()
    if info is None:
        raise NotFoundError("this worker has no KV connector (--kv-connector none)")
    return info


def kv_events_source(state: ServerState) -> dict:
    """Where a router subscribes to this worker's KV events. A wildcard bind host becomes this
    worker's advertised host (`--kv-host`, else `--host`), so the address is one a peer can
    connect to. The endpoint is null when events are off, and when the publisher connects out
    (a host that is not a wildcard: a broker the router must know about itself) or publishes
    in-process; the replay endpoint is null without one. The engine id is new at each start:
    a router's index of this worker's blocks starts over when it changes."""
    config = state.require_ready().config
    events, host = config.kv_events, config.transfer.advertise_host
    endpoint = _connectable(events.endpoint, host) if _is_bound(events.endpoint) else None
    replay = _connectable(events.replay_endpoint, host) if endpoint else None
    return {
        "endpoint": endpoint,
        "replay_endpoint": replay,
        "topic": events.topic,
        "block_size": config.cache.block_size,
        "engine_id": config.transfer.engine_id,
    }


def _is_bound(endpoint: str | None) -> bool:
    """The publisher's rule (common/kv_cache/event_publisher.py): binds a wildcard or ipc."""
    return endpoint is not None and ("*" in endpoint or "::" in endpoint or "ipc://" in endpoint)


def _connectable(endpoint: str | None, host: str) -> str | None:
    if endpoint is None or not endpoint.startswith("tcp://"):
        return endpoint  # ipc://: a path on this host
    bound, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if bound in ("*", "[*]", "::", "[::]", "0.0.0.0"):
        bound = f"[{host}]" if ":" in host else host
    return f"tcp://{bound}:{port}"


def install_internal_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/internal/kv-events")
    async def kv_events(request: Request):
        check_internal_token(state, request)
        return kv_events_source(state)

    @app.get("/internal/kv/peers")
    async def peers(request: Request):
        check_internal_token(state, request)
        return {"num_peers": _with_connector(state).num_peers}

    @app.get("/internal/kv/handshake")
    async def handshake(request: Request):
        check_internal_token(state, request)
        return (await state.run_blocking(local_handshake, state)).model_dump()

    @app.post("/internal/kv/release", openapi_extra=json_body_openapi(ReleaseRequest))
    async def release(request: Request):
        check_internal_token(state, request)
        body = _parse(ReleaseRequest, await read_json_body(request, 4096))
        engine = _with_connector(state)
        if body.reservation_id is not None:
            released = await engine.release_reservation(body.reservation_id)
        elif body.request_id is not None:
            released = await engine.release_lease(body.request_id)
        else:
            raise InvalidRequestError("give request_id or reservation_id", param="request_id")
        return {"released": bool(released)}

    @app.post("/internal/kv/reserve", openapi_extra=json_body_openapi(ReserveRequest))
    async def reserve(request: Request):
        check_internal_token(state, request)
        body = _parse(ReserveRequest, await read_json_body(request, state.cfg.max_body_bytes))
        engine = _with_connector(state)
        num_tokens, token_ids, salt = await state.run_blocking(_prompt_tokens, engine, body)
        if num_tokens >= engine.max_model_len:  # never admitted: no use holding blocks
            raise InvalidRequestError(
                f"a prompt of {num_tokens} tokens leaves no room in max_model_len "
                f"{engine.max_model_len}",
                param="num_tokens",
            )
        try:
            target = await engine.reserve_push(num_tokens, token_ids, salt)
        except NoFreeBlocksError as e:
            raise UnavailableError(
                f"no KV blocks to reserve: {e}", headers={"Retry-After": "1"}
            ) from e
        return target.to_dict()  # the push_to a prefill worker writes into

    @app.post("/internal/kv/lease", openapi_extra=json_body_openapi(LeaseRequest))
    async def lease(request: Request):
        check_internal_token(state, request)
        body = _parse(LeaseRequest, await read_json_body(request, state.cfg.max_body_bytes))
        engine = _with_connector(state)
        if len(body.token_ids) > engine.max_model_len:
            raise InvalidRequestError(
                f"{len(body.token_ids)} token ids are more than max_model_len "
                f"{engine.max_model_len}",
                param="token_ids",
            )
        _check_token_ids(body.token_ids, engine.vocab_size, "token_ids")
        params = await engine.lease_prefix(body.token_ids, body.cache_salt)
        num_tokens = len(params["remote_block_ids"]) * engine.block_size if params else 0
        return {"kv_transfer_params": params, "num_tokens": num_tokens}


def _prompt_tokens(
    engine: EngineClient, body: ReserveRequest
) -> tuple[int, list[int] | None, str | None]:
    """The prompt's length in tokens, its token ids (None when only the length is given) and
    its `cache_salt`; 400 for a bad body. Blocking (tokenizes, renders chat templates): the route
    runs it in the tokenize pool."""
    if body.num_tokens is not None:
        return body.num_tokens, None, None
    if body.completion is not None:
        req = parse_request(CompletionRequest, body.completion)
        if len(req.prompts) != 1:
            raise InvalidRequestError("a push reserves for a single prompt", param="completion")
        prompt = req.prompts[0]
        ids = engine.tokenize(prompt)
    elif body.chat is not None:
        req = parse_request(ChatCompletionRequest, body.chat)
        text = req.render_prompt(engine.tokenizer)
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
    else:
        raise InvalidRequestError("give num_tokens, completion or chat", param="num_tokens")
    _check_token_ids(ids, engine.vocab_size, "completion.prompt")
    return len(ids), ids, req.cache_salt


def _check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    """400 for a token id the model has not (the prefix cache keys them as int32).
    NOTE: serving.check_token_ids's twin; serving imports this module."""
    if not all(0 <= t < vocab_size for t in ids):
        raise InvalidRequestError(f"token ids must be in [0, {vocab_size})", param=param)


def _parse(model, body: dict):
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        raise InvalidRequestError(first["msg"], param=".".join(map(str, first["loc"]))) from e


def _with_connector(state: ServerState) -> EngineClient:
    engine = state.require_ready()
    if not engine.has_connector:
        raise NotFoundError("this worker has no KV connector (--kv-connector none)")
    return engine
