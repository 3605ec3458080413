"""Request migration with real processes: 1 P + 2 D behind the proxy, a D killed (kill -9),
drained by the admin API, or SIGTERM'd with `--drain-migrate` in a rolling restart, while
streams run on it. Every
stream ends with [DONE] and no error event, and its text, token ids, logprobs and usage equal
the same request run uninterrupted; the proxy's migration counters prove the streams moved
(each test fails with `--migration-limit 0`, which its refusal tests pin down)."""

from __future__ import annotations

import json
import signal
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from tests.servers import free_port, wait_until
from tests.stub_worker import StubWorkers

PROMPTS = [list(range(7 + 3 * i, 40 + 5 * i)) for i in range(8)]
MAX_TOKENS = 300
# The kill and drain tests' streams only have to be running when their D goes: it goes once
# every stream has 3 tokens, when the furthest had 13-15 (measured at a load of 11 on 2
# cores), so 120 leaves 8 times that; each decoded step costs D ~25 ms of CPU, and 300 tokens
# made those two tests most of the module's cost. The refusal tests keep MAX_TOKENS.
SHORT = 120
ADMIN = "admin-key"


@pytest.fixture(scope="module")
def workers(start_server, tiny_model):
    common = ["--model", str(tiny_model("llama")), "--num-blocks", "600", "--max-model-len", "512"]
    common += ["--kv-lease-timeout", "20"]
    p = start_server("prefill", *common, wait=False)
    ds = [start_server("decode", *common, "--drain-migrate", wait=False) for _ in range(2)]
    return p.wait_ready(), [d.wait_ready() for d in ds]  # started side by side


def proxy_for(start_server, p, ds, *extra: str):
    return start_server(
        "proxy", "--prefill", p.url, *[a for d in ds for a in ("--decode", d.url)],
        "--decode-policy", "round_robin", "--health-interval", "0.3", "--health-failures", "1",
        "--decode-timeout", "10", "--admin-key", ADMIN, *extra,
    )  # fmt: skip


@pytest.fixture(scope="module")
def proxy(start_server, workers):
    return proxy_for(start_server, *workers)


@dataclass
class Stream:
    """One streamed request as a client sees it."""

    texts: dict[int, str] = field(default_factory=dict)
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list] = field(default_factory=dict)
    finish: dict[int, str] = field(default_factory=dict)
    ids: set[str] = field(default_factory=set)
    created: set[int] = field(default_factory=set)
    usage: dict | None = None
    error: dict | None = None
    is_done: bool = False
    num_events: int = 0
    started: threading.Event = field(default_factory=threading.Event)


def stream(url: str, path: str, body: dict, out: Stream | None = None) -> Stream:
    out = out or Stream()
    payload = {**body, "stream": True, "return_token_ids": True}
    payload["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", url + path, json=payload, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line:
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                out.is_done = True
                break
            event = json.loads(data)
            if "error" in event:
                out.error = event["error"]
                continue
            out.ids.add(event["id"])
            out.created.add(event["created"])
            if event.get("usage"):
                out.usage = event["usage"]
            for c in event["choices"]:
                i = c["index"]
                text = c["delta"].get("content") if "delta" in c else c.get("text")
                out.texts[i] = out.texts.get(i, "") + (text or "")
                out.token_ids.setdefault(i, []).extend(c.get("token_ids") or [])
                lp = c.get("logprobs")
                if lp:
                    out.logprobs.setdefault(i, []).extend(_logprob_items(lp))
                if c.get("finish_reason"):
                    out.finish[i] = c["finish_reason"]
            out.num_events += 1
            if min(len(t) for t in out.token_ids.values()) >= 3 and out.token_ids:
                out.started.set()
    out.started.set()
    return out


CASES = [  # (path, body): greedy, seeded sampled, logprobs, penalties, stop, chat, n = 2
    ("/v1/completions", dict(prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                             ignore_eos=True)),
    ("/v1/completions", dict(prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=1.0, seed=11,
                             ignore_eos=True)),
    ("/v1/completions", dict(prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0, logprobs=2,
                             ignore_eos=True)),
    ("/v1/completions", dict(prompt=PROMPTS[3], max_tokens=MAX_TOKENS, temperature=0.8, seed=3,
                             frequency_penalty=0.5, presence_penalty=0.3, ignore_eos=True)),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "hello there"}],
                                  max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                                  logprobs=True, top_logprobs=1)),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "seeded"}],
                                  max_tokens=MAX_TOKENS, temperature=1.0, seed=5,
                                  ignore_eos=True)),
    ("/v1/completions", dict(prompt=PROMPTS[6], max_tokens=MAX_TOKENS, temperature=0,
                             min_tokens=MAX_TOKENS - 20, ignore_eos=True)),
    ("/v1/completions", dict(prompt=PROMPTS[7], max_tokens=MAX_TOKENS, temperature=0,
                             ignore_eos=True)),
]  # fmt: skip


def shorter(cases: list[tuple[str, dict]], max_tokens: int = SHORT) -> list[tuple[str, dict]]:
    """The cases at `max_tokens` (a `min_tokens` kept as far below it as it was)."""
    out = []
    for path, body in cases:
        body = {**body, "max_tokens": max_tokens}
        if "min_tokens" in body:
            body["min_tokens"] = max_tokens - (MAX_TOKENS - body["min_tokens"])
        out.append((path, body))
    return out


def with_late_stop(case: tuple[str, dict], ref: Stream) -> tuple[str, dict]:
    """The case with a stop string from late in its uninterrupted text (hit after the cut)."""
    path, body = case
    text = ref.texts[0]
    return path, {**body, "stop": [text[-40:-30]]}


def run_all(url: str, cases: list[tuple[str, dict]]) -> tuple[list[Stream], list[threading.Thread]]:
    outs = [Stream() for _ in cases]
    threads = [
        threading.Thread(target=stream, args=(url, path, body, out), daemon=True)
        for (path, body), out in zip(cases, outs, strict=True)
    ]
    for t in threads:
        t.start()
    return outs, threads


def same(got: Stream, ref: Stream) -> None:
    assert got.error is None, got.error
    assert got.is_done
    assert len(got.ids) == 1 and len(got.created) == 1  # one id, one created, whatever moved
    assert got.token_ids == ref.token_ids
    assert got.texts == ref.texts
    assert got.finish == ref.finish
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert {k: got.usage[k] for k in counts} == {k: ref.usage[k] for k in counts}
    assert got.logprobs.keys() == ref.logprobs.keys()
    for index, items in got.logprobs.items():  # the same tokens; values to float noise (a
        assert len(items) == len(ref.logprobs[index])  # token recomputed in a prefill)
        for a, b in zip(items, ref.logprobs[index], strict=True):
            assert {**a, "logprob": 0} == {**b, "logprob": 0}  # token text (and offset)
            assert _logprob(a) == pytest.approx(_logprob(b), abs=1e-4)


def _logprob(item: dict) -> float:
    return item["logprob"]


def _logprob_items(lp: dict) -> list[dict]:
    """Chat's `content` items as they are; completions' columns as one item per token (its
    text, text_offset and logprob)."""
    if "content" in lp:
        return [{"token": c["token"], "logprob": c["logprob"]} for c in lp["content"]]
    columns = zip(lp["tokens"], lp["text_offset"], lp["token_logprobs"], strict=True)
    return [{"token": t, "offset": o, "logprob": v} for t, o, v in columns]


def references(url: str, cases) -> list[Stream]:
    """The cases run uninterrupted, together (as they run when a worker fails)."""
    outs, threads = run_all(url, cases)
    for t in threads:
        t.join(60)
    return outs


def busiest(ds) -> object:
    return max(ds, key=lambda d: d.metric("pdserve_num_requests_running"))


def migrations(proxy) -> float:
    text = httpx.get(f"{proxy.url}/metrics", timeout=5).text
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("pdserve_proxy_migrations_total{")
    )


def readmitted(proxy, server) -> bool:
    workers = httpx.get(f"{proxy.url}/ready", timeout=5).json()["workers"]
    return any(w["url"] == server.url and w["healthy"] for w in workers)


def restart(proxy, server) -> None:
    server.restart()
    server.wait_ready()
    assert wait_until(lambda: readmitted(proxy, server), timeout=60)  # slower on a loaded machine


N2_CASES = [
    ("/v1/completions", dict(prompt=PROMPTS[4], n=2, max_tokens=MAX_TOKENS, temperature=1.0,
                             seed=9, ignore_eos=True)),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "two of them"}], n=2,
                                  max_tokens=MAX_TOKENS, temperature=0.9, seed=2,
                                  ignore_eos=True)),
]  # fmt: skip


def test_a_killed_decode_workers_streams_continue_on_the_other(start_server, proxy, workers):
    """Streams through two proxies at once, one pulling (8 kinds of request), one pushing (n = 2
    among them); one kill -9 of the busier D moves the streams of both."""
    p, ds = workers
    push = proxy_for(start_server, p, ds, "--mode", "push")
    short = shorter(CASES)
    refs = references(proxy.url, short)
    cases = [*short[:7], with_late_stop(short[7], refs[7])]
    refs[7] = stream(proxy.url, *cases[7])
    assert refs[7].finish == {0: "stop"}
    push_cases = shorter([*CASES[:3], *N2_CASES])
    push_refs = references(push.url, push_cases)
    assert all(len(ref.texts) == 2 for ref in push_refs[3:])
    outs, threads = run_all(proxy.url, cases)
    push_outs, push_threads = run_all(push.url, push_cases)
    assert all(out.started.wait(30) for out in outs + push_outs)
    victim = busiest(ds)
    num_running = victim.metric("pdserve_num_requests_running")
    assert num_running >= 4
    victim.stop(signal.SIGKILL)
    for t in threads + push_threads:
        t.join(60)
    for got, ref in zip(outs + push_outs, refs + push_refs, strict=True):
        same(got, ref)
    # one may have finished as it was killed
    assert migrations(proxy) + migrations(push) >= num_running - 1
    assert migrations(proxy) > 0 and migrations(push) > 0
    survivor = next(d for d in ds if d is not victim)
    assert wait_until(lambda: survivor.metric("pdserve_kv_blocks_used") == 0)
    assert wait_until(lambda: p.metric("pdserve_kv_blocks_used") == 0)
    restart(proxy, victim)


def _answer(body: dict) -> list:
    """A whole answer's choices without their logprobs' values (float noise across batches)."""
    return [(c["index"], c["text"], c["token_ids"], c["finish_reason"]) for c in body["choices"]]


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json={**body, "return_token_ids": True}, timeout=60)


def drain(proxy, server, migrate: bool = True) -> None:
    r = httpx.post(
        f"{proxy.url}/admin/workers/drain",
        json={"url": server.url, "migrate": migrate},
        headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=10,
    )
    assert r.status_code == 200, r.text


def test_admin_drain_with_migrate_moves_streamed_and_whole_requests(start_server, workers):
    p, ds = workers
    proxy = proxy_for(start_server, p, ds)
    case = shorter(CASES[1:2])[0]
    ref = post(proxy.url, *case).json()
    whole: dict = {}
    thread = threading.Thread(target=lambda: whole.update(post(proxy.url, *case).json()))
    thread.start()
    assert wait_until(lambda: any(d.metric("pdserve_num_requests_running") for d in ds))
    victim = busiest(ds)
    drain(proxy, victim)
    thread.join(60)
    assert whole["choices"] == ref["choices"]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert {k: whole["usage"][k] for k in counts} == {k: ref["usage"][k] for k in counts}
    assert proxy.metric('pdserve_proxy_migrations_total{reason="drain"}') == 1
    assert wait_until(lambda: victim.metric("pdserve_num_requests_running") == 0)
    # streams, through a proxy of its own (in this one the victim stays drained)
    other = proxy_for(start_server, p, ds, "--min-disagg-tokens", "100000")  # D alone
    short = shorter(CASES[:3])
    refs = references(other.url, short)
    outs, threads = run_all(other.url, short)
    assert all(out.started.wait(30) for out in outs)
    drained = busiest(ds)
    num_running = drained.metric("pdserve_num_requests_running")
    drain(other, drained)
    for t in threads:
        t.join(60)
    for got, ref in zip(outs, refs, strict=True):
        same(got, ref)
    moved = other.metric('pdserve_proxy_migrations_total{reason="drain"}')
    assert moved >= max(1, num_running - 1)  # one may have finished as it was drained


@pytest.mark.parametrize("limit", ["0", "3"])
def test_a_stream_that_cannot_move_ends_with_an_error_event(start_server, workers, limit):
    """Limit 0: no migration; limit 3 with a single D: no other worker to continue on. A drain
    with migrate then leaves the stream on its worker (it goes on); a D that fails (frozen past
    the decode timeout) ends it with the error event."""
    p, ds = workers
    pool = ds if limit == "0" else ds[:1]
    proxy = proxy_for(start_server, p, pool, "--migration-limit", limit, "--decode-timeout", "2")
    out = Stream()
    thread = threading.Thread(target=stream, args=(proxy.url, *CASES[0], out))
    thread.start()
    assert out.started.wait(30)
    victim = busiest(pool)
    drain(proxy, victim)  # nowhere to move it: it goes on where it is
    num_tokens = len(out.token_ids[0])
    assert wait_until(lambda: len(out.token_ids[0]) > num_tokens + 5) and out.error is None
    victim.proc.send_signal(signal.SIGSTOP)
    try:
        thread.join(10)
    finally:
        victim.proc.send_signal(signal.SIGCONT)
    assert out.is_done and out.error is not None
    assert "decode worker failed mid-stream" in out.error["message"]
    assert len(out.token_ids[0]) < MAX_TOKENS and not out.finish  # no answer that claims success
    reason = "limit" if limit == "0" else "no_decode"
    assert proxy.metric(f'pdserve_proxy_migrations_refused_total{{reason="{reason}"}}') == 1
    assert migrations(proxy) == 0
    assert wait_until(lambda: victim.metric("pdserve_num_requests_running") == 0)


def test_rolling_restart_of_every_decode_worker_under_load(proxy, workers):
    """Each D in turn SIGTERM'd (`--drain-migrate`) and restarted while clients keep sending
    streamed and whole requests: each D exits 0 within seconds (not after the drain timeout:
    its requests moved), not one request fails, every answer equals its reference: each client
    counts the requests it sent and the right answers it got, and an exception in a client
    fails the test. The next D goes once the proxy has the last one back (docs/deploy.md)."""
    p, ds = workers
    cases = [(path, {**body, "max_tokens": 60}) for path, body in CASES[:4]]
    refs = references(proxy.url, cases)
    wholes = [post(proxy.url, path, body).json() for path, body in cases]
    failures: list[str] = []
    done = threading.Event()
    sent, answered = [0] * 4, [0] * 4  # per client: only its own thread writes its entry

    def ask(k: int, i: int) -> str | None:
        """Client k's request for case i (odd k stream); what is wrong with the answer, or None."""
        if k % 2:
            got = stream(proxy.url, *cases[i])
            if got.error or got.token_ids != refs[i].token_ids or not got.is_done:
                return f"stream {i}: {got.error or got.token_ids}"
            return None
        r = post(proxy.url, *cases[i])
        if r.status_code != 200 or _answer(r.json()) != _answer(wholes[i]):
            return f"whole {i}: {r.status_code} {r.text[:200]}"
        return None

    def client(k: int) -> None:
        while not done.is_set():
            sent[k] += 1
            try:
                wrong = ask(k, (k + sent[k]) % len(cases))
            except Exception as e:  # noqa: BLE001 — a client that dies is a failed request
                failures.append(f"client {k}: {e!r}")
                return
            if wrong:
                failures.append(wrong)
            else:
                answered[k] += 1

    clients = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(4)]
    for t in clients:
        t.start()
    before = migrations(proxy)
    for victim in ds:
        assert wait_until(lambda v=victim: v.metric("pdserve_num_requests_running") > 0)
        started = time.monotonic()
        victim.proc.send_signal(signal.SIGTERM)
        assert victim.proc.wait(15) == 0
        assert time.monotonic() - started < 10
        restart(proxy, victim)
    time.sleep(1.0)
    done.set()
    for t in clients:
        t.join(60)
    assert not any(t.is_alive() for t in clients), "a client still waits for an answer"
    assert not failures, failures[:5]
    assert answered == sent and sum(sent) >= 8, (sent, answered)
    assert migrations(proxy) > before  # the load was on the workers when they went


def test_a_worker_that_does_not_continue_is_never_passed_on(start_server, workers, tmp_path):
    """The only other D ignores `resume` (it would start the answer again, as a vLLM worker
    would): the proxy sees no `x-pdserve-resumed` on its answer and ends the stream with the
    error event instead."""
    p, ds = workers
    stub = StubWorkers(["127.0.0.1"], free_port(), tmp_path / "stub.log").wait_ready()
    try:
        proxy = proxy_for(start_server, p, ds[:1])
        out = Stream()
        thread = threading.Thread(target=stream, args=(proxy.url, *CASES[0], out))
        thread.start()
        assert out.started.wait(30)
        r = httpx.post(
            f"{proxy.url}/admin/workers", json={"role": "decode", "url": stub.url},
            headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10,
        )  # fmt: skip
        assert r.status_code == 200, r.text
        assert wait_until(lambda: readmitted(proxy, stub))
        drain(proxy, ds[0])
        thread.join(60)
        assert out.is_done and out.error is not None and not out.finish
        assert stub.served("127.0.0.1") == 1  # it was asked, and its answer dropped
        refused = 'pdserve_proxy_migrations_refused_total{reason="unsupported"}'
        assert proxy.metric(refused) == 1
    finally:
        stub.stop(signal.SIGKILL)  # its answer streams on for seconds to a closed connection


def leaves_its_grammar(model) -> dict:
    """A greedy completion whose output leaves its grammar mid-stream, every time: its one
    choice needs the byte 0xC3 (the "é"), whose only tokens the request bans itself
    (`stop_token_ids` under `min_tokens`). The token after "hello world, hello world: " breaks
    the grammar: the request's own fault (a 400), found by D after P's first token and D's
    first ones were streamed."""
    vocab = json.loads((model / "tokenizer.json").read_text())["model"]["vocab"]
    banned = sorted(i for token, i in vocab.items() if "Ã" in token)  # byte-level: 0xC3
    assert banned, "the tiny tokenizer has a token for the byte 0xC3"
    body = dict(prompt=PROMPTS[5], max_tokens=40, min_tokens=40, temperature=0)
    return {**body, "guided_choice": ["hello world, hello world: été"], "stop_token_ids": banned}


def calls(server) -> float:
    """Completion requests the worker answered, whatever their status (its /metrics)."""
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    prefix = 'pdserve_requests_total{endpoint="/v1/completions",'
    return sum(
        float(line.rpartition(" ")[2]) for line in text.splitlines() if line.startswith(prefix)
    )


def faults(proxy, fault: str) -> float:
    return proxy.metric(f'pdserve_proxy_upstream_faults_total{{fault="{fault}",role="decode"}}', 0)


def test_a_request_fault_mid_stream_is_final_and_never_moves(proxy, workers, tiny_model):
    """Output that leaves its grammar is the request's fault: D's error event reaches the client
    typed (`invalid_request_error`, a string code, the status 400 it would have had) after the
    tokens it already had, and no other D is asked to repeat it (no migration)."""
    moved, request_faults = migrations(proxy), faults(proxy, "request")
    out = stream(proxy.url, "/v1/completions", leaves_its_grammar(tiny_model("llama")))
    assert out.is_done and out.error is not None and not out.finish
    assert out.texts[0] == "hello world, hello world: " and len(out.token_ids[0]) > 2
    assert migrations(proxy) == moved
    assert "does not follow the grammar" in out.error["message"]
    assert out.error["type"] == "invalid_request_error", out.error
    assert out.error["code"] == "grammar_violation" and out.error["status"] == 400
    assert faults(proxy, "request") == request_faults + 1


@pytest.mark.parametrize("is_stream", [True, False], ids=["streamed", "whole"])
def test_a_request_fault_is_never_retried_on_another_worker(
    start_server, workers, tiny_model, is_stream
):
    """The same request, streamed (its 4xx an error event) and whole (its 4xx a status), through
    a proxy with room to move it: P and one D are each called once, the other D never."""
    p, ds = workers
    proxy = proxy_for(start_server, p, ds)
    before = [calls(w) for w in (p, *ds)]
    body = {**leaves_its_grammar(tiny_model("llama")), "stream": is_stream}
    r = httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == (200 if is_stream else 400), r.text
    after = [calls(w) for w in (p, *ds)]
    assert after[0] - before[0] == 1  # P: once
    assert sorted(a - b for a, b in zip(after[1:], before[1:], strict=True)) == [0, 1]
    assert migrations(proxy) == 0
    assert proxy.metric('pdserve_proxy_retries_total{role="decode"}') == 0
    assert '"code":"grammar_violation"' in r.text, r.text
    assert faults(proxy, "request") == 1 and faults(proxy, "worker") == 0
