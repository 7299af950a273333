"""A seeded request's sampling: the token at each position is the winner of a race keyed by the
request's seed and that position.

Every vocabulary entry v gets a uniform u_v from a generator seeded by (seed, position), and the
token is argmax_v log(u_v) / p_v: the first to arrive of exponential clocks E_v / p_v, which is
v with probability p_v (the exponential race, Gumbel-max's twin). The noise depends on the seed
and the position alone, so plain decoding draws the same token at a position whatever came
before it in the engine: the same answer to the same seeded request under any batch, policy or
restart. A draft proposes its own race winner over q with the same noise, and the target accepts
it iff it equals the target's winner (Gumbel coupling: drafter-invariant speculative decoding,
Daliri, Musco and Suresh, 2024), so speculation never changes a seeded answer. The price is
acceptance: a shared race agrees less often than rejection sampling's min(1, p / q), which
unseeded requests keep."""

from __future__ import annotations

import functools

import torch

MASK64 = (1 << 64) - 1
# a step needs a request's noise for its k + 1 positions twice (drafting, then verifying)
NUM_CACHED = 64


def race_scores(
    probs: torch.Tensor,  # [num_rows, vocab]: each row's distribution
    seed: int,
    first_position: int,  # of row 0; row r scores the token at first_position + r
) -> torch.Tensor:  # [num_rows, vocab]
    """Scores whose argmax is each row's token: log(u) / p, -inf where p is 0."""
    vocab = probs.shape[-1]
    noise = [log_uniforms(seed, first_position + r, vocab) for r in range(probs.shape[0])]
    return torch.stack(noise).to(probs.device) / probs


@functools.lru_cache(maxsize=NUM_CACHED)
def log_uniforms(seed: int, position: int, vocab: int) -> torch.Tensor:  # [vocab], read only
    """log(u_v), u_v uniform in [0, 1), for the token at `position` of a request seeded `seed`."""
    generator = torch.Generator().manual_seed(_mix(seed, position))
    return torch.rand(vocab, generator=generator).log_()


def _mix(seed: int, position: int) -> int:
    """One 64-bit generator seed per (seed, position), by SplitMix64's finaliser: nearby seeds
    and positions give unrelated streams."""
    x = ((seed & MASK64) * 0x9E3779B97F4A7C15 + position) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)
