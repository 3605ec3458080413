"""A multi-turn run: conversations in parallel, each one's turns in sequence.

Up to `max_concurrency` conversations are in flight (all of them without a cap); a conversation
holds its slot from its first turn to its last, think times included, as a user at a keyboard
would. Turn k is sent `think_time` seconds after turn k−1's answer ended (fixed, or drawn from an
exponential of that mean, seeded per conversation), with the history of
benchmarks/serving/conversations.py: the earlier user messages and the answers the server
actually streamed. A failed turn ends its conversation (its history has no answer to go on).
Each turn carries its conversation's `X-Session-ID` (`conversation-SEED-INDEX`), so that a proxy
with session affinity keeps the conversation on the workers that hold it.

The server's /metrics is scraped before and after (the prompt-cache shares need the proxy's
counters); `duration` runs from the first turn sent to the last answer. The result JSON is the
single-turn benchmark's (report.build_result: vLLM's keys over every turn) with `by_turn`,
`cache`, `routed`, `num_conversations`, `num_turns` and one `requests` entry per turn (its
conversation, turn index and messages added).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

import httpx
from tqdm import tqdm

from benchmarks.serving import prometheus, report
from benchmarks.serving.client import Endpoint, auth_headers, connected, send_request
from benchmarks.serving.config import BenchConfig
from benchmarks.serving.conversations import Conversation, ConversationConfig, history
from benchmarks.serving.datasets import SampleRequest, estimate_tokens
from benchmarks.serving.metrics import ALWAYS_PERCENTILES, compute_metrics
from benchmarks.serving.runner import RunResult
from benchmarks.serving.turn_metrics import (
    Turn,
    by_turn,
    by_turn_dict,
    cache_shares,
    format_turn_table,
    routed,
)


async def run_conversations(
    client: httpx.AsyncClient,
    endpoint: Endpoint,
    system: str | None,
    conversations: list[Conversation],
    conv: ConversationConfig,
    max_concurrency: int | None,
    seed: int = 0,
    show_progress: bool = False,
) -> tuple[list[Turn], RunResult]:
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    headers = auth_headers(endpoint.api_key)
    before = await prometheus.scrape(client, endpoint.base_url, headers)
    total = sum(c.num_turns for c in conversations)
    bar = tqdm(total=total, desc="turns", disable=not show_progress)
    t0 = time.perf_counter()

    async def one(index: int, conversation: Conversation) -> list[Turn]:
        think = random.Random(f"{seed}/{index}")
        session_id = f"conversation-{seed}-{index}"  # X-Session-ID: one per conversation
        async with slots or contextlib.nullcontext():
            return await _converse(
                client, endpoint, system, conversation, conv, index, session_id, think, t0, bar
            )

    per_conversation = await asyncio.gather(*(one(i, c) for i, c in enumerate(conversations)))
    duration = time.perf_counter() - t0
    bar.close()
    after = await prometheus.scrape(client, endpoint.base_url, headers)
    turns = [t for ts in per_conversation for t in ts]
    return turns, RunResult([t.record for t in turns], duration, before, after)


async def _converse(
    client, endpoint, system, conversation, conv, index, session_id, think, t0, bar
):
    turns: list[Turn] = []
    answers: list[str] = []
    for k in range(1, conversation.num_turns + 1):
        if k > 1 and conv.think_time > 0:
            await asyncio.sleep(_think_time(conv, think))
        messages = history(system, list(conversation.user_messages[:k]), answers)
        prompt_len = sum(estimate_tokens(m["content"]) for m in messages)
        sample = SampleRequest(
            messages[-1]["content"], prompt_len, conv.output_len, messages, session_id
        )
        record = await send_request(client, endpoint, sample, t0)
        bar.update()
        turns.append(Turn(index, k, messages, record))
        if not record.success:
            break
        answers.append(record.generated_text)
    return turns


def _think_time(conv: ConversationConfig, rng: random.Random) -> float:
    if conv.think_time_dist == "exponential":
        return rng.expovariate(1.0 / conv.think_time)
    return conv.think_time


async def benchmark_conversations(
    cfg: BenchConfig, system: str | None, conversations: list[Conversation], args: dict
) -> dict:
    """Run `conversations` as `cfg` says; print both tables; write the result file."""
    assert cfg.endpoint_type == "chat", "a multi-turn run needs the chat endpoint"
    conv, concurrency = cfg.conversations, cfg.load.max_concurrency
    num = concurrency or len(conversations)
    async with connected(cfg, "chat", num) as (client, endpoint):
        model = endpoint.model
        print(
            f"Model: {model}  Endpoint: {endpoint.url}  Conversations: {len(conversations)}"
            f" x up to {conv.num_turns} turns  Concurrency: {concurrency}",
            flush=True,
        )
        turns, run = await run_conversations(
            client,
            endpoint,
            system,
            conversations,
            conv,
            concurrency,
            cfg.seed,
            cfg.load.show_progress,
        )
    percentiles = sorted(set(map(float, cfg.percentiles)) | set(ALWAYS_PERCENTILES) | {50.0})
    metrics = compute_metrics(run.records, run.duration, percentiles, cfg.slos_ms)
    print(
        report.format_table(
            metrics, list(cfg.percentile_metrics), list(cfg.percentiles), concurrency
        )
    )
    groups = by_turn(turns, percentiles)
    server = prometheus.server_metrics(run.server_before, run.server_after)
    delta = server and server["delta"]
    shares, paths = cache_shares(turns, delta), routed(delta)
    print(format_turn_table(groups, shares, paths))
    result = report.build_result(metrics, run, args, model, cfg)
    result.update(
        num_conversations=len(conversations),
        num_turns=conv.num_turns,
        by_turn=by_turn_dict(groups),
        cache=shares.to_dict(),
        routed=paths,
        requests=[t.to_dict() for t in turns],
    )
    if cfg.result_file:
        report.write_result(cfg.result_file, result)
        print(f"Wrote {cfg.result_file}")
    return result
