"""Attention backends behind one ABC, chosen at run time.

`select_backend` prefers the flash backend when vllm-flash-attn imports and the device, dtype
and block size fit, and otherwise the pure-torch paged backend (any device, the reference).
"""

from __future__ import annotations

import logging

import torch

from common.attention.backends.base import AttentionBackend
from common.attention.backends.flash import FlashAttentionBackend
from common.attention.backends.torch_paged import TorchPagedBackend

logger = logging.getLogger(__name__)

BACKENDS: dict[str, type[AttentionBackend]] = {
    "flash": FlashAttentionBackend,
    "torch": TorchPagedBackend,
}


def select_backend(
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    name: str | None = None,
    compiled: bool = False,
) -> AttentionBackend:
    """`compiled`: the engine's compiled path (not --enforce-eager); the torch backend then
    runs decodes as one compiled kernel."""
    if name is not None:
        if name not in BACKENDS:
            raise ValueError(f"attention backend must be one of {sorted(BACKENDS)}, got {name!r}")
        why = BACKENDS[name].unsupported_reason(device, dtype, block_size)
        if why:
            raise ValueError(f"attention backend {name!r} cannot run here: {why}")
        backend = _torch(device, compiled) if name == "torch" else BACKENDS[name]()
    else:
        why = FlashAttentionBackend.unsupported_reason(device, dtype, block_size)
        backend = _torch(device, compiled) if why else FlashAttentionBackend()
        if why:
            logger.info("flash attention not used: %s", why)
    logger.info("attention backend: %s", backend.name)
    return backend


def _torch(device: torch.device, compiled: bool) -> TorchPagedBackend:
    """The compiled path on a CPU decodes with the C kernel (native_decode.py)."""
    return TorchPagedBackend(compiled, native=compiled and device.type == "cpu")


__all__ = ["AttentionBackend", "BACKENDS", "select_backend"]
