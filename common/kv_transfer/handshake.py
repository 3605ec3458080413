"""What two workers check before moving KV: the same model, dtype, KV layout and protocol.

`compat_hash` covers the model's identity (config.json and the weight files' names and sizes),
the dtype, the KV layout (layers, KV heads, head dim, block size) and the protocol version. A
worker serves `HandshakeInfo` on `GET /internal/kv/handshake`; a peer whose hash differs is
refused with a message that names what differs.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel

if TYPE_CHECKING:
    from common.arch_config import ArchConfig
    from common.config import EngineConfig

PROTOCOL_VERSION = 3  # 2: push notifications per chunk (nixl/reservations.py); 3: TP shards


class HandshakeInfo(BaseModel):
    engine_id: str
    protocol_version: int
    compat_hash: str
    compat: dict  # the inputs of the hash, to say what differs
    layout: dict  # KVLayout.to_dict()
    agent_metadata: str  # base64

    def metadata_bytes(self) -> bytes:
        return base64.b64decode(self.agent_metadata)


def compat_fields(
    model_dir: Path, dtype: str, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int
) -> dict:
    return {
        "model": model_identity(Path(model_dir)),
        "dtype": dtype,
        "num_layers": num_layers,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "block_size": block_size,
        "protocol_version": PROTOCOL_VERSION,
    }


def local_compat(config: EngineConfig, arch: ArchConfig) -> dict:
    """This worker's compat fields. Reads the model folder the first time (blocking)."""
    return compat_fields(
        config.model.model_dir,
        str(config.model.torch_dtype),
        arch.num_layers,
        arch.num_kv_heads,
        arch.head_dim,
        config.cache.block_size,
    )


@functools.cache
def model_identity(model_dir: Path) -> str:
    """A hash of config.json and the weight files' names and sizes. Read once per folder (file
    I/O): a running worker serves the weights it loaded, even if the folder changes later."""
    config = (model_dir / "config.json").read_bytes()
    weights = sorted((p.name, p.stat().st_size) for p in model_dir.glob("*.safetensors"))
    return hashlib.sha256(config + json.dumps(weights).encode()).hexdigest()[:16]


def compat_hash(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def explain_mismatch(ours: dict, theirs: dict) -> str:
    diffs = [
        f"{k}: {theirs.get(k)!r} there, {ours.get(k)!r} here"
        for k in sorted(ours)
        if ours.get(k) != theirs.get(k)
    ]
    return "; ".join(diffs) or "the compatibility hashes differ"


def encode_metadata(metadata: bytes) -> str:
    return base64.b64encode(metadata).decode()
