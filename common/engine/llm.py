"""The offline API, in the spirit of vLLM's `LLM(model).generate(prompts, sampling_params)`."""

from __future__ import annotations

import dataclasses
import itertools

from common.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from common.engine.engine import LLMEngine
from common.engine.output import CompletionOutput, RequestOutput
from common.engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """`LLM(model=None, **options)`: options are fields of ModelConfig, CacheConfig,
    SchedulerConfig and ParallelConfig (e.g. `block_size=16, num_blocks=512, max_num_seqs=8,
    tensor_parallel_size=2`). `shutdown()` stops tensor-parallel ranks."""

    def __init__(self, model: str | None = None, **options):
        self.engine = LLMEngine(_config(model, options))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        prompts = _as_prompt_list(prompts)
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        ids = [str(next(self._ids)) for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, params_list):
            self.engine.add_request(rid, prompt, p)
        return self._run(ids)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations
        ]
        return self.generate(prompts, sampling_params)

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        latest: dict[str, dict[int, CompletionOutput]] = {i: {} for i in ids}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                for completion in out.outputs:
                    latest[out.request_id][completion.index] = completion
                if out.finished:
                    final[out.request_id] = out
        for rid, out in final.items():
            out.outputs = [latest[rid][i] for i in sorted(latest[rid])]
        return [final[i] for i in ids]


def _as_prompt_list(prompts: Prompt | list[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and isinstance(prompts[0], int):
        return [prompts]
    return list(prompts)


def _config(model: str | None, options: dict) -> EngineConfig:
    parts = {}
    for name, cls in (
        ("model", ModelConfig),
        ("cache", CacheConfig),
        ("scheduler", SchedulerConfig),
        ("parallel", ParallelConfig),
    ):
        fields = {f.name for f in dataclasses.fields(cls)}
        parts[name] = cls(
            **{k: options.pop(k) for k in list(options) if k in fields},
            **({"model": model} if cls is ModelConfig else {}),
        )
    if options:
        raise TypeError(f"unknown LLM options: {sorted(options)}")
    return EngineConfig(**parts)
