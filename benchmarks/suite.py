"""The benchmark suite: every benchmark whose numbers the docs quote, at one scale, in one command.

    python -m benchmarks.suite --scale quick|full --out DIR [--only NAME ...] [--list] [--work DIR]
    make bench SCALE=quick OUT=benchmarks/results

Each entry is one benchmark run as its own process (``python -m benchmarks.MODULE ARGS``) with the
settings of the scale (``ENTRIES``), writing ``NAME.json`` (and ``NAME.png`` where it draws one).
It runs in a work folder (``--work``, default ``runs/bench/SCALE``: logs, node folders, checkpoints)
and its results file is copied into ``--out`` only when it succeeds, so a failed run leaves the last
good file in place. Every results file carries a ``meta`` record (``benchmarks.results_io``), with
``scale`` set from ``$LOCOMESH_BENCH_SCALE``, which the suite sets.

``quick`` fits about 45 minutes on 2 cores (``--list`` prints each entry's estimate): fewer steps,
rounds and configurations than ``full``, but still 3 seeds wherever the benchmark makes a quality
claim, and every ratio a table shows (against ddp, hivemind, dense) comes from runs in the same
process, alternated across seeds. ``full`` runs the settings the docs quote, for hours. An entry
that needs root (network namespaces, ``tc``) is skipped with its reason when the suite is not root;
an entry without settings at a scale is skipped with the reason. A failing benchmark is reported and
the suite goes on; it exits non-zero at the end if any failed. ``DIR/suite.json`` records every
entry's status, seconds and files.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from benchmarks import results_io
from benchmarks.suite_entries import ENTRIES, Entry

SCALES = ("quick", "full")


@dataclass
class Outcome:
    """What became of one entry: ``ok``, ``failed``, ``skipped`` (with why) or ``planned`` (--list)."""

    name: str
    status: str
    detail: str = ""
    seconds: float = 0.0
    files: list[str] = field(default_factory=list)


def skip_reason(entry: Entry, scale: str, is_root: bool) -> str | None:
    """Why ``entry`` does not run at ``scale`` on this machine, or None when it does."""
    if entry.args(scale) is None:
        return entry.why_not.get(scale, f"no {scale} settings")
    if entry.root and not is_root:
        return "needs root (network namespaces and tc); run the suite with sudo"
    return None


def select(entries: Sequence[Entry], only: Sequence[str] | None) -> list[Entry]:
    """The entries named by ``--only`` (in the suite's order), or all; an unknown name is an error."""
    if not only:
        return list(entries)
    names = [e.name for e in entries]
    unknown = [n for n in only if n not in names]
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(names)}")
    return [e for e in entries if e.name in only]


def command(entry: Entry, scale: str, out: Path) -> list[str]:
    """The entry's command line at ``scale``, writing its results to ``out``."""
    args = entry.args(scale)
    assert args is not None
    return [sys.executable, "-m", entry.module, *(a.replace("{out}", str(out)) for a in args)]


def run_entry(entry: Entry, scale: str, out_dir: Path, work: Path, timeout_s: float) -> Outcome:
    """Run one entry in its own process group (killed whole at ``timeout_s``), copy its files into
    ``out_dir`` when it succeeded."""
    folder = work / entry.name
    if folder.exists():
        shutil.rmtree(folder)  # every run starts from fresh node folders and checkpoints
    folder.mkdir(parents=True)
    result = folder / f"{entry.name}.json"
    log = folder / "log.txt"
    env = {**os.environ, results_io.SCALE_ENV: scale}
    started = time.monotonic()
    with open(log, "w") as f:
        process = subprocess.Popen(command(entry, scale, result), cwd=results_io.ROOT, stdout=f, stderr=subprocess.STDOUT,
                                   env=env, start_new_session=True)
        try:
            code = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            try:  # nothing it started (nodes, p2pd) may outlive it
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            process.wait()
    seconds = time.monotonic() - started
    if code is None:
        return Outcome(entry.name, "failed", f"stopped after {timeout_s / 60:.0f} min; log: {log}", seconds)
    if code != 0:
        tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:]
        return Outcome(entry.name, "failed", f"exit {code}: {tail[0][:160] if tail else ''}; log: {log}", seconds)
    if not result.exists():
        return Outcome(entry.name, "failed", f"exit 0 but no {result.name}; log: {log}", seconds)
    files = []
    for produced in (result, result.with_suffix(".png")):
        if produced.exists():
            out_dir.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(produced, out_dir / produced.name)
            files.append(str(out_dir / produced.name))
    return Outcome(entry.name, "ok", "", seconds, files)


def record_outcomes(path: Path, outcomes: list[Outcome], scale: str, work: Path, meta: results_io.RunMeta) -> None:
    """Write ``suite.json``: this invocation's outcomes, and an earlier invocation's at the same scale for
    the entries not run this time (``--only``), marked ``earlier``."""
    entries = [vars(o) for o in outcomes]
    try:
        earlier = json.loads(path.read_text())
    except (OSError, ValueError):
        earlier = {}
    if earlier.get("scale") == scale:
        ran = {o.name for o in outcomes}
        entries += [{**e, "earlier": True} for e in earlier.get("entries", []) if e.get("name") not in ran]
    counts = {s: sum(e["status"] == s for e in entries) for s in ("ok", "failed", "skipped")}
    results_io.write(path, {"scale": scale, "work": str(work), "summary": counts, "entries": entries}, meta)


def status_line(outcome: Outcome, estimate: float | None) -> str:
    est = f" (est. {estimate:g} min)" if estimate is not None else ""
    took = f"{outcome.seconds / 60:5.1f} min" if outcome.status in ("ok", "failed") else " " * 9
    what = ", ".join(outcome.files) if outcome.status == "ok" else outcome.detail
    return f"[{outcome.status:7s}] {outcome.name:24s} {took}{est}  {what}"


def listing(entries: Sequence[Entry], scale: str, is_root: bool) -> str:
    """The plan at ``scale``: every entry's module, arguments or skip reason, and the estimated total."""
    lines, total = [], 0.0
    for e in entries:
        why = skip_reason(e, scale, is_root)
        if why:
            lines.append(f"{e.name:24s} skip: {why}")
            continue
        minutes = e.minutes[scale]
        total += minutes
        lines.append(f"{e.name:24s} ~{minutes:g} min  python -m {e.module} {' '.join(e.args(scale) or ())}")
        lines.append(f"{'':24s} {e.docs}")
    lines.append(f"estimated total at {scale}: {total:.0f} min" + ("" if is_root else " (not root: namespace benchmarks skipped)"))
    return "\n".join(lines)


def main(argv: list[str] | None = None, entries: Sequence[Entry] = ENTRIES) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", choices=SCALES, default="quick")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="where the results files go")
    parser.add_argument("--work", type=Path, help="work folder for logs and node folders (default runs/bench/SCALE)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these entries")
    parser.add_argument("--list", action="store_true", help="print the plan and the estimated minutes, run nothing")
    parser.add_argument("--timeout-factor", type=float, default=3.0,
                        help="stop an entry after this many times its estimate (plus 5 minutes)")
    args = parser.parse_args(argv)
    chosen = select(entries, args.only)
    is_root = os.geteuid() == 0
    if args.list:
        print(listing(chosen, args.scale, is_root))
        return 0
    meta = results_io.begin(None if argv is None else ["python", "-m", "benchmarks.suite", *argv], scale=args.scale)
    work = (args.work or Path("runs/bench") / args.scale).resolve()
    out_dir = args.out.resolve()
    outcomes: list[Outcome] = []
    began = time.monotonic()
    print(f"benchmark suite, scale {args.scale}: {len(chosen)} entries; results into {out_dir}, work in {work}", flush=True)
    for entry in chosen:
        why = skip_reason(entry, args.scale, is_root)
        if why:
            outcome = Outcome(entry.name, "skipped", why)
        else:
            timeout = 60 * (args.timeout_factor * entry.minutes[args.scale] + 5)
            outcome = run_entry(entry, args.scale, out_dir, work, timeout)
        outcomes.append(outcome)
        print(status_line(outcome, entry.minutes.get(args.scale) if outcome.status != "skipped" else None), flush=True)
    counts = {s: sum(o.status == s for o in outcomes) for s in ("ok", "failed", "skipped")}
    elapsed = time.monotonic() - began
    print(f"\n{counts['ok']} ok, {counts['failed']} failed, {counts['skipped']} skipped in {elapsed / 60:.1f} min"
          + (f"; failed: {', '.join(o.name for o in outcomes if o.status == 'failed')}" if counts["failed"] else ""))
    record_outcomes(out_dir / "suite.json", outcomes, args.scale, work, meta)
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
