"""Per-request sampling parameters, validated on construction (OpenAI / vLLM semantics)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on the output, as vLLM's `structured_outputs`: exactly one of a JSON schema
    (`json`, as JSON text), any JSON object (`json_object`), a regular expression (`regex`), one
    of a list of strings (`choice`), or a grammar (`grammar`: Lark, or GBNF / EBNF with `::=`).
    The grammar is compiled and enforced by common/engine/structured.py."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError(
                f"structured_outputs must set exactly one of json, json_object, regex, choice "
                f"and grammar, got {kinds or 'none'}"
            )
        if self.choice is not None and not (
            self.choice and all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("structured_outputs must have a choice of non-empty strings")

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what a compiled grammar is cached by."""
        if self.json_object:
            return "json_object", ""
        if self.choice is not None:
            return "choice", json.dumps(self.choice)  # any string, NUL included
        kind = next(k for k in ("json", "regex", "grammar") if getattr(self, k) is not None)
        return kind, getattr(self, kind)


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per output token; None: none
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured: StructuredOutputs | None = None  # the output follows this grammar
    # its prefix-cache blocks are shared only with requests of the same salt (none: all others
    # without one); not a sampling parameter, but it goes wherever they go
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(self.n, "n", self.n >= 1, ">= 1")
        _check(self.max_tokens, "max_tokens", self.max_tokens >= 1, ">= 1")
        _check(
            self.min_tokens,
            "min_tokens",
            0 <= self.min_tokens <= self.max_tokens,
            f"between 0 and max_tokens ({self.max_tokens})",
        )
        _check(
            self.temperature,
            "temperature",
            _finite(self.temperature) and self.temperature >= 0,
            ">= 0",
        )
        _check(self.top_p, "top_p", _finite(self.top_p) and 0 < self.top_p <= 1, "in (0, 1]")
        _check(self.top_k, "top_k", self.top_k >= -1, "-1, 0 (disabled) or >= 1")
        _check(self.min_p, "min_p", _finite(self.min_p) and 0 <= self.min_p <= 1, "in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(value, name, _finite(value) and -2 <= value <= 2, "in [-2, 2]")
        # NOTE: bounded so that logits divided or multiplied by it stay finite in float32
        # (1e-308 rounds to 0 there: inf logits, NaN weights, an out-of-vocabulary sample)
        _check(
            self.repetition_penalty,
            "repetition_penalty",
            _finite(self.repetition_penalty) and 0.01 <= self.repetition_penalty <= 100,
            "in [0.01, 100]",
        )
        if self.logprobs is not None:
            _check(self.logprobs, "logprobs", 0 <= self.logprobs <= 20, "in [0, 20]")
        _check(
            self.stop, "stop", all(isinstance(s, str) and s for s in self.stop), "non-empty strings"
        )
        salt = self.cache_salt
        _check(salt, "cache_salt", salt is None or (isinstance(salt, str) and salt), "non-empty")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    def check_token_ids(self, vocab_size: int) -> None:
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        _check(bad, "stop_token_ids", not bad, f"in [0, {vocab_size})")


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _check(value: object, name: str, ok: bool, limit: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {limit}, got {value!r}")
