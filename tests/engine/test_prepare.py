"""An engine measures what its own policy needs before its first request (a served replica calls
`prepare` before it reports ready), and nothing a policy without a cost model would not use; the
cost model then learns only from the steps its planner shaped."""

from faser import LLM, SamplingParams, SpecConfig


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


def test_only_the_steps_the_planner_shaped_teach_the_cost_model(tiny_models, tmp_path):
    engine = _engine(tiny_models, tmp_path, "faser")
    engine.prepare()
    cost = engine.speculator.cost
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    others = [([5, 6, 7, 8], "fixed:2"), ([9, 10, 11], "off")]
    for i, (prompt, policy) in enumerate(others):
        engine.add_request(f"other-{i}", prompt, params, speculation={"policy": policy})
    while engine.has_unfinished_requests():
        engine.step()
    # fixed:2's two draft forwards a step, or off's plain ones, are not the planner's to learn
    assert (cost.num_observed, cost.num_decodes) == (0, 0)
    assert (cost.target_scale, cost.draft_scale, cost.decode_scale) == (1.0, 1.0, 1.0)
    engine.add_request("faser-0", [5, 6, 7, 8], params)
    while engine.has_unfinished_requests():
        engine.step()
    assert cost.num_observed + cost.num_decodes > 0
