"""Other builds of this repository, for benchmarks that compare them side by side in one invocation.

A revision is checked out in a temporary git worktree (``.``: the working tree as it is) and its processes run
from that folder with it first on the import path, so ``python -m node ...`` is that revision's code.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]


def env_for(code: Path) -> dict[str, str]:
    """This environment, with ``code`` (a revision's checkout) on the import path."""
    return {**os.environ, "PYTHONPATH": str(code)}


def checkout(rev: str, into: Path) -> Path:
    """``rev`` checked out at ``into`` (a detached worktree); ``.`` is this working tree itself."""
    if rev == ".":
        return ROOT
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(into), rev], check=True, capture_output=True)
    return into


def remove(code: Path) -> None:
    """Remove a worktree made by :func:`checkout` (never this working tree)."""
    if code != ROOT:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(code)], capture_output=True)


def label(rev: str, code: Path) -> str:
    """The short commit a checkout holds, marked when it is the working tree (which may hold uncommitted changes)."""
    commit = subprocess.run(["git", "-C", str(code), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return commit + (" (working tree)" if rev == "." else "")


@contextmanager
def checkouts(revs: list[str]) -> Iterator[dict[str, tuple[Path, str]]]:
    """{rev: (its checkout, its label)} for every revision, removed again on exit."""
    with tempfile.TemporaryDirectory(prefix="lm-revs-") as work:
        made: dict[str, tuple[Path, str]] = {}
        try:
            for i, rev in enumerate(revs):
                code = checkout(rev, Path(work) / f"rev{i}")
                made[rev] = (code, label(rev, code))
            yield made
        finally:
            for code, _ in made.values():
                remove(code)
