"""A seeded request's sampling: the token at each position is the winner of a race keyed by the
request's seed and that position.

Every vocabulary entry v runs an exponential clock E_v / p_v (E_v = -log u_v, u_v uniform from a
generator seeded by (seed, position)); the first to ring is v with probability p_v (the
exponential race, Gumbel-max's twin). The noise depends on the seed and the position alone, so
plain decoding draws the same token at a position whatever came before it in the engine: the
same answer to the same seeded request under any batch, policy or restart. A draft proposes its
own race winner over q with the same noise, and the target accepts it iff it equals the target's
winner (Gumbel coupling: drafter-invariant speculative decoding, Daliri, Musco and Suresh, 2024),
so speculation never changes a seeded answer. The price is acceptance: a shared race agrees less
often than rejection sampling's min(1, p / q), which unseeded requests keep.

The race runs in two rounds, as drawing a uniform for each of tens of thousands of entries at
every position cost more than the rest of a request's share of a step: blocks of BLOCK entries
race first, each with one clock whose rate is its mass (the first of a block's clocks to ring is
an exponential of rate its mass, and which one rang is independent of when), then the winning
block's entries race. Each token still wins with probability p_v."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from faser.layers.sampler import argmax

BLOCK = 256
MASK64 = (1 << 64) - 1
BLOCKS_ROUND = -1  # the noise stream of the blocks' round; block b's entries race on stream b
# a step needs a request's noise for its k + 1 positions twice (drafting, then verifying)
NUM_CACHED = 256


def race_scores(
    probs: torch.Tensor,  # [num_rows, vocab]: each row's distribution
    seed: int,
    first_position: int,  # of row 0; row r scores the token at first_position + r
) -> torch.Tensor:  # [num_rows, vocab] float32
    """Scores whose argmax is each row's token: -E_v / p_v over the winning block, -inf
    elsewhere (and where p is 0)."""
    num_rows, vocab = probs.shape
    num_blocks = -(-vocab // BLOCK)
    padded = probs.float().cpu()
    if vocab % BLOCK:
        padded = F.pad(padded, (0, num_blocks * BLOCK - vocab))  # padding never wins
    blocks = padded.view(num_rows, num_blocks, BLOCK)
    mass = blocks.sum(-1)  # [num_rows, num_blocks]
    scores = torch.full_like(blocks, float("-inf"))
    for r in range(num_rows):
        position = first_position + r
        clocks = log_uniforms(seed, position, BLOCKS_ROUND, num_blocks) / mass[r]
        b = int(argmax(clocks[None]))
        scores[r, b] = log_uniforms(seed, position, b, BLOCK) / blocks[r, b]
    return scores.view(num_rows, -1)[:, :vocab].to(probs.device)


@functools.lru_cache(maxsize=NUM_CACHED)
def log_uniforms(seed: int, position: int, stream: int, n: int) -> torch.Tensor:  # [n], read only
    """log(u), n uniforms in [0, 1) for one round of the race at `position` of a request seeded
    `seed`."""
    generator = torch.Generator().manual_seed(_mix(seed, position, stream))
    return torch.rand(n, generator=generator).log_()


def _mix(*keys: int) -> int:
    """One 64-bit generator seed per key tuple, by SplitMix64's finaliser after each key: nearby
    seeds, positions and streams give unrelated generators."""
    x = 0
    for key in keys:
        x = ((x ^ (key & MASK64)) * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & MASK64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
        x ^= x >> 31
    return x
