"""The spans a worker makes for one HTTP generation request (tracing on: common/tracing).

The request's root span, `prefill.request` or `decode.request`, starts when its route started
and takes its parent from the caller's `traceparent` (the proxy's P or D call); a request that
comes without one starts a trace of its own. The root ends when its last job's generation
ends. Each job's children are made once it has finished, from instants recorded on the way: on
the event loop (handed to the engine, first token out, last) and on the engine thread
(`RequestTimes`: first scheduled, the KV transfer), with those explicit start and end times.
`admission` is the request's time before the engine: its body parsed, its prompt tokenized,
the handshake with a peer it had not met (also a span of its own, `kv.handshake`), the wait
for a place under `--max-waiting`.

    prefill.request                       decode.request
      admission  arrived → handed over      admission   arrived → handed over
      kv.handshake  push: D met (once)      kv.handshake  pull: P met (once)
      queue      handed over → scheduled    queue       handed over → scheduled
      prefill    handed over → token        kv.read     READs posted → landed (pull)
      kv.write   WRITEs posted → settled    first_step  handed over → first token out
      (event kv.lease: the blocks held)     decode      first token → last token
"""

from __future__ import annotations

import time

from fastapi import Request

from common.api.state import ServerState
from common.tracing import NO_TRACE, NoTrace, RequestTimes, Trace, start_trace


def start_request_trace(state: ServerState, request: Request) -> Trace | NoTrace:
    """The request's trace, its root started when its route did (`ServerState.arriving`)."""
    if state.tracer is None:
        return NO_TRACE
    attributes = {
        "http.route": request.url.path,
        "pdserve.request_id": request.state.request_id,
        "pdserve.role": state.cfg.role,
    }
    name = f"{state.cfg.role}.request"
    start_ns = getattr(request.state, "arrived_ns", None)
    trace = start_trace(state.tracer, name, request.headers, start_ns, attributes)
    if (handshake := getattr(request.state, "handshake_ns", None)) is not None:
        trace.record("kv.handshake", *handshake)  # kv_params.py: a peer met for the first time
    return trace


def record_job(
    trace: Trace | NoTrace,
    role: str,
    added_ns: int,
    first_token_ns: int | None,
    times: RequestTimes | None,
    kv_transfer_params: dict | None,
) -> None:
    """A finished job's spans under the request's root (see the module's docstring)."""
    if trace is NO_TRACE:
        return
    end_ns = time.time_ns()
    times = times or RequestTimes()
    trace.record("admission", trace.start_ns, added_ns)
    if times.scheduled_ns is not None:
        trace.record("queue", added_ns, times.scheduled_ns)
    if times.kv_transfer_ns is not None:
        trace.record("kv.write" if role == "prefill" else "kv.read", *times.kv_transfer_ns)
    if role == "prefill":
        trace.record("prefill", added_ns, first_token_ns or end_ns)
        lease = kv_transfer_params or {}
        if lease.get("remote_block_ids"):
            trace.event(
                "kv.lease",
                **{
                    "pdserve.lease_id": lease.get("remote_request_id"),
                    "pdserve.num_blocks": len(lease["remote_block_ids"]),
                    "pdserve.read_by": lease.get("read_by"),
                },
            )
        return
    if first_token_ns is not None:
        trace.record("first_step", added_ns, first_token_ns)
        trace.record("decode", first_token_ns, end_ns)
