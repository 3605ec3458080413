"""A tensor-parallel rank other than 0: one shard of the weights and of every layer's KV cache,
and a loop that runs the forward of each step rank 0 broadcasts.

    python -m common.engine.rank_main '<RankSpec as JSON>'   (started by parallel/launch.py)

It lives beside the engine, not in parallel/: a rank runs a model forward (compiled or eager)
as the engine does, and parallel/ stays the plumbing the engine stands on.

The rank samples nothing and owns no block table: the plan (plan.py) says which tokens, slots
and blocks the step touches, the forward's all-reduces keep every rank's hidden states equal,
and the rank's share of the logits goes to rank 0. It exits 0 when rank 0 says stop, 1 when
something fails (rank 0 gone included), and is killed with the engine thread that started it.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import sys

import torch
import torch.distributed as dist

from common.attention.backends import select_backend
from common.attention.context import ForwardContext, forward_context
from common.cpu import pin_process, set_torch_threads
from common.engine.compiled import CompiledModel
from common.kv_cache.tensors import allocate_kv_caches
from common.model.loader import load_model
from common.parallel.group import TPGroup
from common.parallel.kv_shards import map_shard, shard_shape
from common.parallel.launch import RankSpec
from common.parallel.plan import PlanChannel
from common.parallel.shard import TPShard
from common.processes import die_with_parent

logger = logging.getLogger(__name__)


def serve(spec: RankSpec) -> None:
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = getattr(torch, spec.dtype)
    group = TPGroup(TPShard(spec.rank, spec.size), device)
    timeout = datetime.timedelta(seconds=spec.timeout)
    store = dist.TCPStore("127.0.0.1", spec.store_port, spec.size, False, timeout=timeout)
    model = load_model(spec.model_dir, dtype, device, spec.max_model_len, group)
    compiled = not spec.enforce_eager
    backend = select_backend(device, dtype, spec.block_size, spec.attention_backend, compiled)
    layers = model.attention_layers()
    for layer in layers.values():
        layer.backend = backend
    if spec.kv_fd >= 0:  # rank 0 moves this rank's KV over NIXL: its shard is shared with it
        shape = shard_shape(model.config, spec.num_blocks, spec.block_size)
        kv_caches = map_shard(spec.kv_fd, shape, dtype)
        os.close(spec.kv_fd)
    else:
        kv_caches = allocate_kv_caches(
            model.config, spec.num_blocks, spec.block_size, dtype, device
        )
    forward = CompiledModel(model, device, dtype) if compiled else model
    if compiled:
        backend.warm_up(kv_caches, model.config.num_heads)
    store.set(f"loaded/{spec.rank}", "1")
    group.connect(store, spec.timeout)
    plans = PlanChannel(group, device, spec.block_size)
    kv = dict(zip(layers, kv_caches))
    logger.info("tensor-parallel rank %d of %d ready", spec.rank, spec.size)
    with torch.inference_mode():
        while (plan := plans.receive()) is not None:
            with forward_context(ForwardContext(plan.attn_metadata, layers, kv)):
                hidden = forward(plan.input_ids, plan.positions)
            if plan.logits_indices.numel():
                model.compute_logits(hidden[plan.logits_indices])


def main(argv: list[str]) -> int:
    spec = RankSpec.from_json(argv[1])
    logging.basicConfig(
        level=spec.log_level,
        format=f"%(asctime)s %(levelname)s tp-rank{spec.rank} %(name)s: %(message)s",
    )
    die_with_parent(spec.parent_pid, signal.SIGKILL)  # a step may be half done: no grace
    if spec.pin:
        pin_process(frozenset(spec.cores))
    set_torch_threads(spec.num_threads)
    try:
        serve(spec)
    except Exception:  # noqa: BLE001 — the status tells rank 0; the trace tells the operator
        logger.exception("tensor-parallel rank %d failed", spec.rank)
        return 1
    return 0


if __name__ == "__main__":
    status = main(sys.argv)
    logging.shutdown()
    # NOTE: os._exit, not sys.exit: gloo's threads met in the interpreter's teardown aborted
    # the process now and then ("terminate called without an active exception", status -6)
    os._exit(status)
