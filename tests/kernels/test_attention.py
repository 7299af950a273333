"""paged_attention: the twin against plain causal attention on contiguous K/V, the Triton kernel
against the twin over decodes, verifications (k + 1 queries), prefill chunks and their mixes."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from kernel_cases import AttentionCase, PagedBatch, paged_batch

from faser_kernels.attention import paged_attention, paged_attention_torch

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CASES = [
    AttentionCase(4, 4, 16, 4, q_lens=(1,), context_lens=(0,)),  # the very first token
    AttentionCase(4, 4, 16, 4, q_lens=(1, 1, 1), context_lens=(3, 8, 13)),  # decodes
    AttentionCase(6, 2, 32, 8, q_lens=(4, 1, 3, 5), context_lens=(9, 30, 0, 17)),  # verify, GQA
    AttentionCase(3, 1, 8, 4, q_lens=(2, 1), context_lens=(5, 6)),  # odd group, tiny head_dim
    AttentionCase(5, 5, 64, 16, q_lens=(1, 21), context_lens=(40, 7)),  # odd heads, prefill chunk
    AttentionCase(8, 2, 128, 16, q_lens=(19, 1, 4, 1), context_lens=(0, 33, 12, 2)),  # mixed
    AttentionCase(2, 1, 16, 5, q_lens=(3, 1), context_lens=(11, 4)),  # block_size not a power of 2
    AttentionCase(4, 2, 16, 4, q_lens=(40,), context_lens=(6,)),  # many query blocks
    AttentionCase(4, 2, 16, 4, q_lens=(2, 0, 3), context_lens=(3, 5, 0)),  # a request sits out
    AttentionCase(4, 2, 16, 4, q_lens=(1, 1), context_lens=(9, 9)),  # no mask, no query gather
    AttentionCase(4, 2, 16, 4, q_lens=(3, 3), context_lens=(5, 20)),  # equal q_lens, masked
    AttentionCase(4, 2, 16, 4, q_lens=(20, 1, 30, 2), context_lens=(3, 9, 0, 14)),  # 3 groups
    # short and long contexts: attended in groups of similar length
    AttentionCase(4, 2, 16, 8, q_lens=(1, 3, 1, 2, 1, 1, 40),
                  context_lens=(5, 900, 12, 700, 30, 1000, 8)),
]


def _reference(batch: PagedBatch, scale: float) -> torch.Tensor:  # [num_tokens, heads, dim]
    """Plain causal attention per request on its contiguous keys, in float64."""
    outs = []
    cu = batch.cu_seqlens_q.tolist()
    for i, (k, v) in enumerate(zip(batch.keys, batch.values, strict=True)):
        q = batch.query[cu[i] : cu[i + 1]].double()  # [q_len, heads, dim]
        group = q.shape[1] // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1)
        v = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_abs = k.shape[0] - q.shape[0] + torch.arange(q.shape[0])
        visible = torch.arange(k.shape[0])[None, :] <= q_abs[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v))
    return torch.cat(outs).to(batch.query.dtype)


def _scale(case: AttentionCase) -> float:
    return 1.0 / math.sqrt(case.head_dim)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_twin_matches_plain_causal_attention(case):
    batch = paged_batch(case, seed=0)
    out = paged_attention_torch(*batch.args(_scale(case)))
    torch.testing.assert_close(out, _reference(batch, _scale(case)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_triton_matches_twin(interpreted, case):
    paged_attention_triton = interpreted["triton_attention"].paged_attention_triton
    batch = paged_batch(case, seed=1)
    expected = paged_attention_torch(*batch.args(_scale(case)))
    out = paged_attention_triton(*batch.args(_scale(case)))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_triton_reads_a_query_slice(interpreted):
    """The query may be a view into the fused qkv projection (token stride > heads * dim)."""
    case = CASES[2]
    batch = paged_batch(case, seed=2)
    fused = torch.cat([batch.query, torch.randn_like(batch.query)], dim=1)
    query = fused[:, : case.num_heads]
    args = (query, *batch.args(_scale(case))[1:])
    out = interpreted["triton_attention"].paged_attention_triton(*args)
    torch.testing.assert_close(out, paged_attention_torch(*args), atol=1e-5, rtol=1e-5)


def test_triton_rejects_bad_gqa(interpreted):
    batch = paged_batch(AttentionCase(4, 4, 16, 4, q_lens=(1,), context_lens=(2,)), seed=3)
    query = batch.query[:, :3]  # 3 heads over 4 kv heads
    with pytest.raises(ValueError, match="num_kv_heads"):
        interpreted["triton_attention"].paged_attention_triton(query, *batch.args(1.0)[1:])


def test_dispatcher_forced_to_triton(interpreted, monkeypatch):
    monkeypatch.setenv("FASER_KERNELS", "triton")
    module = interpreted["triton_attention"]
    monkeypatch.setitem(sys.modules, "faser_kernels.triton_attention", module)
    case = CASES[1]
    batch = paged_batch(case, seed=4)
    out = paged_attention(*batch.args(_scale(case)))
    monkeypatch.setenv("FASER_KERNELS", "torch")
    expected = paged_attention(*batch.args(_scale(case)))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_cuda_triton_matches_twin(case, dtype):
    from faser_kernels.triton_attention import paged_attention_triton

    case = AttentionCase(**{**case.__dict__, "dtype": dtype})
    batch = paged_batch(case, seed=5, device="cuda")
    out = paged_attention_triton(*batch.args(_scale(case)))
    expected = _reference(batch, _scale(case))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


@CUDA
def test_cuda_no_recompile_across_decode_batches():
    from faser_kernels.triton_attention import _paged_attention_kernel, paged_attention_triton

    before = _num_compiled(_paged_attention_kernel)
    for num_seqs, context in ((1, 5), (3, 17), (8, 40), (5, 2)):
        case = AttentionCase(
            8, 2, 64, 16, (1,) * num_seqs, (context,) * num_seqs, dtype=torch.bfloat16
        )
        paged_attention_triton(*paged_batch(case, seed=num_seqs, device="cuda").args(0.125))
    assert _num_compiled(_paged_attention_kernel) - before <= 1


def _num_compiled(kernel) -> int:
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton keeps its compile cache elsewhere")
    return sum(len(entry[0]) for entry in caches.values())


def test_requests_are_split_by_context_only_where_it_saves_padding():
    from faser_kernels.attention import SPLIT_COST_POSITIONS, split_by_context

    lens = [5, 900, 12, 700, 30, 1000, 8]
    groups = split_by_context(list(range(7)), lens)
    assert sorted(i for g in groups for i in g) == list(range(7))
    assert all(g == sorted(g) for g in groups)  # each keeps the flat batch's order
    assert [0, 2, 4, 6] in groups  # the short contexts are not padded to 1000
    # similar lengths: one call, in the batch's own order
    assert split_by_context([0, 1, 2, 3], [100, 120, 90, 110]) == [[0, 1, 2, 3]]
    # a split must save more padded positions than one more call costs
    near = [10, 10 + SPLIT_COST_POSITIONS // 4, 10]
    assert split_by_context([0, 1, 2], near) == [[0, 1, 2]]
    assert split_by_context([], []) == []
