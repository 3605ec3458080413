"""vLLM's render endpoints on a live worker: `/v1/completions/render` and
`/v1/chat/completions/render` answer, in vLLM 0.32's `GenerateRequest` shape, the token ids the
worker prefills for the same body (its `prompt_token_ids` and `usage.prompt_tokens` when it
generates) and the ones Hugging Face's tokenizer and chat template give independently; bad input
is the 400 (or 404) that generation gives, in OpenAI's error shape."""

from __future__ import annotations

import httpx
import pytest
import transformers

from tests.tiny_models import VOCAB

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "List three primes, then stop."},
]
PROMPT = "def fibonacci(n):\n    return"
MAX_MODEL_LEN = 128
# what vllm-router 0.1.17 POSTs to /v1/chat/completions/render (captured from its requests)
ROUTER_CHAT = {
    "model": "tiny", "messages": MESSAGES[1:], "stream": False, "max_tokens": 4,
    "logprobs": False, "no_stop_trim": False, "ignore_eos": False,
    "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
    "stream_reasoning": True, "return_hidden_states": False, "include_reasoning": True,
}  # fmt: skip
# vLLM's GenerateRequest, as its render endpoints dump it
GENERATE_REQUEST_FIELDS = {
    "request_id", "token_ids", "token_offsets", "features", "content_parts", "sampling_params",
    "model", "reasoning_ended", "reasoning_parser_kwargs", "return_token_ids", "output_mode",
    "stream", "stream_options", "cache_salt", "priority", "kv_transfer_params",
    "ec_transfer_params",
}  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return str(tiny_model("llama"))


@pytest.fixture(scope="module")
def server(start_server, model_dir):
    args = ["--model", model_dir, "--num-blocks", "64", "--max-model-len", str(MAX_MODEL_LEN)]
    return start_server("decode", *args, "--served-model-name", "tiny")


@pytest.fixture(scope="module")
def hf(model_dir):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


def render(server, path: str, body: dict, **headers: str):
    r = httpx.post(f"{server.url}{path}/render", json=body, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def generate(server, path: str, body: dict) -> dict:
    body = {**body, "max_tokens": 2, "return_token_ids": True}
    r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("prompt", [PROMPT, [5, 17, 300, 1023, 0, 2]], ids=["text", "token_ids"])
def test_completion_render_is_what_the_worker_prefills(server, hf, prompt):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 7, "temperature": 0}
    [item] = render(server, COMPLETIONS, body, **{"X-Request-Id": "r1"})
    out = generate(server, COMPLETIONS, body)
    assert item["token_ids"] == out["choices"][0]["prompt_token_ids"]
    assert len(item["token_ids"]) == out["usage"]["prompt_tokens"]
    assert item["token_ids"] == (hf.encode(prompt) if isinstance(prompt, str) else prompt)
    assert set(item) == GENERATE_REQUEST_FIELDS
    assert item["request_id"] == "cmpl-r1" and item["model"] == "tiny"
    assert item["output_mode"] == "tokens" and item["stream"] is False
    params = item["sampling_params"]
    assert params["max_tokens"] == 7 and params["temperature"] == 0 and params["n"] == 1


def test_completion_render_of_a_batch_has_one_item_per_prompt(server, hf):
    prompts = ["alpha beta", "gamma", "delta epsilon zeta"]
    items = render(server, COMPLETIONS, {"prompt": prompts}, **{"X-Request-Id": "b"})
    assert [i["request_id"] for i in items] == ["cmpl-b-0", "cmpl-b-1", "cmpl-b-2"]
    assert [i["token_ids"] for i in items] == [hf.encode(p) for p in prompts]
    out = generate(server, COMPLETIONS, {"prompt": prompts})
    prefilled = {c["index"]: c["prompt_token_ids"] for c in out["choices"]}
    assert [prefilled[k] for k in range(3)] == [i["token_ids"] for i in items]
    # max_tokens unset in the body of a completion: OpenAI's 16
    assert [i["sampling_params"]["max_tokens"] for i in items] == [16] * 3
    ids = render(server, COMPLETIONS, {"prompt": [[7, 8, 9], [1]]})
    assert [i["token_ids"] for i in ids] == [[7, 8, 9], [1]]


STREAMED = {"stream": True, "stream_options": {"include_usage": True}}


@pytest.mark.parametrize(
    "extra",
    [{}, {"add_generation_prompt": False}, STREAMED],
    ids=["generation prompt", "no generation prompt", "streamed"],
)
def test_chat_render_is_what_the_worker_prefills(server, hf, extra):
    body = {"model": "tiny", "messages": MESSAGES, **extra}
    item = render(server, CHAT, body, **{"X-Request-Id": "c1"})
    out = generate(server, CHAT, {**body, "stream": False, "stream_options": None})
    assert item["token_ids"] == out["prompt_token_ids"]
    assert len(item["token_ids"]) == out["usage"]["prompt_tokens"]
    text = hf.apply_chat_template(
        MESSAGES, add_generation_prompt=extra.get("add_generation_prompt", True), tokenize=False
    )
    assert item["token_ids"] == hf.encode(text, add_special_tokens=False)
    assert set(item) == GENERATE_REQUEST_FIELDS and item["request_id"] == "chatcmpl-c1"
    # max_tokens unset in a chat body: what the context has left after the prompt
    assert item["sampling_params"]["max_tokens"] == MAX_MODEL_LEN - len(item["token_ids"])
    if extra is STREAMED:
        assert item["stream"] is True and item["stream_options"]["include_usage"] is True
    else:
        assert item["stream"] is False and item["stream_options"] is None


def test_the_routers_own_body_renders(server, hf):
    """vllm-router's extra fields (no_stop_trim, separate_reasoning, ...) are ignored."""
    item = render(server, CHAT, ROUTER_CHAT)
    text = hf.apply_chat_template(MESSAGES[1:], add_generation_prompt=True, tokenize=False)
    assert item["token_ids"] == hf.encode(text, add_special_tokens=False)
    assert item["sampling_params"]["max_tokens"] == 4


HI = [{"role": "user", "content": "hi"}]
BAD = {  # name: (path, body, status, param)
    "no prompt": (COMPLETIONS, {"max_tokens": 3}, 400, "prompt"),
    "empty prompt": (COMPLETIONS, {"prompt": ""}, 400, "prompt"),
    "token id = vocab": (COMPLETIONS, {"prompt": [5, VOCAB]}, 400, "prompt"),
    "prompt fills the context": (COMPLETIONS, {"prompt": [5] * MAX_MODEL_LEN}, 400, "prompt"),
    "max_tokens past the context": (COMPLETIONS, {"prompt": "hi", "max_tokens": 500}, 400,
                                    "max_tokens"),
    "temperature negative": (COMPLETIONS, {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    "echo": (COMPLETIONS, {"prompt": "hi", "echo": True}, 400, "echo"),
    "no messages": (CHAT, {"messages": []}, 400, "messages"),
    "a message without role": (CHAT, {"messages": [{"content": "hi"}]}, 400, "messages.0.role"),
    "an image part": (CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages.0.content"),
    "logit_bias": (CHAT, {"messages": HI, "logit_bias": {"5": 1}}, 400, "logit_bias"),
    "another model": (CHAT, {"messages": HI, "model": "gpt-4"}, 404, "model"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_an_openai_error(server, name):
    path, body, status, param = BAD[name]
    r = httpx.post(f"{server.url}{path}/render", json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == ("invalid_request_error" if status == 400 else "not_found_error")
    assert error["param"] == param
    # generation refuses the same body the same way
    assert httpx.post(f"{server.url}{path}", json=body, timeout=30).status_code == status


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_a_body_that_is_not_a_json_object_is_a_400(server, path):
    r = httpx.post(f"{server.url}{path}/render", content=b'{"prompt": "hi",', timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_a_prefill_worker_renders_the_same(start_server, model_dir, server):
    args = ["--model", model_dir, "--num-blocks", "64", "--max-model-len", str(MAX_MODEL_LEN)]
    prefill = start_server(
        "prefill", *args, "--served-model-name", "tiny", "--kv-connector", "none"
    )
    for path, body in ((COMPLETIONS, {"prompt": PROMPT}), (CHAT, {"messages": MESSAGES})):
        headers = {"X-Request-Id": "same"}
        assert render(prefill, path, body, **headers) == render(server, path, body, **headers)
