"""The verifier on its own, over the real tiny target and its runner: the target's own greedy
continuation is accepted whole with a bonus token, a wrong draft token at position j accepts
exactly j, k is ragged across requests, frontiers prune what follows a rejection, prefill chunks
ride along, and after rolling the cache cursors back the next step continues exactly like plain
greedy decoding (the oracle: the same verifier with no draft tokens, one token a step)."""

from __future__ import annotations

import functools

import pytest
import torch

from faser.engine.sequence import Sequence
from faser.models.loader import load_model
from faser.runner.block_manager import BlockManager
from faser.runner.model_runner import ModelRunner
from faser.runner.weights import pack_weights, resolve_weight_format
from faser.sampling_params import SamplingParams
from faser.spec_decode.proposer import Proposal
from faser.spec_decode.state import SpecState
from faser.spec_decode.verifier import Verifier
from tests.engine.tiny import make_checkpoint

BLOCK_SIZE, NUM_BLOCKS, MAX_POSITION = 4, 128, 128
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
PROMPTS = ([3, 14, 15, 92, 65], [35, 89, 79], [32, 38, 46, 26, 43, 38, 32], [2, 71, 82, 81],
           [50, 28, 84])
ORACLE_LEN = 24


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tiny") / "gqa_tied", "gqa_tied")


@pytest.fixture(scope="module")
def target(checkpoint):
    torch.set_flush_denormal(True)  # as the engine does
    model = load_model(checkpoint, "cpu", "float32", MAX_POSITION)
    return pack_weights(model, resolve_weight_format("auto", "cpu", "float32"), "cpu")


class Rig:
    """A target runner with its own block pool, holding requests the way the engine does."""

    def __init__(self, model) -> None:
        self.runner = ModelRunner(model, NUM_BLOCKS, BLOCK_SIZE, "cpu")
        self.blocks = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.verifier = Verifier(self.runner)

    @staticmethod
    def request(prompt, rid: str) -> Sequence:
        state = SpecState(alpha=0.5, policy="fixed", max_k=8)
        return Sequence(rid, list(prompt), GREEDY, state, torch.Generator().manual_seed(0))

    def verify(self, seqs, drafts, frontier=None, prefills=()):
        for seq, draft in zip(seqs, drafts, strict=True):
            assert self.blocks.allocate(seq.request_id, seq.block_table,
                                        seq.num_tokens + len(draft))
        for seq, n in prefills:
            assert self.blocks.allocate(seq.request_id, seq.block_table, seq.num_cached + n)
        proposal = Proposal.empty(len(seqs))
        proposal.draft_token_ids = [list(d) for d in drafts]
        proposal.confidences = [[0.5] * len(d) for d in drafts]
        return self.verifier.verify(seqs, proposal, list(prefills), frontier_size=frontier)

    def commit(self, seq: Sequence, tokens: list[int]) -> None:
        seq.output_token_ids += tokens
        seq.roll_back_caches()
        self.blocks.truncate(seq.block_table, seq.num_tokens)
        assert seq.num_cached == seq.num_tokens - 1

    def prefill(self, seqs) -> None:
        _, tokens = self.verify([], [], prefills=[(s, s.num_tokens) for s in seqs])
        for seq, token in zip(seqs, tokens, strict=True):
            assert token is not None
            self.commit(seq, [token])


@pytest.fixture(scope="module")
def oracle(target):
    """Plain greedy decoding of the target: a prefill, then one token a step (k = 0)."""

    @functools.cache
    def greedy(prompt: tuple[int, ...]) -> list[int]:
        rig = Rig(target)
        seq = rig.request(prompt, "oracle")
        rig.prefill([seq])
        while len(seq.output_token_ids) < ORACLE_LEN:
            (verdict,), _ = rig.verify([seq], [[]])
            assert verdict.token_ids and verdict.num_accepted == verdict.num_pruned == 0
            rig.commit(seq, verdict.token_ids)
        return seq.output_token_ids

    return lambda prompt: greedy(tuple(prompt))


def started(rig: Rig, prompts) -> list[Sequence]:
    seqs = [rig.request(p, str(i)) for i, p in enumerate(prompts)]
    rig.prefill(seqs)
    return seqs


def draft_of(greedy: list[int], done: int, k: int, wrong_at: int | None) -> list[int]:
    """k drafts after `done` committed tokens of the greedy continuation, one of them wrong."""
    draft = list(greedy[done : done + k])
    assert len(draft) == k
    if wrong_at is not None:
        draft[wrong_at] = (draft[wrong_at] + 1) % 97
    return draft


def test_plain_decoding_matches_hugging_face_greedy(checkpoint, oracle):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32)
    for prompt in PROMPTS[:2]:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=ORACLE_LEN,
                             min_new_tokens=ORACLE_LEN, do_sample=False)
        assert oracle(prompt) == out[0, len(prompt) :].tolist()


def test_the_targets_own_continuation_is_accepted_whole_with_a_bonus(target, oracle):
    rig = Rig(target)
    ks = [0, 2, 5]
    seqs = started(rig, PROMPTS[:3])
    starts = [s.num_cached for s in seqs]
    greedy = [oracle(p) for p in PROMPTS[:3]]
    drafts = [draft_of(g, 1, k, None) for g, k in zip(greedy, ks, strict=True)]
    verdicts, prefill_tokens = rig.verify(seqs, drafts)
    assert prefill_tokens == []
    for seq, start, g, k, verdict in zip(seqs, starts, greedy, ks, verdicts, strict=True):
        assert verdict.token_ids == g[1 : k + 2]  # k drafts and the bonus
        assert (verdict.num_accepted, verdict.num_pruned, verdict.done) == (k, 0, True)
        assert seq.num_cached == start + k + 1


# (k, position of the wrong draft token or None) per request, all in one call
RAGGED = [(4, 0), (4, 2), (3, None), (0, None), (5, 4), (1, 0)]


@pytest.mark.parametrize("frontier", [None, 1, 2])
def test_a_wrong_draft_at_j_accepts_exactly_j_and_frontiers_prune_after_it(
    target, oracle, frontier
):
    rig = Rig(target)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(RAGGED))]
    seqs = started(rig, prompts)
    starts = [s.num_cached for s in seqs]
    greedy = [oracle(p) for p in prompts]
    drafts = [draft_of(g, 1, k, j) for g, (k, j) in zip(greedy, RAGGED, strict=True)]
    computed_before = rig.runner.num_positions_computed
    verdicts, _ = rig.verify(seqs, drafts, frontier)
    f = frontier or 99
    computed = []
    for seq, start, g, (k, j), verdict in zip(seqs, starts, greedy, RAGGED, verdicts, strict=True):
        accepted = k if j is None else j
        # the accepted drafts, then the target's own token (a correction or the bonus)
        assert verdict.token_ids == g[1 : accepted + 2]
        assert verdict.num_accepted == accepted and verdict.done
        # the target ran to the end of the frontier that held the rejection, no further
        n = k + 1 if j is None else min((j // f + 1) * f, k + 1)
        assert verdict.num_pruned == k + 1 - n
        assert seq.num_cached == start + n
        computed.append(n)
    assert rig.runner.num_positions_computed - computed_before == sum(computed)
    assert (sum(v.num_pruned for v in verdicts) > 0) == (frontier is not None)


@pytest.mark.parametrize("frontier", [None, 1])
def test_a_prefill_chunk_rides_along_and_samples_only_when_it_completes_the_prompt(
    target, oracle, frontier
):
    rig = Rig(target)
    (seq,) = started(rig, PROMPTS[:1])
    late = rig.request(PROMPTS[2], "late")  # 7 tokens, prefilled 4 + 3 beside the decodes
    g, g_late = oracle(PROMPTS[0]), oracle(PROMPTS[2])

    (verdict,), tokens = rig.verify([seq], [draft_of(g, 1, 3, 1)], frontier, [(late, 4)])
    assert tokens == [None] and late.num_cached == 4 and not late.output_token_ids
    assert verdict.token_ids == g[1:3]
    rig.commit(seq, verdict.token_ids)

    (verdict,), tokens = rig.verify([seq], [draft_of(g, 3, 2, None)], frontier, [(late, 3)])
    assert tokens == [g_late[0]] and late.num_cached == 7
    assert verdict.token_ids == g[3:6]
    rig.commit(seq, verdict.token_ids)
    rig.commit(late, tokens)

    # the chunked prompt's cache is right: the late request now decodes like plain greedy
    verdicts, _ = rig.verify([seq, late], [draft_of(g, 6, 2, 0), draft_of(g_late, 1, 3, None)])
    assert [v.token_ids for v in verdicts] == [g[6:7], g_late[1:5]]


def test_after_rolling_back_the_next_steps_continue_exactly_like_plain_greedy(target, oracle):
    """Rejected drafts leave stale rows in the cache past the committed tokens; once the cursors
    are rolled back, each next step overwrites them and greedy output stays exact."""
    rig = Rig(target)
    prompts = PROMPTS[1:3]
    seqs = started(rig, prompts)
    greedy = [oracle(p) for p in prompts]
    # per step: frontier, then (k, wrong position) per request
    schedule = [
        (None, [(4, 1), (3, None)]),
        (None, [(0, None), (5, 0)]),
        (1, [(3, 2), (2, None)]),
        (2, [(5, 3), (4, 1)]),
        (None, [(2, None), (0, None)]),
        (None, [(3, 0), (3, 2)]),
    ]
    for frontier, plan in schedule:
        drafts = [draft_of(g, len(s.output_token_ids), k, j)
                  for s, g, (k, j) in zip(seqs, greedy, plan, strict=True)]
        verdicts, _ = rig.verify(seqs, drafts, frontier)
        for seq, verdict in zip(seqs, verdicts, strict=True):
            rig.commit(seq, verdict.token_ids)  # asserts num_cached == num_tokens - 1
            assert seq.num_draft_cached == 0  # the verifier never touches the draft's cursor
    for seq, g in zip(seqs, greedy, strict=True):
        assert len(seq.output_token_ids) >= 12
        assert seq.output_token_ids == g[: len(seq.output_token_ids)]


def test_the_greedy_judge_commits_what_rejection_sampling_would():
    """An all-greedy frontier is judged by the argmax alone; rejection sampling's greedy rule,
    over the same rows, commits the same tokens (ties to the first maximum in both, and a
    non-final frontier's repeated last row)."""
    from faser.spec_decode.verifier import _Entry, _greedy_outcomes, _sampled_outcomes

    gen = torch.Generator().manual_seed(0)
    entries = []
    for n_checked, wrong_at, final in [(0, None, True), (3, None, True), (3, 1, True),
                                       (2, None, False), (4, 0, False), (1, None, True)]:
        rows = torch.randn(n_checked + 1, 300, generator=gen)
        rows[-1, [7, 250]] = rows[-1].max() + 1.0  # tied maxima: the first one wins
        if not final:
            rows[-1] = rows[-2]
        checked = rows[:n_checked].argmax(dim=-1).tolist()
        if wrong_at is not None:
            checked[wrong_at] = (checked[wrong_at] + 1) % 300
        entries.append(_Entry(checked, rows, None, torch.zeros(n_checked), torch.zeros(1),
                              GREEDY, final, None, None, 0))
    tokens, accepted = _greedy_outcomes(entries)
    sampled_tokens, sampled_accepted = _sampled_outcomes(entries)
    assert accepted == sampled_accepted == [0, 3, 1, 2, 0, 1]
    for mine, theirs in zip(tokens, sampled_tokens, strict=True):
        assert mine == theirs[: len(mine)] and all(t == -1 for t in theirs[len(mine):])
    assert tokens[0] == [7] and tokens[1][-1] == 7  # the bonus rows' first maximum
