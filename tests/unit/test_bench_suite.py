"""The benchmark suite's plan and runner: listing, skips (root, scale), a failing entry reported while
the others go on, results copied only on success, and the quick scale's time budget."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from benchmarks import convergence, suite
from benchmarks.suite_entries import ENTRIES, Entry

FAKE = '''
import argparse, json, sys
from pathlib import Path
from benchmarks import results_io
p = argparse.ArgumentParser()
p.add_argument("--out", type=Path, required=True)
p.add_argument("--fail", action="store_true")
args = p.parse_args()
meta = results_io.begin()
if args.fail:
    print("something broke"); sys.exit(3)
results_io.write(args.out, {"value": 1}, meta)
args.out.with_suffix(".png").write_bytes(b"png")
'''


def _entry(name: str, quick: tuple[str, ...] | None, root: bool = False) -> Entry:
    return Entry(name, "fake_bench", quick, ("--out", "{out}"), {"quick": 0.1, "full": 0.1}, f"{name} docs", root=root,
                 why_not={"quick": "full scale only: too slow"})


def test_skip_reasons_name_root_and_scale():
    assert suite.skip_reason(_entry("a", ("--out", "{out}")), "quick", is_root=False) is None
    assert "root" in suite.skip_reason(_entry("b", ("--out", "{out}"), root=True), "quick", is_root=False)
    assert suite.skip_reason(_entry("b", ("--out", "{out}"), root=True), "quick", is_root=True) is None
    assert suite.skip_reason(_entry("c", None), "quick", is_root=True) == "full scale only: too slow"
    with pytest.raises(SystemExit, match="unknown benchmark"):
        suite.select(ENTRIES, ["codecs", "nope"])
    assert [e.name for e in suite.select(ENTRIES, ["frontier", "codecs"])] == ["codecs", "frontier"]  # the suite's order


def test_list_prints_every_entry_and_the_estimated_total(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(suite.os, "geteuid", lambda: 1000)
    assert suite.main(["--list", "--scale", "quick"]) == 0
    out = capsys.readouterr().out
    for e in ENTRIES:
        assert e.name in out
    assert "bandwidth_cap            skip: needs root" in out
    assert "churn                    skip: full scale only" in out
    assert "estimated total at quick:" in out and "not root" in out


def test_every_entry_runs_a_module_that_exists_and_names_its_output():
    names = [e.name for e in ENTRIES]
    assert len(names) == len(set(names))
    for e in ENTRIES:
        assert importlib.util.find_spec(e.module) is not None, e.module
        for scale in suite.SCALES:
            args = e.args(scale)
            assert args is None or "{out}" in args, (e.name, scale)
            assert args is not None or e.why_not.get(scale), (e.name, scale)
            assert args is None or scale in e.minutes, (e.name, scale)


def test_quick_fits_45_minutes_on_two_cores_even_as_root():
    total = sum(e.minutes["quick"] for e in ENTRIES if e.quick is not None)
    assert total <= 45, f"quick scale estimated at {total} min"


def test_quality_claims_keep_three_seeds_at_quick_scale():
    for e in ENTRIES:
        args = " ".join(e.quick or ())
        if "--seeds" in args:
            seeds = args.split("--seeds", 1)[1].split()[0]
            assert len(seeds.split(",")) >= 3, e.name


def test_a_failing_entry_is_reported_the_others_run_and_the_exit_code_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    (tmp_path / "fake_bench.py").write_text(FAKE)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{suite.results_io.ROOT}")
    monkeypatch.setattr(suite.os, "geteuid", lambda: 1000)
    out, work = tmp_path / "results", tmp_path / "work"
    (out).mkdir()
    (out / "broken.json").write_text('{"last": "good"}')
    entries = [_entry("good", ("--out", "{out}")), _entry("broken", ("--out", "{out}", "--fail")),
               _entry("later", None), _entry("namespaces", ("--out", "{out}"), root=True)]
    code = suite.main(["--scale", "quick", "--out", str(out), "--work", str(work)], entries=entries)
    assert code == 1
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("[ok     ] good") for line in lines)
    assert any(line.startswith("[failed ] broken") and "exit 3: something broke" in line for line in lines)
    assert any(line.startswith("[skipped] later") and "full scale only" in line for line in lines)
    assert any(line.startswith("[skipped] namespaces") and "needs root" in line for line in lines)
    assert "1 ok, 1 failed, 2 skipped" in "\n".join(lines)
    good = json.loads((out / "good.json").read_text())
    assert good["value"] == 1 and good["meta"]["scale"] == "quick"
    assert (out / "good.png").read_bytes() == b"png"
    assert json.loads((out / "broken.json").read_text()) == {"last": "good"}  # a failed run leaves the last good file
    record = json.loads((out / "suite.json").read_text())
    assert record["summary"] == {"ok": 1, "failed": 1, "skipped": 2} and record["meta"]["scale"] == "quick"

    # --only reruns one entry; the record keeps the others' earlier outcomes
    assert suite.main(["--scale", "quick", "--out", str(out), "--work", str(work), "--only", "good"], entries=entries) == 0
    record = json.loads((out / "suite.json").read_text())
    assert {e["name"]: e.get("earlier", False) for e in record["entries"]} == {
        "good": False, "broken": True, "later": True, "namespaces": True}


def test_dense_diloco_is_added_at_every_other_h_a_variant_uses(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(convergence, "LOCOMESH", {**convergence.LOCOMESH,
                                                  "sparseloco-h20": ["--algorithm", "sparseloco", "--inner-steps", "20"]})
    configs = ["ddp", "diloco", "sparseloco", "sparseloco-h20"]
    assert convergence.add_dense_per_h(configs, convergence.Settings(inner_steps=30)) == ["diloco-h20"]
    assert configs[-1] == "diloco-h20" and convergence.LOCOMESH["diloco-h20"][-2:] == ["--inner-steps", "20"]
    assert convergence.add_dense_per_h(["sparseloco-h20"], convergence.Settings()) == []  # no dense run asked for


def test_suite_module_is_small_and_documented():
    for module in (suite, sys.modules["benchmarks.suite_entries"], suite.results_io):
        source = Path(module.__file__).read_text()
        assert module.__doc__ and len(source.splitlines()) < 400
