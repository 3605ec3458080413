"""Two processes on two GPUs, as docker-compose runs P and D: does their KV move over cuda_ipc?

P and D are `ChildEngine`s, each started with `CUDA_VISIBLE_DEVICES` naming one GPU, the other
GPU left to the driver: the shape deploy/compose.py gives each worker container (it sees every
worker's GPU and runs on its own). Each prompt is pulled and pushed (`pd.compare`: same tokens
as colocated, KV really moved, every block back); then each side's own UCX report
(common/kv_transfer/nixl/transport_info.py): D's READs from P and P's WRITEs to D must use
`cuda_ipc`, and neither `tcp` nor "unknown" (a transport UCX did not name). GB/s, end to end:
the bytes D loaded over the seconds its loads took (pull, from the READ issued to the KV
landed), and the bytes P pushed over the seconds from each request's first WRITE to its last
landing (push, overlapped with P's prefill).

`--device cpu` runs the same with both processes on the CPU: it checks the script. There the
transports (cma, or tcp where a seccomp profile blocks cma) are reported, not asserted.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from tests.gpu.engines import ChildEngine, EngineSpec
from tests.gpu.pd import compare

EXPECTED = "cuda_ipc"


@contextmanager
def child_pair(spec: EngineSpec, gpus: tuple[str | None, str | None]) -> Iterator[tuple]:
    """(P, D) in processes of their own, each seeing only its `gpus` entry (None: all)."""
    sides: list[ChildEngine] = []
    try:
        for role, gpu in zip(("prefill", "decode"), gpus, strict=True):
            env = {} if gpu is None else {"CUDA_VISIBLE_DEVICES": gpu}
            sides.append(ChildEngine(spec, role, env=env, wait=False))
        for side in sides:  # both build their engines at once
            side.ready()
        p, d = sides
        p.add_peer(*d.peer_info())
        d.add_peer(*p.peer_info())
        yield p, d
    finally:
        for side in reversed(sides):
            side.close()


def measure(
    spec: EngineSpec, make_prompts: Callable[[int], list[list[int]]], max_tokens: int
) -> dict:
    """Pull and push between two processes (two GPUs on CUDA) and the transports they used."""
    on_cuda = spec.device == "cuda"
    if on_cuda and torch.cuda.device_count() < 2:
        return {
            "status": "skipped",
            "reason": f"needs two GPUs (P on one, D on the other, a process each); "
            f"{torch.cuda.device_count()} visible here",
        }
    gpus = _two_gpus() if on_cuda else (None, None)
    with child_pair(spec, gpus) as (p, d):
        prompts = make_prompts(p.describe()["vocab_size"])
        before = p.stats(), d.stats()
        pd = compare(p, d, prompts, max_tokens)
        after = p.stats(), d.stats()
        reads, writes = d.transports(), p.transports()
    problems = _problems("D's READs", reads, on_cuda) + _problems("P's WRITEs", writes, on_cuda)
    return {
        "status": "passed" if pd["status"] == "passed" and not problems else "failed",
        "cuda_visible_devices": {"prefill": gpus[0], "decode": gpus[1]},
        "expected": EXPECTED if on_cuda else None,
        "reads": reads,  # D → P, as D's UCX reported them
        "writes": writes,  # P → D, as P's UCX reported them
        "problems": problems,
        "pull_gbps": _gbps(before[1], after[1], "bytes_loaded", "seconds_loading"),
        "push_gbps": _gbps(before[0], after[0], "bytes_pushed", "push_seconds"),
        "pd": pd,
    }


def _two_gpus() -> tuple[str, str]:
    """The first two GPUs this process may use, as the children's CUDA_VISIBLE_DEVICES."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    first, second = visible.split(",")[:2] if visible else ("0", "1")
    return first.strip(), second.strip()


def _problems(who: str, seen: dict[str, dict], on_cuda: bool) -> list[str]:
    """On CUDA: cuda_ipc, no tcp (staging through host memory); anywhere: a transport UCX named."""
    if not seen:
        return [f"{who}: no transport reported"]
    wrong = {"tcp", "unknown"} if on_cuda else {"unknown"}
    return [
        f"{who} with {peer}: {report}"
        for peer, report in seen.items()
        if (on_cuda and EXPECTED not in report["transports"]) or wrong & set(report["transports"])
    ]


def _gbps(before: dict, after: dict, num_bytes: str, seconds: str) -> float | None:
    moved, took = after[num_bytes] - before[num_bytes], after[seconds] - before[seconds]
    return round(moved / took / 1e9, 3) if took > 0 else None
