"""Shared fixtures and the suite's order: real daemons started by a test are always torn down, whatever
the test's outcome; under pytest-xdist (``make test``) the longest live tests are handed out first."""

import json
import os
from pathlib import Path

import pytest
import torch

from tests.helpers.swarm_utils import kill_group

# Seconds each live test took in a `make test` run (pytest --junitxml): only the order depends on it, so a
# stale or missing entry costs wall time, never a result. Tests not listed count as DEFAULT_SECONDS.
DURATIONS = json.loads((Path(__file__).parent / "durations.json").read_text())
DEFAULT_SECONDS = 3.0

if os.environ.get("PYTEST_XDIST_WORKER"):
    # several workers share the cores: one intra-op thread each (two spinning OpenMP threads per worker
    # on a busy machine slowed a 15 s step to minutes); tests that need more set it themselves
    torch.set_num_threads(1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Live tests first, longest first, then the in-process ones in file order: xdist's load scheduler
    hands tests out in this order, so the long waits overlap and the quick tests fill the gaps."""
    def weight(item: pytest.Item) -> float:
        if "/integration/" not in f"/{item.nodeid}":
            return 0.0
        return DURATIONS.get(item.nodeid, DEFAULT_SECONDS)
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (-weight(item), order[id(item)]))


@pytest.fixture
def nodes():
    """A list the test appends its NodeHandles to; every node's process group is killed afterwards."""
    started = []
    yield started
    for handle in started:
        kill_group(handle)
