"""Internal routes of a worker (not part of the OpenAI surface) and the peer handshake.

- `GET /internal/kv/handshake`: this worker's NIXL agent metadata, KV layout and compatibility
  hash, for a peer that will read from (or write to) its KV cache.
- `POST /internal/kv/release` `{"request_id"}`: end a prefill lease early (the reader gave up).

`ensure_peer` runs on a decode worker before it admits a remote-prefill request: it handshakes
with the prefill worker once per engine id (a restarted peer has a new id) and refuses an
incompatible one with a message that names what differs.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
from fastapi import FastAPI, Request
from pydantic import BaseModel

from common.api.app import ServerState, read_json_body
from common.api.errors import InvalidRequestError, NotFoundError, UnavailableError
from common.kv_transfer.handshake import (
    HandshakeInfo,
    compat_fields,
    compat_hash,
    encode_metadata,
    explain_mismatch,
)
from common.kv_transfer.params import KVTransferParamsError, RemotePrefill

logger = logging.getLogger(__name__)


class ReleaseRequest(BaseModel):
    request_id: str


def local_handshake(state: ServerState) -> HandshakeInfo:
    engine = state.require_ready().engine
    connector = engine.connector
    if connector is None or getattr(connector, "transport", None) is None:
        raise NotFoundError("this worker has no KV connector (--kv-connector none)")
    fields = _compat(engine)
    return HandshakeInfo(
        engine_id=engine.config.transfer.engine_id,
        protocol_version=fields["protocol_version"],
        compat_hash=compat_hash(fields),
        compat=fields,
        layout=connector.transport.layout.to_dict(),
        agent_metadata=encode_metadata(connector.transport.metadata()),
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


def install_internal_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/internal/kv/handshake")
    async def handshake():
        return local_handshake(state).model_dump()

    @app.post("/internal/kv/release")
    async def release(request: Request):
        body = ReleaseRequest.model_validate(await read_json_body(request, 4096))
        engine = state.require_ready()
        connector = engine.engine.connector
        if connector is None:
            raise NotFoundError("this worker has no KV connector")
        released = await asyncio.wrap_future(engine.call(connector.release, body.request_id))
        return {"released": bool(released)}


async def ensure_peer(state: ServerState, raw: dict) -> RemotePrefill | None:
    """Handshake with the request's prefill worker (once per engine id). None when it cannot be
    reached and the policy recomputes locally; a 4xx/5xx otherwise."""
    try:
        remote = RemotePrefill.parse(raw)
    except KVTransferParamsError as e:
        raise InvalidRequestError(str(e), param="kv_transfer_params") from e
    engine = state.require_ready()
    connector = engine.engine.connector
    if connector is None:
        raise InvalidRequestError(
            "this worker has no KV connector for a remote prefill", param="kv_transfer_params"
        )
    if connector.has_peer(remote.remote_engine_id):
        return remote
    url = f"http://{remote.remote_host}:{remote.remote_port}/internal/kv/handshake"
    try:
        async with httpx.AsyncClient(timeout=5.0) as client:
            r = await client.get(url)
            r.raise_for_status()
        info = HandshakeInfo.model_validate(r.json())
    except (httpx.HTTPError, ValueError) as e:
        return _unreachable(state, remote, f"handshake with {url} failed: {e!r}")
    if info.engine_id != remote.remote_engine_id:
        return _unreachable(
            state,
            remote,
            f"prefill engine {remote.remote_engine_id} is gone "
            f"({url} now serves engine {info.engine_id})",
        )
    ours = _compat(engine.engine)
    if info.compat_hash != compat_hash(ours):
        raise InvalidRequestError(
            f"prefill engine {info.engine_id} is incompatible with this decode worker: "
            f"{explain_mismatch(ours, info.compat)}",
            param="kv_transfer_params",
        )
    await asyncio.wrap_future(engine.call(connector.add_peer, info.layout, info.metadata_bytes()))
    logger.info("handshake with prefill engine %s at %s", info.engine_id, url)
    return remote


def _unreachable(state: ServerState, remote: RemotePrefill, why: str) -> None:
    if state.engine.engine.config.transfer.failure_policy == "recompute":
        logger.warning("%s: computing the prompt locally", why)
        return None
    raise UnavailableError(f"the prompt's KV cannot be loaded: {why}")
