"""Moves: a streamed request whose D fails mid-stream continues on another D, and the client
sees one uninterrupted stream (docs/design.md, "Migration").

- **When.** relay.py finds the failure (a connection error or reset, silence past
  `--decode-timeout`, an error event that is the worker's fault, a stream that ends without
  `[DONE]` before its choices did, an ejection or a drain with migration) and hands over the
  failed stream's unfinished choices.
- **How.** Each goes to another D as its own request (n = 1) with `resume`: the choice's index,
  its token ids and the characters the client has (client.py). Its prompt + tokens so far are
  planned as a new request whose prompt is those token ids (plan.py: the same D choice and the
  same rule for P, push or pull) and prefilled the same way (prefill.py); D drops P's first
  token and samples the next one itself, continuing exactly (stop strings, penalties, min/max
  tokens, the detokenizer's state, the seed's draws: common/engine/engine.py). A D that fails
  the move's call is left out and the move is planned again.
- **Refusals** (`Refused`). No other D, `--migration-limit` reached, a request whose tokens are
  not known (a D that sent no token ids, a batch of prompts), a D that does not say it
  continued (`x-pdserve-resumed`), or one that refused the move as the request's fault.
"""

from __future__ import annotations

import json
import logging

from common.api.errors import APIError, UnavailableError
from common.api.protocol import RESUMED_HEADER
from proxy.journey.calls import WorkerCalls
from proxy.journey.client import Choice, ClientStream
from proxy.journey.decode import Decodes, Upstream
from proxy.journey.plan import COLOCATED, Plan, Planner
from proxy.journey.prefill import Prefilled, Prefills
from proxy.metrics import ProxyMetrics
from proxy.request import COMPLETIONS_PATH, ProxyRequest
from proxy.upstream import UpstreamError, error_message
from proxy.workers import FailedWorkers, Worker

logger = logging.getLogger(__name__)

# what a move's prompt keeps of the client's body: the model, and the salt its cache is keyed by
_PROMPT_FIELDS = ("model", "cache_salt")


class Refused(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


def moved_prompt(req: ProxyRequest, token_ids: list[int]) -> ProxyRequest:
    """A move's prompt as a request of its own: the token ids so far (prompt + the choice's
    output), which plan.py and prefill.py take as they take a new request."""
    body: dict = {"prompt": token_ids}
    body.update((k, req.body[k]) for k in _PROMPT_FIELDS if k in req.body)
    return ProxyRequest(
        COMPLETIONS_PATH, body, b"", req.request_id, req.trace, session_id=req.session_id
    )


class Migration:
    """One streamed request's moves."""

    def __init__(
        self,
        req: ProxyRequest,
        client: ClientStream,
        planner: Planner,
        prefills: Prefills,
        decodes: Decodes,
        calls: WorkerCalls,
        metrics: ProxyMetrics,
    ):
        self.req = req
        self.client = client
        self.planner = planner
        self.prefills = prefills
        self.decodes = decodes
        self.calls = calls
        self.metrics = metrics
        self.limit = planner.cfg.migration_limit
        self.failed = FailedWorkers()  # D's that failed this request

    def can_move(self, worker: Worker) -> bool:
        """Another D could take `worker`'s choices now (`refusal` aside from the D)."""
        exclude = (*self.failed.excluded, worker)
        return self.refusal() is None and bool(self.planner.pools["decode"].routable(exclude))

    def refusal(self) -> tuple[str, str] | None:
        if self.client.num_migrations >= self.limit:
            return "limit", (
                "the decode worker failed mid-stream"
                + (f" (moved {self.limit} times already)" if self.limit else "")
            )
        if not self.client.is_tracked:
            return "untracked", "the decode worker failed mid-stream; the request cannot move"
        return None

    def begin(self, up: Upstream, reason: str) -> list[int]:
        """The choices of a failed stream that move (`resume` each); `Refused` if they cannot."""
        logger.warning("decode worker %s failed a stream (%s)", up.worker.url, reason)
        self.req.trace.end_calls_to(up.worker.url, error=reason)
        self.failed.add(up.worker)  # not for this request again (until it is back): the
        # health checks decide for the others
        moving = [i for i in up.choices if i in self.client.unfinished]
        if not moving:
            return []  # it failed after its choices finished: nothing to move
        why = self.refusal()
        if why is not None:
            raise Refused(*why)
        self.client.num_migrations += 1
        self.req.trace.event("migration", reason=reason, **{"pdserve.from_url": up.worker.url})
        return moving

    async def resume(self, index: int) -> Upstream:
        """Choice `index` continuing on another D, planned and prefilled as a new request."""
        choice = self.client.choices[index]
        ids = self.client.prompt_token_ids
        prompt = None if ids is None else moved_prompt(self.req, ids + choice.token_ids)
        while True:
            plan = await self._plan(prompt)
            prefilled = await self._prefill(prompt, plan)
            decode = plan.decode
            try:
                resp = await self.decodes.open_once(self.req, decode, self._body(index, prefilled))
            except UpstreamError as e:
                self.prefills.give_back(prefilled)
                self.calls.failed(e)
                self.failed.add(decode)
                if e.is_client_error:
                    message = error_message(e.body) or e.message
                    raise Refused("rejected", f"the request could not move: {message}") from e
                continue
            if resp.headers.get(RESUMED_HEADER) != "1":  # a worker without `resume` (vLLM's)
                decode.num_outstanding -= 1
                self.calls.spawn(resp.aclose())
                self.prefills.give_back(prefilled)
                raise Refused(
                    "unsupported", "the decode worker failed mid-stream; no other can continue it"
                )
            num_prompt = self.req.estimated_tokens() if ids is None else len(ids)
            self.metrics.migration_recomputed.inc(num_prompt + len(choice.token_ids))
            logger.info(
                "request %s choice %d continues on %s after %d tokens (%s)",
                self.req.request_id, index, decode.url, len(choice.token_ids),
                "its KV from P" if prefilled else "recomputed there",
            )  # fmt: skip
            return Upstream(resp, decode, (index,), prefilled)

    async def _plan(self, prompt: ProxyRequest | None) -> Plan:
        """The move's plan (plan.py's, as for a new request); D alone when the prompt's token
        ids are not known."""
        try:
            if prompt is None:
                excluded = self.failed.excluded
                decode = await self.planner.choose_soon("decode", self.req, excluded)
                return Plan(decode, COLOCATED, "tokens_unknown")
            return await self.planner.plan(prompt, self.failed.excluded, wait=True)
        except UnavailableError as e:
            raise Refused(
                "no_decode", "the decode worker failed mid-stream and no other can continue"
            ) from e

    async def _prefill(self, prompt: ProxyRequest | None, plan: Plan) -> Prefilled | None:
        """Prompt + tokens so far computed on P, by the plan; None: D computes them."""
        if prompt is None or not plan.is_disaggregated:
            return None
        try:
            return await self.prefills.prefill(prompt, plan)
        except APIError as e:  # P (or D's reservation) refused it: D computes it
            logger.warning("prefill for a moved request failed: %s", e)
            return None

    def _body(self, index: int, prefilled: Prefilled | None) -> bytes:
        """D's body for choice `index`: the client's, one choice, `resume`, P's params."""
        choice: Choice = self.client.choices[index]
        body = {k: v for k, v in self.req.body.items() if k not in ("best_of", "n")}
        resume = {
            "choice_index": index,
            "output_token_ids": choice.token_ids,
            "num_sent_chars": choice.num_chars,
        }
        body.update(stream=True, return_token_ids=True, resume=resume)
        if prefilled is not None:  # D samples the next token itself (penalties, seed's draw)
            params = {k: v for k, v in prefilled.params.items() if k != "first_token_id"}
            body["kv_transfer_params"] = params
        return json.dumps(body, separators=(",", ":")).encode()
