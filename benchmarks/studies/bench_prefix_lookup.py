"""The cost of a prefix lookup: one prefill choice of KV-aware routing vs the prefills the proxy
has in flight, and a worker's key for each full block of a prompt.

`KVRouter.choose("prefill", ...)` runs on the proxy's event loop for every request. For each
prefill worker it needs how much of the prompt the prefills in flight on it share (they count
as held) and their uncached tokens (its queue). Before, that was a scan of every prefill in
flight, block by block: O(prefills in flight × prompt blocks). Now it is one walk of the
prompt's blocks in an index of their blocks (proxy/kv_index.py `InFlightPrefixes`).

Both are timed in the same run: `scan` is the router with the code as it was (kept below, in
this file only), `index` the router as it is. Two prefill workers, each indexing a shared
system prefix (a `BlockIndex` from KV events); `--prompt-tokens` tokens a prompt, each prompt
the shared prefix (half of it) and its own tail; the in-flight prefills split over the two
workers. A row is the fastest of `--repeats` choices (the least disturbed by other
processes); a few seconds in all.

The block keys (common/kv_cache/block_hash.py) are hashed once per full block of every request a
worker admits: `hash()` (before) is the key as it was, Python's hash of (parent, the block's
tokens as a tuple), kept below in this file only; `sha256` (now) the key as it is. Per block, the
fastest of `--repeats` chains over the whole prompt.

    .venv/bin/python -m benchmarks.studies.bench_prefix_lookup [--prompt-tokens 32768]
        [--repeats 15]
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import httpx
import msgspec

from common.kv_cache.block_hash import chain_hashes, root_hash
from common.kv_cache.events import KVEventBatch, KVEventCollector
from common.kv_cache.manager import hash_block
from proxy.config import from_dict
from proxy.kv_index import BlockIndex, decode_batch
from proxy.kv_routing import KVRouter
from proxy.metrics import ProxyMetrics
from proxy.policies import PrefixAware
from proxy.workers import Worker, WorkerPool

BLOCK = 16
IN_FLIGHT = (0, 1, 4, 16, 32, 64)


class Feeds:
    """KVEventFeeds' face to the router: one index per worker."""

    def __init__(self, indexes: dict[Worker, BlockIndex]):
        self.indexes = indexes

    def index_of(self, worker: Worker) -> BlockIndex | None:
        return self.indexes.get(worker)


class ScanRouter(KVRouter):
    """The router with the prefills in flight kept as it was before their index: a list per
    worker, scanned prompt by prompt."""

    def __init__(self, *args):
        super().__init__(*args)
        self._scanned: dict[Worker, list[tuple[list[int], int]]] = {}

    @contextmanager
    def prefilling(self, worker: Worker, token_ids: list[int] | None) -> Iterator[None]:
        index = self.feeds.index_of(worker)
        held = self._cached_tokens(worker, token_ids, index.match(token_ids))
        entry = (token_ids, len(token_ids) - held)
        self._scanned.setdefault(worker, []).append(entry)
        try:
            yield
        finally:
            self._scanned[worker].remove(entry)

    def _queued(self, worker: Worker) -> int:
        return sum(num_uncached for _, num_uncached in self._scanned.get(worker, ()))

    def _cached_tokens(self, worker: Worker, token_ids: list[int], held: int) -> int:
        size = self.feeds.index_of(worker).block_size
        computing = (_shared_blocks(token_ids, p, size) for p, _ in self._scanned.get(worker, ()))
        return max(held, max(computing, default=0)) * size


def _shared_blocks(a: list[int], b: list[int], size: int) -> int:
    num = 0
    for start in range(0, min(len(a), len(b)) - size + 1, size):
        if a[start : start + size] != b[start : start + size]:
            break
        num += 1
    return num


def indexed(token_ids: list[int]) -> BlockIndex:
    """A worker's index after it cached `token_ids` (the events our engine publishes)."""
    collector, parent, index = KVEventCollector(BLOCK), None, BlockIndex(BLOCK)
    for start in range(0, len(token_ids) - BLOCK + 1, BLOCK):
        block = tuple(token_ids[start : start + BLOCK])
        collector.stored(h := hash_block(parent, block), parent, list(block))
        parent = h
    index.apply(decode_batch(msgspec.msgpack.encode(KVEventBatch(0.0, collector.take(), 0))))
    return index


def time_choices(router: KVRouter, workers, prompts, num_in_flight: int, repeats: int) -> float:
    """Seconds of the fastest of `repeats` prefill choices, `num_in_flight` prefills in flight."""
    hashing = PrefixAware()
    with ExitStack() as stack:
        for i in range(num_in_flight):
            stack.enter_context(router.prefilling(workers[i % 2], prompts[1 + i]))
        seconds = []
        for _ in range(repeats):
            started = time.perf_counter()
            router.choose("prefill", workers, prompts[0], hashing, "")
            seconds.append(time.perf_counter() - started)
    return min(seconds)


def python_hash_chain(tokens: list[int], block_size: int) -> list[int]:
    """The block keys as they were: Python's hash() of (parent, the block's tokens)."""
    hashes: list[int] = []
    for i in range(len(tokens) // block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash((parent, tuple(tokens[i * block_size : (i + 1) * block_size]))))
    return hashes


def time_block_keys(tokens: list[int], repeats: int) -> tuple[float, float]:
    """Seconds per full block: (hash() as it was, sha256 as it is)."""
    root = root_hash("model", "a salt")
    before = min(_seconds(lambda: python_hash_chain(tokens, BLOCK)) for _ in range(repeats))
    now = min(_seconds(lambda: chain_hashes(tokens, BLOCK, [], root)) for _ in range(repeats))
    num_blocks = len(tokens) // BLOCK
    return before / num_blocks, now / num_blocks


def _seconds(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    rng = random.Random(0)
    n = args.prompt_tokens
    system = rng.choices(range(3, 32000), k=n // 2)
    prompts = [
        system + rng.choices(range(3, 32000), k=n - n // 2) for _ in range(1 + IN_FLIGHT[-1])
    ]
    client = httpx.AsyncClient()
    workers = [Worker(f"http://p{i}:1", "prefill", client, client._transport) for i in (1, 2)]
    feeds = Feeds({w: indexed(system) for w in workers})
    pools = {"prefill": WorkerPool("prefill"), "decode": WorkerPool("decode")}
    cfg = from_dict({"decode": ["http://d:1"], "prefill": ["http://p1:1", "http://p2:1"]})
    routers = {cls: cls(cfg, pools, feeds, ProxyMetrics(pools)) for cls in (ScanRouter, KVRouter)}
    print(f"one prefill choice, 2 workers, {n}-token prompts ({n // BLOCK} blocks of {BLOCK})")
    print(f"{'in flight':>9}  {'scan (before) ms':>16}  {'index (now) ms':>14}  {'speed-up':>8}")
    for num in IN_FLIGHT:
        scan, index = (
            time_choices(r, workers, prompts, num, args.repeats) for r in routers.values()
        )
        print(f"{num:>9}  {scan * 1e3:>16.2f}  {index * 1e3:>14.2f}  {scan / index:>7.1f}x")
    before, now = time_block_keys(prompts[0], args.repeats)
    print(f"\nblock keys, {n}-token prompt, blocks of {BLOCK}, per block:")
    print(f"  hash() (before) {before * 1e9:.0f} ns   sha256 (now) {now * 1e9:.0f} ns")


if __name__ == "__main__":
    main()
