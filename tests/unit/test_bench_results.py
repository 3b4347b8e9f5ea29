"""Benchmark results files and their analysis: the one writer (atomic, with ``meta``), reading a loss
curve between evaluations, seeds combined, and dense DiLoCo compared at the same H."""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path

import pytest

from benchmarks import results_io
from benchmarks.convergence_report import combine_seeds, dense_same_h, inner_steps, is_dense_diloco
from benchmarks.curves import crossing, value_at
from benchmarks.recovery import to_target


def test_a_results_file_starts_with_meta_and_keeps_the_report_as_it_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(results_io.SCALE_ENV, "quick")
    meta = results_io.begin(["/x/benchmarks/codecs.py", "--quick"])
    out = tmp_path / "sub" / "r.json"
    results_io.write(out, {"codecs": {"q8": 1}, "runs": [1, 2]}, meta)
    data = json.loads(out.read_text())
    assert list(data) == ["meta", "codecs", "runs"] and data["runs"] == [1, 2]
    m = data["meta"]
    for key in ("command", "argv", "git_commit", "git_dirty", "versions", "cpu_count", "load_before", "load_after",
                "started", "ended", "wall_s", "scale", "platform"):
        assert key in m, key
    assert m["scale"] == "quick" and m["cpu_count"] == os.cpu_count()
    assert set(m["versions"]) >= {"locomesh", "torch", "hivemind", "python"} and m["versions"]["torch"]
    assert datetime.fromisoformat(m["started"]) <= datetime.fromisoformat(m["ended"])
    assert datetime.fromisoformat(m["ended"]).utcoffset().total_seconds() == 0  # UTC
    assert len(m["git_commit"]) == 40 and isinstance(m["git_dirty"], bool)  # this checkout is a git one


def test_the_command_of_a_module_run_reads_as_python_dash_m():
    script = str(results_io.ROOT / "benchmarks" / "frontier.py")
    assert results_io.begin([script, "--codecs", "none,q2"]).command == "python -m benchmarks.frontier --codecs none,q2"
    assert results_io.begin(["make", "mutate"], scale="full").command == "make mutate"
    assert results_io.begin(["make"], scale="full").scale == "full"


def test_a_failed_write_leaves_the_previous_file_whole_and_no_temporary_behind(tmp_path: Path):
    out = tmp_path / "r.json"
    results_io.write_json(out, {"a": 1})

    class Unserialisable:
        def __str__(self) -> str:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        results_io.write_json(out, {"a": Unserialisable()})
    assert json.loads(out.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_crossing_interpolates_between_the_bracketing_evaluations():
    points = [(10.0, 3.0), (20.0, 2.5), (30.0, 2.0), (40.0, 1.9)]
    assert crossing(points, 2.25) == pytest.approx(25.0)
    assert crossing(points, 2.0) == pytest.approx(30.0)
    assert crossing(points, 3.2) == 10.0  # below target at the first evaluation
    assert crossing(points, 1.0) is None
    assert crossing([], 2.0) is None
    # a loss that went up before crossing: the bracket is the last evaluation above the target
    assert crossing([(0.0, 3.0), (10.0, 2.2), (20.0, 2.6), (30.0, 1.6)], 2.1) == pytest.approx(25.0)
    assert crossing([(0.0, 3.0), (10.0, 2.2), (20.0, 2.6), (30.0, 1.6)], 2.2) == pytest.approx(10.0)


def test_value_at_interpolates_and_refuses_to_extrapolate():
    points = [(200, 2.0), (100, 3.0)]
    assert value_at(points, 150) == pytest.approx(2.5)
    assert value_at(points, 200) == 2.0
    assert value_at(points, 250) is None and value_at(points, 50) is None and value_at([], 1) is None


def test_recovery_steps_and_seconds_to_target_are_interpolated():
    result = {"curve": [{"executed": 50, "seconds": 5.0, "val_loss": 3.0}, {"executed": 100, "seconds": 9.0, "val_loss": 2.0}]}
    assert to_target(result, 2.5) == (75.0, pytest.approx(7.0))
    assert to_target(result, 1.0) == (None, None)


def _ok(loss: float, **more) -> dict:
    return {"status": "ok", "final_val_loss": loss, "curve": [{"t_s": 1.0, "val_loss": loss}], **more}


def test_seeds_are_combined_as_mean_and_spread_and_a_failed_seed_fails_the_config():
    rec = combine_seeds({0: _ok(2.0, wall_s=10.0), 1: _ok(2.2, wall_s=12.0), 2: _ok(2.1, wall_s=11.0)})
    assert rec["status"] == "ok" and rec["final_val_loss"] == pytest.approx(2.1)
    spread = rec["spread"]["final_val_loss"]
    assert (spread["min"], spread["max"], spread["n"]) == (2.0, 2.2, 3) and spread["std"] == pytest.approx(0.1)
    assert rec["curve"] == [{"t_s": 1.0, "val_loss": 2.0}] and set(rec["per_seed"]) == {"0", "1", "2"}
    failed = combine_seeds({0: _ok(2.0), 1: {"status": "failed", "reason": "node exit codes [1]"}})
    assert failed["status"] == "failed" and "seed 1" in failed["reason"] and failed["final_val_loss"] == 2.0
    partial = combine_seeds({0: _ok(2.0, time_to_target_s=5.0), 1: _ok(2.1, time_to_target_s=None)})
    assert partial["time_to_target_s"] is None  # one seed never reached the target: no mean time


def test_each_locomesh_config_is_compared_with_dense_diloco_at_its_own_h():
    flags = {"diloco": ["--algorithm", "diloco"], "diloco-h20": ["--algorithm", "diloco", "--inner-steps", "20"],
             "sparseloco": ["--algorithm", "sparseloco"], "sparseloco-h20": ["--algorithm", "sparseloco", "--inner-steps", "20"],
             "q2-h50": ["--algorithm", "diloco", "--compression", "q2", "--inner-steps", "50"]}
    assert inner_steps(flags["sparseloco-h20"], 30) == 20 and inner_steps(flags["sparseloco"], 30) == 30
    assert is_dense_diloco(flags["diloco-h20"]) and not is_dense_diloco(flags["q2-h50"])
    results = {"diloco": _ok(2.0), "diloco-h20": _ok(1.9), "sparseloco": _ok(2.2), "sparseloco-h20": _ok(2.09),
               "q2-h50": _ok(2.1), "ddp": _ok(1.8)}
    dense_same_h(results, flags, 30)
    assert results["sparseloco"]["vs_dense"]["config"] == "diloco"
    assert results["sparseloco"]["vs_dense"]["gap"] == pytest.approx(0.10)
    assert results["sparseloco-h20"]["vs_dense"] == {"config": "diloco-h20", "inner_steps": 20, "gap": pytest.approx(0.10)}
    assert results["q2-h50"]["vs_dense"]["gap"] is None  # no dense run at H = 50: no comparison, not one with H = 30
    assert "vs_dense" not in results["ddp"]
