"""Long chaos (marker `chaos_long`; in the suite and in CI): scripted faults while clients keep
sending requests, in pull and push modes; a P frozen past the proxy's prefill timeout (pull),
killed or frozen mid-push (chunked prefill). Every request ends clearly, the proxy follows,
both pools end free."""

from __future__ import annotations

import random
import threading
import time

import pytest

from tests.chaos.client import HANG_GUARD, Background, assert_clear, body, complete, stream
from tests.chaos.cluster import P_WORKER, Cluster, start_proxy
from tests.chaos.faults import freeze, frozen, kill, restart, thaw
from tests.servers import wait_until

pytestmark = pytest.mark.chaos_long

PROMPTS = [list(range(3 + 5 * i, 40 + 11 * i)) for i in range(6)]


def wait_health(clusters: list[Cluster], server, healthy: bool) -> None:
    for cluster in clusters:
        cluster.wait_health(server, healthy)


def bounce(clusters: list[Cluster], server) -> None:
    """kill -9, ejected, restarted (a new engine id), readmitted."""
    kill(server)
    wait_health(clusters, server, False)
    restart(server)
    wait_health(clusters, server, True)


def bounce_both(clusters: list[Cluster]) -> None:
    """P, then D, kill -9'd together and ejected; both restarted at once (new engine ids, as
    rescheduled together) and readmitted. Restarting them one after the other would add a
    window of D up with P dead, the first fault's, at the cost of a third worker start."""
    workers = clusters[0].workers
    for server in workers:
        kill(server)
    for server in workers:
        wait_health(clusters, server, False)
    for server in workers:
        server.restart()  # a new process, not waited for: both start side by side
    for server in workers:
        server.wait_ready()
        wait_health(clusters, server, True)


def pause(clusters: list[Cluster], server, seconds: float) -> None:
    with frozen(server):
        time.sleep(seconds)
    wait_health(clusters, server, True)


FAULTS = [
    lambda cs: bounce(cs, cs[0].p),
    lambda cs: pause(cs, cs[0].d, 1.0),  # shorter than the proxy's patience
    lambda cs: pause(cs, cs[0].p, 3.5),  # longer than the prefill timeout
    lambda cs: bounce(cs, cs[0].d),
    lambda cs: pause(cs, cs[0].d, 3.5),  # longer than the decode timeout
    bounce_both,
]
MODES = ("pull", "push")


def test_scripted_faults_under_load_in_pull_and_push(start_server, workers):
    """One proxy in each mode over the same P and D, each with its own clients: every fault
    of the script hits both modes at once (the script restarts workers four times, so it runs
    once, not once a mode)."""
    clusters = [start_proxy(start_server, *workers, "--mode", mode) for mode in MODES]
    refs = [clusters[0].reference(prompt, max_tokens=24) for prompt in PROMPTS]
    outcomes: dict[str, list[tuple[int, object]]] = {mode: [] for mode in MODES}
    done = threading.Event()

    def client(mode: str, url: str, seed: int) -> None:
        rng = random.Random(seed)
        while not done.is_set():
            i = rng.randrange(len(PROMPTS))
            send = rng.choice([complete, stream])
            out = send(url, body(PROMPTS[i], max_tokens=24))
            outcomes[mode].append((i, out))
            if not out.is_ok:
                time.sleep(0.2)  # a client backs off after an error

    clients = [
        Background(client, mode, cluster.proxy.url, seed)
        for mode, cluster in zip(MODES, clusters, strict=True)
        for seed in range(2)
    ]
    try:
        for fault in FAULTS:
            fault(clusters)
            time.sleep(0.5)
    finally:
        done.set()
        for c in clients:
            c.result(timeout=2 * HANG_GUARD)
    for mode in MODES:
        for i, out in outcomes[mode]:
            assert_clear(out, refs[i])
        num_ok = sum(out.is_ok for _, out in outcomes[mode])
        assert num_ok >= 3 * len(FAULTS), f"{mode}: {num_ok} of {len(outcomes[mode])} succeeded"
    for cluster in clusters:
        cluster.heal()
    clusters[0].assert_pools_free()
    for cluster in clusters:  # all well again: disaggregated, colocated output in both modes
        for i, prompt in enumerate(PROMPTS):
            assert_clear(complete(cluster.proxy.url, body(prompt, max_tokens=24)), refs[i])


def test_prefill_frozen_past_its_timeout_leaves_an_unread_lease(start_server, workers):
    cluster = start_proxy(start_server, *workers)
    p, proxy = cluster.p, cluster.proxy
    prompt = list(range(5, 400))
    ref = cluster.reference(prompt)
    with frozen(p):  # the proxy gives up on P after 3 s and asks D alone
        out = complete(proxy.url, body(prompt))
        assert out.is_ok and out.token_ids == ref, out
        assert cluster.routed("colocated", "prefill_failed") == 1
        cluster.wait_health(p, False)
    cluster.wait_health(p, True)
    cluster.assert_pools_free()  # P's late KV: released when the client is gone, or expired


@pytest.fixture(scope="module")
def chunked(start_server, start_worker, workers) -> Cluster:
    """A P that prefills 16 tokens a step: a long prompt's push spans many steps."""
    p = start_worker("prefill", "--max-num-batched-tokens", "16", *P_WORKER).wait_ready()
    return start_proxy(start_server, p, workers[1], "--mode", "push")


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_prefill_faulted_mid_push(chunked, fault):
    cluster, p = chunked, chunked.p
    prompt = list(range(9, 480))
    ref = cluster.reference(prompt)
    pushed = p.metric("pdserve_kv_push_bytes_total")
    call = Background(complete, cluster.proxy.url, body(prompt))
    assert wait_until(lambda: p.metric("pdserve_kv_push_bytes_total") > pushed, interval=0.005)
    kill(p) if fault == "kill" else freeze(p)
    try:
        assert_clear(call.result(), ref)
        cluster.wait_health(p, False)
    finally:
        thaw(p)
    cluster.heal()
    cluster.assert_pools_free()
    assert_clear(complete(cluster.proxy.url, body(prompt)), ref)
