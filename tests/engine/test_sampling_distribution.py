"""Speculative sampling keeps the target's distribution: chi-square tests of the marginal of the
second and third sampled tokens (the first ones decided by speculation) against their exact values
computed from the target's own logits, with temperature and top-k applied to both models."""

from __future__ import annotations

import math

import pytest
import torch

from faser import LLM, SamplingParams, SpecConfig
from faser.layers.sampler import logits_to_probs
from tests.engine.tiny import make_checkpoint, make_noisy_copy
from tests.spec_decode.spec_profiles import roofline

VOCAB = 12
PROMPT = [1, 2, 3]
NUM_SAMPLES = 1200
PARAMS = dict(temperature=0.9, top_k=8, top_p=0.95)


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("stat")
    target = make_checkpoint(root / "t", "gqa_tied", vocab_size=VOCAB, seed=3)
    return target, make_noisy_copy(target, root / "d", noise=1.0)


def exact_marginals(target_dir) -> tuple[torch.Tensor, torch.Tensor]:
    """P(t2) and P(t3) by enumerating every t1 (and t2) with the target's own logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir)

    def probs(contexts: list[list[int]]) -> torch.Tensor:  # [n, vocab]
        with torch.no_grad():
            logits = model(torch.tensor(contexts)).logits[:, -1].float()
        n = len(contexts)
        return logits_to_probs(logits, torch.full((n,), PARAMS["temperature"]),
                               torch.full((n,), PARAMS["top_k"]),
                               torch.full((n,), PARAMS["top_p"]))

    p1 = probs([PROMPT])[0]
    p2_given = probs([PROMPT + [a] for a in range(VOCAB)])  # [t1, t2]
    p2 = p1 @ p2_given
    p3_given = probs([PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
    joint12 = p1[:, None] * p2_given  # [t1, t2]
    p3 = joint12.reshape(-1) @ p3_given
    return p2, p3


def assert_marginals_match(outputs, target_dir) -> None:
    """The 2nd and 3rd sampled tokens follow the target's exact marginals."""
    p2, p3 = exact_marginals(target_dir)
    for position, expected in ((1, p2), (2, p3)):
        counts = torch.bincount(torch.tensor([o.token_ids[position] for o in outputs]),
                                minlength=VOCAB).float()
        rejected, stat = chi_square_rejects(counts, expected)
        assert not rejected, f"token {position + 1}: chi-square {stat:.1f}"


def chi_square_rejects(counts: torch.Tensor, expected_p: torch.Tensor) -> tuple[bool, float]:
    """Pearson's test at significance 1e-4 (cells with small expectation pooled)."""
    expected = expected_p * counts.sum()
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum(0, keepdim=True)])
    expect = torch.cat([expected[big], expected[~big].sum(0, keepdim=True)])
    keep = expect > 0
    observed, expect = observed[keep], expect[keep]
    stat = float(((observed - expect) ** 2 / expect).sum())
    df = observed.numel() - 1
    z = 3.719  # one-sided normal quantile for 1e-4; Wilson-Hilferty approximation below
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat > critical, stat


@pytest.mark.parametrize("policy,frontier", [
    ("fixed:2", None), ("fixed:3", 1), ("off", None), ("heuristic", None),
    ("faser", None),
])
def test_speculative_sampling_matches_target_distribution(small_vocab_pair, policy, frontier):
    target, draft = small_vocab_pair
    # the adaptive policy drafts at low load only: fewer requests in flight
    max_num_seqs = 16 if policy == "faser" else 128
    llm = LLM(str(target), draft_model=str(draft),
              spec=SpecConfig(policy=policy, frontier_size=frontier),
              num_kv_blocks=4096, block_size=4, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=1024, dtype="float32")
    # a memory-bound profile, so that faser speculates on models this small
    llm.engine.speculator.use_cost_profile(roofline())
    params = [SamplingParams(max_tokens=3, seed=i, ignore_eos=True, **PARAMS)
              for i in range(NUM_SAMPLES)]
    outputs = llm.generate([PROMPT] * NUM_SAMPLES, params)
    assert_marginals_match(outputs, target)
    if policy != "off":
        stats = llm.engine.stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_chi_square_detects_a_wrong_distribution():
    """The test above can fail: a distribution off by a few points is caught."""
    p = torch.tensor([0.5, 0.3, 0.2])
    wrong = torch.tensor([0.57, 0.25, 0.18]) * NUM_SAMPLES
    assert chi_square_rejects(wrong, p)[0]
    assert not chi_square_rejects(p * NUM_SAMPLES, p)[0]


def test_same_seed_same_output(small_vocab_pair):
    target, draft = small_vocab_pair
    llm = LLM(str(target), draft_model=str(draft), spec=SpecConfig(policy="fixed:3"),
              num_kv_blocks=256, block_size=4, dtype="float32")
    params = SamplingParams(max_tokens=12, seed=7, ignore_eos=True, **PARAMS)
    first = llm.generate([PROMPT, [4, 5]], params)
    again = llm.generate([[4, 5], PROMPT], params)  # other batch order, same seeds
    assert first[0].token_ids == again[1].token_ids
    assert first[1].token_ids == again[0].token_ids
