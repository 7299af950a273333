"""A seeded request's races (faser.layers.race): the winner at a position follows the row's
distribution over seeds, depends on the seed and the position alone, and is never a token
without mass."""

import torch

from faser.layers.race import race_scores
from tests.engine.test_sampling_distribution import chi_square_rejects

P = torch.tensor([0.45, 0.25, 0.15, 0.1, 0.05, 0.0])


def test_the_winners_over_seeds_follow_the_distribution():
    winners = [int(race_scores(P[None], seed, 17).argmax()) for seed in range(4000)]
    counts = torch.bincount(torch.tensor(winners), minlength=P.numel()).float()
    assert counts[-1] == 0  # no mass, never a winner
    rejected, stat = chi_square_rejects(counts, P)
    assert not rejected, stat


def test_the_noise_is_the_seeds_and_the_positions_alone():
    rows = torch.stack([P, P.flip(0), torch.full((6,), 1 / 6)])
    scores = race_scores(rows, seed=3, first_position=40)
    # row r is position 40 + r, however it is batched
    assert torch.equal(scores[1], race_scores(rows[1:2], seed=3, first_position=41)[0])
    assert not torch.equal(race_scores(P[None], 3, 40), race_scores(P[None], 3, 41))
    assert not torch.equal(race_scores(P[None], 3, 40), race_scores(P[None], 4, 40))
    assert torch.isneginf(scores[0, -1]) and torch.isneginf(scores[1, 0])


def test_across_blocks_each_token_wins_with_its_probability():
    """The blocks race first, each on its mass, then the winning block's entries: mass spread
    over several blocks (of 256), with one in the padding's block."""
    p = torch.zeros(1000)
    p[[3, 300, 301, 700, 999]] = torch.tensor([0.4, 0.25, 0.15, 0.15, 0.05])
    winners = [int(race_scores(p[None], seed, 5).argmax()) for seed in range(4000)]
    counts = torch.bincount(torch.tensor(winners), minlength=1000).float()
    assert counts.sum() == counts[[3, 300, 301, 700, 999]].sum()
    rejected, stat = chi_square_rejects(counts[[3, 300, 301, 700, 999]], p[[3, 300, 301, 700, 999]])
    assert not rejected, stat
