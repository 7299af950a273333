"""The engine's per-position and per-k speculation counts (what the replica's
`faser_spec_decode_num_accepted_tokens_per_pos` and `faser_spec_k` metrics are made from) agree
with its totals on a real tiny engine, and `SpecStats.count_step` on hand-made steps."""

from __future__ import annotations

from faser.config import SpecConfig
from faser.llm import LLM
from faser.outputs import SpecStats
from faser.sampling_params import SamplingParams
from tests.engine.tiny import make_checkpoint, make_noisy_copy

PROMPTS = [[1, 2, 3, 4], [9, 8, 7], [5, 50, 20, 11, 3], [42]]


def test_count_step_by_position_and_k() -> None:
    stats = SpecStats()
    stats.count_step(3, 2)
    stats.count_step(3, 0)
    stats.count_step(0, 0)
    stats.count_step(5, 5)
    assert stats.num_steps_per_k == [1, 0, 0, 2, 0, 1]
    assert stats.num_accepted_tokens_per_pos == [2, 2, 1, 1, 1]


def test_engine_counts_agree_with_totals(tmp_path) -> None:
    target = make_checkpoint(tmp_path / "target", "gqa_tied")
    draft = make_noisy_copy(target, tmp_path / "draft", noise=0.12)
    llm = LLM(str(target), draft_model=str(draft), spec=SpecConfig(policy="fixed:4"),
              num_kv_blocks=64, block_size=4)
    llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    stats = llm.engine.stats
    per_pos, per_k = stats.num_accepted_tokens_per_pos, stats.num_steps_per_k
    assert sum(per_pos) == stats.num_accepted_tokens > 0
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:], strict=False))  # prefix-accepted
    assert per_pos[0] <= stats.num_drafts
    assert sum(per_k) == stats.num_steps
    assert sum(k * n for k, n in enumerate(per_k)) == stats.num_draft_tokens
    assert stats.num_drafts == sum(per_k[1:])
    assert len(per_k) <= 5  # fixed:4 never proposes more than 4
