"""The mode controller: which regime the engine speculates in, from the load and the cost profile.

- `overlap` while the target forward stays memory-bound even with full speculation (below the
  profile's knee) and the fleet is not loaded: drafting hides behind verification.
- `prune` once it is compute-bound: short speculation, frontiers with early pruning.
- `off` when speculation cannot pay (the best k predicts no more goodput than k = 0) or the load
  is far past saturation.

Load is one number, the pressure: the target tokens a step would have with full speculation over
the knee (1 = at the knee), raised by a waiting queue and a nearly full KV cache, and at least the
router's cluster-wide load. Hysteresis keeps it from flapping: a threshold is crossed upwards at
(1 + margin) times its value and downwards at (1 - margin) times, and a new mode must be wanted
for `patience` consecutive steps before it is taken.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

from faser.spec.cost_model import CostProfile
from faser.spec.goodput import StepCost, choose_k
from faser.spec.plan import LoadView

LEVELS = ("overlap", "prune", "off")  # ordered by rising load


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    patience: int = 3  # consecutive steps a new mode must be wanted before it is taken
    margin: float = 0.15  # relative band around each threshold
    prune_pressure: float = 1.0  # at the knee
    off_pressure: float = 2.0  # far past saturation, speculation only steals compute
    kv_high: float = 0.9  # above this KV use, speculation's slots compete with admissions
    pay_margin: float = 0.02  # relative goodput gain needed to leave `off` for lack of pay
    history_size: int = 64

    def __post_init__(self) -> None:
        if self.patience < 1:
            raise ValueError(f"patience must be >= 1, got {self.patience}")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"margin must lie in [0, 1), got {self.margin}")
        if not 0.0 < self.prune_pressure < self.off_pressure:
            raise ValueError("need 0 < prune_pressure < off_pressure")


@dataclass(frozen=True, slots=True)
class ModeSwitch:
    step: int
    old: str
    new: str
    pressure: float


class ModeController:
    def __init__(
        self,
        cost: CostProfile,
        max_k: int,
        alpha_prior: float = 0.5,
        config: ControllerConfig | None = None,
        *,
        allow_overlap: bool = True,
    ) -> None:
        self.cost = cost
        self.max_k = max_k
        self.alpha_prior = alpha_prior
        self.config = config or ControllerConfig()
        self.allow_overlap = allow_overlap
        self.knee = cost.knee()
        self.mode = "overlap" if allow_overlap else "prune"
        self.cluster_load = 0.0
        self.last_pressure = 0.0
        self.num_steps = 0
        self.history: deque[ModeSwitch] = deque(maxlen=self.config.history_size)
        self.steps_in_mode: Counter[str] = Counter()
        self._pending: str | None = None
        self._pending_steps = 0

    def set_cluster_load(self, load: float) -> None:
        """The router's fleet-wide signal, 0 (idle) .. 1+ (overloaded)."""
        self.cluster_load = max(0.0, float(load))

    def pressure(self, load: LoadView) -> float:
        tokens = load.num_running * (1 + self.max_k) + load.num_prefill_tokens
        local = tokens / self.knee if self.knee > 0 else float("inf")
        if load.num_waiting > 0:  # a queue means the batch is full: admissions are waiting on us
            local *= 1.0 + min(1.0, load.num_waiting / max(1, load.num_running))
        if load.kv_usage >= self.config.kv_high:
            local = max(local, self.config.prune_pressure * (1.0 + self.config.margin))
        cluster = load.cluster_load if load.cluster_load is not None else self.cluster_load
        return max(local, cluster)

    def update(self, load: LoadView, alpha: float | None = None) -> str:
        """The mode for this step; call once per step. `alpha` is the batch's mean acceptance
        (the prior when None), used to ask whether speculation can pay at all."""
        pressure = self.pressure(load)
        wanted = self._wanted(pressure, load, self.alpha_prior if alpha is None else alpha)
        self.last_pressure = pressure
        if self.num_steps == 0:
            self._switch(wanted, pressure)
        elif wanted == self.mode:
            self._pending, self._pending_steps = None, 0
        else:
            self._pending_steps = self._pending_steps + 1 if wanted == self._pending else 1
            self._pending = wanted
            if self._pending_steps >= self.config.patience:
                self._switch(wanted, pressure)
        self.num_steps += 1
        self.steps_in_mode[self.mode] += 1
        return self.mode

    def _wanted(self, pressure: float, load: LoadView, alpha: float) -> str:
        current = LEVELS.index(self.mode)
        level = 0
        for thr_level, thr in ((1, self.config.prune_pressure), (2, self.config.off_pressure)):
            band = -self.config.margin if current >= thr_level else self.config.margin
            if pressure >= thr * (1.0 + band):
                level = thr_level
        if not self.allow_overlap:
            level = max(level, 1)
        if level < 2 and not self._pays(load, alpha, overlap=level == 0):
            level = 2
        return LEVELS[level]

    def _pays(self, load: LoadView, alpha: float, *, overlap: bool) -> bool:
        """Would the goodput model speculate for a batch of this size at this acceptance?"""
        if load.num_running == 0 or self.max_k == 0:
            return self.max_k > 0
        acceptance = [[alpha] * self.max_k] * load.num_running
        step_cost = StepCost(self.cost, load.num_running, load.num_prefill_tokens, overlap=overlap)
        gain = self.config.pay_margin if self.mode == "off" else 0.0
        choice = choose_k(acceptance, step_cost, token_budget=load.token_budget, min_gain=gain)
        return choice.speculates

    def _switch(self, mode: str, pressure: float) -> None:
        if mode != self.mode or self.num_steps == 0:
            self.history.append(ModeSwitch(self.num_steps, self.mode, mode, pressure))
        self.mode = mode
        self._pending, self._pending_steps = None, 0
