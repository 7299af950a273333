"""Lossless by construction: in each dtype, every policy's greedy tokens equal plain decoding's in
that dtype, bit for bit, and a request decodes the same alone or beside others. This holds because
every op on the step's path gives a row the same bits however many rows share the call (the
packed linear layers and the CPU attention kernel); where those kernels cannot run, the engine
says so at start-up and these tests skip."""

from __future__ import annotations

import logging

import pytest

from faser import LLM, SamplingParams, SpecConfig
from faser.runner.weights import packed_reason
from faser_kernels.cpu_attention import unavailable_reason
from tests.engine.test_greedy_equality import ALL_POLICIES

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 50)), [60] * 17, [3, 1, 4, 1, 5, 9, 2, 6]]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
DTYPES = ["bfloat16", "float32"]


def _skip_without_kernels(dtype: str) -> None:
    import torch

    reason = packed_reason("cpu", dtype) or unavailable_reason(getattr(torch, dtype), 16)
    if reason is not None:
        pytest.skip(f"no row-invariant kernels here: {reason}")


def _generate(models, policy: str, dtype: str, prompts=PROMPTS) -> list[list[int]]:
    llm = LLM(
        str(models["gqa_tied"]), draft_model=str(models["gqa_tied_draft"]),
        spec=SpecConfig(policy=policy), dtype=dtype, num_kv_blocks=128, block_size=4,
    )
    return [out.token_ids for out in llm.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def plain(tiny_models) -> dict[str, list[list[int]]]:
    return {dtype: _generate(tiny_models, "off", dtype) for dtype in DTYPES}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("policy", [p for p in ALL_POLICIES if p != "off"])
def test_every_policy_equals_plain_decoding_bit_for_bit(tiny_models, plain, dtype, policy):
    _skip_without_kernels(dtype)
    assert _generate(tiny_models, policy, dtype) == plain[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_request_decodes_the_same_alone_and_in_a_batch(tiny_models, plain, dtype):
    _skip_without_kernels(dtype)
    alone = [_generate(tiny_models, "off", dtype, [p])[0] for p in PROMPTS[:3]]
    assert alone == plain[dtype][:3]


def test_the_engine_warns_where_speculation_is_not_exact_by_construction(tiny_models, caplog):
    with caplog.at_level(logging.WARNING, logger="faser.engine.llm_engine"):
        LLM(str(tiny_models["gqa_tied"]), draft_model=str(tiny_models["gqa_tied_draft"]),
            weight_format="dense", num_kv_blocks=16, block_size=4)
    assert "not row-invariant" in caplog.text


def test_a_bf16_target_rescores_its_leading_logits_in_float32(tiny_models):
    """The bf16 head picks the candidates; their logits are the checkpoint's float32 products."""
    import torch

    from faser.models.llama import RESCORED

    path = str(tiny_models["gqa_tied"])
    target = LLM(path, dtype="bfloat16", num_kv_blocks=16, block_size=4).engine.pair.target
    reference = LLM(path, dtype="float32", num_kv_blocks=16, block_size=4).engine.pair.target
    assert target.head_float32.dtype == torch.float32
    assert reference.head_float32 is None  # a float32 model needs no rescoring
    hidden = torch.randn(5, target.config.hidden_size, generator=torch.Generator().manual_seed(0))
    logits = target.compute_logits(hidden)
    # the candidates the bf16 head picked, on equal logits the lower index (a rescored one may
    # fall behind an unpicked one)
    bf16 = target.lm_head(hidden.bfloat16()).float()
    top = torch.sort(bf16, dim=-1, descending=True, stable=True).indices[:, :RESCORED]
    exact = hidden @ reference.embed_tokens.weight.T
    torch.testing.assert_close(logits.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-5)
