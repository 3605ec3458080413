"""Text <-> token ids for one model folder, its chat template, and streaming detokenization.

`Tokenizer.from_dir(model_dir)` reads, as transformers does:
    tokenizer.json          required: the `tokenizers` pipeline (normalizer, BPE, decoder)
    tokenizer_config.json   chat_template, bos/eos/unk/pad tokens, add_bos_token
    chat_template.jinja     if present, the chat template (newer transformers save it here)
    generation_config.json  if present, more eos ids (`eos_token_id`: int or list)

`apply_chat_template` renders with a sandboxed jinja2 environment set up like transformers'
(trim_blocks, lstrip_blocks, `raise_exception`, `strftime_now`, a non-escaping `tojson`). Encode the
result with `add_special_tokens=False`: the template already writes any bos it wants.

`IncrementalDetokenizer` turns a stream of generated ids into final text deltas, never splitting a
UTF-8 character, decoding only a small window per token.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from common.model.hf_config import ModelLoadError

REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    def __init__(
        self,
        backend: HFTokenizer,
        *,
        source: Path,
        chat_template: str | None = None,
        special_tokens: Mapping[str, str] | None = None,
        add_bos_token: bool = False,
        extra_eos_token_ids: Iterable[int] = (),
    ):
        self.backend = backend
        self.source = source
        self.chat_template = chat_template
        # bos_token, eos_token, unk_token, pad_token: as the template sees them
        self.special_tokens = dict(special_tokens or {})
        self.add_bos_token = add_bos_token
        self.bos_token_id = self._token_id("bos_token")
        eos_id = self._token_id("eos_token")
        eos_ids = [*extra_eos_token_ids, *([] if eos_id is None else [eos_id])]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_ids))
        added = backend.get_added_tokens_decoder()
        self.special_token_ids = frozenset(i for i, token in added.items() if token.special)
        self._template: jinja2.Template | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        folder = Path(model_dir)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{path}: missing (a model folder needs tokenizer.json)")
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception
            raise ModelLoadError(f"{path}: cannot be loaded ({e})") from e
        config = _read_json(folder / "tokenizer_config.json")
        generation = _read_json(folder / "generation_config.json")
        template_file = folder / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else None
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        return cls(
            backend,
            source=folder,
            chat_template=template or _pick_template(config.get("chat_template")),
            special_tokens={n: t for n in names if (t := _token_text(config.get(n))) is not None},
            add_bos_token=bool(config.get("add_bos_token", False)),
            extra_eos_token_ids=_as_ids(generation.get("eos_token_id")),
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # NOTE: encode_batch releases the GIL (encode holds it): a long prompt tokenized on a
        # worker thread then leaves the event loop free to answer other requests
        ids = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)  # tokenizer_config asks for bos but the post-processor adds none
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Any],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt for `messages`: dicts or pydantic models, content a string or text parts."""
        if self.chat_template is None:
            raise ValueError(f"{self.source}: the tokenizer has no chat template")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        context = {**self.special_tokens, **kwargs}
        try:
            return self._template.render(
                messages=[_plain_message(m) for m in messages],
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except jinja2.TemplateError as e:  # includes raise_exception() from the template
            raise ValueError(f"chat template: {e}") from e

    def _token_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)


class IncrementalDetokenizer:
    """Generated ids in, newly final text out (the prefix/read-offset technique of TGI and vLLM).

    Only a small window of ids is decoded per token: `ids[:read_offset]` made the last delta (or
    are the prompt's last tokens) and decode to `prefix_text`; they give the new tokens context,
    because a token's leading space can decode differently at the start of a string. The pending
    `ids[read_offset:]` are held back while their text ends in U+FFFD, i.e. a UTF-8 character is
    still incomplete. Older ids are dropped, so the window never grows.
    """

    NUM_CONTEXT_TOKENS = 5  # prompt tokens decoded as context for the first output token
    MAX_PENDING_TOKENS = 8  # a character needs at most 4 tokens; more means invalid bytes

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Skipped specials never enter the window: they decode to nothing and would only grow it.
        self._skipped_ids = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._ids = list(prompt_token_ids[-self.NUM_CONTEXT_TOKENS :])
        self._prefix_text = self._decode(self._ids)
        if self._prefix_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character: its bytes must not merge with the output's.
            self._ids, self._prefix_text = [], ""
        self._read_offset = len(self._ids)
        self._parts: list[str] = []

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def add(self, token_id: int) -> str:
        """Append one generated id; return the text it made final ("" while held back)."""
        if token_id in self._skipped_ids:
            return ""
        self._ids.append(token_id)
        window = self._decode(self._ids)
        if len(window) > len(self._prefix_text) and not window.endswith(REPLACEMENT_CHAR):
            return self._advance(len(self._ids), window)
        if len(self._ids) - self._read_offset < self.MAX_PENDING_TOKENS:
            return ""  # the rest of a character is still to come
        return self._advance(*self._clean_split(window))  # invalid bytes: do not hold forever

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character becomes U+FFFD); call at the end."""
        if len(self._ids) == self._read_offset:
            return ""
        return self._advance(len(self._ids), self._decode(self._ids))

    def _clean_split(self, window: str) -> tuple[int, str]:
        """The last pending boundary no character straddles (both sides decode the same apart)."""
        for end in range(len(self._ids) - 1, self._read_offset, -1):
            head = self._decode(self._ids[:end])
            if head + self._decode(self._ids[end:]) == window:
                return end, head
        return len(self._ids), window

    def _advance(self, end: int, window: str) -> str:
        """Make ids[:end] read; `window` is their text. The ids just read become the prefix."""
        delta = window[len(self._prefix_text) :]
        del self._ids[: self._read_offset]
        self._read_offset = end - self._read_offset
        self._prefix_text = self._decode(self._ids[: self._read_offset])
        if delta:
            self._parts.append(delta)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json spells a token as a string or as a serialized AddedToken
    return value.get("content") if isinstance(value, dict) else value


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _pick_template(value: Any) -> str | None:
    # Older configs store several named templates: [{"name": "default", "template": ...}, ...]
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default")
    return value


def _plain_message(message: Any) -> dict:
    if hasattr(message, "model_dump"):  # pydantic request models
        message = message.model_dump()
    if not isinstance(message, Mapping):
        raise ValueError(f"a chat message must be an object, got {type(message).__name__}")
    # Like transformers: drop None values, which templates handle worse than a missing key.
    plain = {key: value for key, value in message.items() if value is not None}
    if isinstance(plain.get("content"), list):
        plain["content"] = _join_text_parts(plain["content"])
    return plain


def _join_text_parts(parts: list) -> str:
    texts = []
    for part in parts:
        if not isinstance(part, Mapping) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ValueError(f"unsupported message content part {kind!r} (only 'text')")
        texts.append(str(part.get("text", "")))
    return "\n".join(texts)  # NOTE: vLLM joins text parts with a newline too


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training; render as-is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _compile_template(source: str) -> jinja2.Template:
    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        # jinja's own tojson escapes HTML characters; templates expect plain JSON
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
