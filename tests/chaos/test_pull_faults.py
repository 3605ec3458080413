"""Pull mode under faults: P killed or frozen after answering and before D reads, D killed before
it reads or frozen mid-stream, P restarted under a new engine id. Each request ends clearly (the
colocated tokens, or a 5xx / error event), the proxy ejects and readmits, both pools end free."""

from __future__ import annotations

import httpx
import pytest

from tests.chaos.client import assert_clear, body, complete, stream
from tests.chaos.cluster import start_proxy
from tests.chaos.faults import freeze, kill, restart, thaw
from tests.servers import wait_until

PROMPTS = [list(range(5 + i, 60 + 3 * i)) for i in range(6)]


@pytest.fixture(scope="module")
def cluster(start_server, workers):
    return start_proxy(start_server, *workers)


@pytest.fixture(autouse=True)
def healed(cluster):
    yield
    cluster.heal()


def engine_id(server) -> str:
    return httpx.get(f"{server.url}/internal/kv/handshake", timeout=5).json()["engine_id"]


def test_prefill_killed_before_the_read_then_restarted_under_a_new_engine_id(cluster):
    p, d, proxy = cluster.p, cluster.d, cluster.proxy
    ref = cluster.reference(PROMPTS[0])
    assert_clear(complete(proxy.url, body(PROMPTS[0])), ref)  # D knows P now
    old_engine = engine_id(p)
    with cluster.at_handoff(complete, body(PROMPTS[0])) as call:
        kill(p)
    out = call.result()
    assert out.is_ok and out.token_ids == ref, out  # D recomputed the prompt
    cluster.wait_health(p, False)
    assert_clear(complete(proxy.url, body(PROMPTS[1])), cluster.reference(PROMPTS[1]))
    restart(p)
    assert engine_id(p) != old_engine
    cluster.wait_health(p, True)
    transfers = d.metric("pdserve_kv_transfers_total")
    assert_clear(complete(proxy.url, body(PROMPTS[0])), ref)
    assert d.metric("pdserve_kv_transfers_total") == transfers + 1  # re-handshaked and read
    cluster.assert_pools_free()


def test_prefill_frozen_before_the_read_and_its_release_delayed(cluster):
    p, proxy = cluster.p, cluster.proxy
    ref = cluster.reference(PROMPTS[2])
    assert_clear(complete(proxy.url, body(PROMPTS[2])), ref)  # D knows P now
    with cluster.at_handoff(complete, body(PROMPTS[2])) as call:
        freeze(p)
    try:
        out = call.result()  # read from a frozen P, or recomputed after D's 1.5 s read timeout
        assert out.is_ok and out.token_ids == ref, out
        cluster.wait_health(p, False)
        assert_clear(complete(proxy.url, body(PROMPTS[3])), cluster.reference(PROMPTS[3]))
    finally:
        thaw(p)  # the release notification reaches P now
    cluster.wait_health(p, True)
    cluster.assert_pools_free()


def test_decode_killed_before_the_read(cluster):
    p, d, proxy = cluster.p, cluster.d, cluster.proxy
    ref = cluster.reference(PROMPTS[4])
    with cluster.at_handoff(complete, body(PROMPTS[4])) as call:
        kill(d)
    out = call.result()
    assert_clear(out, ref)
    assert out.status >= 500, out  # the only D is gone
    # the proxy gives P's blocks back at once (well before the 3.5 s lease would end)
    assert wait_until(lambda: p.metric("pdserve_kv_blocks_used") == 0, timeout=2)
    cluster.wait_health(d, False)
    restart(d)
    cluster.wait_health(d, True)
    assert_clear(complete(proxy.url, body(PROMPTS[4])), ref)
    cluster.assert_pools_free()


def test_decode_frozen_mid_stream_ends_the_stream_then_is_readmitted(cluster):
    d, proxy = cluster.d, cluster.proxy
    ref = cluster.reference(PROMPTS[5], max_tokens=400)

    def freeze_d_at_third_event(i: int) -> None:
        if i == 2:
            freeze(d)

    try:
        out = stream(proxy.url, body(PROMPTS[5], max_tokens=400), on_event=freeze_d_at_third_event)
        assert_clear(out, ref)
        assert out.error is not None and "decode worker" in out.error, out
        assert out.seconds < 10  # the proxy's 3 s decode timeout, not a hang
        cluster.wait_health(d, False)
    finally:
        thaw(d)  # D sees the closed stream and aborts the request
    cluster.wait_health(d, True)
    cluster.assert_pools_free()
    assert_clear(stream(proxy.url, body(PROMPTS[5], max_tokens=8)), ref[:8])
