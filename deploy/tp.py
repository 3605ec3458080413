"""Tensor parallelism in the launchers: each role's `--tensor-parallel-size`, and where it may go.

A worker started with `--tensor-parallel-size N` (docs/design.md, "Tensor parallelism") runs N
ranks: N GPUs, or N runs of its cores. On CPU its KV moves to and from workers of any TP size
(docs/design.md, "KV between TP sizes"), so P and D may differ. On CUDA it has no P/D KV
transfer yet: it defaults to `--kv-connector none` and refuses nixl (common/config.py). So for
GPU workers the launchers (deploy/local.py with `-- --device cuda`, deploy/compose.py without
`--cpu`) take `--prefill-tp N` and `--decode-tp N` only with `--mode colocated`, where decode
workers serve whole requests, and exit 2 otherwise, rather than start or write workers that
fail at start-up.
"""

from __future__ import annotations

from collections.abc import Callable

ROLES = ("prefill", "decode")


def add_tp_args(add: Callable, default: int | None = 1) -> None:
    """`--prefill-tp N` and `--decode-tp N` on a parser (`add`: its add_argument)."""
    for role in ROLES:
        add(
            f"--{role}-tp",
            type=int,
            default=default,
            metavar="N",
            help=f"each {role} worker's --tensor-parallel-size (default 1); on GPUs N > 1 "
            "needs --mode colocated: no P/D KV transfer between CUDA workers at TP > 1 yet",
        )


def check_tensor_parallel(mode: str, tp: dict[str, int], is_cuda: bool) -> None:
    """Each role's tensor-parallel size against the mode and device; raises ValueError."""
    for role, size in tp.items():
        if size < 1:
            raise ValueError(f"--{role}-tp must be >= 1, got {size}")
    flags = " and ".join(f"--{role}-tp {size}" for role, size in tp.items() if size > 1)
    if flags and mode != "colocated" and is_cuda:
        raise ValueError(
            f"{flags} with --mode {mode} on GPUs: P/D KV transfer between CUDA workers needs "
            "tensor parallelism 1 for now (a CUDA worker with --tensor-parallel-size > 1 has no "
            "KV connector); serve a TP worker colocated: --mode colocated (e.g. --prefill 0 "
            "--decode-tp N)"
        )


def is_cuda(worker_args: tuple[str, ...] | list[str]) -> bool:
    """Whether the workers' own arguments put them on CUDA (`--device cuda[:N]`)."""
    args = list(worker_args)
    for i, arg in enumerate(args):
        value = arg.split("=", 1)[1] if arg.startswith("--device=") else None
        if arg == "--device" and i + 1 < len(args):
            value = args[i + 1]
        if value is not None and value.startswith("cuda"):
            return True
    return False


def tp_args(size: int) -> list[str]:
    """The worker's flag; none at 1, the workers' default."""
    return ["--tensor-parallel-size", str(size)] if size > 1 else []
