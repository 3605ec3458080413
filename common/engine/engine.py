"""The engine: requests in, outputs out, one `step()` at a time.

    step: schedule → run the model (prepare, forward, sample) → update requests → outputs

With `tensor_parallel_size` N > 1 the engine is rank 0 of N (common/parallel/): one shard of the
model and KV cache, ranks 1..N-1 as processes fed each step's plan; scheduling, blocks and
sampling stay here; so does the KV connector, to which every rank's KV is shared (kv_shards.py).
What happens between steps to a request whose KV crosses workers (a pushed prompt awaited, a
load that failed, an answer held while its KV is sent) is kv_transfer/remote_prefills.py's.

A request with `n > 1` fans out into n child sequences (`<id>#<i>`); its outputs come back
under the parent id with each child's index. With prefix caching on, the first child prefills
alone and its siblings join once the prompt is computed: they share its full prompt blocks
(ref counts > 1) and recompute only the last, partial block.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from common.attention.backends import select_backend
from common.config import EngineConfig, TransferConfig
from common.engine.decode_graphs import decode_graph_sizes
from common.engine.model_runner import ModelRunner
from common.engine.output import OutputProcessor, RequestOutput
from common.engine.request import Request, RequestStatus, Resume
from common.engine.sampler import SampledToken, Sampler, skip_draw
from common.engine.sampling_params import SamplingParams
from common.engine.scheduler import Scheduler
from common.engine.structured import GrammarCompiler, GrammarMasks
from common.kv_cache.block_pool import BlockPool
from common.kv_cache.manager import KVCacheManager
from common.kv_cache.tensors import allocate_kv_caches, num_blocks_for_memory
from common.kv_transfer import create_connector
from common.kv_transfer.base import KVConnector, Reservation
from common.kv_transfer.handshake import compat_hash, local_compat
from common.kv_transfer.params import RemotePrefill, wants_remote_prefill
from common.kv_transfer.remote_prefills import RemotePrefills
from common.model.hf_config import load_arch_config
from common.model.loader import load_model
from common.parallel.group import TPGroup
from common.parallel.launch import RankDiedError, start_ranks
from common.parallel.shard import TPShard, kv_heads_held
from common.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

RANK_MAIN = "common.engine.rank_main"  # what ranks 1..N-1 run (`python -m`)


@dataclass
class _Parent:
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request] = field(default_factory=list)


ConnectorFactory = Callable[[TransferConfig, int, BlockPool], KVConnector | None]


class LLMEngine:
    def __init__(self, config: EngineConfig, make_connector: ConnectorFactory = create_connector):
        """`make_connector(transfer config, block size, pool)`: the KV connector, from the
        registry by default (`TransferConfig.connector`); tests give a fake of their own. The
        tensor-parallel ranks share their KV with rank 0 when `TransferConfig.connector` names
        one, whoever makes it."""
        self.config = config
        mc, cc = config.model, config.cache
        model_dir = mc.model_dir
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.arch = load_arch_config(model_dir)
        self.max_model_len = mc.resolve_max_model_len(self.arch.max_position_embeddings)
        self.device = torch.device(mc.device)
        dtype, why = mc.dtype_choice.dtype, mc.dtype_choice.reason
        logger.info("dtype %s (--dtype %s: %s)", str(dtype).removeprefix("torch."), mc.dtype, why)
        torch.manual_seed(mc.seed)
        tp_size = config.parallel.tensor_parallel_size
        self.tp = TPGroup(TPShard(0, tp_size), self.device) if tp_size > 1 else None
        held = dataclasses.replace(self.arch, num_kv_heads=kv_heads_held(self.arch, tp_size))
        self.num_blocks = cc.num_blocks or num_blocks_for_memory(  # the budget of all ranks
            held, cc.block_size, dtype, cc.kv_cache_memory
        )
        if self.num_blocks * cc.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {self.num_blocks * cc.block_size} tokens, fewer than "
                f"max_model_len={self.max_model_len}: raise num_blocks / kv_cache_memory or lower "
                "max_model_len"
            )
        share = self.arch if config.transfer.connector is not None else None
        self.ranks = self.tp and start_ranks(
            config, dtype, self.max_model_len, self.num_blocks, RANK_MAIN, share
        )
        self.model = load_model(model_dir, dtype, self.device, self.max_model_len, self.tp)
        backend = select_backend(
            self.device, dtype, cc.block_size, mc.attention_backend, not mc.enforce_eager
        )
        for layer in self.model.attention_layers().values():
            layer.backend = backend
        self.kv_caches = allocate_kv_caches(
            self.model.config, self.num_blocks, cc.block_size, dtype, self.device
        )
        plans = self.ranks and self.ranks.connect(self.tp, cc.block_size)  # ranks loaded
        spare = (self.num_blocks - 1) * cc.block_size >= self.max_model_len  # a pad block
        graph_sizes = decode_graph_sizes(config, self.device, backend.decode_graphs, self.tp, spare)
        # the cache's last block pads captured decodes: the pool never hands it out
        self.pool = BlockPool(self.num_blocks - bool(graph_sizes), cc.enable_prefix_caching)
        eos = tuple(sorted(set(self.arch.eos_token_ids) | set(self.tokenizer.eos_token_ids)))
        self.eos_token_ids = eos
        self.grammars = GrammarCompiler(self.tokenizer, self.arch.vocab_size, eos, config.grammar)
        self.grammars.warm_up()  # the first request with a grammar does not wait for it
        self.connector = make_connector(config.transfer, cc.block_size, self.pool)
        # the prefix cache's keys cover the model as peers check it before moving KV
        kv = KVCacheManager(self.pool, cc.block_size, compat_hash(local_compat(config, self.arch)))
        self.scheduler = Scheduler(config.scheduler, kv, self.max_model_len, eos, self.connector)
        self.runner = ModelRunner(
            self.model,
            self.kv_caches,
            cc.block_size,
            Sampler(eos),
            self.device,
            self.connector,
            enforce_eager=mc.enforce_eager,
            plans=plans,
            kv_shards=self.ranks and self.ranks.kv_shards(self.kv_caches),
            graph_sizes=graph_sizes,
            max_model_len=self.max_model_len,
            pad_block=self.num_blocks - 1,
            masks=GrammarMasks(
                self.grammars.vocab_size, config.grammar.mask_budget_ms, self.grammars.stats
            ),
        )
        self.remote = RemotePrefills(
            self.connector, self.scheduler, config.transfer, cc.block_size, self.pool
        )
        self.outputs = OutputProcessor(self.tokenizer)
        self._parents: dict[str, _Parent] = {}
        self._held: dict[str, list[Request]] = {}  # first child id → siblings not yet scheduled
        self._children: dict[str, tuple[str, int]] = {}
        logger.info(
            "engine ready: %s, %d layers, %d KV blocks of %d tokens, max_model_len %d, "
            "up to %d tokens a step",
            self.arch.architecture,
            self.arch.num_layers,
            self.num_blocks,
            cc.block_size,
            self.max_model_len,
            config.scheduler.max_num_batched_tokens,
        )

    def watch_ranks(self, on_death: Callable[[RankDiedError], None]) -> None:
        if self.ranks is not None:
            self.ranks.watch(on_death)

    def shutdown(self, failed: bool = False) -> None:
        """Stop the tensor-parallel ranks (on the engine's thread; `failed`: kill them, a step
        may be half done); nothing at TP = 1."""
        if self.ranks is not None:
            self.ranks, ranks = None, self.ranks
            ranks.stop(None if failed else self.runner.plans)
            self.tp.close()

    # -- requests -------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        kv_transfer_params: dict | None = None,
        resume: Resume | None = None,
    ) -> None:
        """`resume`: run the request as choice `resume.choice_index` of one that another worker
        started, from its next token (n must be 1)."""
        params = params or SamplingParams()
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self._tokenize(prompt)
        params.check_token_ids(self.arch.vocab_size)
        if params.structured is not None:
            self.grammars.check_rows(params.n)
            self.grammars.check(params.structured)
        if resume is not None:
            self.check_resume(token_ids, params, resume)
        parent = _Parent(text, token_ids)
        for i in [resume.choice_index] if resume else range(params.n):
            child_id = f"{request_id}#{i}" if params.n > 1 else request_id
            child = Request(
                child_id,
                token_ids,
                _child_params(params, i),
                prompt=text,
                kv_transfer_params=kv_transfer_params if not parent.children else None,
                grammar=params.structured and self.grammars.grammar(params.structured),
            )
            self.outputs.add_request(child)
            if resume is not None:
                self._resume(child, resume)
            parent.children.append(child)
            self._children[child.request_id] = (request_id, i)
        first, siblings = parent.children[0], parent.children[1:]
        if wants_remote_prefill(kv_transfer_params) and self.connector is not None:
            first.remote_prefill = RemotePrefill.parse(kv_transfer_params)
            self._accept_first_token(first)
            self.remote.add(first)
        else:
            self.scheduler.add_request(first)
        if siblings and self.pool.enable_prefix_caching:
            self._held[first.request_id] = siblings
        else:
            for sibling in siblings:
                self.scheduler.add_request(sibling)
        self._parents[request_id] = parent

    def abort_request(self, request_id: str) -> None:
        parent = self._parents.pop(request_id, None)
        for child in parent.children if parent else []:
            self._held.pop(child.request_id, None)
            self.remote.abort(child)
            self.scheduler.finish(child, RequestStatus.FINISHED_ABORTED)
            self.outputs.remove(child.request_id)
            self._children.pop(child.request_id, None)

    def reserve_push(
        self, num_tokens: int, token_ids: list[int] | None = None, cache_salt: str | None = None
    ) -> Reservation:
        """D, push mode: blocks for a prefill worker to write a prompt into, led by the blocks
        of it this worker has cached (given `token_ids`, under the request's `cache_salt`),
        which it need not write."""
        held = self.scheduler.kv.take_cached_prefix(token_ids, cache_salt) if token_ids else []
        return self.connector.reserve(num_tokens, held)

    def lease_prefix(self, token_ids: list[int], cache_salt: str | None = None) -> dict | None:
        """D, the reverse pull: hold the leading blocks of a prompt that this worker has cached
        (under the request's `cache_salt`) for a prefill worker to read; the
        `kv_transfer_params` it reads them with, or None when none are cached."""
        blocks = self.scheduler.kv.take_cached_prefix(token_ids, cache_salt)
        if not blocks:
            return None
        return self.connector.lease_prefix(f"prefix-{uuid.uuid4().hex}", blocks)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or self.remote.has_ready

    def poll_transfers(self) -> None:
        """Between steps: the connector's notifications; pushed KV that landed is admitted."""
        self.remote.poll()

    def has_pending_transfers(self) -> bool:
        return self.connector is not None and self.connector.has_pending()

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.poll_transfers()  # also admits requests whose pushed KV has landed
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return self._make_outputs(self.remote.take_ready())
        meta = self.connector.build_connector_meta(sched.scheduled) if self.connector else None
        sampled = self.runner.execute(sched.scheduled, meta)
        sched.scheduled = self.remote.drop_failed_loads(sched.scheduled, sampled)
        changed = self.remote.hold_sending(self.scheduler.update(sched, sampled))
        self._release_siblings()
        return self._make_outputs(self.remote.take_ready() + changed)

    def check_resume(self, prompt_ids: list[int], params: SamplingParams, resume: Resume) -> None:
        """ValueError if `resume` cannot continue this prompt (reads only fixed fields: the
        server calls it on its event loop to answer a 400 before a stream starts)."""
        num = resume.num_tokens
        if params.n != 1:
            raise ValueError(f"a resumed request runs one choice: n must be 1, got {params.n}")
        if resume.choice_index < 0 or resume.num_sent_chars < 0:
            raise ValueError("resume's choice_index and num_sent_chars must be >= 0")
        bad = [t for t in resume.output_token_ids if not 0 <= t < self.arch.vocab_size]
        if bad:
            raise ValueError(f"resumed token ids must be in [0, {self.arch.vocab_size}): {bad[:5]}")
        if num >= params.max_tokens:
            raise ValueError(f"{num} resumed tokens leave none of max_tokens={params.max_tokens}")
        if len(prompt_ids) + num >= self.max_model_len:
            raise ValueError(
                f"the prompt and {num} resumed tokens fill max_model_len={self.max_model_len}"
            )

    def _resume(self, req: Request, resume: Resume) -> None:
        """The outputs another worker generated, as if generated here: appended (counts and
        penalties see them), one seeded draw skipped for each, and the text the client has
        marked sent. ValueError (nothing registered) if `num_sent_chars` passes that text."""
        req.append_resumed(resume.output_token_ids)
        if req.grammar is not None and req.grammar.error is not None:
            self.outputs.remove(req.request_id)
            raise ValueError(f"resume: {req.grammar.error}")
        for _ in range(resume.num_tokens):  # NOTE: exactly the draws the sampler made for them
            skip_draw(req)
        try:
            self.outputs.resume(req, resume.num_sent_chars)
        except ValueError:
            self.outputs.remove(req.request_id)
            raise

    def _accept_first_token(self, req: Request) -> None:
        """D: take the prefill worker's first token as generated here (seeded draws included);
        `RemotePrefills.add` then sees whether it ends the request."""
        token_id = req.remote_prefill.first_token_id
        if token_id is None:
            return  # vLLM-style: the last prompt token is recomputed and sampled here
        req.append_token(SampledToken(token_id))
        skip_draw(req)
        if req.remote_prefill.first_token_streamed:  # the client has it: stream from the 2nd
            self.outputs.process(req)
            self.outputs.mark_sent(req.request_id)

    def _release_siblings(self) -> None:
        """Schedule the siblings of first children whose prompt is now computed (and cached)."""
        for first_id in list(self._held):
            first = self._parents[self._children[first_id][0]].children[0]
            if first.num_output_tokens > 0 or first.is_finished:
                for sibling in self._held.pop(first_id):
                    self.scheduler.add_request(sibling)

    def _make_outputs(self, changed: list[Request]) -> list[RequestOutput]:
        by_parent: dict[str, RequestOutput] = {}
        for req in changed:
            completion, stop_str = self.outputs.process(req)
            if stop_str is not None:
                self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED, stop_str)
            parent_id, index = self._children[req.request_id]
            parent = self._parents[parent_id]
            completion.index = index
            head = (parent_id, parent.prompt, parent.prompt_token_ids, [], False)
            out = by_parent.setdefault(
                parent_id, RequestOutput(*head, parent.children[0].num_cached_tokens)
            )
            out.outputs.append(completion)
        for parent_id, out in by_parent.items():
            children = self._parents[parent_id].children
            out.finished = all(c.is_finished for c in children)
            out.kv_transfer_params = children[0].kv_transfer_params_out
            failed = next((c for c in children if c.error), None)
            out.error = failed and failed.error
            out.error_is_request_fault = bool(failed and failed.error_is_request_fault)
            out.grammar_error_code = failed.grammar_error_code if failed else None
            if out.finished:
                out.times = children[0].times
                self._forget(parent_id)
        return list(by_parent.values())

    def _forget(self, parent_id: str) -> None:
        for child in self._parents.pop(parent_id).children:
            self._children.pop(child.request_id, None)

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
            bad = [
                t for t in token_ids if not (isinstance(t, int) and 0 <= t < self.arch.vocab_size)
            ]
            if bad:
                raise ValueError(
                    f"prompt token ids must be in [0, {self.arch.vocab_size}), got {bad[:5]}"
                )
        if not token_ids:
            raise ValueError("prompt must not be empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(token_ids)} tokens, max_model_len is "
                f"{self.max_model_len} (the prompt plus one output token must fit)"
            )
        return text, token_ids


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    # NOTE: torch takes seeds modulo 2**64 (-1 is 2**64 - 1) but refuses any outside
    # [-2**63, 2**64): wrap, so that the last seed the API accepts still has siblings
    seed = None if params.seed is None else (params.seed + index) % 2**64
    return dataclasses.replace(params, n=1, seed=seed)
