"""The churn benchmark compares runs at equal tokens through the pipeline (every trainer's microbatches),
not at equal steps of one trainer: with two trainers and one killed, the stages see half the tokens."""

import pytest

from benchmarks.churn import analyse, pipeline_steps_points


def _trainer(index: int, evals: list[tuple[float, int, float]], steps: int) -> dict:
    return {"index": index, "role": "trainer", "steps": steps,
            "rounds": [{"t": t, "step": s, "val_loss": v} for t, s, v in evals]}


def _report(trainers: list[dict], events: list[dict] | None = None) -> dict:
    return {"duration_s": 100.0, "events": events or [], "nodes": [{"index": 0, "role": "stage", "stage": 0}, *trainers]}


def test_a_killed_trainer_s_steps_stop_counting_and_the_survivor_s_are_summed():
    survivor = _trainer(6, [(10.0, 10, 4.0), (20.0, 20, 3.0), (40.0, 40, 2.0)], 40)
    killed = _trainer(7, [(10.0, 10, 4.0)], 12)  # last evaluation at 10 steps, died at 12
    points = pipeline_steps_points(_report([survivor, killed]))
    assert points == [(20.0, 4.0), (32.0, 3.0), (52.0, 2.0)]


def test_evaluations_without_times_give_no_points():
    old = {"index": 6, "role": "trainer", "steps": 40, "rounds": [{"step": 20, "val_loss": 3.0}]}
    assert pipeline_steps_points(_report([old])) == []


def test_the_gap_is_taken_at_equal_pipeline_steps():
    # calm: two trainers at the same pace; killed: the second died at once, the first ran twice as fast
    calm = _report([_trainer(6, [(10.0, 10, 3.0), (20.0, 20, 2.0)], 20), _trainer(7, [(10.0, 10, 3.0), (20.0, 20, 2.0)], 20)])
    killed = _report([_trainer(6, [(10.0, 20, 3.0), (20.0, 40, 2.2)], 40), _trainer(7, [], 0)],
                     [{"event": "chaos_kill", "node": 7, "t": 1.0}])
    result = analyse(killed, calm)
    assert result["equal_pipeline_steps"] == 40 and result["trainers_killed"] == 1
    assert result["val_loss_at_equal_pipeline_steps"] == {"killed": pytest.approx(2.2), "calm": pytest.approx(2.0)}
    assert result["val_loss_gap_pipeline_steps"] == pytest.approx(0.1)
    # at equal steps of the evaluated trainer the run that lost a trainer looks 50 % worse: half the tokens
    assert result["equal_steps"] == 20 and result["val_loss_gap"] == pytest.approx(0.5)
