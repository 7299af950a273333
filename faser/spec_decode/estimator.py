"""How likely a draft token is to be accepted: one estimator, shared by every policy.

- Before drafting, each of request i's tokens is accepted with its rate alpha_i: its own verified
  trials, decayed so that the text it writes now counts most, plus the population's rate as a
  prior worth PRIOR_TRIALS trials.
- Both age with every engine step back toward their prior: an estimate that fell below what pays
  is not measured again until its owner drafts, so a run of rejections would otherwise switch
  drafting off for good.
- After drafting, a greedy request's token t blends alpha_i with the draft's calibrated confidence
  in it (how often tokens drafted with that confidence were accepted), as a small draft's raw
  probability is no acceptance rate. A sampled request's tokens keep alpha_i: their confidences,
  the chances of tokens drawn at its temperature, are not on the calibration's scale.
- A prompt-lookup guess (faser.spec_decode.lookup) is rated by how often verified guesses from an
  n-gram of its length were accepted, from a prior, in place of the draft's calibration.
- A verification is a run of trials that stops at the first rejection, so it counts the accepted
  positions and the rejected one: accepted / drafted would read 0.59 for a rate of 0.8 at k = 4.
- Drafts trimmed before verification count as the verification would likely have gone, by their
  calibrated confidence: trimming drops the least confident, so the verified ones alone would
  rate a request's next drafts above what drafting them yields, and it would keep drafting what
  is trimmed again.
"""

from __future__ import annotations

from collections.abc import Sequence

from faser.spec_decode.lookup import MAX_N, PRIOR_PRECISION
from faser.spec_decode.state import SpecState

NUM_BINS = 10  # confidence bins of the calibration
BIN_PRIOR_TRIALS = 4.0  # pseudo-trials at q itself, so that an unseen bin answers q
PRIOR_TRIALS = 8.0  # the population's rate, in a request's estimate, counts as this many trials
DECAY = 0.95  # per engine step, of a request's earlier trials
POPULATION_DECAY = 0.98  # per engine step, of the population's trials
CONFIDENCE_WEIGHT = 0.5  # of the calibrated confidence against alpha_i, after drafting


class AcceptanceEstimator:
    def __init__(self, prior: float) -> None:
        if not 0.0 < prior < 1.0:
            raise ValueError(f"alpha_prior must lie in (0, 1), got {prior}")
        self._configured = prior
        self._population = [0.0, 0.0]  # every request's accepted, trials
        self._bins_accepted = [0.0] * NUM_BINS
        self._bins_trials = [0.0] * NUM_BINS
        self._lookup_accepted = [0.0] * (MAX_N + 1)  # by n-gram length
        self._lookup_trials = [0.0] * (MAX_N + 1)
        self.num_steps = 0

    def tick(self) -> None:
        """One engine step passed: every request's evidence ages by DECAY (read lazily), the
        population's by POPULATION_DECAY."""
        self.num_steps += 1
        self._population = [POPULATION_DECAY * n for n in self._population]

    @property
    def prior(self) -> float:
        """The population's rate: a new request's estimate."""
        accepted, trials = self._population
        return (accepted + PRIOR_TRIALS * self._configured) / (trials + PRIOR_TRIALS)

    def alpha(self, state: SpecState) -> float:
        aged = DECAY ** (self.num_steps - state.observed_at)
        prior = PRIOR_TRIALS * self.prior
        return (aged * state.accepted + prior) / (aged * state.trials + PRIOR_TRIALS)

    def before_draft(self, state: SpecState, k: int) -> list[float]:
        """Acceptance chances of request `state`'s next k draft tokens."""
        return [self.alpha(state)] * k

    def after_draft(self, state: SpecState, confidences: Sequence[float]) -> list[float]:
        """Acceptance chances of its drafted tokens, from the draft's confidence in each."""
        w, alpha = CONFIDENCE_WEIGHT, self.alpha(state)
        if not state.greedy:
            return [alpha] * len(confidences)
        return [w * self.calibrated(q) + (1.0 - w) * alpha for q in confidences]

    def calibrated(self, q: float) -> float:
        """How often tokens drafted with confidence q were accepted."""
        b = _bin(q)
        accepted, trials = self._bins_accepted[b], self._bins_trials[b]
        return (accepted + BIN_PRIOR_TRIALS * q) / (trials + BIN_PRIOR_TRIALS)

    def lookup_precision(self, n: int) -> float:
        """How often prompt-lookup guesses from an n-gram of n tokens were accepted."""
        accepted, trials = self._lookup_accepted[n], self._lookup_trials[n]
        return (accepted + BIN_PRIOR_TRIALS * PRIOR_PRECISION) / (trials + BIN_PRIOR_TRIALS)

    def observe(self, state: SpecState, confidences: Sequence[float], num_accepted: int,
                looked_up: Sequence[int] = (), trimmed: Sequence[float] = ()) -> None:
        """One request's verified draft tokens (their confidences), how many were accepted, and
        the confidences of the drafts trimmed after them. `looked_up[t]`: the n-gram length of
        a prompt-lookup guess at t, 0 for the draft's own token. Looked-up tokens count for the
        request's rate and their length's precision, not the draft's calibration: their
        confidence is the lookup's, not the draft's. A sampled request's confidences are not on
        the calibration's scale: they neither calibrate nor stand for its trimmed drafts, which
        its own rate, not their confidence, trimmed."""
        k = len(confidences)
        trimmed = trimmed if state.greedy else ()
        if k == 0 and not trimmed:
            return
        verified = num_accepted + int(num_accepted < k)  # trials up to the first rejection
        accepted, trials = float(num_accepted), float(verified)
        if num_accepted == k and trimmed:  # the line was still alive where trimming cut it
            tail_accepted, tail_trials = _expected_run([self.calibrated(q) for q in trimmed])
            accepted, trials = accepted + tail_accepted, trials + tail_trials
        aged = DECAY ** (self.num_steps - state.observed_at)
        state.accepted = aged * state.accepted + accepted
        state.trials = aged * state.trials + trials
        state.observed_at = self.num_steps
        self._population = [self._population[0] + accepted, self._population[1] + trials]
        state.alpha = self.alpha(state)
        if not state.greedy:
            return
        for t, q in enumerate(confidences[:verified]):
            n = looked_up[t] if t < len(looked_up) else 0
            hit = float(t < num_accepted)
            if n:
                self._lookup_trials[n] += 1.0
                self._lookup_accepted[n] += hit
            else:
                b = _bin(q)
                self._bins_trials[b] += 1.0
                self._bins_accepted[b] += hit


def _expected_run(chances: Sequence[float]) -> tuple[float, float]:
    """Expected accepted tokens and trials of verifying tokens accepted with `chances`, in order,
    until the first rejection."""
    alive, accepted, trials = 1.0, 0.0, 0.0
    for c in chances:
        trials += alive
        alive *= c
        accepted += alive
    return accepted, trials


def _bin(q: float) -> int:
    return min(NUM_BINS - 1, max(0, int(q * NUM_BINS)))
