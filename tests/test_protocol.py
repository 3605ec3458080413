"""The OpenAI protocol layer: request validation (400s with `param`), conversion to
SamplingParams, chat prompts. Responses and logprobs: test_protocol_responses.py."""

from __future__ import annotations

import json

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from common.api.errors import InvalidRequestError
from common.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
    validation_error_to_api_error,
)
from common.engine.sampling_params import StructuredOutputs
from common.tokenizer import Tokenizer

USER = [{"role": "user", "content": "hi"}]


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


@pytest.mark.parametrize("make", [completion, chat], ids=["completions", "chat"])
def test_unknown_top_level_fields_are_ignored_as_vllm_does(make):
    """vllm-router adds `no_stop_trim`; clients add their own. Not-implemented fields at their
    inert value change nothing, so they pass too; inside the body a typo is still a 400."""
    req = make(no_stop_trim=True, frobnicate={"x": 1}, use_beam_search=False, bad_words=None)
    assert req.ignored_fields == ["bad_words", "frobnicate", "no_stop_trim", "use_beam_search"]
    assert make().ignored_fields == []
    assert make(max_tokens=3, frobnicate=1).to_sampling_params(100) == make(
        max_tokens=3
    ).to_sampling_params(100)
    assert param_of(make, stream=True, stream_options={"bogus": 1}) == "stream_options.bogus"


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
        ({"guided_json": 3}, "guided_json", ""),
        ({"response_format": {"type": "xml"}}, "response_format.type", ""),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structural_tag", "not supported"),
        ({"structured_outputs": {"regex": "a", "bogus": 1}}, "structured_outputs.bogus", ""),
        ({"prompt_logprobs": 1}, "prompt_logprobs", "not supported"),
        ({"use_beam_search": True}, "use_beam_search", "not supported"),
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
        ({"stream_options": {"include_usage": True}}, "stream_options", "stream"),
        ({"continue_final_message": True}, "continue_final_message", "add_generation_prompt"),
        (
            {"continue_final_message": True, "add_generation_prompt": False},
            "messages",
            "assistant",
        ),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "tools"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools.0.function.name", "required"),
        *[  # a past call whose function is not an object was a 500 (found by the fuzzer)
            (
                {"messages": [*USER, {"role": "assistant", "tool_calls": [call]}]},
                "messages.1.tool_calls",
                words,
            )
            for call, words in [
                ({"id": "1", "type": "function", "function": ["f"]}, "'function' object"),
                ({"id": "1", "type": "function", "function": "f"}, "'function' object"),
                ({"id": "1", "type": "function", "function": {"arguments": "{}"}}, "'name'"),
                ({"id": "1", "function": {"name": "f", "arguments": 5}}, "arguments"),
            ]
        ],
        ({"echo": True}, "echo", "echo is not supported"),
        ({"logit_bias": {"1": 5}}, "logit_bias", "not supported"),
        ({"guided_regex": 5}, "guided_regex", ""),
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


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "f"),
        ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice", "not supported"),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "tool_choice",
            "'g'",
        ),
        (
            {
                "tools": [TOOL],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
            "cannot be combined with response_format",
        ),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "guided_regex",
            "set one of",
        ),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "one of"),
    ],
)
def test_structured_output_and_tool_choice_400s(fields, param, words):
    with pytest.raises(InvalidRequestError) as info:
        chat(**fields).to_sampling_params(100)
    assert info.value.param == param
    assert words in info.value.message


def test_every_structured_field_sets_the_same_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    text = json.dumps(schema)
    forms = [
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": schema},
            }
        },
        {"structured_outputs": {"json": schema}},
        {"structured_outputs": {"json": text}},
        {"guided_json": schema},
        {"guided_json": text},
    ]
    specs = {chat(**form).to_sampling_params(100).structured for form in forms}
    assert specs == {StructuredOutputs(json=text)}
    assert chat(response_format={"type": "text"}).to_sampling_params(100).structured is None
    assert completion(guided_choice=["a", "b"]).to_sampling_params(99).structured.choice == (
        "a",
        "b",
    )
    required = chat(tools=[TOOL], tool_choice="required", parallel_tool_calls=False)
    forced = json.loads(required.to_sampling_params(100).structured.json)
    assert forced["type"] == "array" and forced["maxItems"] == 1
