"""A real P and D behind a real proxy (`Cluster`), as the chaos tests see them: the proxy's
view of its workers, colocated references, the pools' state, and `heal()` after a fault."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx

from tests.chaos.client import Background, body, complete
from tests.chaos.faults import freeze, frozen, is_alive, restart, thaw
from tests.servers import ServerProcess, wait_until

WORKER = ["--num-blocks", "96", "--max-model-len", "512", "--no-prefix-caching"]
# Timeouts as short as their order allows, since tests wait for them to fire: D gives up a
# read (1.5 s) within the proxy's patience (3 s), and P's leases and D's push reservations
# (3.5 s) outlast that patience. Shorter, a busy moment of two shared cores would fire them.
P_WORKER = ["--kv-lease-timeout", "3.5"]
D_WORKER = ["--kv-load-timeout", "1.5", "--kv-lease-timeout", "3.5"]
PROXY = [
    "--health-interval", "0.3", "--health-timeout", "0.5", "--health-failures", "2",
    "--connect-timeout", "1", "--prefill-timeout", "3", "--decode-timeout", "3",
]  # fmt: skip


@dataclass
class Cluster:
    p: ServerProcess
    d: ServerProcess
    proxy: ServerProcess

    @property
    def workers(self) -> tuple[ServerProcess, ServerProcess]:
        return self.p, self.d

    def health(self) -> dict[str, bool]:
        """The proxy's view: worker URL → healthy (GET /ready)."""
        return {w["url"]: w["healthy"] for w in self._workers()}

    def outstanding(self, server: ServerProcess) -> int:
        """Requests the proxy has in flight on `server`."""
        return next(w["outstanding"] for w in self._workers() if w["url"] == server.url)

    def _workers(self) -> list[dict]:
        return httpx.get(f"{self.proxy.url}/ready", timeout=5).json()["workers"]

    @contextmanager
    def at_handoff(self, send: Callable, payload: dict) -> Iterator[Background]:
        """A request through the proxy caught between P's answer and D's read: inside the
        block P holds the prompt's KV and D (which the proxy chose while it was healthy) is
        frozen; D continues at the end of the block (unless the block killed it)."""
        with frozen(self.p):  # the proxy chooses D, then waits for P
            call = Background(send, self.proxy.url, payload)
            assert wait_until(lambda: self.outstanding(self.p) == 1), "no prefill started"
            freeze(self.d)
        try:
            assert wait_until(lambda: self.p.metric("pdserve_kv_blocks_held") > 0)
            yield call
        finally:
            thaw(self.d)

    def routed(self, path: str, reason: str) -> float:
        name = f'pdserve_proxy_routed_total{{path="{path}",reason="{reason}"}}'
        return self.proxy.metric(name, 0)

    def wait_health(self, server: ServerProcess, healthy: bool, timeout: float = 15) -> None:
        state = "readmitted" if healthy else "ejected"
        ok = wait_until(lambda: self.health()[server.url] is healthy, timeout=timeout)
        assert ok, f"the proxy has not {state} {server.role} {server.url}: {self.health()}"

    def reference(self, prompt: list[int], max_tokens: int = 8) -> list[int]:
        """Colocated greedy tokens, from D directly."""
        out = complete(self.d.url, body(prompt, max_tokens))
        assert out.is_ok, out
        return out.token_ids

    def assert_pools_free(self, timeout: float = 15) -> None:
        for s in self.workers:
            ok = wait_until(lambda s=s: s.metric("pdserve_kv_blocks_used") == 0, timeout=timeout)
            assert ok, f"{s.role} {s.url} still uses {s.metric('pdserve_kv_blocks_used')} blocks"

    def heal(self) -> None:
        """Every worker running (thawed, or restarted if dead) and healthy in the proxy."""
        for s in self.workers:
            thaw(s)
            if not is_alive(s):
                restart(s)
        for s in self.workers:
            self.wait_health(s, True)


def start_proxy(start_server, p: ServerProcess, d: ServerProcess, *args: str) -> Cluster:
    """A proxy over P and D (module-scoped, by the suite's `start_server`) that checks its
    workers every 0.3 s, ejects one after two failed checks (a second or so: a request sent
    just before a fault still reaches its workers) and waits at most 3 s for a silent one."""
    proxy = start_server("proxy", "--prefill", p.url, "--decode", d.url, *PROXY, *args)
    return Cluster(p, d, proxy)
