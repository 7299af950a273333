"""Tensors moved into memory backed by transparent huge pages (2 MiB), where the OS gives them.

A decode step streams every packed weight once. With 4 KiB pages that stream takes a TLB miss
and restarts the hardware prefetcher every 4 KiB; with 2 MiB pages it does neither, and the same
weights stream markedly faster (the kernels' notes in kernels/README.md). Linux gives huge pages to
private anonymous memory advised with MADV_HUGEPAGE when transparent huge pages are "madvise" or
"always"; elsewhere (or "never") the tensors stay as they were, and nothing but speed changes:
the bytes, and so every result, are the same.
"""

from __future__ import annotations

import mmap

import torch

ALIGN = 64  # each tensor's start in the buffer, as the kernels' vector loads like it


def available() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_PRIVATE")


def into_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` (CPU, contiguous) in one buffer advised for huge pages, each a view
    that keeps the buffer alive; the tensors themselves where huge pages are not available."""
    if not tensors or not available():
        return tensors
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // ALIGN) * ALIGN
    buffer = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buffer.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: faults then take 2 MiB
    except OSError:
        return tensors
    arena = torch.frombuffer(buffer, dtype=torch.uint8)
    out = []
    for t, offset, size in zip(tensors, offsets, sizes, strict=True):
        view = arena[offset : offset + size].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
    return out
