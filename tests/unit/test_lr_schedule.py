"""The inner lr schedule (``swarm.lr_schedule``): its shape as properties over random settings, its refusals,
and its position carried across a join (state-transfer meta) and a checkpoint resume."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.lr_schedule import SCHEDULE_STEP, LrSchedule, schedule_position

warmups = st.integers(min_value=0, max_value=200)
lengths = st.integers(min_value=1, max_value=5000)
floors = st.floats(min_value=0.0, max_value=1.0)
fractions = st.floats(min_value=0.01, max_value=1.0)
decaying = st.sampled_from(["cosine", "wsd"])


def _schedule(kind: str, warmup: int, extra: int, floor: float, fraction: float = 0.2) -> LrSchedule:
    return LrSchedule(kind, warmup, warmup + extra, floor, fraction)  # type: ignore[arg-type]


def _old_constant(step: int, warmup: int) -> float:
    """LocalTrainer's schedule before schedules existed: linear warm-up, then 1."""
    return min(1.0, (step + 1) / warmup) if warmup else 1.0


@given(warmups, st.integers(min_value=0, max_value=10_000))
def test_constant_is_the_old_warmup_then_constant(warmup, step):
    assert LrSchedule("constant", warmup).factor(step) == _old_constant(step, warmup)


@given(decaying, warmups, lengths, floors, fractions)
@settings(max_examples=200)
def test_decaying_schedules_warm_up_like_constant_then_never_rise(kind, warmup, extra, floor, fraction):
    s = _schedule(kind, warmup, extra, floor, fraction)
    total = warmup + extra
    steps = range(0, total + 20, max(1, total // 400))
    for step in range(warmup):
        assert s.factor(step) == _old_constant(step, warmup)
    after = [s.factor(step) for step in steps if step >= max(0, warmup - 1)]
    assert all(b <= a + 1e-12 for a, b in zip(after, after[1:])), "non-increasing after warm-up"


@given(decaying, warmups, lengths, floors, fractions)
@settings(max_examples=200)
def test_decaying_schedules_stay_between_floor_and_one_and_end_at_the_floor(kind, warmup, extra, floor, fraction):
    s = _schedule(kind, warmup, extra, floor, fraction)
    total = warmup + extra
    for step in list(range(max(0, warmup - 1), total + 3, max(1, extra // 200))) + [total, total + 1, 10 * total]:
        assert floor - 1e-12 <= s.factor(step) <= 1.0
    assert s.factor(total) == pytest.approx(floor)
    assert s.factor(10 * total) == pytest.approx(floor)


@given(decaying, warmups, st.integers(min_value=10, max_value=5000), floors, fractions)
@settings(max_examples=200)
def test_decaying_schedules_have_no_jump(kind, warmup, extra, floor, fraction):
    """Continuous: one step changes the factor by at most one warm-up increment or one step of the steepest
    decay (cosine: (1−floor)·π/2 per decay length; wsd: (1−floor) per decay length)."""
    s = _schedule(kind, warmup, extra, floor, fraction)
    total = warmup + extra
    span = total - s.decay_start
    steepest = (1 - floor) * (math.pi / 2 if kind == "cosine" else 1.0) / span
    bound = max(1 / warmup if warmup else 0.0, steepest) + 1e-9
    for step in range(0, total + 2):
        assert abs(s.factor(step + 1) - s.factor(step)) <= bound, step


def test_cosine_and_wsd_shapes():
    cos = LrSchedule("cosine", 10, 110, 0.1)
    assert cos.factor(9) == 1.0 and cos.factor(10) == 1.0
    assert cos.factor(60) == pytest.approx(0.55)  # half way: floor + (1 − floor)/2
    wsd = LrSchedule("wsd", 10, 110, 0.1)
    assert wsd.decay_start == 88  # the last ceil(20% of 110) = 22 steps decay
    assert wsd.factor(87) == 1.0 and wsd.factor(88) == 1.0
    assert wsd.factor(99) == pytest.approx(1 - 0.9 * 11 / 22)
    assert wsd.factor(110) == pytest.approx(0.1)


def test_a_decaying_schedule_needs_a_length_past_warm_up():
    with pytest.raises(ValueError, match="--total-steps or --max-steps"):
        LrSchedule("cosine", 10, None)
    with pytest.raises(ValueError, match="do not outlast --warmup-steps 50"):
        LrSchedule("wsd", 50, 50)
    with pytest.raises(ValueError, match="unknown lr schedule"):
        LrSchedule("linear", 10, 100)  # type: ignore[arg-type]


def test_schedule_position_from_a_peers_meta():
    assert schedule_position({SCHEDULE_STEP: 400}, 7, own=0) == 407
    assert schedule_position({}, 7, own=12) == 12, "a peer that does not say leaves the joiner's own position"
    assert schedule_position({SCHEDULE_STEP: "400"}, 7, own=12) == 12
    assert schedule_position({SCHEDULE_STEP: True}, 7, own=12) == 12


def test_a_schedule_position_past_what_the_rounds_can_hold_is_not_taken():
    """A holder that says it is 10¹² steps in would leave a joiner at the schedule's final lr."""
    assert schedule_position({SCHEDULE_STEP: 10**12}, 7, own=12, high=5 * 30) == 12
    assert schedule_position({SCHEDULE_STEP: 150}, 7, own=12, high=5 * 30) == 157
