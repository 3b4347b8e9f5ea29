"""Shared fixtures: real daemons started by a test are always torn down, whatever the test's outcome."""

import pytest

from tests.helpers.swarm_utils import kill_group


@pytest.fixture
def nodes():
    """A list the test appends its NodeHandles to; every node's process group is killed afterwards."""
    started = []
    yield started
    for handle in started:
        kill_group(handle)
