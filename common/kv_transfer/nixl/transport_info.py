"""Which UCX transports carry a NIXL peer's KV, from UCX's own reporting.

NIXL does not say which UCX transport a connection uses (its UCX backend's parameters are `{}`),
and UCX falls back without a word: a CUDA IPC handle that cannot be opened, or cma blocked by
seccomp, still moves the right bytes, over tcp, several times slower. UCX prints what it chose,
in lines that name the local agent (UCX's worker name, cut to 31 characters) and an endpoint
configuration, never the peer: at INFO a line per new configuration (`<agent> intra-node cfg#1
...`), and with UCX_PROTO_INFO a table per configuration and operation, the protocol and the
transport for each message size (`remote memory read by ucp_get* ...` → `cuda_ipc/cuda`).

`configure()`, before UCX loads, has UCX write that to a file of this process (UCX_LOG_FILE)
unless the operator set those variables (`PDSERVE_KV_TRANSPORT_INFO=0`: leave UCX alone); UCX's
warnings in it go on to this module's logger. `watch()` wraps the agent to infer each peer by
bracketing: the log is read before and after `add_remote_agent`, and from the posting of the
first READ and the first WRITE to a peer until that transfer ends. UCX prints on the thread that
calls into it (`fflush` then makes it reach the file), and one transport thread makes these
calls, so the one configuration named in between is the peer's.

NOTE: a peer whose endpoint reuses another peer's configuration prints nothing new; it gets the
transports of every configuration it could be when they agree, "unknown" otherwise. The
initiator reports: D for its READs (pull), P for its WRITEs (push). `snapshot()` is what
`/metrics` shows (through the transport and the connector's stats); each peer is logged when
its first READ or WRITE ends.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import re
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from common.settings import Settings

logger = logging.getLogger(__name__)

PROTO_INFO = "*remote memory*"  # UCX_PROTO_INFO glob: only the tables of READ/WRITE (get/put)
UNKNOWN = "unknown"
_MIN_NAME = 16  # UCX cuts worker names to 31 characters: match a prefix at least this long
_FOLLOW_S = 1.0  # how often UCX's warnings are passed on
_FILE_NAME = "pdserve-ucx-%p.log"  # in the temporary directory; UCX puts the pid for %p

_LINE = re.compile(r"^(?P<key>\[[\d.]+\] \[[^\]]+\])\s+(?P<rest>.*)$")
_MESSAGE = re.compile(r"^(?P<src>\S+:\d+)\s+UCX\s+(?P<level>[A-Z]+)\s+(?P<msg>.*)$")
_CONFIG = re.compile(r"^(?P<agent>\S+) (?P<kind>[\w-]+) cfg#(?P<index>\d+)(?:\s.*)?$")
_TRANSPORT = re.compile(r"\b([a-z][a-z0-9_]*)/\S+")  # `cma/memory`, `52% on tcp/lo and ...`
_OPS = {"remote memory read": "read", "remote memory write": "write"}
_FORWARD = {"WARN": logging.WARNING, "ERROR": logging.ERROR, "FATAL": logging.CRITICAL}


@dataclass
class EndpointConfig:
    """One UCX endpoint configuration of one agent: its kind (self, intra-node, inter-node) and
    the table rows of each remote-memory operation (`0..inf zero-copy cma/memory`)."""

    kind: str
    rows: dict[str, list[str]] = field(default_factory=dict)

    def transports(self, op: str) -> frozenset[str]:
        return frozenset(t for row in self.rows.get(op, []) for t in _TRANSPORT.findall(row))


@dataclass
class _Table:
    title: re.Match | None = None
    op: str | None = None
    has_rows: bool = False


class UcxLog:
    """UCX's log file of this process, read incrementally: endpoint configurations by agent, and
    a sequence of mentions (which configuration each new line names) for brackets."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.RLock()
        self._offset = 0
        self._partial = ""
        self._seq = 0
        self._configs: dict[str, dict[int, EndpointConfig]] = {}  # UCX's (cut) agent name →
        self._mentions: list[tuple[int, str, int]] = []  # (seq, agent, config) but "self" ones
        self._tables: dict[str, _Table] = {}  # by line prefix: one table's lines share it

    def read(self) -> None:
        """Flush UCX's buffered output and parse what is new in the file."""
        with self._lock:
            _LIBC.fflush(None)  # UCX writes its log through stdio, buffered
            try:
                with open(self.path, "rb") as f:
                    if os.fstat(f.fileno()).st_size < self._offset:  # a new file: start over
                        self._offset, self._partial = 0, ""
                    f.seek(self._offset)
                    data = f.read()
            except OSError:  # not there yet (UCX not loaded), or unreadable: nothing to add
                return
            self._offset += len(data)
            lines = (self._partial + data.decode(errors="replace")).split("\n")
            self._partial = lines.pop()
            for line in lines:
                self.feed(line)

    def mark(self) -> int:
        self.read()
        return self._seq

    def named_since(self, agent: str, mark: int) -> set[int]:
        """The configurations of `agent` (not "self") named by lines read after `mark`."""
        self.read()
        with self._lock:
            return {i for seq, a, i in self._mentions if seq > mark and _same_agent(a, agent)}

    def configs(self, agent: str) -> dict[int, EndpointConfig]:
        with self._lock:
            return dict(next((c for a, c in self._configs.items() if _same_agent(a, agent)), {}))

    def feed(self, line: str) -> None:
        m = _LINE.match(line)
        if m is None:
            return
        self._seq += 1
        key, rest = m["key"], m["rest"]
        if rest.startswith(("|", "+")):
            return self._table_line(key, rest)
        msg = _MESSAGE.match(rest)
        if msg is None:
            return
        if msg["level"] in _FORWARD:
            logger.log(_FORWARD[msg["level"]], "UCX %s: %s", msg["src"], msg["msg"])
        if (config := _CONFIG.match(msg["msg"].strip())) is not None:  # a new configuration
            self._config(config)

    def _table_line(self, key: str, body: str) -> None:
        table = self._tables.setdefault(key, _Table())
        if body.startswith("+"):  # a border: after the rows, the table's end
            if table.has_rows:
                del self._tables[key]
            return
        cells = [c.strip() for c in body.strip().strip("|").split("|")]
        if len(cells) == 1:
            if table.title is None:
                table.title = _CONFIG.match(cells[0])
            elif table.op is None:
                table.op = next((op for s, op in _OPS.items() if cells[0].startswith(s)), "")
            return
        if cells[0] in ("Range", "Count"):
            return
        table.has_rows = True
        if table.title is not None and table.op:
            rows = self._config(table.title).rows.setdefault(table.op, [])
            row = " ".join(c for c in cells if c)
            if row not in rows:
                rows.append(row)

    def _config(self, m: re.Match) -> EndpointConfig:
        agent, index = m["agent"], int(m["index"])
        config = self._configs.setdefault(agent, {}).setdefault(index, EndpointConfig(m["kind"]))
        if m["kind"] != "self":
            self._mentions.append((self._seq, agent, index))
            del self._mentions[:-4096]  # brackets look back a few lines, never this far
        return config


_LOG: UcxLog | None = None
_CONFIGURE_LOCK = threading.Lock()
_REPORTS_LOCK = threading.Lock()
_REPORTS: dict[tuple[str, str], dict[str, tuple[frozenset[str], str]]] = {}  # process-wide:
# (local agent, peer) → op → (transports, what UCX printed)


def snapshot(local: str | None = None) -> dict[str, frozenset[str]]:
    """{peer agent name: the UCX transports of its KV transfers ({"unknown"} if UCX did not
    say)}, for every peer this process (or its agent named `local`) has READ from or WRITTEN
    to."""
    merged: dict[str, frozenset[str]] = {}
    with _REPORTS_LOCK:
        for (agent, peer), ops in _REPORTS.items():
            if local is not None and agent != local:
                continue
            merged[peer] = merged.get(peer, frozenset()).union(*(u for u, _ in ops.values()))
    return {peer: used or frozenset([UNKNOWN]) for peer, used in merged.items()}


def details() -> dict[str, dict[str, str]]:
    """{peer agent name: {"read"|"write": what UCX printed for it}}, e.g. "intra-node cfg#1,
    0..inf zero-copy cuda_ipc/cuda"."""
    with _REPORTS_LOCK:
        return {peer: {op: d for op, (_, d) in ops.items()} for (_, peer), ops in _REPORTS.items()}


def configure(env: Any = os.environ) -> UcxLog | None:
    """Point UCX's log at a file this process reads (idempotent). Must run before UCX loads;
    else the file never appears and every peer is "unknown"."""
    global _LOG
    with _CONFIGURE_LOCK:
        if _LOG is not None or not Settings.from_env(env).is_kv_transport_info:
            return _LOG
        env.setdefault("UCX_LOG_LEVEL", "info")
        env.setdefault("UCX_PROTO_INFO", PROTO_INFO)  # set otherwise: peers may be "unknown"
        default = os.path.join(tempfile.gettempdir(), _FILE_NAME)
        # NOTE: no UCX_LOG_FILE_SIZE: with a limit, fflush no longer brings UCX's lines out
        if env.setdefault("UCX_LOG_FILE", default) == default:  # ours (and children's)
            atexit.register(_remove, _expand(default))
            _sweep(os.path.dirname(default))
        _LOG = UcxLog(_expand(env["UCX_LOG_FILE"]))
        logger.info("UCX's log: %s (warnings are repeated here)", _LOG.path)
        threading.Thread(target=_follow, args=(_LOG,), name="ucx-log", daemon=True).start()
        return _LOG


def watch(agent: Any, name: str) -> Any:
    """`agent` (a nixl_agent named `name`), reporting its peers' transports if UCX's log is
    read (`configure()`); else `agent` itself."""
    return agent if _LOG is None else WatchedAgent(agent, name, _LOG)


@dataclass
class _Bracket:
    """A peer's first READs (or WRITEs), from the first one's posting to the end of one of them
    (NOTE: the first posted may print the tables and another end first). `is_shared`: another
    peer's bracket was open meanwhile, so a configuration named in it may be the other's."""

    peer: str
    op: str
    mark: int
    is_shared: bool = False


class WatchedAgent:
    """A NIXL agent that brackets `add_remote_agent` and each peer's first READ and WRITE with
    reads of UCX's log; every other call goes straight to the agent."""

    def __init__(self, agent: Any, name: str, log: UcxLog):
        self._agent, self._name, self._log = agent, name, log
        self._configs: dict[str, int | None] = {}  # peer → its endpoint configuration
        self._ops: dict[str, set[str]] = {}  # peer → the ops whose transports are known
        self._open: dict[tuple[str, str], _Bracket] = {}  # by (peer, op)
        self._pending: dict[int, tuple[Any, _Bracket]] = {}  # by id(handle)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._agent, attr)

    def add_remote_agent(self, metadata: bytes) -> Any:
        mark = self._log.mark()
        name = self._agent.add_remote_agent(metadata)
        peer = name.decode() if isinstance(name, bytes) else name
        self._ops[peer] = set()
        named = self._log.named_since(self._name, mark)
        self._configs[peer] = None if self._share_pending() else _only(named)
        return name

    def remove_remote_agent(self, agent: str) -> Any:
        self._configs.pop(agent, None)
        self._ops.pop(agent, None)
        self._open = {key: b for key, b in self._open.items() if b.peer != agent}
        self._pending = {k: (h, b) for k, (h, b) in self._pending.items() if b.peer != agent}
        with _REPORTS_LOCK:
            _REPORTS.pop((self._name, agent), None)
        return self._agent.remove_remote_agent(agent)

    def initialize_xfer(self, operation, local_descs, remote_descs, remote_agent, *a, **kw):
        op = "read" if operation == "READ" else "write"
        is_first = remote_agent in self._ops and op not in self._ops[remote_agent]
        bracket = self._open.get((remote_agent, op)) if is_first else None
        if is_first and bracket is None:
            bracket = _Bracket(remote_agent, op, self._log.mark())
            bracket.is_shared = self._share_pending(remote_agent)
            self._open[(remote_agent, op)] = bracket
        handle = self._agent.initialize_xfer(
            operation, local_descs, remote_descs, remote_agent, *a, **kw
        )
        if bracket is not None:
            self._pending[id(handle)] = (handle, bracket)
        return handle

    def transfer(self, handle: Any, *args: Any, **kwargs: Any) -> Any:
        return self._watched(handle, self._agent.transfer, *args, **kwargs)

    def check_xfer_state(self, handle: Any) -> Any:
        return self._watched(handle, self._agent.check_xfer_state)

    def _watched(self, handle: Any, call, *args: Any, **kwargs: Any) -> Any:
        try:
            state = call(handle, *args, **kwargs)
        except Exception:
            self._settled(handle, "ERR")
            raise
        self._settled(handle, state)
        return state

    def _share_pending(self, peer: str | None = None) -> bool:
        """Mark the open brackets of other peers than `peer` shared; True if there was one."""
        others = [b for b in self._open.values() if b.peer != peer]
        for bracket in others:
            bracket.is_shared = True
        return bool(others)

    def _settled(self, handle: Any, state: str) -> None:
        """NOTE: UCX may choose the protocol when the request first progresses, after
        `transfer()` has returned: the bracket ends when the transfer does."""
        if state == "PROC" or not self._pending:
            return
        held, bracket = self._pending.pop(id(handle), (None, None))
        if held is not handle or self._open.pop((bracket.peer, bracket.op), None) is None:
            return  # not a first transfer, or its peer's op was resolved by another one
        try:
            self._resolve(bracket)
        except Exception:  # noqa: BLE001 — reporting must never fail a transfer
            logger.exception("could not tell the UCX transport to peer %s", bracket.peer)

    def _resolve(self, bracket: _Bracket) -> None:
        peer, op = bracket.peer, bracket.op
        if peer not in self._ops:  # removed meanwhile
            return
        # this transfer's tables name the configuration its endpoint has now (wireup may have
        # moved it since add_remote_agent), unless another peer's bracket overlapped
        named = _only(self._log.named_since(self._name, bracket.mark))
        if named is not None and not bracket.is_shared:
            self._configs[peer] = named
        index, configs = self._configs.get(peer), self._log.configs(self._name)
        if (config := configs.get(index)) is not None:
            transports = config.transports(op)
            detail = f"{config.kind} cfg#{index}, " + "; ".join(config.rows.get(op, ["no table"]))
        else:  # a reused configuration: any that has done this op could be it
            candidates = {c.transports(op) for c in configs.values() if c.kind != "self"}
            candidates.discard(frozenset())
            transports = next(iter(candidates)) if len(candidates) == 1 else frozenset()
            detail = "another peer's configuration" if transports else "it did not say"
        self._ops[peer].add(op)
        with _REPORTS_LOCK:
            _REPORTS.setdefault((self._name, peer), {})[op] = (transports, detail)
        used = ",".join(sorted(transports)) or UNKNOWN
        logger.info("KV transport to peer %s (%s): %s (UCX: %s)", peer, op, used, detail)


def _follow(log: UcxLog) -> None:
    while True:
        time.sleep(_FOLLOW_S)
        try:
            log.read()
        except Exception:  # noqa: BLE001 — never let reporting take a worker down
            logger.exception("reading UCX's log failed; transports are no longer reported")
            return


def _same_agent(logged: str, name: str) -> bool:
    return name.startswith(logged) and len(logged) >= min(len(name), _MIN_NAME)


def _only(indices: set[int]) -> int | None:
    return next(iter(indices)) if len(indices) == 1 else None


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)


def _sweep(directory: str) -> None:
    """Remove the log files of processes that died without removing theirs (SIGKILL)."""
    pattern = re.compile(re.escape(_FILE_NAME).replace("%p", r"(\d+)"))
    for entry in os.scandir(directory):
        if (m := pattern.fullmatch(entry.name)) is None:
            continue
        try:
            os.kill(int(m[1]), 0)  # alive: keep
        except ProcessLookupError:
            _remove(entry.path)
        except OSError:  # another user's process, alive
            pass


def _expand(path: str) -> str:
    """UCX_LOG_FILE as UCX expands it: %p the process id, %h the host name."""
    return path.replace("%p", str(os.getpid())).replace("%h", socket.gethostname())


_LIBC = ctypes.CDLL(None)
