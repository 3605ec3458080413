"""Which peers the transport forgets (common/kv_transfer/nixl/transport.py), as a pure policy."""

from __future__ import annotations

import time

from common.kv_transfer.nixl.transport import Peer, stale_peers


def _peer(age_s: float, retired: bool = False) -> Peer:
    return Peer(layout=None, last_used=time.monotonic() - age_s, is_retired=retired)


def test_retired_and_idle_peers_go_unless_busy():
    peers = {"old": _peer(600), "retired": _peer(1, retired=True), "fresh": _peer(1)}
    peers["busy-retired"] = _peer(900, retired=True)
    assert stale_peers(peers, busy={"busy-retired"}, idle_s=300, max_peers=64) == {
        "old",
        "retired",
    }


def test_past_max_peers_the_least_recently_used_idle_ones_go():
    peers = {f"p{i}": _peer(10 - i) for i in range(5)}  # p0 the least recently used
    assert stale_peers(peers, busy={"p0"}, idle_s=300, max_peers=3) == {"p1", "p2"}
