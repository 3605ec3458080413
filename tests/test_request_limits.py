"""The request limits (common/api/limits.py) in-process: the depth scan agrees with the parser,
each limit names its flag and field, and the proxy's and the worker's flags build the same
limits. The hostile requests themselves go through real processes in tests/test_bad_input.py."""

from __future__ import annotations

import json
import random

import pytest

from common.api.cli import parse_args as worker_args
from common.api.errors import InvalidRequestError
from common.api.http import parse_json_object
from common.api.limits import LIMIT_CODE, RequestLimits, check_body, json_shape, loads_bounded
from common.api.tools import tool_call_from_named, tool_calls_from_required
from proxy.config import from_dict
from proxy.config import parse_args as proxy_args


def _depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


def _random_json(rng: random.Random, depth: int):
    if depth == 0 or rng.random() < 0.2:
        return rng.choice([1, "a[{", 'q"]}\\', "\\\\", None, "ü{", 2.5, "é]\n[", '\\"[', "\\"])
    if rng.random() < 0.5:
        return [_random_json(rng, depth - 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}[": _random_json(rng, depth - 1) for i in range(rng.randint(0, 3))}


def test_the_shape_scan_agrees_with_the_parsed_structure():
    rng = random.Random(0)
    for _ in range(500):
        value = _random_json(rng, rng.randint(0, 12))
        if rng.random() < 0.5:
            value = {f'k:{i}"': _random_json(rng, 4) for i in range(rng.randint(0, 6))}
        fields = len(value) if isinstance(value, dict) else 0
        for text in (json.dumps(value), json.dumps(value, ensure_ascii=False, indent=1)):
            assert json_shape(text.encode()) == (_depth(value), fields), text


def test_a_wide_body_is_refused_before_it_is_parsed():
    body = json.dumps({"prompt": "a:b", **{f"x{i}": {"y": 1} for i in range(300)}}).encode()
    with pytest.raises(InvalidRequestError) as e:
        parse_json_object(body, 64, max_fields=256)
    assert "--max-fields" in e.value.message and "is 301" in e.value.message
    assert len(parse_json_object(body, 64, max_fields=301)) == 301


def test_a_deep_body_is_refused_before_it_is_parsed():
    limits = RequestLimits(max_json_depth=8)
    ok = {"prompt": "[[[[[[[[[[", "x": [[[[[[[1]]]]]]]}  # 8 deep, brackets in a string
    assert parse_json_object(json.dumps(ok).encode(), limits.max_json_depth) == ok
    for raw in (b'{"x": [[[[[[[[1]]]]]]]]}', b"[" * 100_000, b'{"a":' * 5000):
        with pytest.raises(InvalidRequestError) as e:
            parse_json_object(raw, limits.max_json_depth)
        assert e.value.code == LIMIT_CODE and "--max-json-depth" in e.value.message


def _refusal(body: dict, is_chat: bool = False, **limits) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as e:
        check_body(body, is_chat, RequestLimits(**limits))
    assert e.value.code == LIMIT_CODE, e.value.message
    return e.value


CHAT_CALL = {"type": "function", "id": "c1", "function": {"name": "f", "arguments": "x"}}


@pytest.mark.parametrize(
    "body, is_chat, flag, param",
    [
        ({"prompt": "hi", "n": 10**7}, False, "--max-n", "n"),
        ({"prompt": "hi", "best_of": 129}, False, "--max-n", "best_of"),
        ({"prompt": "hi", "logprobs": 21}, False, "--max-logprobs", "logprobs"),
        ({"messages": [], "top_logprobs": 21}, True, "--max-logprobs", "top_logprobs"),
        ({"messages": [], "max_completion_tokens": 2**70}, True, "--max-tokens",
         "max_completion_tokens"),
        ({"prompt": "hi", "stop": ["a"] * 17}, False, "--max-stop", "stop"),
        ({"prompt": "hi", "stop": "a" * 1025}, False, "--max-stop-chars", "stop"),
        ({"prompt": "hi", "stop_token_ids": [1] * 1025}, False, "--max-stop-token-ids",
         "stop_token_ids"),
        ({"messages": [], "tools": [{}] * 129}, True, "--max-tools", "tools"),
        ({"messages": [], "tools": [{"d": "a" * (256 << 10)}]}, True, "--max-tools-bytes",
         "tools"),
        ({"prompt": "hi", "guided_choice": ["a"] * 1025}, False, "--max-choices",
         "guided_choice"),
        ({"prompt": "hi", "guided_regex": "a" * (64 << 10) + "a"}, False, "--max-spec-bytes",
         "guided_regex"),
        ({"prompt": "hi", "structured_outputs": {"grammar": "a" * (65 << 10)}}, False,
         "--max-spec-bytes", "structured_outputs.grammar"),
        ({"prompt": "hi", "guided_json": "[" * 65 + "]" * 65}, False, "--max-json-depth",
         "guided_json"),
        ({"messages": [{"role": "assistant", "tool_calls": [{**CHAT_CALL, "function": {
            "name": "f", "arguments": '{"a":' * 900 + "1" + "}" * 900}}]}]}, True,
         "--max-json-depth", "messages.0.tool_calls.0.function.arguments"),
        ({f"x{i}": 1 for i in range(257)}, False, "--max-fields", None),
        ({"prompt": "hi", "cache_salt": "s" * 1025}, False, "--max-cache-salt-chars",
         "cache_salt"),
    ],
)  # fmt: skip
def test_each_limit_names_its_flag_and_field(body, is_chat, flag, param):
    error = _refusal(body, is_chat)
    assert flag in error.message and error.param == param, (error.message, error.param)


def test_requests_within_the_limits_pass():
    check_body({"prompt": "hi", "n": 128, "stop": ["a"] * 16, "logprobs": 20}, False,
               RequestLimits())  # fmt: skip
    call = {**CHAT_CALL, "function": {"name": "f", "arguments": '{"a": [1, {"b": 2}]}'}}
    body = {"messages": [{"role": "assistant", "tool_calls": [call]}], "tools": [{}] * 128}
    check_body(body, True, RequestLimits())
    check_body({"prompt": "hi", "n": "many", "stop": 5}, False, RequestLimits())  # models' 400


def test_the_proxy_and_the_worker_take_the_same_flags(tiny_model):
    flags = ["--max-n", "4", "--max-json-depth", "16", "--max-header-bytes", "4096"]
    expected = RequestLimits(max_n=4, max_json_depth=16, max_header_bytes=4096)
    assert proxy_args(["--decode", "http://d:1", *flags]).limits == expected
    _, server = worker_args("decode", ["--model", str(tiny_model("llama")), *flags])
    assert server.limits == expected
    # a config file's "limits" table, or the flat keys, as for every other setting
    assert from_dict({"decode": ["http://d:1"], "limits": {"max-n": 4}}).limits.max_n == 4
    assert from_dict({"decode": ["http://d:1"], "max_n": 4}).limits.max_n == 4
    with pytest.raises(ValueError, match="unknown limits"):
        from_dict({"decode": ["http://d:1"], "limits": {"max_x": 4}})
    with pytest.raises(ValueError, match="--max-n must be >= 1"):
        RequestLimits(max_n=0)


def test_a_models_deep_json_is_no_call_and_no_error():
    """The model's own output is bounded by no edge: JSON too deep for a call is text (before:
    a RecursionError, a 500)."""
    deep_array, deep_object = "[" * 5000 + "]" * 5000, '{"a":' * 900 + "1" + "}" * 900
    assert tool_calls_from_required(deep_array) == []
    assert tool_calls_from_required(f'[{{"name": "f", "parameters": {deep_object}}}]') == []
    assert tool_call_from_named("f", deep_object).function.arguments == deep_object
    with pytest.raises(ValueError):
        loads_bounded(deep_array)
    assert loads_bounded('{"a": [1, {"b": "[[["}]}') == {"a": [1, {"b": "[[["}]}
