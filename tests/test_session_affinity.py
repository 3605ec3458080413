"""Session affinity (proxy/sessions.py): the requests of one `X-Session-ID` stay on one worker,
within the load bound; a new session hashes to the same worker in every proxy process.

The choice on its own and through `Planner.choose` (retries' exclusions, no header, the
flag), then the proxy in front of two real decode workers, read from the workers' own counters.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import httpx
import pytest

from benchmarks.serving.client import Endpoint
from benchmarks.serving.conversations import Conversation, ConversationConfig
from benchmarks.serving.multiturn import run_conversations
from proxy.config import from_dict
from proxy.metrics import ProxyMetrics
from proxy.orchestrator import Orchestrator
from proxy.policies import LeastOutstanding, RoundRobin
from proxy.request import COMPLETIONS_PATH, MAX_SESSION_ID_CHARS, ProxyRequest
from proxy.sessions import SessionAffinity
from proxy.workers import Worker, WorkerPool

CLIENT = httpx.AsyncClient()


def decode_workers(n: int, shuffle_seed: int | None = None) -> list[Worker]:
    ws = [Worker(f"http://d{i}:8200", "decode", CLIENT, CLIENT._transport) for i in range(n)]
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(ws)
    return ws


def affinity(max_sessions: int = 100) -> SessionAffinity:
    return SessionAffinity("decode", ProxyMetrics({}), max_sessions)


def outcomes(sessions: SessionAffinity) -> dict[str, float]:
    counter = sessions.metrics.session_routed
    names = ("kept", "hashed", "moved_load", "moved_gone")
    return {o: counter.labels("decode", o)._value.get() for o in names}


def unused(*_) -> Worker:
    raise AssertionError("the session's own worker was expected")


# -- the choice on its own ------------------------------------------------------------------------
def test_a_session_stays_on_its_worker():
    sessions, ws = affinity(), decode_workers(3)
    chosen = {sessions.choose("alice", ws, unused) for _ in range(5)}
    assert len(chosen) == 1 and sessions.url_of("alice") == chosen.pop().url
    assert outcomes(sessions) == {"kept": 4, "hashed": 1, "moved_load": 0, "moved_gone": 0}


def test_a_new_session_hashes_alike_in_every_process_and_any_order():
    ids = [f"session-{i}" for i in range(64)]
    one, two = affinity(), affinity()  # two proxy processes: nothing shared but the URLs
    first = [one.choose(s, decode_workers(4), unused).url for s in ids]
    second = [
        two.choose(s, decode_workers(4, shuffle_seed=i), unused).url for i, s in enumerate(ids)
    ]
    assert first == second
    assert len(set(first)) == 4  # the hash spreads sessions over the workers
    smaller = [affinity().choose(s, decode_workers(3), unused).url for s in ids]
    moved = sum(a != b for a, b in zip(first, smaller, strict=True))
    assert moved == first.count("http://d3:8200")  # a worker gone moves only its own sessions


def test_over_the_load_bound_a_session_moves_and_stays_where_it_moved():
    sessions, ws = affinity(), decode_workers(3)
    home = sessions.choose("alice", ws, unused)
    home.num_outstanding = 4  # the others idle: 5 > 1.25 × 5 / 3
    least = LeastOutstanding()
    moved = sessions.choose("alice", ws, lambda: least.choose(ws, ""))
    assert moved is not home and sessions.url_of("alice") == moved.url
    moved.num_outstanding = 1  # within the bound: 2 <= 1.25 × 6 / 3
    assert sessions.choose("alice", ws, unused) is moved
    assert outcomes(sessions) == {"kept": 1, "hashed": 1, "moved_load": 1, "moved_gone": 0}
    for w in ws:
        w.num_outstanding = 0
    hashed = affinity().choose("bob", ws, unused)  # a new session whose hashed worker is busy
    hashed.num_outstanding = 20
    fresh = affinity()
    assert fresh.choose("bob", ws, lambda: least.choose(ws, "")) is not hashed
    assert outcomes(fresh)["moved_load"] == 1


def test_a_session_whose_worker_is_gone_falls_back_and_remembers():
    sessions, ws = affinity(), decode_workers(3)
    home = sessions.choose("alice", ws, unused)
    others = [w for w in ws if w is not home]
    policy = RoundRobin()
    moved = sessions.choose("alice", others, lambda: policy.choose(others, ""))
    assert moved is others[0] and sessions.url_of("alice") == moved.url
    assert sessions.choose("alice", ws, unused) is moved  # even once the old one is back
    assert outcomes(sessions) == {"kept": 1, "hashed": 1, "moved_load": 0, "moved_gone": 1}


def test_the_least_recent_sessions_are_forgotten():
    sessions, ws = affinity(max_sessions=2), decode_workers(2)
    for s in ("a", "b", "a", "c"):  # "a" used again: "b" is the least recent
        sessions.choose(s, ws, unused)
    assert len(sessions) == 2
    assert sessions.url_of("b") is None
    assert sessions.url_of("a") is not None and sessions.url_of("c") is not None


def test_the_session_header_is_read_trimmed_and_capped():
    raw = b'{"prompt": "hi"}'
    assert ProxyRequest.parse(COMPLETIONS_PATH, raw, "r").session_id is None
    assert ProxyRequest.parse(COMPLETIONS_PATH, raw, "r", session_header="").session_id is None
    assert ProxyRequest.parse(COMPLETIONS_PATH, raw, "r", session_header=" s1 ").session_id == "s1"
    long = ProxyRequest.parse(COMPLETIONS_PATH, raw, "r", session_header="x" * 10_000)
    assert long.session_id == "x" * MAX_SESSION_ID_CHARS


# -- through Planner.choose -----------------------------------------------------------------------
class NoFeeds:
    """KVEventFeeds' face to the router: no worker publishes KV events."""

    def index_of(self, worker: Worker) -> None:
        return None


def orchestrator(n: int, **settings) -> tuple[Orchestrator, list[Worker]]:
    ws = decode_workers(n)
    cfg = from_dict({"decode": [w.url for w in ws], "decode_policy": "round_robin", **settings})
    pools = {"prefill": WorkerPool("prefill"), "decode": WorkerPool("decode")}
    for w in ws:
        w.is_healthy = True
        pools["decode"].add(w)
    return Orchestrator(cfg, pools, ProxyMetrics(pools), NoFeeds()), ws


def request(session: str | None) -> ProxyRequest:
    return ProxyRequest.parse(COMPLETIONS_PATH, b'{"prompt": "hi"}', "r", session_header=session)


def test_the_orchestrator_keeps_a_session_and_a_retry_still_leaves_the_failed_worker_out():
    orch, ws = orchestrator(3)
    alice = request("alice")
    home = orch.planner.choose("decode", alice)
    assert {orch.planner.choose("decode", alice) for _ in range(4)} == {home}
    retried = orch.planner.choose("decode", alice, tried=(home,))
    assert retried is not home
    assert orch.planner.choose("decode", alice) is retried  # the session follows its last worker
    home.is_healthy = False
    assert orch.planner.choose("decode", request("bob"), tried=(retried,)) not in (home, retried)


def test_without_the_header_or_with_the_flag_off_the_policy_decides_as_before():
    orch, ws = orchestrator(3)
    assert [orch.planner.choose("decode", request(None)) for _ in range(6)] == ws * 2  # round robin
    assert len(orch.planner.sessions["decode"]) == 0
    off, ws = orchestrator(3, session_affinity=False)
    assert [off.planner.choose("decode", request("alice")) for _ in range(6)] == ws * 2
    assert len(off.planner.sessions["decode"]) == 0


# -- the proxy in front of two decode workers ---------------------------------------------------
@pytest.fixture(scope="module")
def cluster(start_server, tiny_model):
    model = str(tiny_model("llama"))
    args = ["--model", model, "--num-blocks", "128", "--max-model-len", "512"]
    ds = [start_server("decode", *args, "--served-model-name", "tiny", wait=False) for _ in "12"]
    ds = [d.wait_ready() for d in ds]
    proxy = start_server(
        "proxy", "--mode", "colocated", *[a for d in ds for a in ("--decode", d.url)],
        "--decode-policy", "round_robin", "--health-interval", "0.5",
    )  # fmt: skip
    return ds, proxy


def served(worker) -> float:
    path = "/v1/completions"
    return worker.metric(
        f'pdserve_requests_total{{endpoint="{path}",role="decode",status="200"}}', 0
    )


def complete(url: str, session: str | None) -> None:
    headers = {"X-Session-ID": session} if session else {}
    body = {"prompt": "The harbour office", "max_tokens": 2, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text


def sessions_hashed_apart(ds) -> tuple[str, str]:
    """Two session ids that the proxy's hash puts on different decode workers."""
    ws = [Worker(d.url, "decode", CLIENT, CLIENT._transport) for d in ds]
    home = {s: affinity().choose(s, ws, unused).url for s in (f"s{i}" for i in range(32))}
    first = next(iter(home))
    return first, next(s for s, url in home.items() if url != home[first])


def test_a_session_stays_on_one_decode_worker_and_two_sessions_can_part(cluster):
    ds, proxy = cluster
    alice, bob = sessions_hashed_apart(ds)
    deltas = []
    for session in (alice, bob, None):
        before = [served(d) for d in ds]
        for _ in range(4):
            complete(proxy.url, session)
        deltas.append([served(d) - b for d, b in zip(ds, before, strict=True)])
    assert sorted(deltas[0]) == [0, 4] and sorted(deltas[1]) == [0, 4]  # one D each
    assert deltas[0] != deltas[1]  # and not the same one
    assert deltas[2] == [2, 2]  # no session: round robin, as before
    kept = proxy.metric('pdserve_proxy_session_routed_total{outcome="kept",role="decode"}')
    hashed = proxy.metric('pdserve_proxy_session_routed_total{outcome="hashed",role="decode"}')
    assert (kept, hashed) == (6, 2)


def test_the_multiturn_benchmark_sends_one_session_per_conversation(cluster):
    ds, proxy = cluster
    kept = 'pdserve_proxy_session_routed_total{outcome="kept",role="decode"}'
    hashed = 'pdserve_proxy_session_routed_total{outcome="hashed",role="decode"}'
    before = proxy.metric(kept), proxy.metric(hashed)
    conversations = [Conversation(("Hello there", "And then?", "Why?")) for _ in range(2)]
    conv = ConversationConfig(num_conversations=2, num_turns=3, output_len=2)

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            endpoint = Endpoint(proxy.url, "chat", "tiny")
            return await run_conversations(client, endpoint, None, conversations, conv, 1, seed=7)

    turns, _ = asyncio.run(run())
    assert all(t.record.success for t in turns) and len(turns) == 6
    assert (proxy.metric(kept) - before[0], proxy.metric(hashed) - before[1]) == (4, 2)
    assert Counter(t.conversation for t in turns) == {0: 3, 1: 3}
