"""What the client of a streamed request has received, read from every event D sends before
it is passed on, so that a failed D's choices can continue on another (migration.py).

- Per choice: the token ids (D is always asked for `return_token_ids`; they are removed again
  unless the client asked), the characters of text, whether it finished and whether it has its
  chat role (sent once per choice). P's first token, sent by the proxy, counts too.
- The stream's `id` and `created`: a continuation's events are rewritten to the first ones.
- **Usage.** Without a migration D's usage chunk passes as is; after one, the proxy writes it:
  the prompt once (as D counts it) and every completion token the client received.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from proxy.request import ProxyRequest
from proxy.sse import event


class _Delta(msgspec.Struct):
    role: str | None = None
    content: str | None = None


class _ChoiceView(msgspec.Struct):
    index: int = 0
    text: str | None = None
    delta: _Delta | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    finish_reason: str | None = None


class _ChunkView(msgspec.Struct):
    """The fields of a D event the proxy reads (the rest is passed on as D wrote it)."""

    id: str | None = None
    created: int | None = None
    choices: list[_ChoiceView] | None = None
    usage: dict | None = None
    prompt_token_ids: list[int] | None = None
    error: dict | None = None


read_view = msgspec.json.Decoder(_ChunkView).decode  # what the proxy reads of one D event
_encode = msgspec.json.encode


@dataclass
class Choice:
    token_ids: list[int] = field(default_factory=list)  # the client has them
    num_chars: int = 0  # characters of text the client has
    is_finished: bool = False
    has_role: bool = False  # chat: the client has this choice's role


class ClientStream:
    """What the client has received, and D's events rewritten for it (see the module's doc)."""

    def __init__(self, req: ProxyRequest):
        n = req.body.get("n")
        self.choices = {i: Choice() for i in range(n if isinstance(n, int) and n > 1 else 1)}
        self.is_chat = req.is_chat
        self.wants_ids = req.body.get("return_token_ids") is True
        options = req.body.get("stream_options")
        self.wants_usage = isinstance(options, dict) and options.get("include_usage") is True
        self.usage_sent = False
        self.id: str | None = None
        self.created: int | None = None
        # every choice's token ids are known, and its text is what the client has
        self.is_tracked = not req.is_batch and not req.reads_tool_calls
        self.prompt_token_ids: list[int] | None = None
        self.usage: dict | None = None  # the last usage D reported
        self.num_migrations = 0

    def first_token(self, answer_events: bytes, token_id: int | None) -> None:
        """P's first token, sent by the proxy itself (proxy/sse.py `first_token_events`, which
        carry the token's id only when the client asked: `token_id` says it)."""
        is_tracked = self.is_tracked
        for raw in answer_events.split(b"\n\n"):
            if raw.startswith(b"data: {"):
                self.accept(raw[6:], read_view(raw[6:]))
        self.choices[0].token_ids = [] if token_id is None else [token_id]
        self.is_tracked = is_tracked and token_id is not None

    @property
    def unfinished(self) -> list[int]:
        return [i for i, c in self.choices.items() if not c.is_finished]

    def accept(self, data: bytes, view: _ChunkView) -> bytes | None:
        """The event for the client from one of D's chunks (`data`, JSON; `view`, what the
        proxy reads of it), once tracked; None: nothing to send. As D wrote it, less the token
        ids the client did not ask for and with the stream's `created`, unless it must be
        written anew: one with prompt token ids or another id, a chat role the client already
        has, or the usage after a migration (the proxy writes that one at the end)."""
        choices = view.choices or ()
        had_role = {
            c.index
            for c in choices
            if c.delta is not None and c.delta.role is not None
            and (choice := self.choices.get(c.index)) is not None and choice.has_role
        }  # fmt: skip
        first_prompt_ids = self.prompt_token_ids is None
        anew = (
            bool(had_role)
            or view.prompt_token_ids is not None
            or any(c.prompt_token_ids is not None for c in choices)
            or (self.id is not None and view.id != self.id)
            or (self.num_migrations > 0 and view.usage is not None)
        )
        self._track(view, choices)
        if anew:
            return self._written_anew(msgspec.json.decode(data), had_role, first_prompt_ids)
        if view.created not in (None, self.created):  # a continuation; D after P's token
            was, now = b'"created":%d' % view.created, b'"created":%d' % self.created
            if was not in data:
                return self._written_anew(msgspec.json.decode(data), had_role, False)
            data = data.replace(was, now, 1)
        for c in () if self.wants_ids else choices:
            if c.token_ids is None:
                continue
            ids = b',"token_ids":' + _encode(c.token_ids)
            if ids not in data:  # NOTE: D writes compact JSON (pydantic); else written anew
                return self._written_anew(msgspec.json.decode(data), had_role, False)
            data = data.replace(ids, b"", 1)
        self.usage_sent = self.usage_sent or view.usage is not None
        return b"data: " + data + b"\n\n"

    def _track(self, view: _ChunkView, choices) -> None:
        """What the client gets of this chunk: per choice its ids, characters, role, end."""
        if self.id is None:
            self.id, self.created = view.id, view.created
        if self.prompt_token_ids is None:
            found = (c.prompt_token_ids for c in choices if c.prompt_token_ids is not None)
            self.prompt_token_ids = view.prompt_token_ids or next(found, None)
        if view.usage is not None:
            self.usage = view.usage
        for c in choices:
            choice = self.choices.get(c.index)
            if choice is None:  # not a choice of this request (a batch's prompt > 0)
                continue
            text = c.text if c.delta is None else c.delta.content
            if c.token_ids is None:  # a D that does not say its token ids: nothing moves
                self.is_tracked = self.is_tracked and not text
            else:
                choice.token_ids.extend(c.token_ids)
            choice.has_role = choice.has_role or (c.delta is not None and c.delta.role is not None)
            choice.num_chars += len(text or "")
            choice.is_finished = choice.is_finished or c.finish_reason is not None

    def _written_anew(
        self, payload: dict, had_role: set[int], first_prompt_ids: bool
    ) -> bytes | None:
        payload["id"], payload["created"] = self.id, self.created
        keep_prompt_ids = first_prompt_ids and self.wants_ids  # sent once, and only if asked
        if not keep_prompt_ids:
            payload.pop("prompt_token_ids", None)
        usage = payload.get("usage")
        choices = payload.get("choices")
        if not choices:
            if usage is not None and self.num_migrations:
                return None  # written at the end (`usage_event`)
            self.usage_sent = self.usage_sent or usage is not None
            return event(payload)
        kept = []
        for raw in choices:
            if not keep_prompt_ids:
                raw.pop("prompt_token_ids", None)
            if not self.wants_ids:
                raw.pop("token_ids", None)
            delta = raw.get("delta")
            if raw.get("index") in had_role and isinstance(delta, dict):
                delta.pop("role", None)
                if not delta.get("content") and _is_bare(raw, delta):
                    continue
            kept.append(raw)
        payload["choices"] = kept
        return event(payload) if kept or usage is not None else None

    def usage_event(self) -> bytes | None:
        """After a migration: the usage chunk, the prompt once and every completion token."""
        if self.usage is None and self.prompt_token_ids is None:
            return None
        prompt = (self.usage or {}).get("prompt_tokens", len(self.prompt_token_ids or ()))
        completion = sum(len(c.token_ids) for c in self.choices.values())
        usage = {**(self.usage or {}), "prompt_tokens": prompt, "completion_tokens": completion}
        usage["total_tokens"] = prompt + completion
        kind = "chat.completion.chunk" if self.is_chat else "text_completion"
        payload = {"id": self.id, "object": kind, "created": self.created, "choices": []}
        return event({**payload, "usage": usage})


def _is_bare(raw: dict, delta: dict) -> bool:
    """A chat choice that carried only its role (and perhaps an empty content)."""
    rest = {k for k, v in raw.items() if v is not None} - {"index", "delta", "token_ids"}
    return not rest and set(delta) <= {"content"}
