"""The step limits that SLO-aware speculation keeps to (the planner takes them as constraints).

- TPOT averages over the output, so a step need only be short enough for the tokens it commits:
  request i stays on track when the step's time tau <= D_i (1 + E_i(k_i)), D_i being what its
  remaining budget allows per token, so its own speculation relaxes its limit and everyone
  else's tightens it.
- A TTFT target caps the step in which the request's prefill ends, as none after it can help.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from faser.spec_decode.request import SpecRequest

# a request behind its TPOT target catches up within this many tokens (or its remaining ones);
# one ahead spends its slack over all its remaining tokens, as later load is unknown
CATCH_UP_TOKENS = 32


def tpot_deadline(
    tpot_s: float, now_s: float, first_token_s: float | None, num_output_tokens: int,
    max_tokens: int,
) -> float:
    """Seconds per committed token that this step may take and keep the request on its TPOT
    target by its last token: the budget left, (tokens so far + tokens left) * tpot - elapsed,
    spread over the tokens left (over CATCH_UP_TOKENS at most when behind). Negative when the
    request is so far behind that nothing this step can save it."""
    if first_token_s is None:
        return tpot_s
    done = max(0, num_output_tokens - 1)  # tokens since the first, the ones TPOT counts
    left = max(1, max_tokens - num_output_tokens)
    slack = done * tpot_s - (now_s - first_token_s)  # > 0: ahead of the target
    horizon = left if slack >= 0 else min(left, CATCH_UP_TOKENS)
    return tpot_s + slack / horizon


def tpot_deadlines(requests: Sequence[SpecRequest], now_s: float) -> list[float | None]:
    """`tpot_deadline` per decoding request; None for one with no TPOT target."""
    out: list[float | None] = []
    for seq in requests:
        tpot_s = seq.spec_state.slo.tpot_s if seq.spec_state.slo is not None else None
        out.append(None if tpot_s is None else tpot_deadline(
            tpot_s, now_s, seq.first_token_time, len(seq.output_token_ids), seq.params.max_tokens))
    return out


def ttft_step_limit(prefills: Sequence[tuple[SpecRequest, int]], now_s: float) -> float | None:
    """The longest this step may take so that every request whose prefill ends in it still gets
    its first token within its TTFT target; None when no such target is at stake (a target
    already missed is not one: nothing this step does can save it)."""
    limits = []
    for seq, num_tokens in prefills:
        slo = seq.spec_state.slo
        if slo is None or slo.ttft_s is None or seq.num_cached + num_tokens < seq.num_tokens:
            continue
        left = seq.arrival_time + slo.ttft_s - now_s
        if left > 0:
            limits.append(left)
    return min(limits) if limits else None
