"""Request state: a small class with derived properties and one Enum of statuses."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

import torch

from common.engine.sampler import SampledToken
from common.engine.sampling_params import SamplingParams
from common.engine.structured import Grammar
from common.kv_cache.block_pool import Block
from common.kv_transfer.params import RemotePrefill
from common.tracing import RequestTimes


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


@dataclass(frozen=True)
class Resume:
    """A choice that another worker started: its first outputs were generated there and
    delivered to the client with `num_sent_chars` characters of their text; this worker goes
    on from the next token as if it had generated them (counts, penalties, seeded draws, text)."""

    choice_index: int
    output_token_ids: tuple[int, ...]
    num_sent_chars: int

    @property
    def num_tokens(self) -> int:
        return len(self.output_token_ids)


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        arrival_time: float | None = None,
        kv_transfer_params: dict | None = None,
        grammar: Grammar | None = None,
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
        self.block_hashes: list[bytes] = []  # its full blocks' keys (kv_cache/block_hash.py)
        self.generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
        self._all_token_ids = list(prompt_token_ids)
        # NOTE: what a prefill worker computed for it: the tokens known at admission, before any
        # first token from P (a resumed request's outputs so far included)
        self.num_admitted_tokens = len(prompt_token_ids)
        self.kv_transfer_params = kv_transfer_params  # as the client sent them
        self.remote_prefill: RemotePrefill | None = None  # D: where the prompt's KV is
        self.kv_transfer_params_out: dict | None = None  # P: where this request's KV is held
        self.error: str | None = None
        self.error_is_request_fault = False  # the request's own (a 400), not the server's
        self.grammar = grammar  # structured output: advanced over every appended token
        self.times = RequestTimes()  # for its trace (common/tracing)

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def grammar_error_code(self) -> str | None:
        """OpenAI's `code` for `error` when its grammar ended it and named one."""
        grammar = self.grammar
        is_grammars = grammar is not None and self.error is not None and self.error == grammar.error
        return grammar.error_code if is_grammars else None

    @property
    def cache_salt(self) -> str | None:
        """Its prefix-cache blocks are shared only with requests of the same salt."""
        return self.sampling_params.cache_salt

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
        if self.grammar is not None:
            self.grammar.accept((sampled.token_id,))

    def append_resumed(self, token_ids: tuple[int, ...] | list[int]) -> None:
        """Outputs generated by another worker, known at admission: no logprobs (they were
        reported there), so `output_logprobs` holds only this worker's tokens."""
        self.output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
        self.num_admitted_tokens = self.num_tokens
        if self.grammar is not None:
            self.grammar.accept(token_ids)
