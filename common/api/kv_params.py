"""A generation request's `kv_transfer_params`, made ready for the engine: `resolve_kv_params`,
once per request.

Params that name a peer (a prefill worker to read from, a decode worker to push into) are parsed
strictly (400 if malformed) and the peer made known (`EngineClient.ensure_peer`: a handshake the
first time). A peer whose KV differs is a 400 that names what differs. A decode worker that
cannot be pushed into is a 503. A worker to read from that cannot be reached is the failure
policy's to judge (`EngineClient.remote_unreachable`, common/kv_transfer/remote_prefills.py):
its prompt computed here instead (a prefill worker's under `--kv-load-failure-policy
recompute`, a decode worker's prompt prefix whatever the policy), else a 503.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from fastapi import Request

from common.api.errors import InvalidRequestError, UnavailableError
from common.api.internal import check_internal_token
from common.api.state import ServerState
from common.engine.client import EngineClient, PeerIncompatible, PeerUnreachable
from common.kv_transfer.params import (
    KVTransferParamsError,
    RemotePrefill,
    push_target,
    wants_remote_decode,
    wants_remote_prefill,
    without_prefix,
)

T = TypeVar("T")


async def resolve_kv_params(state: ServerState, raw: dict | None, request: Request) -> dict | None:
    """The request's kv_transfer_params, once the peer they name is known; None when the prompt
    will be computed here instead. With a cluster token they need it too: they make this worker
    call the peer they name, token attached."""
    if raw is None:
        return None
    check_internal_token(state, request)
    if wants_remote_decode(raw) and raw.get("push_to"):
        target = _parse(push_target, raw)
        why = await _reach(_peers(state), target.engine_id, target.host, target.port, request)
        if why is not None:
            raise UnavailableError(f"cannot push KV to the decode worker: {why}")
        return raw
    if not wants_remote_prefill(raw):
        return raw
    remote = _parse(RemotePrefill.parse, raw, state.require_ready().vocab_size)
    engine = _peers(state)
    if remote.push_reservation_id:  # pushed: nothing to read from P
        return raw
    where = (remote.remote_engine_id, remote.remote_host, remote.remote_port)
    why = await _reach(engine, *where, request)
    if why is None:
        return raw
    if not await engine.remote_unreachable(remote, why):
        raise UnavailableError(f"the prompt's KV cannot be loaded: {why}")
    return without_prefix(raw) if remote.prefix_only else None


def _parse(parse: Callable[..., T], *args) -> T:
    try:
        return parse(*args)
    except KVTransferParamsError as e:
        raise InvalidRequestError(str(e), param="kv_transfer_params") from e


def _peers(state: ServerState) -> EngineClient:
    """The engine, which must move KV to meet a peer: 400 otherwise."""
    engine = state.require_ready()
    if not engine.has_connector:
        raise InvalidRequestError(
            "this worker has no KV connector for kv_transfer_params", param="kv_transfer_params"
        )
    return engine


async def _reach(
    engine: EngineClient, engine_id: str, host: str, port: int, request: Request
) -> str | None:
    """Why the peer cannot be reached, or None once it is known; 400 if incompatible. When the
    request waited for a handshake, when it did is `request.state.handshake_ns` (its trace)."""
    started = time.time_ns()
    try:
        if await engine.ensure_peer(engine_id, host, port):
            request.state.handshake_ns = (started, time.time_ns())
    except PeerIncompatible as e:
        raise InvalidRequestError(str(e), param="kv_transfer_params") from e
    except PeerUnreachable as e:
        return str(e)
    return None
