"""Mutation testing of the math modules: how many small bugs (mutants) their unit tests catch.

``make mutate`` runs mutmut with the settings in ``pyproject.toml`` (``[tool.mutmut]``: the modules open
to mutation and the unit tests that guard them), then this script writes the score per module to
``benchmarks/results/mutation.json`` and prints it. mutmut changes one operator, constant, argument or
call at a time in a module's functions and runs the tests that reach that function; a mutant that no
test fails on "survived", and one in a function no test reaches has "no tests". ``python -m mutmut show
NAME`` prints a survivor's diff.

Summarise an existing run without re-running it: ``python -m tests.mutate --summary-only``.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import results_io

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "mutation.json"
LINE = re.compile(r"^\s*(?P<name>(?P<module>\w+\.\w+)\.\S+__mutmut_\d+): (?P<status>.+)$")


def summarise(listing: str) -> dict[str, dict]:
    """Per module (``gossip.aggregate``…): mutants, killed, the survivors by name, other outcomes, and the score
    killed / (mutants − mutants no test reaches). Mutants with no tests are counted, not hidden."""
    modules: dict[str, dict] = {}
    for line in listing.splitlines():
        match = LINE.match(line)
        if not match:
            continue
        entry = modules.setdefault(match["module"], {"mutants": 0, "killed": 0, "survived": [], "no_tests": [], "other": {}})
        entry["mutants"] += 1
        status = match["status"].strip()
        if status == "killed":
            entry["killed"] += 1
        elif status == "survived":
            entry["survived"].append(match["name"])
        elif status == "no tests":
            entry["no_tests"].append(match["name"])
        else:
            entry["other"][status] = entry["other"].get(status, 0) + 1
    for entry in modules.values():
        entry["score"] = round(entry["killed"] / entry["mutants"], 4) if entry["mutants"] else None
    return modules


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--summary-only", action="store_true", help="summarise the last run in ./mutants")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    meta = results_io.begin(["make", "mutate", *sys.argv[1:]])
    started = time.time()
    if not args.summary_only:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", str(args.jobs)], cwd=ROOT, env=env, check=True)
    listing = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
    modules = summarise(listing)
    report = {"command": "make mutate", "commit": meta.git_commit, "dirty": meta.git_dirty,
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cores": os.cpu_count(),
              "python": platform.python_version(), "seconds": None if args.summary_only else round(time.time() - started),
              "modules": modules}
    results_io.write(OUT, report, meta)
    total = {k: sum(e[k] for e in modules.values()) for k in ("mutants", "killed")}
    for module, entry in sorted(modules.items()):
        print(f"{module:24s} {entry['killed']:4d}/{entry['mutants']:<4d} killed ({entry['score']:.1%})  "
              f"survived {len(entry['survived'])}  no tests {len(entry['no_tests'])}  other {entry['other'] or '-'}")
    if total["mutants"]:
        print(f"{'all':24s} {total['killed']:4d}/{total['mutants']:<4d} killed ({total['killed'] / total['mutants']:.1%})")
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
