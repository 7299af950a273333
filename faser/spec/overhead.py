"""What a real step costs beyond the cost profile: learned online, added to every prediction.

The profile times bare forwards at a short context. A served step also schedules, samples,
keeps per-request state and gathers each request's paged cache over its whole context: on this
CPU a decode step of 16 requests took about 85 ms where the profile said 61-66, one of 32 about
135 where it said 78. That time grows mostly with the requests in the step, so leaving it out
makes every draft token look dearer than it is, relative to the step it rides in (the goodput
model kept k = 0 at 16 requests, where k = 1 paid 9 %). Not all of it is independent of k: at
long contexts each verified token's attention costs more than the profile's, which this model
leaves out, so at high load it prices speculation too cheap. Each decode-only step's
measured time minus the profile's prediction for what it ran, per request, feeds an EMA;
policies add it, times their requests, to every step they predict. Steps with a prefill chunk
are left out: the profile's long forwards are priced on their own terms.
"""

from __future__ import annotations

OVERHEAD_EMA = 0.05  # weight of the newest step: steps are noisy, the overhead moves slowly


class StepOverhead:
    __slots__ = ("_ema", "num_steps")

    def __init__(self) -> None:
        self._ema = 0.0
        self.num_steps = 0

    def observe(self, predicted_s: float, measured_s: float, num_requests: int) -> None:
        if num_requests < 1:
            return
        residual = (measured_s - predicted_s) / num_requests
        if self.num_steps == 0:
            self._ema = residual
        else:
            self._ema += OVERHEAD_EMA * (residual - self._ema)
        self.num_steps += 1

    @property
    def per_request_s(self) -> float:
        """Never below 0: a profile that overprices steps is the safe side."""
        return max(0.0, self._ema)
