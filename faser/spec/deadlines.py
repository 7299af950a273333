"""TPOT deadlines inside the goodput search: the longest step that keeps every request with a
TPOT target on track, as draft tokens are added (see faser/spec/slo.py for the deadlines)."""

from __future__ import annotations

import copy
import heapq
import math
from collections.abc import Sequence


class Allowances:
    """min_i D_i (1 + E_i(k_i)) over the requests with a TPOT deadline, as the goodput search adds
    draft tokens: the longest step that keeps every one of them on track.

    Adding a token raises only its own request's allowance, so the minimum moves only when that
    request holds it: a heap with stale entries dropped lazily answers in O(log n)."""

    def __init__(self, deadlines: Sequence[float | None]) -> None:
        self.deadline = list(deadlines)
        self.allowance = [math.inf if d is None else d for d in deadlines]
        self.heap = [(a, i) for i, a in enumerate(self.allowance) if a < math.inf]
        heapq.heapify(self.heap)

    def copy(self) -> Allowances:
        twin = copy.copy(self)
        twin.allowance, twin.heap = list(self.allowance), list(self.heap)
        return twin

    def margin(self, step_time_s: float) -> float:
        """How many times over the tightest allowance covers the step (>= 1: all on track). A
        ratio, so that shortfalls compare as rates: a step twice as long that commits three
        times the tokens is better for a TPOT target, not worse."""
        return _ratio(self._min(), step_time_s)

    def margin_if(self, i: int, gain: float, step_time_s: float) -> float:
        """The margin if request i commits `gain` more expected tokens in a step this long."""
        d = self.deadline[i]
        current = self._min()
        if d is None or not self.heap or self.heap[0][1] != i:
            return _ratio(current, step_time_s)
        top = heapq.heappop(self.heap)
        second = self._min()
        heapq.heappush(self.heap, top)
        return _ratio(min(self.allowance[i] + d * gain, second), step_time_s)

    def own_margin(self, i: int, gain: float, step_time_s: float) -> float:
        """Request i's own margin with `gain` more expected tokens."""
        d = self.deadline[i]
        return math.inf if d is None else _ratio(self.allowance[i] + d * gain, step_time_s)

    def tightest(self) -> int | None:
        self._min()
        return self.heap[0][1] if self.heap else None

    def add(self, i: int, gain: float) -> None:
        d = self.deadline[i]
        if d is not None and gain > 0:
            self.allowance[i] += d * gain
            heapq.heappush(self.heap, (self.allowance[i], i))

    def _min(self) -> float:
        heap = self.heap
        while heap and heap[0][0] != self.allowance[heap[0][1]]:
            heapq.heappop(heap)  # stale: its request has gained since
        return heap[0][0] if heap else math.inf


def _ratio(allowance_s: float, step_time_s: float) -> float:
    return allowance_s / step_time_s if step_time_s > 0 else math.inf
