"""Resume: a worker continues a choice that another worker started, exactly. A choice resumed
after G tokens must stream what the uninterrupted run streamed from token G on: the same
tokens (greedy, seeded, penalised, min_tokens), the same text (a stop string across the cut, a
character split across it, text held back for a stop string), the same counts.

Engine level here; the HTTP field (`resume` in the body, its 400s and 401) further down."""

from __future__ import annotations

import dataclasses
import json

import httpx
import pytest
import torch

from common.config import CacheConfig, EngineConfig, ModelConfig
from common.engine.engine import LLMEngine
from common.engine.output import OutputProcessor, decoded_text
from common.engine.request import Request, Resume
from common.engine.sampler import SampledToken
from common.engine.sampling_params import SamplingParams
from tests.tiny_models import VOCAB

PROMPT = torch.randint(3, VOCAB, (21,), generator=torch.Generator().manual_seed(11)).tolist()
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model):
    config = EngineConfig(
        ModelConfig(str(tiny_model("llama")), dtype="float32", max_model_len=256),
        CacheConfig(num_blocks=64),
    )
    return LLMEngine(config)


@dataclasses.dataclass
class Run:
    """One request's outputs, streamed: what each step added, and the last one."""

    deltas: list  # CompletionOutput per step, in order
    index: int

    @property
    def final(self):
        return self.deltas[-1]

    @property
    def new_tokens(self) -> list[int]:
        return [t for c in self.deltas for t in c.delta_token_ids]

    @property
    def new_text(self) -> str:
        return "".join(c.delta_text for c in self.deltas)


def run(engine: LLMEngine, params: SamplingParams, resume: Resume | None = None, index=0) -> Run:
    """Step until the request ends; the outputs of choice `index`."""
    engine.add_request("r", PROMPT, dataclasses.replace(params), resume=resume)
    deltas = []
    for _ in range(1000):
        for out in engine.step():
            deltas += [c for c in out.outputs if c.index == index]
            if out.finished:
                assert engine.pool.is_all_free
                return Run(deltas, index)
    raise AssertionError("the request did not finish")


def resume_at(engine, full: Run, params: SamplingParams, g: int, held: int = 0, index=0) -> Resume:
    """Resume after full's first `g` tokens, the client holding their text less `held` chars."""
    text = decoded_text(engine.tokenizer, PROMPT, full.final.token_ids[:g], True)
    return Resume(index, tuple(full.final.token_ids[:g]), len(text) - held)


@pytest.mark.parametrize("g", [0, 1, 5, 15])
def test_greedy_resume_streams_the_rest_of_the_uninterrupted_run(engine, g):
    full = run(engine, GREEDY)
    resume = resume_at(engine, full, GREEDY, g)
    resumed = run(engine, GREEDY, resume)
    assert resumed.new_tokens == full.final.token_ids[g:]
    assert resumed.final.token_ids == full.final.token_ids  # the choice, the G tokens included
    assert resumed.final.finish_reason == "length"
    text_before = full.final.text[: resume.num_sent_chars]
    assert text_before + resumed.new_text == full.final.text


def test_seeded_sampling_resumes_the_same_draws(engine):
    """Token k of a seeded choice depends only on (seed, choice index, k): a resume skips
    exactly the G draws the previous worker made, and seeds choice i with seed + i."""
    full = run(engine, SEEDED)
    resumed = run(engine, SEEDED, resume_at(engine, full, SEEDED, 5))
    assert resumed.new_tokens == full.final.token_ids[5:]
    n3 = dataclasses.replace(SEEDED, n=3)
    sibling = run(engine, n3, index=2)
    assert sibling.final.token_ids != full.final.token_ids  # choice 2 has its own seed
    resumed = run(engine, SEEDED, resume_at(engine, sibling, SEEDED, 5, index=2), index=2)
    assert resumed.final.index == 2
    assert resumed.new_tokens == sibling.final.token_ids[5:]


def test_one_skipped_draw_per_token_equals_one_batched_draw():
    """What `_resume`'s skip loop consumes: G single draws leave the generator where one draw
    of G leaves it (so either is the state after G sampled steps)."""
    singles, batched = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    for _ in range(5):
        torch.rand(1, generator=singles)
    torch.rand(5, generator=batched)
    assert torch.equal(torch.rand(3, generator=singles), torch.rand(3, generator=batched))


def finished(engine: LLMEngine, rid: str, prompt, params: SamplingParams):
    engine.add_request(rid, prompt, dataclasses.replace(params))
    while True:
        done = next((o for o in engine.step() if o.finished), None)
        if done is not None:
            return done.outputs[0]


@pytest.mark.parametrize("repetition", [1.0, 1.8])
def test_penalties_see_the_resumed_tokens_as_outputs(engine, repetition):
    params = dataclasses.replace(
        GREEDY, presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=repetition
    )
    full = run(engine, params)
    g = 6
    resumed = run(engine, params, resume_at(engine, full, params, g))
    assert resumed.new_tokens == full.final.token_ids[g:]
    if repetition == 1.0:  # the G tokens as prompt (a resume that dropped them) go elsewhere
        as_prompt = finished(engine, "p", PROMPT + full.final.token_ids[:g], params)
        assert as_prompt.token_ids[: 16 - g] != full.final.token_ids[g:]


def test_min_tokens_counts_the_resumed_tokens(engine):
    """A stop token first generated at position k stops a run with min_tokens = k there; a
    resume that counted only its own tokens would still ban it."""
    tokens = run(engine, GREEDY).final.token_ids
    k = next(k for k in range(6, 16) if tokens[k] not in tokens[:k])
    params = dataclasses.replace(GREEDY, min_tokens=k, stop_token_ids=[tokens[k]])
    full = run(engine, params)
    assert full.final.token_ids == tokens[: k + 1] and full.final.finish_reason == "stop"
    resumed = run(engine, params, resume_at(engine, full, params, 5))
    assert resumed.new_tokens == tokens[5 : k + 1] and resumed.final.finish_reason == "stop"


def test_stop_string_across_the_cut_and_held_back_text(engine):
    """A stop string that starts in the resumed text and ends in new text is found; the text
    the previous worker held back (len(stop) - 1 chars) is not sent yet, so it comes now."""
    full = run(engine, GREEDY)
    for g in range(3, 14):
        cut = len(decoded_text(engine.tokenizer, PROMPT, full.final.token_ids[:g], True))
        stop = full.final.text[cut - 2 : cut + 2]
        if cut >= 5 and len(stop) == 4 and full.final.text.find(stop) == cut - 2:
            break
    else:
        pytest.skip("no cut with a stop string around it in this text")
    params = dataclasses.replace(GREEDY, stop=[stop])
    stopped = run(engine, params)
    assert stopped.final.text == full.final.text[: cut - 2]
    resume = resume_at(engine, full, params, g, held=3)
    resumed = run(engine, params, resume)
    assert resumed.final.finish_reason == "stop" and resumed.final.stop_reason == stop
    assert resumed.new_text == full.final.text[cut - 3 : cut - 2]  # the held char, then stop
    assert full.final.text[: resume.num_sent_chars] + resumed.new_text == stopped.final.text


def test_logprobs_only_for_new_tokens_and_aligned(engine):
    params = dataclasses.replace(GREEDY, logprobs=2)
    full = run(engine, params)
    resumed = run(engine, params, resume_at(engine, full, params, 5))
    for c in resumed.deltas:
        assert [s.token_id for s in c.delta_logprobs] == c.delta_token_ids
    assert [s.token_id for s in resumed.final.logprobs] == full.final.token_ids[5:]
    expected = [s.logprob for s in full.final.logprobs[5:]]
    assert [s.logprob for s in resumed.final.logprobs] == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize(
    "params, resume, why",
    [
        (dataclasses.replace(GREEDY, n=2), Resume(0, (5,), 0), "n must be 1"),
        (GREEDY, Resume(0, (5, VOCAB), 0), "resumed token ids"),
        (GREEDY, Resume(0, (5,) * 16, 0), "max_tokens"),
        (GREEDY, Resume(0, (5,), 1000), "num_sent_chars"),
    ],
)
def test_bad_resume_is_refused_and_leaves_nothing(engine, params, resume, why):
    with pytest.raises(ValueError, match=why):
        engine.add_request("bad", PROMPT, dataclasses.replace(params), resume=resume)
    assert not engine.has_unfinished_requests() and engine.pool.is_all_free
    engine.add_request("bad", PROMPT, dataclasses.replace(GREEDY, max_tokens=1))  # id free
    while engine.has_unfinished_requests():
        engine.step()


def test_character_split_across_the_cut_decodes_whole(tokenizer):
    """The detokenizer resumes mid-character: the bytes of `€` on both sides of the cut make
    one character, never U+FFFD."""
    prompt = tokenizer.encode("x = 1\n")
    ids = tokenizer.encode("ab€cd")
    cut = next(i for i in range(1, len(ids)) if "\ufffd" in tokenizer.decode(ids[:i]))
    params = SamplingParams(max_tokens=32)
    req = Request("q", prompt, params)
    outputs = OutputProcessor(tokenizer)
    outputs.add_request(req)
    req.append_resumed(ids[:cut])
    sent = decoded_text(tokenizer, prompt, ids[:cut], True)
    assert sent == "ab"  # the split character is held back
    outputs.resume(req, len(sent))
    text = ""
    for token_id in ids[cut:]:
        req.append_token(SampledToken(token_id))
        out, _ = outputs.process(req)
        text += out.delta_text
    assert text == "€cd" and "\ufffd" not in text


# -- HTTP: the `resume` field ------------------------------------------------------------------
TOKEN = "resume-test-token"
HEADERS = {"X-Internal-Token": TOKEN}
CHAT = [{"role": "user", "content": "import os and list the files"}]


@pytest.fixture(scope="module")
def server(start_server, tiny_model):
    return start_server(
        "decode",
        *("--model", str(tiny_model("llama")), "--num-blocks", "64"),
        *("--internal-token", TOKEN, "--served-model-name", "tiny"),
    )


def post(server, path: str, body: dict, headers=HEADERS) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def stream(server, path: str, body: dict) -> list[dict]:
    """The events of a streamed request, [DONE] checked and dropped."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}{path}", json=body, headers=HEADERS, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def tokens_and_text(chunks: list[dict], text_of) -> tuple[list[int], str]:
    choices = [c for chunk in chunks for c in chunk["choices"]]
    return [t for c in choices for t in c.get("token_ids") or []], "".join(map(text_of, choices))


def completion_text(choice: dict) -> str:
    return choice["text"]


def chat_text(choice: dict) -> str:
    return choice["delta"].get("content") or ""


def sent_after(chunks: list[dict], text_of, g: int) -> tuple[list[int], int]:
    """The first `g` tokens of a stream and the characters the client had with them."""
    ids, num_chars = [], 0
    for c in (c for chunk in chunks for c in chunk["choices"]):
        if len(ids) >= g:
            break
        ids += c.get("token_ids") or []
        num_chars += len(text_of(c))
    assert len(ids) == g
    return ids, num_chars


@pytest.mark.parametrize(
    "path, text_of, base",
    [
        ("/v1/completions", completion_text, {"prompt": "def fibonacci(n):", "logprobs": 1}),
        ("/v1/chat/completions", chat_text, {"messages": CHAT, "logprobs": True}),
    ],
    ids=["completions", "chat"],
)
def test_streamed_resume_continues_the_stream(server, path, text_of, base):
    body = {**base, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    body["return_token_ids"] = True
    full = stream(server, path, body)
    full_ids, full_text = tokens_and_text(full, text_of)
    g = 5
    ids, num_chars = sent_after(full, text_of, g)
    resume = {"choice_index": 3, "output_token_ids": ids, "num_sent_chars": num_chars}
    resumed = stream(server, path, {**body, "resume": resume})
    new_ids, new_text = tokens_and_text(resumed, text_of)
    assert new_ids == full_ids[g:]
    assert full_text[:num_chars] + new_text == full_text
    assert {c["index"] for chunk in resumed for c in chunk["choices"]} == {3}
    usage, full_usage = resumed[-1]["usage"], full[-1]["usage"]
    assert usage["completion_tokens"] == 12
    assert usage["prompt_tokens"] == full_usage["prompt_tokens"]
    prompt_ids = next(
        x
        for chunk in resumed
        for x in [chunk.get("prompt_token_ids")]
        + [c.get("prompt_token_ids") for c in chunk["choices"]]
        if x
    )
    assert len(prompt_ids) == full_usage["prompt_tokens"]  # the original prompt
    choices = [c for chunk in resumed for c in chunk["choices"] if c.get("token_ids")]
    if path == "/v1/completions":  # text offsets go on from the client's text
        assert choices[0]["logprobs"]["text_offset"] == [num_chars]
    assert sum(len(c["logprobs"]["content" if "delta" in c else "tokens"]) for c in choices) == 7


def test_non_streamed_resume_counts_the_resumed_tokens(server):
    body = {"prompt": "x = 1", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    full = post(server, "/v1/completions", {**body, "return_token_ids": True}).json()
    ids = full["choices"][0]["token_ids"]
    resume = {"choice_index": 1, "output_token_ids": ids[:4], "num_sent_chars": 0}
    r = post(server, "/v1/completions", {**body, "resume": resume, "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert r.headers["x-pdserve-resumed"] == "1"  # the proxy moves a stream only on this word
    assert "x-pdserve-resumed" not in post(server, "/v1/completions", body).headers
    out = r.json()
    assert out["choices"][0]["index"] == 1 and out["choices"][0]["token_ids"] == ids
    assert out["usage"]["completion_tokens"] == 10
    assert out["usage"]["prompt_tokens"] == full["usage"]["prompt_tokens"]
    empty = {"choice_index": 2, "output_token_ids": [], "num_sent_chars": 0}  # no token yet
    out = post(server, "/v1/completions", {**body, "resume": empty}).json()
    assert (
        out["choices"][0]["index"] == 2 and out["choices"][0]["text"] == full["choices"][0]["text"]
    )


@pytest.mark.parametrize(
    "change, resume",
    [
        ({"n": 2}, {"output_token_ids": [5]}),
        ({"prompt": ["a", "b"]}, {"output_token_ids": [5]}),
        ({}, {"output_token_ids": [5, VOCAB]}),
        ({"max_tokens": 3}, {"output_token_ids": [5, 6, 7]}),
        ({}, {"output_token_ids": [5, 6], "num_sent_chars": 100}),
    ],
    ids=["n", "batch", "vocab", "max_tokens", "num_sent_chars"],
)
def test_bad_resume_is_a_400(server, change, resume):
    body = {"prompt": "x = 1", "max_tokens": 8, **change}
    resume = {"choice_index": 0, "num_sent_chars": 0, **resume}
    r = post(server, "/v1/completions", {**body, "resume": resume})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "resume"


def test_resume_needs_the_cluster_token(server):
    body = {"messages": CHAT, "max_tokens": 4}
    body["resume"] = {"choice_index": 0, "output_token_ids": [5], "num_sent_chars": 0}
    r = post(server, "/v1/chat/completions", body, headers={})
    assert r.status_code == 401, r.text
    assert post(server, "/v1/chat/completions", body).status_code == 200
    assert post(server, "/v1/chat/completions", {**body, "resume": None}, headers={}).is_success
