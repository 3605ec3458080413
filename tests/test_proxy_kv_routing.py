"""KV-aware routing: the proxy routes by the blocks workers really hold, read from their KV events.

The parts on their own (the index against the events our engine writes, a subscription against
the real publisher, the choice under load), then the proxy in front of two real prefill workers
and one decode worker, all publishing KV events over ZMQ on loopback. Where a request went is
read from the workers' own metrics and answers (request counts, prefix-cache hit rates,
`usage.prompt_tokens_details.cached_tokens`), not only from the proxy's.

Prefixes are warmed on the prefill worker that hashing would *not* pick, so that a proxy that
ignored the events would fail these tests.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import msgspec
import pytest
import zmq.asyncio

from common.api.protocol import MAX_CACHE_SALT_CHARS
from common.config import KVEventsConfig
from common.kv_cache.event_publisher import KVEventPublisher
from common.kv_cache.events import AllBlocksCleared, KVEventBatch, KVEventCollector
from common.kv_cache.manager import hash_block
from proxy.config import from_dict
from proxy.kv_events import EventsSource, Subscription
from proxy.kv_index import BlockIndex, InFlightPrefixes, decode_batch
from proxy.kv_routing import KVRouter
from proxy.metrics import ProxyMetrics
from proxy.policies import PrefixAware
from proxy.workers import Worker, WorkerPool
from tests.servers import ROOT, free_port, kv_sources, wait_until
from tests.tiny_models import VOCAB

TOKEN = "cluster-secret"
BLOCK = 16
PREFIX_LEN = 512
SYSTEM = ("You are the harbour office's assistant: answer in one short line, name the pier. " * 13)[
    :1000
]  # ~480 tokens of the tiny tokenizer


def ids(seed: int, n: int) -> list[int]:
    return random.Random(seed).choices(range(3, VOCAB), k=n)  # 0-2 are special tokens


# -- the parts on their own ----------------------------------------------------------------------
def stored_batch(token_ids: list[int], block_size: int = 4) -> bytes:
    """What our engine publishes when it caches `token_ids` (common/kv_cache/events.py)."""
    collector, parent = KVEventCollector(block_size), None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = tuple(token_ids[start : start + block_size])
        h = hash_block(parent, block)
        collector.stored(h, parent, list(block))
        parent = h
    return msgspec.msgpack.encode(KVEventBatch(time.time(), collector.take(), 0))


def test_index_walks_the_chain_and_follows_removals_and_clears():
    index = BlockIndex(block_size=4)
    index.apply(decode_batch(stored_batch(list(range(12)))))
    assert len(index) == 3
    assert index.match(list(range(12)) + [99]) == 3
    assert index.match(list(range(8)) + [5, 5, 5, 5]) == 2  # the chain parts after block 2
    assert index.match([1] + list(range(1, 12))) == 0
    second = next(e for e in decode_batch(stored_batch(list(range(8)))).events).block_hashes[1]
    index.remove([second])  # block 1 evicted: block 2 is unreachable, as in the worker's lookup
    assert index.match(list(range(12))) == 1
    index.apply(decode_batch(msgspec.msgpack.encode(KVEventBatch(0.0, [AllBlocksCleared()], 0))))
    assert len(index) == 0 and index.match(list(range(12))) == 0


def test_a_subscription_catches_up_by_replay_then_follows_the_live_stream():
    pub_port, replay_port = free_port(), free_port()
    cfg = KVEventsConfig(f"tcp://*:{pub_port}", f"tcp://127.0.0.1:{replay_port}", topic="w")
    publisher = KVEventPublisher(cfg)
    source = EventsSource(
        f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}", "w", 4, "engine-1"
    )

    def publish(payload: bytes) -> None:
        publisher.publish(msgspec.msgpack.decode(payload, type=KVEventBatch).events)

    async def until(condition, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def scenario():
        ctx = zmq.asyncio.Context()
        sub = Subscription(ctx, source, "worker")
        try:
            publish(stored_batch(list(range(8))))  # before anyone listens: only replay has it
            publish(stored_batch(list(range(100, 112))))
            sub.start()
            assert await until(lambda: sub.is_ready and len(sub.index) == 5)
            assert sub.index.match(list(range(8))) == 2
            publisher.publish([AllBlocksCleared()])
            assert await until(lambda: len(sub.index) == 0)
            publish(stored_batch(list(range(200, 204))))
            assert await until(lambda: sub.index.match(list(range(200, 204))) == 1)
            assert sub.next_seq == 4 and sub.num_gaps == 0
        finally:
            await sub.close()
            ctx.destroy(linger=0)

    try:
        asyncio.run(scenario())
    finally:
        publisher.close()


def test_workers_advertise_an_address_a_subscriber_can_connect_to():
    from common.api.internal import _connectable

    assert _connectable("tcp://*:5557", "10.0.0.2") == "tcp://10.0.0.2:5557"
    assert _connectable("tcp://[::]:5557", "fd00::2") == "tcp://[fd00::2]:5557"
    assert _connectable("tcp://10.0.0.3:5557", "10.0.0.2") == "tcp://10.0.0.3:5557"
    assert _connectable("ipc:///tmp/kv", "10.0.0.2") == "ipc:///tmp/kv"
    info = {"endpoint": "tcp://0.0.0.0:1", "replay_endpoint": "tcp://*:2", "topic": "t"}
    source = EventsSource.parse({**info, "block_size": 16, "engine_id": "e"}, "http://w1:8100")
    assert (source.endpoint, source.replay_endpoint) == ("tcp://w1:1", "tcp://w1:2")
    assert EventsSource.parse({"endpoint": None, "block_size": 16}, "http://w1:8100") is None


def test_the_proxy_still_imports_no_torch():
    code = "import sys, proxy.app; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


class Feeds:
    """KVEventFeeds' face to the router, with indexes given by the test."""

    def __init__(self, indexes: dict[Worker, BlockIndex]):
        self.indexes = indexes

    def index_of(self, worker: Worker) -> BlockIndex | None:
        return self.indexes.get(worker)


def router_for(indexes: dict[Worker, BlockIndex], pools) -> KVRouter:
    cfg = from_dict({"decode": ["http://d:1"]})
    return KVRouter(cfg, pools, Feeds(indexes), ProxyMetrics(pools))


def test_the_longest_prefix_wins_while_its_queue_allows():
    client = httpx.AsyncClient()
    p1, p2 = (Worker(f"http://p{i}:1", "prefill", client, client._transport) for i in (1, 2))
    pools = {"prefill": WorkerPool("prefill"), "decode": WorkerPool("decode")}
    one, two = BlockIndex(BLOCK), BlockIndex(BLOCK)
    prefix = ids(1, PREFIX_LEN)
    one.apply(decode_batch(stored_batch(prefix, BLOCK)))
    router, hashing = router_for({p1: one, p2: two}, pools), PrefixAware()
    prompt = prefix + ids(2, 64)
    assert router.choose("prefill", [p1, p2], prompt, hashing, "") is p1
    assert router.choose("prefill", [p2, p1], prompt, hashing, "") is p1
    with router.prefilling(p1, ids(3, 1000)):  # a long queue on P1: P2 is much sooner
        assert router.choose("prefill", [p1, p2], prompt, hashing, "") is p2
    with router.prefilling(p1, ids(3, 64)):  # a short queue: the cache still wins
        assert router.choose("prefill", [p1, p2], prompt, hashing, "") is p1
    fresh = ids(4, PREFIX_LEN)  # nobody holds it: the hash decides, the same for the same key
    first = router.choose("prefill", [p1, p2], fresh + ids(5, 8), hashing, "fresh")
    with router.prefilling(first, fresh + ids(5, 8)):  # its twin meets it there, while in flight
        other = p2 if first is p1 else p1
        with router.prefilling(other, ids(6, 100)):
            assert router.choose("prefill", [p1, p2], fresh + ids(7, 8), hashing, "x") is first
    assert router.metrics.prefix_hit_blocks.labels("prefill")._value.get() == 32 * 3
    no_events = router_for({}, pools)
    assert no_events.choose("prefill", [p1, p2], prompt, hashing, "k") is hashing.choose(
        [p1, p2], "k"
    )


def shared_blocks(a: list[int], b: list[int], size: int) -> int:
    """Leading full blocks two prompts have in common, compared token by token."""
    num = 0
    while (num + 1) * size <= min(len(a), len(b)) and a[: (num + 1) * size] == b[
        : (num + 1) * size
    ]:
        num += 1
    return num


def test_prefills_in_flight_index_matches_a_scan_and_forgets_finished_ones():
    rng = random.Random(7)
    stem = ids(10, 40)
    prompts = [stem[: rng.randrange(0, 41)] + ids(11 + i, rng.randrange(0, 30)) for i in range(30)]
    prefills = InFlightPrefixes(block_size=4)
    entries = [prefills.add(p, len(p)) for p in prompts]
    entries.append(prefills.add(prompts[0], 5))  # a twin: the same prompt twice in flight
    prompts.append(prompts[0])
    assert len(prefills) == 31 and prefills.num_uncached == sum(map(len, prompts[:-1])) + 5
    for _ in range(30):
        live = [p for p, e in zip(prompts, entries) if e is not None]
        for query in (stem + ids(99, 9), rng.choice(live) + [1], ids(98, 20), []):
            expected = max((shared_blocks(query, p, 4) for p in live), default=0)
            assert prefills.match(query) == expected
        i = rng.choice([i for i, e in enumerate(entries) if e is not None])
        prefills.remove(entries[i])  # a prefill finished
        entries[i] = None
    first = next(e for e in entries if e is not None)
    assert prefills.match(prompts[entries.index(first)]) == len(first.path)
    prefills.remove(first)
    assert (len(prefills), prefills.num_nodes, prefills.num_uncached) == (0, 0, 0)
    assert prefills.match(stem) == 0


def test_the_router_drops_a_prefill_from_its_index_when_it_finishes():
    client = httpx.AsyncClient()
    p1 = Worker("http://p1:1", "prefill", client, client._transport)
    pools = {"prefill": WorkerPool("prefill"), "decode": WorkerPool("decode")}
    router = router_for({p1: BlockIndex(BLOCK)}, pools)
    prompt = ids(20, 10 * BLOCK)
    with router.prefilling(p1, prompt):
        with router.prefilling(p1, prompt[: 4 * BLOCK] + ids(21, BLOCK)):
            assert router._cached_tokens(p1, prompt, 0) == 10 * BLOCK
            assert router._queued(p1) == 11 * BLOCK  # its first 4 blocks were being computed
        assert router._cached_tokens(p1, prompt[: 6 * BLOCK], 0) == 6 * BLOCK
        assert router._queued(p1) == 10 * BLOCK
    assert router._cached_tokens(p1, prompt, 0) == 0 and router._queued(p1) == 0
    with pytest.raises(RuntimeError), router.prefilling(p1, prompt):  # a prefill that failed
        raise RuntimeError("upstream")
    assert router._cached_tokens(p1, prompt, 0) == 0 and not router._prefills


# -- the proxy in front of real workers --------------------------------------------------------
@pytest.fixture(scope="module")
def model_1k(tiny_model, tmp_path_factory):
    """The tiny llama with room for a 512-token prefix and a suffix: its rope is computed, so
    its weights do not depend on max_position_embeddings."""
    folder = tmp_path_factory.mktemp("llama-1k")
    shutil.copytree(tiny_model("llama"), folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    return folder


@pytest.fixture(scope="module")
def cluster(start_server, model_1k):
    def worker(role: str):
        args = ["--model", str(model_1k), "--max-model-len", "1024", "--num-blocks", "256"]
        args += ["--internal-token", TOKEN, "--served-model-name", "tiny"]
        args += ["--kv-events-endpoint", f"tcp://*:{free_port()}"]
        args += ["--kv-events-replay-endpoint", f"tcp://*:{free_port()}"]
        return start_server(role, *args, wait=False)

    p1, p2, d = (w.wait_ready() for w in (worker("prefill"), worker("prefill"), worker("decode")))
    proxy = start_server(
        "proxy", "--prefill", p1.url, "--prefill", p2.url, "--decode", d.url,
        "--internal-token", TOKEN, "--health-interval", "0.5",
    )  # fmt: skip
    return SimpleNamespace(p1=p1, p2=p2, d=d, proxy=proxy, prefills=(p1, p2))


def complete(url: str, prompt: list[int], **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    body.update(return_token_ids=True, **extra)
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def chat(url: str, user: str) -> dict:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    body = {"messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def served(worker, path: str = "/v1/completions") -> float:
    return worker.metric(
        f'pdserve_requests_total{{endpoint="{path}",role="{worker.role}",status="200"}}', 0
    )


def indexed(proxy, worker) -> float:
    name = f'pdserve_proxy_kv_index_blocks{{role="{worker.role}",url="{worker.url}"}}'
    return proxy.metric(name, -1)


def assert_loaded(d, before: dict[str, float], num_requests: int, mode: str = "pull") -> None:
    """D loaded the KV of each of `num_requests` P/D requests since `before` (its kv_sources),
    and computed none of them instead."""
    assert wait_until(lambda: kv_sources(d)[mode] == before[mode] + num_requests, 10), (
        f"D loaded {kv_sources(d)[mode] - before[mode]:g} of {num_requests} requests ({mode})"
    )
    assert kv_sources(d)["recomputed"] == before["recomputed"]


def not_hashed_to(c, key: str):
    """The prefill worker that the hash policy would not pick for `key` (the proxy's ring)."""
    client = httpx.AsyncClient()
    ws = [Worker(p.url, "prefill", client, client._transport) for p in c.prefills]
    picked = PrefixAware().choose(ws, key[:256])
    return next(p for p, w in zip(c.prefills, ws, strict=True) if w is not picked)


def test_a_warmed_prefix_goes_to_the_prefill_worker_that_holds_it(cluster):
    c = cluster
    prefix = ids(10, PREFIX_LEN)
    prompts = [prefix + ids(20 + i, 96) for i in range(6)]
    warm = not_hashed_to(c, json.dumps(prompts[0]))
    other = c.p2 if warm is c.p1 else c.p1
    complete(warm.url, prefix + ids(11, 40), max_tokens=1)  # the prefix, cached on one P only
    assert wait_until(lambda: indexed(c.proxy, warm) >= PREFIX_LEN // BLOCK, 30)
    before = served(warm), served(other)
    hits = 'pdserve_proxy_prefix_hit_blocks_total{role="prefill"}'
    hits_before = c.proxy.metric(hits, 0)
    cached_before = c.proxy.metric("pdserve_proxy_prefill_cached_tokens_total", 0)
    loads_before = kv_sources(c.d)
    routed = [complete(c.proxy.url, p) for p in prompts]
    assert_loaded(c.d, loads_before, 6)  # P/D equality below is of KV that D read
    assert (served(warm) - before[0], served(other) - before[1]) == (6, 0)
    assert warm.metric("pdserve_prefix_cache_hit_rate") > 0.5  # its own lookups hit
    assert other.metric("pdserve_prefix_cache_hit_rate") == 0
    assert c.proxy.metric(hits) - hits_before >= 6 * PREFIX_LEN // BLOCK
    cached = c.proxy.metric("pdserve_proxy_prefill_cached_tokens_total") - cached_before
    assert cached >= 6 * PREFIX_LEN  # P's own usage reports
    routed_pd = 'pdserve_proxy_routed_total{path="disaggregated",reason="pull"}'
    assert c.proxy.metric(routed_pd) >= 6
    for prompt, through in zip(prompts, routed, strict=True):
        alone = complete(c.d.url, prompt)
        assert through["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
        assert through["choices"][0]["text"] == alone["choices"][0]["text"]


def test_chat_prompts_are_rendered_and_follow_their_prefix(cluster):
    c = cluster
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "pier 1?"}]
    warm = not_hashed_to(c, json.dumps(messages, separators=(",", ":")))
    other = c.p2 if warm is c.p1 else c.p1
    blocks_before = indexed(c.proxy, warm)
    chat(warm.url, "warming up")
    assert wait_until(lambda: indexed(c.proxy, warm) >= blocks_before + 25, 30)
    before = served(warm, "/v1/chat/completions"), served(other, "/v1/chat/completions")
    renders = c.proxy.metric("pdserve_proxy_render_seconds_count", 0)
    loads_before = kv_sources(c.d)
    # NOTE: each user turn is > 64 tokens: D, which keeps the transferred KV of the first one,
    # holds the system prompt too, and a shorter remainder would go to D alone
    users = [
        f"Which pier for ship number {i}? " + "It carries timber and grain. " * 6 for i in range(3)
    ]
    routed = [chat(c.proxy.url, u) for u in users]
    assert_loaded(c.d, loads_before, 3)
    after = served(warm, "/v1/chat/completions"), served(other, "/v1/chat/completions")
    assert (after[0] - before[0], after[1] - before[1]) == (3, 0)
    assert c.proxy.metric("pdserve_proxy_render_seconds_count") - renders == 3
    for user, through in zip(users, routed, strict=True):
        assert through["choices"][0]["message"] == chat(c.d.url, user)["choices"][0]["message"]


def test_a_prompt_the_decode_worker_holds_goes_to_it_alone(cluster):
    c = cluster
    held = ids(30, 256)
    blocks_before = indexed(c.proxy, c.d)
    complete(c.d.url, held + ids(31, 5), max_tokens=1)  # D caches the 256 tokens
    assert wait_until(lambda: indexed(c.proxy, c.d) >= blocks_before + 256 // BLOCK, 30)
    before = [served(p) for p in c.prefills]
    prompt = held + ids(32, 8)  # all but 8 tokens on D: below --cached-on-decode-tokens (64)
    through = complete(c.proxy.url, prompt)
    assert [served(p) for p in c.prefills] == before  # no prefill worker saw it
    name = 'pdserve_proxy_routed_total{path="colocated",reason="cached_on_decode"}'
    assert c.proxy.metric(name) == 1
    assert through["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256  # D's own word
    alone = complete(c.d.url, prompt)
    assert through["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_the_next_turn_reads_the_answer_it_holds_from_the_decode_worker(
    cluster, start_server, mode
):
    """The reverse pull: turn 2's prompt holds turn 1's answer, which D generated and no P has
    seen. P reads the blocks D holds instead of computing them (P's own count), computes the
    new message, and the answer is what D alone gives. In push mode D reserves the prompt's
    blocks starting with those it holds, and P writes only the rest."""
    c = cluster
    proxy = c.proxy
    if mode == "push":
        proxy = start_server(
            "proxy", "--prefill", c.p1.url, "--prefill", c.p2.url, "--decode", c.d.url,
            "--internal-token", TOKEN, "--health-interval", "0.5", "--mode", "push",
        )  # fmt: skip
    seed = 60 if mode == "pull" else 70
    first = ids(seed, 100)
    blocks_before = indexed(proxy, c.d)
    answer = complete(proxy.url, first, max_tokens=80)["choices"][0]["token_ids"]
    history = first + answer  # D computed the KV of all but the last token: 11 whole blocks
    assert wait_until(lambda: indexed(proxy, c.d) >= blocks_before + 11, 30)
    lent = 'pdserve_proxy_reverse_pulls_total{outcome="lent"}'
    lent_before, tokens_before = (
        proxy.metric(lent, 0),
        proxy.metric("pdserve_proxy_reverse_pull_tokens_total", 0),
    )
    reverse = 'pdserve_kv_loaded_requests_total{mode="reverse"}'
    pushed = 'pdserve_kv_loaded_requests_total{mode="push"}'
    read_before, pushed_before = sum(p.metric(reverse) for p in c.prefills), c.d.metric(pushed, 0)
    held_before = c.d.metric("pdserve_kv_push_held_blocks_total", 0)
    loads_before = kv_sources(c.d)
    prompt = history + ids(seed + 1, 80)
    through = complete(proxy.url, prompt)
    assert_loaded(c.d, loads_before, 1, mode)  # pull: D read what P computed and read
    assert proxy.metric(lent) == lent_before + 1
    # D lent its 176 tokens; turn 1's P, which holds the first 96, read the other 80
    assert proxy.metric("pdserve_proxy_reverse_pull_tokens_total") - tokens_before == 80
    assert wait_until(lambda: sum(p.metric(reverse) for p in c.prefills) == read_before + 1, 10)
    assert wait_until(lambda: c.d.metric("pdserve_kv_blocks_held") == 0, 10)  # lease ended
    # push: P wrote turn 2 into D (pull: D read it), all but the 11 blocks D reserved from
    # its own cache
    assert c.d.metric(pushed, 0) - pushed_before == (1 if mode == "push" else 0)
    held = c.d.metric("pdserve_kv_push_held_blocks_total", 0) - held_before
    assert held == (11 if mode == "push" else 0)
    alone = complete(c.d.url, prompt)
    assert through["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]


def test_without_kv_events_prefix_routing_hashes(cluster, start_server):
    c = cluster
    proxy = start_server(
        "proxy", "--prefill", c.p1.url, "--prefill", c.p2.url, "--decode", c.d.url,
        "--internal-token", TOKEN, "--health-interval", "0.5", "--no-kv-routing",
    )  # fmt: skip
    prefix = ids(40, PREFIX_LEN)
    prompts = [prefix + ids(41 + i, 96) for i in range(4)]
    hashed = next(p for p in c.prefills if p is not not_hashed_to(c, json.dumps(prompts[0])))
    before = [served(p) for p in c.prefills]
    for prompt in prompts:
        complete(proxy.url, prompt)
    deltas = [served(p) - b for p, b in zip(c.prefills, before, strict=True)]
    assert deltas[c.prefills.index(hashed)] == 4 and sum(deltas) == 4
    assert proxy.metric('pdserve_proxy_prefix_hit_blocks_total{role="prefill"}', 0) == 0
    assert proxy.metric("pdserve_proxy_render_seconds_count", 0) == 0
    assert indexed(proxy, c.p1) == -1  # no subscription at all


def test_a_restarted_worker_starts_with_an_empty_index(cluster):
    c = cluster
    complete(c.p2.url, ids(50, 64), max_tokens=1)
    assert wait_until(lambda: indexed(c.proxy, c.p2) > 0, 30)
    c.p2.restart().wait_ready()
    assert wait_until(lambda: indexed(c.proxy, c.p2) == 0, 30)  # the new engine's index
    complete(c.p2.url, ids(51, 64), max_tokens=1)
    assert wait_until(lambda: indexed(c.proxy, c.p2) >= 4, 30)  # and it follows the new stream


# -- cache_salt: a tenant's prefix cache of its own -----------------------------------------------
def cached_tokens(answer: dict) -> int:
    return (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def test_two_salts_never_share_a_cached_block(cluster):
    url, prompt = cluster.p1.url, ids(80, 130)  # 8 whole blocks, all but the last token
    complete(url, prompt, max_tokens=1, cache_salt="tenant-a")
    assert cached_tokens(complete(url, prompt, max_tokens=1, cache_salt="tenant-a")) == 128
    assert cached_tokens(complete(url, prompt, max_tokens=1, cache_salt="tenant-b")) == 0
    assert cached_tokens(complete(url, prompt, max_tokens=1)) == 0  # no salt: not tenant-a's
    assert cached_tokens(complete(url, prompt, max_tokens=1)) == 128  # no salt: shared
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "pier 9?"}]
    body = {"messages": messages, "max_tokens": 1, "cache_salt": "tenant-a"}
    chats = [httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120) for _ in "ab"]
    assert [r.status_code for r in chats] == [200, 200]
    assert cached_tokens(chats[0].json()) == 0  # the system prompt without the salt: not hit
    assert cached_tokens(chats[1].json()) >= 400


@pytest.mark.parametrize("salt", ["", 7, "x" * (MAX_CACHE_SALT_CHARS + 1)])
def test_a_bad_cache_salt_is_a_400(cluster, salt):
    body = {"prompt": ids(81, 20), "max_tokens": 1, "cache_salt": salt}
    for url in (cluster.p1.url, cluster.proxy.url):  # the proxy passes P's 400 on, untried
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "cache_salt"


def test_a_salted_prompt_is_read_from_p_and_claims_no_blocks_of_another_salt(cluster):
    """Every worker holds the prompt without a salt: with one it is computed on P (P's usage),
    D reads it from P (D's count) and caches it under the salt, and the proxy, which routes it
    as a prompt nobody holds, counts no hit."""
    c = cluster
    prompt = ids(90, 200)  # 12 whole blocks
    for w in (c.p1, c.p2, c.d):
        complete(w.url, prompt, max_tokens=1)
    # NOTE: the index's size is no proof (eviction on a full pool holds it back): the proxy
    # sends the prompt without a salt to D alone once D's events say D holds all of it
    routed = 'pdserve_proxy_routed_total{path="colocated",reason="cached_on_decode"}'

    def is_indexed_on_d() -> bool:
        before = c.proxy.metric(routed, 0)
        complete(c.proxy.url, prompt, max_tokens=1)
        return c.proxy.metric(routed, 0) > before

    assert wait_until(is_indexed_on_d, 30)
    hits = [f'pdserve_proxy_prefix_hit_blocks_total{{role="{r}"}}' for r in ("prefill", "decode")]
    hits_before = [c.proxy.metric(name, 0) for name in hits]
    cached_before = c.proxy.metric("pdserve_proxy_prefill_cached_tokens_total", 0)
    loaded_before = kv_sources(c.d)
    fallbacks = 'pdserve_proxy_kv_fallbacks_total{reason="cache_salt"}'
    fallbacks_before = c.proxy.metric(fallbacks, 0)
    through = complete(c.proxy.url, prompt, cache_salt="tenant-c")
    assert c.proxy.metric("pdserve_proxy_prefill_cached_tokens_total", 0) == cached_before
    loaded = kv_sources(c.d)
    assert loaded["pull"] == loaded_before["pull"] + 1, "D read the KV from P"
    assert loaded["recomputed"] == loaded_before["recomputed"]
    assert [c.proxy.metric(name, 0) for name in hits] == hits_before
    assert c.proxy.metric(fallbacks) == fallbacks_before + 1
    alone = complete(c.d.url, prompt, cache_salt="tenant-c")
    assert cached_tokens(alone) == 192  # what D read, cached under the salt
    assert through["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
