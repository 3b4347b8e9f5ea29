"""What the project says it supports: pyproject.toml, ``node doctor`` and constraints.txt agree."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from node.ops.doctor import PYTHONS, TORCH_NEWEST, TORCH_OLDEST, torch_supported

ROOT = Path(__file__).resolve().parents[2]


def test_torch_versions_in_and_out_of_the_tested_range():
    assert torch_supported("2.13.0") and torch_supported("2.13.0+cpu") and torch_supported("2.11.0a0+git1234")
    assert torch_supported("2.12.1+cu130")
    assert not torch_supported("2.10.0") and not torch_supported("2.14.0") and not torch_supported("3.0.0")
    assert not torch_supported("nightly")


def test_pyproject_and_doctor_name_the_same_pythons_and_torch_range():
    text = (ROOT / "pyproject.toml").read_text()
    low, high = re.search(r'requires-python = ">=(\d+\.\d+),<(\d+\.\d+)"', text).groups()
    assert (tuple(map(int, low.split("."))), tuple(map(int, high.split(".")))) == (PYTHONS[0], (3, PYTHONS[-1][1] + 1))
    oldest, newest = re.search(r'"torch>=(\d+\.\d+),<(\d+\.\d+)"', text).groups()
    assert tuple(map(int, oldest.split("."))) == TORCH_OLDEST
    assert tuple(map(int, newest.split("."))) == (TORCH_NEWEST[0], TORCH_NEWEST[1] + 1)
    pinned = re.search(r"^torch==(\d+)\.(\d+)\.", (ROOT / "constraints.txt").read_text(), re.M).groups()
    assert tuple(map(int, pinned)) == TORCH_NEWEST  # make setup and CI install the newest tested torch
    assert sys.version_info[:2] in PYTHONS  # the suite itself runs on a supported Python
