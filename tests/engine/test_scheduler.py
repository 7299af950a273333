"""Continuous batching with no model loaded: budget, chunked prefill, preemption."""

from __future__ import annotations

import torch

from faser.config import EngineConfig
from faser.engine.scheduler import Scheduler
from faser.engine.sequence import Sequence, SequenceStatus
from faser.runner.block_manager import BlockManager
from faser.sampling_params import SamplingParams
from faser.spec_decode.state import SpecState


def make_seq(rid: str, prompt_len: int) -> Sequence:
    return Sequence(rid, list(range(prompt_len)), SamplingParams(max_tokens=8),
                    SpecState(alpha=0.5, policy="off", max_k=0), torch.Generator())


def make_scheduler(num_blocks=64, block_size=4, budget=16, max_seqs=8) -> Scheduler:
    config = EngineConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                          block_size=block_size)
    return Scheduler(config, BlockManager(num_blocks, block_size))


def run_prefills(sched: Scheduler, out) -> None:
    """What the engine does after a forward: the chunk is cached; a finished prompt samples."""
    for seq, n in out.prefills:
        seq.mark_target_cached(seq.num_cached + n)
        if seq.num_cached == seq.num_tokens:
            seq.output_token_ids.append(0)


def test_token_budget_and_chunked_prefill():
    sched = make_scheduler(budget=16)
    long, short = make_seq("long", 40), make_seq("short", 3)
    sched.add(long)
    sched.add(short)
    out = sched.schedule()
    assert out.prefills == [(long, 16)] and out.token_budget_left == 0
    run_prefills(sched, out)
    out = sched.schedule()
    assert out.prefills == [(long, 16)]
    run_prefills(sched, out)
    out = sched.schedule()  # the long prompt's last 8 tokens, then the short one fits
    assert out.prefills == [(long, 8), (short, 3)]
    run_prefills(sched, out)
    out = sched.schedule()  # both decode now, one token each
    assert out.decodes == [long, short] and out.token_budget_left == 14


def test_decodes_come_before_new_prefills_and_seq_cap():
    sched = make_scheduler(budget=8, max_seqs=2)
    seqs = [make_seq(str(i), 2) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [s for s, _ in out.prefills] == seqs[:2]  # the cap keeps the third waiting
    run_prefills(sched, out)
    out = sched.schedule()
    assert out.decodes == seqs[:2] and not out.prefills


def test_preemption_frees_newest_and_requeues_it_first():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64)
    a, b = make_seq("a", 8), make_seq("b", 8)
    sched.add(a)
    sched.add(b)
    run_prefills(sched, sched.schedule())  # 2 blocks each; 9 tokens now
    out = sched.schedule()  # each needs a 9th slot: a third block, none free -> b preempted
    assert out.decodes == [a] and out.num_preempted == 1
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_cached == 0
    assert sched.waiting[0] is b
    assert len(a.block_table) == 3
    sched.finish(a)
    out = sched.schedule()  # b is recomputed from prompt + its output so far
    assert out.prefills == [(b, 9)]
