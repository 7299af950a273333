"""The mode controller: the regime the faser policies speculate in, read off each step's plan.

- off: the plan gave nobody a draft token at a batch with no prefill; until the batch shrinks or
  OFF_REPLAN_STEPS steps pass (the estimates age toward the prior), steps skip planning.
- overlap: speculation pays, the engine has lanes, the rows to verify stay below the target's
  knee and the router does not report the fleet busy: drafting then hides behind verification.
- prune: speculation pays otherwise. While the router reports the fleet busy, k is capped at half
  its maximum: at high load each token must pay in real compute.
"""

from __future__ import annotations

import math
from collections import Counter

OFF_REPLAN_STEPS = 16  # planning 32 requests costs well under 1 % of a step spread over 16
CLUSTER_BUSY = 1.0  # the router's load signal: 0 idle, 1 and more overloaded


class ModeController:
    def __init__(self, can_overlap: bool) -> None:
        self.can_overlap = can_overlap
        self.mode = "prune"
        self.steps_in_mode: Counter[str] = Counter()
        self._off_batch = 0  # the batch at which the plan stopped speculating (0: none)
        self._off_steps = 0

    def stays_off(self, num_running: int) -> bool:
        """Whether this step skips planning (counted as a step in `off`)."""
        if self.mode != "off" or not 0 < self._off_batch <= num_running:
            return False
        if self._off_steps >= OFF_REPLAN_STEPS:  # the estimates have aged: plan again
            return False
        self._off_steps += 1
        self.steps_in_mode["off"] += 1
        return True

    @staticmethod
    def cap(max_k: int, cluster_load: float) -> int:
        return math.ceil(max_k / 2) if cluster_load >= CLUSTER_BUSY else max_k

    def update(self, ks: tuple[int, ...], num_prefill_tokens: int, knee: float,
               cluster_load: float = 0.0) -> str:
        """The mode of a step whose plan is `ks`, `cluster_load` being the router's signal."""
        if not any(ks):
            self.mode = "off"
            self._off_batch = len(ks) if num_prefill_tokens == 0 else 0
            self._off_steps = 0
        else:
            rows = sum(k + 1 for k in ks) + num_prefill_tokens
            calm = cluster_load < CLUSTER_BUSY
            self.mode = "overlap" if self.can_overlap and calm and rows <= knee else "prune"
        self.steps_in_mode[self.mode] += 1
        return self.mode
