"""The prefix-cache key (common/kv_cache/block_hash.py): a cryptographic hash of a canonical
encoding, the same in every process, that covers the model and the request's `cache_salt`."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import pytest

from common.kv_cache.block_hash import chain_hashes, hash_block, root_hash
from tests.servers import ROOT

TOKENS = list(range(1000, 1040))  # two full blocks of 16 and a partial one
# NOTE: pinned (checked by hand): a change of the encoding
# changes every key, on which two versions in one cluster would then disagree. The root:
# blake2b(b"m+" u64le(5) b"model" b"l-" u64le(0) b"s+" u64le(4) b"salt", person
# b"pdserve.kvroot1"); the block: sha256(root + int32le(1000..1015)).
GOLDEN = {
    "root": "967a60273b15dd21ea44c949ddcf2d22e54fe1a02a08dc1c2dee41866266e545",
    "block 1": "b49ed3b821357337e25cf874c50870c80febd767e0070382e8bee827e875a3dd",
}


def test_keys_are_the_same_in_every_process():
    code = (
        "from common.kv_cache.block_hash import chain_hashes, root_hash;"
        f"print([h.hex() for h in chain_hashes({TOKENS}, 16, [], root_hash('m', 'salt'))])"
    )
    runs = []
    for seed in ("1", "2"):  # str and bytes hashes differ between these; keys must not
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        runs.append(out.stdout.strip())
    here = str([h.hex() for h in chain_hashes(TOKENS, 16, [], root_hash("m", "salt"))])
    assert runs == [here, here]


def test_the_encoding_is_pinned():
    root = root_hash("model", "salt")
    first = chain_hashes(TOKENS, 16, [], root)[0]
    assert (root.hex(), first.hex()) == (GOLDEN["root"], GOLDEN["block 1"])
    assert first == hash_block(root, TOKENS[:16]) and len(first) == 32


def test_the_key_covers_the_model_the_adapter_and_the_salt():
    plain = root_hash("model")
    others = {
        root_hash("other model"),
        root_hash("model", cache_salt="a"),
        root_hash("model", cache_salt="b"),
        root_hash("model", lora_name="a"),  # the same string as an adapter: another root
        root_hash("model", cache_salt="a", lora_name="a"),
        root_hash("modela"),  # fields are length-prefixed: nothing runs into the next
        root_hash("model", cache_salt=""),
    }
    assert len(others | {plain}) == len(others) + 1
    assert root_hash("model") == plain and root_hash("model", "a") == root_hash("model", "a")
    blocks = {hash_block(root, TOKENS[:16]) for root in others | {plain}}
    assert len(blocks) == len(others) + 1, "each root starts its own chain"


def test_each_key_covers_its_parent_and_its_tokens():
    root = root_hash("model")
    a, b = chain_hashes(TOKENS, 16, [], root)
    assert chain_hashes(TOKENS[:32], 16, [a], root) == [a, b]  # extends, never rehashes
    assert hash_block(a, TOKENS[16:32]) == b
    assert hash_block(root, TOKENS[16:32]) != b  # the same tokens after another prefix
    swapped = TOKENS[:15] + [TOKENS[16], TOKENS[15]] + TOKENS[17:]
    assert chain_hashes(swapped, 16, [], root)[1] != b
    with pytest.raises(struct.error):  # not a token id: refused, never folded onto another
        hash_block(root, [5] * 15 + [5 + 2**61 - 1])  # (Python's hash() of it is 5's)
