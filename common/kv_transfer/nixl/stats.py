"""The NIXL connector's running totals (`TransferStats`), shared by its two halves and read into
the frozen `KVTransferStats` that the connector reports (connector.py `stats_snapshot`). A total
has the name it has there, and /metrics reads it by that name (common/api/metrics.py)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from common.kv_transfer.transfers import DescriptorHistogram, SecondsHistogram


@dataclass
class TransferStats:
    num_loads: int = 0
    num_load_failures: int = 0
    num_bytes_loaded: int = 0
    seconds_loading: float = 0.0
    num_load_descriptors: int = 0
    descriptors_a_layer: DescriptorHistogram = field(default_factory=DescriptorHistogram)
    seconds_a_request: SecondsHistogram = field(default_factory=SecondsHistogram)
    num_checksum_failures: int = 0
    loaded_requests: Counter = field(default_factory=Counter)  # pull, push (D); reverse (P)
    recomputed: Counter = field(default_factory=Counter)  # D: by KVLoss.reason
