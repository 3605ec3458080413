"""Creating a NIXL agent that does not spin a core while idle and reports its peers' transports.

NOTE: NIXL's Python wrapper hard-codes its progress thread's delay to 0 µs, so an idle agent
polls in a tight loop (a whole core). The agent is created with the wrapper's binding module
swapped, for that one call, for a stand-in that sets `pthrDelay` on the way to the C++ agent.

UCX's log is pointed at a file before NIXL loads UCX, and the agent comes back wrapped so that
each peer's UCX transports are read from it (transport_info.py).

UCX's tcp transport listens on every network interface unless told otherwise. `listen_on(host)`
(the address peers are told, `--kv-host`), called before the first agent loads UCX, sets
`UCX_NET_DEVICES` to the interface that holds that address plus the RDMA ports (which listen on
no IP socket), unless the operator set it. A wildcard or an address no interface holds leaves
UCX's default.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct
import threading
from pathlib import Path
from typing import Any

from common.kv_transfer.nixl import transport_info

logger = logging.getLogger(__name__)

_AGENT_CREATION_LOCK = threading.Lock()
NET_DEVICES_ENV = "UCX_NET_DEVICES"
_SIOCGIFADDR = 0x8915  # <linux/sockios.h>
_RDMA = Path("/sys/class/infiniband")


class _DelayedBind:
    """Stands in for the wrapper's `nixlBind` module while one agent is created.

    NOTE: the Python wrapper hard-codes the progress thread's delay to 0 µs, so an idle agent
    spins a whole core; this sets `pthrDelay` on the config on its way to the C++ agent.
    """

    def __init__(self, real: Any, delay_us: int) -> None:
        self._real = real
        self._delay_us = delay_us
        self.is_used = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # noqa: N802 — the binding's name
        config.pthrDelay = self._delay_us
        self.is_used = True
        return self._real.nixlAgent(name, config)


def create_agent(name: str, progress_delay_us: int) -> Any:
    transport_info.configure()  # UCX reads its environment once, when NIXL first loads it
    api = _import_nixl_api()
    # RW: transfers and notifications share the agent across threads; peer changes are exclusive.
    config = api.nixl_agent_config(sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW)
    with _AGENT_CREATION_LOCK:
        real = api.nixlBind
        api.nixlBind = proxy = _DelayedBind(real, progress_delay_us)
        try:
            agent = api.nixl_agent(name, config)
        finally:
            api.nixlBind = real
    if not proxy.is_used:
        logger.warning("could not set NIXL's progress-thread delay: an idle agent spins a core")
    return transport_info.watch(agent, name)


def _import_nixl_api() -> Any:
    try:
        import nixl._api as api
    except ImportError:
        import nixl_cu12._api as api
    return api


def listen_on(host: str) -> None:
    """Have UCX listen on `host`'s interface only (see the module's docstring)."""
    if NET_DEVICES_ENV in os.environ:
        return
    interface = interface_of(host)
    if interface is None:
        logger.info("UCX listens on every interface: %r is no local interface's address", host)
        return
    os.environ[NET_DEVICES_ENV] = ",".join([interface, *_rdma_ports()])


def interface_of(host: str) -> str | None:
    """The network interface that holds the address `host` (a name is resolved); None for a
    wildcard, or an address no interface holds."""
    try:
        address = ipaddress.ip_address(
            socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0].partition("%")[0]
        )
    except (OSError, ValueError):
        return None
    if address.is_unspecified:
        return None
    if address.is_loopback:
        return "lo"
    if address.version == 6:
        return _ipv6_interface(address)
    return next((name for _, name in socket.if_nameindex() if _ipv4_of(name) == address), None)


def _ipv4_of(interface: str) -> ipaddress.IPv4Address | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            answer = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", interface.encode()))
        except OSError:  # no IPv4 address
            return None
    return ipaddress.IPv4Address(answer[20:24])


def _ipv6_interface(address: ipaddress.IPv6Address) -> str | None:
    try:
        lines = Path("/proc/net/if_inet6").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hex_address, *_, name = line.split()
        if ipaddress.IPv6Address(int(hex_address, 16)) == address:
            return name
    return None


def _rdma_ports() -> list[str]:
    """`mlx5_0:1`-style names of this host's RDMA ports."""
    if not _RDMA.is_dir():
        return []
    return sorted(f"{d.name}:{p.name}" for d in _RDMA.iterdir() for p in (d / "ports").iterdir())
