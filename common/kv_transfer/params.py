"""`kv_transfer_params`: the dict that travels P → proxy → D, with vLLM's NIXL field names.

A request to P carries `{"do_remote_decode": true}`; P answers with `RemotePrefill` (where D reads
the prompt's KV from); the proxy hands that to D. In push mode the request to P also carries
`push_to` (`PushTarget`: a reservation on D); P writes the KV there layer by layer and answers
with `push_reservation_id` instead of blocks to read. Extra fields ride along: `first_token_id` (P's
sampled first token, which D then treats as generated) and `first_token_streamed` (the proxy
already sent it to the client, so D's stream starts at the second token).

The reverse pull: a request to P may also carry `do_remote_prefill` with `prefix_only` and a
decode worker's blocks (`POST /internal/kv/lease` on D): the leading blocks of the prompt that D
holds from an earlier turn, which P reads instead of computing them; P computes the rest.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


class KVTransferParamsError(ValueError):
    pass


@dataclass(frozen=True)
class KVLoss:
    """Why a request's remote KV cannot be used: a metric label and a message for the client."""

    reason: str  # read_failed | lease_expired | checksum_mismatch | push_incomplete | ...
    message: str
    from_prefix: bool = False  # P's read of D's prefix (reverse pull): always recomputed

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class RemotePrefill:
    remote_engine_id: str
    remote_block_ids: list[int]
    remote_request_id: str
    remote_host: str
    remote_port: int
    tp_size: int = 1
    first_token_id: int | None = None
    first_token_streamed: bool = False
    push_reservation_id: str | None = None  # push mode: the KV was written into these blocks
    kv_checksums: list[list[int]] | None = None  # per layer, per block (--kv-checksum on P)
    read_by: float | None = None  # unix time (P's clock): reads must be done by then (lease)
    prefix_only: bool = False  # the blocks hold a prefix of the prompt: the rest is computed
    do_remote_prefill: bool = True

    @classmethod
    def parse(cls, raw: dict[str, Any], vocab_size: int | None = None) -> RemotePrefill:
        """Each field of its own type, or KVTransferParamsError: nothing is coerced (a float
        block id or a "false" string is refused, never rounded or taken as true); with
        `vocab_size`, a first token past the vocabulary is refused too."""
        top = None if vocab_size is None else vocab_size - 1
        try:
            return cls(
                remote_engine_id=_text(raw["remote_engine_id"]),
                remote_block_ids=_block_ids(raw["remote_block_ids"]),
                remote_request_id=_text(raw["remote_request_id"]),
                remote_host=_text(raw["remote_host"]),
                remote_port=_integer(raw["remote_port"], 0, 65535),  # 0: in-process, no HTTP
                tp_size=_integer(raw.get("tp_size", 1), 1),
                first_token_id=_optional(raw.get("first_token_id"), _integer, 0, top),
                first_token_streamed=_flag(raw.get("first_token_streamed", False)),
                push_reservation_id=_optional(raw.get("push_reservation_id"), _text),
                kv_checksums=_checksums(raw.get("kv_checksums")),
                read_by=_optional_float(raw.get("read_by")),
                prefix_only=_flag(raw.get("prefix_only", False)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise KVTransferParamsError(
                f"kv_transfer_params for a remote prefill are incomplete or malformed: {e!r}"
            ) from e

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def inconsistency(
        self, num_prompt_tokens: int, block_size: int, num_layers: int, peer_blocks: int | None
    ) -> KVLoss | None:
        """D, pull mode: why these blocks cannot hold this prompt's KV, or None. P sends one
        block per `block_size` prompt tokens, each in its pool, and (--kv-checksum) one
        checksum per block per layer; a list of any other length would decode over blocks
        that were never written, or check only some of them. A prefix (`prefix_only`, the
        reverse pull) is whole blocks that leave at least one prompt token to compute."""
        ids, expected = self.remote_block_ids, -(-num_prompt_tokens // block_size)
        if self.prefix_only:
            expected = min(len(ids), (num_prompt_tokens - 1) // block_size)
        if len(ids) != expected:
            why = f"{len(ids)} remote_block_ids for a prompt of {num_prompt_tokens} tokens"
            return KVLoss("remote_blocks_mismatch", f"{why} ({expected} blocks)")
        if peer_blocks is not None and any(b >= peer_blocks for b in ids):  # None: read fails
            why = f"remote_block_ids past the prefill worker's {peer_blocks} blocks"
            return KVLoss("remote_blocks_mismatch", why)
        sums = self.kv_checksums
        if sums is not None and (len(sums) != num_layers or any(len(c) != len(ids) for c in sums)):
            shape = f"{len(sums)} layers of {sorted({len(c) for c in sums})} blocks"
            why = f"kv_checksums for {shape}, not {num_layers} of {len(ids)}"
            return KVLoss("remote_blocks_mismatch", why)
        return None


def _text(raw: Any) -> str:
    if not isinstance(raw, str) or not raw:
        raise TypeError(f"expected a non-empty string, got {raw!r}")
    return raw


def _integer(raw: Any, low: int, high: int | None = None) -> int:
    if not isinstance(raw, int) or isinstance(raw, bool):
        raise TypeError(f"expected an integer, got {raw!r}")
    if raw < low or (high is not None and raw > high):
        raise ValueError(f"{raw} is out of range (from {low} to {high or 'any'})")
    return raw


def _flag(raw: Any) -> bool:
    if not isinstance(raw, bool):
        raise TypeError(f"expected true or false, got {raw!r}")
    return raw


def _optional(raw: Any, parse, *args) -> Any:
    return None if raw is None else parse(raw, *args)


def _block_ids(raw: Any) -> list[int]:
    if not isinstance(raw, list):
        raise TypeError(f"expected a list of block ids, got {raw!r}")
    ids = [_integer(b, 0) for b in raw]
    if len(set(ids)) != len(ids):
        raise ValueError("a block id appears twice in remote_block_ids")
    return ids


def _checksums(raw: Any) -> list[list[int]] | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(isinstance(layer, list) for layer in raw):
        raise TypeError("expected kv_checksums as a list (per layer) of lists (per block)")
    return [[_integer(c, 0) for c in layer] for layer in raw]


def _optional_float(raw: Any) -> float | None:
    if raw is None:
        return None
    if not isinstance(raw, int | float) or isinstance(raw, bool):
        raise TypeError(f"expected a number, got {raw!r}")
    value = float(raw)
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {raw!r}")
    return value


def wants_remote_decode(raw: dict[str, Any] | None) -> bool:
    return bool(raw) and bool(raw.get("do_remote_decode"))


def wants_remote_prefill(raw: dict[str, Any] | None) -> bool:
    return bool(raw) and bool(raw.get("do_remote_prefill"))


def without_prefix(raw: dict[str, Any]) -> dict[str, Any]:
    """P: the params less a decode worker's prefix to read (it cannot be: computed instead)."""
    return {**raw, "do_remote_prefill": False}


@dataclass(frozen=True)
class PushTarget:
    """Push mode: where P writes a prompt's KV (a decode worker's reservation)."""

    engine_id: str
    reservation_id: str
    block_ids: list[int]
    host: str
    port: int
    write_by: float | None = None  # unix time (D's clock): writes must have landed by then
    num_held_blocks: int = 0  # leading blocks D has cached: P writes only those after them

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> PushTarget:
        try:
            block_ids = _block_ids(raw["block_ids"])
            return cls(
                engine_id=_text(raw["engine_id"]),
                reservation_id=_text(raw["reservation_id"]),
                block_ids=block_ids,
                host=_text(raw["host"]),
                port=_integer(raw["port"], 0, 65535),
                write_by=_optional_float(raw.get("write_by")),
                # at least the last block is P's to write: its logits give the first token
                num_held_blocks=_integer(
                    raw.get("num_held_blocks", 0), 0, max(0, len(block_ids) - 1)
                ),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise KVTransferParamsError(
                f"kv_transfer_params.push_to is incomplete or malformed: {e!r}"
            ) from e

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def push_target(raw: dict[str, Any] | None) -> PushTarget | None:
    if not wants_remote_decode(raw) or not raw.get("push_to"):
        return None
    return PushTarget.parse(raw["push_to"])
