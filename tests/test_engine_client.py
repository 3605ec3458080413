"""The worker's HTTP layer has one door to its engine (common/engine/client.py), and a KV peer
that cannot be reached is judged by the one failure policy (common/kv_transfer/remote_prefills.py).

- No module of common/api/ imports the engine's machinery (the engine, its thread, scheduler,
  runner) or the KV transfer machinery (peers, connectors, NIXL): only the client and the
  contract types that cross it (sampling params, outputs, resume, stats, params, handshake).
  The graph is read from the source, every import included, as test_import_cycles.py reads it.
- Metrics are read from the engine's stats, never from a prometheus object's private state
  (`counter._value`), in the worker or the proxy.
- `RemotePrefills.unreachable`: a prefill worker out of reach is computed here under
  `recompute` (counted as `prefill_unreachable`), fails under `fail`, and fails whatever the
  policy once the client has P's first token; a decode worker's prefix out of reach is computed
  here whatever the policy (`prefix_unreachable`).
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

from common.config import TransferConfig
from common.kv_transfer.base import KVConnector
from common.kv_transfer.params import RemotePrefill
from common.kv_transfer.remote_prefills import RemotePrefills

API = Path(__file__).resolve().parent.parent / "common" / "api"

# what common/api/ may import of the engine and KV transfer packages: the door and its contract
ALLOWED = {
    "common.engine.client",  # the door
    "common.engine.sampling_params",  # what a request asks for
    "common.engine.output",  # what it gets back
    "common.engine.request",  # Resume: a choice another worker started
    "common.engine.stats",  # EngineStats, for /metrics
    "common.engine.structured",  # GrammarSeconds, a stats histogram type
    "common.engine.sampler",  # SampledToken, a type of an output's logprobs
    "common.kv_transfer.params",  # kv_transfer_params, parsed
    "common.kv_transfer.handshake",  # HandshakeInfo, what /internal/kv/handshake answers
    "common.kv_transfer.transfers",  # the running histograms a connector's stats carry
}


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


@pytest.mark.parametrize("path", sorted(API.rglob("*.py")), ids=lambda p: str(p.relative_to(API)))
def test_the_http_layer_reaches_the_engine_only_through_its_client(path):
    engine_side = {
        name
        for name in imported_modules(path)
        if name.startswith(("common.engine", "common.kv_transfer"))
    }
    assert engine_side <= ALLOWED, f"{path} imports {sorted(engine_side - ALLOWED)}"
    text = path.read_text()
    assert ".engine.engine" not in text and ".call(" not in text, path


@pytest.mark.parametrize("package", ["common", "proxy"])
def test_no_metric_is_read_from_prometheus_private_state(package):
    readers = [
        str(path.relative_to(API.parent.parent))
        for path in sorted((API.parent.parent / package).rglob("*.py"))
        if "._value" in path.read_text()
    ]
    assert not readers


class CountingConnector(KVConnector):
    def __init__(self) -> None:
        super().__init__()
        self.recomputed: Counter = Counter()

    def count_recomputed(self, reason: str) -> None:
        self.recomputed[reason] += 1

    def start_load_kv(self, ctx) -> None: ...

    def wait_for_layer_load(self, layer_name: str) -> None: ...

    def save_kv_layer(self, layer_name, kv_cache, attn_metadata) -> None: ...

    def wait_for_save(self) -> None: ...


def remote(**fields) -> RemotePrefill:
    return RemotePrefill("p", [0, 1], "r", "127.0.0.1", 1, **fields)


def judge(policy: str, prefill: RemotePrefill) -> tuple[bool, Counter]:
    connector = CountingConnector()
    remote_prefills = RemotePrefills(
        connector, queue=None, cfg=TransferConfig(failure_policy=policy), block_size=16, pool=None
    )
    return remote_prefills.unreachable(prefill, "no handshake"), connector.recomputed


def test_an_unreachable_prefill_worker_is_recomputed_by_policy():
    assert judge("recompute", remote()) == (True, Counter(prefill_unreachable=1))
    assert judge("fail", remote()) == (False, Counter())


def test_a_streamed_first_token_is_never_recomputed_into_the_stream():
    streamed = remote(first_token_id=5, first_token_streamed=True)
    assert judge("recompute", streamed) == (False, Counter())
    # a first token the client has not seen yet: the prompt is computed here
    assert judge("recompute", remote(first_token_id=5)) == (True, Counter(prefill_unreachable=1))


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_an_unreachable_prefix_is_computed_here_whatever_the_policy(policy):
    prefix = remote(prefix_only=True, first_token_id=5, first_token_streamed=True)
    assert judge(policy, prefix) == (True, Counter(prefix_unreachable=1))
