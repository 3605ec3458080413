"""What the engine thread reports after each step (`EngineStats`): a frozen snapshot that the
event loop reads (metrics, /health, admission) without touching the engine's own tables."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.kv_transfer.transfers import DescriptorHistogram


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
    kv_blocks_held: int = 0
    kv_blocks_in_transfer: int = 0
    kv_blocks_quarantined: int = 0
    kv_loaded_requests: dict[str, int] = field(default_factory=dict)  # by mode
    kv_recomputed: dict[str, int] = field(default_factory=dict)  # by reason
    kv_pushes_in_flight: int = 0  # P: push requests whose writes have not settled
    kv_events_dropped: int = 0  # KV event batches the publisher's queue had no room for
    kv_descriptors: dict[str, DescriptorHistogram] = field(default_factory=dict)  # read | write


def engine_stats(engine, kv_events) -> EngineStats:
    """The snapshot of `engine` (an LLMEngine) now; on the engine thread."""
    sched, pool = engine.scheduler, engine.pool
    connector = engine.connector
    transfer = getattr(connector, "stats", None)
    leases = getattr(connector, "leases", None)
    holds = getattr(connector, "holds", None)
    pushed = connector.pushes.stats if hasattr(connector, "pushes") else None
    reservations = getattr(connector, "reservations", None)
    push_incomplete = reservations.num_incomplete if reservations is not None else 0
    return EngineStats(
        num_running=len(sched.running),
        num_waiting=len(sched.waiting),
        num_blocks_used=pool.num_used_blocks,
        num_blocks_free=pool.num_free_blocks,
        prefix_cache_queries=pool.num_queries,
        prefix_cache_hits=pool.num_hits,
        num_preemptions=sched.num_preemptions,
        num_graph_steps=engine.runner.graphs.num_steps if engine.runner.graphs else 0,
        kv_transfers=transfer.num_loads if transfer else 0,
        kv_transfer_failures=transfer.num_failed if transfer else 0,
        kv_transfer_bytes=transfer.bytes_loaded if transfer else 0,
        kv_transfer_seconds=transfer.seconds_loading if transfer else 0.0,
        kv_transfer_descriptors=transfer.descriptors if transfer else 0,
        kv_lease_expiries=leases.num_expired if leases is not None else 0,
        kv_push_bytes=pushed.num_bytes if pushed else 0,
        kv_push_seconds=pushed.seconds if pushed else 0.0,
        kv_push_exposed_seconds=pushed.seconds_exposed if pushed else 0.0,
        kv_push_failures=(pushed.num_failures if pushed else 0) + push_incomplete,
        kv_checksum_failures=transfer.num_checksum_failures if transfer else 0,
        kv_blocks_held=leases.num_blocks_held if leases is not None else 0,
        kv_blocks_in_transfer=holds.num_blocks_held if holds is not None else 0,
        kv_blocks_quarantined=holds.num_quarantined if holds is not None else 0,
        kv_loaded_requests=dict(transfer.loaded_requests) if transfer else {},
        kv_recomputed=dict(transfer.recomputed) if transfer else {},
        kv_pushes_in_flight=len(connector.pushes) if hasattr(connector, "pushes") else 0,
        kv_events_dropped=kv_events.num_dropped if kv_events is not None else 0,
        kv_descriptors={
            op: stats.descriptors_a_layer.copy()
            for op, stats in (("read", transfer), ("write", pushed))
            if stats is not None
        },
    )
