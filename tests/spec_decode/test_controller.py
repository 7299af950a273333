"""The mode controller: off (and skipping the planner) after a zero plan, overlap below the knee
on a calm fleet, prune otherwise, and k halved while the fleet is busy."""

import pytest

from faser.spec_decode.controller import CLUSTER_BUSY, OFF_REPLAN_STEPS, ModeController

KNEE = 16.0


def stopped_at(batch: int) -> ModeController:
    """A controller whose last plan gave none of `batch` requests a draft token, no prefill."""
    controller = ModeController(can_overlap=True)
    assert controller.update((0,) * batch, 0, KNEE) == "off"
    return controller


def test_starts_planning_in_prune():
    controller = ModeController(can_overlap=True)
    assert controller.mode == "prune"
    assert not controller.stays_off(4)


def test_a_zero_plan_without_prefill_skips_planning_at_the_same_or_a_larger_batch():
    controller = stopped_at(8)
    assert controller.stays_off(8)
    assert controller.stays_off(20)


def test_a_smaller_batch_plans_again():
    controller = stopped_at(8)
    assert not controller.stays_off(7)
    assert controller.steps_in_mode["off"] == 1  # the update's step only


def test_off_replans_after_a_fixed_number_of_skipped_steps():
    """Acceptance may have moved since: every OFF_REPLAN_STEPS skipped steps the planner runs."""
    controller = stopped_at(4)
    assert all(controller.stays_off(4) for _ in range(OFF_REPLAN_STEPS))
    assert not controller.stays_off(4)
    controller.update((0,) * 4, 0, KNEE)  # still nothing pays: skip again
    assert controller.stays_off(4)


def test_skipped_steps_are_counted_as_off():
    controller = stopped_at(4)
    for _ in range(5):
        controller.stays_off(4)
    assert controller.steps_in_mode["off"] == 6


def test_a_zero_plan_with_prefill_never_skips_planning():
    """The prefill may be what made speculation not pay; the next step may have none."""
    controller = ModeController(can_overlap=True)
    assert controller.update((0, 0, 0), 32, KNEE) == "off"
    assert not controller.stays_off(3)
    assert not controller.stays_off(30)


def test_speculating_again_leaves_off():
    controller = stopped_at(4)
    assert controller.update((1, 0), 0, KNEE) == "overlap"
    assert not controller.stays_off(4)


def test_a_smaller_zero_plan_moves_the_batch_it_stopped_at():
    controller = stopped_at(8)
    assert not controller.stays_off(5)
    controller.update((0,) * 5, 0, KNEE)
    assert controller.stays_off(5)


@pytest.mark.parametrize(
    ("can_overlap", "ks", "prefill", "cluster_load", "mode"),
    [
        (True, (4, 4), 0, 0.0, "overlap"),  # 10 rows
        (True, (7, 7), 0, 0.0, "overlap"),  # 16 rows: at the knee
        (True, (7, 8), 0, 0.0, "prune"),  # 17 rows: past it
        (True, (2, 2), 10, 0.0, "overlap"),  # 6 rows + 10 prefill tokens: 16
        (True, (2, 2), 11, 0.0, "prune"),  # 6 rows + 11 prefill tokens
        (False, (4, 4), 0, 0.0, "prune"),  # no lanes
        (True, (4, 4), 0, 0.99, "overlap"),
        (True, (4, 4), 0, CLUSTER_BUSY, "prune"),  # the fleet is busy
    ],
)
def test_overlap_needs_lanes_rows_within_the_knee_and_a_calm_fleet(
    can_overlap, ks, prefill, cluster_load, mode
):
    controller = ModeController(can_overlap)
    assert controller.update(ks, prefill, KNEE, cluster_load) == mode
    assert controller.mode == mode and controller.steps_in_mode[mode] == 1


@pytest.mark.parametrize(
    ("cluster_load", "max_k", "cap"),
    [(0.0, 8, 8), (0.99, 8, 8), (1.0, 8, 4), (2.5, 8, 4), (1.0, 5, 3), (1.0, 1, 1), (1.0, 0, 0)],
)
def test_a_busy_fleet_halves_k(cluster_load, max_k, cap):
    assert ModeController.cap(max_k, cluster_load) == cap
