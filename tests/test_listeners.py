"""Where a worker listens: a census of the listening TCP sockets of a real decode worker's whole
process tree (tensor-parallel ranks included), read from /proc. With `--host 127.0.0.1` every
listener sits on loopback: the HTTP port, the KV events PUB and ROUTER (wildcard endpoints bind
--host), the UCX listener (the address peers are told), gloo's sockets; the tensor-parallel
rendezvous store is closed once the ranks have joined.
"""

from __future__ import annotations

import ipaddress
import json
import os
from pathlib import Path

from tests.servers import free_port

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


def process_tree(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo.extend(children.get(tree[-1], []))
    return tree


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return ipaddress.IPv4Address(raw[::-1])
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))  # host-order 32-bit words
    return ipaddress.IPv6Address(words)


def listeners(pid: int) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every listening TCP socket of the tree rooted at `pid`."""
    found = []
    for member in process_tree(pid):
        inodes = socket_inodes(member)
        for table in ("tcp", "tcp6"):
            for line in Path(f"/proc/{member}/net/{table}").read_text().splitlines()[1:]:
                cols = line.split()
                if cols[3] == _LISTEN and cols[9] in inodes:
                    address, port = cols[1].split(":")
                    found.append((str(_address(address)), int(port, 16), member))
    return found


def store_port(pid: int) -> int:
    """The rendezvous store's port, from a rank's command line (its RankSpec)."""
    for member in process_tree(pid):
        argv = Path(f"/proc/{member}/cmdline").read_bytes().split(b"\0")
        if b"common.engine.rank_main" in argv:
            return json.loads(argv[argv.index(b"common.engine.rank_main") + 1])["store_port"]
    raise AssertionError("no tensor-parallel rank in the tree")


def test_a_tensor_parallel_decode_worker_listens_on_its_host_only(start_server, tiny_model):
    events, replay = free_port(), free_port()
    worker = start_server(
        "decode",
        "--model", str(tiny_model()), "--host", "127.0.0.1", "--tensor-parallel-size", "2",
        "--kv-connector", "nixl", "--num-blocks", "64",
        "--kv-events-endpoint", f"tcp://*:{events}",
        "--kv-events-replay-endpoint", f"tcp://*:{replay}",
    )  # fmt: skip
    found = listeners(worker.proc.pid)
    ports = {port for _, port, _ in found}
    assert {worker.port, events, replay} <= ports, found
    wide = [(a, p) for a, p, _ in found if not ipaddress.ip_address(a).is_loopback]
    assert not wide, f"listeners beyond 127.0.0.1: {wide}"
    assert store_port(worker.proc.pid) not in ports, "the rendezvous store is still open"
