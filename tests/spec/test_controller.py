import dataclasses
import random

import pytest

from faser.spec.controller import ControllerConfig, ModeController
from faser.spec.cost_model import CostProfile
from faser.spec.plan import LoadView
from tests.spec.spec_profiles import linear, roofline

# knee at 64 tokens; with max_k = 4 a request puts 5 tokens in the target batch with full
# speculation: the prune signal is num_running * 5 / 64 (1 at 12.8 requests), the off signal
# num_running / off_batch, 62 requests at the prior 0.8 (from 65 on no k pays); with the 15 %
# margin, prune from 14.7 requests down to 10.9, off from 71.3 down to 52.7
PROFILE = roofline(knee=64)
MAX_K = 4


def load(num_running, waiting=0, prefill=0, kv=0.2, cluster=None):
    return LoadView(num_running, waiting, prefill, 512 - num_running, kv, cluster)


def controller(**config):
    return ModeController(PROFILE, MAX_K, alpha_prior=0.8, config=ControllerConfig(**config))


def run(ctrl, loads, alpha=0.8):
    return [ctrl.update(x, alpha=alpha) for x in loads]


def test_first_step_takes_its_mode_at_once():
    assert controller().update(load(40)) == "prune"
    assert controller().update(load(90)) == "off"
    assert controller().update(load(4)) == "overlap"


def test_modes_follow_load_up_and_down():
    ctrl = controller(patience=3)
    up = [load(n) for n in (2, 4, 8, 12, 16, 20, 30, 40, 50, 60, 70, 80, 90, 100)]
    modes = run(ctrl, [x for x in up for _ in range(4)])
    assert modes[0] == "overlap" and modes[-1] == "off"
    assert "prune" in modes
    assert _transitions(modes) == ["overlap", "prune", "off"]
    down = list(reversed(up))
    modes = run(ctrl, [x for x in down for _ in range(4)])
    assert _transitions(modes) == ["off", "prune", "overlap"]
    assert [(s.old, s.new) for s in ctrl.history][-4:] == [
        ("overlap", "prune"),
        ("prune", "off"),
        ("off", "prune"),
        ("prune", "overlap"),
    ]


@pytest.mark.parametrize(("centre", "spread"), [(13, 1), (64, 6)])
def test_noisy_load_near_a_threshold_does_not_flap(centre, spread):
    rng = random.Random(0)
    ctrl = controller()
    run(ctrl, [load(centre)] * 5)
    start, switches = ctrl.mode, len(ctrl.history)
    noisy = [load(centre + rng.randint(-spread, spread)) for _ in range(300)]
    assert set(run(ctrl, noisy)) == {start}
    assert len(ctrl.history) == switches


def test_without_hysteresis_the_same_noise_would_flap():
    rng = random.Random(0)
    ctrl = controller(patience=1, margin=0.0)
    noisy = [load(13 + rng.randint(-1, 1)) for _ in range(300)]
    assert len(_transitions(run(ctrl, noisy))) > 10


def test_a_short_spike_does_not_switch():
    ctrl = controller(patience=3)
    run(ctrl, [load(4)] * 3)
    assert run(ctrl, [load(100), load(100), load(4)]) == ["overlap"] * 3
    assert run(ctrl, [load(100)] * 3)[-1] == "off"


def test_cluster_load_pushes_toward_prune_and_off():
    ctrl = controller(patience=1)
    assert ctrl.update(load(4)) == "overlap"
    ctrl.set_cluster_load(1.3)
    assert ctrl.update(load(4)) == "prune"
    ctrl.set_cluster_load(2.5)
    assert ctrl.update(load(4)) == "off"
    ctrl.set_cluster_load(0.0)
    assert ctrl.update(load(4)) == "overlap"
    # a signal carried in the LoadView wins over the stored one
    assert ctrl.update(load(4, cluster=1.5)) == "prune"


def test_queue_and_full_kv_raise_pressure():
    ctrl = controller()
    queued, calm = ctrl.pressure(load(20, waiting=20)), ctrl.pressure(load(20))
    assert queued.prune == pytest.approx(2 * calm.prune)
    assert queued.off == pytest.approx(2 * calm.off)
    assert ctrl.pressure(load(1, kv=0.95)).prune > 1.0


def test_off_when_speculation_cannot_pay():
    cpu = linear(fixed_s=0.010, per_token_s=0.001)  # every verified token costs real time
    assert ModeController(cpu, MAX_K).update(load(4), alpha=0.9) == "prune"
    assert ModeController(cpu, MAX_K).update(load(4), alpha=0.01) == "off"
    # and back once the acceptance recovers, after the patience
    ctrl = ModeController(cpu, MAX_K, config=ControllerConfig(patience=2))
    assert run(ctrl, [load(4)] * 2, alpha=0.01) == ["off", "off"]
    assert run(ctrl, [load(4)] * 2, alpha=0.9) == ["off", "prune"]


def test_a_cpu_curve_with_an_early_jump_keeps_speculating_where_it_pays():
    """A CPU-shaped target step (SmolLM2-135M, fp32, 2 threads): 4 tokens cost 1.6x one, 16
    barely more than 8. The knee sits at 2 tokens, yet k = 1 still pays at 16 requests; past
    about 20 requests it stops paying."""
    cpu = CostProfile(
        (1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
        (0.0301, 0.0324, 0.0492, 0.0633, 0.0657, 0.0802, 0.120, 0.182, 0.353, 0.977),
        (1, 2, 4, 8, 16, 32, 64),
        (0.00155, 0.00155, 0.00221, 0.00275, 0.0031, 0.00452, 0.00707),
    )
    ctrl = ModeController(cpu, MAX_K, alpha_prior=0.5)
    assert ctrl.knee < 4 and 16 < ctrl.off_batch < 40
    assert run(ctrl, [load(16)] * 4, alpha=0.36)[-1] == "prune"
    assert run(ctrl, [load(40)] * 4, alpha=0.36)[-1] == "off"


def test_never_overlap_when_not_allowed():
    ctrl = ModeController(PROFILE, MAX_K, allow_overlap=False)
    assert set(run(ctrl, [load(n) for n in (1, 2, 4, 2, 1)])) == {"prune"}


def test_counts_steps_per_mode():
    ctrl = controller(patience=1)
    run(ctrl, [load(4)] * 3 + [load(40)] * 2)
    assert ctrl.steps_in_mode == {"overlap": 3, "prune": 2}
    assert ctrl.num_steps == 5


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="patience"):
        ControllerConfig(patience=0)
    with pytest.raises(ValueError, match="margin"):
        ControllerConfig(margin=1.0)


def _transitions(modes):
    out = [modes[0]]
    for m in modes[1:]:
        if m != out[-1]:
            out.append(m)
    return out


def test_overlap_only_where_the_lanes_pay_for_themselves():
    """When the target's lane has half a CPU's cores, its forward takes twice as long, more
    than hiding the draft wins back, so low load runs sequential (prune) steps there."""
    halved = dataclasses.replace(PROFILE, lane_scales=(2.0, 1.0))
    ctrl = ModeController(halved, MAX_K, alpha_prior=0.8)
    assert run(ctrl, [load(2)] * 4) == ["prune"] * 4
    streams = dataclasses.replace(PROFILE, lane_scales=(1.05, 1.0))  # a GPU's streams
    assert ModeController(streams, MAX_K, alpha_prior=0.8).update(load(2)) == "overlap"
