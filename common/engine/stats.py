"""What the engine thread reports after each step (`EngineStats`): a frozen snapshot that the
event loop reads (metrics, /health, admission) without touching the engine's own tables.

The KV connector's running totals ride in it as they are (`kv`, the connector's
`KVTransferStats`): /metrics names each metric after the field it reads
(common/api/metrics.py), and nothing renames them on the way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.kv_transfer.base import KVTransferStats
from common.kv_transfer.transfers import RunningHistogram


@dataclass(frozen=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    num_blocks_used: int = 0
    num_blocks_free: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_graph_steps: int = 0  # decode steps replayed as a CUDA graph (decode_graphs.py)
    num_kv_events_dropped: int = 0  # KV event batches the publisher's queue had no room for
    kv: KVTransferStats = field(default_factory=KVTransferStats)  # the connector's totals
    grammar_seconds: dict[str, RunningHistogram] = field(default_factory=dict)  # compile | mask
    grammar_refusals: dict[str, int] = field(default_factory=dict)  # by reason (structured.py)


def engine_stats(engine, kv_events) -> EngineStats:
    """The snapshot of `engine` (an LLMEngine) now; on the engine thread."""
    sched, pool = engine.scheduler, engine.pool
    grammar_seconds, grammar_refusals = engine.grammars.stats.snapshot()
    return EngineStats(
        num_running=len(sched.running),
        num_waiting=len(sched.waiting),
        num_blocks_used=pool.num_used_blocks,
        num_blocks_free=pool.num_free_blocks,
        prefix_cache_queries=pool.num_queries,
        prefix_cache_hits=pool.num_hits,
        num_preemptions=sched.num_preemptions,
        num_graph_steps=engine.runner.graphs.num_steps if engine.runner.graphs else 0,
        num_kv_events_dropped=kv_events.num_dropped if kv_events is not None else 0,
        kv=engine.connector.stats_snapshot() if engine.connector else KVTransferStats(),
        grammar_seconds=grammar_seconds,
        grammar_refusals=grammar_refusals,
    )
