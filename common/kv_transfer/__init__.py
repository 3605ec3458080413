"""KV transfer between workers: the `KVConnector` interface and a registry of connectors.

`create_connector(config, block_size, pool)` builds the connector named by
`TransferConfig.connector` (None: no transfer, colocated serving only).

Layout: the contract is at the root (base.py: the connector; transport.py: the wire a connector
moves bytes over; params.py, layout.py, handshake.py, peers.py, remote_prefills.py, transfers.py:
what crosses between workers or reaches the engine); the NIXL connector and all its machinery
are under nixl/; fake.py is the same connector over a loopback transport, for tests.
"""

from __future__ import annotations

from importlib import import_module

from common.config import TransferConfig
from common.kv_cache.block_pool import BlockPool
from common.kv_transfer.base import KVConnector

# name → "module:class", imported on use (NIXL loads a native library and torch on import)
CONNECTORS = {"nixl": "common.kv_transfer.nixl:NixlConnector"}


def create_connector(
    config: TransferConfig, block_size: int, pool: BlockPool
) -> KVConnector | None:
    if config.connector is None:
        return None
    if config.connector == "nixl":  # before the agent loads UCX, which reads it once
        from common.kv_transfer.nixl.agent import listen_on

        listen_on(config.advertise_host)
    module, _, cls = CONNECTORS[config.connector].partition(":")
    return getattr(import_module(module), cls)(config, block_size, pool)
