"""One rank's end of the tensor-parallel group: the collectives a step needs, each timed.

Two torch.distributed groups over one TCPStore that rank 0 hosts (on loopback, closed once
`connect` has returned on rank 0):
- the plan group (gloo, CPU tensors): rank 0 broadcasts each step's plan (`plan.py`);
- the model group (NCCL on CUDA; on CPU the plan group itself): the all-reduces after the
  row-parallel layers and the vocab-parallel embedding, and the gather of the vocab-sharded
  logits onto rank 0, the only rank that samples.
The groups are backend objects the engine owns, not torch.distributed's global default group,
so one process may hold several engines (tests run TP 1 and 2 side by side).

Under torch.compile an all-reduce is the custom op `pdserve::tp_all_reduce(x, group_id)`,
opaque to the compiler like attention: a compiled decoder layer keeps its two all-reduces as
graph nodes, run in Python at run time.

`stats` sums the wall time this rank spends in each kind of collective. On CPU that includes
waiting for the slowest rank to arrive; on CUDA it is only the launch (NCCL is asynchronous).
"""

from __future__ import annotations

import datetime
import itertools
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from common.parallel.shard import TPShard

_GROUPS: dict[int, TPGroup] = {}  # by id: how the compiled graph's op finds its group
_ids = itertools.count()


@dataclass
class CollectiveStats:
    """Calls and seconds per collective kind (all_reduce, broadcast, gather)."""

    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def add(self, kind: str, seconds: float) -> None:
        self.calls[kind] += 1
        self.seconds[kind] += seconds

    def reset(self) -> None:
        self.calls.clear()
        self.seconds.clear()


class TPGroup:
    """Created unconnected (the model is built with it while the other ranks still load);
    `connect(store)` joins the process groups."""

    def __init__(self, shard: TPShard, device: torch.device):
        self.shard = shard
        self.device = device
        self.stats = CollectiveStats()
        self._plan_pg: dist.ProcessGroup | None = None
        self._model_pg: dist.ProcessGroup | None = None
        self.id = next(_ids)
        _GROUPS[self.id] = self

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.size

    def connect(self, store: dist.Store, timeout: float) -> None:
        """Join the groups (blocks until every rank has called it)."""
        wait = datetime.timedelta(seconds=timeout)
        gloo = dist.ProcessGroupGloo._Options()
        gloo._timeout = wait
        # NOTE: by default gloo listens on the address the host's name resolves to; the ranks
        # share a host, so loopback does
        gloo._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        self._plan_pg = dist.ProcessGroupGloo(
            dist.PrefixStore("plan", store), self.rank, self.size, gloo
        )
        self._model_pg = self._plan_pg
        if self.device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = wait
            store = dist.PrefixStore("model", store)
            self._model_pg = dist.ProcessGroupNCCL(store, self.rank, self.size, options)
        # every rank past its rendezvous (NCCL's is lazy: its first collective): rank 0 may
        # close the store once its own connect returns
        self.all_reduce_(torch.zeros(1, device=self.device))
        self.stats.reset()

    def close(self) -> None:
        self._plan_pg = self._model_pg = None
        _GROUPS.pop(self.id, None)

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns it."""
        start = time.perf_counter()
        self._model_pg.allreduce([x]).wait()
        self.stats.add("all_reduce", time.perf_counter() - start)
        return x

    def broadcast_(self, x: torch.Tensor, timeout: float | None = None) -> torch.Tensor:
        """Rank 0's CPU tensor `x` into every rank's `x` (the plan group); `timeout` overrides
        the group's (a rank waits for the next step as long as it takes)."""
        start = time.perf_counter()
        wait = None if timeout is None else datetime.timedelta(seconds=timeout)
        self._plan_pg.broadcast(x, 0, wait).wait()
        self.stats.add("broadcast", time.perf_counter() - start)
        return x

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor | None:
        """Every rank's (N, V/size) logits → (N, V/size · size) on rank 0; None elsewhere."""
        start = time.perf_counter()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        shards = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else []
        self._model_pg.gather([shards] if shards else [], [local.contiguous()], opts).wait()
        self.stats.add("gather", time.perf_counter() - start)
        return torch.cat(shards, dim=-1) if shards else None


def all_reduce(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """Sum `x` over the group's ranks: in place in eager mode, through the opaque op when
    compiling."""
    if torch.compiler.is_compiling():
        return torch.ops.pdserve.tp_all_reduce(x, group.id)
    return group.all_reduce_(x)


@torch.library.custom_op("pdserve::tp_all_reduce", mutates_args=())
def _all_reduce_op(x: torch.Tensor, group_id: int) -> torch.Tensor:
    return _GROUPS[group_id].all_reduce_(x.clone())


@_all_reduce_op.register_fake
def _(x, group_id):
    return torch.empty_like(x)
