"""Both transports are the `Transport` (common/kv_transfer/transport.py): every method and property
of the protocol exists on NIXL's and on the loopback's with the same signature, so a change to
one that the other (or the protocol) does not follow fails here, not in a process test."""

from __future__ import annotations

import inspect

import pytest
import torch

from common.config import TransferConfig
from common.kv_cache.block_pool import BlockPool
from common.kv_transfer.fake import FakeConnector, Loopback, LoopbackTransport
from common.kv_transfer.layout import ShardTensors
from common.kv_transfer.nixl.transport import NixlTransport
from common.kv_transfer.transport import Transport

MEMBERS = sorted(name for name in vars(Transport) if not name.startswith("_") and name != "layout")


def signature(cls: type, name: str) -> inspect.Signature:
    member = inspect.getattr_static(cls, name)
    return inspect.signature(member.fget if isinstance(member, property) else member)


def test_the_protocol_names_what_the_connector_calls():
    assert {"read_layers", "write_layer", "add_peer", "num_peers", "peer_transports"} <= set(
        MEMBERS
    )
    assert "layout" in Transport.__annotations__


@pytest.mark.parametrize("cls", [NixlTransport, LoopbackTransport])
@pytest.mark.parametrize("name", MEMBERS)
def test_each_transport_has_the_protocols_member_with_its_signature(cls, name):
    assert Transport in cls.__mro__  # explicitly, not only by shape
    ours = inspect.getattr_static(cls, name)
    theirs = inspect.getattr_static(Transport, name)
    assert ours is not theirs, f"{cls.__name__} does not implement {name}"
    assert isinstance(ours, property) == isinstance(theirs, property), name
    assert signature(cls, name) == signature(Transport, name)


def test_the_loopback_transport_has_a_layout_and_no_staging():
    kv = [torch.zeros(2, 4, 2, 1, 4) for _ in range(2)]
    transport = Loopback().transport("e0", [ShardTensors(0, kv)])
    assert transport.layout.engine_id == "e0"
    assert transport.peer_transports() == {}
    with pytest.raises(NotImplementedError):
        transport.register(torch.zeros(8, dtype=torch.uint8))


def test_the_transports_report_reaches_the_connectors_stats():
    """What carries each peer's KV (NIXL: UCX's transports) goes to /metrics through the
    connector's `KVTransferStats`, never by the HTTP layer asking NIXL."""
    pool = BlockPool(4, enable_prefix_caching=False)
    connector = FakeConnector(TransferConfig(engine_id="e0"), 2, pool, Loopback())
    assert connector.stats_snapshot().peer_transports == {}  # no KV registered yet
    kv = {f"layer{i}": torch.zeros(2, 4, 2, 1, 4) for i in range(2)}
    connector.register_kv_caches(kv)
    report = {"p-0": frozenset({"cma"})}
    connector.transport.peer_transports = lambda: report
    assert connector.stats_snapshot().peer_transports == report
