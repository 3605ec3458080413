"""Upstream stubs for `bench_proxy.py`: workers that answer instantly, so that what a benchmark
through a proxy measures is the proxy.

`python benchmarks/proxy_stubs.py prefill --port N`: answers a completion request that asks for
`do_remote_decode` with vLLM-style `kv_transfer_params` (no first token, so every proxy does the
same work: one prefill call, then D's stream). `decode --port N`: streams 16 chunks (with
`token_ids` when the request asks, as a worker does) and `[DONE]` (or one JSON body when
`stream` is false). Both answer `/health` and `/v1/models`.
A bare ASGI app on uvicorn (httptools, uvloop): no framework between the socket and the answer.
"""

from __future__ import annotations

import argparse
import json

import uvicorn

NUM_CHUNKS = 16
_MODELS = json.dumps({"object": "list", "data": [{"id": "stub", "object": "model"}]}).encode()
_PREFILLED = json.dumps(
    {
        "id": "cmpl-stub",
        "object": "text_completion",
        "model": "stub",
        "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": "stub-engine",
            "remote_block_ids": [1, 2, 3],
            "remote_host": "127.0.0.1",
            "remote_port": 1,
            "tp_size": 1,
        },
    }
).encode()
_CHUNK = (
    b'data: {"id":"cmpl-stub","object":"text_completion","model":"stub",'
    b'"choices":[{"index":0,"text":" tok","finish_reason":null}]}\n\n'
)
_CHUNK_IDS = (  # with `return_token_ids`, as a worker writes it (pdserve's proxy asks for them)
    b'data: {"id":"cmpl-stub","object":"text_completion","model":"stub",'
    b'"choices":[{"index":0,"text":" tok","finish_reason":null,"token_ids":[1234]}]}\n\n'
)
_WHOLE = json.dumps(
    {"id": "cmpl-stub", "object": "text_completion", "model": "stub",
     "choices": [{"index": 0, "text": " tok" * NUM_CHUNKS, "finish_reason": "length"}]}
).encode()  # fmt: skip


async def read_body(receive) -> bytes:
    """An ASGI request's whole body."""
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    return body


async def _send(send, status: int, body: bytes, content_type: bytes) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def make_app(role: str):
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        path = scope["path"]
        if scope["method"] == "GET":
            body = _MODELS if path == "/v1/models" else b'{"status":"ok"}'
            return await _send(send, 200, body, b"application/json")
        request = json.loads(await read_body(receive) or b"{}")
        if role == "prefill":
            return await _send(send, 200, _PREFILLED, b"application/json")
        if not request.get("stream"):
            return await _send(send, 200, _WHOLE, b"application/json")
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        chunk = _CHUNK_IDS if request.get("return_token_ids") else _CHUNK
        for _ in range(NUM_CHUNKS):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("role", choices=["prefill", "decode"])
    p.add_argument("--port", type=int, required=True)
    a = p.parse_args()
    uvicorn.run(make_app(a.role), host="127.0.0.1", port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
