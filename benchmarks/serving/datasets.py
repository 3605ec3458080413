"""Benchmark prompts: `SampleRequest`s (a prompt, its expected length, the output length to ask).

random    completions: token ids drawn uniformly from `token_range`; chat: random English words
          (about one token each). Lengths as in vLLM's random dataset: uniform integers in
          [⌊L·(1−r)⌋, ⌈L·(1+r)⌉] (outputs at least 1), after a prefix of `prefix_len` shared by
          every prompt.
sharegpt  a ShareGPT-format JSON list of {"conversations": [{"from": "human", "value": ...},
          {"from": "gpt", "value": ...}, ...]}: the first human turn is the prompt; the output
          length is `sharegpt_output_len`, else the reply's words × 1.3 capped at
          `sharegpt_max_output_len`.
prompts   a text file, one prompt per line (blank lines skipped), `prompts_output_len` each.

ShareGPT and prompt files are shuffled (ShareGPT) and repeated until there are `num_prompts`.
Text prompts' lengths are estimates (words × 1.3); the server's usage gives the real ones.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

DATASETS = ("random", "sharegpt", "prompts")
WORDS_PER_TOKEN = 1 / 1.3

_WORD_TEXT = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force"
)
WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class SampleRequest:
    prompt: str | list[int]  # text, or token ids (random dataset, completions)
    prompt_len: int  # exact for token ids, estimated for text
    expected_output_len: int
    messages: list[dict] | None = None  # chat: the whole history, instead of `prompt` alone
    session_id: str | None = None  # sent as X-Session-ID: a multi-turn run's conversation


@dataclass(frozen=True)
class DatasetConfig:
    name: str = "random"
    path: str | None = None
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    random_token_range: tuple[int, int] = (100, 1000)
    sharegpt_output_len: int | None = None
    sharegpt_max_output_len: int = 1024
    prompts_output_len: int = 128

    def __post_init__(self):
        if self.name not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}, got {self.name!r}")
        if self.name != "random" and not self.path:
            raise ValueError(f"the {self.name} dataset needs --dataset-path")
        if self.path and not Path(self.path).is_file():
            raise ValueError(f"dataset file not found: {self.path}")
        if not 0.0 <= self.random_range_ratio < 1.0:
            ratio = self.random_range_ratio
            raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
        if self.random_input_len < 1 or self.random_output_len < 1 or self.random_prefix_len < 0:
            raise ValueError("random input/output lengths must be >= 1 and the prefix >= 0")
        low, high = self.random_token_range
        if not 0 <= low < high:
            raise ValueError(f"--random-token-range needs 0 <= LOW < HIGH, got {low} {high}")
        for name in ("sharegpt_output_len", "sharegpt_max_output_len", "prompts_output_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def load_samples(
    cfg: DatasetConfig, num_prompts: int, is_chat: bool, seed: int
) -> list[SampleRequest]:
    rng = random.Random(seed)
    if cfg.name == "random":
        return random_samples(cfg, num_prompts, is_chat, rng)
    if cfg.name == "sharegpt":
        return _repeat(sharegpt_samples(cfg, rng), num_prompts, cfg.path)
    return _repeat(prompt_file_samples(cfg), num_prompts, cfg.path)


def random_samples(
    cfg: DatasetConfig, num_prompts: int, is_chat: bool, rng: random.Random
) -> list[SampleRequest]:
    def draw(num: int) -> list[int] | list[str]:
        if is_chat:
            return [rng.choice(WORDS) for _ in range(num)]
        return [rng.randrange(*cfg.random_token_range) for _ in range(num)]

    prefix = draw(cfg.random_prefix_len)
    samples = []
    for _ in range(num_prompts):
        body = draw(rng.randint(*length_bounds(cfg.random_input_len, cfg.random_range_ratio)))
        output_len = rng.randint(*length_bounds(cfg.random_output_len, cfg.random_range_ratio))
        tokens = prefix + body
        prompt = " ".join(tokens) if is_chat else tokens
        samples.append(SampleRequest(prompt, len(tokens), output_len))
    return samples


def length_bounds(length: int, range_ratio: float) -> tuple[int, int]:
    """vLLM's interval for a random length: [⌊L·(1−r)⌋, ⌈L·(1+r)⌉], at least 1."""
    low = max(1, math.floor(length * (1 - range_ratio)))
    return low, max(low, math.ceil(length * (1 + range_ratio)))


def sharegpt_samples(cfg: DatasetConfig, rng: random.Random) -> list[SampleRequest]:
    try:
        entries = json.loads(Path(cfg.path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg.path} is not JSON: {e}") from e
    if not isinstance(entries, list):
        raise ValueError(f"{cfg.path}: a ShareGPT file is a JSON list of conversations")
    rng.shuffle(entries)
    samples = []
    for entry in entries:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        pair = _first_exchange(turns or [])
        if pair is None:
            continue
        prompt, reply = pair
        output_len = cfg.sharegpt_output_len or min(
            cfg.sharegpt_max_output_len, max(1, estimate_tokens(reply))
        )
        samples.append(SampleRequest(prompt, estimate_tokens(prompt), output_len))
    return samples


def _first_exchange(turns: list) -> tuple[str, str] | None:
    """The first human turn and the gpt turn right after it."""
    for turn, reply in zip(turns, turns[1:]):
        if turn.get("from") == "human" and reply.get("from") == "gpt" and turn.get("value"):
            return turn["value"], reply.get("value") or ""
    return None


def prompt_file_samples(cfg: DatasetConfig) -> list[SampleRequest]:
    lines = Path(cfg.path).read_text(encoding="utf-8").splitlines()
    return [
        SampleRequest(line, estimate_tokens(line), cfg.prompts_output_len)
        for line in lines
        if line.strip()
    ]


def estimate_tokens(text: str) -> int:
    return round(len(text.split()) / WORDS_PER_TOKEN)


def _repeat(samples: list[SampleRequest], num: int, path: str | None) -> list[SampleRequest]:
    if not samples:
        raise ValueError(f"no usable prompts in {path}")
    return [samples[i % len(samples)] for i in range(num)]
