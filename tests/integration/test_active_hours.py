"""``node join --active-hours``: a node outside its window waits and stops cleanly on SIGTERM; one whose window
ends leaves by its normal path (final checkpoint) and waits for the next window.

The window arithmetic itself (midnight wrap, DST days) is unit-tested in tests/unit/test_active_hours.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from tests.helpers.swarm_utils import FAST_ARGS

ROOT = Path(__file__).resolve().parents[2]


def start(tmp_path: Path, window: str) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / "log.txt"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("LOCOMESH_")}, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "node", "join", *FAST_ARGS, "--active-hours", window, "--checkpoint-dir", str(tmp_path / "ck"),
           "--info-file", str(tmp_path / "info.json"), "--listen", "/ip4/127.0.0.1/tcp/0"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=ROOT)
    return proc, log


def wait_for(proc: subprocess.Popen, log: Path, text: str, timeout: float) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        content = log.read_text()
        if text in content:
            return content
        assert proc.poll() is None, f"exited with {proc.returncode} before logging {text!r}:\n{content[-3000:]}"
        time.sleep(0.3)
    raise AssertionError(f"no {text!r} after {timeout}s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> int:
    try:
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_outside_the_window_it_waits_and_stops_on_sigterm(tmp_path: Path) -> None:
    opens = (datetime.now().hour + 2) % 24  # a window that opens 1 to 2 hours from now
    window = f"{opens}-{(opens + 1) % 24}"
    proc, log = start(tmp_path, window)
    try:
        wait_for(proc, log, f"outside --active-hours {opens:02d}-{(opens + 1) % 24:02d}: waiting until {opens:02d}:00", 90)
    finally:
        code = stop(proc)
    assert code == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert "is up" not in text and not (tmp_path / "info.json").exists()  # it never joined


@pytest.mark.slow
def test_the_window_end_makes_the_node_leave_with_a_checkpoint_and_wait(tmp_path: Path) -> None:
    now = datetime.now()
    begin, end = now - timedelta(minutes=1), now + timedelta(minutes=3)  # closes at a minute boundary 2 to 3 minutes away
    window = f"{begin.hour}:{begin.minute:02d}-{end.hour}:{end.minute:02d}"
    proc, log = start(tmp_path, window)
    try:
        wait_for(proc, log, "is up", 90)
        wait_for(proc, log, "ended: leaving the swarm until", 240)
        text = wait_for(proc, log, "outside --active-hours", 120)
        assert "stopped cleanly" in text  # the node's own leave path ran to its end
        assert (tmp_path / "ck" / "checkpoint.pt").exists()
    finally:
        code = stop(proc)
    assert code == 0, log.read_text()[-3000:]
