"""The row-invariant CPU attention kernel against its twin (paged_attention_torch) over decodes,
verifications, prefill chunks and their mixes, and its defining property: a query gets the bits
it gets alone, whatever else shares the batch and however many queries its request has."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from kernel_cases import AttentionCase, paged_batch
from test_attention import CASES

from faser_kernels.attention import paged_attention_torch
from faser_kernels.cpu_attention import paged_attention_cpu, unavailable_reason

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(params=DTYPES, ids=str)
def dtype(request) -> torch.dtype:
    if (reason := unavailable_reason(request.param, 64)) is not None:
        pytest.skip(reason)
    return request.param


@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_kernel_equals_its_twin_to_rounding(case, dtype):
    case = dataclasses.replace(case, dtype=dtype)
    batch = paged_batch(case, seed=1)
    scale = 1 / math.sqrt(case.head_dim)
    out = paged_attention_cpu(*batch.args(scale))
    twin = paged_attention_torch(*(t.float() if t.is_floating_point() else t
                                   for t in batch.args(scale)[:-1]), scale)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), twin, atol=tolerance, rtol=tolerance)


def test_a_verification_query_has_the_bits_of_a_decode_at_its_position(dtype):
    """The same request's cache: 5 queries verified at once, then each as a decode alone with
    the keys up to it, then beside other requests."""
    case = AttentionCase(9, 3, 64, 16, q_lens=(5, 1, 30), context_lens=(40, 77, 3), dtype=dtype)
    batch = paged_batch(case, seed=2)
    scale = 0.125
    together = paged_attention_cpu(*batch.args(scale))
    for i in range(5):
        alone = paged_attention_cpu(
            batch.query[i : i + 1], batch.key_cache, batch.value_cache, batch.block_tables[:1],
            torch.tensor([41 + i], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
            scale,
        )
        assert torch.equal(alone[0], together[i]), i


def test_a_prefill_query_has_the_bits_of_a_decode_at_its_position(dtype):
    """A chunk of 21 queries spans several of the kernel's tiles; each query, wherever its tile
    begins, gets what it gets as a decode alone."""
    case = AttentionCase(9, 3, 64, 4, q_lens=(21,), context_lens=(6,), dtype=dtype)
    batch = paged_batch(case, seed=4)
    together = paged_attention_cpu(*batch.args(0.125))
    for i in range(21):
        alone = paged_attention_cpu(
            batch.query[i : i + 1], batch.key_cache, batch.value_cache, batch.block_tables,
            torch.tensor([7 + i], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
            0.125,
        )
        assert torch.equal(alone[0], together[i]), i


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(10, 2, 64), (14, 2, 128)])
def test_a_tile_of_query_heads_that_does_not_fill_its_rows(dtype, num_heads, num_kv_heads,
                                                           head_dim):
    """5 and 7 query heads per kv head: on AMX a tile holds 9 or 6 queries, 45 or 42 of its 48
    rows; the rows past them must not spill into the tile's sums."""
    case = AttentionCase(num_heads, num_kv_heads, head_dim, 16, q_lens=(40, 1),
                         context_lens=(30, 70), dtype=dtype)
    batch = paged_batch(case, seed=5)
    scale = 1 / math.sqrt(head_dim)
    out = paged_attention_cpu(*batch.args(scale))
    twin = paged_attention_torch(*(t.float() if t.is_floating_point() else t
                                   for t in batch.args(scale)[:-1]), scale)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), twin, atol=tolerance, rtol=tolerance)
    for i in (0, 8, 9, 39):  # a tile's first and last queries
        alone = paged_attention_cpu(
            batch.query[i : i + 1], batch.key_cache, batch.value_cache, batch.block_tables[:1],
            torch.tensor([31 + i], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
            scale,
        )
        assert torch.equal(alone[0], out[i]), i


# alone, a request's kv heads go to the threads one by one; in a batch of four or more tiles,
# each work item takes a run of them (at most 8: the 10 kv heads go in a run of 8 and one of 2;
# the AVX2 build runs only a request's last tile (8 queries at most), and all its kv heads up
# to 8)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 64), (10, 10, 16)])
def test_a_query_ignores_the_batch_beside_it(dtype, num_heads, num_kv_heads, head_dim):
    case = AttentionCase(num_heads, num_kv_heads, head_dim, 8, q_lens=(1, 3, 12, 1),
                         context_lens=(20, 9, 0, 150), dtype=dtype)
    batch = paged_batch(case, seed=3)
    together = paged_attention_cpu(*batch.args(0.125))
    cu = batch.cu_seqlens_q.tolist()
    for s in range(4):
        rows = slice(cu[s], cu[s + 1])
        alone = paged_attention_cpu(
            batch.query[rows], batch.key_cache, batch.value_cache, batch.block_tables[s : s + 1],
            batch.seq_lens[s : s + 1], torch.tensor([0, cu[s + 1] - cu[s]], dtype=torch.int32),
            0.125,
        )
        assert torch.equal(alone, together[rows]), s


def test_a_head_too_wide_is_refused():
    assert "head_dim" in unavailable_reason(torch.float32, 512)
