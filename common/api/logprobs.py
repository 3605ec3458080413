"""Logprobs in OpenAI's two shapes, built from the sampler's `SampledToken`s.

- completions: parallel lists `tokens`, `token_logprobs`, `top_logprobs` (one `{token: logprob}`
  dict per position: the requested top entries plus the sampled token, as OpenAI and vLLM do)
  and `text_offset` (character offset of each token in the completion text);
- chat: `content`, one entry per token with its logprob, UTF-8 bytes and `top_logprobs`
  (exactly the requested top entries).

A token's string is `tokenizer.decode([id], skip_special_tokens=False)`; a token that is part of a
multi-byte character therefore reads as U+FFFD, as in vLLM. Logprobs of `-inf` are written as
-9999.0 (OpenAI's value for "very unlikely"), since JSON has no infinity.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel

if TYPE_CHECKING:  # NOTE: the proxy imports the protocol models, and must not import torch
    from common.engine.sampler import SampledToken
    from common.tokenizer import Tokenizer

MIN_LOGPROB = -9999.0


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobToken] = []


def completion_logprobs(
    tokenizer: Tokenizer, tokens: list[SampledToken], text_offset: int
) -> CompletionLogprobs:
    """Logprobs of `tokens`, the first of which starts at character `text_offset` of the text."""
    out = CompletionLogprobs()
    offset = text_offset
    for token in tokens:
        text, logprob = _token_str(tokenizer, token.token_id), _logprob_of(token)
        top = {_token_str(tokenizer, i): _clamp(lp) for i, lp in token.top_logprobs or []}
        top.setdefault(text, logprob)
        out.tokens.append(text)
        out.token_logprobs.append(logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def chat_logprobs(tokenizer: Tokenizer, tokens: list[SampledToken]) -> ChatLogprobs:
    content = []
    for token in tokens:
        top = [_top_logprob(tokenizer, i, lp) for i, lp in token.top_logprobs or []]
        entry = _top_logprob(tokenizer, token.token_id, _logprob_of(token))
        content.append(ChatLogprobToken(**entry.model_dump(), top_logprobs=top))
    return ChatLogprobs(content=content)


def _top_logprob(tokenizer: Tokenizer, token_id: int, logprob: float) -> TopLogprob:
    text = _token_str(tokenizer, token_id)
    return TopLogprob(token=text, logprob=_clamp(logprob), bytes=list(text.encode("utf-8")))


def _token_str(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _logprob_of(token: SampledToken) -> float:
    assert token.logprob is not None, f"token {token.token_id} was sampled without logprobs"
    return _clamp(token.logprob)


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)
