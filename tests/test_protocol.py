"""The OpenAI protocol layer: request validation (400s with `param`), conversion to
SamplingParams, chat prompts, response JSON that the `openai` client parses, logprob builders."""

from __future__ import annotations

import json
import math

import openai.types as oai
import pytest
from fastapi.exceptions import RequestValidationError
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import ValidationError

from common.api.errors import InvalidRequestError
from common.api.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    UsageInfo,
    chat_logprobs,
    completion_logprobs,
    parse_request,
    validation_error_to_api_error,
)
from common.engine.sampler import SampledToken
from common.tokenizer import Tokenizer
from tests.tiny_tokenizer import write_tiny_tokenizer

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("tiny_tokenizer")
    write_tiny_tokenizer(folder)
    return Tokenizer.from_dir(folder)


def completion(**fields) -> CompletionRequest:
    return parse_request(CompletionRequest, {"prompt": "hello", **fields})


def chat(**fields) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, {"messages": USER, **fields})


def param_of(make, **fields) -> str | None:
    with pytest.raises(InvalidRequestError) as info:
        make(**fields)
    assert info.value.status_code == 400
    return info.value.param


# ---------------------------------------------------------------- request validation


@pytest.mark.parametrize("prompt", ["", [], [""], [[]], ["a", ""], 5, [1, "a"], [True], None])
def test_bad_prompt_is_400_on_prompt(prompt):
    assert param_of(completion, prompt=prompt) == "prompt"


def test_prompt_shapes_are_accepted():
    assert completion(prompt="a").prompts == ["a"]
    assert completion(prompt=["a", "b"]).prompts == ["a", "b"]
    assert completion(prompt=[1, 2]).prompts == [[1, 2]]
    assert completion(prompt=[[1], [2, 3]]).prompts == [[1], [2, 3]]


def test_missing_prompt_names_prompt():
    with pytest.raises(InvalidRequestError) as info:
        parse_request(CompletionRequest, {"max_tokens": 3})
    assert info.value.param == "prompt"
    assert "prompt" in info.value.message


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"echo": True}, "echo", "not supported"),
        ({"suffix": "x"}, "suffix", "not supported"),
        ({"logit_bias": {"1": 5}}, "logit_bias", "not supported"),
        ({"best_of": 2}, "best_of", "best_of"),
        ({"logprobs": 21}, "logprobs", "20"),
        ({"logprobs": -1}, "logprobs", "0"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "stream"),
        ({"stream": True, "stream_options": {"bogus": 1}}, "stream_options.bogus", "bogus"),
        ({"temperature": "hot"}, "temperature", "number"),
        ({"frobnicate": 1}, "frobnicate", "Unrecognized request argument supplied: frobnicate"),
    ],
)
def test_completion_400s(fields, param, words):
    with pytest.raises(InvalidRequestError) as info:
        completion(**fields)
    assert info.value.param == param
    assert words in info.value.message


def test_completion_accepts_the_harmless_forms():
    request = completion(
        echo=False, suffix="", logit_bias={}, best_of=3, n=3, stream=True,
        stream_options={"include_usage": True}, kv_transfer_params={"do_remote_decode": True},
    )  # fmt: skip
    assert request.best_of == request.n == 3
    assert request.stream_options.include_usage
    assert request.kv_transfer_params == {"do_remote_decode": True}


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"messages": []}, "messages", "empty"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "role"),
        ({"messages": [{"role": "user", "content": "x", "foo": 1}]}, "messages.0.foo", "foo"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "content"),
        (
            {
                "messages": [
                    *USER,
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "a"},
                            {"type": "image_url", "image_url": {"url": "http://x"}},
                        ],
                    },
                ]
            },
            "messages.1.content",
            "'image_url'",
        ),  # fmt: skip
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content", ""),
        ({"top_logprobs": 3}, "top_logprobs", "logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "20"),
        ({"tool_choice": "required"}, "tool_choice", "not supported"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", ""),
        ({"response_format": {"type": "json_object"}}, "response_format", "not supported"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "stream"),
        ({"continue_final_message": True}, "continue_final_message", "add_generation_prompt"),
        (
            {"continue_final_message": True, "add_generation_prompt": False},
            "messages",
            "assistant",
        ),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "tools"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools.0.function.name", "required"),
        ({"echo": True}, "echo", "Unrecognized"),
    ],
)
def test_chat_400s(fields, param, words):
    with pytest.raises(InvalidRequestError) as info:
        chat(**fields)
    assert info.value.param == param
    assert words in info.value.message


def test_missing_messages_names_messages():
    assert param_of(parse_request, model=ChatCompletionRequest, body={}) == "messages"


def test_chat_accepts_tools_and_openai_extras():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    request = chat(
        tools=[tool], tool_choice="auto", parallel_tool_calls=True,
        response_format={"type": "text"},
        messages=[*USER, {"role": "assistant", "content": None, "refusal": None,
                          "tool_calls": [{"id": "1", "type": "function",
                                          "function": {"name": "f", "arguments": "{}"}}]},
                  {"role": "tool", "content": "42", "tool_call_id": "1"}],
    )  # fmt: skip
    assert request.tools[0].function.name == "f"


def test_validation_error_to_api_error_directly():
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": USER, "temperature": [1]})
    err = validation_error_to_api_error(info.value)
    assert isinstance(err, InvalidRequestError)
    assert err.param == "temperature"
    assert err.to_response().error.type == "invalid_request_error"


def test_fastapi_body_prefix_is_dropped():
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": "x", "top_k": "many"})
    wrapped = RequestValidationError(
        [{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()]
    )
    assert validation_error_to_api_error(wrapped).param == "top_k"


def test_json_text_body():
    assert parse_request(CompletionRequest, b'{"prompt": "x"}').prompt == "x"
    assert param_of(parse_request, model=CompletionRequest, body=b"{not json") is None


# ---------------------------------------------------------------- to_sampling_params


def test_completion_defaults():
    params = completion().to_sampling_params(100)
    assert params.max_tokens == 16  # OpenAI's default for completions
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (1.0, 1.0, 0, 0.0)
    assert (params.presence_penalty, params.frequency_penalty) == (0.0, 0.0)
    assert params.repetition_penalty == 1.0
    assert params.logprobs is None and params.seed is None and params.n == 1
    assert params.stop == [] and params.stop_token_ids == []
    assert params.skip_special_tokens and not params.ignore_eos


def test_completion_mapping():
    request = completion(
        max_tokens=None, temperature=0, top_p=0.5, top_k=7, min_p=0.1, seed=3, n=2,
        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2, stop="###",
        stop_token_ids=[5], logprobs=0, ignore_eos=True, min_tokens=2,
        skip_special_tokens=False, include_stop_str_in_output=True,
    )  # fmt: skip
    params = request.to_sampling_params(50)
    assert params.max_tokens == 50  # None: whatever the context has left
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0, 0.5, 7, 0.1)
    assert (params.seed, params.n, params.logprobs, params.min_tokens) == (3, 2, 0, 2)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
    assert params.repetition_penalty == 1.2
    assert params.stop == ["###"] and params.stop_token_ids == [5]
    assert params.ignore_eos and params.include_stop_str_in_output
    assert not params.skip_special_tokens


def test_chat_defaults_and_logprobs_mapping():
    params = chat().to_sampling_params(77)
    assert params.max_tokens == 77  # chat has no default cap
    assert params.temperature == 1.0 and params.top_p == 1.0 and params.logprobs is None
    assert chat(logprobs=True).to_sampling_params(10).logprobs == 0
    assert chat(logprobs=True, top_logprobs=5).to_sampling_params(10).logprobs == 5


def test_max_completion_tokens_wins():
    assert chat(max_tokens=5, max_completion_tokens=9).to_sampling_params(100).max_tokens == 9
    assert chat(max_tokens=5).to_sampling_params(100).max_tokens == 5


@pytest.mark.parametrize(
    "make, fields, param",
    [
        (completion, {"temperature": -1}, "temperature"),
        (completion, {"top_p": 0}, "top_p"),
        (completion, {"top_k": -2}, "top_k"),
        (completion, {"n": 0}, "n"),
        (completion, {"max_tokens": 0}, "max_tokens"),
        (completion, {"max_tokens": 101}, "max_tokens"),
        (completion, {"min_tokens": 20}, "min_tokens"),
        (completion, {"presence_penalty": 3}, "presence_penalty"),
        (completion, {"repetition_penalty": 0}, "repetition_penalty"),
        (completion, {"stop": ["ok", ""]}, "stop"),
        (chat, {"max_completion_tokens": 0, "max_tokens": 5}, "max_completion_tokens"),
        (chat, {"max_tokens": 0}, "max_tokens"),
        (chat, {"max_tokens": 101}, "max_tokens"),
        (chat, {"min_p": 2}, "min_p"),
    ],
)
def test_sampling_errors_name_the_request_field(make, fields, param):
    with pytest.raises(InvalidRequestError) as info:
        make(**fields).to_sampling_params(100)
    assert info.value.param == param
    assert info.value.message.startswith(param)


def test_full_context_blames_the_prompt():
    assert param_of(lambda: completion().to_sampling_params(0)) == "prompt"
    assert param_of(lambda: chat().to_sampling_params(0)) == "messages"


def test_chat_top_logprobs_error_is_renamed():
    request = chat(logprobs=True, top_logprobs=3)
    request.top_logprobs = 30  # past the model check, as if validate_assignment were off
    with pytest.raises(InvalidRequestError) as info:
        request.to_sampling_params(10)
    assert info.value.param == "top_logprobs"
    assert info.value.message.startswith("top_logprobs must be")


# ---------------------------------------------------------------- chat prompts


def test_text_parts_are_joined(tokenizer: Tokenizer):
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    request = chat(messages=[{"role": "user", "content": parts}])
    assert request.messages[0].text == "one\ntwo"
    prompt = request.render_prompt(tokenizer)
    assert prompt == "<|im_start|>user\none\ntwo<|im_end|>\n<|im_start|>assistant\n"


def test_render_prompt_options(tokenizer: Tokenizer):
    no_gen = chat(add_generation_prompt=False).render_prompt(tokenizer)
    assert no_gen == "<|im_start|>user\nhi<|im_end|>\n"
    messages = [*USER, {"role": "assistant", "content": "Sure, the"}]
    cont = chat(messages=messages, continue_final_message=True, add_generation_prompt=False)
    assert cont.render_prompt(tokenizer).endswith("<|im_start|>assistant\nSure, the")


def test_template_failure_is_a_400(tokenizer: Tokenizer):
    request = chat(messages=[{"role": "assistant", "content": None}])
    assert param_of(lambda: request.render_prompt(tokenizer)) == "messages"


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
