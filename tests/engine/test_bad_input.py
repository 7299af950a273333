"""Bad input gets a ValueError naming what is wrong, and never harms the other requests."""

from __future__ import annotations

import json

import pytest

from faser import LLM, SamplingParams, SpecConfig
from tests.engine.tiny import make_checkpoint, write_nan

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["gqa_tied"]), draft_model=str(tiny_models["gqa_tied_draft"]),
               spec=SpecConfig(policy="fixed:3"), num_kv_blocks=64, block_size=4, dtype="float32")


@pytest.mark.parametrize("kwargs,field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 10**30}, "top_k"),  # once failed the step of every request beside it
    ({"repetition_penalty": 1e-300}, "repetition_penalty"),  # made logits inf, then NaN
    ({"logit_bias": {1: 101.0}}, "logit_bias"),
])
def test_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompt,message", [
    ([], "prompt must not be empty"),
    ([1, 2, 10_000], "prompt token ids"),
    (list(range(1, 90)) * 3, "max_model_len"),
    ("text but no tokenizer", "tokenizer"),
])
def test_bad_prompts(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request(None, prompt, GREEDY)


def test_max_tokens_past_the_context(llm):
    with pytest.raises(ValueError, match="max_tokens"):
        llm.engine.add_request(None, [1, 2, 3], SamplingParams(max_tokens=10_000))


@pytest.mark.parametrize("spec,field", [
    ({"policy": "nope"}, "policy"),
    ({"max_k": 99}, "num_speculative_tokens"),
    ({"k": 2}, "unknown fields"),
])
def test_bad_speculation_overrides(llm, spec, field):
    with pytest.raises(ValueError, match=field):
        llm.engine.add_request(None, [1, 2, 3], GREEDY, speculation=spec)


def test_one_bad_request_does_not_take_down_the_batch(llm, hf_greedy):
    good = [[1, 2, 3, 4, 5], [7, 8, 9]]
    with pytest.raises(ValueError):
        llm.generate([good[0], [], good[1]], GREEDY)  # all or nothing, and nothing left behind
    assert not llm.engine.has_unfinished_requests()
    outputs = llm.generate(good, GREEDY)
    assert [o.token_ids for o in outputs] == [hf_greedy("gqa_tied", p, 8) for p in good]
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def test_draft_with_another_vocabulary_is_refused(tiny_models, tmp_path):
    other = make_checkpoint(tmp_path / "other", "draft", vocab_size=50)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(str(tiny_models["gqa_tied"]), draft_model=str(other), num_kv_blocks=16, dtype="float32")


def test_a_checkpoint_holding_a_nan_is_refused(tiny_models, tmp_path):
    """Named at load, not served: a NaN in a row of the head would change which token wins."""
    damaged = write_nan(make_checkpoint(tmp_path / "nan", "mha_untied"), 7)
    with pytest.raises(ValueError, match="embed_tokens.weight' holds NaN"):
        LLM(str(damaged), num_kv_blocks=16, dtype="float32")


def test_unsupported_architecture_is_refused(tiny_models, tmp_path):
    bad = tmp_path / "gpt2"
    bad.mkdir()
    config = json.loads((tiny_models["gqa_tied"] / "config.json").read_text())
    config["model_type"] = "gpt2"
    config["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(str(bad), num_kv_blocks=16, dtype="float32")


def test_a_temperature_too_small_to_divide_by_samples_greedily(llm, hf_greedy):
    """1e-40 is 0 as a float32 whose denormals flush, so logits over it were inf and the
    distribution NaN, which no sampler can draw from: such a request once failed its step, and
    every request in it."""
    tiny = SamplingParams(max_tokens=8, temperature=1e-40, seed=3, ignore_eos=True)
    assert tiny.greedy
    prompt = [1, 2, 3, 4, 5]
    assert llm.generate([prompt], tiny)[0].token_ids == hf_greedy("gqa_tied", prompt, 8)


def test_a_failed_step_leaves_no_request_behind(llm, hf_greedy):
    """A row whose distribution is NaN (here a repetition penalty past its bounds, set behind
    validation's back, as a model's own NaN would make it) fails its step; the call raises and
    takes its requests with it, so the next call runs as if nothing had happened (it used to
    step the failed requests forever)."""
    broken = SamplingParams(max_tokens=8, temperature=1.0)  # unseeded: drawn by inverse CDF
    object.__setattr__(broken, "repetition_penalty", 1e-300)
    prompt = [1, 2, 3, 4, 5]
    with pytest.raises((IndexError, RuntimeError)):  # the sampler finds no token with mass
        llm.generate([prompt, [7, 8, 9]], [broken, GREEDY])
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks
    assert llm.generate([prompt], GREEDY)[0].token_ids == hf_greedy("gqa_tied", prompt, 8)
