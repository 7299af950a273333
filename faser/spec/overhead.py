"""What a real step costs beyond the cost profile: learned online, added to every prediction.

The profile times bare forwards at a short context. A served step also schedules, samples,
gathers the paged cache over long contexts and mixes in prefill chunks: on this CPU a step of 16
decoding requests took about 85 ms where the profile said 61. That time barely changes with k,
so leaving it out makes every draft token look dearer than it is, relative to the step it rides
in (the goodput model then kept k = 0 at 16 requests, where k = 1 paid 9 %). Each step's
measured time minus the profile's prediction for what it ran feeds an EMA; policies add it to
their step costs.
"""

from __future__ import annotations

OVERHEAD_EMA = 0.05  # weight of the newest step: steps are noisy, the overhead moves slowly


class StepOverhead:
    __slots__ = ("_ema", "num_steps")

    def __init__(self) -> None:
        self._ema = 0.0
        self.num_steps = 0

    def observe(self, predicted_s: float, measured_s: float) -> None:
        residual = measured_s - predicted_s
        if self.num_steps == 0:
            self._ema = residual
        else:
            self._ema += OVERHEAD_EMA * (residual - self._ema)
        self.num_steps += 1

    @property
    def seconds(self) -> float:
        """Never below 0: a profile that overprices steps is the safe side."""
        return max(0.0, self._ema)
