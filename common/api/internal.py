"""Internal routes of a worker (not part of the OpenAI surface) and the peer handshake.

- `GET /internal/kv/handshake`: this worker's NIXL agent metadata, KV layout and compatibility
  hash, for a peer that will read from (or write to) its KV cache.
- `POST /internal/kv/release` `{"request_id"}` or `{"reservation_id"}`: end a prefill lease or
  a push reservation early (the other side gave up).
- `POST /internal/kv/reserve` `{"num_tokens"}` (or `{"completion": body}` / `{"chat": body}`, a
  client's request that this worker tokenizes): a decode worker reserves blocks for a push and
  answers the `push_to` target a prefill worker writes into.
- `GET /internal/kv-events`: where a router subscribes to this worker's KV events
  (`--kv-events-endpoint`): connectable endpoints, topic, block size and engine id; the
  endpoint is null when events are off (proxy/kv_events.py subscribes).

With `--internal-token`, every internal route refuses a request without the header
`X-Internal-Token: TOKEN` (401), and this worker sends it to its peers.

`ensure_peer` runs on a decode worker before it admits a remote-prefill request: it handshakes
with the prefill worker once per engine id (a restarted peer has a new id) and refuses an
incompatible one with a message that names what differs.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
from fastapi import FastAPI, Request
from pydantic import BaseModel, Field, ValidationError

from common.api.errors import (
    AuthenticationError,
    InvalidRequestError,
    NotFoundError,
    UnavailableError,
)
from common.api.http import json_body_openapi, read_json_body
from common.api.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from common.api.state import ServerState
from common.credentials import is_same_secret
from common.kv_cache.block_pool import NoFreeBlocksError
from common.kv_transfer.handshake import (
    HandshakeInfo,
    compat_fields,
    compat_hash,
    encode_metadata,
    explain_mismatch,
)
from common.kv_transfer.params import KVTransferParamsError, RemotePrefill, push_target

logger = logging.getLogger(__name__)


class ReleaseRequest(BaseModel):
    request_id: str | None = None
    reservation_id: str | None = None


class ReserveRequest(BaseModel):
    num_tokens: int | None = Field(default=None, gt=0)
    completion: dict | None = None  # a client's /v1/completions body: its prompt's tokens
    chat: dict | None = None  # a client's /v1/chat/completions body


TOKEN_HEADER = "X-Internal-Token"


def check_internal_token(state: ServerState, request: Request) -> None:
    token = state.cfg.internal_token
    if token and not is_same_secret(request.headers.get(TOKEN_HEADER), token):
        raise AuthenticationError(f"internal routes need the cluster token ({TOKEN_HEADER})")


def token_headers(state: ServerState) -> dict[str, str]:
    token = state.cfg.internal_token
    return {TOKEN_HEADER: token} if token else {}


def local_handshake(state: ServerState) -> HandshakeInfo:
    """What a peer needs to move KV with this worker. Blocking (reads the model folder): the
    route runs it in the tokenize pool."""
    engine = state.require_ready().engine
    info = engine.connector and engine.connector.peer_info()
    if info is None:
        raise NotFoundError("this worker has no KV connector (--kv-connector none)")
    fields = _compat(engine)
    return HandshakeInfo(
        engine_id=engine.config.transfer.engine_id,
        protocol_version=fields["protocol_version"],
        compat_hash=compat_hash(fields),
        compat=fields,
        layout=info.layout,
        agent_metadata=encode_metadata(info.metadata),
    )


def _compat(engine) -> dict:
    return compat_fields(
        engine.config.model.model_dir,
        str(engine.config.model.torch_dtype),
        engine.arch.num_layers,
        engine.arch.num_kv_heads,
        engine.arch.head_dim,
        engine.config.cache.block_size,
    )


def kv_events_source(state: ServerState) -> dict:
    """Where a router subscribes to this worker's KV events. A wildcard bind host becomes this
    worker's advertised host (`--kv-host`, else `--host`), so the address is one a peer can
    connect to. The endpoint is null when events are off, and when the publisher connects out
    (a host that is not a wildcard: a broker the router must know about itself) or publishes
    in-process; the replay endpoint is null without one. The engine id is new at each start:
    a router's index of this worker's blocks starts over when it changes."""
    config = state.require_ready().engine.config
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
        _, connector = _connector(state)
        return {"num_peers": connector.num_peers}

    @app.get("/internal/kv/handshake")
    async def handshake(request: Request):
        check_internal_token(state, request)
        return (await state.run_blocking(local_handshake, state)).model_dump()

    @app.post("/internal/kv/release", openapi_extra=json_body_openapi(ReleaseRequest))
    async def release(request: Request):
        check_internal_token(state, request)
        body = _parse(ReleaseRequest, await read_json_body(request, 4096))
        engine, connector = _connector(state)
        if body.reservation_id is not None:
            fn, key = connector.release_reservation, body.reservation_id
        elif body.request_id is not None:
            fn, key = connector.release_lease, body.request_id
        else:
            raise InvalidRequestError("give request_id or reservation_id", param="request_id")
        return {"released": bool(await asyncio.wrap_future(engine.call(fn, key)))}

    @app.post("/internal/kv/reserve", openapi_extra=json_body_openapi(ReserveRequest))
    async def reserve(request: Request):
        check_internal_token(state, request)
        body = _parse(ReserveRequest, await read_json_body(request, state.cfg.max_body_bytes))
        engine, connector = _connector(state)
        num_tokens = await state.run_blocking(_num_prompt_tokens, engine.engine, body)
        if num_tokens >= engine.engine.max_model_len:  # never admitted: no use holding blocks
            raise InvalidRequestError(
                f"a prompt of {num_tokens} tokens leaves no room in max_model_len "
                f"{engine.engine.max_model_len}",
                param="num_tokens",
            )
        try:
            res = await asyncio.wrap_future(engine.call(connector.reserve, num_tokens))
        except NoFreeBlocksError as e:
            raise UnavailableError(
                f"no KV blocks to reserve: {e}", headers={"Retry-After": "1"}
            ) from e
        cfg = engine.engine.config.transfer
        return {
            "engine_id": cfg.engine_id,
            "reservation_id": res.reservation_id,
            "block_ids": [b.block_id for b in res.blocks],
            "host": cfg.advertise_host,
            "port": cfg.advertise_port,
            "write_by": res.write_by,  # P writes nothing after this (unix time, our clock)
        }


def _num_prompt_tokens(llm, body: ReserveRequest) -> int:
    """The prompt's length in tokens; 400 for a bad body. Blocking (tokenizes, renders chat
    templates): the route runs it in the tokenize pool."""
    if body.num_tokens is not None:
        return body.num_tokens
    if body.completion is not None:
        req = parse_request(CompletionRequest, body.completion)
        if len(req.prompts) != 1:
            raise InvalidRequestError("a push reserves for a single prompt", param="completion")
        prompt = req.prompts[0]
        return len(llm.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt)
    if body.chat is not None:
        req = parse_request(ChatCompletionRequest, body.chat)
        text = req.render_prompt(llm.tokenizer)
        return len(llm.tokenizer.encode(text, add_special_tokens=False))
    raise InvalidRequestError("give num_tokens, completion or chat", param="num_tokens")


def _parse(model, body: dict):
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        raise InvalidRequestError(first["msg"], param=".".join(map(str, first["loc"]))) from e


def _connector(state: ServerState):
    engine = state.require_ready()
    connector = engine.engine.connector
    if connector is None:
        raise NotFoundError("this worker has no KV connector (--kv-connector none)")
    return engine, connector


async def ensure_peer(state: ServerState, raw: dict) -> RemotePrefill | None:
    """D, before admitting a remote-prefill request: the prefill worker is known (handshake
    once per engine id). None when it cannot be reached and the policy recomputes locally."""
    vocab_size = state.require_ready().engine.arch.vocab_size
    try:
        remote = RemotePrefill.parse(raw, vocab_size)
    except KVTransferParamsError as e:
        raise InvalidRequestError(str(e), param="kv_transfer_params") from e
    _connector_for_params(state)
    if remote.push_reservation_id:  # pushed: nothing to read from P
        return remote
    why = await handshake_with(
        state, remote.remote_engine_id, remote.remote_host, remote.remote_port
    )
    return remote if why is None else _unreachable(state, remote, why)


async def ensure_push_target(state: ServerState, raw: dict) -> None:
    """P, before a push: the decode worker it writes into is known (handshake)."""
    try:
        target = push_target(raw)
    except KVTransferParamsError as e:
        raise InvalidRequestError(str(e), param="kv_transfer_params") from e
    _connector_for_params(state)
    why = await handshake_with(state, target.engine_id, target.host, target.port)
    if why is not None:
        raise UnavailableError(f"cannot push KV to the decode worker: {why}")


def _connector_for_params(state: ServerState):
    connector = state.require_ready().engine.connector
    if connector is None:
        raise InvalidRequestError(
            "this worker has no KV connector for kv_transfer_params", param="kv_transfer_params"
        )
    return connector


class Handshakes:
    """One handshake in flight per host:port (concurrent first requests share it) and the
    engine id last met there: a new one retires the old (a restarted peer)."""

    def __init__(self) -> None:
        self.pending: dict[tuple[str, int], asyncio.Future] = {}
        self.engine_at: dict[tuple[str, int], str] = {}


def _handshakes(state: ServerState) -> Handshakes:
    if not hasattr(state, "handshakes"):
        state.handshakes = Handshakes()
    return state.handshakes


async def handshake_with(state: ServerState, engine_id: str, host: str, port: int) -> str | None:
    """Add the peer `engine_id` at host:port unless known; why it failed, or None. A peer whose
    KV is incompatible is a 400 that names what differs."""
    connector = state.require_ready().engine.connector
    book, key = _handshakes(state), (host, port)
    while not connector.has_peer(engine_id):
        pending = book.pending.get(key)
        if pending is None:
            pending = asyncio.ensure_future(_handshake(state, engine_id, host, port))
            book.pending[key] = pending
            pending.add_done_callback(lambda done: book.pending.pop(key, None))
        why = await asyncio.shield(pending)
        if why is not None or book.engine_at.get(key) != engine_id:
            return why or f"engine {engine_id} is gone ({host}:{port} serves another)"
    return None


async def _handshake(state: ServerState, engine_id: str, host: str, port: int) -> str | None:
    engine = state.require_ready()
    connector = engine.engine.connector
    url = f"http://{host}:{port}/internal/kv/handshake"
    try:
        async with httpx.AsyncClient(timeout=5.0) as client:
            r = await client.get(url, headers=token_headers(state))
            r.raise_for_status()
        info = HandshakeInfo.model_validate(r.json())
    except (httpx.HTTPError, ValueError) as e:
        return f"handshake with {url} failed: {e!r}"
    if info.engine_id != engine_id:
        return f"engine {engine_id} is gone ({url} now serves engine {info.engine_id})"
    ours = _compat(engine.engine)
    if info.compat_hash != compat_hash(ours):
        raise InvalidRequestError(
            f"engine {info.engine_id} is incompatible with this worker: "
            f"{explain_mismatch(ours, info.compat)}",
            param="kv_transfer_params",
        )
    await asyncio.wrap_future(engine.call(connector.add_peer, info.layout, info.metadata_bytes()))
    state.metrics.handshakes.inc()
    logger.info("handshake with engine %s at %s", info.engine_id, url)
    book = _handshakes(state)
    old = book.engine_at.get((host, port))
    book.engine_at[(host, port)] = engine_id
    if old not in (None, engine_id):
        await asyncio.wrap_future(engine.call(connector.retire_peer, old))
    return None


def _unreachable(state: ServerState, remote: RemotePrefill, why: str) -> None:
    # NOTE: a first token the client already has cannot be recomputed into the same stream
    if state.engine.engine.config.transfer.failure_policy == "recompute" and not (
        remote.first_token_streamed and remote.first_token_id is not None
    ):
        logger.warning("%s: computing the prompt locally", why)
        state.metrics.recomputed.labels(reason="prefill_unreachable").inc()
        return None
    raise UnavailableError(f"the prompt's KV cannot be loaded: {why}")
