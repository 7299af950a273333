"""A feature draft (EAGLE-style, reads the target's hidden states) in the engine: greedy output
equals the target's own under every policy, chunked prefill and preemption; sampling keeps the
target's distribution; the draft never overlaps.

The draft is trained, in the fixture, on the target's own greedy continuations of TRAIN_PROMPTS
(quick on models this small): on those prompts it guesses well but not perfectly, so
steps both accept and reject."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from faser import LLM, SamplingParams, SpecConfig
from faser.distill.feature_model import build_feature_draft, export_feature_draft
from faser.distill.teacher import teacher_labels
from faser.distill.train import TrainConfig, train_draft
from tests.engine.test_sampling_distribution import (
    PARAMS,
    PROMPT,
    SAMPLED_TOKENS,
    VOCAB,
    assert_marginals_match,
)
from tests.engine.tiny import make_checkpoint
from tests.spec_decode.spec_profiles import roofline

MAX_TOKENS = 32
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _train_prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 12, (16,), generator=gen).tolist()
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


TRAIN_PROMPTS = _train_prompts(97)
PROMPTS = TRAIN_PROMPTS[:6] + [[5] * 20, list(range(30, 70))]  # two it never saw


def make_feature_draft(target: Path, out: Path, prompts, max_tokens: int, epochs: int) -> Path:
    """A feature draft reading the target's last two layers, trained on its continuations."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target).eval()
    layers = (1, hf.config.num_hidden_layers)
    plain = LLM(str(target), num_kv_blocks=96, block_size=4, dtype="float32")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    records = [{"prompt_ids": p, "response_ids": o.token_ids}
               for p, o in zip(prompts, plain.generate(prompts, params), strict=True)]
    labels = teacher_labels(hf, records, 4, out.parent / f"{out.name}-labels.pt",
                            feature_layers=layers)
    token_map = torch.arange(hf.config.vocab_size)
    draft = build_feature_draft(hf, layers, [hf.config.num_hidden_layers - 1], token_map)
    config = TrainConfig(epochs=epochs, lr=3e-3, warmup_steps=5, batch_tokens=512)
    train_draft(draft, labels, labels[:2], token_map, config, lambda summary: None)
    export_feature_draft(draft, token_map, out, {"test": True}, dtype=torch.float32)
    return out


@pytest.fixture(scope="module")
def feature_pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("feature")
    target = make_checkpoint(root / "target", "gqa_tied")
    return target, make_feature_draft(target, root / "draft", TRAIN_PROMPTS, 40, epochs=60)


@pytest.fixture(scope="module")
def plain_greedy(feature_pair) -> list[list[int]]:
    llm = LLM(str(feature_pair[0]), num_kv_blocks=96, block_size=4, dtype="float32")
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def run(pair, policy: str, **kwargs) -> tuple[LLM, list[list[int]]]:
    target, draft = pair
    llm = LLM(str(target), draft_model=str(draft), spec=SpecConfig(
        policy=policy, frontier_size=kwargs.pop("frontier_size", None)),
        num_kv_blocks=kwargs.pop("num_kv_blocks", 96), block_size=4, **kwargs, dtype="float32")
    llm.engine.speculator.use_cost_profile(roofline())  # so that faser speculates on tiny models
    outputs = llm.generate(PROMPTS, GREEDY)
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks  # nothing leaked
    return llm, [o.token_ids for o in outputs]


@pytest.mark.parametrize("policy", ["fixed:1", "fixed:4", "heuristic", "faser",
                                    "faser-noprune", "dsd"])
def test_greedy_output_equals_the_targets(feature_pair, plain_greedy, policy):
    llm, outputs = run(feature_pair, policy)
    assert outputs == plain_greedy
    stats = llm.engine.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_it_reads_the_targets_features(feature_pair):
    """On its training prompts, with the target's features at every committed position, its
    first guess is almost always right; the same weights reading zeros instead are not."""

    def acceptance(zeros: bool) -> float:
        target, draft = feature_pair
        llm = LLM(str(target), draft_model=str(draft), spec=SpecConfig(policy="fixed:1"),
                  num_kv_blocks=96, block_size=4, dtype="float32")
        engine = llm.engine
        assert engine.target.feature_layers == (1, 2)
        assert engine.draft.feature_cache is engine.target.feature_cache
        if zeros:  # a cache of its own, which no target forward writes
            engine.draft.read_features(torch.zeros_like(engine.target.feature_cache))
        llm.generate(TRAIN_PROMPTS[:6], GREEDY)
        assert engine.speculator.overlap is None  # its next guess needs the target's features
        return engine.stats.num_accepted_tokens / engine.stats.num_draft_tokens

    with_features = acceptance(zeros=False)
    assert with_features >= 0.8
    assert acceptance(zeros=True) < with_features - 0.3


def test_prompts_read_from_the_prefix_cache_keep_output_and_guesses(feature_pair, plain_greedy):
    """Run again, the prompts' full blocks come from the cache, with the draft's half the first
    run filled from the target's features and the feature it reads on from: no token changes
    and the draft guesses as well (reading a zero feature there instead cost 0.05)."""
    llm, first = run(feature_pair, "fixed:1")
    stats = llm.engine.stats
    accepted, drafted = stats.num_accepted_tokens, stats.num_draft_tokens
    again = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in again] == first == plain_greedy
    # every full block but one holding a prompt's last token, whose logits the request needs
    assert [o.num_cached_tokens for o in again] == [(len(p) - 1) // 4 * 4 for p in PROMPTS]
    rate = (stats.num_accepted_tokens - accepted) / (stats.num_draft_tokens - drafted)
    assert rate == pytest.approx(accepted / drafted, abs=0.02)


def test_frontiers_chunked_prefill_and_preemption(feature_pair, plain_greedy):
    llm, outputs = run(feature_pair, "fixed:4", frontier_size=2, num_kv_blocks=28,
                       max_num_batched_tokens=8, max_num_seqs=4)
    assert outputs == plain_greedy
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.stats.num_pruned_positions > 0


def test_sampling_keeps_the_target_distribution(tmp_path_factory):
    root = tmp_path_factory.mktemp("feature-stat")
    target = make_checkpoint(root / "t", "gqa_tied", vocab_size=VOCAB, seed=3)
    prompts = [PROMPT + [a] for a in range(VOCAB)]
    draft = make_feature_draft(target, root / "d", prompts, 4, epochs=5)
    llm = LLM(str(target), draft_model=str(draft), spec=SpecConfig(policy="fixed:3"),
              num_kv_blocks=4096, block_size=4, max_num_seqs=128, max_num_batched_tokens=1024,
              dtype="float32")
    params = [SamplingParams(max_tokens=SAMPLED_TOKENS, seed=i, ignore_eos=True, **PARAMS)
              for i in range(1200)]
    outputs = llm.generate([PROMPT] * 1200, params)
    assert_marginals_match(outputs, target)
    stats = llm.engine.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def _written(engine, seq) -> torch.Tensor:
    """Whether each position the target has run for `seq`, but its newest, has a feature row."""
    size, cache = engine.config.block_size, engine.target.feature_cache
    slots = [seq.block_table[p // size] * size + p % size for p in range(seq.num_tokens - 1)]
    return cache[slots].abs().sum(dim=1) > 0


def test_steps_of_requests_that_never_speculate_compute_no_features(feature_pair, plain_greedy):
    """Per-request "off" in an engine with a feature draft: same output; a step of such requests
    alone does not stop at the target's feature layers, and a request that drafts has every row
    written while it runs beside one."""
    target, draft = feature_pair
    llm = LLM(str(target), draft_model=str(draft), spec=SpecConfig(policy="fixed:2"),
              num_kv_blocks=96, block_size=4, dtype="float32")
    engine = llm.engine
    off = {"policy": "off"}
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], GREEDY, speculation=off)] \
        == plain_greedy[:2]
    assert not engine.target.feature_cache.any()
    for i, prompt in enumerate(PROMPTS[2:4]):  # not in the prefix cache
        engine.add_request(f"r{i}", prompt, GREEDY, speculation=off if i == 0 else None)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out.token_ids
        drafting = [s for s in engine.scheduler.running if s.request_id == "r1"]
        assert all(_written(engine, seq).all() for seq in drafting)
    assert [outputs["r0"], outputs["r1"]] == plain_greedy[2:4]
    assert engine.stats.num_draft_tokens > 0


def test_requests_keep_their_features_while_faser_is_off(feature_pair, plain_greedy):
    """With one slot, the second request queues while the first decodes, so faser plans no
    drafting (a queue means the replica is busy) in those steps; every position the target ran,
    prompt and decoded tokens alike, has its row all the same, which the draft reads once it
    drafts again. Output stays the target's."""
    target, draft = feature_pair
    llm = LLM(str(target), draft_model=str(draft), spec=SpecConfig(policy="faser"),
              num_kv_blocks=96, block_size=4, dtype="float32", max_num_seqs=1)
    engine = llm.engine
    engine.speculator.use_cost_profile(roofline())
    for i, prompt in enumerate(PROMPTS[:2]):
        engine.add_request(f"r{i}", prompt, GREEDY)
    off_steps = 0
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out.token_ids
        if engine.speculator.mode != "off":
            continue
        for seq in engine.scheduler.running:
            off_steps += 1
            assert _written(engine, seq).all()  # no position reads as zeros
    assert [outputs["r0"], outputs["r1"]] == plain_greedy[:2]
    assert off_steps > 0


def test_a_prefix_computed_without_features_is_computed_again_to_draft(feature_pair,
                                                                      plain_greedy):
    """Policy `off`'s requests alone leave a prompt's blocks without the target's features. A
    request that drafts does not share them (its draft would read other positions' rows there)
    but computes them again, and its blocks then take the cache's place: the next drafting
    request shares them and guesses as well as the first. An `off` request shares either.
    Output is the target's throughout."""
    target, draft = feature_pair
    llm = LLM(str(target), draft_model=str(draft), spec=SpecConfig(policy="fixed:1"),
              num_kv_blocks=96, block_size=4, dtype="float32")
    stats, prompt, expected = llm.engine.stats, PROMPTS[0], plain_greedy[0]
    full = (len(prompt) - 1) // 4 * 4  # every full block but one holding the last token

    def once(speculation=None) -> tuple[int, float]:
        accepted, drafted = stats.num_accepted_tokens, stats.num_draft_tokens
        out = llm.generate([prompt], GREEDY, speculation=speculation)[0]
        assert out.token_ids == expected
        rate = (stats.num_accepted_tokens - accepted) / max(1, stats.num_draft_tokens - drafted)
        return out.num_cached_tokens, rate

    assert once({"policy": "off"})[0] == 0
    assert not llm.engine.target.feature_cache.any()
    cached, first_rate = once()
    assert cached == 0 and first_rate > 0.5
    cached, rate = once()
    assert cached == full and rate == pytest.approx(first_rate, abs=0.05)
    assert once({"policy": "off"})[0] == full
