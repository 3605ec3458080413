"""The worker's event loop stays free while a prompt is tokenized: tokenization and chat
templates run in a small thread pool, so `/health` (and every other request) answers at once."""

from __future__ import annotations

import asyncio
import gc
import json
import random
import time

import httpx
import pytest

from common.tokenizer import Tokenizer

pytestmark = pytest.mark.serial  # a 50 ms latency bound: not beside other tests' load

MAX_HEALTH_SECONDS = 0.05


def slow_prompt(tokenizer: Tokenizer, min_seconds: float) -> str:
    """Text (random emoji: 4 bytes each, no merges to shortcut) that takes `min_seconds` or more
    to encode here, grown from 100,000 characters."""
    rng = random.Random(0)
    num_chars = 100_000
    while True:
        text = "".join(chr(rng.randint(0x1F600, 0x1F64F)) for _ in range(num_chars))
        start = time.perf_counter()
        tokenizer.encode(text)
        took = time.perf_counter() - start
        if took >= min_seconds:
            return text
        num_chars = int(num_chars * min(4.0, 1.3 * min_seconds / max(took, 0.01)))


async def health_latencies_during(url: str, body: bytes) -> tuple[list[float], httpx.Response]:
    """Latencies of `/health` calls made one after another while `body` is posted."""
    headers = {"content-type": "application/json"}
    async with (
        httpx.AsyncClient(base_url=url, timeout=60) as big,
        httpx.AsyncClient(base_url=url, timeout=60) as small,
    ):
        await small.get("/health")  # a warm connection: time the server, not a TCP handshake
        posted = asyncio.create_task(big.post("/v1/completions", content=body, headers=headers))
        latencies = []
        while not posted.done():
            start = time.perf_counter()
            r = await small.get("/health")
            latencies.append(time.perf_counter() - start)
            assert r.status_code == 200, r.text
            await asyncio.sleep(0.01)
        return latencies, await posted


def measure_server(url: str, body: bytes) -> tuple[list[float], httpx.Response]:
    """NOTE: late in the suite this (pytest's) process holds a large heap, and a full garbage
    collection in the middle of a timed call added 60-80 ms to it: collect first, then time
    with the collector off, so that the figure is the server's."""
    gc.collect()
    gc.disable()
    try:
        return asyncio.run(health_latencies_during(url, body))
    finally:
        gc.enable()


def test_health_answers_while_a_big_prompt_is_tokenized(start_server, tiny_model):
    model_dir = tiny_model("llama")
    # 100,000 characters (~0.2 s to encode here): a blocked loop delays /health by all of it;
    # a longer prompt only adds rounds in which a loaded machine can steal 50 ms from a call
    prompt = slow_prompt(Tokenizer.from_dir(model_dir), min_seconds=0.15)
    body = json.dumps({"prompt": prompt, "max_tokens": 1}, ensure_ascii=False).encode()
    args = ["--model", str(model_dir), "--max-body-bytes", str(4 * len(body))]
    server = start_server("prefill", *args)
    rounds: list[list[float]] = []  # /health latencies, one list per round
    # NOTE: on a busy shared CPU any one call can lose 50 ms to other processes, so up to three
    # rounds; a loop blocked by tokenizing delays a call in every round, by 0.5 s or more
    while len(rounds) < 3 and (not rounds or max(rounds[-1]) >= MAX_HEALTH_SECONDS):
        latencies, response = measure_server(server.url, body)
        assert response.status_code in (200, 400), response.text  # 400: over max_model_len
        rounds.append(latencies)
    best = min(rounds, key=max)
    assert max(best) < MAX_HEALTH_SECONDS, [round(max(r), 3) for r in rounds]
    assert len(best) >= 5, best  # /health ran all along while the prompt was tokenized
