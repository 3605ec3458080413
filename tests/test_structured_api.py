"""Structured outputs and tool calling over HTTP, driven by the OpenAI SDK: against a decode
worker alone (colocated) and through proxies in pull mode (P's first token streamed early, and
not), and push mode. P's first token is constrained by the same grammar, D continues it, and
the answer equals colocated, token for token, from KV that D loaded.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from tests.servers import kv_sources, wait_until

TOKEN = "cluster-secret"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "units": {"enum": ["metric", "imperial"]},
    },
    "required": ["city", "days", "units"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast for a city",
        "parameters": SCHEMA,
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
MODES = ["colocated", "pull", "pull-no-first-token", "push"]


@pytest.fixture(scope="module")
def model(tiny_model, tmp_path_factory) -> Path:
    """The tiny llama with room for the tools' description (the tiny tokenizer, trained on
    Python source, spends ~2 characters a token): 2048 positions instead of 512."""
    folder = tmp_path_factory.mktemp("long") / "tiny-llama-long"
    shutil.copytree(tiny_model("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    return folder


@pytest.fixture(scope="module")
def cluster(start_server, model):
    common = ["--model", str(model), "--num-blocks", "320", "--max-model-len", "2048"]
    common += ["--no-prefix-caching", "--internal-token", TOKEN, "--served-model-name", "tiny"]
    p, d = start_server("prefill", *common, wait=False), start_server("decode", *common, wait=False)
    p, d = p.wait_ready(), d.wait_ready()  # started side by side
    proxy_args = ["--prefill", p.url, "--decode", d.url, "--internal-token", TOKEN]
    proxies = {
        "pull": start_server("proxy", *proxy_args),
        "pull-no-first-token": start_server("proxy", *proxy_args, "--no-first-token-from-prefill"),
        "push": start_server("proxy", *proxy_args, "--mode", "push"),
    }
    return p, d, proxies


def client(cluster, mode: str) -> openai.OpenAI:
    p, d, proxies = cluster
    url = d.url if mode == "colocated" else proxies[mode].url
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def chat(cluster, mode: str, stream: bool, **fields) -> tuple[dict, list[int]]:
    """The answer's first choice as a dict (message or the stream's joined deltas) and its
    token ids, greedy."""
    fields = {"model": "tiny", "messages": ASK, "max_tokens": 80, "temperature": 0, **fields}
    extra = {"return_token_ids": True, **fields.pop("extra_body", {})}
    c = client(cluster, mode)
    if not stream:
        answer = c.chat.completions.create(**fields, extra_body=extra)
        choice = answer.choices[0]
        message = choice.message.model_dump(exclude_none=True)
        return {**message, "finish_reason": choice.finish_reason}, choice.token_ids
    content, calls, ids, finish = "", {}, [], None
    for chunk in c.chat.completions.create(**fields, stream=True, extra_body=extra):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                joined = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                joined["id"] = joined["id"] or call.id
                joined["name"] += call.function.name or ""
                joined["arguments"] += call.function.arguments or ""
            ids += getattr(choice, "token_ids", None) or []
            finish = choice.finish_reason or finish
    tool_calls = [
        {
            "id": c["id"],
            "type": "function",
            "function": {"name": c["name"], "arguments": c["arguments"]},
        }
        for _, c in sorted(calls.items())
    ]
    answer = {"content": content or None, "finish_reason": finish}
    return {**answer, **({"tool_calls": tool_calls} if tool_calls else {})}, ids


def loaded(d) -> float:
    sources = kv_sources(d)
    return sources["pull"] + sources["push"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_json_schema_output_validates_and_pd_equals_colocated(cluster, stream):
    _, d, _ = cluster
    body = dict(
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}
    )
    colocated, colocated_ids = chat(cluster, "colocated", stream, **body)
    jsonschema.validate(json.loads(colocated["content"]), SCHEMA)
    assert colocated["finish_reason"] == "stop"
    for mode in MODES[1:]:
        before = loaded(d)
        answer, ids = chat(cluster, mode, stream, **body)
        assert ids == colocated_ids and answer == colocated, mode
        assert wait_until(lambda b=before: loaded(d) == b + 1), f"{mode}: D did not load the KV"


def test_every_structured_field_through_the_proxy(cluster):
    """vLLM's spellings reach the workers unchanged and constrain P's and D's tokens."""
    forms = {
        "json_object": dict(response_format={"type": "json_object"}),
        "structured_outputs.regex": dict(extra_body={"structured_outputs": {"regex": "[a-e]{4}!"}}),
        "guided_choice": dict(extra_body={"guided_choice": ["sunny", "rain", "snow"]}),
        "guided_grammar": dict(extra_body={"guided_grammar": 'root ::= "t=" [0-9] [0-9]'}),
        "guided_json": dict(extra_body={"guided_json": SCHEMA}),
    }
    d = cluster[1]
    for name, body in forms.items():
        colocated, colocated_ids = chat(cluster, "colocated", False, **body)
        before = loaded(d)
        answer, ids = chat(cluster, "pull", True, **body)
        assert ids == colocated_ids and answer["content"] == colocated["content"], name
        assert wait_until(lambda b=before: loaded(d) == b + 1), f"{name}: D did not load the KV"
    text = lambda body: chat(cluster, "push", False, **body)[0]["content"]  # noqa: E731
    assert isinstance(json.loads(text(forms["json_object"])), dict)
    assert text(forms["structured_outputs.regex"])[-1] == "!"
    assert text(forms["guided_choice"]) in ("sunny", "rain", "snow")
    assert text(forms["guided_grammar"])[:2] == "t="
    jsonschema.validate(json.loads(text(forms["guided_json"])), SCHEMA)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("mode", ["colocated", "pull", "push"])
def test_tool_choice_required_gives_calls_whose_arguments_validate(cluster, mode, stream):
    answer, _ = chat(
        cluster, mode, stream, tools=[WEATHER, TIME], tool_choice="required", max_tokens=120
    )
    assert answer["finish_reason"] == "tool_calls" and not answer.get("content")
    assert answer["tool_calls"]
    for call in answer["tool_calls"]:
        assert call["id"].startswith("call_") and call["type"] == "function"
        tool = {"get_weather": WEATHER, "get_time": TIME}[call["function"]["name"]]
        jsonschema.validate(
            json.loads(call["function"]["arguments"]), tool["function"]["parameters"]
        )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_named_tool_choice_calls_that_function(cluster, stream):
    choice = {"type": "function", "function": {"name": "get_time"}}
    answer, _ = chat(cluster, "pull", stream, tools=[WEATHER, TIME], tool_choice=choice)
    assert answer["finish_reason"] == "stop" and len(answer["tool_calls"]) == 1
    call = answer["tool_calls"][0]["function"]
    assert call["name"] == "get_time" and json.loads(call["arguments"])["zone"] in ("UTC", "CET")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_parses_a_call_in_the_models_format(cluster, stream):
    """The output is forced to a hand-made Hermes call (a guided choice next to tool_choice
    auto): the parser turns it into tool_calls, and the text before it stays content."""
    arguments = {"city": "Paris", "days": 3, "units": "metric"}
    call_json = json.dumps({"name": "get_weather", "arguments": arguments})
    made = f"Let me check. <tool_call>\n{call_json}\n</tool_call>"
    body = dict(tools=[WEATHER], tool_choice="auto", extra_body={"guided_choice": [made]})
    body["max_tokens"] = 300
    answer, _ = chat(cluster, "pull", stream, **body)
    assert answer["finish_reason"] == "tool_calls"
    assert answer["content"].strip() == "Let me check."
    [call] = answer["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {
        "city": "Paris",
        "days": 3,
        "units": "metric",
    }
    plain, _ = chat(
        cluster,
        "pull",
        stream,
        tools=[WEATHER],
        tool_choice="none",
        max_tokens=300,
        extra_body={"guided_choice": [made]},
    )
    assert plain["content"] == made and "tool_calls" not in plain


def test_history_with_tool_results_renders_through_the_template(cluster, tokenizer):
    _, d, _ = cluster
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "days": 3, "units": "metric"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    r = httpx.post(
        f"{d.url}/v1/chat/completions/render",
        json={"model": "tiny", "messages": history, "tools": [WEATHER]},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    prompt = tokenizer.decode(r.json()["token_ids"], skip_special_tokens=False)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    answer, _ = chat(cluster, "pull", False, messages=history, tools=[WEATHER], max_tokens=5)
    assert answer["finish_reason"] in ("stop", "length")  # and it runs, through P and D


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            dict(
                response_format={"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}
            ),
            "response_format",
        ),
        (dict(extra_body={"guided_regex": "(unclosed"}), "guided_regex"),
        (
            dict(extra_body={"structured_outputs": {"grammar": "start: missing_rule"}}),
            "structured_outputs",
        ),
        (
            dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
            "tool_choice",
        ),
        (dict(tool_choice="required"), "tool_choice"),
    ],
)
@pytest.mark.parametrize("mode", ["colocated", "pull"])
def test_bad_schemas_and_tool_names_are_400s(cluster, mode, body, param):
    _, d, _ = cluster
    with pytest.raises(openai.BadRequestError) as info:
        chat(cluster, mode, True, **body)
    assert info.value.body["param"] == param
    assert d.metric("pdserve_num_requests_running") == 0


def test_token_the_grammar_refuses_is_a_400_not_wrong_output(cluster):
    """D given a first token from an unconstrained P, off the grammar: an error in OpenAI's
    shape (the request's fault), and P's blocks come back."""
    p, d, _ = cluster
    prompt = {"model": "tiny", "prompt": "hello", "temperature": 0}
    r = httpx.post(
        f"{p.url}/v1/completions",
        json={**prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        headers={"X-Internal-Token": TOKEN},
        timeout=30,
    )
    params = r.json()["kv_transfer_params"]
    r = httpx.post(
        f"{d.url}/v1/completions",
        json={
            **prompt,
            "max_tokens": 8,
            "guided_choice": ["\u00e9t\u00e9"],
            "kv_transfer_params": params,
        },
        headers={"X-Internal-Token": TOKEN},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "does not follow the grammar" in r.json()["error"]["message"]
    assert wait_until(lambda: p.metric("pdserve_kv_blocks_used") == 0)


def test_grammar_cost_is_bounded_at_the_worker(cluster):
    """What a grammar may cost, through a real worker (docs/security.md, "Grammar cost"): n
    over --max-grammar-rows is a 400 naming n; the regex that once cost ~0.1 s a step is a 400
    that is the request's own (refused at admission, or ended for its cost), naming the limit;
    D's blocks come back, and /metrics shows grammar time and the refusals."""
    _, d, _ = cluster
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 32, "temperature": 0}
    url = f"{d.url}/v1/completions"
    r = httpx.post(url, json={**body, "n": 17, "guided_regex": "[0-9]+"}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == ("n", "limit_exceeded")
    assert "--max-grammar-rows" in error["message"]
    r = httpx.post(url, json={**body, "guided_regex": "((a{70}){70}){70}"}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "grammar_too_expensive")
    assert "--grammar-" in error["message"], error
    assert wait_until(lambda: d.metric("pdserve_kv_blocks_used") == 0)
    assert d.metric('pdserve_grammar_seconds_count{op="compile"}') >= 1
    assert d.metric('pdserve_grammar_refusals_total{reason="rows"}') >= 1
