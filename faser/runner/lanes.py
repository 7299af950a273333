"""Lanes: shares of the hardware that run one phase of a step each, at the same time.

A lane is one worker thread that runs the functions submitted to it in order. On a CPU it has its
own intra-op thread count (torch's is per thread: a lane set to 1 leaves the other cores to the
other lane, and the main thread keeps its own); on CUDA it has its own stream, so that the
draft's kernels and the target's can run at once. torch releases the GIL inside its ops, so two
lanes really run in parallel."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple, TypeVar

import torch

T = TypeVar("T")


class Lane:
    def __init__(self, name: str, num_threads: int | None = None, device: str = "cpu") -> None:
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"lane_threads: a lane needs >= 1 thread, got {num_threads}")
        self.name, self.num_threads, self.device = name, num_threads, device
        self._stream = torch.cuda.Stream(device) if device.startswith("cuda") else None
        self._pool = ThreadPoolExecutor(
            1, thread_name_prefix=f"faser-lane-{name}", initializer=self._init_thread
        )

    def _init_thread(self) -> None:
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        # FTZ/DAZ are per-thread CPU flags: the engine sets them on its own thread only
        torch.set_flush_denormal(True)

    def submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        if self._stream is not None:
            # work queued on the caller's stream (a sequential step's KV writes) comes first
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        return self._pool.submit(self._run, fn, args)

    def _run(self, fn: Callable[..., T], args: tuple) -> T:
        if self._stream is None:
            return fn(*args)
        with torch.cuda.stream(self._stream):
            out = fn(*args)
        # the other lane and the host read what this lane wrote: finish before handing it over
        self._stream.synchronize()
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class Lanes(NamedTuple):
    target: Lane
    draft: Lane

    def close(self) -> None:
        self.target.close()
        self.draft.close()


def make_lanes(device: str, lane_threads: tuple[int, int] | None = None) -> Lanes | None:
    """Two lanes, or None when the hardware has no second share to give.

    CUDA: two streams. CPU: `lane_threads` = (target threads, draft threads); None splits the
    intra-op threads torch has now, the larger half to the target (it runs the larger model),
    and gives no lanes with fewer than two threads (both phases would share one core)."""
    if lane_threads is not None and (len(lane_threads) != 2 or min(lane_threads) < 1):
        raise ValueError(f"lane_threads must be two counts >= 1, got {lane_threads!r}")
    if device.startswith("cuda"):
        return Lanes(Lane("target", device=device), Lane("draft", device=device))
    if lane_threads is None:
        total = torch.get_num_threads()
        if total < 2:
            return None
        lane_threads = (total - total // 2, total // 2)
    return Lanes(Lane("target", lane_threads[0]), Lane("draft", lane_threads[1]))
