"""Tensor parallelism in the launchers: each role's `--tensor-parallel-size`, and where it may go.

A worker started with `--tensor-parallel-size N` (docs/design.md, "Tensor parallelism") runs N
ranks: N GPUs, or N runs of its cores. It has no P/D KV transfer yet: it defaults to
`--kv-connector none` and refuses nixl (common/config.py). So the launchers (deploy/local.py,
deploy/compose.py) take `--prefill-tp N` and `--decode-tp N` only with `--mode colocated`, where
decode workers serve whole requests, and exit 2 otherwise, rather than start or write workers
that fail at start-up.
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
            help=f"each {role} worker's --tensor-parallel-size (default 1); N > 1 needs "
            "--mode colocated: no P/D KV transfer at TP > 1 yet",
        )


def check_tensor_parallel(mode: str, tp: dict[str, int]) -> None:
    """Each role's tensor-parallel size against the mode; raises ValueError."""
    for role, size in tp.items():
        if size < 1:
            raise ValueError(f"--{role}-tp must be >= 1, got {size}")
    flags = " and ".join(f"--{role}-tp {size}" for role, size in tp.items() if size > 1)
    if flags and mode != "colocated":
        raise ValueError(
            f"{flags} with --mode {mode}: P/D KV transfer needs tensor parallelism 1 for now "
            "(a worker with --tensor-parallel-size > 1 has no KV connector); serve a TP worker "
            "colocated: --mode colocated (e.g. --prefill 0 --decode-tp N)"
        )


def tp_args(size: int) -> list[str]:
    """The worker's flag; none at 1, the workers' default."""
    return ["--tensor-parallel-size", str(size)] if size > 1 else []
