"""An engine measures what its own policy needs before its first request (a served replica calls
`prepare` before it reports ready), and nothing a policy without a cost model would not use."""

from faser import LLM, SpecConfig


def _engine(models, tmp_path, policy: str):
    return LLM(
        str(models["gqa_tied"]), draft_model=str(models["gqa_tied_draft"]),
        spec=SpecConfig(policy=policy, profile_cache_dir=str(tmp_path)),
        num_kv_blocks=96, block_size=4, max_num_batched_tokens=16, max_num_seqs=4,
    ).engine


def test_prepare_measures_a_faser_policys_profile_before_any_request(tiny_models, tmp_path):
    engine = _engine(tiny_models, tmp_path, "faser")
    assert engine.speculator.cost is None  # measured lazily unless prepared
    engine.prepare()
    assert engine.speculator.cost is not None
    assert list(tmp_path.glob("*.json"))  # cached for the next replica on this node
    assert engine.num_free_blocks == engine.num_total_blocks  # the borrowed blocks are back


def test_prepare_measures_nothing_for_a_policy_without_a_cost_model(tiny_models, tmp_path):
    engine = _engine(tiny_models, tmp_path, "fixed:2")
    engine.prepare()
    assert engine.speculator.cost is None and not list(tmp_path.glob("*.json"))
