"""Packed weights moved into huge pages keep their values, their layout and their alignment, share
one buffer, and, where the OS gives transparent huge pages, sit on them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from faser_kernels import huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


def _tensors() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(3, 5).bfloat16(), torch.randint(-127, 127, (1536, 2048), dtype=torch.int8),
            torch.randn(7), torch.randn(1024, 1024).bfloat16()]


def test_moved_tensors_keep_their_values_in_one_aligned_buffer():
    if not huge_pages.available():
        pytest.skip("no MADV_HUGEPAGE here")
    tensors = _tensors()
    moved = huge_pages.into_huge_pages(tensors)
    for before, after in zip(tensors, moved, strict=True):
        assert after.dtype == before.dtype and after.shape == before.shape
        assert torch.equal(after, before) and after.data_ptr() != before.data_ptr()
        assert after.data_ptr() % huge_pages.ALIGN == 0 and after.is_contiguous()
    assert len({t.untyped_storage().data_ptr() for t in moved}) == 1


def test_the_buffer_sits_on_huge_pages_where_the_os_gives_them():
    if not huge_pages.available() or not THP.exists() or "[never]" in THP.read_text():
        pytest.skip("transparent huge pages are off here")
    moved = huge_pages.into_huge_pages(_tensors())
    assert _anon_huge_kb(moved[0].data_ptr()) >= 2048


def test_nothing_to_move_is_nothing():
    assert huge_pages.into_huge_pages([]) == []
