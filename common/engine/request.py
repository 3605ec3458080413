"""Request state: a small class with derived properties and one Enum of statuses."""

from __future__ import annotations

import enum
import time

import torch

from common.engine.sampler import SampledToken
from common.engine.sampling_params import SamplingParams
from common.kv_cache.block_pool import Block
from common.kv_transfer.params import RemotePrefill


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED")


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        arrival_time: float | None = None,
        kv_transfer_params: dict | None = None,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[SampledToken] = []
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at admission
        self.num_preemptions = 0
        self.blocks: list[Block] = []
        self.block_hashes: list[int] = []
        self.generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
        self._all_token_ids = list(prompt_token_ids)
        self.kv_transfer_params = kv_transfer_params  # as the client sent them
        self.remote_prefill: RemotePrefill | None = None  # D: where the prompt's KV is
        self.kv_transfer_params_out: dict | None = None  # P: where this request's KV is held
        self.error: str | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_aborted(self) -> bool:
        return self.status == RequestStatus.FINISHED_ABORTED

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.is_finished else None

    def append_token(self, sampled: SampledToken) -> None:
        self.output_token_ids.append(sampled.token_id)
        self._all_token_ids.append(sampled.token_id)
        if self.sampling_params.logprobs is not None:
            self.output_logprobs.append(sampled)
