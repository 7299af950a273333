"""Synthetic cost profiles: the shapes a real profile takes, with knees known by construction."""

from __future__ import annotations

from faser.runner.profiler import DRAFT_POINTS, TARGET_POINTS, CostProfile


def roofline(
    flat_s: float = 0.010, knee: float = 64, draft_s: float = 0.001, draft_knee: float = 32
) -> CostProfile:
    """Memory-bound (flat) up to `knee` tokens, then compute-bound (linear): a GPU's shape."""
    return CostProfile(
        TARGET_POINTS,
        tuple(flat_s * max(1.0, n / knee) for n in TARGET_POINTS),
        DRAFT_POINTS,
        tuple(draft_s * max(1.0, b / draft_knee) for b in DRAFT_POINTS),
    )


def linear(fixed_s: float, per_token_s: float, draft_s: float = 0.0005) -> CostProfile:
    """t(n) = fixed + n per_token: a CPU's shape, compute-bound almost at once."""
    return CostProfile(
        TARGET_POINTS,
        tuple(fixed_s + n * per_token_s for n in TARGET_POINTS),
        DRAFT_POINTS,
        tuple(draft_s * (1 + 0.05 * b) for b in DRAFT_POINTS),
    )
