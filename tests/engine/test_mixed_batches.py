"""A greedy request's answer is its own whatever shares its steps: random batches of every kind of
valid request (sampled beside greedy, penalties, logit bias, stops, logprobs, each request its
own policy) give every greedy request the tokens, text, finish reason and logprobs of its run
alone under plain decoding, in each dtype."""

from __future__ import annotations

import random

import pytest

from faser import LLM, SamplingParams, SpecConfig
from tests.engine.test_exactness import DTYPES, _skip_without_kernels

POLICIES = [None, {"policy": "off"}, {"policy": "fixed", "max_k": 1},
            {"policy": "fixed", "max_k": 4}, {"policy": "dsd"}, {"policy": "heuristic"},
            {"policy": "faser"}]


def _params(rng: random.Random, vocab: int) -> SamplingParams:
    kw: dict = {"max_tokens": rng.choice([1, 3, 12, 24]), "ignore_eos": rng.random() < 0.7}
    if rng.random() < 0.5:
        kw["temperature"] = rng.choice([0.0, 1e-6])
    else:
        kw.update(temperature=rng.choice([0.5, 1.0, 1.5]), seed=rng.randrange(10**6),
                  top_p=rng.choice([0.3, 1.0]), top_k=rng.choice([0, 5]),
                  min_p=rng.choice([0.0, 0.1]))
    if rng.random() < 0.3:
        kw.update(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=-0.5)
    if rng.random() < 0.3:
        kw["logit_bias"] = {rng.randrange(vocab): rng.choice([-100.0, 4.0])
                            for _ in range(3)}
    if rng.random() < 0.3:
        kw["stop_token_ids"] = (rng.randrange(vocab),)
    if rng.random() < 0.3:
        kw["logprobs"] = rng.choice([0, 3])
    return SamplingParams(**kw)


def _answer(out) -> tuple:
    return out.token_ids, out.text, out.finish_reason, out.logprobs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_a_greedy_answer_is_the_same_in_any_batch(tiny_models, dtype, seed):
    _skip_without_kernels(dtype)
    llm = LLM(str(tiny_models["gqa_tied"]), draft_model=str(tiny_models["gqa_tied_draft"]),
              spec=SpecConfig(policy="faser"), dtype=dtype, num_kv_blocks=256, block_size=4)
    rng, vocab = random.Random(seed), llm.engine.target.vocab_size
    requests = [([rng.randrange(vocab) for _ in range(rng.randrange(1, 30))],
                 _params(rng, vocab), rng.choice(POLICIES)) for _ in range(16)]
    for i, (prompt, params, speculation) in enumerate(requests):
        llm.engine.add_request(str(i), prompt, params, speculation=speculation)
    done = {}
    while llm.engine.has_unfinished_requests():
        done.update({o.request_id: o for o in llm.engine.step() if o.finished})
    greedy = [i for i, (_, params, _) in enumerate(requests) if params.greedy]
    assert len(done) == len(requests) and greedy
    assert llm.engine.stats.num_accepted_tokens > 0  # speculation ran, and was right at times
    for i in greedy:
        prompt, params, _ = requests[i]
        alone = llm.generate(prompt, params, speculation={"policy": "off"})[0]
        assert _answer(done[str(i)]) == _answer(alone), f"request {i}: {params}"
