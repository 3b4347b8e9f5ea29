"""Builds compared side by side (``benchmarks.revisions``): a revision's worktree holds its own code and is gone after."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks.revisions import ROOT, checkouts, env_for


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs this repository's git history")
def test_a_revision_is_checked_out_beside_the_working_tree_and_removed_after() -> None:
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    with checkouts(["HEAD", "."]) as builds:
        code, label = builds["HEAD"]
        assert code != ROOT and (code / "node" / "__init__.py").exists() and label == head
        assert builds["."] == (ROOT, f"{head} (working tree)")
        found = subprocess.run([sys.executable, "-c", "import node; print(node.__file__)"], capture_output=True, text=True,
                               cwd=code, env=env_for(code)).stdout.strip()
        assert found == str(code / "node" / "__init__.py"), "python -m node runs that revision's code"
    assert not code.exists()
    listed = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True).stdout
    assert str(code) not in listed
