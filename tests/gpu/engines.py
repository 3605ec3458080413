"""A prefill (P) or decode (D) engine with a NIXL connector, driven at the engine level (no HTTP).

`EngineSide` wraps one `LLMEngine`: run requests to completion, reserve push targets, report
transfer stats, the UCX transports its transfers used and whether every block came back.
`ChildEngine` runs one in a child process behind the same methods, for when two NIXL agents in
one process cannot reach each other (over VRAM that depends on the UCX transports), or to give
it an environment of its own (`CUDA_VISIBLE_DEVICES`). Values cross as plain dicts and lists.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from common.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, TransferConfig
from common.engine.engine import LLMEngine
from common.engine.sampling_params import SamplingParams
from common.kv_transfer.nixl import transport_info


@dataclass(frozen=True)
class EngineSpec:
    model: str | None  # None: the default model (SmolLM2)
    device: str
    dtype: str
    max_model_len: int
    max_num_batched_tokens: int = 2048
    num_blocks: int | None = None
    kv_checksum: bool = False
    load_timeout: float = 20.0

    def config(self, role: str) -> EngineConfig:
        # NOTE: no prefix caching: a local hit on D would skip the very reads under test, and
        # policy "fail": a lost transfer must show as an error, never as a silent recompute.
        # Eager: these parts check transfers; the compiled path, never run on CUDA yet, is
        # measured (and its failure reported) by the speed part alone
        return EngineConfig(
            model=ModelConfig(
                self.model, self.device, self.dtype, self.max_model_len, enforce_eager=True
            ),
            cache=CacheConfig(num_blocks=self.num_blocks, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_batched_tokens=self.max_num_batched_tokens),
            transfer=TransferConfig(
                connector="nixl",
                engine_id=f"{role}-{uuid.uuid4().hex[:8]}",
                load_timeout=self.load_timeout,
                failure_policy="fail",
                kv_checksum=self.kv_checksum,
            ),
        )


@dataclass(frozen=True)
class Job:
    request_id: str
    prompt: list[int]
    max_tokens: int
    kv_transfer_params: dict | None = None


class EngineSide:
    def __init__(self, spec: EngineSpec, role: str):
        self.engine = LLMEngine(spec.config(role))
        self.connector = self.engine.connector

    def describe(self) -> dict:
        backend = next(iter(self.engine.model.attention_layers().values())).backend
        return {"backend": backend.name, "vocab_size": self.engine.arch.vocab_size}

    def peer_info(self) -> tuple[dict, bytes]:
        info = self.connector.peer_info()
        return info.layout, info.metadata

    def add_peer(self, layout: dict, metadata: bytes) -> None:
        self.connector.add_peer(layout, metadata)

    def reserve(self, num_tokens: int) -> dict:
        """A push target on this (decode) engine, as /internal/kv/reserve answers it."""
        res = self.connector.reserve(num_tokens)
        return {
            "engine_id": self.engine.config.transfer.engine_id,
            "reservation_id": res.reservation_id,
            "block_ids": [b.block_id for b in res.blocks],
            "host": "127.0.0.1",
            "port": 0,
            "write_by": res.write_by,
        }

    def run(self, jobs: list[Job], timeout: float = 120.0) -> dict[str, dict]:
        """Greedy, EOS ignored: every job to completion → {id: {token_ids, error, kv params}}.
        Pushed jobs are added once all their KV has landed, so they start in the same step."""
        deadline = time.monotonic() + timeout
        self._await_pushes(jobs, deadline)
        for job in jobs:
            params = SamplingParams(max_tokens=job.max_tokens, temperature=0, ignore_eos=True)
            self.engine.add_request(job.request_id, job.prompt, params, job.kv_transfer_params)
        done: dict[str, dict] = {}
        while len(done) < len(jobs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(jobs) - len(done)} requests unfinished after {timeout}s")
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = {
                        "token_ids": list(out.outputs[0].token_ids),
                        "error": out.error,
                        "kv_transfer_params": out.kv_transfer_params,
                    }
        return done

    def _await_pushes(self, jobs: list[Job], deadline: float) -> None:
        params = [job.kv_transfer_params or {} for job in jobs]
        ids = [rid for p in params if (rid := p.get("push_reservation_id"))]
        while any(self.connector.reservation_state(rid) == "pending" for rid in ids):
            if time.monotonic() > deadline:
                return  # the engine's own deadline then fails them, which is what we report
            self.engine.poll_transfers()
            time.sleep(0.001)

    def stats(self) -> dict:
        """The connector's totals (its stats snapshot) under the names the check reports."""
        s = self.connector.stats_snapshot()
        return {
            "num_loads": s.num_loads,
            "num_failed": s.num_load_failures,
            "bytes_loaded": s.num_bytes_loaded,
            "seconds_loading": s.seconds_loading,
            "bytes_pushed": s.num_bytes_pushed,
            "num_push_failures": s.num_push_failures,
            "push_seconds": s.seconds_pushing,
            "num_checksum_failures": s.num_checksum_failures,
        }

    def transports(self) -> dict[str, dict]:
        """{peer agent: the UCX transports, and what UCX printed for each op} of the READs and
        WRITEs this process initiated."""
        details = transport_info.details()
        return {
            peer: {"transports": sorted(used), **details.get(peer, {})}
            for peer, used in transport_info.snapshot().items()
        }

    def settle(self, timeout: float = 10.0) -> bool:
        """Poll until no lease or reservation is left; True when every block is free again."""
        deadline = time.monotonic() + timeout
        while self.engine.has_pending_transfers() and time.monotonic() < deadline:
            self.engine.poll_transfers()
            time.sleep(0.005)
        return self.engine.pool.is_all_free

    def slow_down(self, cycles: int) -> None:
        """Queue a GPU sleep before every attention call, so the compute stream runs behind the
        host: a KV transfer not ordered after `write_kv` would then read blocks not yet written."""
        backend = next(iter(self.engine.model.attention_layers().values())).backend
        forward = backend.forward

        def delayed(*args, **kwargs):
            torch.cuda._sleep(cycles)
            return forward(*args, **kwargs)

        backend.forward = delayed

    def close(self) -> None:
        self.connector.close()


class ChildEngine:
    """An `EngineSide` in a spawned process; its methods are called over a pipe."""

    def __init__(
        self,
        spec: EngineSpec,
        role: str,
        timeout: float = 300.0,
        env: dict | None = None,
        wait: bool = True,
    ):
        """`wait=False`: return once the child is started; `ready()` waits for its engine (so
        that two children build theirs at the same time)."""
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._timeout = timeout
        self._proc = ctx.Process(target=_serve, args=(child, spec, role), daemon=True)
        with _environ(env or {}):  # the child starts with it, before CUDA or UCX load
            self._proc.start()
        if wait:
            self.ready()

    def ready(self) -> ChildEngine:
        """Wait until the child's engine is built (raises what building it raised)."""
        self._receive()
        return self

    def __getattr__(self, name: str) -> Any:
        def call(*args):
            self._conn.send((name, args))
            return self._receive()

        return call

    def _receive(self) -> Any:
        if not self._conn.poll(self._timeout):
            raise TimeoutError(f"child engine silent for {self._timeout}s")
        ok, value = self._conn.recv()
        if not ok:
            raise RuntimeError(f"in the child engine: {value}")
        return value

    def close(self) -> None:
        try:
            if self._proc.is_alive():  # not one whose engine failed to build (it has exited)
                self._conn.send(("close", ()))
                self._receive()
        finally:
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()


@contextmanager
def _environ(env: dict) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _serve(conn, spec: EngineSpec, role: str) -> None:
    try:
        side = EngineSide(spec, role)
    except Exception as e:  # noqa: BLE001 — reported to the parent, which raises it
        conn.send((False, f"{type(e).__name__}: {e}"))
        return
    conn.send((True, None))
    while True:
        name, args = conn.recv()
        try:
            conn.send((True, getattr(side, name)(*args)))
        except Exception as e:  # noqa: BLE001 — reported to the parent, which raises it
            conn.send((False, f"{type(e).__name__}: {e}"))
        if name == "close":
            return
