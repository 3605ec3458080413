"""The transport's peers: what it keeps per peer, and which peers it forgets.

A peer is dropped when it is retired (a restarted worker's old engine id) or idle for
`idle_s`, and, past `max_peers`, the least recently used idle ones go too; a peer with a
transfer not yet settled always stays (nixl_transport.py sweeps when a peer is added).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from common.kv_transfer.layout import KVLayout


@dataclass
class Peer:
    layout: KVLayout
    last_used: float = field(default_factory=time.monotonic)
    is_retired: bool = False


def stale_peers(peers: dict[str, Peer], busy: set[str], idle_s: float, max_peers: int) -> set[str]:
    """The engine ids to drop now."""
    idle_since = time.monotonic() - idle_s
    by_age = sorted(peers.items(), key=lambda item: item[1].last_used)
    idle = [engine_id for engine_id, _ in by_age if engine_id not in busy]
    stale = {e for e in idle if peers[e].is_retired or peers[e].last_used < idle_since}
    num_over = len(peers) - len(stale) - max_peers
    stale.update([e for e in idle if e not in stale][: max(num_over, 0)])
    return stale
