"""An expired lease: D frozen between P's answer and its read, past P's 1 s lease, while P
reuses the freed blocks for another prompt. D must fail closed: recompute (the colocated
tokens) or, with `--kv-load-failure-policy fail`, a clear 5xx or error event; never a 200 built
on another prompt's KV."""

from __future__ import annotations

import pytest

from tests.chaos.client import assert_clear, body, complete, stream
from tests.chaos.cluster import D_WORKER, start_proxy
from tests.servers import wait_until

PROMPT = list(range(11, 90))
OTHER = list(range(300, 400))  # takes P's freed blocks (and more)


@pytest.fixture(scope="module")
def clusters(start_server, start_worker, workers):
    p = start_worker("prefill", "--kv-lease-timeout", "1")
    d_fail = start_worker("decode", *D_WORKER, "--kv-load-failure-policy", "fail")
    p.wait_ready()
    d_fail.wait_ready()
    patient = ["--decode-timeout", "15"]  # D stays frozen longer than the chaos proxy's 3 s
    return {
        "recompute": start_proxy(start_server, p, workers[1], *patient),
        "fail": start_proxy(start_server, p, d_fail, *patient),
    }


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_lease_expired_before_a_delayed_read(clusters, policy, streamed):
    cluster = clusters[policy]
    p, proxy = cluster.p, cluster.proxy
    ref = cluster.reference(PROMPT)
    send = stream if streamed else complete
    assert_clear(send(proxy.url, body(PROMPT)), ref)  # D knows P now
    expired = p.metric("pdserve_kv_lease_expiries_total")
    with cluster.at_handoff(send, body(PROMPT)) as call:
        assert wait_until(lambda: p.metric("pdserve_kv_lease_expiries_total") > expired)
        assert complete(p.url, body(OTHER, max_tokens=1)).is_ok  # P reuses the blocks
    out = call.result()
    assert_clear(out, ref)
    if policy == "recompute":
        assert out.is_ok, out
    else:
        assert out.error is not None and "KV" in out.error, out
        assert out.status == (200 if streamed else 500), out  # streamed: an error event
    cluster.assert_pools_free()
