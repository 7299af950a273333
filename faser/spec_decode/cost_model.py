"""What a step costs: the profiled forwards (faser.runner.profiler), corrected online.

- `CostModel` scales each curve by what the served steps' own phases measured, since a served
  step also samples, scores and attends over whole contexts, which the bare profile does not; a
  shape's first step is left out, as a kernel's first call at a size plans and allocates, and
  that one step priced draft tokens so dear that speculation stopped for good.
- A step over STALL times its phases' estimates is left out too (a page-fault storm, the host's
  other work): a few at a replica's start set the scales a hundredfold, and only speculative
  steps, which then never ran again, would have brought them back.
- A step's first draft forward has a scale of its own: it runs right after the target's forward
  has streamed through the caches, so it reads the draft's weights from memory, and the ones
  after it find them warm, as the profile did. One scale for all charged every further forward
  the first one's cold start, and so priced a second draft token at about twice what it costs.
  Until a step has drafted in a single forward, longer ones teach both scales as one.
"""

from __future__ import annotations

from collections.abc import Sequence

from faser.runner.profiler import CostProfile

# weight of the newest step in the corrections, which follow the mean step: goodput is tokens over
# mean time, and a lower envelope prices a two-phase speculative step further below its mean than
# the one-phase off step (its phases seldom both end quickly)
CORRECTION = 0.05
# a step this many times slower than the corrections predict stalled: it teaches them nothing
STALL = 4.0
# a warm draft forward's scale is taken as at least this: a sample below it means the first
# forward's scale ran high, not that further forwards are free
MIN_WARM_SCALE = 0.5


class CostModel:
    """The profile, each phase scaled by what served steps measured: drafting (a step's first
    draft forward by `first_draft_scale`, the others by `draft_scale`), the target's forward in a
    step that verifies no draft (`decode_scale`, which follows the host's speed) and in one that
    verifies some (`target_scale`: the decode scale times
    `verify_ratio`, what verification adds to a plain step's forward of as many rows). Learned
    apart, since a scale learned from drafting steps charged plain steps the verification's extra
    work and made drafting look cheap; tied, since a replica that has only decoded would
    otherwise price verification at the bare profile while its plain steps cost what they
    measured, far more at many requests over long contexts, and drafting looked cheap again;
    scales, not offsets, since the profile's own curve knows what one more row costs."""

    __slots__ = ("_warm", "decode_scale", "draft_scale", "first_draft_scale", "num_decodes",
                 "num_drafted", "num_first_drafts", "num_observed", "profile", "verify_ratio")

    def __init__(self, profile: CostProfile) -> None:
        self.profile = profile
        self.draft_scale = self.first_draft_scale = self.decode_scale = self.verify_ratio = 1.0
        self.num_observed = 0  # steps that verified drafts
        self.num_first_drafts = 0  # of them, steps that drafted in one forward
        self.num_drafted = 0  # and those that drafted in more
        self.num_decodes = 0  # steps that verified none
        self._warm: set[tuple[int, int]] = set()

    @property
    def target_scale(self) -> float:
        """Never below the plain step's: a verifying forward does all that a plain one over as
        many rows does, and more. A ratio learned from wide verifying steps, whose extra rows
        cost less than the profile says, would otherwise price a narrow verification below the
        plain step it contains."""
        return self.decode_scale * max(1.0, self.verify_ratio)

    def draft_time(self, batch_size: float, first: bool = False) -> float:
        """A draft forward over `batch_size` requests; `first`: the step's first."""
        scale = self.first_draft_scale if first else self.draft_scale
        return scale * self.profile.draft_time(batch_size)

    def verify_time(self, num_requests: int, num_drafts: float = 0,
                    num_prefill_tokens: int = 0) -> float:
        """The target's forward over each decoding request's row, its draft tokens and a
        prefill."""
        scale = self.target_scale if num_drafts > 0 else self.decode_scale
        return scale * self.profile.target_time(num_requests + num_drafts + num_prefill_tokens)

    def step_time(self, num_requests: int, ks: Sequence[int], num_prefill_tokens: int = 0) -> float:
        """Predicted seconds of a sequential step: draft forwards, then one verification."""
        draft = sum(self.draft_time(sum(k > j for k in ks), j == 0)
                    for j in range(max(ks, default=0)))
        return draft + self.verify_time(num_requests, sum(ks), num_prefill_tokens)

    def observe(self, num_requests: int, ks: Sequence[int], forward_rows: Sequence[int],
                draft_s: float, verify_s: float) -> None:
        """A decode-only sequential step that verified `ks`, its draft forwards having fed
        `forward_rows` tokens: `draft_s` from its first draft forward to its verification
        (drafting, trimming), `verify_s` from there to its end. Drafting is priced by the rows
        it fed, not by `ks`: a catch-up's missed tokens and the trimmed drafts cost too, and a
        scale that charged them to the kept tokens priced every later draft dear enough to stop
        speculation for good. A shape's first step and a stalled one are left out (the module
        docstring)."""
        rows = num_requests + sum(ks)
        shape = (rows, max(ks, default=0))
        if rows < 1 or shape not in self._warm:
            self._warm.add(shape)
            return
        ratio = verify_s / self.profile.target_time(rows)
        if not any(ks):
            if ratio < STALL * self.decode_scale:
                before = self.decode_scale
                self.num_decodes += 1
                self.decode_scale = _follow(self.decode_scale, ratio, self.num_decodes)
                if self.num_decodes == 1 and self.num_observed:
                    # the verifications so far were measured against the prior scale, so their
                    # ratio is their own price: kept, not carried up with the first real scale
                    self.verify_ratio *= before / self.decode_scale
            return
        bare = [self.profile.draft_time(r) for r in forward_rows]
        first, later = (bare[0], sum(bare[1:])) if bare else (0.0, 0.0)
        predicted = self.first_draft_scale * first + self.draft_scale * later
        if (predicted > 0 and draft_s >= STALL * predicted) or ratio >= STALL * self.target_scale:
            return
        self.num_observed += 1
        self.verify_ratio = _follow(self.verify_ratio, ratio / self.decode_scale,
                                    self.num_observed)
        if later > 0 and self.num_first_drafts:  # the first priced as learned, the rest after
            warm = max(draft_s - self.first_draft_scale * first, MIN_WARM_SCALE * later)
            self.num_drafted += 1
            self.draft_scale = _follow(self.draft_scale, warm / later, self.num_drafted)
        elif later > 0:  # no step has drafted in one forward yet to tell the first apart
            self.num_drafted += 1
            self.draft_scale = _follow(self.draft_scale, draft_s / (first + later),
                                       self.num_drafted)
            self.first_draft_scale = self.draft_scale
        elif first > 0:
            self.num_first_drafts += 1
            self.first_draft_scale = _follow(self.first_draft_scale, draft_s / first,
                                             self.num_first_drafts)


def _follow(estimate: float, sample: float, num_samples: int) -> float:
    """The correction moved toward `sample`: the mean of the first few, then an EMA."""
    return estimate + max(CORRECTION, 1.0 / num_samples) * (sample - estimate)
