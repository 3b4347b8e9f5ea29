"""The wheel in clean venvs: build it once, install it with its dependencies into a fresh venv of each
Python, and run a 2-node swarm from the installed ``node`` command.

    python -m benchmarks.wheel_install --pythons python3.11,python3.12,python3.13 --out benchmarks/results/wheel_install.json

Per Python: the install's seconds (``pip install locomesh-*.whl -c constraints.txt``: every dependency
from the package index or pip's find-links, nothing from this checkout), the torch it got, and
``node swarm --nodes 2 --duration 30`` run outside the checkout: exit code, steps, rounds and held-out
loss per node. The venvs live in a temporary folder and are removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import results_io

ROOT = Path(__file__).resolve().parents[1]


def tracked_sources(dest: Path) -> None:
    """Copy what a release builds from (the files git tracks, as they are in the working tree) to ``dest``."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, (f.decode() for f in files)):
        source = ROOT / name
        if source.is_file():
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())


def build_wheel(work: Path) -> Path:
    """The wheel of the tracked files (``pip wheel --no-deps``, offline: setuptools comes from this
    environment), built in a copy under ``work`` so the checkout gets no build folders."""
    src, dist = work / "src", work / "dist"
    tracked_sources(src)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                          "--no-index", "-w", str(dist), str(src)], capture_output=True, text=True, timeout=600, cwd=work)
    if out.returncode:
        raise RuntimeError(f"pip wheel failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    wheels = list(dist.glob("locomesh-*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one locomesh wheel in {dist}, found {wheels}")
    return wheels[0]


def try_python(python: str, wheel: Path, work: Path, duration: int) -> dict[str, Any]:
    """Install ``wheel`` into a fresh venv of ``python`` and run a short swarm from it."""
    venv = work / f"venv-{Path(python).name}"
    row: dict[str, Any] = {"python": python}
    subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=300)
    bin_ = venv / "bin"
    row["python_version"] = subprocess.run([str(bin_ / "python"), "-c", "import platform; print(platform.python_version())"],
                                           capture_output=True, text=True, check=True).stdout.strip()
    start = time.monotonic()
    install = subprocess.run([str(bin_ / "python"), "-m", "pip", "install", "--quiet", "-c", str(ROOT / "constraints.txt"),
                              str(wheel)], capture_output=True, text=True, timeout=3600, cwd=work)
    row["install_s"] = round(time.monotonic() - start, 1)
    row["install_rc"] = install.returncode
    if install.returncode:
        row["install_error"] = install.stderr[-2000:]
        return row
    row["torch"] = subprocess.run([str(bin_ / "python"), "-c", "import torch; print(torch.__version__)"],
                                  capture_output=True, text=True, cwd=work).stdout.strip()
    report = work / f"swarm-{Path(python).name}" / "report.json"
    start = time.monotonic()
    swarm = subprocess.run([str(bin_ / "node"), "swarm", "--nodes", "2", "--duration", str(duration), "--report", str(report)],
                           capture_output=True, text=True, timeout=duration + 600, cwd=work)
    row["swarm_s"] = round(time.monotonic() - start, 1)
    row["swarm_rc"] = swarm.returncode
    if swarm.returncode or not report.is_file():
        row["swarm_error"] = (swarm.stdout + swarm.stderr)[-2000:]
        return row
    nodes = json.loads(report.read_text())["nodes"]
    row["nodes"] = [{k: node.get(k) for k in ("exit_code", "steps", "outer_rounds", "train_loss_first", "val_loss")}
                    for node in nodes]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pythons", default="python3.11", help="comma-separated interpreters to try")
    parser.add_argument("--duration", type=int, default=30, help="seconds of each `node swarm`")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    meta = results_io.begin(None if argv is None else ["python", "-m", "benchmarks.wheel_install", *argv])
    with tempfile.TemporaryDirectory(prefix="locomesh-wheel-") as folder:
        work = Path(folder)
        wheel = build_wheel(work)
        rows = []
        for python in filter(None, (p.strip() for p in args.pythons.split(","))):
            print(f"… {python}", file=sys.stderr, flush=True)
            rows.append(try_python(python, wheel, work, args.duration))
            print(json.dumps(rows[-1]), flush=True)
        results = {"wheel": wheel.name, "wheel_bytes": wheel.stat().st_size, "duration_s": args.duration, "runs": rows}
    if args.out:
        results_io.write(args.out, results, meta)
    return 0 if all(r.get("swarm_rc") == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
