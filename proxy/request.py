"""One client request as the proxy sees it: the JSON body (opaque but for a few fields), its id,
and the bodies derived from it for P and D.

A client's `X-Session-ID` header (vllm-router's `consistent_hash` header) names the
conversation the request belongs to: `session_id`, for session affinity (proxy/sessions.py).

The proxy does not tokenize: conditional disaggregation uses an estimate of the prompt's length
(token ids are counted exactly; text is taken as ~4 bytes per token).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from common.api.errors import InvalidRequestError
from common.api.http import parse_json_object
from common.api.limits import RequestLimits, check_body
from common.tracing import NO_TRACE, NoTrace, Trace

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
GENERATION_PATHS = frozenset((COMPLETIONS_PATH, CHAT_PATH))
_PREFILL_DROPS = ("stream_options", "max_completion_tokens", "logprobs", "echo")
_DEFAULT_LIMITS = RequestLimits()
MAX_SESSION_ID_CHARS = 256  # a longer X-Session-ID is cut: ids that long still tell sessions apart


@dataclass
class ProxyRequest:
    path: str  # COMPLETIONS_PATH or CHAT_PATH
    body: dict
    raw: bytes  # the body as received, forwarded as is where nothing changes
    request_id: str
    trace: Trace | NoTrace = NO_TRACE  # its spans (common/tracing): the calls made for it
    session_id: str | None = None  # X-Session-ID: its conversation; None without one

    @classmethod
    def parse(
        cls,
        path: str,
        raw: bytes,
        request_id: str,
        trace: Trace | NoTrace = NO_TRACE,
        session_header: str | None = None,
        limits: RequestLimits | None = None,
    ) -> ProxyRequest:
        """`session_header`: the X-Session-ID header as received (empty: none; cut to
        `MAX_SESSION_ID_CHARS`); `limits` (default: the defaults) are checked before anything
        is made from the body (a stream's choices, above all)."""
        limits = limits or _DEFAULT_LIMITS
        body = parse_json_object(raw, limits.max_json_depth, limits.max_fields)
        check_body(body, is_chat=path == CHAT_PATH, limits=limits)
        for name in ("kv_transfer_params", "resume"):
            if body.get(name) is not None:
                raise InvalidRequestError(
                    f"{name} are set by the proxy, not by clients", param=name
                )
        session_id = (session_header or "").strip()[:MAX_SESSION_ID_CHARS] or None
        return cls(path, body, raw, request_id, trace, session_id)

    @property
    def is_chat(self) -> bool:
        return self.path == CHAT_PATH

    @property
    def is_stream(self) -> bool:
        return self.body.get("stream") is True

    @property
    def is_batch(self) -> bool:
        """Several prompts in one completions request (each would need its own transfer)."""
        prompt = self.body.get("prompt")
        return (
            not self.is_chat
            and isinstance(prompt, list)
            and bool(prompt)
            and isinstance(prompt[0], (str, list))
        )

    @property
    def can_stream_first_token(self) -> bool:
        """P's first token can go to the client before D answers: one plain choice."""
        b = self.body
        return (
            self.is_stream
            and (b.get("n") in (None, 1))
            and not self.wants_logprobs
            and not b.get("echo")
            and not self.reads_tool_calls
        )

    @property
    def reads_tool_calls(self) -> bool:
        """A chat whose tools the model may call: the worker reads tool calls out of the text,
        holding back what may be one, so the text is not the client's to have as it comes
        (P's first token is not streamed early, and a stream does not move)."""
        b = self.body
        return self.is_chat and bool(b.get("tools")) and b.get("tool_choice") != "none"

    @property
    def wants_logprobs(self) -> bool:
        """Logprobs asked for (completions' `logprobs: 0` too). P's first token comes without
        them, so D samples every token itself."""
        if self.is_chat:
            return self.body.get("logprobs") not in (None, False)
        return self.body.get("logprobs") is not None

    @property
    def prompt_text(self) -> str:
        if self.is_chat:
            messages = self.body.get("messages")
            return json.dumps(messages, separators=(",", ":"))[:65536] if messages else ""
        prompt = self.body.get("prompt")
        return prompt if isinstance(prompt, str) else json.dumps(prompt)[:65536]

    def estimated_tokens(self) -> int:
        prompt = self.body.get("prompt")
        is_ids = isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
        if not self.is_chat and is_ids:
            return len(prompt)
        return len(self.prompt_text.encode()) // 4

    def prefill_body(self, push_to: dict | None, lent: dict | None = None) -> dict:
        """To P: compute the prompt and the first token, keep the KV for D; `lent`: read this
        prefix of the prompt from D instead (the reverse pull)."""
        body = {k: v for k, v in self.body.items() if k not in _PREFILL_DROPS}
        body.update(max_tokens=1, stream=False, n=1, kv_transfer_params={"do_remote_decode": True})
        if self.is_chat:
            body.pop("top_logprobs", None)
        if isinstance(body.get("min_tokens"), int):  # still masks EOS for the first token
            body["min_tokens"] = min(body["min_tokens"], 1)
        if push_to is not None:
            body["kv_transfer_params"]["push_to"] = push_to
        if lent is not None:
            body["kv_transfer_params"].update(lent, do_remote_prefill=True)
        return body

    def decode_body(self, kv_transfer_params: dict | None, track: bool = False) -> bytes:
        """To D: the client's body, P's params added; `track`: with the token ids of every
        chunk, which a migration carries over (proxy/journey/client.py removes them again)."""
        has_ids = self.body.get("return_token_ids") is True
        if kv_transfer_params is None and (has_ids or not track):
            return self.raw
        head = self.raw.rstrip()
        if kv_transfer_params is None and head.endswith(b"}"):
            # NOTE: the key added at the end, not the body encoded again (a long chat costs
            # tens of µs to encode); a parser keeps the last of a repeated key
            sep = b"," if head[:-1].rstrip() != b"{" else b""
            return head[:-1] + sep + b'"return_token_ids":true}'
        body = dict(self.body)
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        if track:
            body["return_token_ids"] = True
        return json.dumps(body).encode()

    def reserve_body(self) -> dict:
        """To D before a push: the request, which D tokenizes to size the reservation."""
        body = {k: v for k, v in self.body.items() if k != "stream_options"}
        return {"chat" if self.is_chat else "completion": {**body, "stream": False}}
