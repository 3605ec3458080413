"""The OpenAI protocol layer's responses: JSON the `openai` client parses, logprob builders."""

from __future__ import annotations

import json
import math

import openai.types as oai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from common.api.protocol import (
    ChatChoice,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    UsageInfo,
    chat_logprobs,
    completion_logprobs,
)
from common.engine.sampler import SampledToken
from common.tokenizer import Tokenizer

USER = [{"role": "user", "content": "hi"}]


# ---------------------------------------------------------------- responses


def dumped(model) -> dict:
    return json.loads(model.model_dump_json(exclude_none=True))


def test_completion_response_parses_in_openai(tokenizer: Tokenizer):
    tokens = [SampledToken(t, -0.5, [(t, -0.5), (0, -2.0)]) for t in tokenizer.encode("ok go")]
    choice = CompletionChoice(
        index=0, text="ok go", finish_reason="length",
        logprobs=completion_logprobs(tokenizer, tokens, 0),
        prompt_token_ids=[1, 2], token_ids=[t.token_id for t in tokens],
    )  # fmt: skip
    response = CompletionResponse(
        model="tiny", choices=[choice], usage=UsageInfo.from_counts(2, len(tokens), 0),
        kv_transfer_params={"do_remote_prefill": True, "remote_host": None},
    )  # fmt: skip
    data = dumped(response)
    parsed = oai.Completion.model_validate(data)
    assert parsed.id.startswith("cmpl-") and parsed.object == "text_completion"
    assert "".join(parsed.choices[0].logprobs.tokens) == "ok go"
    assert parsed.usage.total_tokens == 2 + len(tokens)
    assert parsed.usage.prompt_tokens_details.cached_tokens == 0
    assert "stop_reason" not in data["choices"][0]
    assert data["choices"][0]["token_ids"] == [t.token_id for t in tokens]
    assert data["kv_transfer_params"] == {"do_remote_prefill": True, "remote_host": None}


def test_completion_stream_chunks():
    chunk = CompletionStreamResponse(
        id="cmpl-1", model="tiny", choices=[CompletionStreamChoice(index=0, text="a")]
    )
    data = dumped(chunk)
    assert data["choices"][0]["finish_reason"] is None and "finish_reason" in data["choices"][0]
    assert "usage" in data and data["usage"] is None
    assert "stop_reason" not in data["choices"][0]
    last = CompletionStreamChoice(index=0, text="", finish_reason="stop", stop_reason="###")
    final = CompletionStreamResponse(id="cmpl-1", model="tiny", choices=[last])
    assert oai.Completion.model_validate(dumped(final)).choices[0].finish_reason == "stop"
    usage = CompletionStreamResponse(id="cmpl-1", model="tiny", usage=UsageInfo.from_counts(1, 2))
    assert oai.Completion.model_validate(dumped(usage)).usage.total_tokens == 3


def test_chat_response_parses_in_openai(tokenizer: Tokenizer):
    tokens = [SampledToken(t, -0.1, [(t, -0.1)]) for t in tokenizer.encode("hello")]
    choice = ChatChoice(
        index=0, message=ChatResponseMessage(content="hello"), finish_reason="stop",
        logprobs=chat_logprobs(tokenizer, tokens),
    )  # fmt: skip
    response = ChatCompletionResponse(
        model="tiny", choices=[choice], usage=UsageInfo.from_counts(5, len(tokens))
    )
    data = dumped(response)
    parsed = ChatCompletion.model_validate(data)
    assert parsed.id.startswith("chatcmpl-") and parsed.object == "chat.completion"
    assert parsed.choices[0].message.role == "assistant"
    assert parsed.choices[0].message.content == "hello"
    assert "".join(c.token for c in parsed.choices[0].logprobs.content) == "hello"
    assert "prompt_token_ids" not in data and "kv_transfer_params" not in data


def test_chat_stream_chunks_parse_in_openai():
    first = ChatStreamChoice(index=0, delta=DeltaMessage(role="assistant", content=""))
    middle = ChatStreamChoice(index=0, delta=DeltaMessage(content="hi"))
    last = ChatStreamChoice(index=0, delta=DeltaMessage(), finish_reason="length")
    for choice in (first, middle, last):
        chunk = ChatCompletionStreamResponse(id="chatcmpl-1", model="tiny", choices=[choice])
        data = dumped(chunk)
        assert data["usage"] is None
        assert {"finish_reason", "logprobs"} <= data["choices"][0].keys()
        parsed = ChatCompletionChunk.model_validate(data)
        assert parsed.object == "chat.completion.chunk"
    assert dumped(last)["delta"] == {}
    usage = ChatCompletionStreamResponse(id="c", model="t", usage=UsageInfo.from_counts(1, 1))
    assert ChatCompletionChunk.model_validate(dumped(usage)).choices == []


def test_model_list_parses_in_openai():
    data = dumped(ModelList(data=[ModelCard(id="tiny", max_model_len=256)]))
    assert data["object"] == "list"
    model = oai.Model.model_validate(data["data"][0])
    assert (model.id, model.object, model.owned_by) == ("tiny", "model", "pdserve")
    assert data["data"][0]["max_model_len"] == 256


# ---------------------------------------------------------------- logprob builders


def test_completion_logprobs(tokenizer: Tokenizer):
    ids = tokenizer.encode("def f(x): return x")
    tokens = [SampledToken(t, -0.25, [(0, -0.1), (t, -0.25)]) for t in ids]
    tokens[-1] = SampledToken(ids[-1], -math.inf, [(0, -0.1)])
    out = completion_logprobs(tokenizer, tokens, text_offset=7)
    assert "".join(out.tokens) == "def f(x): return x"
    assert out.token_logprobs[:-1] == [-0.25] * (len(ids) - 1)
    assert out.token_logprobs[-1] == -9999.0  # JSON has no -inf
    assert out.text_offset[0] == 7
    assert out.text_offset[1:] == [7 + len("".join(out.tokens[:i])) for i in range(1, len(ids))]
    first = out.top_logprobs[0]
    assert first == {"<|endoftext|>": -0.1, out.tokens[0]: -0.25}  # top entries + the sampled one
    assert out.top_logprobs[-1] == {"<|endoftext|>": -0.1, out.tokens[-1]: -9999.0}
    assert json.loads(out.model_dump_json())["token_logprobs"][-1] == -9999.0


def test_completion_logprobs_zero_top_keeps_sampled(tokenizer: Tokenizer):
    token_id = tokenizer.encode("return")[0]
    out = completion_logprobs(tokenizer, [SampledToken(token_id, -1.5, [])], 0)
    assert out.top_logprobs == [{out.tokens[0]: -1.5}]


def test_chat_logprobs(tokenizer: Tokenizer):
    ids = tokenizer.encode("héllo")
    tokens = [SampledToken(t, -0.3, [(t, -0.3), (2, -1.0)]) for t in ids]
    out = chat_logprobs(tokenizer, tokens)
    assert len(out.content) == len(ids)
    assert b"".join(bytes(entry.bytes) for entry in out.content).decode("utf-8", "replace")
    for entry, token_id in zip(out.content, ids):
        assert entry.token == tokenizer.decode([token_id], skip_special_tokens=False)
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert entry.logprob == -0.3
        assert [(t.token, t.logprob) for t in entry.top_logprobs] == [
            (entry.token, -0.3),
            ("<|im_end|>", -1.0),
        ]
    if all("\ufffd" not in e.token for e in out.content):
        assert "".join(e.token for e in out.content) == "héllo"


def test_logprobs_need_sampled_logprobs(tokenizer: Tokenizer):
    with pytest.raises(AssertionError):
        chat_logprobs(tokenizer, [SampledToken(5)])
