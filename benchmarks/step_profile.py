"""Where an engine step's time goes: the target's linear layers (GEMMs, the head included), its
attention (the cache writes included), its other layer ops, its layers run as one C call where
they are fused (faser_kernels.cpu_decoder: then the GEMMs counted are the head's alone), and
everything outside the target's forward (the draft, sampling, scheduling, Python). Measured by
timing those calls inside real steps, and set against the machine's read bandwidth (a sum over
1 GiB) for the weights' rate."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import nn

from faser import LLM, SamplingParams
from faser.layers.attention import PagedAttention
from faser.runner.weights import RowInvariantLinear
from faser_kernels.cpu_decoder import DecoderLayers

PARTS = ("gemm", "attention", "other layer ops", "fused layers", "outside the forward")


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s a `sum` streams from memory: the machine's practical read rate."""
    data = torch.ones(int(gib * 2**30 // 4))
    data.sum()
    best = min(_seconds(data.sum) for _ in range(repeats))
    return data.numel() * 4 / best


def weight_bytes(llm: LLM) -> int:
    """The bytes a one-token target forward reads: its linear weights (one embedding row)."""
    model = llm.engine.pair.target
    total = 0
    for module in model.modules():
        if isinstance(module, RowInvariantLinear):
            total += module.packed.data.numel() * module.packed.data.element_size()
        elif isinstance(module, nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
    return total


def profile_steps(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """Seconds per step in each of PARTS (and "step"), over one run of `prompts` at once."""
    spent: Counter[str] = Counter()
    engine = llm.engine
    timers = [
        (RowInvariantLinear, "forward", "gemm"),
        (nn.Linear, "forward", "gemm"),
        (PagedAttention, "forward", "attention"),
        (DecoderLayers, "run", "fused layers"),
    ]
    with _timing(timers, spent), _timing([(type(engine.target), "forward_hidden", "target")],
                                         spent):
        steps = _count_steps(llm, prompts, max_tokens, spent)
    target = spent.pop("target")
    parts = {
        "gemm": spent["gemm"],
        "attention": spent["attention"],
        "other layer ops": target - spent["gemm"] - spent["attention"] - spent["fused layers"],
        "fused layers": spent["fused layers"],
        "outside the forward": spent["step"] - target,
        "step": spent["step"],
    }
    return {name: seconds / steps for name, seconds in parts.items()}


def _count_steps(llm: LLM, prompts, max_tokens: int, spent: Counter) -> int:
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"profile-{i}", prompt, params)
    steps = 0
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        spent["step"] += time.perf_counter() - start
        steps += 1
    return steps


@contextmanager
def _timing(targets: list[tuple[type, str, str]], spent: Counter):
    """Each class's method timed into spent[part] (outermost calls only: a linear inside a
    timed linear is not counted twice)."""
    originals = [(cls, name, getattr(cls, name)) for cls, name, _ in targets]
    active: set[str] = set()

    def timed(fn: Callable, part: str) -> Callable:
        def wrapper(*args, **kwargs):
            if part in active:
                return fn(*args, **kwargs)
            active.add(part)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[part] += time.perf_counter() - start
                active.discard(part)

        return wrapper

    try:
        for (cls, name, part), (_, _, fn) in zip(targets, originals, strict=True):
            setattr(cls, name, timed(fn, part))
        yield
    finally:
        for cls, name, fn in originals:
            setattr(cls, name, fn)


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
