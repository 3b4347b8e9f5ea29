"""Pipeline churn with real processes: the same swarm with and without random SIGKILLs.

    python -m benchmarks.recovery --churn --out runs/bench/churn.json [--minutes 15] [--nodes 8] [--seeds 0 1]

Runs ``node swarm --nodes N --stages 3 --checkfree-plus`` twice for the same wall time and seeds:
once with ``--chaos kill:random:every=45s --restart-killed 20`` and once without kills. From the
two reports it computes, for the run with kills:

- ``progress_fraction``: the share of the trainer's training time it was not waiting for an unserved
  stage (from its ``waiting_for_stage`` events; time the trainer itself was dead counts as waiting);
- every recovery (method, seconds), ``fresh_initialisations`` (``stage_unrecoverable``) and
  ``stages_emptied_by_recovery`` (a stage declared lost within 30 s after one of its servers left it
  to rebuild another);
- held-out loss at equal trainer steps: both runs' trainer evaluations, compared at the largest
  step both reached (linear interpolation between evaluations, ``benchmarks.curves.value_at``).

The swarm runs on one machine: with 8 processes on 2 cores the absolute speed is low and noisy;
the comparison between the two runs is what it measures. With several seeds (``--seeds``: the swarm's
``--seed``, which also seeds the chaos schedule) the runs alternate killed, calm, killed, calm… so a
change in the machine's load falls on both, and the result holds each seed's analysis and their
mean and spread.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks import results_io
from benchmarks.curves import value_at

SWARM_ARGS = ["--stages", "3", "--checkfree-plus", "--model", "micro", "--batch-size", "8", "--eval-every", "2",
              "--eval-batches", "4", "--sync-every", "20", "--recovery-grace", "6", "--microbatches", "2",
              "--activation-compression", "int8-block"]


def run_swarm(folder: Path, nodes: int, seconds: float, chaos: bool, seed: int = 0, restart: bool = True) -> dict[str, Any]:
    report = folder / "report.json"
    cmd = [sys.executable, "-m", "node", "swarm", "--nodes", str(nodes), "--duration", str(seconds), "--report", str(report),
           "--fresh", "--seed", str(seed), *SWARM_ARGS]
    if chaos:
        cmd += ["--chaos", "kill:random:every=45s", *(["--restart-killed", "20"] if restart else [])]
    subprocess.run(cmd, check=False, timeout=seconds + 600, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(report.read_text())


def _trainer(report: dict[str, Any]) -> dict[str, Any]:
    trainers = [n for n in report["nodes"] if n.get("role") == "trainer"]
    return max(trainers, key=lambda n: n.get("steps", 0)) if trainers else {}


def analyse(killed: dict[str, Any], calm: dict[str, Any]) -> dict[str, Any]:
    events = killed["events"]
    trainer = _trainer(killed)
    index = trainer.get("index")
    waits = sum(e.get("duration_s", 0.0) for e in events if e["event"] == "waiting_for_stage" and e.get("node") == index)
    trainer_kills = [e for e in events if e["event"] == "chaos_kill" and e.get("node") == index]
    trainer_nodes = {n.get("index") for n in killed["nodes"] if n.get("role") == "trainer"}
    dead = 20.0 * len(trainer_kills)  # restarted 20 s after each kill (without restarts a killed trainer ends the run)
    wall = max(1e-9, killed["duration_s"])
    recoveries = [{"stage": e["stage"], "method": e["method"], "duration_s": e.get("duration_s"), "node": e["node"]}
                  for e in events if e["event"] == "stage_recovered"]
    emptied = 0
    for e in events:
        if e["event"] != "stage_lost":
            continue
        for r in events:
            if r["event"] != "stage_recovered" or not 0 <= e["t"] - r["t"] <= 30:
                continue
            before = [m for m in events if m.get("node") == r["node"] and m["t"] < r["t"]
                      and m["event"] in ("stage_joined", "stage_moved", "stage_recovered")]
            if before and before[-1].get("stage") == e["stage"]:  # the rebuilder had been serving the stage now lost
                emptied += 1
                break
    points = {name: [(r["step"], r["val_loss"]) for r in _trainer(rep).get("rounds", []) if "val_loss" in r and r["step"] > 0]
              for name, rep in (("killed", killed), ("calm", calm))}
    common = min((max(s for s, _ in p) for p in points.values() if p), default=0)
    at = {name: value_at(p, common) for name, p in points.items()}
    by_tokens = {name: pipeline_steps_points(rep) for name, rep in (("killed", killed), ("calm", calm))}
    common_tokens = min((max(s for s, _ in p) for p in by_tokens.values() if p), default=0)
    at_tokens = {name: value_at(p, common_tokens) for name, p in by_tokens.items()}
    return {
        "wall_s": killed["duration_s"],
        "progress_fraction": round(max(0.0, 1.0 - (waits + dead) / wall), 4),
        "trainer_waits_s": round(waits, 2),
        "trainer_kills": len(trainer_kills),
        "kills": sum(1 for e in events if e["event"] == "chaos_kill"),
        "trainers_killed": sum(1 for e in events if e["event"] == "chaos_kill" and e.get("node") in trainer_nodes),
        "recoveries": recoveries,
        "recovery_failures": sum(1 for e in events if e["event"] == "stage_recovery_failed"),
        "fresh_initialisations": sum(1 for e in events if e["event"] == "stage_unrecoverable"),
        "stages_emptied_by_recovery": emptied,
        "equal_steps": common,
        "val_loss_at_equal_steps": at,
        "val_loss_gap": (at["killed"] / at["calm"] - 1.0) if at.get("killed") and at.get("calm") else None,
        "trainer_steps": {"killed": _trainer(killed).get("steps"), "calm": _trainer(calm).get("steps")},
        # every trainer's microbatches together (equal tokens through the stages): a run whose other trainer
        # was killed has trained its stages on about half the tokens at the same steps of the evaluated one
        "equal_pipeline_steps": round(common_tokens),
        "val_loss_at_equal_pipeline_steps": at_tokens,
        "val_loss_gap_pipeline_steps": ((at_tokens["killed"] / at_tokens["calm"] - 1.0)
                                        if at_tokens.get("killed") and at_tokens.get("calm") else None),
        "all_trainer_steps": {name: sorted(n.get("steps", 0) for n in rep["nodes"] if n.get("role") == "trainer")
                              for name, rep in (("killed", killed), ("calm", calm))},
    }


def pipeline_steps_points(report: dict[str, Any]) -> list[tuple[float, float]]:
    """(microbatches every trainer had pushed through the pipeline, held-out loss) at each evaluation of
    the evaluated trainer. A trainer's steps between its evaluations are interpolated in time; before its
    first they count as 0, after its last (a killed trainer) they stay at its last count. Needs the
    evaluations' times ("t"); empty for reports written before trainers recorded them."""
    trainers = [n for n in report["nodes"] if n.get("role") == "trainer"]
    curves = [[(r["t"], r["step"]) for r in n.get("rounds", []) if "t" in r] for n in trainers]

    def steps_at(curve: list[tuple[float, float]], final: int, t: float) -> float:
        if not curve or t < curve[0][0]:
            return 0.0
        inside = value_at(curve, t)
        return float(final if inside is None else inside)

    evaluated = _trainer(report)
    out = []
    for r in evaluated.get("rounds", []):
        if "val_loss" in r and "t" in r and r["step"] > 0:
            total = sum(steps_at(c, max(n.get("steps", 0), c[-1][1] if c else 0), r["t"]) for n, c in zip(trainers, curves))
            out.append((total, r["val_loss"]))
    return out


def churn(out: Path, nodes: int = 8, minutes: float = 15.0, seeds: tuple[int, ...] = (0,), restart: bool = True,
          meta: results_io.RunMeta | None = None) -> dict[str, Any]:
    """Run a killed and a calm swarm per seed (alternating), analyse each pair, write ``out`` and return it."""
    meta = meta or results_io.begin()
    folder = out.parent / (out.stem + "-runs")
    per_seed = {}
    for seed in seeds:
        killed = run_swarm(folder / f"killed-{seed}", nodes, minutes * 60, chaos=True, seed=seed, restart=restart)
        calm = run_swarm(folder / f"calm-{seed}", nodes, minutes * 60, chaos=False, seed=seed)
        per_seed[str(seed)] = analyse(killed, calm)
    summary = {}
    for key in ("progress_fraction", "val_loss_gap", "val_loss_gap_pipeline_steps", "fresh_initialisations",
                "stages_emptied_by_recovery", "kills"):
        values = [r[key] for r in per_seed.values() if r.get(key) is not None]
        if values:
            summary[key] = {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}
    result = {"command": meta.command, "commit": meta.git_commit, "dirty": meta.git_dirty, "cores": meta.cpu_count,
              "load_before": meta.load_before, "nodes": nodes, "minutes": minutes,
              "swarm_args": SWARM_ARGS, "restart_killed": restart, "seeds": list(seeds), "summary": summary, "per_seed": per_seed}
    results_io.write(out, result, meta)
    return {"meta": meta.finish(), **result}
