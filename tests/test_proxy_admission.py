"""Admission control in the proxy (proxy/admission.py): token buckets per API key, a bounded
priority queue for slots with a deadline, 429s in OpenAI's shape with Retry-After, slots that
never leak, and a flood from one key that leaves another key's time to first token within 2× of
its idle value. The parts alone first (an injected clock, a queue on one event loop), then real
proxies on loopback in front of stub decode workers (tests/stub_worker.py) that stream one
chunk per `--chunk-delay`, so a request holds its slot for `max_tokens` × that delay. Every wait
has a deadline; nothing is asserted right after an action."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from proxy.admission import Admission, AdmissionRefused, RateLimit, RateLimiter, SlotQueue
from proxy.config import build_parser, from_dict, parse_args
from proxy.metrics import ProxyMetrics
from tests.servers import free_port, wait_until
from tests.stub_worker import StubWorkers

QUICK_S = 0.1  # one chunk of the quick stub
SLOW_S = 0.5  # one chunk of the slow stub: the TTFT the fairness test measures
RUNNING = "pdserve_proxy_admitted_running"
DEPTH = "pdserve_proxy_queue_depth"


# -- the parts ---------------------------------------------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket_refills_at_its_rate_up_to_its_burst():
    clock = FakeClock()
    limiter = RateLimiter({"a": RateLimit(2.0, 3.0), "default": RateLimit(1.0, 1.0)}, clock)
    assert [limiter.wait_s("a") for _ in range(3)] == [0.0, 0.0, 0.0]  # the burst
    assert limiter.wait_s("a") == pytest.approx(0.5)  # a token every 1/2 s
    clock.now += 0.25
    assert limiter.wait_s("a") == pytest.approx(0.25)
    clock.now += 0.25
    assert limiter.wait_s("a") == 0.0 and limiter.wait_s("a") > 0
    clock.now += 60  # refills to the burst, no further
    assert [limiter.wait_s("a") for _ in range(4)][-1] == pytest.approx(0.5)
    assert limiter.wait_s("b") == 0.0 and limiter.wait_s("c") == 0.0  # a default bucket each
    assert limiter.wait_s("b") == pytest.approx(1.0)
    assert RateLimiter({"a": RateLimit(1.0, 1.0)}, clock).wait_s("other") == 0.0  # no default


def test_bucket_table_is_an_lru_with_a_hard_cap():
    """New keys past the cap drop the least recently used bucket, never grow the table: a key
    in use keeps its drained bucket, a forgotten one starts again full."""
    clock = FakeClock()
    limiter = RateLimiter({"default": RateLimit(1.0, 1.0)}, clock, max_buckets=3)
    for key in ("a", "b", "c"):
        assert limiter.wait_s(key) == 0.0  # each bucket drained: the clock stands still
    assert limiter.wait_s("a") > 0  # a is now the most recently used
    assert limiter.wait_s("d") == 0.0  # b, least recently used, makes room
    assert list(limiter.buckets) == ["c", "a", "d"]
    for i in range(100):  # a flood of new keys: the table never passes its cap
        limiter.wait_s(f"new-{i}")
        assert len(limiter.buckets) == 3
    assert list(limiter.buckets) == ["new-97", "new-98", "new-99"]
    assert limiter.wait_s("new-98") > 0  # kept: still drained
    assert limiter.wait_s("a") == 0.0  # dropped: a fresh bucket


def test_waiters_that_leave_leave_the_heap():
    """Waiters that time out or whose client leaves do not pile up in the heap while no slot is
    released: `--max-queue` bounds it."""

    async def scenario() -> None:
        queue = SlotQueue(max_running=1, max_waiting=4, timeout=0.01)
        holder = await queue.acquire(1)
        for _ in range(25):  # timeouts
            late = [asyncio.create_task(queue.acquire(1)) for _ in range(4)]
            for result in await asyncio.gather(*late, return_exceptions=True):
                assert isinstance(result, AdmissionRefused), result
            assert queue.heap_size <= 2 * queue.max_waiting
        assert (queue.num_waiting, queue.heap_size) == (0, 0)
        queue.timeout = 60.0
        for _ in range(25):  # clients that left
            gone = [asyncio.create_task(queue.acquire(0)) for _ in range(4)]
            await asyncio.sleep(0)
            assert queue.num_waiting == 4
            for task in gone:
                task.cancel()
            await asyncio.gather(*gone, return_exceptions=True)
            assert queue.heap_size <= 2 * queue.max_waiting
        assert (queue.num_waiting, queue.heap_size) == (0, 0)
        stays = asyncio.create_task(queue.acquire(2))  # the queue still hands slots on
        await asyncio.sleep(0)
        holder.release()
        (await stays).release()
        assert (queue.num_running, queue.num_waiting, queue.heap_size) == (0, 0, 0)

    asyncio.run(scenario())


def test_key_priority_default_is_the_ceiling_of_keys_not_listed():
    cfg = from_dict(
        {"decode": ["http://d:1"], "key_priority": ["default=low", "ops=high", "anonymous=normal"]}
    )
    admission = Admission(cfg, ProxyMetrics({}))
    assert admission.rank_of("stranger", "high") == 2  # capped by default=low
    assert admission.rank_of("stranger", None) == 2  # and low unless it asks for less
    assert admission.rank_of("ops", "high") == 0 and admission.rank_of("ops", None) == 0
    assert admission.rank_of(None, "high") == 1  # no key: `anonymous` is listed
    plain = Admission(from_dict({"decode": ["http://d:1"]}), ProxyMetrics({}))
    assert plain.rank_of("stranger", "high") == 0 and plain.rank_of("stranger", None) == 1
    assert "KEY 'default' for every key not listed" in " ".join(
        build_parser().format_help().split()
    )


def test_slot_queue_orders_by_class_then_arrival_and_forgets_the_cancelled():
    async def scenario() -> list[str]:
        queue = SlotQueue(max_running=1, max_waiting=3, timeout=5.0)
        holder = await queue.acquire(1)
        order: list[str] = []

        async def wait(name: str, rank: int) -> None:
            slot = await queue.acquire(rank)
            order.append(name)
            await asyncio.sleep(0.01)
            slot.release()

        tasks = {}
        for name, rank in (("low1", 2), ("low2", 2), ("gone", 0), ("high", 0)):
            tasks[name] = asyncio.create_task(wait(name, rank))
            await asyncio.sleep(0)
            if name == "gone":
                tasks[name].cancel()  # a client that left: out of the queue, no slot taken
                await asyncio.sleep(0.01)
                assert queue.num_waiting == 2
        with pytest.raises(AdmissionRefused) as full:
            await queue.acquire(0)  # three live waiters: the queue is full
        assert full.value.code == "queue_full" and full.value.headers == {"Retry-After": "1"}
        holder.release()
        holder.release()  # idempotent
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        assert (queue.num_running, queue.num_waiting) == (0, 0)
        return order

    assert asyncio.run(scenario()) == ["high", "low1", "low2"]


def test_slot_queue_deadline():
    async def scenario() -> None:
        queue = SlotQueue(max_running=1, max_waiting=3, timeout=0.2)
        await queue.acquire(1)
        with pytest.raises(AdmissionRefused) as late:
            await queue.acquire(0)
        assert late.value.code == "queue_timeout" and queue.num_waiting == 0

    asyncio.run(scenario())


def test_admission_flags_and_config_file(tmp_path):
    cfg = parse_args(
        ["--decode", "http://d:1", "--rate-limit", "sk-a==5:10", "--rate-limit", "default=1",
         "--key-priority", "batch=low", "--max-concurrency", "8", "--queue-timeout", "2"]
    )  # fmt: skip
    assert cfg.rate_limits == {"sk-a=": RateLimit(5, 10), "default": RateLimit(1, 1)}
    assert cfg.key_priorities == {"batch": 2} and cfg.max_queue == 1024
    file = from_dict(
        {"decode": ["http://d:1"], "rate-limit": {"k": "2"}, "key_priority": ["v=high"]}
    )
    assert file.rate_limits == {"k": RateLimit(2, 2)} and file.key_priorities == {"v": 0}
    for bad in (["k"], ["k=0"], ["k=1:0.5"], ["k=x"]):
        with pytest.raises(ValueError):
            from_dict({"decode": ["http://d:1"], "rate_limit": bad})
    with pytest.raises(ValueError):
        from_dict({"decode": ["http://d:1"], "key_priority": ["k=urgent"]})


# -- through real proxies ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
    logs = tmp_path_factory.mktemp("stubs")
    quick = StubWorkers(["127.0.0.1"], free_port(), logs / "quick.log", chunk_delay=QUICK_S)
    slow = StubWorkers(["127.0.0.1"], free_port(), logs / "slow.log", chunk_delay=SLOW_S)
    yield quick.wait_ready(), slow.wait_ready()
    quick.stop()
    slow.stop()


@pytest.fixture(scope="module")
def start_proxy(start_server, stubs):
    def start(*args: str, stub=None):
        stub = stub or stubs[0]
        return start_server("proxy", "--mode", "colocated", "--decode", stub.url, *args)

    return start


def headers(key: str | None = None, priority: str | None = None) -> dict:
    h = {"Authorization": f"Bearer {key}"} if key else {}
    return {**h, "X-Priority": priority} if priority else h


def complete(proxy, max_tokens: int = 1, **kw) -> httpx.Response:
    """A streamed request, read to the end; `.ttft` is the seconds to its first chunk."""
    body = {"prompt": "hi", "max_tokens": max_tokens, "stream": True}
    started = time.perf_counter()
    with httpx.stream(
        "POST", f"{proxy.url}/v1/completions", json=body, headers=headers(**kw), timeout=60
    ) as r:
        chunks = r.iter_raw()
        next(chunks, None)
        r.ttft = time.perf_counter() - started
        r.first_at = time.perf_counter()
        for _ in chunks:
            pass
    return r


def in_background(pool: ThreadPoolExecutor, proxy, **kw):
    return pool.submit(complete, proxy, **kw)


def test_rate_limit_is_a_429_in_openai_shape_with_retry_after(start_proxy):
    proxy = start_proxy("--rate-limit", "sk-a=0.2:2", "--rate-limit", "anonymous=0.5:1")
    url = f"{proxy.url}/v1/completions"
    body = {"prompt": "hi", "max_tokens": 1}
    codes = [httpx.post(url, json=body, headers=headers("sk-a")).status_code for _ in range(2)]
    assert codes == [200, 200]
    r = httpx.post(url, json=body, headers=headers("sk-a"))
    assert r.status_code == 429
    assert r.json() == {
        "error": {
            "message": "rate limit reached for this API key; retry later",
            "type": "rate_limit_error",
            "param": None,
            "code": "rate_limited",
        }
    }
    assert 1 <= int(r.headers["retry-after"]) <= 5  # a token every 5 s
    assert httpx.post(url, json=body, headers=headers("sk-b")).status_code == 200  # no limit
    anonymous = [httpx.post(url, json=body).status_code for _ in range(2)]
    assert anonymous == [200, 429]
    rejected = 'pdserve_proxy_admission_rejected_total{reason="rate_limited"}'
    assert wait_until(lambda: proxy.metric(rejected, 0) == 2)


def test_queue_full_and_queue_timeout_are_429s(start_proxy):
    proxy = start_proxy("--max-concurrency", "1", "--max-queue", "2", "--queue-timeout", "1.5")
    with ThreadPoolExecutor(4) as pool:
        holder = in_background(pool, proxy, max_tokens=40)  # 4 s
        assert wait_until(lambda: proxy.metric(RUNNING) == 1)
        queued = [in_background(pool, proxy) for _ in range(2)]
        assert wait_until(lambda: proxy.metric(DEPTH) == 2)
        full = complete(proxy)
        assert full.status_code == 429 and full.headers["retry-after"] == "1"
        started = time.perf_counter()
        late = [f.result() for f in queued]
        assert time.perf_counter() - started < 3.5  # refused at the deadline, not at the end
        assert all(r.status_code == 429 for r in late)
        assert holder.result().status_code == 200
    for reason, n in (("queue_full", 1), ("queue_timeout", 2)):
        name = f'pdserve_proxy_admission_rejected_total{{reason="{reason}"}}'
        assert wait_until(lambda name=name, n=n: proxy.metric(name, 0) == n)
    assert wait_until(lambda: proxy.metric(RUNNING) == 0 and proxy.metric(DEPTH) == 0)
    assert complete(proxy).status_code == 200


def test_high_priority_is_admitted_before_earlier_low_ones(start_proxy):
    proxy = start_proxy("--max-concurrency", "1", "--key-priority", "batch=low")
    with ThreadPoolExecutor(5) as pool:
        holder = in_background(pool, proxy, max_tokens=40)  # 4 s: outlasts the queueing below
        assert wait_until(lambda: proxy.metric(RUNNING) == 1)
        waiting = []
        for i, kw in enumerate(
            [{"priority": "low"}, {"key": "batch"}, {"key": "batch", "priority": "high"},
             {"priority": "high"}]
        ):  # fmt: skip
            waiting.append(in_background(pool, proxy, max_tokens=2, **kw))
            assert wait_until(lambda i=i: proxy.metric(DEPTH) == i + 1)  # arrival order fixed
        assert not holder.done(), "the holder ended before the queue was built"
        assert holder.result().status_code == 200
        answers = [f.result() for f in waiting]
    assert all(r.status_code == 200 for r in answers)
    # high first; then the lows (batch's "high" is capped at its class, low) in arrival order
    order = sorted(range(4), key=lambda i: answers[i].first_at)
    assert order == [3, 0, 1, 2]


def test_client_leaving_the_queue_or_a_stream_frees_its_slot(start_proxy, stubs):
    proxy = start_proxy("--max-concurrency", "1")
    served = stubs[0].served("127.0.0.1")
    body = {"prompt": "hi", "max_tokens": 200, "stream": True}  # 20 s
    url = f"{proxy.url}/v1/completions"
    with httpx.stream("POST", url, json=body, timeout=30) as running, ThreadPoolExecutor(1) as pool:
        chunks = running.iter_raw()  # NOTE: kept: a dropped iterator closes the response
        next(chunks)
        assert wait_until(lambda: proxy.metric(RUNNING) == 1)
        short = httpx.Timeout(3.0, connect=5)
        queued = pool.submit(httpx.post, url, json=body, timeout=short)
        assert wait_until(lambda: proxy.metric(DEPTH) == 1)
        with pytest.raises(httpx.ReadTimeout):  # then its client gives up
            queued.result()
        assert wait_until(lambda: proxy.metric(DEPTH) == 0)
        assert proxy.metric(RUNNING) == 1
    assert wait_until(lambda: proxy.metric(RUNNING) == 0)  # the stream's client left
    assert wait_until(lambda: proxy.metric("pdserve_proxy_client_disconnects_total") == 2)
    assert stubs[0].served("127.0.0.1") == served + 1  # the queued one never reached a worker
    for stream in (True, False):  # finished streams and whole answers give their slot back
        r = httpx.post(url, json={**body, "max_tokens": 2, "stream": stream}, timeout=10)
        assert r.status_code == 200
    bad = httpx.post(url, content=b"{not json", timeout=10)
    assert bad.status_code == 400
    assert wait_until(lambda: proxy.metric(RUNNING) == 0)


@pytest.mark.serial  # compares TTFTs: not beside other tests' load
def test_a_flood_from_one_key_leaves_another_keys_ttft_within_2x(start_proxy, stubs):
    proxy = start_proxy(
        "--rate-limit", "flood=1:1", "--max-concurrency", "4", "--queue-timeout", "60",
        stub=stubs[1],
    )  # fmt: skip
    complete(proxy, key="steady")  # warm the connections
    idle = statistics.median(complete(proxy, key="steady").ttft for _ in range(5))
    assert SLOW_S <= idle < 2 * SLOW_S
    stop = threading.Event()
    counts = {200: 0, 429: 0}

    def flood() -> None:  # as fast as it is answered: 1 s a request, or a 429 at once
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                body = {"prompt": "hi", "max_tokens": 2, "stream": True}
                r = client.post(f"{proxy.url}/v1/completions", json=body, headers=headers("flood"))
                counts[r.status_code] = counts.get(r.status_code, 0) + 1
                if r.status_code == 429:
                    time.sleep(0.05)

    threads = [threading.Thread(target=flood) for _ in range(8)]
    for t in threads:
        t.start()
    try:
        rejected = 'pdserve_proxy_admission_rejected_total{reason="rate_limited"}'
        assert wait_until(lambda: proxy.metric(rejected, 0) > 50)
        loaded = statistics.median(complete(proxy, key="steady").ttft for _ in range(5))
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    assert counts[200] >= 2 and counts[429] > 50  # the flood ran, and over its limit
    assert loaded <= 2 * idle, (idle, loaded)
