"""2 prefill + 2 decode workers behind the proxy, and workers killed under it: a dead P is
routed around (requests keep succeeding with the colocated output), a D killed mid-stream ends
that stream with an error event within seconds when migration is off (`--migration-limit 0`;
tests/test_migration.py moves it), readiness follows, survivors end all-free."""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

from tests.servers import wait_until

PROMPTS = [list(range(5 + i, 40 + 3 * i)) for i in range(8)]


@pytest.fixture(scope="module")
def cluster(start_server, tiny_model):
    common = ["--model", str(tiny_model("llama")), "--num-blocks", "512", "--max-model-len", "512"]
    common += ["--no-prefix-caching", "--kv-lease-timeout", "20"]
    ps = [start_server("prefill", *common, wait=False) for _ in range(2)]
    ds = [start_server("decode", *common, wait=False) for _ in range(2)]
    ps, ds = [p.wait_ready() for p in ps], [d.wait_ready() for d in ds]  # side by side
    proxy = start_server(
        "proxy", *[a for p in ps for a in ("--prefill", p.url)],
        *[a for d in ds for a in ("--decode", d.url)],
        "--prefill-policy", "round_robin", "--decode-policy", "round_robin",
        "--health-interval", "0.3", "--health-failures", "1", "--decode-timeout", "10",
        "--migration-limit", "0",  # a D killed mid-stream: today's error event (no migration)
    )  # fmt: skip
    return ps, ds, proxy


def complete(url: str, prompt: list[int], **extra) -> dict:
    body = dict(prompt=prompt, max_tokens=6, temperature=0, return_token_ids=True, **extra)
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def ready(proxy) -> dict:
    r = httpx.get(f"{proxy.url}/ready")
    return {"status": r.status_code, **r.json()}


def test_killed_prefill_is_routed_around(cluster):
    ps, ds, proxy = cluster
    expected = [complete(ds[0].url, p) for p in PROMPTS]
    assert [complete(proxy.url, p) for p in PROMPTS[:4]] == expected[:4]
    ps[0].stop(signal.SIGKILL)
    assert [complete(proxy.url, p) for p in PROMPTS] == expected  # retried on the other P
    assert wait_until(lambda: ready(proxy)["status"] == 200)  # one healthy P is enough
    states = {w["url"]: w["healthy"] for w in ready(proxy)["workers"]}
    assert states[ps[0].url] is False and states[ps[1].url] is True
    assert proxy.metric('pdserve_proxy_routed_total{path="disaggregated",reason="pull"}') >= 12
    for s in (ps[1], *ds):
        assert wait_until(lambda s=s: s.metric("pdserve_kv_blocks_used") == 0), s.url


def test_decode_killed_mid_stream_ends_the_stream_with_an_error(cluster):
    ps, ds, proxy = cluster
    body = dict(prompt=PROMPTS[0], max_tokens=470, ignore_eos=True, stream=True, temperature=0)
    events = []
    started = time.monotonic()
    with httpx.stream("POST", f"{proxy.url}/v1/completions", json=body, timeout=30) as r:
        lines = (line for line in r.iter_lines() if line)
        events.append(next(lines))
        # NOTE: the first event can be P's token, streamed before D has admitted the request
        assert wait_until(lambda: _running(ds))
        serving = _running(ds)[0]  # 470 tokens to go: it is still running
        serving.stop(signal.SIGKILL)
        events.extend(lines)  # must end: a hang fails on the read timeout
    assert time.monotonic() - started < 30
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert "decode worker failed" in error["message"] and error["status"] == 502
    assert error["code"] == "decode_failed" and error["type"] == "server_error"
    assert wait_until(lambda: proxy.metric("pdserve_proxy_stream_errors_total") == 1)
    refused = 'pdserve_proxy_migrations_refused_total{reason="limit"}'
    assert proxy.metric(refused) == 1
    survivor = next(d for d in ds if d is not serving)
    assert complete(proxy.url, PROMPTS[1]) == complete(survivor.url, PROMPTS[1])
    assert wait_until(lambda: ready(proxy)["status"] == 200)
    for s in (ps[1], survivor):
        assert wait_until(lambda s=s: s.metric("pdserve_kv_blocks_used") == 0), s.url


def _running(workers) -> list:
    return [w for w in workers if w.metric("pdserve_num_requests_running") == 1]


def test_without_prefill_workers_requests_go_to_decode_and_readiness_drops(cluster):
    ps, ds, proxy = cluster
    ps[1].stop(signal.SIGKILL)
    assert wait_until(lambda: ready(proxy)["status"] == 503)
    survivor = next(d for d in ds if d.proc.poll() is None)
    assert complete(proxy.url, PROMPTS[2]) == complete(survivor.url, PROMPTS[2])
    colocated = 'pdserve_proxy_routed_total{path="colocated",reason="no_prefill"}'
    assert proxy.metric(colocated) >= 1
    assert wait_until(lambda: survivor.metric("pdserve_kv_blocks_used") == 0)
