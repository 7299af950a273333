"""Tensors moved into memory backed by transparent huge pages (2 MiB), where the OS gives them.

A decode step streams every packed weight once. With 4 KiB pages that stream takes a TLB miss
and restarts the hardware prefetcher every 4 KiB; with 2 MiB pages it does neither, and the same
weights stream markedly faster (the kernels' notes in kernels/README.md). Linux gives huge pages to
private anonymous memory advised with MADV_HUGEPAGE when transparent huge pages are "madvise" or
"always"; elsewhere (or "never") the tensors stay as they were, and nothing but speed changes:
the bytes, and so every result, are the same.
"""

from __future__ import annotations

import math
import mmap

import torch

ALIGN = 64  # each tensor's start in the buffer, as the kernels' vector loads like it


def available() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_PRIVATE")


def into_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` (CPU, contiguous) in one buffer advised for huge pages, each a view
    that keeps the buffer alive; the tensors themselves where huge pages are not available."""
    if not tensors:
        return tensors
    views = _views([(t.shape, t.dtype) for t in tensors])
    if views is None:
        return tensors
    for view, t in zip(views, tensors, strict=True):
        view.copy_(t)
    return views


def zeros(shape: tuple[int, ...], dtype: torch.dtype, count: int) -> list[torch.Tensor]:
    """`count` zero tensors of `shape` in one buffer advised for huge pages; torch.zeros where
    huge pages are not available. For the KV cache: attention reads a request's blocks from
    anywhere in it, and on 4 KiB pages each block costs a TLB miss. Written once here, as
    torch.zeros writes, so that the first requests' steps do not pay the page faults."""
    views = _views([(shape, dtype)] * count)
    if views is None:
        return [torch.zeros(shape, dtype=dtype) for _ in range(count)]
    for view in views:
        view.zero_()
    return views


def _views(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor] | None:
    """Tensors of these shapes and dtypes in one anonymous buffer advised for huge pages, each
    starting ALIGN-aligned; None where the OS does not take the advice."""
    if not available():
        return None
    sizes = [math.prod(shape) * torch.empty((), dtype=dtype).element_size()
             for shape, dtype in specs]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // ALIGN) * ALIGN
    buffer = mmap.mmap(-1, max(total, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buffer.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: faults then take 2 MiB
    except OSError:
        return None
    arena = torch.frombuffer(buffer, dtype=torch.uint8)
    return [arena[offset : offset + size].view(dtype).view(shape)
            for (shape, dtype), offset, size in zip(specs, offsets, sizes, strict=True)]
