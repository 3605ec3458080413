"""What the engine thread reports after each step (`EngineStats`): a frozen snapshot that the
event loop reads (metrics, /health, admission) without touching the engine's own tables."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.kv_transfer.base import KVTransferStats
from common.kv_transfer.transfers import DescriptorHistogram, RunningHistogram, SecondsHistogram


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
    kv_transfers: int = 0
    kv_transfer_failures: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: float = 0.0
    kv_transfer_descriptors: int = 0
    kv_lease_expiries: int = 0
    kv_push_bytes: int = 0
    kv_push_seconds: float = 0.0
    kv_push_exposed_seconds: float = 0.0
    kv_push_failures: int = 0
    kv_checksum_failures: int = 0
    kv_push_held_blocks: int = 0
    kv_blocks_held: int = 0
    kv_blocks_in_transfer: int = 0
    kv_blocks_quarantined: int = 0
    kv_loaded_requests: dict[str, int] = field(default_factory=dict)  # by mode
    kv_recomputed: dict[str, int] = field(default_factory=dict)  # by reason
    kv_pushes_in_flight: int = 0  # P: push requests whose writes have not settled
    kv_events_dropped: int = 0  # KV event batches the publisher's queue had no room for
    kv_descriptors: dict[str, DescriptorHistogram] = field(default_factory=dict)  # read | write
    kv_seconds: dict[str, SecondsHistogram] = field(default_factory=dict)  # read | write
    kv_peer_transports: dict[str, frozenset[str]] = field(default_factory=dict)  # by peer
    grammar_seconds: dict[str, RunningHistogram] = field(default_factory=dict)  # compile | mask
    grammar_refusals: dict[str, int] = field(default_factory=dict)  # by reason (structured.py)


def engine_stats(engine, kv_events) -> EngineStats:
    """The snapshot of `engine` (an LLMEngine) now; on the engine thread."""
    sched, pool = engine.scheduler, engine.pool
    kv = engine.connector.stats_snapshot() if engine.connector else KVTransferStats()
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
        kv_transfers=kv.num_loads,
        kv_transfer_failures=kv.num_load_failures,
        kv_transfer_bytes=kv.num_bytes_loaded,
        kv_transfer_seconds=kv.seconds_loading,
        kv_transfer_descriptors=kv.num_load_descriptors,
        kv_lease_expiries=kv.num_lease_expiries,
        kv_push_bytes=kv.num_bytes_pushed,
        kv_push_seconds=kv.seconds_pushing,
        kv_push_exposed_seconds=kv.seconds_push_exposed,
        kv_push_failures=kv.num_push_failures,
        kv_checksum_failures=kv.num_checksum_failures,
        kv_push_held_blocks=kv.num_push_blocks_held,
        kv_blocks_held=kv.num_blocks_held,
        kv_blocks_in_transfer=kv.num_blocks_in_transfer,
        kv_blocks_quarantined=kv.num_blocks_quarantined,
        kv_loaded_requests=kv.loaded_requests,
        kv_recomputed=kv.recomputed,
        kv_pushes_in_flight=kv.num_pushes_in_flight,
        kv_events_dropped=kv_events.num_dropped if kv_events is not None else 0,
        kv_descriptors=kv.descriptors,
        kv_seconds=kv.seconds,
        kv_peer_transports=kv.peer_transports,
        grammar_seconds=grammar_seconds,
        grammar_refusals=grammar_refusals,
    )
