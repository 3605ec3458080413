"""One plan for a new request and for every move of one (proxy/journey/plan.py): a streamed
choice that moves is planned as a new request whose prompt is its token ids so far, so the same
state gives it the same D, the same path and the same reason (the cached-on-decode rule, a short
prompt counted exactly, push in push mode).

In-process: the orchestrator's and a migration's plans are recorded where each hands its plan to
the prefill stage, for the same cluster state (KV events indexed by the test, no processes).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace

import httpx
import pytest
from fastapi.responses import Response

from common.api.protocol import RESUMED_HEADER
from proxy.config import from_dict
from proxy.journey.client import ClientStream
from proxy.journey.migration import Migration
from proxy.journey.plan import Plan
from proxy.journey.prefill import Prefilled
from proxy.kv_index import BlockIndex, decode_batch
from proxy.metrics import ProxyMetrics
from proxy.orchestrator import Orchestrator
from proxy.request import COMPLETIONS_PATH, ProxyRequest
from proxy.upstream import UpstreamError
from proxy.workers import Worker, WorkerPool
from tests.test_proxy_kv_routing import Feeds, ids, stored_batch

BLOCK = 16
PROMPT = ids(1, 100)  # the client's prompt
OUTPUT = ids(2, 20)  # the tokens a choice had when its D failed
SO_FAR = PROMPT + OUTPUT


class PlanRecorder:
    """The prefill stage's face to the other stages: records each plan it is handed, and
    computes nothing (D alone)."""

    def __init__(self) -> None:
        self.plans: list[Plan] = []

    async def prefill(self, req: ProxyRequest, plan: Plan) -> Prefilled | None:
        self.plans.append(plan)
        return None

    def give_back(self, prefilled: Prefilled | None) -> None:
        pass


class Resumed:
    """The decode stage's face to a move: every D continues it."""

    async def open_once(self, req, decode, content, timeout=None):
        return SimpleNamespace(headers={RESUMED_HEADER: "1"})


@dataclass
class Cluster:
    """1 P and 2 D's behind an orchestrator whose prefill stage records the plans."""

    orch: Orchestrator
    recorder: PlanRecorder
    workers: dict[str, Worker]
    indexes: dict[Worker, BlockIndex]

    def hold(self, name: str, token_ids: list[int]) -> None:
        """Worker `name`'s KV events say it caches `token_ids`."""
        self.indexes[self.workers[name]].apply(decode_batch(stored_batch(token_ids, BLOCK)))

    def new_request_plan(self, prompt: list[int]) -> Plan:
        """The plan of a new request of `prompt`: the one handed to the prefill stage, else
        the one taken (D alone)."""
        req = ProxyRequest(COMPLETIONS_PATH, {"prompt": prompt}, b"", "new")
        plan, _ = asyncio.run(self.orch._plan_and_prefill(req))
        return self.recorder.plans.pop() if self.recorder.plans else plan

    def move_plan(self, failed: Worker | None = None) -> Plan | Worker:
        """The plan a streamed request's choice takes when it moves after OUTPUT (its D when
        no plan reached the prefill stage: D alone)."""
        body = {"prompt": "a text prompt the proxy never tokenizes", "stream": True}
        req = ProxyRequest(COMPLETIONS_PATH, body, b"", "moved")
        client = ClientStream(req)
        client.prompt_token_ids, client.choices[0].token_ids = PROMPT, list(OUTPUT)
        orch = self.orch
        migration = Migration(
            req, client, orch.planner, self.recorder, Resumed(), orch.calls, orch.metrics
        )
        if failed is not None:
            migration.failed.add(failed)
        up = asyncio.run(migration.resume(0))
        if not self.recorder.plans:
            return up.worker
        plan = self.recorder.plans.pop()
        assert plan.decode is up.worker, "the move decodes on the D it planned"
        return plan


def cluster(**settings) -> Cluster:
    client = httpx.AsyncClient()
    roles = {"p": "prefill", "d1": "decode", "d2": "decode"}
    workers = {n: Worker(f"http://{n}:1", r, client, client._transport) for n, r in roles.items()}
    pools = {"prefill": WorkerPool("prefill"), "decode": WorkerPool("decode")}
    for w in workers.values():
        w.is_healthy = True
        pools[w.role].add(w)
    indexes = {w: BlockIndex(BLOCK) for w in workers.values()}
    urls = {"prefill": ["http://p:1"], "decode": ["http://d1:1", "http://d2:1"]}
    cfg = from_dict({**urls, **settings})
    orch = Orchestrator(cfg, pools, ProxyMetrics(pools), Feeds(indexes))
    recorder = PlanRecorder()
    orch.prefills = orch.decodes.prefills = recorder
    return Cluster(orch, recorder, workers, indexes)


@pytest.mark.parametrize(
    "settings, held, expected",
    [
        ({}, {"d2": SO_FAR[:32]}, ("d2", "disaggregated", "pull")),  # the D holding more
        ({"mode": "push"}, {"d1": SO_FAR[:48]}, ("d1", "disaggregated", "push")),
        # 120 tokens so far: long enough, counted exactly; held nowhere, D by its load
        ({"min_disagg_tokens": 110}, {}, ("d2", "disaggregated", "pull")),
    ],
)
def test_a_move_takes_the_plan_of_a_new_request_of_its_tokens(settings, held, expected):
    c = cluster(**settings)
    for name, token_ids in held.items():
        c.hold(name, token_ids)
    if not held:  # NOTE: least-outstanding's ties go round robin: one D busier decides
        c.workers["d1"].num_outstanding = 1
    moved = c.move_plan()
    assert moved == c.new_request_plan(SO_FAR)
    name, path, reason = expected
    assert (moved.decode, moved.path, moved.reason) == (c.workers[name], path, reason)
    assert moved.token_ids == SO_FAR


@pytest.mark.parametrize(
    "settings, reason",
    [
        ({"min_disagg_tokens": 200}, "short_prompt"),  # the tokens so far, counted exactly
        ({}, "cached_on_decode"),  # D holds all of them but a few
        ({"mode": "colocated"}, "mode"),
    ],
)
def test_a_move_that_a_new_request_would_send_to_d_alone_goes_to_d_alone(settings, reason):
    c = cluster(**settings)
    c.workers["d1"].num_outstanding = 1  # NOTE: no tie for least-outstanding's round robin
    if reason == "cached_on_decode":
        c.hold("d2", SO_FAR)
    new = c.new_request_plan(SO_FAR)
    assert (new.path, new.reason) == ("colocated", reason)
    assert c.move_plan() is new.decode  # D alone: P never asked, the same D


def test_a_move_leaves_out_the_d_that_failed_it_as_a_new_request_leaves_out_one_ejected():
    c = cluster()
    c.hold("d1", SO_FAR[:32])  # d1 holds more, but failed the request
    moved = c.move_plan(failed=c.workers["d1"])
    c.workers["d1"].is_healthy = False
    assert moved == c.new_request_plan(SO_FAR)
    assert moved.decode is c.workers["d2"]


def test_a_whole_request_run_again_takes_the_plan_of_a_new_request():
    """Not streamed: a D that fails before answering is replaced, and the rerun is planned (and
    prefilled) as a new request with that D out of rotation."""
    c = cluster()
    c.hold("d1", SO_FAR[:32])
    d1, d2 = c.workers["d1"], c.workers["d2"]
    asked = []

    async def answer(req, decode, prefilled, content):
        asked.append(decode)
        if decode is d1:
            raise UpstreamError(decode, "decode failed: reset by peer")
        return Response(b"{}", media_type="application/json")

    c.orch.decodes._answer_whole = answer
    req = ProxyRequest(COMPLETIONS_PATH, {"prompt": SO_FAR}, b"", "whole")
    asyncio.run(c.orch._plan_and_prefill(req))
    assert c.recorder.plans.pop().decode is d1  # the D holding more
    asyncio.run(c.orch.decodes.whole(req, d1, None))
    rerun = c.recorder.plans.pop()
    d1.is_healthy = False
    assert rerun == c.new_request_plan(SO_FAR)
    assert rerun.decode is d2 and asked == [d1, d2]
