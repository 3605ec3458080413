"""One worker's prefix cache as its KV events describe it, and how much of a prompt it holds.

The events are vLLM 0.32's (common/kv_cache/events.py writes them; docs/interop.md): a
`BlockStored` carries, for a run of blocks of one prefix chain, the hash of the block before the
run and `block_size` token ids per block. That is enough to index a block as
`(parent hash, its tokens) → its hash` without knowing the worker's hash function (ours and
vLLM's are both sha256s, of different inputs): a prompt's cached prefix is then a walk from the
root, block by block, as long as the next `(parent, tokens)` is indexed. So the index matches
exactly what the worker's own prefix-cache lookup would find (a chain broken by an evicted
parent stops both).

A chain's first block has no parent hash, and its root is what else its key covers: a
`cache_salt` (vLLM's per-request field), which our workers name in the first block's
`extra_keys` (common/kv_cache/events.py). Such a block is indexed under that root, never the
plain one, so that a prompt without the salt is never matched to blocks its lookup cannot hit;
any other `extra_keys` on a first block (vLLM's LoRA names, images, its raw salt) root it apart
the same way.

The structs declare only the fields the index reads; msgspec skips the others, so newer vLLM
fields do no harm. Hashes may be ints or bytes (vLLM's sha256 mode). Blocks of a LoRA adapter or
of another tier than the primary cache ("GPU", vLLM's name on every device) are not indexed: a
base-model prompt with the same tokens would not hit them.

`InFlightPrefixes` indexes the other half of what a worker will soon hold: the prompts of the
prefills the proxy has in flight on it, as a trie of the same `(parent, block tokens)` keys
with a count of prompts through each node, so that how much of a prompt they share costs one
walk of the prompt's blocks, however many prefills are in flight.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import msgspec

Hash = int | bytes
PRIMARY_MEDIA = (None, "GPU")


class _Event(msgspec.Struct, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    extra_keys: list[Any] | None = None  # one entry per block (None: none)


class BlockRemoved(_Event):
    block_hashes: list[Hash]
    medium: str | None = None


class AllBlocksCleared(_Event):
    pass


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


decode_batch = msgspec.msgpack.Decoder(EventBatch).decode


Root = tuple | None  # what a chain's first block is indexed under: None, the plain root


def root_of(extra_keys: Any) -> Root:
    """The root of a chain whose first block carries these `extra_keys`."""
    if extra_keys is None:
        return None
    return ("extra_keys", msgspec.msgpack.encode(extra_keys))  # hashable, whatever they hold


class BlockIndex:
    """The blocks one worker holds: `(parent hash or root, block tokens) → hash`, and back."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._by_key: dict[tuple[Hash | Root, tuple[int, ...]], Hash] = {}
        self._key_of: dict[Hash, tuple[Hash | Root, tuple[int, ...]]] = {}

    def __len__(self) -> int:
        return len(self._key_of)

    def apply(self, batch: EventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.store(event)
            elif isinstance(event, BlockRemoved):
                if event.medium in PRIMARY_MEDIA:
                    self.remove(event.block_hashes)
            else:
                self.clear()

    def store(self, event: BlockStored) -> None:
        if event.lora_id is not None or event.medium not in PRIMARY_MEDIA:
            return
        size, parent = event.block_size, event.parent_block_hash
        if size != self.block_size or len(event.token_ids) != size * len(event.block_hashes):
            return  # not this worker's block size: nothing a prompt walk could match
        if parent is None and event.extra_keys:
            parent = root_of(event.extra_keys[0])
        for i, block_hash in enumerate(event.block_hashes):
            key = (parent, tuple(event.token_ids[i * size : (i + 1) * size]))
            self._by_key[key] = block_hash
            self._key_of[block_hash] = key
            parent = block_hash

    def remove(self, block_hashes: list[Hash]) -> None:
        for block_hash in block_hashes:
            key = self._key_of.pop(block_hash, None)
            if key is not None and self._by_key.get(key) == block_hash:
                del self._by_key[key]

    def clear(self) -> None:
        self._by_key.clear()
        self._key_of.clear()

    def match(self, token_ids: list[int], root: Root = None) -> int:
        """How many leading full blocks of the prompt this worker holds (of the chain from
        `root`: None for a prompt without a salt)."""
        size, parent, num = self.block_size, root, 0
        for start in range(0, len(token_ids) - size + 1, size):
            parent = self._by_key.get((parent, tuple(token_ids[start : start + size])))
            if parent is None:
                break
            num += 1
        return num


_Key = tuple[int, tuple[int, ...]]  # (parent node, the block's tokens); node 0 is the root


@dataclass(eq=False)  # one prefill in flight: itself, whatever its twins
class Prefill:
    path: list[_Key]  # its full blocks' keys, root first
    num_uncached: int  # tokens the worker computes for it


class InFlightPrefixes:
    """The prompts of one worker's prefills in flight: `add` when one starts, `remove` when it
    ends; `match` is the longest run of leading full blocks a prompt shares with any of them."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.num_uncached = 0  # tokens the worker computes for all of them
        self._node_of: dict[_Key, int] = {}
        self._num_through: dict[_Key, int] = {}  # prompts in flight through each node
        self._next_node = itertools.count(1)
        self._prefills: set[Prefill] = set()

    def __len__(self) -> int:
        return len(self._prefills)

    @property
    def num_nodes(self) -> int:
        return len(self._node_of)

    def add(self, token_ids: list[int], num_uncached: int) -> Prefill:
        path, parent = [], 0
        for block in self._blocks(token_ids):
            key = (parent, block)
            node = self._node_of.get(key)
            if node is None:
                node = self._node_of[key] = next(self._next_node)
            self._num_through[key] = self._num_through.get(key, 0) + 1
            path.append(key)
            parent = node
        prefill = Prefill(path, num_uncached)
        self._prefills.add(prefill)
        self.num_uncached += num_uncached
        return prefill

    def remove(self, prefill: Prefill) -> None:
        self._prefills.remove(prefill)
        self.num_uncached -= prefill.num_uncached
        for key in prefill.path:
            self._num_through[key] -= 1
            if not self._num_through[key]:
                del self._num_through[key], self._node_of[key]

    def match(self, token_ids: list[int]) -> int:
        """How many leading full blocks of the prompt some prefill in flight shares."""
        num, parent = 0, 0
        for block in self._blocks(token_ids):
            node = self._node_of.get((parent, block))
            if node is None:
                break
            num, parent = num + 1, node
        return num

    def _blocks(self, token_ids: list[int]):
        size = self.block_size
        for start in range(0, len(token_ids) - size + 1, size):
            yield tuple(token_ids[start : start + size])
