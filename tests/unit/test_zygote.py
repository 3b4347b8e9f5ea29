"""The test zygote (tests/helpers/zygote.py) starts children that behave as ``python -m MODULE`` would:
their own arguments, folder, environment, session and log, a fresh ``random``, and exit codes (signals
included) reported as :class:`subprocess.Popen` reports them."""

import json
import signal
import subprocess

import pytest

from tests.helpers.zygote import Zygote


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


def _seen(log):
    return json.loads(log.read_text().splitlines()[0])


def test_a_child_runs_with_its_own_arguments_folder_environment_session_and_log(zygote, tmp_path):
    logs = [tmp_path / f"log{i}.txt" for i in range(2)]
    children = [zygote.spawn("tests.helpers.zygote_probe", ["3", "extra"], {"ZYGOTE_PROBE": f"child{i}"}, log, cwd=tmp_path)
                for i, log in enumerate(logs)]
    assert [c.wait(timeout=30) for c in children] == [3, 3]
    seen = [_seen(log) for log in logs]
    assert [s["probe"] for s in seen] == ["child0", "child1"]
    for s in seen:
        assert s["argv"] == ["3", "extra"] and s["cwd"] == str(tmp_path) and s["own_session"] and s["modules"]
    assert seen[0]["random"] != seen[1]["random"], "each child draws its own random numbers"
    assert "to stderr" in logs[0].read_text()


def test_a_signalled_child_reports_minus_the_signal_and_waits_time_out(zygote, tmp_path):
    child = zygote.spawn("tests.helpers.zygote_probe", ["sleep"], {}, tmp_path / "log.txt")
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.5)
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=30) == -signal.SIGTERM and child.returncode == -signal.SIGTERM
    child.kill()  # a finished child is left alone


def test_a_child_that_reuses_an_old_childs_pid_does_not_read_its_exit_code(zygote, tmp_path):
    """pid_max is 32768 here and torch's threads draw from the same ids, so a suite reuses pids: reports
    name the request, and a new daemon on an old pid stays running until it exits itself."""
    import os

    old = zygote.spawn("tests.helpers.zygote_probe", ["3"], {}, tmp_path / "old.txt")
    assert old.wait(timeout=30) == 3
    last_pid = "/proc/sys/kernel/ns_last_pid"
    if os.geteuid() != 0 or not os.access(last_pid, os.W_OK):
        pytest.skip("steering the next pid needs root (/proc/sys/kernel/ns_last_pid)")
    for attempt in range(50):
        with open(last_pid, "w") as steer:
            steer.write(str(old.pid - 1))
        new = zygote.spawn("tests.helpers.zygote_probe", ["sleep"], {}, tmp_path / f"new{attempt}.txt")
        if new.pid == old.pid:
            break
        new.kill()
        new.wait(timeout=30)
    else:
        pytest.skip("another process took the steered pid 50 times")
    assert new.poll() is None, "the new child read the old child's exit code"
    new.send_signal(signal.SIGTERM)
    assert new.wait(timeout=30) == -signal.SIGTERM and old.returncode == 3
