"""A NIXL peer in its own process for transport tests: serves a KV cache, answers over a Pipe.

`PeerProcess.start(engine_id, seed)` spawns it; its KV cache is `make_kv(seed)`, so a test can
compute the bytes the peer holds. `call(cmd, *args)` runs one command in the peer (see `_serve`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from collections.abc import Sequence

import torch

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 3, 16, 16, 2, 16  # 1 KiB fp16 blocks


def make_kv(seed: int | None) -> list[torch.Tensor]:
    """Per-layer fp16 KV tensors, shape (2, NUM_BLOCKS, ...); zeros if no seed."""
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    if seed is None:
        return [torch.zeros(shape, dtype=torch.float16) for _ in range(NUM_LAYERS)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).half() for _ in range(NUM_LAYERS)]


def block_bytes(kv: list[torch.Tensor], layer: int, blocks: Sequence[int]) -> bytes:
    """The K then V bytes of `blocks` in `layer`, in the order given."""
    return kv[layer][:, list(blocks)].contiguous().numpy().tobytes()


class PeerProcess:
    def __init__(self, engine_id: str, seed: int | None) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, engine_id, seed), daemon=True)
        self.proc.start()
        child.close()
        self._hello: tuple[dict, bytes] | None = None

    @classmethod
    def start(cls, engine_id: str, seed: int | None = None) -> PeerProcess:
        return cls(engine_id, seed)

    def hello(self, timeout: float = 60.0) -> tuple[dict, bytes]:
        """(layout dict, agent metadata) the peer sends once its transport is up."""
        if self._hello is None:
            if not self.conn.poll(timeout):
                raise TimeoutError("NIXL peer did not start")
            self._hello = self.conn.recv()
        return self._hello

    def call(self, cmd: str, *args: object, timeout: float = 10.0) -> object:
        self.conn.send((cmd, *args))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"NIXL peer did not answer {cmd!r}")
        return self.conn.recv()

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGCONT)  # a stopped process dies only once resumed
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


def _serve(conn, engine_id: str, seed: int | None) -> None:
    """Peer main: commands add_peer, send_notif, notifs, blocks, exit; collects notifs meanwhile."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from common.kv_transfer.nixl.transport import KVLayout, NixlTransport

    kv = make_kv(seed)
    transport = NixlTransport(engine_id, kv)
    conn.send((transport.layout.to_dict(), transport.metadata()))
    notifs: list[bytes] = []
    while True:
        if not conn.poll(0.01):
            notifs += transport.get_notifs()
            continue
        cmd, *args = conn.recv()
        if cmd == "exit":
            break
        if cmd == "add_peer":
            reply = transport.add_peer(KVLayout.from_dict(args[0]), args[1])
        elif cmd == "send_notif":
            reply = transport.send_notif(*args)
        elif cmd == "notifs":
            reply, notifs = notifs + transport.get_notifs(), []
        elif cmd == "blocks":
            reply = block_bytes(kv, *args)
        else:
            reply = ValueError(f"unknown command {cmd!r}")
        conn.send(reply)
    transport.close()
