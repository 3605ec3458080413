"""`EngineClient`: the worker's one door to its engine. The HTTP layer (common/api/) talks to
the engine through it and nothing else, as vLLM's API server sees only its `EngineClient`.

    route (common/api/) → EngineClient → AsyncEngine (the engine thread) → LLMEngine

What it offers, by kind:
- lifecycle: `start`, `stop`, `is_alive`, `error`, `end_all` (hand every stream on);
- the model's limits, fixed once built (read on the event loop): `model_name`,
  `max_model_len`, `vocab_size`, `block_size`, `config`, `tokenizer` and what is done with it
  (`tokenize`, `decoded_text`), `compile_seconds`, `num_threads`;
- checks before a stream starts: `check_resume`, `check_grammar_rows`, `compile_grammar`;
- generation: `generate` (outputs until finished; leaving early aborts), `num_waiting`,
  `num_unfinished`, `stats` (the last `EngineStats`);
- the P/D door, where this worker moves KV (`has_connector`): `handshake_info` (ours),
  `ensure_peer` (theirs, a handshake the first time), `remote_unreachable` (the failure policy,
  common/kv_transfer/remote_prefills.py), `reserve_push`, `lease_prefix`,
  `release_reservation`, `release_lease`, `num_peers`.

Every call that touches the engine's tables runs on the engine thread between steps; the
client never hands out the engine, its connector or a way to run an arbitrary function there.

What it raises for the HTTP layer to answer: `EngineDeadError` (the engine thread is gone),
`GrammarError` (a structured output refused), `NoFreeBlocksError` (nothing to reserve),
`PeerIncompatible` and `PeerUnreachable` (a KV peer), ValueError (a request's bad input).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from pathlib import Path

from common.config import EngineConfig
from common.engine.async_engine import AsyncEngine, EngineDeadError
from common.engine.engine import LLMEngine
from common.engine.output import RequestOutput, decoded_text
from common.engine.request import Resume
from common.engine.sampling_params import SamplingParams, StructuredOutputs
from common.engine.stats import EngineStats
from common.engine.structured import GrammarError
from common.kv_cache.block_pool import NoFreeBlocksError
from common.kv_transfer.handshake import HandshakeInfo, compat_hash, encode_metadata, local_compat
from common.kv_transfer.params import PushTarget, RemotePrefill
from common.kv_transfer.peers import PeerIncompatible, Peers, PeerUnreachable
from common.tokenizer import Tokenizer

__all__ = [
    "EngineClient",
    "EngineFactory",
    "EngineDeadError",
    "GrammarError",
    "NoFreeBlocksError",
    "PeerIncompatible",
    "PeerUnreachable",
]

EngineFactory = Callable[[], LLMEngine]  # builds the engine, on the engine thread


def engine_factory(config: EngineConfig) -> EngineFactory:
    """The engine a worker serves, built from its config."""
    return lambda: LLMEngine(config)


class EngineClient:
    def __init__(
        self,
        engine_factory: EngineFactory,
        on_death: Callable[[BaseException], None] | None = None,
        num_threads: int | None = None,
        on_the_way: Callable[[], int] | None = None,
        arrival_wait: float = 0.0,
        peer_headers: dict[str, str] | None = None,
        on_handshake: Callable[[], None] = lambda: None,
    ):
        """The first five as `AsyncEngine`'s; `peer_headers`: sent with every handshake with a
        KV peer (the cluster token); `on_handshake`: counts each new peer (metrics)."""
        self._engine = AsyncEngine(
            engine_factory,
            on_death=on_death,
            num_threads=num_threads,
            on_the_way=on_the_way,
            arrival_wait=arrival_wait,
        )
        self._peer_headers = peer_headers or {}
        self._on_handshake = on_handshake
        self._llm: LLMEngine | None = None  # once built; its fixed fields are read here
        self._peers: Peers | None = None  # with a KV connector

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Build the engine on its thread; raises what building raised."""
        await self._engine.start()
        self._llm = self._engine.engine
        if self._llm.connector is not None:
            self._peers = Peers(
                self._llm.connector,
                self._engine.call,
                lambda: local_compat(self._llm.config, self._llm.arch),
                self._peer_headers,
                on_handshake=self._on_handshake,
            )

    async def stop(self) -> None:
        await self._engine.stop()

    @property
    def is_alive(self) -> bool:
        return self._engine.is_alive

    @property
    def error(self) -> BaseException | None:
        return self._engine.error

    def end_all(self, make_error: Callable[[], BaseException]) -> None:
        """Every stream, and every later one, ends with `make_error()` (`AsyncEngine.end_all`)."""
        self._engine.end_all(make_error)

    # -- the model's limits --------------------------------------------------------------------
    @property
    def config(self) -> EngineConfig:
        return self._llm.config

    @property
    def model_name(self) -> str:
        """The model folder's name: what the worker serves unless told another."""
        return Path(self._llm.config.model.model_dir).name

    @property
    def max_model_len(self) -> int:
        return self._llm.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._llm.arch.vocab_size

    @property
    def block_size(self) -> int:
        return self._llm.config.cache.block_size

    @property
    def tokenizer(self) -> Tokenizer:
        return self._llm.tokenizer

    @property
    def compile_seconds(self) -> float:
        """Seconds the compiled forward took to build (0: eager)."""
        return self._llm.runner.compile_seconds

    @property
    def num_threads(self) -> int | None:
        return self._engine.num_threads

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """A prompt's token ids (text is encoded, ids are kept). Blocking: off the event loop."""
        return self._llm.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def decoded_text(self, prompt_ids: list[int], output_ids: list[int], skip: bool) -> str:
        """The text a stream has made final after `output_ids` (output.decoded_text). Blocking."""
        return decoded_text(self._llm.tokenizer, prompt_ids, output_ids, skip)

    # -- checks before a stream starts ---------------------------------------------------------
    def check_resume(self, prompt_ids: list[int], params: SamplingParams, resume: Resume) -> None:
        """ValueError if `resume` cannot continue this prompt (LLMEngine.check_resume)."""
        self._llm.check_resume(prompt_ids, params, resume)

    def check_grammar_rows(self, n: int) -> None:
        """GrammarError for more choices than a grammar may have."""
        self._llm.grammars.check_rows(n)

    async def compile_grammar(self, spec: StructuredOutputs) -> None:
        """GrammarError for a structured output that cannot compile, hits a grammar limit or
        does not compile within its budget. It compiles on the compiler's threads (cached for
        the engine); the event loop waits at most the budget."""
        grammars = self._llm.grammars
        await _within(grammars.submit(spec), grammars.compile_budget)
        grammars.check(spec, timeout=0)

    # -- generation ----------------------------------------------------------------------------
    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_transfer_params: dict | None = None,
        resume: Resume | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request until it finishes (`AsyncEngine.generate`)."""
        return self._engine.generate(
            request_id, prompt_token_ids, params, kv_transfer_params, resume
        )

    @property
    def num_waiting(self) -> int:
        return self._engine.num_waiting

    @property
    def num_unfinished(self) -> int:
        return self._engine.num_unfinished

    @property
    def stats(self) -> EngineStats:
        return self._engine.stats

    # -- the P/D door --------------------------------------------------------------------------
    @property
    def has_connector(self) -> bool:
        return self._llm.connector is not None

    @property
    def num_peers(self) -> int:
        return self._llm.connector.num_peers if self._llm.connector is not None else 0

    def handshake_info(self) -> HandshakeInfo | None:
        """What a peer needs to move KV with this worker; None without a connector. Blocking
        (reads the model folder the first time)."""
        llm = self._llm
        info = llm.connector and llm.connector.peer_info()
        if info is None:
            return None
        fields = local_compat(llm.config, llm.arch)
        return HandshakeInfo(
            engine_id=llm.config.transfer.engine_id,
            protocol_version=fields["protocol_version"],
            compat_hash=compat_hash(fields),
            compat=fields,
            layout=info.layout,
            agent_metadata=encode_metadata(info.metadata),
        )

    async def ensure_peer(self, engine_id: str, host: str, port: int) -> bool:
        """The peer is known once this returns (`Peers.ensure`); True when it waited for a
        handshake. PeerIncompatible, PeerUnreachable."""
        assert self._peers is not None, "a worker without a KV connector has no peers"
        return await self._peers.ensure(engine_id, host, port)

    async def remote_unreachable(self, remote: RemotePrefill, why: str) -> bool:
        """The peer `remote` names could not be reached: True when its KV is computed here
        instead (counted), False when the request fails (`RemotePrefills.unreachable`)."""
        return await self._on_engine(self._llm.remote.unreachable, remote, why)

    async def reserve_push(
        self, num_tokens: int, token_ids: list[int] | None, cache_salt: str | None
    ) -> PushTarget:
        """D: blocks for a prefill worker to write a prompt into, as the target it writes to
        (LLMEngine.reserve_push). NoFreeBlocksError."""
        res = await self._on_engine(self._llm.reserve_push, num_tokens, token_ids, cache_salt)
        transfer = self._llm.config.transfer
        return PushTarget(
            engine_id=transfer.engine_id,
            reservation_id=res.reservation_id,
            block_ids=[b.block_id for b in res.blocks],
            host=transfer.advertise_host,
            port=transfer.advertise_port,
            write_by=res.write_by,  # P writes nothing after this (unix time, our clock)
            num_held_blocks=res.num_held,  # cached here already: P writes the rest
        )

    async def lease_prefix(self, token_ids: list[int], cache_salt: str | None) -> dict | None:
        """D, the reverse pull: the `kv_transfer_params` of the prompt's cached leading blocks,
        held for a prefill worker to read; None when none are cached."""
        return await self._on_engine(self._llm.lease_prefix, token_ids, cache_salt)

    async def release_reservation(self, reservation_id: str) -> bool:
        return await self._on_engine(self._llm.connector.release_reservation, reservation_id)

    async def release_lease(self, request_id: str) -> bool:
        return await self._on_engine(self._llm.connector.release_lease, request_id)

    def _on_engine(self, fn: Callable, *args) -> asyncio.Future:
        """`fn(*args)` on the engine thread, between steps."""
        return asyncio.wrap_future(self._engine.call(fn, *args))


async def _within(future: Future, seconds: float) -> None:
    """Wait at most `seconds` for a thread's `future`, which goes on whatever happens here."""
    waiter = asyncio.wrap_future(future)
    waiter.add_done_callback(lambda f: f.cancelled() or f.exception())  # NOTE: read, not logged
    await asyncio.wait([waiter], timeout=seconds)
