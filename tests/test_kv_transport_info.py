"""Which UCX transport carries a peer's KV, as each worker logs it and `/metrics` shows it.

Real workers first: a prefill worker and two decode workers on loopback, one of them started
with `UCX_TLS=tcp`. Pulls make the decode workers report the prefill worker (`cma` from the
default one, `tcp` from the other); pushes make the prefill worker report both decode workers,
each with its own transport. Then the parsing and the bracketing on UCX output written by a
stand-in agent: GPU tables (cuda_ipc, the tcp fallback), a peer that reuses another's endpoint
configuration, a protocol chosen only once the transfer progresses, UCX's warnings passed on.
"""

from __future__ import annotations

import itertools
import logging
import re
from types import SimpleNamespace

import httpx
import pytest

from common.api.metrics import ServerMetrics
from common.engine.stats import engine_stats
from common.kv_transfer.base import KVTransferStats
from common.kv_transfer.nixl import transport_info
from common.kv_transfer.nixl.transport_info import UcxLog, WatchedAgent
from tests.test_pd_pull import complete, prefill, prompts

SAMPLE = re.compile(r'^pdserve_kv_transport_info\{peer="([^"]+)",transport="([^"]+)"\} 1\.0$')


def transports(worker) -> dict[str, set[str]]:
    """{peer: transports} from the worker's /metrics."""
    found: dict[str, set[str]] = {}
    for line in httpx.get(f"{worker.url}/metrics", timeout=5).text.splitlines():
        if m := SAMPLE.match(line):
            found.setdefault(m[1], set()).add(m[2])
    return found


@pytest.fixture(scope="module")
def workers(start_server, tiny_model):
    common = ["--model", str(tiny_model("llama")), "--num-blocks", "256", "--max-model-len", "256"]
    common.append("--no-prefix-caching")
    p = start_server("prefill", *common, wait=False)
    d = start_server("decode", *common, wait=False)
    p, d = p.wait_ready(), d.wait_ready()  # started side by side
    with pytest.MonkeyPatch.context() as env:  # read when the process starts
        env.setenv("UCX_TLS", "tcp")
        d_tcp = start_server("decode", *common)
    return p, d, d_tcp


def test_decode_workers_report_the_transport_their_reads_use(workers):
    p, d, d_tcp = workers
    body = dict(prompt=prompts()[5], max_tokens=4, ignore_eos=True, return_token_ids=True)
    for worker, expected in ((d, "cma"), (d_tcp, "tcp")):
        params = prefill(p, body)
        complete(worker.url, {**body, "kv_transfer_params": params})
        (peer, used), *others = transports(worker).items()
        assert not others and peer.startswith(params["remote_engine_id"])
        assert used == {expected}, worker.log()
        assert re.search(rf"KV transport to peer {peer} \(read\): {expected} \(UCX: ", worker.log())
    assert transports(p) == {}  # pull: P initiates nothing


def test_prefill_worker_reports_each_decode_worker_it_pushes_to(workers):
    p, d, d_tcp = workers
    prompt = prompts()[7]
    body = dict(prompt=prompt, max_tokens=4, ignore_eos=True, return_token_ids=True)
    engines = {}
    for worker in (d, d_tcp):
        r = httpx.post(f"{worker.url}/internal/kv/reserve", json={"num_tokens": len(prompt)})
        target = r.json()
        engines[target["engine_id"]] = worker
        params = {"do_remote_decode": True, "push_to": target}
        answer = complete(p.url, {**body, "max_tokens": 1, "kv_transfer_params": params})
        complete(worker.url, {**body, "kv_transfer_params": answer["kv_transfer_params"]})
    reported = {
        next(w for e, w in engines.items() if peer.startswith(e)): used
        for peer, used in transports(p).items()
    }
    assert reported == {d: {"cma"}, d_tcp: {"tcp"}}, p.log()


# -- UCX's output, written by a stand-in agent ---------------------------------------------
_TIMES = itertools.count(1)


def table(agent: str, kind: str, index: int, op: str, *rows: tuple[str, str, str]) -> list[str]:
    """A UCX_PROTO_INFO table as UCX 1.23 prints it (one timestamp for all its lines)."""
    prefix, border = f"[17.{next(_TIMES):06d}] [vm:42 :1]   ", "+--------+----+"
    lines = [border, f"| {agent} {kind} cfg#{index} |", f"| {op} |", border]
    lines += ["| Range  | Description | Config |", border]
    lines += [f"| {r} | {d} | {c} |" for r, d, c in rows] + [border, ""]
    return [prefix + line for line in lines]


def config_line(agent: str, kind: str, index: int, lanes: str) -> list[str]:
    where = f"[17.{next(_TIMES):06d}] [vm:42 :1]      ucp_worker.c:1997 UCX  INFO    "
    return [f"{where}{agent} {kind} cfg#{index} {lanes}"]


GET_CUDA = "remote memory read by ucp_get* into cuda memory from cuda"
PUT_CUDA = "remote memory write by ucp_put* from cuda memory to cuda"


class StandInAgent:
    """Prints, on each call, what UCX would print for it: `script[(call, peer)]`."""

    def __init__(self, path, script: dict):
        self.path, self.script, self.on_progress = path, script, {}

    def _print(self, key) -> None:
        with open(self.path, "a") as f:
            f.write("\n".join(self.script.pop(key, [])) + "\n")

    def add_remote_agent(self, metadata: bytes) -> bytes:
        self._print(("add", metadata.decode()))
        return metadata

    def remove_remote_agent(self, name: str) -> None:
        pass

    def initialize_xfer(self, op, local, remote, peer, notif=b""):
        return (op, peer)

    def transfer(self, handle) -> str:
        self._print(handle)
        return "PROC" if ("progress", handle[1]) in self.script else "DONE"

    def check_xfer_state(self, handle) -> str:
        self._print(("progress", handle[1]))
        return "DONE"


@pytest.fixture
def ucx(tmp_path):
    """(UcxLog, a WatchedAgent around a stand-in named `d-...`) and the script to fill."""
    name = "d0123456789abcdef0123456789abcdef-1a2b3c4d"  # UCX cuts it to 31 characters
    log, script = UcxLog(str(tmp_path / "ucx.log")), {}
    agent = WatchedAgent(StandInAgent(log.path, script), name, log)
    yield log, agent, script, name[:31]
    for peer in list(agent._ops):
        agent.remove_remote_agent(peer)


def move(agent: WatchedAgent, peer: str, op: str = "READ") -> None:
    handle = agent.initialize_xfer(op, [], [], peer)
    if agent.transfer(handle) == "PROC":
        assert agent.check_xfer_state(handle) == "DONE"


def test_each_peer_gets_the_configuration_ucx_named_while_it_was_new(ucx):
    log, agent, script, ucx_name = ucx
    other = "e0123456789abcdef0123456789abcde"  # another agent of this process: never ours
    script[("add", "p-ipc")] = config_line(ucx_name, "intra-node", 1, "rma_bw(cuda_ipc/cuda)")
    script[("READ", "p-ipc")] = table(
        ucx_name, "intra-node", 1, GET_CUDA, ("0..inf", "zero-copy", "cuda_ipc/cuda")
    )
    script[("add", "p-tcp")] = config_line(ucx_name, "intra-node", 2, "am(tcp/eth0)")
    script[("READ", "p-tcp")] = table(
        ucx_name, "intra-node", 2, GET_CUDA, ("0..inf", "software emulation", "tcp/eth0")
    ) + table(other, "intra-node", 1, GET_CUDA, ("0..inf", "zero-copy", "rc_mlx5/mlx5_0:1"))
    script[("progress", "p-rdma")] = table(
        ucx_name,
        "inter-node",
        3,
        PUT_CUDA,
        ("0..inf", "zero-copy", "51% on rc_mlx5/mlx5_0:1 and 49% on rc_mlx5/mlx5_1:1"),
    )
    script[("WRITE", "p-rdma")] = []  # chosen only once the transfer progresses
    for peer in ("p-ipc", "p-tcp", "p-rdma"):
        agent.add_remote_agent(peer.encode())
    move(agent, "p-ipc")
    move(agent, "p-tcp")
    move(agent, "p-rdma", "WRITE")
    # p-late reuses cfg#1 or cfg#2 (no line is new): they disagree, so UCX did not say
    agent.add_remote_agent(b"p-late")
    move(agent, "p-late")
    shown = {p: set(t) for p, t in transport_info.snapshot().items() if p.startswith("p-")}
    assert shown == {
        "p-ipc": {"cuda_ipc"},
        "p-tcp": {"tcp"},
        "p-rdma": {"rc_mlx5"},
        "p-late": {"unknown"},
    }
    assert set(log.configs(ucx_name)) == {1, 2, 3}
    agent.remove_remote_agent("p-late")
    assert "p-late" not in transport_info.snapshot()


def test_a_peer_reusing_the_only_configuration_gets_its_transports(ucx):
    log, agent, script, ucx_name = ucx
    script[("add", "q-1")] = config_line(ucx_name, "self", 0, "") + config_line(
        ucx_name, "intra-node", 1, ""
    )
    script[("READ", "q-1")] = table(
        ucx_name,
        "intra-node",
        1,
        "remote memory read by ucp_get*(multi) into host memory from host",
        ("0..inf", "zero-copy", "cma/memory"),
    )
    for peer in ("q-1", "q-2"):
        agent.add_remote_agent(peer.encode())
        move(agent, peer)
    shown = transport_info.snapshot()
    assert shown["q-1"] == shown["q-2"] == {"cma"}


def test_a_configuration_named_while_two_peers_were_new_goes_to_neither(ucx):
    """r-old reuses cfg#1 (no line of its own) while r-new's first READ, in flight at the same
    time, prints cfg#2's table: r-old must not get r-new's transport."""
    log, agent, script, ucx_name = ucx
    host_read = "remote memory read by ucp_get*(multi) into host memory from host"
    script[("add", "r-first")] = config_line(ucx_name, "intra-node", 1, "")
    script[("READ", "r-first")] = table(
        ucx_name, "intra-node", 1, host_read, ("0..inf", "zero-copy", "cma/memory")
    )
    script[("add", "r-new")] = config_line(ucx_name, "intra-node", 2, "")
    script[("progress", "r-new")] = table(
        ucx_name, "intra-node", 2, host_read, ("0..inf", "software emulation", "tcp/lo")
    )
    script[("progress", "r-old")] = []
    for peer in ("r-first", "r-old", "r-new"):
        agent.add_remote_agent(peer.encode())
    move(agent, "r-first")
    old, new = (agent.initialize_xfer("READ", [], [], p) for p in ("r-old", "r-new"))
    assert agent.transfer(old) == agent.transfer(new) == "PROC"
    agent.check_xfer_state(new)
    agent.check_xfer_state(old)
    shown = transport_info.snapshot()
    assert (shown["r-first"], shown["r-new"], shown["r-old"]) == ({"cma"}, {"tcp"}, {"unknown"})


def test_the_first_of_several_transfers_to_a_new_peer_opens_its_bracket(ucx):
    """Per-layer WRITEs: the first one posted prints the table, a later one ends first."""
    log, agent, script, ucx_name = ucx
    put = "remote memory write by ucp_put*(multi) from host memory to host"
    script[("add", "s-cma")] = table(
        ucx_name, "intra-node", 1, put, ("0..inf", "zero-copy", "cma/memory")
    )
    script[("add", "s-tcp")] = table(
        ucx_name, "intra-node", 2, put, ("0..inf", "zero-copy", "tcp/lo")
    )
    script[("WRITE", "s-new")] = table(
        ucx_name, "intra-node", 1, put, ("0..inf", "zero-copy", "cma/memory")
    )
    script[("progress", "s-new")] = []
    for peer in ("s-cma", "s-tcp", "s-new"):
        agent.add_remote_agent(peer.encode())
    first = agent.initialize_xfer("WRITE", [], [], "s-new")
    assert agent.transfer(first) == "PROC"  # prints the table
    later = agent.initialize_xfer("WRITE", [], [], "s-new")
    assert agent.transfer(later) == "PROC"
    agent.check_xfer_state(later)
    agent.check_xfer_state(first)
    assert transport_info.snapshot()["s-new"] == {"cma"}


def test_ucx_warnings_are_passed_on(tmp_path, caplog):
    log = UcxLog(str(tmp_path / "ucx.log"))
    warning = "transport 'cuda_ipc' is not available, please use one or more of: cma, tcp"
    (tmp_path / "ucx.log").write_text(
        f"[17.1] [vm:42 :0]     ucp_context.c:1508 UCX  WARN  {warning}\n[17.2] [vm:42 :0] partial"
    )
    with caplog.at_level(logging.WARNING, logger="common.kv_transfer.nixl.transport_info"):
        log.read()
    assert [r.getMessage() for r in caplog.records] == [f"UCX ucp_context.c:1508: {warning}"]


def test_metrics_show_one_sample_per_peer_and_transport():
    """/metrics reads the report from the connector's stats (`KVTransferStats.peer_transports`,
    through the engine's), not from NIXL's module."""
    used = frozenset({"cuda_ipc", "cuda_copy"})
    kv = KVTransferStats(peer_transports={"z-peer": used})
    engine = SimpleNamespace(  # what engine_stats reads of an engine
        scheduler=SimpleNamespace(running=[], waiting=[], num_preemptions=0),
        pool=SimpleNamespace(num_used_blocks=0, num_free_blocks=0, num_queries=0, num_hits=0),
        runner=SimpleNamespace(graphs=None),
        grammars=SimpleNamespace(stats=SimpleNamespace(snapshot=lambda: ({}, {}))),
        connector=SimpleNamespace(stats_snapshot=lambda: kv),
    )
    text = ServerMetrics("decode").render(engine_stats(engine, None)).decode()
    samples = [m.groups() for line in text.splitlines() if (m := SAMPLE.match(line))]
    assert ("z-peer", "cuda_ipc") in samples and ("z-peer", "cuda_copy") in samples


def test_a_transport_sees_only_its_own_agents_peers():
    reports = {
        ("a1", "p-1"): {"read": (frozenset({"cma"}), "")},
        ("a2", "p-2"): {"write": (frozenset(), "")},
    }
    transport_info._REPORTS.update(reports)
    try:
        assert transport_info.snapshot("a1") == {"p-1": {"cma"}}
        assert transport_info.snapshot("a2") == {"p-2": {transport_info.UNKNOWN}}
        assert {"p-1", "p-2"} <= set(transport_info.snapshot())  # the process's, for the GPU check
    finally:
        for key in reports:
            del transport_info._REPORTS[key]
