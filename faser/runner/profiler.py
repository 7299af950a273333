"""Timings of real forwards, for the cost model: the target over n tokens of a flat batch and the
draft over a batch of b requests, each a decode at a modest context."""

from __future__ import annotations

import time
from collections.abc import Callable

from faser.runner.batch import Chunk
from faser.runner.model_runner import ModelRunner

PROFILE_CONTEXT = 64  # cached tokens each profiled request attends to


def decode_timer(runner: ModelRunner, block_table: list[int]) -> Callable[[int], float]:
    """seconds of one forward of n one-token requests; they share `block_table`, whose blocks
    must belong to no live request (their contents are overwritten)."""
    # within the rotary tables too: a model may be served with max_model_len < PROFILE_CONTEXT
    limit = getattr(getattr(runner.model, "rotary", None), "max_position", PROFILE_CONTEXT)
    position = min(PROFILE_CONTEXT, len(block_table) * runner.block_size, limit) - 1

    def measure(n: int) -> float:
        chunks = [Chunk([0], position, block_table, num_logits=1)] * n
        runner.synchronize()
        start = time.perf_counter()
        runner.forward(chunks)
        runner.synchronize()  # CUDA returns before the work is done
        return time.perf_counter() - start

    return measure
