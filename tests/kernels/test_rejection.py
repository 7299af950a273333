"""rejection_sample: table-driven greedy cases and a chi-square test of the twin (sampled
rejection must reproduce the target distribution), then the Triton kernel against the twin:
identical random inputs must give identical tokens."""

from __future__ import annotations

import sys

import pytest
import torch
from kernel_cases import RejectionBatch, rejection_batch

from faser_kernels.rejection import rejection_sample, rejection_sample_torch

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
VOCAB = 6

# (draft tokens, each target row's argmax incl. the bonus row, committed tokens)
GREEDY_TABLE = [
    ([], [3], [3]),  # k = 0: plain decoding, the bonus is the target's token
    ([1, 2, 0], [1, 2, 0, 4], [1, 2, 0, 4]),  # all accepted, plus the bonus
    ([1, 2], [3, 2, 0], [3]),  # first rejected: the recovered token only
    ([1, 2, 0], [1, 4, 0, 2], [1, 4]),  # rejected in the middle; later rows are ignored
    ([5, 5], [5, 1, 1], [5, 1]),  # the last draft rejected
]


def _greedy_batch(table: list, vocab_size: int = VOCAB) -> RejectionBatch:
    """Target rows hold logits (greedy rows may) peaking at the given argmax."""
    drafts, rows = [], []
    for draft, argmax, _ in table:
        drafts += draft
        for token in argmax:
            row = torch.linspace(-3.0, -1.0, vocab_size)
            row[token] = 2.0
            rows.append(row)
    ks = [len(d) for d, _, _ in table]
    cu = torch.tensor([0, *torch.tensor(ks, dtype=torch.long).cumsum(0).tolist()])
    num_reqs, num_draft = len(table), len(drafts)
    return RejectionBatch(
        torch.tensor(drafts, dtype=torch.long), cu, None, torch.stack(rows),
        torch.ones(num_reqs, dtype=torch.bool), torch.rand(num_draft), torch.rand(num_reqs),
    )


def _committed(out, i: int) -> list[int]:
    return out.output_token_ids[i, : int(out.num_accepted[i]) + 1].tolist()


def _check_greedy_table(sample) -> None:
    out = sample(*_greedy_batch(GREEDY_TABLE).args())
    for i, (_, _, expected) in enumerate(GREEDY_TABLE):
        assert _committed(out, i) == expected
        assert out.output_token_ids[i, len(expected) :].eq(-1).all()
    assert out.output_token_ids.shape == (len(GREEDY_TABLE), 4)


def test_twin_greedy_table():
    _check_greedy_table(rejection_sample_torch)


def test_twin_greedy_ties_go_to_the_lowest_token():
    batch = _greedy_batch([([2], [4, 4], [4, 4])])
    batch.target_probs[0, 1] = batch.target_probs[0, 4]  # token 1 ties with token 4
    out = rejection_sample_torch(*batch.args())
    assert _committed(out, 0) == [1]


P = torch.tensor([[0.3, 0.05, 0.2, 0.0, 0.25, 0.2], [0.1, 0.1, 0.1, 0.1, 0.1, 0.5]])
Q = torch.tensor([[0.1, 0.3, 0.1, 0.2, 0.1, 0.2], [0.5, 0.1, 0.1, 0.1, 0.1, 0.1]])
BONUS = torch.tensor([0.0, 0.0, 0.5, 0.5, 0.0, 0.0])
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}  # 0.1 % critical values


def _chi_square_ok(tokens: torch.Tensor, p: torch.Tensor) -> bool:
    """Pearson's test at the 0.1 % level; a token the target never emits must never appear."""
    counts = torch.bincount(tokens, minlength=p.numel()).double()
    support = p > 0
    if counts[~support].sum() > 0:
        return False
    expected = p[support].double() * tokens.numel()
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    return stat < CHI2_999[int(support.sum()) - 1]


def test_twin_sampled_rejection_reproduces_the_target():
    """Two drafts a request, drawn from q; committed token j must follow p_j whatever q is."""
    num_reqs = 4000
    gen = torch.Generator().manual_seed(7)
    drafts = torch.stack([torch.multinomial(Q[j], num_reqs, True, generator=gen) for j in (0, 1)])
    out = rejection_sample_torch(
        drafts.T.reshape(-1),
        torch.arange(0, 2 * num_reqs + 1, 2),
        Q.repeat(num_reqs, 1),
        torch.cat([P, BONUS[None]]).repeat(num_reqs, 1),
        torch.zeros(num_reqs, dtype=torch.bool),
        torch.rand(2 * num_reqs, generator=gen),
        torch.rand(num_reqs, generator=gen),
    )
    tokens = out.output_token_ids
    assert _chi_square_ok(tokens[:, 0], P[0])
    assert _chi_square_ok(tokens[out.num_accepted >= 1, 1], P[1])
    assert _chi_square_ok(tokens[out.num_accepted == 2, 2], BONUS)
    assert not _chi_square_ok(drafts[0], P[0])  # the test has the power to tell q from p


@pytest.fixture
def triton_sample(interpreted):
    return interpreted["triton_rejection"].rejection_sample_triton


def _assert_same(got, expected) -> None:
    assert torch.equal(got.output_token_ids, expected.output_token_ids)
    assert torch.equal(got.num_accepted, expected.num_accepted)


def test_triton_greedy_table(triton_sample):
    _check_greedy_table(triton_sample)


def test_triton_greedy_ties_across_vocab_blocks(triton_sample):
    batch = _greedy_batch([([7], [4100, 9], [4100])], vocab_size=5000)
    batch.target_probs[0, 10] = batch.target_probs[0, 4100]  # tie in the first block of 4096
    _assert_same(triton_sample(*batch.args()), rejection_sample_torch(*batch.args()))
    assert _committed(triton_sample(*batch.args()), 0) == [10]


@pytest.mark.parametrize(
    ("ks", "greedy", "vocab_size", "seed"),
    [
        ([0, 3, 2, 5, 1, 0], [True, False, True, False, False, True], 50, 0),
        ([4, 4, 1, 2], [False, False, False, False], 50, 1),
        ([1, 0, 6], [False, True, False], 37, 2),  # vocab not a power of 2
        ([2, 0, 3], [False, True, False], 5000, 3),  # two vocab blocks
        ([0, 0, 0], [False, True, False], 50, 4),  # plain decoding only
    ],
)
def test_triton_matches_twin(triton_sample, ks, greedy, vocab_size, seed):
    batch = rejection_batch(ks, greedy, vocab_size, seed)
    expected = rejection_sample_torch(*batch.args())
    _assert_same(triton_sample(*batch.args()), expected)
    # the inputs make both outcomes happen, or the comparison would prove little
    if sum(ks) >= 6:
        assert 0 < int(expected.num_accepted.sum()) < sum(ks)


def test_triton_all_greedy_without_draft_probs(triton_sample):
    batch = rejection_batch([3, 0, 2], [True, True, True], 50, seed=5)
    batch = RejectionBatch(*(None if i == 2 else t for i, t in enumerate(batch.args())))
    _assert_same(triton_sample(*batch.args()), rejection_sample_torch(*batch.args()))


def test_triton_residual_and_rounding_fallbacks(triton_sample):
    """A draft token with q = 0 is rejected and p == q leaves no residual: resample from p. A
    uniform just below 1 takes the last token with mass, never a trailing token without."""
    p = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0, 0.0])
    batch = RejectionBatch(
        torch.tensor([2, 2]), torch.tensor([0, 1, 2]), torch.stack([p, p]),
        torch.stack([p, p, p, p]), torch.tensor([False, False]),
        torch.tensor([0.5, 0.5]), torch.tensor([0.3, 1.0 - 2.0**-24]),
    )
    expected = rejection_sample_torch(*batch.args())
    assert expected.output_token_ids[:, 0].tolist() == [1, 3]
    _assert_same(triton_sample(*batch.args()), expected)


def test_triton_rejects_missing_draft_probs(triton_sample):
    batch = rejection_batch([2, 1], [True, False], 50, seed=6)
    with pytest.raises(ValueError, match="draft_probs"):
        triton_sample(*(None if i == 2 else t for i, t in enumerate(batch.args())))


def test_dispatcher_forced_to_triton(interpreted, monkeypatch):
    monkeypatch.setenv("FASER_KERNELS", "triton")
    module = interpreted["triton_rejection"]
    monkeypatch.setitem(sys.modules, "faser_kernels.triton_rejection", module)
    batch = rejection_batch([2, 3], [False, True], 50, seed=8)
    _assert_same(rejection_sample(*batch.args()), rejection_sample_torch(*batch.args()))


@CUDA
@pytest.mark.parametrize("seed", range(4))
def test_cuda_triton_matches_twin(seed):
    from faser_kernels.triton_rejection import rejection_sample_triton

    ks = [(seed * 3 + i) % 6 for i in range(8)]
    batch = rejection_batch(ks, [i % 3 == 0 for i in range(8)], 49152, seed)
    expected = rejection_sample_torch(*batch.args())
    got = rejection_sample_triton(*batch.to("cuda").args())
    _assert_same(type(got)(*(t.cpu() for t in got)), expected)


@CUDA
def test_cuda_no_recompile_across_k():
    from faser_kernels.triton_rejection import _rejection_kernel, rejection_sample_triton

    caches = getattr(_rejection_kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton keeps its compile cache elsewhere")
    count = lambda: sum(len(entry[0]) for entry in caches.values())
    rejection_sample_triton(*rejection_batch([1], [False], 1000, 0).to("cuda").args())
    before = count()
    for seed, ks in enumerate(([0], [5, 1, 0], [16, 2], [3] * 17, [0, 0, 7])):
        greedy = [i % 2 == 0 for i in range(len(ks))]
        rejection_sample_triton(*rejection_batch(ks, greedy, 1000, seed).to("cuda").args())
    assert count() == before
