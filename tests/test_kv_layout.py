"""How a transfer addresses the paged KV: runs of blocks become descriptors, byte for byte the
blocks they stand for; the CPU KV tensors sit in huge pages where the kernel has them."""

from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest
import torch

from common.kv_cache.tensors import huge_page_zeros
from common.kv_transfer.layout import KVLayout, runs

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
    descs = layout.run_descs([2, 0], block_runs, side=0)
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
    remote_descs = layout.run_descs([2, 0], block_runs, side=1)  # the other side's starts
    assert remote_descs[0, 0] == kv[2].data_ptr() + remote[0] * layout.block_len


def test_run_descriptors_refuse_blocks_and_layers_out_of_range():
    layout = layout_of([torch.zeros(SHAPE)])
    with pytest.raises(ValueError, match="out of range"):
        layout.run_descs([0], [(38, 0, 3)], side=0)  # blocks 38..40 of 40
    with pytest.raises(ValueError, match="out of range"):
        layout.run_descs([1], [(0, 0, 1)], side=0)


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
