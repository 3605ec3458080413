"""`kv_transfer_params`: the dict that travels P → proxy → D, with vLLM's NIXL field names.

A request to P carries `{"do_remote_decode": true}`; P answers with `RemotePrefill` (where D reads
the prompt's KV from); the proxy hands that to D. Extra fields ride along: `first_token_id` (P's
sampled first token, which D then treats as generated) and `first_token_streamed` (the proxy
already sent it to the client, so D's stream starts at the second token).
"""

from __future__ import annotations

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
            )
        except (KeyError, TypeError, ValueError) as e:
            raise KVTransferParamsError(
                f"kv_transfer_params for a remote prefill are incomplete or malformed: {e!r}"
            ) from e

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def wants_remote_decode(raw: dict[str, Any] | None) -> bool:
    return bool(raw) and bool(raw.get("do_remote_decode"))


def wants_remote_prefill(raw: dict[str, Any] | None) -> bool:
    return bool(raw) and bool(raw.get("do_remote_prefill"))
