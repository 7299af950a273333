"""The mode controller: which regime the engine speculates in, from the load and the cost profile.

- `overlap` while the target forward stays memory-bound even with full speculation (below the
  profile's knee) and the fleet is not loaded: drafting hides behind verification.
- `prune` once it is compute-bound: short speculation, frontiers with early pruning.
- `off` when speculation cannot pay (the best k predicts no more goodput than k = 0) or the load
  is far past saturation.

Load enters as two signals, each 1 at its threshold: the prune signal, the target tokens a step
would have with full speculation over the knee, and the off signal, the requests decoding over
the number at which the goodput model stops finding any k that pays at the prior acceptance
(`off_batch`; past it a draft token costs about as much as a real one). The knee alone is no
guide to that on a CPU, whose step time can jump at a few tokens and then stay flat for a while:
there k = 1 can still pay at batches that the knee puts far past it.
A waiting queue raises both (admissions are held back by our batch), a nearly full KV cache
raises the first, and the router's cluster-wide load is a floor under each.
Hysteresis keeps the mode from flapping: a signal crosses its threshold upwards at 1 + margin and
downwards at 1 - margin, and a new mode must be wanted for `patience` consecutive steps.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, replace
from typing import NamedTuple

from faser.spec.cost_model import CostProfile
from faser.spec.goodput import KChoice, StepCost, choose_k
from faser.spec.overhead import NO_OVERHEAD, Overhead
from faser.spec.plan import LoadView

LEVELS = ("overlap", "prune", "off")  # ordered by rising load
OFF_BATCH_REFRESH = 0.25  # relative move of the overhead that has off_batch found again,
OFF_BATCH_MIN_MOVE_S = 0.00025  # and at least this much (per request),
OFF_BATCH_EVERY = 100  # at most once per this many steps


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    patience: int = 3  # consecutive steps a new mode must be wanted before it is taken
    margin: float = 0.15  # relative band around each threshold
    prune_pressure: float = 1.0  # full-speculation target tokens over the knee
    off_pressure: float = 1.0  # no-speculation target tokens over off_batch
    cluster_prune: float = 1.0  # fleet load (the router's signal) that keeps speculation short
    cluster_off: float = 2.0  # fleet load that switches it off
    kv_high: float = 0.9  # above this KV use, speculation's slots compete with admissions
    # relative goodput gain the model must predict to leave `off` for lack of pay, and to keep
    # speculating: its predictions are a few per cent off, so a gain inside that is no gain
    pay_margin: float = 0.05
    keep_margin: float = 0.01
    history_size: int = 64

    def __post_init__(self) -> None:
        if self.patience < 1:
            raise ValueError(f"patience must be >= 1, got {self.patience}")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"margin must lie in [0, 1), got {self.margin}")
        for name in ("prune_pressure", "off_pressure", "cluster_prune", "cluster_off"):
            if not getattr(self, name) > 0.0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


class Pressure(NamedTuple):
    prune: float  # >= 1: compute-bound with full speculation
    off: float  # >= 1: compute-bound without any


@dataclass(frozen=True, slots=True)
class ModeSwitch:
    step: int
    old: str
    new: str
    pressure: Pressure


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
        self.overhead = NO_OVERHEAD  # a real step's time beyond its forwards
        self.knee = cost.knee()
        self.off_batch = self._off_batch(alpha_prior)
        self._off_batch_overhead_s = 0.0  # the overhead off_batch was found with
        self._off_batch_step = -OFF_BATCH_EVERY  # and the step it was found at (none yet)
        self.mode = "overlap" if allow_overlap else "prune"
        self.cluster_load = 0.0
        self.last_pressure = Pressure(0.0, 0.0)
        self.num_steps = 0
        self.history: deque[ModeSwitch] = deque(maxlen=self.config.history_size)
        self.steps_in_mode: Counter[str] = Counter()
        self._pending: str | None = None
        self._pending_steps = 0

    def set_cluster_load(self, load: float) -> None:
        """The router's fleet-wide signal, 0 (idle) .. 1+ (overloaded)."""
        self.cluster_load = max(0.0, float(load))

    def set_overhead(self, overhead: Overhead) -> None:
        """The learned step overhead (faser.spec.overhead). It moves the batch past which
        speculation stops paying, so off_batch is found again, but only once the overhead has
        moved by a quarter and not within 100 steps of the last time: finding it runs the goodput
        search at every batch size (a noticeable share of a short run when it followed the
        overhead's early noise), and the pay check decides meanwhile."""
        self.overhead = overhead
        seconds = overhead.seconds(1, 1)  # a request verifying one draft token
        found_with = self._off_batch_overhead_s
        moved = abs(seconds - found_with) > max(OFF_BATCH_REFRESH * found_with,
                                                OFF_BATCH_MIN_MOVE_S)
        if moved and self.num_steps >= self._off_batch_step + OFF_BATCH_EVERY:
            self.off_batch = self._off_batch(self.alpha_prior)
            self._off_batch_overhead_s, self._off_batch_step = seconds, self.num_steps

    def pressure(self, load: LoadView) -> Pressure:
        config = self.config
        speculative = load.num_running * (1 + self.max_k) + load.num_prefill_tokens
        plain = load.num_running + load.num_prefill_tokens
        queue = 1.0
        if load.num_waiting > 0:  # a queue means the batch is full: admissions wait on us
            queue += min(1.0, load.num_waiting / max(1, load.num_running))
        cluster = load.cluster_load if load.cluster_load is not None else self.cluster_load
        prune = queue * speculative / (self.knee * config.prune_pressure)
        if load.kv_usage >= config.kv_high:
            prune = max(prune, 1.0 + config.margin)
        off = queue * plain / (self.off_batch * config.off_pressure)
        return Pressure(
            max(prune, cluster / config.cluster_prune), max(off, cluster / config.cluster_off)
        )

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

    def _wanted(self, pressure: Pressure, load: LoadView, alpha: float) -> str:
        current = LEVELS.index(self.mode)
        level = 0
        for signal_level, signal in ((1, pressure.prune), (2, pressure.off)):
            band = -self.config.margin if current >= signal_level else self.config.margin
            if signal >= 1.0 + band:
                level = signal_level
        if not self.allow_overlap:
            level = max(level, 1)
        if level < 2:
            level = self._paying_level(level, load, alpha)
        return LEVELS[level]

    def _paying_level(self, level: int, load: LoadView, alpha: float) -> int:
        """`level` (0 overlap, 1 prune) as far as the goodput model says it pays: overlap only
        where the best overlapped step beats the best sequential one (the lanes' smaller shares
        of the device can cost more than drafting hides), 2 (off) where no speculation pays."""
        if self.max_k == 0:
            return 2
        idle = load.num_running == 0
        if idle:  # nothing to pay for yet: judge overlap for one request
            load = replace(load, num_running=1)
        gain = 0.0 if idle else (
            self.config.pay_margin if self.mode == "off" else self.config.keep_margin)
        sequential = self._best(load, alpha, min_gain=gain)
        if level == 0:
            overlapped = self._best(load, alpha, overlap=True, min_gain=gain)
            if overlapped.speculates and overlapped.goodput > sequential.goodput:
                return 0
        return 1 if idle or sequential.speculates else 2

    def _best(
        self, load: LoadView, alpha: float, *, overlap: bool = False, min_gain: float = 0.0
    ) -> KChoice:
        acceptance = [[alpha] * self.max_k] * load.num_running
        step_cost = StepCost(self.cost, load.num_running, load.num_prefill_tokens, overlap=overlap,
                             overhead=self.overhead)
        return choose_k(acceptance, step_cost, token_budget=load.token_budget, min_gain=min_gain)

    def _off_batch(self, alpha: float) -> float:
        """The fewest decoding requests past which no k pays any more at acceptance `alpha`
        (sequential steps, no prefill). Not the first batch where none pays: a CPU's stepped curve
        can make k = 1 lose at a small batch and win again at a larger one."""
        if self.max_k == 0:
            return 1.0
        # up to the largest batch the draft was profiled at (the engine's max_num_seqs, at most
        # 64): past it the scan only grows longer and says nothing the pay check would not
        largest = self.cost.draft_points[-1] if self.cost.draft_points else 64
        batch, off = 1, 1
        while batch <= largest:
            full = LoadView(batch, 0, 0, batch * (1 + self.max_k), 0.0)
            nxt = max(batch + 1, round(batch * 1.1))
            if self._best(full, alpha).speculates:
                off = nxt
            batch = nxt
        if off > largest:  # pays throughout: off only past the profile
            return float(self.cost.target_points[-1])
        return float(off)

    def _switch(self, mode: str, pressure: Pressure) -> None:
        if mode != self.mode or self.num_steps == 0:
            self.history.append(ModeSwitch(self.num_steps, self.mode, mode, pressure))
        self.mode = mode
        self._pending, self._pending_steps = None, 0
