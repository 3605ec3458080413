"""The prefix-cache key: what a full block of KV is cached and found under.

A block's hash is a SHA-256 over its parent's hash (32 bytes) and its token ids (int32,
little-endian), so it covers every token before it: a hit on block i implies hits on blocks
0..i-1. The parent of a sequence's first block is its root, a hash of everything else that
changes the KV those tokens produce:

- the model's identity (`namespace`; in a worker the compatibility hash two workers compare
  before moving KV, common/kv_transfer/handshake.py: the weights, dtype and KV layout),
- the LoRA adapter (none served yet: the slot is there so that adding one cannot collide),
- the request's `cache_salt` (vLLM's per-request field): two salts never share a block, and no
  salt is today's sharing between every request of the model.

The root's fields are tagged and length-prefixed (a salt can never pass for an adapter name, as
in vLLM's issue #44701), under a personalized BLAKE2b, a different function from the blocks'
SHA-256. A key is a cryptographic hash of a canonical byte encoding: it is the same in every
process and on every machine (no `hash()`, no PYTHONHASHSEED), and nobody can make a block of
theirs pass for another prefix's (vLLM's GHSA-rm76-4mrf-v9r8 was a 64-bit `hash()`).

`salt_tag` is what KV events carry for a salted chain (common/kv_cache/events.py) instead of
the salt itself, so that a reader of the events learns which blocks share a salt, never the
salt that would let it hit them.
"""

from __future__ import annotations

import hashlib
import struct

BlockHash = bytes  # 32 bytes
NO_PARENT = bytes(32)  # the parent of a chain hashed without a root (tests, benchmarks)
_ROOT_PERSON = b"pdserve.kvroot1"
_SALT_PERSON = b"pdserve.salt1"


def root_hash(namespace: str, cache_salt: str | None = None, lora_name: str | None = None) -> bytes:
    """The parent of a sequence's first block. `namespace`: the model's identity."""
    h = hashlib.blake2b(digest_size=32, person=_ROOT_PERSON)
    for tag, value in ((b"m", namespace), (b"l", lora_name), (b"s", cache_salt)):
        data = b"" if value is None else value.encode()
        h.update(tag + (b"-" if value is None else b"+") + len(data).to_bytes(8, "little") + data)
    return h.digest()


def salt_tag(cache_salt: str) -> str:
    """Names a salt without revealing it (KV events, routing)."""
    return hashlib.blake2b(cache_salt.encode(), digest_size=16, person=_SALT_PERSON).hexdigest()


def hash_block(parent: bytes | None, token_ids: list[int] | tuple[int, ...]) -> bytes:
    """One block's key; `parent` None: NO_PARENT."""
    return hashlib.sha256((parent or NO_PARENT) + _token_bytes(token_ids)).digest()


def chain_hashes(
    token_ids: list[int], block_size: int, hashes: list[bytes], root: bytes
) -> list[bytes]:
    """`hashes` (a chain from `root` over the first blocks of `token_ids`) extended over every
    full block; `root` is the first block's parent (unread once `hashes` holds that block)."""
    start, end = len(hashes), len(token_ids) // block_size
    if start >= end:
        return hashes
    data = _token_bytes(token_ids[start * block_size : end * block_size])
    step, parent, sha256 = 4 * block_size, hashes[-1] if hashes else root, hashlib.sha256
    for offset in range(0, len(data), step):
        parent = sha256(parent + data[offset : offset + step]).digest()
        hashes.append(parent)
    return hashes


def _token_bytes(token_ids) -> bytes:
    """int32, little-endian (token ids are < vocab size); struct.error: not a token id."""
    return struct.pack(f"<{len(token_ids)}i", *token_ids)  # ~3x faster than array's
