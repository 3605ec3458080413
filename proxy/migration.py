"""Decode streams that outlive their worker: a request whose D fails mid-stream continues on
another D, and the client sees one uninterrupted stream (docs/design.md, "Migration").

- **What the client has.** `ClientStream` reads every event D sends before passing it on: per
  choice, the token ids (D is always asked for `return_token_ids`; they are removed again unless
  the client asked), the characters of text and whether it finished; the stream's `id` and
  `created` (a continuation's events are rewritten to the first ones); the chat role (sent once
  per choice).
- **When a D fails.** A connection error or reset, silence past `--decode-timeout`, an error
  event that is the worker's fault (a 5xx `status`, or an older worker's untyped event; one
  drained with `--drain-migrate` sends `worker_draining`), a stream that ends
  without `[DONE]` before its choices did, an ejection by the health checks, or
  `POST /admin/workers/drain` with `migrate` (both through `InFlight.cut`). Each unfinished
  choice then goes to another D as its own request (n = 1) with `resume`: the choice's index,
  its token ids and the characters the client has. Prompt + tokens are computed on P and
  pulled by D, by the rule of a new request (`--min-disagg-tokens`; pulled even in push mode),
  else on D itself; D continues exactly (stop strings, penalties, min/max tokens, the
  detokenizer's state, the seed's draws: common/engine/engine.py).
- **Usage.** Without a migration D's usage chunk passes as is; after one, the proxy writes it:
  the prompt once (as D counts it) and every completion token the client received.
- **Refusals.** No other D, `--migration-limit` reached, a request whose tokens are not known
  (a D that sent no token ids, a batch of prompts): the stream ends with today's error event,
  never with an answer that claims success.
- **The request's fault is final.** An error event with a 4xx `status` (its output left its
  grammar, a limit) goes to the client as D wrote it and ends the stream: nothing moves.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx
import msgspec

from common.api.errors import APIError, UnavailableError, fault_of
from common.api.protocol import RESUMED_HEADER
from proxy.request import COMPLETIONS_PATH, ProxyRequest
from proxy.sse import DONE, error_event, event
from proxy.upstream import UpstreamError, error_message, open_stream
from proxy.workers import FailedWorkers, Worker

if TYPE_CHECKING:
    from proxy.orchestrator import Orchestrator, Prefilled

logger = logging.getLogger(__name__)


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


_read_view = msgspec.json.Decoder(_ChunkView).decode
_encode = msgspec.json.encode


@dataclass
class Choice:
    token_ids: list[int] = field(default_factory=list)  # the client has them
    num_chars: int = 0  # characters of text the client has
    is_finished: bool = False
    has_role: bool = False  # chat: the client has this choice's role


class Refused(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


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
                self.accept(raw[6:], _read_view(raw[6:]))
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


@dataclass(eq=False)
class Upstream:
    """One decode stream the client's stream reads from."""

    resp: httpx.Response
    worker: Worker
    choices: tuple[int, ...]  # the client's choices it carries
    prefilled: Prefilled | None = None
    task: asyncio.Task | None = None
    cut_reason: str | None = None  # set when the proxy cut it (ejection, drain)
    is_done: bool = False  # D sent [DONE]: it ended well, whatever its choices said
    unwatch: object = None


class MigratingRelay:
    """The client's stream from one or more decode streams, moving choices when one fails."""

    def __init__(self, orch: Orchestrator, req: ProxyRequest, client: ClientStream):
        self.orch = orch
        self.req = req
        self.client = client
        self.limit = orch.cfg.migration_limit
        self.failed = FailedWorkers()  # D's that failed this request
        self.active: set[Upstream] = set()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.error: bytes | None = None  # the last error event a D sent, for a refusal

    async def run(self, first: Upstream, start_metric=None) -> AsyncIterator[bytes]:
        """The client's bytes; `start_metric(now)` at the first one."""
        finished = False
        try:
            self._start(first)
            while self.active:
                kind, up, data = await self.queue.get()
                if up not in self.active:
                    continue  # what a stream already given up on still sent
                if kind == "events":
                    out, failure = self._events(up, data)
                    if out:
                        if start_metric is not None:
                            start_metric()
                            start_metric = None
                        yield out
                    if failure == "request_fault":
                        finished = True
                        yield DONE
                        return
                    if failure is None:
                        continue
                    kind, data = "failed", failure
                if kind == "end":
                    self._close(up, ok=True)
                    if up.is_done or not any(i in self.client.unfinished for i in up.choices):
                        continue
                    data = "truncated"
                else:
                    self._close(up)
                try:
                    await self._migrate(up, data)
                except Refused as e:
                    self.orch.metrics.migrations_refused.labels(e.reason).inc()
                    self.orch.metrics.stream_errors.inc()
                    finished = True
                    # D's own error event where it sent one (its message says what failed)
                    yield self.error or error_event(e.message, code="decode_failed")
                    return
            if self.client.wants_usage and not self.client.usage_sent:
                usage = self.client.usage_event()  # after a migration, or a D gone before it
                if usage:
                    yield usage
            finished = True
            yield DONE
        finally:
            for up in list(self.active):
                self._close(up)
            if not finished:  # the client went away: each D sees its stream close and aborts
                self.orch.metrics.disconnects.inc()

    # -- one decode stream -----------------------------------------------------------------------
    def _start(self, up: Upstream) -> None:
        self.active.add(up)
        up.task = asyncio.get_running_loop().create_task(self._pump(up))
        up.unwatch = self.orch.inflight.watch(up.worker, lambda reason: self._cut(up, reason))

    def _cut(self, up: Upstream, reason: str) -> None:
        """Ejected or drained: the stream moves now, if it can (else it goes on waiting)."""
        if up in self.active and up.task is not None and not up.task.done() and self.can_move(up):
            up.cut_reason = reason
            up.task.cancel()

    def can_move(self, up: Upstream) -> bool:
        """Another D could take this stream's choices now (`_refusal` aside from the D)."""
        exclude = (*self.failed.excluded, up.worker)
        return self._refusal() is None and bool(self.orch.pools["decode"].routable(exclude))

    async def _pump(self, up: Upstream) -> None:
        """D's events into the queue, those of one read together; then "end" or why it
        failed."""
        pending = b""
        put = self.queue.put_nowait
        try:
            async for chunk in up.resp.aiter_raw():
                *events, pending = (pending + chunk).split(b"\n\n")
                if events:
                    put(("events", up, events))
            put(("end", up, None))
        except asyncio.CancelledError:
            if up.cut_reason is None:
                raise
            put(("failed", up, up.cut_reason))
        except httpx.TimeoutException as e:
            logger.warning("decode worker %s went silent mid-stream: %r", up.worker.url, e)
            put(("failed", up, "timeout"))
        except Exception as e:  # noqa: BLE001 — httpx's errors, and a bug: the stream moves
            if isinstance(e, httpx.HTTPError):
                logger.warning("decode worker %s failed mid-stream: %r", up.worker.url, e)
            else:
                logger.exception("reading decode worker %s failed", up.worker.url)
            put(("failed", up, "connection"))

    def _events(self, up: Upstream, events: list[bytes]) -> tuple[bytes, str | None]:
        """The client's bytes for events of one read, and why D failed (see `_event`): the
        events after a failure are not sent."""
        out = []
        for raw in events:
            up.is_done = up.is_done or raw == b"data: [DONE]"
            sent, failure = self._event(raw)
            if sent:
                out.append(sent)
            if failure is not None:
                return b"".join(out), failure
        return b"".join(out), None

    def _event(self, raw: bytes) -> tuple[bytes | None, str | None]:
        """What to send the client for one of D's events, and why D failed (None: it did not;
        "request_fault": an error the request caused, sent and final: another D would end it
        the same way, after the work of a move)."""
        if not raw.startswith(b"data: "):
            return raw + b"\n\n", None
        data = raw[6:]
        if data == b"[DONE]":  # the proxy sends its own once every stream has ended
            return None, None
        try:
            view = _read_view(data)
        except msgspec.DecodeError:  # not a chunk: passed on as it is, and nothing can move
            self.client.is_tracked = False
            return raw + b"\n\n", None
        error = view.error
        if error is not None:
            fault = fault_of(error)
            self.orch.metrics.upstream_faults.labels("decode", fault).inc()
            if fault == "request":
                return raw + b"\n\n", "request_fault"
            logger.warning("decode worker error event: %s", error.get("message"))
            self.error = raw + b"\n\n" + DONE
            draining = "worker_draining" in (error.get("type"), error.get("code"))
            return None, "drain" if draining else "error_event"
        return self.client.accept(data, view), None

    def _close(self, up: Upstream, ok: bool = False) -> None:
        """Done with a decode stream; what it holds on P (pull) or D (push) is freed unless it
        ended well (D read it)."""
        if up not in self.active:
            return
        self.active.discard(up)
        if up.unwatch is not None:
            up.unwatch()
        if up.task is not None and not up.task.done():
            up.task.cancel()
        up.worker.num_outstanding -= 1
        if not ok:
            self.orch.give_back(up.prefilled)
        self.orch.spawn(up.resp.aclose())

    # -- moving choices --------------------------------------------------------------------------
    async def _migrate(self, up: Upstream, reason: str) -> None:
        """Each unfinished choice of a failed stream continues on another D; `Refused` if not."""
        logger.warning("decode worker %s failed a stream (%s)", up.worker.url, reason)
        self.req.trace.end_calls_to(up.worker.url, error=reason)
        self.failed.add(up.worker)  # not for this request again (until it is back): the
        # health checks decide for the others
        moving = [i for i in up.choices if i in self.client.unfinished]
        if reason != "error_event" and reason != "drain":
            self.error = None  # this failure has no event of its own
        if not moving:
            return  # it failed after its choices finished: nothing to move
        why = self._refusal()
        if why is not None:
            raise Refused(*why)
        self.client.num_migrations += 1
        self.req.trace.event("migration", reason=reason, **{"pdserve.from_url": up.worker.url})
        for index in moving:
            self._start(await self._resume(index))
            self.orch.metrics.migrations.labels(reason).inc()

    def _refusal(self) -> tuple[str, str] | None:
        if self.client.num_migrations >= self.limit:
            return "limit", (
                "the decode worker failed mid-stream"
                + (f" (moved {self.limit} times already)" if self.limit else "")
            )
        if not self.client.is_tracked:
            return "untracked", "the decode worker failed mid-stream; the request cannot move"
        return None

    async def _resume(self, index: int) -> Upstream:
        choice = self.client.choices[index]
        body = {k: v for k, v in self.req.body.items() if k not in ("best_of", "n")}
        resume = {
            "choice_index": index,
            "output_token_ids": choice.token_ids,
            "num_sent_chars": choice.num_chars,
        }
        body.update(stream=True, return_token_ids=True, resume=resume)
        prefilled = await self._prefill(choice)
        if prefilled is not None:  # D samples the next token itself (penalties, seed's draw)
            params = {k: v for k, v in prefilled.params.items() if k != "first_token_id"}
            body["kv_transfer_params"] = params
        content = json.dumps(body, separators=(",", ":")).encode()
        headers = {"X-Request-Id": self.req.request_id, **self.orch.internal}
        while True:
            try:
                decode = await self.orch.choose_soon("decode", self.req, self.failed.excluded)
            except UnavailableError as e:
                self.orch.give_back(prefilled)
                raise Refused(
                    "no_decode", "the decode worker failed mid-stream and no other can continue"
                ) from e
            decode.num_outstanding += 1
            trace = self.req.trace
            span = trace.child("proxy.decode", "client", **{"server.address": decode.url})
            try:
                resp = await open_stream(
                    decode, self.req.path, content, {**headers, **trace.headers(span)},
                    self.orch.stream_timeout,
                )  # fmt: skip
            except UpstreamError as e:
                trace.end_span(span, error=e.kind)
                decode.num_outstanding -= 1
                self.orch.failed(e)
                self.failed.add(decode)
                if e.is_client_error:
                    self.orch.give_back(prefilled)
                    message = error_message(e.body) or e.message
                    raise Refused("rejected", f"the request could not move: {message}") from e
                continue
            if resp.headers.get(RESUMED_HEADER) != "1":  # a worker without `resume` (vLLM's)
                decode.num_outstanding -= 1
                self.orch.spawn(resp.aclose())
                self.orch.give_back(prefilled)
                raise Refused(
                    "unsupported", "the decode worker failed mid-stream; no other can continue it"
                )
            prompt = self.client.prompt_token_ids
            num_prompt = self.req.estimated_tokens() if prompt is None else len(prompt)
            recomputed = num_prompt + len(choice.token_ids)
            self.orch.metrics.migration_recomputed.inc(recomputed)
            logger.info(
                "request %s choice %d continues on %s after %d tokens (%s)",
                self.req.request_id, index, decode.url, len(choice.token_ids),
                "its KV from P" if prefilled else "recomputed there",
            )  # fmt: skip
            return Upstream(resp, decode, (index,), prefilled)

    async def _prefill(self, choice: Choice) -> Prefilled | None:
        """Prompt + tokens so far computed on P, for D to pull (the rule of a new request:
        `--min-disagg-tokens`, a routable P); None: D computes them."""
        orch, ids = self.orch, self.client.prompt_token_ids
        if ids is None or orch.cfg.mode == "colocated" or not orch.pools["prefill"].routable():
            return None
        tokens = ids + choice.token_ids
        if len(tokens) < orch.cfg.min_disagg_tokens:
            return None
        body = {"prompt": tokens}
        if "model" in self.req.body:
            body["model"] = self.req.body["model"]
        prompt = ProxyRequest(COMPLETIONS_PATH, body, b"", self.req.request_id, self.req.trace)
        try:  # NOTE: pulled even in push mode: a reservation would need D chosen first
            return await orch.prefill(prompt, None, tokens, push=False)
        except APIError as e:  # P refused it: D computes it
            logger.warning("prefill for a moved request failed: %s", e)
            return None
