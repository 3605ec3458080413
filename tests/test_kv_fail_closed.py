"""Fail closed on the KV paths, with real workers and real NIXL transfers:

- a failed load's blocks are quarantined while a READ into them is still in flight, so a later
  request never has its KV overwritten by it;
- a push with a failed middle chunk is never admitted with holes: P answers an error, D waits
  for every chunk of every layer and recomputes (or fails) when one never lands;
- P's step never waits on a decode worker: a frozen D does not stall P's other requests.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

from common.config import CacheConfig, EngineConfig, ModelConfig, TransferConfig
from common.engine.engine import LLMEngine
from common.engine.sampling_params import SamplingParams
from common.kv_transfer.handshake import HandshakeInfo
from common.kv_transfer.nixl.transport import TransferError
from common.kv_transfer.transfers import TransferFuture
from tests.chaos.faults import frozen
from tests.servers import wait_until
from tests.test_pd_pull import complete
from tests.tiny_models import VOCAB


def random_prompt(seed: int, n: int = 40) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("llama"))


@pytest.fixture(scope="module")
def prefill(start_server, model):
    args = ["--model", model, "--num-blocks", "64", "--max-model-len", "256"]
    return start_server("prefill", *args, "--no-prefix-caching", "--kv-lease-timeout", "60")


def decode_engine(model: str) -> LLMEngine:
    """A decode engine in this process, so that its transport can be given faults."""
    return LLMEngine(
        EngineConfig(
            ModelConfig(model, dtype="float32", max_model_len=256),  # as the P worker
            CacheConfig(num_blocks=48, enable_prefix_caching=False),
            transfer=TransferConfig(connector="nixl", failure_policy="fail", load_timeout=30),
        )
    )


def run(engine: LLMEngine, request_id: str) -> tuple[list[int], str | None]:
    """Step until `request_id` finishes: its token ids and error."""
    tokens: list[int] = []
    for _ in range(500):
        for out in engine.step():
            if out.request_id == request_id:
                tokens += out.outputs[0].delta_token_ids
                if out.finished:
                    return tokens, out.error
    raise AssertionError(f"{request_id} did not finish")


def test_late_reads_of_a_failed_load_never_land_in_another_requests_blocks(prefill, model):
    engine = decode_engine(model)
    connector = engine.connector
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    other = random_prompt(2)
    engine.add_request("reference", other, greedy)
    reference, _ = run(engine, "reference")

    info = HandshakeInfo.model_validate(httpx.get(f"{prefill.url}/internal/kv/handshake").json())
    connector.add_peer(info.layout, info.metadata_bytes())
    body = {"prompt": random_prompt(1), "max_tokens": 1, "temperature": 0}
    params = complete(prefill.url, {**body, "kv_transfer_params": {"do_remote_decode": True}})

    gate, late = threading.Event(), []
    read_layers = connector.transport.read_layers

    def faulty_read(peer, layers, local, remote, **kw):
        """The READ fails at once, as one past its deadline does, but NIXL has not let go of
        it: its bytes land later (after the gate), and only then has it settled."""
        future = TransferFuture()
        assert future.set_running_or_notify_cancel()
        future.set_exception(TransferError("injected: the READ failed, its handle still busy"))

        def land() -> None:
            gate.wait(30)
            try:
                read_layers(peer, layers, local, remote, **kw).result()
            finally:
                future.mark_settled()

        late.append(threading.Thread(target=land, daemon=True))
        late[-1].start()
        return future

    connector.transport.read_layers = faulty_read
    engine.add_request("loaded", body["prompt"], greedy, params["kv_transfer_params"])
    tokens, error = run(engine, "loaded")
    assert error is not None and "read failed" in error, error  # policy "fail": a clear error
    assert late, "no READ was left in flight"
    quarantined = connector.holds.num_quarantined
    assert quarantined > 0, "blocks with READs in flight went back to the pool"

    engine.add_request("second", other, greedy)  # admitted while the late READs are pending
    first = engine.step()  # its prefill writes its KV, then the late READs land
    gate.set()
    for thread in late:
        thread.join(30)
    second, error = run(engine, "second")
    assert error is None and first[0].outputs[0].token_ids + second == reference
    assert wait_until(lambda: (engine.poll_transfers(), connector.holds.num_quarantined)[1] == 0)
    assert engine.pool.is_all_free
    connector.close()


@pytest.fixture(scope="module")
def chunked_pd(start_server, model):
    common = ["--model", model, "--num-blocks", "96", "--max-model-len", "256"]
    chunks = ["--max-num-batched-tokens", "32", "--no-prefix-caching"]
    p = start_server("prefill", *common, *chunks, wait=False)
    d = start_server(
        "decode", *common, *chunks, "--kv-lease-timeout", "5", "--kv-load-timeout", "3", wait=False
    )
    return p.wait_ready(), d.wait_ready()  # started side by side


def reserve(d, num_tokens: int) -> dict:
    r = httpx.post(f"{d.url}/internal/kv/reserve", json={"num_tokens": num_tokens})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_failed_middle_chunk_is_an_error_on_p_and_never_decoded_on_d(chunked_pd):
    p, d = chunked_pd
    prompt = random_prompt(5, 100)  # 7 blocks of 16: chunks of 32 tokens = 2 blocks each
    body = dict(prompt=prompt, max_tokens=8, temperature=0, ignore_eos=True, return_token_ids=True)
    colocated = complete(d.url, body)["choices"][0]["token_ids"]
    target = reserve(d, len(prompt))
    broken = dict(target, block_ids=list(target["block_ids"]))
    broken["block_ids"][2] = 10**6  # chunk 1's first block: its WRITE fails, the others land
    r = httpx.post(
        f"{p.url}/v1/completions",
        json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True,
                                                              "push_to": broken}},
        timeout=30,
    )  # fmt: skip
    assert r.status_code >= 500 and "KV" in r.json()["error"]["message"], r.text
    assert wait_until(lambda: p.metric("pdserve_kv_push_failures_total") >= 1)

    # a decode request that names the reservation anyway: D must not decode with a hole
    recomputed = 'pdserve_kv_recomputed_total{reason="push_incomplete"}'
    before = d.metric(recomputed)
    params = {
        "do_remote_prefill": True,
        "push_reservation_id": target["reservation_id"],
        "remote_engine_id": "p",
        "remote_block_ids": [],
        "remote_request_id": "r",
        "remote_host": "127.0.0.1",
        "remote_port": 1,
        "first_token_id": colocated[0],
    }
    out = complete(d.url, {**body, "kv_transfer_params": params})
    assert out["choices"][0]["token_ids"] == colocated
    assert wait_until(lambda: d.metric(recomputed) == before + 1)
    assert d.metric('pdserve_kv_loaded_requests_total{mode="push"}') == 0
    assert wait_until(lambda: d.metric("pdserve_kv_push_failures_total") >= 1)
    for s in (p, d):
        assert wait_until(lambda s=s: s.metric("pdserve_kv_blocks_used") == 0)


def ttft(url: str, prompt: list[int]) -> float:
    started = time.perf_counter()
    complete(url, {"prompt": prompt, "max_tokens": 1, "temperature": 0})
    return time.perf_counter() - started


def test_a_frozen_decode_worker_does_not_stall_the_prefill_worker(chunked_pd):
    p, d = chunked_pd
    prompt = random_prompt(7, 60)
    push = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    warm = reserve(d, len(prompt))  # P connects to D once, while D is alive
    complete(p.url, {**push, "kv_transfer_params": {"do_remote_decode": True, "push_to": warm}})
    idle = max(ttft(p.url, random_prompt(i)) for i in range(10, 15))
    target = reserve(d, len(prompt))
    result: dict = {}

    def send_push() -> None:
        params = {"do_remote_decode": True, "push_to": target}
        r = httpx.post(
            f"{p.url}/v1/completions", json={**push, "kv_transfer_params": params}, timeout=30
        )
        result["status"] = r.status_code

    with frozen(d):
        sender = threading.Thread(target=send_push)
        sender.start()
        time.sleep(0.3)  # the push is at P, its WRITEs to the frozen D in flight
        busy = max(ttft(p.url, random_prompt(i)) for i in range(20, 25))
        sender.join(30)
    # NOTE: no wall-clock speed is asserted here, only that P is not stalled for the ~4.5 s a
    # WRITE to a frozen peer takes to time out (before the fix: 4.2 s vs 0.04 s idle); the
    # slack keeps a loaded machine's noise out of it
    assert busy < 2 * idle + 1.5, f"P stalled: {busy:.2f} s per request vs {idle:.2f} s idle"
    assert not sender.is_alive() and result["status"] in (200, 500), result
    assert wait_until(lambda: p.metric("pdserve_kv_blocks_used") == 0, timeout=30)
