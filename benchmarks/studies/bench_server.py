"""The HTTP layer's cost: concurrent streamed chats through a worker vs the offline engine.

Same prompts, same sampling (greedy, EOS ignored, fixed output length), same engine settings;
output tokens/s of each and their ratio. The offline run goes first and is freed before the
server starts, so the two never share the cores.

    python benchmarks/studies/bench_server.py [--concurrency 32] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from common.engine.llm import LLM  # noqa: E402
from common.engine.sampling_params import SamplingParams  # noqa: E402
from deploy.processes import ServerProcess  # noqa: E402

TOPICS = [
    "the sea",
    "mountains",
    "a city at night",
    "trains",
    "bread",
    "rain",
    "the moon",
    "coffee",
    "libraries",
    "bicycles",
    "winter",
    "gardens",
]


def conversations(n: int) -> list[list[dict]]:
    return [
        [
            {
                "role": "user",
                "content": f"Write a short story about {TOPICS[i % len(TOPICS)]} (number {i}).",
            }
        ]
        for i in range(n)
    ]


def bench_offline(convs, max_tokens: int, engine_args: dict) -> float:
    llm = LLM(**engine_args)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.chat(convs[0], SamplingParams(max_tokens=2))
    llm.engine.pool.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.chat(convs, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    del llm
    gc.collect()
    return tokens / elapsed


async def _stream_chat(client: httpx.AsyncClient, url: str, conv, max_tokens: int) -> int:
    body = dict(
        messages=conv,
        max_tokens=max_tokens,
        temperature=0,
        ignore_eos=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    tokens = 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
    return tokens


async def _run_clients(url: str, convs, max_tokens: int) -> float:
    limits = httpx.Limits(max_connections=len(convs) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await _stream_chat(client, url, convs[0], 2)  # warm-up
        start = time.perf_counter()
        counts = await asyncio.gather(*[_stream_chat(client, url, c, max_tokens) for c in convs])
        elapsed = time.perf_counter() - start
    assert all(c == max_tokens for c in counts), counts
    return sum(counts) / elapsed


def bench_server(convs, max_tokens: int, args: list[str], port: int) -> float:
    log = Path(tempfile.mkdtemp(prefix="bench_server_")) / "decode.log"
    server = ServerProcess("decode", ["--log-level", "warning", *args], log, port)
    try:
        server.wait_ready(timeout=300)
        return asyncio.run(_run_clients(server.url, convs, max_tokens))
    finally:
        server.stop(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--port", type=int, default=8299)
    a = parser.parse_args()
    convs = conversations(a.concurrency)
    engine_args = dict(max_num_seqs=a.concurrency, max_model_len=2048)
    offline = bench_offline(convs, a.max_tokens, engine_args)
    served = bench_server(
        convs,
        a.max_tokens,
        ["--max-num-seqs", str(a.concurrency), "--max-model-len", "2048"],
        a.port,
    )
    print(f"{a.concurrency} concurrent streamed chats, {a.max_tokens} tokens each (SmolLM2)")
    print(f"{'':>10} | {'output tok/s':>12}")
    print(f"{'offline':>10} | {offline:>12.1f}")
    print(f"{'server':>10} | {served:>12.1f}")
    print(f"{'ratio':>10} | {served / offline:>12.2f}")


if __name__ == "__main__":
    main()
