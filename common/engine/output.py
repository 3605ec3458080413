"""Turning sampled tokens into user-facing outputs: incremental text, stop strings, logprobs.

A stop string ends the request (the text is cut before it, or after it with
`include_stop_str_in_output`). While a request runs, the last `len(longest stop) - 1`
characters are held back from the streamed delta, so a stop string is never half-streamed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.engine.request import Request
from common.engine.sampler import SampledToken
from common.kv_transfer.params import wants_remote_decode
from common.tokenizer import IncrementalDetokenizer, Tokenizer
from common.tracing import RequestTimes


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[SampledToken] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[SampledToken] = field(default_factory=list)  # empty: none requested


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None  # a prefill worker's answer: where the KV is held
    error: str | None = None  # why a request finished with finish_reason "error"
    error_is_request_fault: bool = False  # the error is the request's (a 400), not the server's
    grammar_error_code: str | None = None  # its grammar's code for it (grammar_too_expensive)
    times: RequestTimes | None = None  # a finished request's instants, for its trace

    @property
    def error_code(self) -> str | None:
        """`error` as a stable name (its `code` in OpenAI's shape, common/api/errors.py). The
        engine ends a request with an error when its output leaves its grammar, the request's
        own fault (common/engine/structured.py), or when its KV could not be moved or checked,
        the worker's (common/kv_transfer/remote_prefills.py)."""
        if self.error is None:
            return None
        if self.grammar_error_code is not None:
            return self.grammar_error_code
        return "grammar_violation" if self.error_is_request_fault else "kv_transfer_failed"


def decoded_text(
    tokenizer: Tokenizer, prompt_ids: list[int], output_ids: list[int], skip_special: bool
) -> str:
    """The text a stream has made final after `output_ids` (an incomplete UTF-8 tail held),
    as the output processor tracks it: what a resumed request's `num_sent_chars` may reach."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special)
    for token_id in output_ids:
        detok.add(token_id)
    return detok.text


@dataclass
class _Track:
    detok: IncrementalDetokenizer
    text: str = ""  # all text, stop-string cut applied
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    num_detok_tokens: int = 0
    stopped_by: str | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._tracks: dict[str, _Track] = {}

    def add_request(self, req: Request) -> None:
        detok = IncrementalDetokenizer(
            self.tokenizer, req.prompt_token_ids, req.sampling_params.skip_special_tokens
        )
        self._tracks[req.request_id] = _Track(detok)

    def remove(self, request_id: str) -> None:
        self._tracks.pop(request_id, None)

    def process(self, req: Request) -> tuple[CompletionOutput, str | None]:
        """The request's output after its newest token, and the stop string it hit, if any."""
        track = self._tracks[req.request_id]
        if track.stopped_by is None and track.num_detok_tokens < req.num_output_tokens:
            for token_id in req.output_token_ids[track.num_detok_tokens :]:
                track.detok.add(token_id)
            track.num_detok_tokens = req.num_output_tokens
            # NOTE: a prefill for a remote decode keeps an incomplete UTF-8 tail unflushed:
            # D continues the same text, and the client must not get a replacement character
            if req.is_finished and not wants_remote_decode(req.kv_transfer_params):
                track.detok.flush()
            track.text = track.detok.text
            track.stopped_by = self._find_stop(req, track)
        finished = req.is_finished or track.stopped_by is not None
        out = self._completion(req, track, finished)
        if finished:
            self.remove(req.request_id)
        return out, track.stopped_by

    def resume(self, req: Request, num_sent_chars: int) -> None:
        """A resumed request (its outputs so far appended): the detokenizer as it was after
        them, and the client holding exactly `num_sent_chars` characters of their text. Text
        that the previous worker still held back (a possible stop string) is not sent: it goes
        out with the next delta. ValueError if the text is shorter than `num_sent_chars`."""
        track = self._tracks[req.request_id]
        for token_id in req.output_token_ids[track.num_detok_tokens :]:
            track.detok.add(token_id)
        track.num_detok_tokens = req.num_output_tokens
        track.text = track.detok.text
        if num_sent_chars > len(track.text):
            raise ValueError(
                f"num_sent_chars is {num_sent_chars}, but the output so far decodes to "
                f"{len(track.text)} characters"
            )
        track.num_sent_chars, track.num_sent_tokens = num_sent_chars, req.num_output_tokens

    def mark_sent(self, request_id: str) -> None:
        """The client already has all text so far (P's first token, streamed by the proxy)."""
        track = self._tracks[request_id]
        track.num_sent_chars = len(track.text)

    def _find_stop(self, req: Request, track: _Track) -> str | None:
        params = req.sampling_params
        for stop in params.stop:
            idx = track.text.find(stop, max(0, track.num_sent_chars - len(stop)))
            if idx >= 0:
                end = idx + len(stop) if params.include_stop_str_in_output else idx
                track.text = track.text[:end]
                return stop
        return None

    def _completion(self, req: Request, track: _Track, finished: bool) -> CompletionOutput:
        hold = 0 if finished else max((len(s) for s in req.sampling_params.stop), default=1) - 1
        num_chars = max(track.num_sent_chars, len(track.text) - hold)
        delta_text = track.text[track.num_sent_chars : num_chars]
        delta_tokens = req.output_token_ids[track.num_sent_tokens :]
        # NOTE: copies, not the request's lists: the engine thread appends to those while the
        # event loop still formats this output (a stream then named later tokens' strings)
        logprobs = None
        if req.sampling_params.logprobs is not None:
            logprobs = list(req.output_logprobs)
        delta_logprobs = logprobs[len(logprobs) - len(delta_tokens) :] if logprobs else []
        track.num_sent_chars, track.num_sent_tokens = num_chars, req.num_output_tokens
        return CompletionOutput(
            index=0,
            text=track.text,
            token_ids=list(req.output_token_ids),
            finish_reason="stop" if track.stopped_by else req.finish_reason,
            stop_reason=track.stopped_by or req.stop_reason,
            logprobs=logprobs,
            delta_text=delta_text,
            delta_token_ids=delta_tokens,
            delta_logprobs=delta_logprobs,
        )
