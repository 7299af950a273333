"""Speculative sampling keeps the target's distribution: chi-square tests of the marginal of the
second and third sampled tokens (the first ones decided by speculation) against their exact values
computed from the target's own logits, with temperature and top-k applied to both models, and
once more with penalties and min-p (whose target distribution at each position depends on the
tokens sampled before it, drafts included), and once with a logit bias. Unseeded requests verify
by rejection sampling, seeded ones by races keyed by seed and position (faser.layers.race); a
seeded request's answer is the same under every policy, frontier size and batch."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from faser import LLM, SamplingParams, SpecConfig
from faser.layers.sampler import History, request_probs
from tests.engine.tiny import make_checkpoint, make_noisy_copy
from tests.spec_decode.spec_profiles import roofline

VOCAB = 12
PROMPT = [1, 2, 3]
NUM_SAMPLES = 1200
# tokens 2 and 3 are checked; a request drafts at most the tokens it has left but one, so with 5
# the first decoding step drafts up to three (tokens 2 to 4, the 5th its bonus): tokens 2 and 3
# are drafted ones, accepted or resampled
SAMPLED_TOKENS = 5
PARAMS = dict(temperature=0.9, top_k=8, top_p=0.95)
PENALISED = dict(PARAMS, repetition_penalty=0.8, frequency_penalty=-1.0, presence_penalty=-1.0,
                 min_p=0.05)
BIASED = dict(PARAMS, logit_bias={2: 1.5, 5: -100.0, 7: 0.8})


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("stat")
    target = make_checkpoint(root / "t", "gqa_tied", vocab_size=VOCAB, seed=3)
    return target, make_noisy_copy(target, root / "d", noise=1.0)


def exact_marginals(target_dir, params: dict = PARAMS) -> tuple[torch.Tensor, ...]:
    """P(t2), P(t3) and P(t2, t3) (flat, t2-major) by enumerating every t1 (and t2) with the
    target's own logits, each context's penalties over its own output."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir)
    sampling = SamplingParams(**params)

    def probs(contexts: list[list[int]]) -> torch.Tensor:  # [n, vocab]
        with torch.no_grad():
            logits = model(torch.tensor(contexts)).logits[:, -1].float()
        histories = [History(PROMPT, c[len(PROMPT):]) for c in contexts]
        return request_probs(logits, [sampling] * len(contexts), histories)

    p1 = probs([PROMPT])[0]
    p2_given = probs([PROMPT + [a] for a in range(VOCAB)])  # [t1, t2]
    p2 = p1 @ p2_given
    p3_given = probs([PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
    joint12 = p1[:, None] * p2_given  # [t1, t2]
    p3 = joint12.reshape(-1) @ p3_given
    joint123 = joint12.reshape(-1, 1) * p3_given  # [t1 * t2, t3]
    p23 = joint123.reshape(VOCAB, VOCAB * VOCAB).sum(0)  # [t2 * t3]
    return p2, p3, p23


def assert_marginals_match(outputs, target_dir, params: dict = PARAMS) -> None:
    """The 2nd and 3rd sampled tokens follow the target's exact marginals, and so do the two
    together (with penalties, the 3rd token's distribution depends on the 2nd)."""
    p2, p3, p23 = exact_marginals(target_dir, params)
    pairs = [o.token_ids[1] * VOCAB + o.token_ids[2] for o in outputs]
    cases = (("token 2", [o.token_ids[1] for o in outputs], p2),
             ("token 3", [o.token_ids[2] for o in outputs], p3), ("tokens 2 and 3", pairs, p23))
    for name, values, expected in cases:
        counts = torch.bincount(torch.tensor(values), minlength=expected.numel()).float()
        rejected, stat = chi_square_rejects(counts, expected)
        assert not rejected, f"{name}: chi-square {stat:.1f}"


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


@pytest.mark.parametrize("policy,frontier,params,seeded", [
    ("fixed:2", None, PARAMS, False), ("fixed:3", 1, PARAMS, False), ("off", None, PARAMS, False),
    ("heuristic", None, PARAMS, False), ("faser", None, PARAMS, False),
    ("fixed:3", None, PENALISED, False), ("fixed:2", 1, PENALISED, False),
    ("fixed:3", None, BIASED, False),
    ("fixed:3", None, PARAMS, True), ("off", None, PARAMS, True), ("faser", None, PARAMS, True),
    ("fixed:2", 1, PENALISED, True),
])
def test_speculative_sampling_matches_target_distribution(small_vocab_pair, policy, frontier,
                                                          params, seeded, monkeypatch):
    target, draft = small_vocab_pair
    # an unseeded request's generator takes torch.seed(): counted here, so that a run repeats
    monkeypatch.setattr(torch, "seed", itertools.count(10**6).__next__)
    max_num_seqs = 16 if policy == "faser" else 128
    llm = LLM(str(target), draft_model=str(draft),
              spec=SpecConfig(policy=policy, frontier_size=frontier),
              num_kv_blocks=4096, block_size=4, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=1024, dtype="float32")
    # a memory-bound profile, so that faser speculates on models this small
    llm.engine.speculator.use_cost_profile(roofline())
    sampling = [SamplingParams(max_tokens=SAMPLED_TOKENS, seed=i if seeded else None,
                               ignore_eos=True, **params) for i in range(NUM_SAMPLES)]
    # faser drafts only at low load with no queue: waves of max_num_seqs requests
    outputs = [out for i in range(0, NUM_SAMPLES, max_num_seqs)
               for out in llm.generate([PROMPT] * len(sampling[i : i + max_num_seqs]),
                                       sampling[i : i + max_num_seqs])]
    assert_marginals_match(outputs, target, params)
    if policy != "off":
        stats = llm.engine.stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_chi_square_detects_a_wrong_distribution():
    """The test above can fail: a distribution off by a few points is caught."""
    p = torch.tensor([0.5, 0.3, 0.2])
    wrong = torch.tensor([0.57, 0.25, 0.18]) * NUM_SAMPLES
    assert chi_square_rejects(wrong, p)[0]
    assert not chi_square_rejects(p * NUM_SAMPLES, p)[0]


@pytest.mark.parametrize("params", [PARAMS, PENALISED, BIASED])
def test_a_seeded_answer_is_the_same_under_every_policy_and_batch(small_vocab_pair, params):
    """Plain decoding's answer, whatever was drafted and accepted: each token is its position's
    race, which speculation cannot move."""
    target, draft = small_vocab_pair
    prompts = [PROMPT, [4, 5], [6, 7, 8, 9]]
    sampling = [SamplingParams(max_tokens=16, seed=s, ignore_eos=True, **params)
                for s in (7, 8, 9)]
    answers = {}
    for policy, frontier in (("off", None), ("fixed:1", None), ("fixed:3", None),
                             ("fixed:3", 1), ("faser", None)):
        llm = LLM(str(target), draft_model=str(draft),
                  spec=SpecConfig(policy=policy, frontier_size=frontier),
                  num_kv_blocks=256, block_size=4, dtype="float32")
        llm.engine.speculator.use_cost_profile(roofline())
        together = llm.generate(prompts, sampling)
        alone = llm.generate(prompts[2:], sampling[2:])  # another batch
        answers[policy, frontier] = [o.token_ids for o in together]
        assert alone[0].token_ids == together[2].token_ids
        if policy != "off":
            stats = llm.engine.stats
            assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    plain = answers["off", None]
    assert len({tuple(a) for a in plain}) == 3  # the seeds sample three different answers
    assert all(a == plain for a in answers.values()), answers
