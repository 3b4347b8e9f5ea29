"""What two real daemons hold: peak RSS of each against ``node join --dry-run``, for one or more builds.

    python -m benchmarks.daemon_memory --revs e77ca99,HEAD --data shards --out benchmarks/results/llama150m_memory_X.json \\
        [--duration 120] -- --model llama-150m --batch-size 1 --context 32 --inner-steps 3 --threads 1 --eval-every 0

For each git revision (a temporary worktree of this repository; ``.`` = the working tree as it is), back to
back in one invocation: ``node swarm --nodes 2 --duration D`` with the join options after ``--`` (each daemon
gets a ``--checkpoint-dir``, as ``node swarm`` gives it), then per daemon its peak RSS (the summary's
``peak_mem_mb``, the process without its p2pd), its rounds and those both peers averaged in, and the
``--dry-run`` estimate of the same options with a ``--checkpoint-dir`` (from that revision's code).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import results_io
from benchmarks.revisions import checkout, env_for, label, remove


def _estimate_gib(code: Path, options: list[str], data: Path | None) -> float:
    cmd = [sys.executable, "-m", "node", "join", "--dry-run", *options, "--checkpoint-dir", tempfile.mkdtemp(prefix="lm-dry-"),
           *(["--data", str(data)] if data else [])]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=code, env=env_for(code),
                         timeout=300)
    found = re.search(r"total RAM\s*│\s*RAM\s*│\s*([\d.]+) GiB", out.stdout)
    if not found:
        raise RuntimeError(f"no estimate in --dry-run's output: {out.stdout[-800:]} {out.stderr[-800:]}")
    return float(found.group(1))


def run_rev(rev: str, options: list[str], data: Path | None, duration: float, work: Path) -> dict[str, Any]:
    code = checkout(rev, work / "code")
    try:
        report = work / "report.json"
        cmd = [sys.executable, "-m", "node", "swarm", "--nodes", "2", "--duration", str(duration), "--report", str(report),
               *options, *(["--data", str(data)] if data else [])]
        subprocess.run(cmd, cwd=code, env=env_for(code), capture_output=True,
                       timeout=duration + 600, check=True)
        nodes = json.loads(report.read_text())["nodes"]
        estimate = _estimate_gib(code, options, data)
        peaks = [round(n["peak_mem_mb"] / 1024, 2) for n in nodes]
        return {"rev": rev, "commit": label(rev, code), "peak_rss_gib": peaks,
                "dry_run_gib": estimate, "ratio_to_estimate": [round(p / estimate, 2) for p in peaks],
                "rounds_each": [n["outer_rounds"] for n in nodes],
                "rounds_with_both_peers": [sum(1 for r in n["rounds"] if r["contributors"] == 2) for n in nodes],
                "exit_codes": [n["exit_code"] for n in nodes], "steps": [n["steps"] for n in nodes],
                "median_round_s": [sorted(r["duration_s"] for r in n["rounds"])[len(n["rounds"]) // 2] if n["rounds"] else None
                                   for n in nodes]}
    finally:
        remove(code)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    options = argv[argv.index("--") + 1:] if "--" in argv else []
    ours = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--revs", default=".", help="comma-separated git revisions ('.' = the working tree)")
    parser.add_argument("--data", type=Path, default=None, help="the --data folder (made absolute)")
    parser.add_argument("--duration", type=float, default=120.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(ours)
    meta = results_io.begin(["python", "-m", "benchmarks.daemon_memory", *argv])
    data = args.data.resolve() if args.data else None
    runs = []
    for rev in args.revs.split(","):
        with tempfile.TemporaryDirectory(prefix="lm-mem-") as work:
            runs.append(run_rev(rev, options, data, args.duration, Path(work)))
        print(json.dumps(runs[-1]), flush=True)
    results_io.write(args.out, {"what": "two daemons on loopback (node swarm --nodes 2): peak RSS per daemon against node join "
                                        "--dry-run with the same options and a --checkpoint-dir", "options": options,
                                "duration_s": args.duration, "runs": runs}, meta)


if __name__ == "__main__":
    main()
