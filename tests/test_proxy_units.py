"""The proxy's parts on their own: routing policies, health state, configuration, the request's
derived bodies, the events it writes itself, and the lean transport against a real server."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter

import httpx
import pytest
import uvicorn

from proxy.config import from_dict, parse_args
from proxy.policies import LeastOutstanding, PowerOfTwo, PrefixAware, RoundRobin
from proxy.request import CHAT_PATH, COMPLETIONS_PATH, ProxyRequest
from proxy.sse import first_token_events
from proxy.transport import LeanTransport
from proxy.workers import FailedWorkers, Worker


def workers(n: int) -> list[Worker]:
    client = httpx.AsyncClient()
    return [Worker(f"http://w{i}:1", "prefill", client, client._transport) for i in range(n)]


def test_round_robin_and_least_outstanding():
    ws = workers(3)
    rr = RoundRobin()
    assert [rr.choose(ws, "").url for _ in range(6)] == [w.url for w in ws] * 2
    ws[0].num_outstanding, ws[1].num_outstanding, ws[2].num_outstanding = 3, 1, 2
    assert LeastOutstanding().choose(ws, "") is ws[1]


def test_power_of_two_never_picks_the_most_loaded_of_three():
    ws = workers(3)
    for w, load in zip(ws, (0, 5, 9)):
        w.num_outstanding = load
    p2c = PowerOfTwo(random.Random(0))
    picks = Counter(p2c.choose(ws, "").url for _ in range(300))
    assert ws[2].url not in picks and picks[ws[0].url] > picks[ws[1].url]


def test_prefix_aware_is_sticky_spreads_and_respects_load_bounds():
    ws = workers(4)
    policy = PrefixAware()
    keys = [f"system prompt {i}" for i in range(200)]
    first = {k: policy.choose(ws, k) for k in keys}
    assert all(policy.choose(ws, k) is first[k] for k in keys)  # same prefix → same worker
    assert len(set(first.values())) == 4  # and different prefixes spread over all
    hot = first[keys[0]]
    hot.num_outstanding = 50  # far above the bounded-load limit
    assert policy.choose(ws, keys[0]) is not hot
    survivors = [w for w in ws if w is not hot]  # removing a worker moves only its keys
    hot.num_outstanding = 0
    moved = [k for k in keys if first[k] is not hot and policy.choose(survivors, k) is not first[k]]
    assert not moved


def test_worker_health_thresholds():
    (w,) = workers(1)
    assert not w.is_healthy
    assert w.record_check(True, None, failures=2, successes=2) is False
    assert w.record_check(True, None, failures=2, successes=2) is True and w.is_healthy
    assert not w.record_check(False, "down", failures=2, successes=2) and w.is_healthy
    assert w.record_check(False, "down", failures=2, successes=2) and not w.is_healthy
    w.record_check(True, None, 2, 1)
    w.eject("connect refused")
    assert not w.is_routable and w.last_error == "connect refused"
    w.record_check(True, None, 2, 1)
    w.is_draining = True
    assert w.is_healthy and not w.is_routable


def test_ejections_count_each_fall_from_healthy_and_show_per_worker():
    from proxy.metrics import ProxyMetrics
    from proxy.workers import WorkerPool

    def metric_samples(text: str, sample: str) -> list[float]:
        return [float(line.rpartition(" ")[2]) for line in text.splitlines()
                if line.rpartition(" ")[0] == sample]  # fmt: skip

    (w,) = workers(1)
    w.record_check(True, None, 2, 1)  # healthy: its first admission is no ejection
    w.eject("connect refused")
    w.eject("connect refused")  # already out: not a second ejection
    w.record_check(True, None, 2, 1)
    for _ in range(2):  # the checks' threshold: out once more
        w.record_check(False, "down", 2, 1)
    assert w.num_ejections == 2
    pool = WorkerPool("prefill")
    pool.add(w)
    text = ProxyMetrics({"prefill": pool}).render().decode()
    labels = f'role="prefill",url="{w.url}"'
    assert metric_samples(text, f"pdserve_proxy_worker_ejections_total{{{labels}}}") == [2.0]
    assert metric_samples(text, f"pdserve_proxy_worker_healthy{{{labels}}}") == [0.0]
    w.record_check(True, None, 2, 1)
    text = ProxyMetrics({"prefill": pool}).render().decode()
    assert metric_samples(text, f"pdserve_proxy_worker_healthy{{{labels}}}") == [1.0]
    rejected = 'pdserve_proxy_admission_rejected_total{reason="queue_full"}'
    assert metric_samples(text, rejected) == [0.0], "known reasons start at 0"


def test_config_from_flags_file_and_errors(tmp_path, capsys):
    path = tmp_path / "proxy.json"
    path.write_text(json.dumps({"prefill": ["http://p:8100"], "decode": ["http://d:8200"],
                                "health": {"interval": 5}, "min-disagg-tokens": 64}))  # fmt: skip
    cfg = parse_args(["--config", str(path), "--port", "9000", "--health-failures", "3"])
    assert cfg.prefill == ("http://p:8100",) and cfg.port == 9000
    assert cfg.min_disagg_tokens == 64
    assert (cfg.health.interval, cfg.health.failure_threshold) == (5, 3)
    for bad, message in [
        ({"prefill": ["http://p"]}, "--decode"),
        ({"decode": ["d:8200"]}, "http://"),
        ({"decode": ["http://d"], "decode_policy": "prefix"}, "prefill workers only"),
        ({"decode": ["http://d"], "colour": 1}, "unknown settings: colour"),
    ]:
        with pytest.raises(ValueError, match=message):
            from_dict(bad)
    with pytest.raises(SystemExit):
        parse_args(["--prefill", "http://p"])
    assert "--decode" in capsys.readouterr().err


def test_prefill_and_decode_bodies():
    raw = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True,
                      "stream_options": {"include_usage": True}, "max_completion_tokens": 50,
                      "min_tokens": 5, "logprobs": True, "top_logprobs": 2}).encode()  # fmt: skip
    req = ProxyRequest.parse(CHAT_PATH, raw, "rid")
    body = req.prefill_body(push_to=None)
    assert body["max_tokens"] == 1 and body["stream"] is False and body["n"] == 1
    assert body["min_tokens"] == 1 and body["kv_transfer_params"] == {"do_remote_decode": True}
    assert not {"stream_options", "max_completion_tokens", "logprobs", "top_logprobs"} & set(body)
    assert not req.can_stream_first_token  # logprobs: D streams every token itself
    decoded = json.loads(req.decode_body({"remote_engine_id": "e"}))
    assert decoded["kv_transfer_params"] == {"remote_engine_id": "e"} and decoded["min_tokens"] == 5
    ids = ProxyRequest.parse(COMPLETIONS_PATH, b'{"prompt": [1, 2, 3, 4, 5]}', "r")
    assert ids.estimated_tokens() == 5 and not ids.is_batch
    assert ProxyRequest.parse(COMPLETIONS_PATH, b'{"prompt": ["a", "b"]}', "r").is_batch
    assert ProxyRequest.parse(COMPLETIONS_PATH, b'{"prompt": "' + b"x" * 400 + b'"}', "r")\
        .estimated_tokens() == 100  # fmt: skip


def test_first_token_events_look_like_a_workers_stream():
    answer = {"created": 7, "model": "m", "choices": [{"message": {"content": "Hel"},
              "token_ids": [42]}], "prompt_token_ids": [1, 2]}  # fmt: skip
    events = first_token_events(True, "rid", answer, {"return_token_ids": True}).split(b"\n\n")
    role, content = (json.loads(e[len(b"data: ") :]) for e in events[:2])
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert role["id"] == "chatcmpl-rid"
    assert role["prompt_token_ids"] == [1, 2]
    assert content["choices"][0]["delta"] == {"content": "Hel"}
    assert content["choices"][0]["token_ids"] == [42]
    text = first_token_events(False, "rid", {"choices": [{"text": "Hel"}]}, {})
    assert json.loads(text[len(b"data: ") :])["choices"][0]["text"] == "Hel"


async def _chunked_app(scope, receive, send):
    if scope["type"] != "http":
        return
    if scope["path"] == "/slow":
        await asyncio.sleep(1)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    for i in range(3):
        await send({"type": "http.response.body", "body": b"part%d;" % i, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


def test_lean_transport_keep_alive_streaming_and_errors():
    async def scenario():
        port = _free_port()
        server = uvicorn.Server(uvicorn.Config(_chunked_app, port=port, log_level="warning"))
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        transport = LeanTransport()
        client = httpx.AsyncClient(transport=transport, base_url=f"http://127.0.0.1:{port}")
        try:
            for _ in range(3):  # one connection, kept alive and reused
                r = await client.post("/", content=b"x" * 10)
                assert r.status_code == 200 and r.content == b"part0;part1;part2;"
            assert len(transport._idle) == 1
            with pytest.raises(httpx.ReadTimeout):
                await client.get("/slow", timeout=0.2)
            with pytest.raises(httpx.ConnectError):
                await httpx.AsyncClient(transport=LeanTransport()).get("http://127.0.0.1:9/")
        finally:
            await client.aclose()
            server.should_exit = True
            await serving

    asyncio.run(scenario())


def test_lean_transport_on_uvloop_survives_a_connection_closed_before_the_write():
    """uvloop (the proxy's loop) raises RuntimeError on a write to a closed transport, and
    `connection_lost` runs a tick after the close: a kept-alive connection the server closed
    just then, or a fresh one the server reset at once, is an httpx error (a fresh connection
    is tried for the first), never a RuntimeError out of the proxy's stream."""
    uvloop = pytest.importorskip("uvloop")

    async def scenario():
        port = _free_port()
        server = uvicorn.Server(uvicorn.Config(_chunked_app, port=port, log_level="warning"))
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        transport = LeanTransport()
        client = httpx.AsyncClient(transport=transport, base_url=f"http://127.0.0.1:{port}")
        try:
            assert (await client.post("/", content=b"x")).status_code == 200
            (idle,) = transport._idle
            idle.transport.close()  # its connection_lost has not run yet
            assert not idle.is_closed
            r = await client.post("/", content=b"x")  # reused, found closed: a fresh one
            assert r.status_code == 200 and r.content == b"part0;part1;part2;"
            assert idle not in transport._idle
            url = httpx.URL(f"http://127.0.0.1:{port}/")
            conn, _ = await transport._connection(url, 1.0, fresh=True)
            conn.transport.close()
            await asyncio.sleep(0)  # the handle is closed now: a write would raise
            with pytest.raises(httpx.ConnectError):
                await conn.send(b"POST / HTTP/1.1\r\nhost: x\r\n\r\n", b"", 1.0)
        finally:
            await client.aclose()
            server.should_exit = True
            await serving

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario())


def _free_port() -> int:
    from tests.servers import free_port

    return free_port()


def test_lean_transport_hands_over_what_arrived_together_and_never_waits_for_more():
    """Events that arrive in one read reach the relay as one piece (one send to the client,
    not one per event); a lone event is handed over at once, before the next one is sent."""

    async def scenario():
        sent_alone = asyncio.Event()
        burst = b"".join(
            b"%x\r\ndata: %d\n\n\r\n" % (len(b"data: %d\n\n" % i), i) for i in range(16)
        )

        async def respond(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
            writer.write(head + burst)  # 16 chunked-encoding chunks in one write
            await writer.drain()
            await sent_alone.wait()  # the client must have the burst before the last event
            writer.write(b"%x\r\ndata: last\n\n\r\n0\r\n\r\n" % len(b"data: last\n\n"))
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(respond, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = httpx.AsyncClient(transport=LeanTransport(), base_url=f"http://127.0.0.1:{port}")
        pieces = []
        try:
            async with client.stream("GET", "/") as r:
                async for piece in r.aiter_raw():
                    pieces.append(piece)
                    sent_alone.set()
        finally:
            await client.aclose()
            server.close()
        events = b"".join(b"data: %d\n\n" % i for i in range(16))
        assert b"".join(pieces) == events + b"data: last\n\n"
        assert pieces[0] == events and pieces[-1] == b"data: last\n\n"  # 16 as one, then 1

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_merged_metrics_sum_amounts_and_take_the_largest_view():
    """`--workers N`: counts and amounts in flight add up over processes; a process's view of
    the pools and of the KV index (each process subscribes to every worker) does not."""
    from prometheus_client.parser import text_string_to_metric_families

    from proxy.siblings import merge_metrics

    def text(index_blocks: int, outstanding: int, requests: int, workers: int) -> str:
        return (
            "# TYPE pdserve_proxy_kv_index_blocks gauge\n"
            f'pdserve_proxy_kv_index_blocks{{role="prefill",url="http://p:1"}} {index_blocks}\n'
            "# TYPE pdserve_proxy_outstanding gauge\n"
            f'pdserve_proxy_outstanding{{role="decode"}} {outstanding}\n'
            "# TYPE pdserve_proxy_workers gauge\n"
            f'pdserve_proxy_workers{{role="decode",state="healthy"}} {workers}\n'
            "# TYPE pdserve_proxy_requests_total counter\n"
            f'pdserve_proxy_requests_total{{status="200"}} {requests}\n'
        )

    merged = merge_metrics([text(40, 3, 5, 2), text(38, 2, 7, 2)]).decode()
    values = {s.name: s.value for f in text_string_to_metric_families(merged) for s in f.samples}
    assert values["pdserve_proxy_kv_index_blocks"] == 40  # not 78: the same index, twice
    assert values["pdserve_proxy_workers"] == 2
    assert values["pdserve_proxy_outstanding"] == 5
    assert values["pdserve_proxy_requests_total"] == 12


def feed(client, payload: dict) -> dict | None:
    """One of D's chunks through a ClientStream: what the client gets of it, as JSON."""
    from proxy.journey.client import read_view

    data = json.dumps(payload, separators=(",", ":")).encode()
    out = client.accept(data, read_view(data))
    return None if out is None else json.loads(out[len(b"data: ") :])


def test_client_stream_tracks_what_the_client_has_and_rewrites_a_continuation():
    from proxy.journey.client import ClientStream

    raw = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True, "n": 2,
                      "stream_options": {"include_usage": True}}).encode()  # fmt: skip
    client = ClientStream(ProxyRequest.parse(CHAT_PATH, raw, "rid"))
    head = {"id": "chatcmpl-rid", "created": 5, "object": "chat.completion.chunk"}
    role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
    first = feed(client, {**head, "prompt_token_ids": [1, 2], "choices": [role]})
    assert "prompt_token_ids" not in first and first["choices"] == [role]  # not asked for
    text = {"index": 1, "delta": {"content": "héllo"}, "token_ids": [7, 8]}
    assert feed(client, {**head, "choices": [text]})["choices"][0] == {
        "index": 1, "delta": {"content": "héllo"}}  # fmt: skip
    assert client.choices[1].token_ids == [7, 8] and client.choices[1].num_chars == 5
    client.num_migrations = 1  # choice 0 continues elsewhere: its role again, a new created
    again = {"index": 0, "delta": {"role": "assistant", "content": ""}, "token_ids": []}
    assert feed(client, {**head, "created": 9, "choices": [again]}) is None
    done = {"index": 0, "delta": {"content": "x"}, "token_ids": [3], "finish_reason": "length"}
    out = feed(client, {**head, "created": 9, "choices": [done]})
    assert out["created"] == 5 and out["id"] == "chatcmpl-rid"
    assert client.unfinished == [1] and client.choices[0].token_ids == [3]
    usage = {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
    assert feed(client, {**head, "created": 9, "choices": [], "usage": usage}) is None
    written = json.loads(client.usage_event()[len(b"data: ") :])
    assert written["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert written["created"] == 5 and written["choices"] == []


def test_client_stream_without_token_ids_cannot_move():
    from proxy.journey.client import ClientStream

    client = ClientStream(ProxyRequest.parse(COMPLETIONS_PATH, b'{"prompt": "a"}', "r"))
    feed(client, {"id": "c", "created": 1, "choices": [{"index": 0, "text": "b"}]})
    assert not client.is_tracked
    batch = ClientStream(ProxyRequest.parse(COMPLETIONS_PATH, b'{"prompt": ["a", "b"]}', "r"))
    assert not batch.is_tracked


def test_p_first_token_without_ids_for_the_client_still_moves():
    """P's first token as the proxy streams it: its id only in `token_id` (the client did not
    ask for ids); the stream stays movable, and the token counts."""
    from proxy.journey.client import ClientStream

    req = ProxyRequest.parse(COMPLETIONS_PATH, b'{"prompt": "a", "stream": true}', "r")
    client = ClientStream(req)
    answer = {"created": 3, "choices": [{"text": "Hel"}]}
    client.first_token(first_token_events(False, "r", answer, req.body), 42)
    assert client.is_tracked and client.choices[0].token_ids == [42]
    assert client.choices[0].num_chars == 3 and client.created == 3


def test_client_stream_passes_d_bytes_on_with_only_the_ids_cut():
    from proxy.journey.client import ClientStream, read_view

    client = ClientStream(ProxyRequest.parse(COMPLETIONS_PATH, b'{"prompt": "a"}', "r"))
    data = b'{"id":"c","created":1,"choices":[{"index":0,"text":"h\\u00e9","token_ids":[5,6]}]}'
    out = client.accept(data, read_view(data))
    assert out == b'data: {"id":"c","created":1,"choices":[{"index":0,"text":"h\\u00e9"}]}\n\n'
    assert client.choices[0].token_ids == [5, 6] and client.choices[0].num_chars == 2
    spaced = b'{"id": "c", "choices": [{"index": 0, "text": "x", "token_ids": [7]}]}'
    again = json.loads(client.accept(spaced, read_view(spaced))[len(b"data: ") :])
    assert again["choices"] == [{"index": 0, "text": "x"}]  # not D's layout: written anew
    assert client.choices[0].token_ids == [5, 6, 7] and client.is_tracked
    done = b'{"id":"c","choices":[{"index":0,"text":"","token_ids":[],"finish_reason":"stop"}]}'
    client.accept(done, read_view(done))
    assert client.unfinished == []


def test_decode_body_asks_for_token_ids_without_encoding_the_body_again():
    raw = b'{"prompt": "a", "stream": true, "return_token_ids": false}\n'
    req = ProxyRequest.parse(COMPLETIONS_PATH, raw, "r")
    tracked = req.decode_body(None, track=True)
    assert json.loads(tracked) == {"prompt": "a", "stream": True, "return_token_ids": True}
    assert tracked.startswith(raw.rstrip()[:-1])  # the client's bytes, one key added
    asked = ProxyRequest.parse(COMPLETIONS_PATH, b'{"prompt":"a","return_token_ids":true}', "r")
    assert asked.decode_body(None, track=True) == asked.raw
    with_kv = json.loads(req.decode_body({"remote_engine_id": "e"}, track=True))
    assert with_kv["return_token_ids"] is True and with_kv["kv_transfer_params"]


def test_a_failed_worker_is_out_of_a_requests_way_until_it_comes_back():
    """A D that failed a request is not chosen for it again, unless its health flipped since
    (a restarted worker is a new one): the last D of a rolling restart may take it."""
    w, other = workers(2)
    failed = FailedWorkers()
    failed.add(w)
    failed.add(other)
    assert set(failed.excluded) == {w, other} and failed.num_failures == 2
    w.eject("restarting")  # the health checks see it go ...
    w.record_check(True, None, 2, 1)  # ... and come back
    assert failed.excluded == (other,)
    failed.add(w)  # failed again: out again, and counted
    assert set(failed.excluded) == {w, other} and failed.num_failures == 3


def test_a_moved_request_waits_for_a_decode_worker_coming_back():
    """`Planner.choose_soon`: with no routable D it waits up to the health checks' readmission time
    (interval x (successes + 1)) for one, then gives up with a 503."""
    from common.api.errors import UnavailableError
    from proxy.journey.plan import Planner
    from proxy.workers import WorkerPool

    cfg = from_dict({"decode": ["http://d:1"], "health": {"interval": 0.2}})
    (d,) = workers(1)
    pool = WorkerPool("decode")
    pool.add(d)
    planner = Planner.__new__(Planner)  # the parts choose_soon uses
    planner.cfg, planner.pools, planner.policies = cfg, {"decode": pool}, {"decode": RoundRobin()}
    req = ProxyRequest.parse(COMPLETIONS_PATH, b'{"prompt": "hi"}', "r")

    async def back_after(seconds: float) -> None:
        await asyncio.sleep(seconds)
        d.record_check(True, None, 2, 1)

    async def main():
        comes_back = asyncio.create_task(back_after(0.15))
        assert await planner.choose_soon("decode", req) is d  # waited for it
        await comes_back
        d.eject("gone for good")
        started = asyncio.get_running_loop().time()
        with pytest.raises(UnavailableError):
            await planner.choose_soon("decode", req)
        assert asyncio.get_running_loop().time() - started >= 0.35  # 0.2 x (1 + 1), then 503

    asyncio.run(main())
