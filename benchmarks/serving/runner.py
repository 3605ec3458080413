"""One benchmark run: warm-ups, then every request at its arrival time, under a concurrency cap.

Arrivals follow `vllm bench serve`: with a finite `request_rate`, the gaps between arrivals are
gamma-distributed with shape `burstiness` and mean 1/rate (burstiness 1 is a Poisson process,
below 1 burstier, above 1 more even, inf a fixed gap), rescaled so the last arrival is at
num/rate; with an infinite rate every request arrives at once. Under `max_concurrency` an
arrived request waits for a free slot, and its latencies start when it is sent. Past `duration`
seconds nothing more is sent (those requests are not counted); requests in flight finish, each
within the endpoint's request timeout, so a run always ends.

The server's /metrics is scraped after the warm-ups and after the run; `duration` is the wall
time from the first arrival slot to the last answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import time
from dataclasses import dataclass

import httpx
import numpy as np
from tqdm import tqdm

from benchmarks.serving import prometheus
from benchmarks.serving.client import Endpoint, RequestRecord, auth_headers, send_request
from benchmarks.serving.datasets import SampleRequest


@dataclass(frozen=True)
class LoadConfig:
    request_rate: float = math.inf  # requests/s
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_warmups: int = 0
    duration: float | None = None  # seconds; stop sending after it
    show_progress: bool = True

    def __post_init__(self):
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0, got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"--burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.num_warmups < 0:
            raise ValueError(f"--num-warmups must be >= 0, got {self.num_warmups}")
        if self.duration is not None and not self.duration > 0:
            raise ValueError(f"--duration must be > 0, got {self.duration}")


@dataclass(frozen=True)
class RunResult:
    records: list[RequestRecord]  # the requests sent, in arrival order
    duration: float
    server_before: prometheus.Scrape | None
    server_after: prometheus.Scrape | None


def arrival_times(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start at which each request arrives."""
    if math.isinf(rate):
        return [0.0] * num
    if math.isinf(burstiness):
        gaps = np.full(num, 1.0 / rate)
    else:
        rng = np.random.default_rng(seed)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num)
    times = np.cumsum(gaps)
    return (times * (num / rate) / times[-1]).tolist()


async def run_benchmark(
    client: httpx.AsyncClient,
    endpoint: Endpoint,
    samples: list[SampleRequest],
    load: LoadConfig,
    seed: int = 0,
) -> RunResult:
    assert samples, "no requests to send"
    slots = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    if load.num_warmups:
        await _warm_up(client, endpoint, samples[0], load, slots)
    headers = auth_headers(endpoint.api_key)
    before = await prometheus.scrape(client, endpoint.base_url, headers)
    bar = tqdm(total=len(samples), desc="requests", disable=not load.show_progress)
    t0 = time.perf_counter()
    deadline = t0 + load.duration if load.duration else math.inf

    async def one(sample: SampleRequest) -> RequestRecord | None:
        async with slots or contextlib.nullcontext():
            if time.perf_counter() >= deadline:
                return None  # not sent
            record = await send_request(client, endpoint, sample, t0)
        bar.update()
        return record

    tasks = []
    times = arrival_times(len(samples), load.request_rate, load.burstiness, seed)
    for sample, at in zip(samples, times):
        await asyncio.sleep(max(0.0, min(t0 + at, deadline) - time.perf_counter()))
        if time.perf_counter() >= deadline:
            break
        tasks.append(asyncio.create_task(one(sample)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    bar.close()
    after = await prometheus.scrape(client, endpoint.base_url, headers)
    records = [r for r in results if r is not None]
    return RunResult(records, duration, before, after)


async def _warm_up(
    client: httpx.AsyncClient,
    endpoint: Endpoint,
    sample: SampleRequest,
    load: LoadConfig,
    slots: asyncio.Semaphore | None,
) -> None:
    """`num_warmups` copies of the first request, not counted anywhere."""
    bar = tqdm(total=load.num_warmups, desc="warm-up", disable=not load.show_progress)

    async def one() -> RequestRecord:
        async with slots or contextlib.nullcontext():
            record = await send_request(client, endpoint, sample, time.perf_counter())
        bar.update()
        return record

    records = await asyncio.gather(*(one() for _ in range(load.num_warmups)))
    bar.close()
    failed = [r.error_reason for r in records if not r.success]
    if failed:
        print(
            f"warning: {len(failed)} of {len(records)} warm-ups failed: {failed[0]}",
            file=sys.stderr,
        )
