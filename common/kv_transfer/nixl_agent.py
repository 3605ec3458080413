"""Creating a NIXL agent that does not spin a core while idle and reports its peers' transports.

NOTE: NIXL's Python wrapper hard-codes its progress thread's delay to 0 µs, so an idle agent
polls in a tight loop (a whole core). The agent is created with the wrapper's binding module
swapped, for that one call, for a stand-in that sets `pthrDelay` on the way to the C++ agent.

UCX's log is pointed at a file before NIXL loads UCX, and the agent comes back wrapped so that
each peer's UCX transports are read from it (common/kv_transfer/transport_info.py).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from common.kv_transfer import transport_info

logger = logging.getLogger(__name__)

_AGENT_CREATION_LOCK = threading.Lock()


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
