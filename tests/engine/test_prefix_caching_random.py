"""Prefix caching against no cache on random traffic: conversations that share system prompts and
send their answers back, mixed policies per request, a KV pool small enough to preempt and evict,
and a token budget that chunks prompts. Every greedy output must equal the uncached engine's."""

from __future__ import annotations

import random

from faser import LLM, SamplingParams, SpecConfig

POLICIES = [{"policy": "off"}, {"policy": "fixed", "max_k": 1}, {"policy": "fixed", "max_k": 3},
            {"policy": "faser"}]


def engine(models, prefix_caching: bool) -> LLM:
    return LLM(str(models["gqa_tied"]), draft_model=str(models["gqa_tied_draft"]),
               spec=SpecConfig(policy="faser"), num_kv_blocks=28, block_size=4, dtype="float32",
               max_num_batched_tokens=24, max_num_seqs=4, prefix_caching=prefix_caching)


def rounds(seed: int) -> list[list[tuple[list[int], int, dict]]]:
    """Rounds of (prompt, max_tokens, speculation); a conversation's later prompts hold its
    earlier ones (filled in with the answers while running)."""
    rng = random.Random(seed)

    def tokens(lo: int, hi: int) -> list[int]:
        return [rng.randrange(5, 90) for _ in range(rng.randrange(lo, hi))]

    systems = [tokens(3, 30) for _ in range(3)]
    out = []
    for _ in range(4):
        batch = []
        for _ in range(rng.randrange(2, 7)):
            prompt = rng.choice(systems) + tokens(1, 9)
            batch.append((prompt, rng.randrange(1, 24), rng.choice(POLICIES)))
        out.append(batch)
    return out


def run(llm: LLM, seed: int) -> tuple[list[list[int]], int]:
    """Every round in order, its outputs and the prompt tokens read from the cache; from the
    second round on, half the requests continue an earlier conversation (its prompt, its
    answer, a new turn)."""
    rng = random.Random(seed + 1)
    history: list[list[int]] = []
    outputs, hits = [], 0
    for batch in rounds(seed):
        prompts = []
        for prompt, _, _ in batch:
            earlier = [h for h in history if len(h) < 80]  # a request fits in the KV pool
            if earlier and rng.random() < 0.5:
                prompt = rng.choice(earlier) + prompt[-3:]
            prompts.append(prompt)
        for prompt, (_, max_tokens, spec) in zip(prompts, batch, strict=True):
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            llm.engine.add_request(None, prompt, params, speculation=spec)
        finished = {}
        while llm.engine.has_unfinished_requests():
            for out in llm.engine.step():
                if out.finished:
                    finished[out.request_id] = out
        for out in sorted(finished.values(), key=lambda o: int(o.request_id)):
            outputs.append(out.token_ids)
            hits += out.num_cached_tokens
            history.append(list(out.prompt_token_ids) + list(out.token_ids))
    return outputs, hits


def test_random_traffic_gives_the_uncached_outputs(tiny_models):
    preempted = 0
    for seed in range(4):
        cached = engine(tiny_models, prefix_caching=True)
        outputs, hits = run(cached, seed)
        expected, no_hits = run(engine(tiny_models, prefix_caching=False), seed)
        assert outputs == expected, seed
        assert hits > 0 and no_hits == 0, seed
        assert cached.engine.num_free_blocks == cached.engine.num_total_blocks, seed
        preempted += cached.engine.scheduler.num_preemptions
    assert preempted > 0  # the pool was tight enough to preempt requests holding shared blocks
