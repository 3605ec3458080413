"""Push mode under faults: P dead when the proxy reserves on D, D killed while P is about to
push into it, D restarted under a new engine id (P handshakes again), P frozen past the proxy's
patience (its push comes late). Each request ends clearly; reservations and blocks come back."""

from __future__ import annotations

import pytest

from tests.chaos.client import Background, assert_clear, body, complete, stream
from tests.chaos.cluster import start_proxy
from tests.chaos.faults import frozen, kill, restart
from tests.servers import wait_until

PROMPTS = [list(range(7 + 2 * i, 70 + 3 * i)) for i in range(4)]


@pytest.fixture(scope="module")
def cluster(start_server, workers):
    return start_proxy(start_server, *workers, "--mode", "push")


@pytest.fixture(autouse=True)
def healed(cluster):
    yield
    cluster.heal()


def pushed_bytes(cluster) -> float:
    return cluster.p.metric("pdserve_kv_push_bytes_total")


def test_prefill_dead_at_the_push_then_restarted(cluster):
    p, d, proxy = cluster.p, cluster.d, cluster.proxy
    ref = cluster.reference(PROMPTS[0])
    kill(p)
    out = complete(proxy.url, body(PROMPTS[0]))
    assert out.is_ok and out.token_ids == ref, out  # D computed it alone
    # a reservation the proxy made before it found P dead comes back at its expiry (3.5 s):
    # D cannot tell that P never got the request
    assert wait_until(lambda: d.metric("pdserve_kv_blocks_used") == 0, timeout=10)
    cluster.wait_health(p, False)
    restart(p)
    cluster.wait_health(p, True)
    before = pushed_bytes(cluster)
    assert_clear(complete(proxy.url, body(PROMPTS[0])), ref)
    assert pushed_bytes(cluster) > before
    cluster.assert_pools_free()


def test_decode_killed_before_the_push_then_restarted_under_a_new_engine_id(cluster):
    p, d, proxy = cluster.p, cluster.d, cluster.proxy
    ref = cluster.reference(PROMPTS[1])
    assert_clear(complete(proxy.url, body(PROMPTS[1])), ref)  # P knows D now
    with frozen(p):  # P cannot push yet
        call = Background(complete, proxy.url, body(PROMPTS[1]))
        assert wait_until(lambda: d.metric("pdserve_kv_blocks_used") > 0)  # reserved
        kill(d)
    out = call.result()  # P's writes fail; the KV lives on the dead D: a clear error
    assert_clear(out, ref)
    assert out.status >= 500, out
    cluster.wait_health(d, False)
    restart(d)
    cluster.wait_health(d, True)
    before = pushed_bytes(cluster)
    assert_clear(complete(proxy.url, body(PROMPTS[1])), ref)  # P handshakes with the new D
    assert pushed_bytes(cluster) > before
    cluster.assert_pools_free()


def test_prefill_frozen_past_the_timeout_pushes_late_into_released_blocks(cluster):
    p, d, proxy = cluster.p, cluster.d, cluster.proxy
    ref = cluster.reference(PROMPTS[2])
    victim_ref = cluster.reference(PROMPTS[3], max_tokens=400)
    gave_up = cluster.routed("colocated", "prefill_failed")
    with frozen(p):
        out = complete(proxy.url, body(PROMPTS[2]))  # the proxy gives up on P after 3 s
        assert out.is_ok and out.token_ids == ref, out  # and D computes the prompt alone
        assert cluster.routed("colocated", "prefill_failed") == gave_up + 1
        cluster.wait_health(p, False)
        # another request takes D's released blocks; P wakes up and may still push into them
        victim = Background(stream, d.url, body(PROMPTS[3], max_tokens=400))
        assert wait_until(lambda: d.metric("pdserve_num_requests_running") == 1)
    assert_clear(victim.result(), victim_ref)
    cluster.wait_health(p, True)
    cluster.assert_pools_free()
