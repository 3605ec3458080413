"""`kv_transfer_params`: the dict that travels P → proxy → D, with vLLM's NIXL field names.

A request to P carries `{"do_remote_decode": true}`; P answers with `RemotePrefill` (where D reads
the prompt's KV from); the proxy hands that to D. In push mode the request to P also carries
`push_to` (`PushTarget`: a reservation on D); P writes the KV there layer by layer and answers
with `push_reservation_id` instead of blocks to read. Extra fields ride along: `first_token_id` (P's
sampled first token, which D then treats as generated) and `first_token_streamed` (the proxy
already sent it to the client, so D's stream starts at the second token).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


class KVTransferParamsError(ValueError):
    pass


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
    do_remote_prefill: bool = True

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> RemotePrefill:
        try:
            return cls(
                remote_engine_id=str(raw["remote_engine_id"]),
                remote_block_ids=[int(b) for b in raw["remote_block_ids"]],
                remote_request_id=str(raw["remote_request_id"]),
                remote_host=str(raw["remote_host"]),
                remote_port=int(raw["remote_port"]),
                tp_size=int(raw.get("tp_size", 1)),
                first_token_id=(
                    None if raw.get("first_token_id") is None else int(raw["first_token_id"])
                ),
                first_token_streamed=bool(raw.get("first_token_streamed", False)),
                push_reservation_id=raw.get("push_reservation_id"),
                kv_checksums=_checksums(raw.get("kv_checksums")),
                read_by=_optional_float(raw.get("read_by")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise KVTransferParamsError(
                f"kv_transfer_params for a remote prefill are incomplete or malformed: {e!r}"
            ) from e

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _checksums(raw: Any) -> list[list[int]] | None:
    if raw is None:
        return None
    return [[int(c) for c in layer] for layer in raw]


def _optional_float(raw: Any) -> float | None:
    if raw is None:
        return None
    value = float(raw)
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {raw!r}")
    return value


def wants_remote_decode(raw: dict[str, Any] | None) -> bool:
    return bool(raw) and bool(raw.get("do_remote_decode"))


def wants_remote_prefill(raw: dict[str, Any] | None) -> bool:
    return bool(raw) and bool(raw.get("do_remote_prefill"))


@dataclass(frozen=True)
class PushTarget:
    """Push mode: where P writes a prompt's KV (a decode worker's reservation)."""

    engine_id: str
    reservation_id: str
    block_ids: list[int]
    host: str
    port: int
    write_by: float | None = None  # unix time (D's clock): writes must have landed by then

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> PushTarget:
        try:
            return cls(
                engine_id=str(raw["engine_id"]),
                reservation_id=str(raw["reservation_id"]),
                block_ids=[int(b) for b in raw["block_ids"]],
                host=str(raw["host"]),
                port=int(raw["port"]),
                write_by=_optional_float(raw.get("write_by")),
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
