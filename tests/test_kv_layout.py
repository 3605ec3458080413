"""How a transfer addresses the paged KV: runs of blocks become descriptors, byte for byte the
blocks they stand for; the CPU KV tensors sit in huge pages where the kernel has them."""

from __future__ import annotations

import ctypes
import gc
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from common.kv_cache.tensors import huge_page_zeros
from common.kv_transfer.layout import KVLayout, ShardTensors, runs, transfer_descs

SHAPE = (2, 40, 16, 2, 8)  # 40 blocks of 16 tokens, 2 KV heads of 8


@pytest.mark.parametrize(
    "local, remote, expected",
    [
        ([], [], []),
        ([5], [9], [(5, 9, 1)]),
        ([3, 4, 5, 6], [0, 1, 2, 3], [(3, 0, 4)]),
        ([3, 4, 5, 9], [7, 8, 9, 2], [(3, 7, 3), (9, 2, 1)]),
        ([1, 2, 3], [4, 6, 7], [(1, 4, 1), (2, 6, 2)]),  # consecutive here, not there
        ([2, 1, 0], [0, 1, 2], [(2, 0, 1), (1, 1, 1), (0, 2, 1)]),  # going down: no run
    ],
)
def test_runs_are_consecutive_on_both_sides(local, remote, expected):
    assert runs(local, remote) == expected


def test_runs_need_as_many_blocks_on_each_side():
    with pytest.raises(ValueError, match="remote"):
        runs([1, 2], [1])


def layout_of(kv: list[torch.Tensor]) -> KVLayout:
    return KVLayout.of("e", "a", kv)


def test_run_descriptors_cover_exactly_the_blocks_bytes():
    """Every (addr, len) row read from memory equals, in order, the K then V bytes of the
    blocks of its run, layer by layer: a run is the blocks it stands for, nothing else."""
    kv = [torch.randn(SHAPE) for _ in range(3)]
    layout = layout_of(kv)
    local, remote = [7, 8, 9, 20, 21, 3], [0, 1, 2, 10, 11, 39]
    block_runs = runs(local, remote)
    descs, remote_descs = transfer_descs(layout, layout, [2, 0], block_runs, dest_is_local=True)
    assert len(descs) == 2 * 2 * len(block_runs)  # layers x K/V x runs
    as_bytes = {t.data_ptr(): t.view(-1).view(torch.uint8) for t in kv}
    got = []
    for addr, size, device in descs.tolist():
        assert device == 0
        base = max(b for b in as_bytes if b <= addr)
        got.append(as_bytes[base][addr - base : addr - base + size])
    want = [
        kv[layer][kv_idx, start : start + n].reshape(-1).view(torch.uint8)
        for layer in (2, 0)
        for kv_idx in (0, 1)
        for start, _, n in block_runs
    ]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    block_len = layout.block_len(layout.shards[0])  # the other side's starts:
    assert remote_descs[0, 0] == kv[2].data_ptr() + remote[0] * block_len


def test_run_descriptors_refuse_blocks_and_layers_out_of_range():
    layout = layout_of([torch.zeros(SHAPE)])
    with pytest.raises(ValueError, match="out of range"):
        transfer_descs(layout, layout, [0], [(38, 0, 3)], True)  # blocks 38..40 of 40
    with pytest.raises(ValueError, match="out of range"):
        transfer_descs(layout, layout, [0], [(0, 38, 3)], True)
    with pytest.raises(ValueError, match="out of range"):
        transfer_descs(layout, layout, [1], [(0, 0, 1)], True)


def anon_huge_kib(tensor: torch.Tensor) -> int:
    """AnonHugePages (KiB) of the mapping that holds `tensor`, from /proc/self/smaps."""
    addr = tensor.data_ptr()
    mapping = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if m := re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line):
            mapping = int(m[1], 16) <= addr < int(m[2], 16)
        elif mapping and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError("no mapping holds the tensor")


def thp_enabled() -> bool:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.exists() and "[never]" not in path.read_text()


def test_huge_page_tensors_are_zeroed_aligned_and_outlive_their_maker():
    t = huge_page_zeros((2, 256, 16, 8, 64), torch.bfloat16)  # 8 MiB
    assert t.is_contiguous() and t.dtype == torch.bfloat16 and t.shape == (2, 256, 16, 8, 64)
    assert t.data_ptr() % (2 << 20) == 0 and not t.any()
    gc.collect()  # the mapping lives as long as the tensor
    t.fill_(3)
    assert float(t.float().sum()) == 3 * t.numel()
    if thp_enabled():  # this machine's kernel (madvise mode) backs it with 2 MiB pages
        assert anon_huge_kib(t) >= 4 << 10, "the KV tensor got no huge pages"


def split_heads(full: list[torch.Tensor], bounds: list[tuple[int, int]]) -> list[ShardTensors]:
    """A TP layout's shards of `full`: heads [first, stop) each, as contiguous copies."""
    return [ShardTensors(a, [t[:, :, :, a:b].clone() for t in full]) for a, b in bounds]


def apply(local: np.ndarray, remote: np.ndarray, dest_is_local: bool) -> None:
    """What NIXL does with the rows: copy each source row's bytes over its destination row."""
    for (la, ln, _), (ra, rn, _) in zip(local.tolist(), remote.tolist(), strict=True):
        assert ln == rn
        dst, src = (la, ra) if dest_is_local else (ra, la)
        ctypes.memmove(dst, src, ln)


@pytest.mark.parametrize(
    "ours, theirs",
    [
        ([(0, 3)], [(0, 1), (1, 3)]),  # D at TP 1 reads SmolLM2-like uneven halves of P at TP 2
        ([(0, 1), (1, 3)], [(0, 3)]),  # D at TP 2 reads its heads of P at TP 1
        ([(0, 2), (2, 3)], [(0, 1), (1, 3)]),  # both at TP 2, split differently
        ([(0, 1), (0, 1)], [(0, 1)]),  # one KV head, replicated on D's two ranks
    ],
)
@pytest.mark.parametrize("dest_is_local", [True, False], ids=["read", "write"])
def test_head_sliced_descriptors_move_each_head_where_it_belongs(ours, theirs, dest_is_local):
    """Every head of every block a transfer names ends up in the destination's shard that holds
    it, from the source shard that holds it; nothing outside the named blocks moves."""
    heads = max(b for _, b in ours + theirs)
    full = [torch.randn(2, 10, 4, heads, 8) for _ in range(3)]
    blank = [torch.zeros_like(t) for t in full]
    src, dest = (theirs, ours) if dest_is_local else (ours, theirs)
    src_shards, dest_shards = split_heads(full, src), split_heads(blank, dest)
    local_shards, remote_shards = (
        (dest_shards, src_shards) if dest_is_local else (src_shards, dest_shards)
    )
    local = KVLayout.of("here", "a", local_shards, heads)
    remote = KVLayout.of("there", "b", remote_shards, heads)
    local.check_peer(remote)
    local_blocks, remote_blocks = [1, 2, 3, 7], [4, 5, 6, 0]
    block_runs = runs(local_blocks, remote_blocks)
    descs = transfer_descs(local, remote, [0, 2], block_runs, dest_is_local)
    apply(*descs, dest_is_local)
    dest_blocks = local_blocks if dest_is_local else remote_blocks
    src_blocks = remote_blocks if dest_is_local else local_blocks
    for shard in dest_shards:
        n = shard.kv_caches[0].shape[3]
        for layer in range(3):
            got = shard.kv_caches[layer]
            want = full[layer][:, :, :, shard.first_head : shard.first_head + n]
            if layer == 1:  # not named: untouched
                assert not got.any()
                continue
            assert torch.equal(got[:, dest_blocks], want[:, src_blocks])
            others = [b for b in range(10) if b not in dest_blocks]
            assert not got[:, others].any()


def test_a_peer_missing_heads_or_of_another_shape_is_refused_naming_both():
    kv = [torch.zeros(2, 10, 4, 3, 8)]
    ours = KVLayout.of("d", "a", [ShardTensors(0, kv)], 3)
    half = KVLayout.of("p", "b", [ShardTensors(0, [t[:, :, :, :2].clone() for t in kv])], 3)
    with pytest.raises(ValueError, match=r"KV head 2 of d \(shards 0-2\).*of p \(shards 0-1\)"):
        ours.check_peer(half)
    other = KVLayout.of("p", "b", [torch.zeros(2, 10, 8, 3, 8)])
    with pytest.raises(
        ValueError, match=r"peer p has .* \(1, 8, 3, 8, 'float32'\); we have \(1, 4,"
    ):
        ours.check_peer(other)
