"""Results files of the benchmarks: one way to write them, each with a ``meta`` record of the run.

    meta = results_io.begin()            # when the benchmark starts: command, commit, load before, ...
    ...                                  # measure
    results_io.write(out, report, meta)  # atomic; adds the end time and the load after

``write`` puts ``meta`` first in the JSON object (``report`` keeps its own keys and layout) and
writes through a temporary file in the same folder and ``os.replace``, so a reader never sees a
half-written file and an interrupted run leaves the previous file whole. ``meta`` holds:

- ``command``: the command line (``python -m benchmarks.NAME ARGS``) and ``argv`` (the list);
- ``git_commit`` and ``git_dirty`` (tracked files modified; untracked files do not count);
- ``versions``: locomesh, torch, hivemind, numpy and Python (read from the installed packages'
  metadata, no import);
- ``cpu_count``, ``load_before`` and ``load_after`` (1, 5 and 15 minute load averages);
- ``started`` and ``ended`` (UTC, ISO 8601) and ``wall_s``;
- ``scale``: ``quick`` or ``full`` when ``benchmarks.suite`` ran the benchmark (it sets
  ``LOCOMESH_BENCH_SCALE``), else ``null`` (a run by hand).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

SCALE_ENV = "LOCOMESH_BENCH_SCALE"
ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("locomesh", "torch", "hivemind", "numpy")


def _utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _load() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not every platform has a load average
        return []


def git_state(root: Path = ROOT) -> tuple[str | None, bool | None]:
    """(commit, dirty) of the checkout at ``root``; (None, None) outside a git checkout."""
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    if commit.returncode != 0:
        return None, None
    return commit.stdout.strip(), bool(status.stdout.strip())


def versions() -> dict[str, str | None]:
    """Installed versions of the packages a result depends on (None where one is missing)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _command(argv: list[str]) -> str:
    """``python -m benchmarks.NAME ARGS`` for a module run with ``-m``, else the script and its arguments."""
    script = argv[0] if argv else ""
    path = Path(script).resolve() if script else None
    if path is not None and path.suffix == ".py" and ROOT in path.parents:
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        return shlex.join(["python", "-m", module, *argv[1:]])
    return shlex.join(argv)


@dataclass
class RunMeta:
    """What a results file says about the run that made it (see the module docstring)."""

    command: str
    argv: list[str]
    git_commit: str | None
    git_dirty: bool | None
    versions: dict[str, str | None]
    cpu_count: int | None
    load_before: list[float]
    started: str
    scale: str | None
    platform: str
    load_after: list[float] = field(default_factory=list)
    ended: str | None = None
    wall_s: float | None = None
    _t0: float = field(default=0.0, repr=False)

    def finish(self) -> dict[str, Any]:
        """The record as written now: with the current time as ``ended`` and the load after."""
        self.load_after, self.ended = _load(), _utc_now()
        self.wall_s = round(time.time() - self._t0, 1)
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}


def begin(argv: list[str] | None = None, scale: str | None = None) -> RunMeta:
    """Start a run's ``meta``: call it before measuring (``argv`` defaults to ``sys.argv``; ``scale``
    to ``$LOCOMESH_BENCH_SCALE``)."""
    args = list(sys.argv if argv is None else argv)
    commit, dirty = git_state()
    return RunMeta(command=_command(args), argv=args, git_commit=commit, git_dirty=dirty, versions=versions(),
                   cpu_count=os.cpu_count(), load_before=_load(), started=_utc_now(),
                   scale=scale if scale is not None else os.environ.get(SCALE_ENV) or None,
                   platform=platform.platform(), _t0=time.time())


def write_json(path: Path | str, payload: Any, indent: int | None = 1) -> None:
    """Write ``payload`` as JSON to ``path`` atomically (a temporary file beside it, then ``os.replace``);
    values JSON cannot hold are written as their ``str``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=indent, default=str)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write(path: Path | str, report: dict[str, Any], meta: RunMeta) -> None:
    """Write a results file: ``{"meta": ..., **report}``, atomically. Call it again to rewrite the file
    with what was measured since (``ended`` and ``load_after`` move on)."""
    write_json(path, {"meta": meta.finish(), **{k: v for k, v in report.items() if k != "meta"}})
