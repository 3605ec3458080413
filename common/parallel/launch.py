"""Rank 0's handle on the other tensor-parallel ranks: start them, wait until each holds its
shard, watch them, stop them.

Ranks 1..N-1 are processes (`python -m MAIN SPEC`, MAIN the engine's common/engine/rank_main.py)
started by the engine's own thread. Each takes its share of the CPU budget
(`common.cpu.split_budget`: its torch threads, and with `pin_ranks` (the worker's --cpu-cores)
its run of the cores; on CUDA it owns cuda:r), loads its shard of the weights, allocates its
shard of the KV cache, and serves steps until it is told to stop. Rank 0 is the engine: its
thread takes the first share (the event loop and tokenizer threads keep the process's mask). A
worker that moves KV over NIXL shares every rank's KV cache with rank 0 (kv_shards.py).

The ranks meet at a TCPStore that rank 0 serves on 127.0.0.1 (the ranks share a host); it
closes once every rank has joined the group, whose gloo sockets listen on 127.0.0.1 too.

Fail closed, never hang: a rank that exits while loading fails the engine's start-up with its
exit status. A rank that exits later fails whatever collective rank 0 is in at once (its
sockets close), and the watcher reports it (`on_death`) to an idle engine, which then dies the
usual way (async_engine.py: /health answers 503, the worker exits 1). A rank that hangs fails
rank 0's next collective after `tp_timeout` seconds. Each rank dies with the thread that
started it (PR_SET_PDEATHSIG), so none outlives a killed worker.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from common.arch_config import ArchConfig
from common.config import EngineConfig
from common.cpu import available_cores, split_budget
from common.kv_transfer.layout import ShardTensors
from common.parallel.group import TPGroup
from common.parallel.kv_shards import SharedKVShards
from common.parallel.plan import PlanChannel

logger = logging.getLogger(__name__)

_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds the `common` package


class RankDiedError(RuntimeError):
    """A tensor-parallel rank exited while the engine needed it."""


@dataclass(frozen=True)
class RankSpec:
    """What a rank process needs to build its shard; JSON on its command line."""

    rank: int
    size: int
    model_dir: str
    dtype: str  # resolved: float32, bfloat16, float16
    device: str
    max_model_len: int
    num_blocks: int
    block_size: int
    attention_backend: str | None
    enforce_eager: bool
    store_port: int
    cores: list[int]
    num_threads: int
    pin: bool  # to `cores`; else only the threads are set
    timeout: float
    parent_pid: int
    log_level: int
    kv_fd: int = -1  # its KV shard's shared file, made by rank 0 (kv_shards.py); -1: its own

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RankSpec:
        return cls(**json.loads(text))


class RankProcesses:
    def __init__(
        self, spec: RankSpec, timeout: float, main: str, shared: SharedKVShards | None = None
    ):
        """Start ranks 1..size-1 like `spec` (rank 0's), each `python -m main`; give the calling
        thread rank 0's share of the CPU budget (given back by `stop`). With `shared`, each
        rank's KV cache is its shard there."""
        self.shared = shared
        self.timeout = timeout
        self._store_server: dist.TCPStore | None = _loopback_store(spec.size, timeout)
        self.store = dist.TCPStore(
            "127.0.0.1",
            self._store_server.port,
            spec.size,
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout),
        )
        shares = split_budget(available_cores(), torch.get_num_threads(), spec.size)
        self._stopping = False
        self.procs: dict[int, subprocess.Popen] = {}
        for rank in range(1, spec.size):
            cores, threads = shares[rank]
            device = f"cuda:{rank}" if spec.device.startswith("cuda") else spec.device
            own = dataclasses.replace(
                spec,
                rank=rank,
                device=device,
                store_port=self.store.port,
                cores=sorted(cores),
                num_threads=threads,
                kv_fd=shared.fds[rank] if shared else -1,
            )
            self.procs[rank] = _spawn(own, main)
        self._thread_id = threading.get_native_id()
        self._restore = (os.sched_getaffinity(0), torch.get_num_threads())
        if spec.pin:  # this thread; the OpenMP threads it starts inherit it
            os.sched_setaffinity(0, shares[0][0])
        torch.set_num_threads(shares[0][1])
        logger.info(
            "tensor parallel: %d ranks; rank 0 is this engine thread (%d threads), ranks %s",
            spec.size,
            shares[0][1],
            ", ".join(f"{r}: pid {p.pid}" for r, p in self.procs.items()),
        )

    def connect(self, group: TPGroup, block_size: int) -> PlanChannel:
        """Wait until every rank holds its shard (failing if one exits), then join the group;
        returns rank 0's end of the plan channel."""
        deadline = time.monotonic() + self.timeout
        for rank, proc in self.procs.items():
            while not self.store.check([f"loaded/{rank}"]):
                status = proc.poll()
                if status is not None:
                    raise RankDiedError(
                        f"tensor-parallel rank {rank} exited with status {status} while "
                        "loading its shard (its log is above)"
                    )
                if time.monotonic() > deadline:
                    raise TimeoutError(f"tensor-parallel rank {rank} not ready in {self.timeout} s")
                time.sleep(0.02)
        group.connect(self.store, self.timeout)
        self.close_store()  # every rank has joined: the rendezvous is over
        if self.shared:
            self.shared.close_files()  # every rank has mapped its shard
        return PlanChannel(group, group.device, block_size)

    def close_store(self) -> None:
        """Stop the store's server: its port closes (the group's sockets stay)."""
        self._store_server = None

    @property
    def is_store_open(self) -> bool:
        return self._store_server is not None

    def kv_shards(self, kv_caches: list[torch.Tensor]) -> list[ShardTensors] | None:
        """Every rank's KV tensors, rank 0's being `kv_caches`; None unless shared."""
        return self.shared and [ShardTensors(0, kv_caches), *self.shared.shards]

    def watch(self, on_death: Callable[[RankDiedError], None]) -> None:
        """Call `on_death` (from a watcher thread) when a rank exits before `stop`."""
        for rank, proc in self.procs.items():
            threading.Thread(
                target=self._wait, args=(rank, proc, on_death), name=f"tp-rank{rank}", daemon=True
            ).start()

    def _wait(self, rank: int, proc: subprocess.Popen, on_death: Callable) -> None:
        status = proc.wait()
        if not self._stopping:
            logger.error("tensor-parallel rank %d (pid %d) exited: %s", rank, proc.pid, status)
            on_death(RankDiedError(f"tensor-parallel rank {rank} exited with status {status}"))

    @property
    def all_alive(self) -> bool:
        return all(proc.poll() is None for proc in self.procs.values())

    def stop(self, plans: PlanChannel | None) -> None:
        """Tell the ranks to stop through `plans` (when all are alive), reap them, kill what
        does not exit. With no `plans` (the engine failed: a collective may be half done),
        kill them at once."""
        self._stopping = True
        self.close_store()
        if plans is not None and self.all_alive:
            try:
                plans.stop(timeout=5.0)
            except RuntimeError as e:  # a rank died meanwhile: it is reaped below
                logger.warning("stopping tensor-parallel ranks: %s", e)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10 if plans is not None else 0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if threading.get_native_id() == self._thread_id:
            os.sched_setaffinity(0, self._restore[0])
            torch.set_num_threads(self._restore[1])


def start_ranks(
    config: EngineConfig,
    dtype: torch.dtype,
    max_model_len: int,
    num_blocks: int,
    main: str,
    share_kv_of: ArchConfig | None = None,
) -> RankProcesses:
    """Start the ranks of an engine (rank 0) built from `config`, each running the module
    `main` (the engine names its own: the rank's forward loop sits above this package); with
    `share_kv_of` (the model's architecture), their KV caches are shared with rank 0."""
    mc = config.model
    spec = RankSpec(
        rank=0,
        size=config.parallel.tensor_parallel_size,
        model_dir=str(mc.model_dir),
        dtype=str(dtype).removeprefix("torch."),
        device=mc.device,
        max_model_len=max_model_len,
        num_blocks=num_blocks,
        block_size=config.cache.block_size,
        attention_backend=mc.attention_backend,
        enforce_eager=mc.enforce_eager,
        store_port=0,
        cores=[],
        num_threads=1,
        pin=config.parallel.pin_ranks,
        timeout=config.parallel.tp_timeout,
        parent_pid=os.getpid(),
        log_level=logging.getLogger().getEffectiveLevel(),
    )
    shared = share_kv_of and SharedKVShards(
        share_kv_of, spec.size, num_blocks, spec.block_size, dtype
    )
    return RankProcesses(spec, config.parallel.tp_timeout, main, shared)


def _loopback_store(size: int, timeout: float) -> dist.TCPStore:
    """The rendezvous store's server, on a socket bound to 127.0.0.1: given a port alone,
    TCPStore listens on every interface."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return dist.TCPStore(
        "127.0.0.1",
        sock.getsockname()[1],
        size,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout),
        master_listen_fd=sock.detach(),
    )


def _spawn(spec: RankSpec, main: str) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", main, spec.to_json()]
    fds = [spec.kv_fd] if spec.kv_fd >= 0 else []
    return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, pass_fds=fds)
