"""Tensor parallelism at TP = 2 on CPU: two real ranks (rank 1 a process) over gloo on
loopback, one thread each.

- parity: greedy tokens identical to transformers and logits within 1e-5 on every tiny
  architecture (GQA with 2 KV heads split, 1 KV head replicated; a vocabulary that does not
  split evenly), and SmolLM2 (9 heads over 2 ranks: uneven) within 1e-4;
- invariance: batch + chunked prefill, prefix-cache hits and preemption give the outputs of each
  prompt alone, greedy and seeded;
- a worker started with --tensor-parallel-size 2 answers what TP = 1 answers, and fails closed
  when rank 1 is killed: /health 503, then exit 1, no orphan (P/D between TP sizes:
  test_pd_tensor_parallel.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from unittest import mock

import httpx
import pytest
import torch
import transformers

from common.api.state import ENGINE_DEAD_EXIT_CODE
from common.engine.llm import LLM
from common.engine.sampling_params import SamplingParams
from tests.oracle import engine_greedy, hf_greedy
from tests.servers import wait_until
from tests.test_cpu_budget import cpus_allowed
from tests.test_engine import GREEDY, SEEDED, prompts, token_ids
from tests.tiny_models import ARCHS, VOCAB

NEW_TOKENS = 36
SMOL_TOKENS = 24
PROMPT_LENS = (21, 53)
# one KV head, replicated on both ranks, and a vocabulary of 1021 rows: 511 + 510 and a pad row
EXTRA_ARCHS = {"llama-kv1": ("LlamaConfig", dict(num_key_value_heads=1, vocab_size=1021))}
PARITY = ["llama", "llama-kv1", "llama-tied", "llama3-rope", "mistral-swa", "qwen2", "qwen3"]


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    def get(name: str) -> Path:
        with mock.patch.dict(ARCHS, EXTRA_ARCHS):
            return tiny_model(name)

    return get


def tp_llm(folder, tp: int = 2, **options) -> LLM:
    return LLM(str(folder), dtype="float32", enforce_eager=True, tensor_parallel_size=tp, **options)


@contextlib.contextmanager
def running(llm: LLM):
    try:
        yield llm
    finally:
        llm.shutdown()


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@pytest.mark.parametrize("arch", PARITY)
def test_greedy_matches_transformers_at_tp2(model_dir, arch):
    folder = model_dir(arch)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    cases = [_prompt(n, seed=i, vocab=vocab) for i, n in enumerate(PROMPT_LENS)]
    expected = [hf_greedy(hf, p, NEW_TOKENS, pad_id=0) for p in cases]
    with running(tp_llm(folder, num_blocks=64, block_size=16)) as llm:
        ranks = list(llm.engine.ranks.procs.values())
        for prompt, (hf_tokens, hf_logits) in zip(cases, expected):
            tokens, logits = engine_greedy(llm, prompt, NEW_TOKENS)
            assert tokens == hf_tokens, f"{arch}: greedy tokens differ ({len(prompt)} tokens)"
            diff = (logits - hf_logits).abs().max().item()
            assert diff < 1e-5, f"{arch}: max |logit diff| {diff:.2e} ({len(prompt)} tokens)"
        assert llm.engine.pool.num_used_blocks == 0
        calls = llm.engine.tp.stats.calls
        assert calls["all_reduce"] > 0 and calls["gather"] > 0, "no collective ran"
    assert [proc.returncode for proc in ranks] == [0], "told to stop, rank 1 exits 0"


@pytest.mark.slow
def test_smollm2_matches_transformers_at_tp2():
    questions = ["What is the capital of France?", "Write a haiku about the sea."]
    with running(LLM(num_blocks=256, max_model_len=2048, dtype="float32", enforce_eager=True,
                     tensor_parallel_size=2)) as llm:  # fmt: skip
        tok, folder = llm.tokenizer, llm.engine.config.model.model_dir
        chats = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
        cases = [tok.encode(c) for c in chats]
        results = [engine_greedy(llm, p, SMOL_TOKENS) for p in cases]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for question, prompt, (tokens, logits) in zip(questions, cases, results):
        hf_tokens, hf_logits = hf_greedy(hf, prompt, SMOL_TOKENS, pad_id=2)
        assert tokens == hf_tokens, question
        diff = (logits - hf_logits).abs().max().item()
        assert diff < 1e-4, f"{question!r}: max |logit diff| {diff:.2e}"


def test_batch_chunks_prefix_hits_and_preemption_equal_alone_at_tp2(model_dir):
    folder = model_dir("llama")
    alone = {}
    with running(tp_llm(folder, num_blocks=64, enable_prefix_caching=False)) as llm:
        for mode, params in (("greedy", GREEDY), ("seeded", SEEDED)):
            alone[mode] = [token_ids(llm.generate(p, params))[0] for p in prompts()]
    # 16 blocks cannot hold the 8 requests at once (preemption), 24 tokens a step (chunks)
    options = dict(num_blocks=16, max_model_len=256, max_num_batched_tokens=24)
    with running(tp_llm(folder, **options)) as llm:
        for mode, params in (("greedy", GREEDY), ("seeded", SEEDED)):  # the second: hits
            assert token_ids(llm.generate(prompts(), params)) == alone[mode], mode
        engine = llm.engine
        assert engine.scheduler.num_preemptions > 0 and engine.pool.num_hits > 0
        assert engine.pool.num_used_blocks == 0
    with running(LLM(str(folder), dtype="float32", num_blocks=64)) as tp1:
        assert [token_ids(tp1.generate(p, GREEDY))[0] for p in prompts()] == alone["greedy"]


CORES = sorted(os.sched_getaffinity(0))[:2]


@pytest.fixture(scope="module")
def tp_server(start_server, model_dir):
    """A TP = 2 worker on two cores: rank 0's engine thread on the first, rank 1 on the other."""
    args = ["--model", str(model_dir("llama")), "--num-blocks", "64", "-tp", "2"]
    return start_server("decode", *args, "--cpu-cores", ",".join(map(str, CORES)))


def rank_pids(server) -> list[int]:
    """The worker's child processes: its tensor-parallel ranks."""
    pids = []
    for task in Path(f"/proc/{server.proc.pid}/task").iterdir():
        pids += [int(p) for p in (task / "children").read_text().split()]
    return pids


def test_a_tp2_worker_answers_what_tp1_answers(tp_server, model_dir):
    body = dict(prompt="The quick brown fox", max_tokens=16, temperature=0, ignore_eos=True)
    r = httpx.post(f"{tp_server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    with running(LLM(str(model_dir("llama")), dtype="float32", num_blocks=64)) as tp1:
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        assert (
            r.json()["choices"][0]["text"]
            == tp1.generate(body["prompt"], params)[0].outputs[0].text
        )
    (rank1,) = rank_pids(tp_server)  # the worker's one child process
    if len(CORES) == 2:
        assert cpus_allowed(Path(f"/proc/{rank1}/status")) == str(CORES[1])
    assert "tensor parallel: 2 ranks" in tp_server.log()


def test_killing_rank_1_fails_the_worker_closed(tp_server):
    (rank1,) = rank_pids(tp_server)
    body = dict(prompt="hello", max_tokens=400, ignore_eos=True, stream=True)
    with httpx.stream("POST", f"{tp_server.url}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # generating
        os.kill(rank1, signal.SIGKILL)
        text = "\n".join(lines)  # a hang would end in a ReadTimeout here
    assert '"error"' in text, text[-500:]
    seen_503 = False
    with contextlib.suppress(httpx.ConnectError):  # unless the process is already gone
        seen_503 = httpx.get(f"{tp_server.url}/health", timeout=10).status_code == 503
    assert wait_until(lambda: tp_server.proc.poll() is not None, timeout=60), tp_server.log()
    assert tp_server.proc.returncode == ENGINE_DEAD_EXIT_CODE, tp_server.log()
    assert seen_503 or "engine died" in tp_server.log()
    # the watcher's report, or the collective that met the dead peer first: gloo says "closed"
    # or "reset by peer" depending on which side of the socket saw the kill
    why = ("tensor-parallel rank", "Connection closed", "Connection reset by peer")
    assert any(w in tp_server.log() for w in why), tp_server.log()


def test_an_idle_worker_notices_a_dead_rank(start_server, model_dir):
    server = start_server(
        "decode", "--model", str(model_dir("llama")), "--num-blocks", "32", "-tp", "2"
    )
    (rank1,) = rank_pids(server)
    os.kill(rank1, signal.SIGKILL)
    assert wait_until(lambda: _health(server) in (503, None), timeout=30), server.log()
    assert wait_until(lambda: server.proc.poll() is not None, timeout=60), server.log()
    assert server.proc.returncode == ENGINE_DEAD_EXIT_CODE, server.log()
    assert "tensor-parallel rank 1 exited" in server.log()


def test_ranks_die_with_a_killed_worker(start_server, model_dir):
    server = start_server(
        "decode", "--model", str(model_dir("llama")), "--num-blocks", "32", "-tp", "2"
    )
    (rank1,) = rank_pids(server)
    server.proc.kill()
    assert wait_until(lambda: not Path(f"/proc/{rank1}").exists() or _is_zombie(rank1), 30)


def _is_zombie(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    return True


def _health(server) -> int | None:
    try:
        return httpx.get(f"{server.url}/health", timeout=5).status_code
    except httpx.HTTPError:
        return None


def test_uneven_and_replicated_head_splits():
    from common.model.hf_config import parse_arch_config
    from common.parallel.shard import TPShard, kv_heads_held

    def arch(heads: int, kv: int):
        raw = dict(architectures=["LlamaForCausalLM"], vocab_size=VOCAB, hidden_size=heads * 8,
                   intermediate_size=96, num_hidden_layers=1, num_attention_heads=heads,
                   num_key_value_heads=kv)  # fmt: skip
        return parse_arch_config(raw)

    smol = arch(9, 3)  # SmolLM2's heads: whole KV groups per rank, rank 0 the lighter
    shards = [TPShard(r, 2).local_arch(smol) for r in range(2)]
    assert [(a.num_heads, a.num_kv_heads) for a in shards] == [(3, 1), (6, 2)]
    assert kv_heads_held(arch(8, 2), 4) == 4, "each KV head on two ranks"
    assert TPShard(3, 4).slice_of("layers.0.self_attn.k_proj.weight", arch(8, 2)) == (0, 8, 16)
    with pytest.raises(ValueError, match="multiple of them"):
        TPShard(0, 3).check(arch(8, 2))
