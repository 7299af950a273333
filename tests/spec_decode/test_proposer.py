"""The proposer on its own, over the real tiny draft and its runner: ragged k across requests, the
draft's own greedy continuation, confidences, the draft cache cursor (advanced while drafting,
rolled back after a commit), stopping on low confidence, truncation, prompt lookup, and the
distributions over the target's vocabulary that sampled requests carry, reduced-vocabulary drafts
included. The oracle is plain greedy decoding of the draft
model (the verifier with no draft tokens, run over the draft as if it were a target)."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from faser.engine.sequence import Sequence
from faser.models.loader import load_model
from faser.runner.block_manager import BlockManager
from faser.runner.model_runner import ModelRunner
from faser.runner.weights import pack_weights, resolve_weight_format
from faser.sampling_params import SamplingParams
from faser.spec_decode.lookup import PRIOR_PRECISION
from faser.spec_decode.proposer import Proposal, Proposer
from faser.spec_decode.state import SpecState
from faser.spec_decode.verifier import Verifier
from tests.engine.tiny import make_checkpoint, make_noisy_copy

BLOCK_SIZE, NUM_BLOCKS, MAX_POSITION, VOCAB = 4, 128, 128, 97
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=64)
PROMPTS = ([3, 14, 15, 92, 65], [35, 89, 79], [32, 38, 46, 26, 43, 38, 32], [2, 71, 82, 81])


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tiny") / "gqa_tied", "gqa_tied")


@pytest.fixture(scope="module")
def draft(target_dir):
    torch.set_flush_denormal(True)  # as the engine does
    path = make_noisy_copy(target_dir, target_dir.parent / "gqa_tied_draft", noise=0.12)
    model = load_model(path, "cpu", "float32", MAX_POSITION)
    assert model.config.vocab_size == VOCAB
    return pack_weights(model, resolve_weight_format("auto", "cpu", "float32"), "cpu")


class Rig:
    """A draft runner with its own block pool, and requests on it as the engine holds them."""

    def __init__(self, model, **proposer_kwargs) -> None:
        self.runner = ModelRunner(model, NUM_BLOCKS, BLOCK_SIZE, "cpu")
        self.blocks = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.proposer = Proposer(self.runner, VOCAB, **proposer_kwargs)

    @staticmethod
    def requests(prompts, params=GREEDY, seed: int = 0) -> list[Sequence]:
        return [
            Sequence(str(i), list(p), params, SpecState(alpha=0.5, policy="fixed", max_k=8),
                     torch.Generator().manual_seed(seed + i))
            for i, p in enumerate(prompts)
        ]

    def propose(self, seqs, max_k, stop_confidence=None) -> Proposal:
        for seq, k in zip(seqs, max_k, strict=True):
            assert self.blocks.allocate(seq.request_id, seq.block_table, seq.num_tokens + k)
        return self.proposer.propose(seqs, max_k, stop_confidence)


@pytest.fixture(scope="module")
def draft_greedy(draft):
    """The draft model's plain greedy continuation of a context, one token a step."""

    @functools.cache
    def greedy(context: tuple[int, ...], n: int) -> list[int]:
        if n == 0:
            return []
        runner = ModelRunner(draft, NUM_BLOCKS, BLOCK_SIZE, "cpu")
        verifier = Verifier(runner)
        (seq,) = Rig.requests([context])
        seq.block_table = list(range(-(-(len(context) + n) // BLOCK_SIZE)))
        _, (token,) = verifier.verify([], Proposal.empty(0), [(seq, seq.num_tokens)])
        while True:
            seq.output_token_ids.append(token)
            seq.roll_back_caches()
            if len(seq.output_token_ids) == n:
                return seq.output_token_ids
            (verdict,), _ = verifier.verify([seq], Proposal.empty(1), [])
            (token,) = verdict.token_ids

    return lambda context, n: greedy(tuple(context), n)


def test_ragged_k_gives_the_drafts_own_greedy_continuation(draft, draft_greedy):
    rig = Rig(draft)
    seqs = rig.requests(PROMPTS[:3])
    max_k = [0, 1, 3]
    proposal = rig.propose(seqs, max_k)
    for seq, k, tokens, confidences in zip(
        seqs, max_k, proposal.draft_token_ids, proposal.confidences, strict=True
    ):
        assert tokens == draft_greedy(seq.token_ids, k)
        assert len(confidences) == k and all(0.0 < c <= 1.0 for c in confidences)
        # the whole prompt was fed, then each draft token but the last
        assert seq.num_draft_cached == (seq.num_tokens + k - 1 if k else 0)
    assert proposal.draft_probs == [None, None, None]  # greedy requests carry no distribution
    assert proposal.looked_up == [[0] * k for k in max_k]
    # the cost model prices drafting by what each forward fed: both prompts, then one row twice
    assert proposal.forward_rows == [3 + 7, 1, 1]


def test_after_a_commit_the_draft_cache_rolls_back_and_drafts_from_the_new_context(
    draft, draft_greedy
):
    rig = Rig(draft)
    seqs = rig.requests(PROMPTS[:3])
    first = rig.propose(seqs, [0, 4, 3])
    # request 1 keeps two drafts and a correction; request 2 keeps all three and a bonus
    commits = [[7], first.draft_token_ids[1][:2] + [(first.draft_token_ids[1][2] + 1) % VOCAB],
               first.draft_token_ids[2] + [11]]
    for seq, tokens in zip(seqs, commits, strict=True):
        seq.output_token_ids += tokens
        seq.roll_back_caches()
    # request 0 was never drafted: its cache is empty; request 1's row of its rejected third
    # draft is stale and dropped; request 2's never read its third draft nor the bonus
    assert [s.num_draft_cached for s in seqs] == [0, seqs[1].num_tokens - 1,
                                                 seqs[2].num_tokens - 2]
    max_k = [2, 3, 1]
    missed = [s.num_tokens - s.num_draft_cached for s in seqs]
    second = rig.propose(seqs, max_k)
    assert second.forward_rows == [sum(missed), 2, 1]
    for seq, k, tokens in zip(seqs, max_k, second.draft_token_ids, strict=True):
        assert tokens == draft_greedy(seq.token_ids, k)
        assert seq.num_draft_cached == seq.num_tokens + k - 1


@pytest.mark.parametrize("stop", [1.0, 0.02, 0.0])
def test_a_line_stops_once_its_cumulative_confidence_falls_below_the_threshold(
    draft, draft_greedy, stop
):
    rig = Rig(draft)
    seqs = rig.requests(PROMPTS)
    max_k = [4, 0, 6, 5]
    proposal = rig.propose(seqs, max_k, stop_confidence=stop)
    for seq, k, tokens, confidences in zip(
        seqs, max_k, proposal.draft_token_ids, proposal.confidences, strict=True
    ):
        assert len(tokens) == len(confidences) <= k
        assert tokens == draft_greedy(seq.prompt_token_ids, k)[: len(tokens)]
        if stop == 1.0:  # a random draft is never certain: each line stops after one token
            assert len(tokens) == min(k, 1)
        if stop == 0.0:
            assert len(tokens) == k
        cumulative = [math.prod(confidences[: m + 1]) for m in range(len(tokens))]
        assert all(c >= stop for c in cumulative[:-1])  # it went on while confident enough
        if len(tokens) < k:
            assert cumulative[-1] < stop  # and stopped only when it no longer was
    lengths = [len(t) for t in proposal.draft_token_ids]
    if 0.0 < stop < 1.0:  # the tiny draft's confidences (about 0.1 each) cut lines mid-way
        assert any(1 < n < k for n, k in zip(lengths, max_k, strict=True))


def test_only_greedy_lines_stop_on_low_confidence(draft):
    # a sampled token's confidence is its chance at the request's temperature, low whatever the
    # chance that the target accepts it: a sampled line runs to its k
    rig = Rig(draft)
    greedy, sampled = rig.requests(PROMPTS[:1]), rig.requests(PROMPTS[1:2], SAMPLED, seed=5)
    sampled[0].request_id = "sampled"
    proposal = rig.propose(greedy + sampled, [4, 4], stop_confidence=1.0)
    assert [len(t) for t in proposal.draft_token_ids] == [1, 4]


def test_sampled_requests_carry_distributions_over_the_target_vocabulary(draft):
    rig = Rig(draft)
    seqs = rig.requests(PROMPTS[:2], SAMPLED, seed=5) + rig.requests(PROMPTS[2:3])
    max_k = [3, 2, 2]
    proposal = rig.propose(seqs, max_k)
    assert proposal.draft_probs[2] is None  # the greedy request beside them
    for k, tokens, confidences, probs in zip(
        max_k[:2], proposal.draft_token_ids[:2], proposal.confidences[:2],
        proposal.draft_probs[:2], strict=True,
    ):
        assert probs.shape == (k, VOCAB) and len(tokens) == k
        assert bool((probs >= 0).all())
        torch.testing.assert_close(probs.sum(-1), torch.ones(k))
        chosen = probs[torch.arange(k), torch.tensor(tokens)]
        assert bool((chosen > 0).all())  # top-p never lets an excluded token be drawn
        torch.testing.assert_close(chosen, torch.tensor(confidences))  # q of its own token
    # the requests' seeded generators make the draws reproducible
    again = Rig(draft).propose(Rig.requests(PROMPTS[:2], SAMPLED, seed=5), max_k[:2])
    assert again.draft_token_ids == proposal.draft_token_ids[:2]


def test_a_token_map_puts_the_drafts_rows_at_target_ids(draft):
    token_map = torch.arange(VOCAB).flip(0)  # the draft's row r is target id VOCAB - 1 - r

    def first_drafts(params, **kwargs) -> Proposal:
        rig = Rig(draft, **kwargs)
        return rig.propose(rig.requests(PROMPTS[:2], params, seed=3), [1, 1])

    plain, mapped = first_drafts(SAMPLED), first_drafts(SAMPLED, token_map=token_map)
    for p, m in zip(plain.draft_probs, mapped.draft_probs, strict=True):
        assert m.shape == (1, VOCAB)
        torch.testing.assert_close(m[:, token_map], p)
    plain, mapped = first_drafts(GREEDY), first_drafts(GREEDY, token_map=token_map)
    assert mapped.draft_token_ids == [[VOCAB - 1 - t] for (t,) in plain.draft_token_ids]


def test_a_reduced_vocabulary_drafts_q_rows_are_distributions_over_the_target_vocabulary(
    target_dir, tmp_path
):
    from transformers import AutoModelForCausalLM

    from faser.distill.model import build_draft, export_draft

    token_map = torch.arange(0, VOCAB, 2)  # the draft predicts the even target ids only
    hf = AutoModelForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32)
    export_draft(build_draft(hf, [0], token_map), token_map, tmp_path, {}, torch.float32)
    target = load_model(target_dir, "cpu", "float32", MAX_POSITION)
    reduced = load_model(tmp_path, "cpu", "float32", MAX_POSITION, target.embed_tokens)
    rig = Rig(reduced, token_map=token_map)
    (probs,) = rig.propose(rig.requests(PROMPTS[:1], SAMPLED), [2]).draft_probs
    assert probs.shape == (2, VOCAB) and bool((probs[:, 1::2] == 0).all())
    torch.testing.assert_close(probs.sum(-1), torch.ones(2))


def test_truncate_cuts_tokens_confidences_and_distributions_alike(draft):
    rig = Rig(draft)
    seqs = rig.requests(PROMPTS[:2], SAMPLED, seed=1) + rig.requests(PROMPTS[2:4])
    proposal = rig.propose(seqs, [3, 3, 2, 3])
    before = (
        [list(t) for t in proposal.draft_token_ids],
        [list(c) for c in proposal.confidences],
        [p.clone() if p is not None else None for p in proposal.draft_probs],
    )
    keep = [1, 0, 2, 3]
    proposal.truncate(keep)
    for i, k in enumerate(keep):
        assert proposal.draft_token_ids[i] == before[0][i][:k]
        assert proposal.confidences[i] == before[1][i][:k]
        assert len(proposal.looked_up[i]) == k
        if before[2][i] is None:
            assert proposal.draft_probs[i] is None
        else:
            assert torch.equal(proposal.draft_probs[i], before[2][i][:k])
    empty = Proposal.empty(2)
    empty.truncate([0, 0])
    assert empty.draft_token_ids == [[], []] and empty.draft_probs == [None, None]


def test_prompt_lookup_replaces_greedy_guesses_only(draft):
    # calibration 0: the draft's own guess is never deemed likely, so any found n-gram wins
    rig = Rig(draft, prompt_lookup=True, calibration=lambda confidence: 0.0)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    seqs = rig.requests([prompt]) + rig.requests([prompt], SAMPLED, seed=2)
    proposal = rig.propose(seqs, [3, 3])
    assert proposal.draft_token_ids[0] == [8, 5, 6]  # the pattern, continued
    assert all(c >= PRIOR_PRECISION for c in proposal.confidences[0])
    assert proposal.looked_up[1] == [0] * 3  # a sampled request keeps the draft's tokens
    assert [s.num_draft_cached for s in seqs] == [len(prompt) + 2] * 2
