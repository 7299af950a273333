"""Logprobs, penalties and logit bias stay exact under speculation: in each dtype, every
policy's greedy tokens, penalised, biased or neither, and their logprobs (and the prompt's)
equal plain decoding's bit for bit; the logprobs are the target's own log-softmax (Hugging
Face's, in float32); repetition penalty greedy output equals Hugging Face's generate with the
same penalty, and the other penalties and the bias a plain loop over Hugging Face's logits."""

from __future__ import annotations

import pytest
import torch

from faser import LLM, SamplingParams, SpecConfig
from faser.layers.sampler import (
    History,
    apply_penalties,
    logits_to_probs,
    request_probs,
    token_counts,
    token_logprobs,
)
from tests.engine.test_exactness import _skip_without_kernels
from tests.engine.test_greedy_equality import ALL_POLICIES

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 40)), [60] * 9]
MAX_TOKENS = 16
LOGPROBS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=3,
                          prompt_logprobs=2)
PENALISED = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1,
                           repetition_penalty=1.4, frequency_penalty=0.6, presence_penalty=0.4)
BIAS = {5: 3.0, 17: 2.5, 23: -100.0, 40: 1.5}
BIASED = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1,
                        logit_bias=BIAS)
DTYPES = ["bfloat16", "float32"]


def _generate(models, policy: str, dtype: str):
    llm = LLM(str(models["gqa_tied"]), draft_model=str(models["gqa_tied_draft"]),
              spec=SpecConfig(policy=policy), dtype=dtype, num_kv_blocks=128, block_size=4)
    params = [LOGPROBS] * len(PROMPTS) + [PENALISED] * len(PROMPTS) + [BIASED] * len(PROMPTS)
    outputs = llm.generate(PROMPTS * 3, params)
    return [(o.token_ids, o.logprobs, o.prompt_logprobs) for o in outputs], llm.engine.stats


@pytest.fixture(scope="module")
def plain(tiny_models):
    return {dtype: _generate(tiny_models, "off", dtype)[0] for dtype in DTYPES}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("policy", [p for p in ALL_POLICIES if p != "off"])
def test_logprobs_and_penalties_equal_plain_decoding_bit_for_bit(tiny_models, plain, dtype,
                                                                 policy):
    _skip_without_kernels(dtype)
    outputs, stats = _generate(tiny_models, policy, dtype)
    assert outputs == plain[dtype]
    if policy.startswith("fixed"):
        assert stats.num_accepted_tokens > 0


def test_penalties_and_bias_change_the_greedy_output(plain):
    tokens = [t for t, _, _ in plain["float32"]]
    n = len(PROMPTS)
    assert tokens[:n] != tokens[n : 2 * n] and tokens[:n] != tokens[2 * n :]


def test_logprobs_are_the_targets_log_softmax(tiny_models, plain):
    """Each output and prompt token's logprob and top alternatives, against Hugging Face's own
    float32 forward over the whole sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["gqa_tied"])
    for prompt, (tokens, logprobs, prompt_logprobs) in zip(PROMPTS, plain["float32"],
                                                            strict=False):
        sequence = prompt + tokens
        with torch.no_grad():
            expected = model(torch.tensor([sequence])).logits[0].float().log_softmax(-1)
        assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(prompt)
        scored = [*prompt_logprobs[1:], *logprobs]  # position p is scored by row p - 1
        assert [lp.token_id for lp in scored] == sequence[1:]
        for p, lp in enumerate(scored, start=1):
            row = expected[p - 1]
            assert lp.logprob == pytest.approx(float(row[sequence[p]]), abs=1e-4)
            top = row.topk(len(lp.top))
            assert [t for t, _ in lp.top] == top.indices.tolist()
            assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert all(len(lp.top) == 3 for lp in logprobs)
        assert all(len(lp.top) == 2 for lp in prompt_logprobs[1:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_prompt_token_is_scored_as_when_it_was_generated(tiny_models, plain, dtype):
    """Prompt logprobs come from a prefill chunk's rows, output logprobs from decode and
    verification rows: the same bits for the same context."""
    _skip_without_kernels(dtype)
    llm = LLM(str(tiny_models["gqa_tied"]), dtype=dtype, num_kv_blocks=128, block_size=4,
              max_num_seqs=4, max_num_batched_tokens=16)  # long prompts: several chunks
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=3)
    outputs = plain[dtype][: len(PROMPTS)]
    echoed = llm.generate([p + t for p, (t, _, _) in zip(PROMPTS, outputs, strict=True)], params)
    for prompt, (_, logprobs, _), again in zip(PROMPTS, outputs, echoed, strict=True):
        rescored = again.prompt_logprobs[len(prompt):]
        assert [(lp.token_id, lp.logprob) for lp in rescored] == [
            (lp.token_id, lp.logprob) for lp in logprobs]
        assert [lp.top for lp in rescored] == [lp.top[:3] for lp in logprobs]


def test_repetition_penalty_matches_hf_generate(tiny_models, hf_greedy):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["gqa_tied"])
    llm = LLM(str(tiny_models["gqa_tied"]), draft_model=str(tiny_models["gqa_tied_draft"]),
              spec=SpecConfig(policy="fixed:3"), dtype="float32", num_kv_blocks=128,
              block_size=4)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                            repetition_penalty=1.5)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True):
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS,
                            min_new_tokens=MAX_TOKENS, do_sample=False, repetition_penalty=1.5)
        assert out.token_ids == hf[0, len(prompt):].tolist()
        assert out.token_ids != hf_greedy("gqa_tied", prompt, MAX_TOKENS)


def test_frequency_and_presence_penalties_match_a_plain_loop(tiny_models):
    """OpenAI's definition, written out: logit - frequency * count - presence * (count > 0)
    over the output so far, then the argmax; against Hugging Face's float32 forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["gqa_tied"])
    llm = LLM(str(tiny_models["gqa_tied"]), draft_model=str(tiny_models["gqa_tied_draft"]),
              spec=SpecConfig(policy="fixed:4"), dtype="float32", num_kv_blocks=128,
              block_size=4)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                            frequency_penalty=1.1, presence_penalty=0.7)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True):
        tokens: list[int] = []
        for _ in range(MAX_TOKENS):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + tokens])).logits[0, -1].float()
            for token in set(tokens):
                logits[token] -= 1.1 * tokens.count(token) + 0.7
            tokens.append(int(logits.argmax()))
        assert out.token_ids == tokens


def test_logit_bias_matches_a_plain_loop(tiny_models):
    """OpenAI's definition, written out: the bias added to the logits, then the argmax (a bias
    of -100 bans its token); against Hugging Face's float32 forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["gqa_tied"])
    llm = LLM(str(tiny_models["gqa_tied"]), draft_model=str(tiny_models["gqa_tied_draft"]),
              spec=SpecConfig(policy="fixed:4"), dtype="float32", num_kv_blocks=128,
              block_size=4)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, BIASED), strict=True):
        tokens: list[int] = []
        for _ in range(MAX_TOKENS):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + tokens])).logits[0, -1].float()
            for token, bias in BIAS.items():
                logits[token] += bias
            tokens.append(int(logits.argmax()))
        assert out.token_ids == tokens and 23 not in tokens


def test_logit_bias_is_checked_against_the_vocabulary(tiny_models):
    llm = LLM(str(tiny_models["gqa_tied"]), dtype="float32", num_kv_blocks=32)
    vocab = llm.engine.pair.target.config.vocab_size
    with pytest.raises(ValueError, match="logit_bias: token ids must lie in"):
        llm.generate([[1, 2]], SamplingParams(logit_bias={vocab: 1.0}))
    for bad in ({-1: 1.0}, {1: 100.5}, {1: float("nan")}, {"1": 1.0}):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)


# -- the logits processing on its own -------------------------------------------------------


def test_apply_penalties_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    prompt = torch.tensor([[True, True, False, False]])
    counts = torch.tensor([[0.0, 0.0, 2.0, 0.0]])
    one = torch.ones(1)
    rep = apply_penalties(logits, prompt, counts, 2 * one, 0 * one, 0 * one)
    assert rep.tolist() == [[1.0, -2.0, 0.25, 3.0]]  # seen: / 2 if > 0, * 2 if not
    freq = apply_penalties(logits, prompt, counts, one, 0.5 * one, 0 * one)
    assert freq.tolist() == [[2.0, -1.0, -0.5, 3.0]]  # output only: 0.5 - 0.5 * 2
    presence = apply_penalties(logits, prompt, counts, one, 0 * one, -1.0 * one)
    assert presence.tolist() == [[2.0, -1.0, 1.5, 3.0]]  # a negative penalty encourages
    off = apply_penalties(logits, prompt, counts, one, 0 * one, 0 * one)
    assert torch.equal(off, logits)


def test_min_p_drops_tokens_below_a_share_of_the_likeliest():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    one = torch.ones(1)
    probs = logits_to_probs(logits, one, torch.zeros(1, dtype=torch.long), one,
                            torch.tensor([0.4]))  # keeps p >= 0.2
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    # min_p 1 leaves the likeliest alone; 0 changes nothing
    alone = logits_to_probs(logits, one, torch.zeros(1, dtype=torch.long), one, one)
    assert alone.tolist() == [[1.0, 0.0, 0.0, 0.0]]
    same = logits_to_probs(logits, one, torch.zeros(1, dtype=torch.long), one, 0 * one)
    torch.testing.assert_close(same, torch.tensor([[0.5, 0.3, 0.15, 0.05]]))


def test_request_probs_penalise_each_row_by_its_own_history():
    """Rows of one request in a verification differ only by the drafts before them; greedy rows
    stay logits, penalised; unpenalised rows are left alone and need no history."""
    logits = torch.zeros(3, 5)
    greedy = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    sampled = SamplingParams(temperature=1.0, presence_penalty=2.0, min_p=0.5)
    plain = SamplingParams(temperature=0.0)
    rows = request_probs(logits, [greedy, sampled, plain],
                         [History([0], [1, 1]), History([0], [2]), None])
    assert rows[0].tolist() == [0.0, -2.0, 0.0, 0.0, 0.0]
    assert rows[1].tolist() == [0.25, 0.25, 0.0, 0.25, 0.25]  # token 2 dropped by min_p
    assert rows[2].tolist() == [0.0] * 5
    with pytest.raises(ValueError, match="history"):
        request_probs(logits[:1], [greedy])


def test_token_counts_and_logprobs():
    counts = token_counts([[1, 1, 3], []], 4)
    assert counts.tolist() == [[0, 2, 0, 1], [0, 0, 0, 0]]
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]])
    scored = token_logprobs(logits, [0, 0], [2, 0])
    expected = logits.log_softmax(-1)
    assert scored[0].logprob == float(expected[0, 0])
    assert [t for t, _ in scored[0].top] == [2, 1] and scored[1].top == ()


def test_request_probs_add_each_rows_own_bias_first():
    logits = torch.tensor([[1.0, 2.0, 0.5], [1.0, 2.0, 0.5]])
    biased = SamplingParams(temperature=0.5, logit_bias={0: 2.0, 1: -100.0})
    greedy = SamplingParams(temperature=0.0, logit_bias={2: 1.0})
    probs = request_probs(logits, [biased, greedy])
    torch.testing.assert_close(probs[0], (torch.tensor([3.0, -98.0, 0.5]) / 0.5).softmax(-1))
    assert probs[1].tolist() == [1.0, 2.0, 1.5]  # a greedy row stays logits, biased
    assert logits.tolist() == [[1.0, 2.0, 0.5], [1.0, 2.0, 0.5]]  # the raw logits untouched


def test_a_reduced_vocabulary_draft_biases_in_the_targets_ids():
    from faser.spec_decode.proposer import Proposer

    proposer = Proposer.__new__(Proposer)
    proposer.token_map, proposer.target_vocab_size = torch.tensor([1, 3, 4]), 5
    logits = torch.tensor([[1.0, 2.0, 0.5]])  # [rows, draft vocab]
    greedy = SamplingParams(temperature=0.0, logit_bias={4: 2.0, 0: 5.0})
    rows, _ = proposer._request_rows(logits, [greedy], [None])
    inf = float("-inf")
    assert rows[0].tolist() == [inf, 1.0, inf, 2.0, 2.5]  # target id 4 is biased; 0 stays out
    tokens, _, _ = proposer._picks([_Seq(greedy)], logits, [None], [0])
    assert tokens == [4]


class _Seq:
    def __init__(self, params: SamplingParams) -> None:
        self.params = params


def test_a_reduced_vocabulary_draft_penalises_in_the_targets_ids():
    """A draft whose output covers some target tokens (token_map): its rows are moved to the
    target's vocabulary before the penalties, whose histories hold target ids."""
    from faser.spec_decode.proposer import Proposer

    proposer = Proposer.__new__(Proposer)  # the row processing alone, no draft model
    proposer.token_map, proposer.target_vocab_size = torch.tensor([1, 3, 4]), 5
    logits = torch.tensor([[1.0, 2.0, 0.5], [1.0, 2.0, 0.5]])  # [rows, draft vocab]
    greedy = SamplingParams(temperature=0.0, presence_penalty=2.0)
    sampled = SamplingParams(temperature=1.0, frequency_penalty=1.0)
    rows, confidence = proposer._request_rows(
        logits, [greedy, sampled], [History([], [3]), History([], [3, 3])])
    inf = float("-inf")
    assert rows[0].tolist() == [inf, 1.0, inf, 0.0, 0.5]  # target id 3 is penalised
    expected = torch.tensor([inf, 1.0, inf, 0.0, 0.5]).softmax(-1)
    torch.testing.assert_close(rows[1], expected)
    assert confidence.shape == (2, 5) and float(confidence[1].sum()) == pytest.approx(1.0)
