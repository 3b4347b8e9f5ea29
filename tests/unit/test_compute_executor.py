"""The network loop's executor: calls run on daemon threads, and a stopping node can wait for them."""

import subprocess
import sys
import threading

from node.runtime.network import DaemonThreadExecutor


def test_wait_idle_reports_a_call_in_flight_and_returns_once_it_is_done():
    executor = DaemonThreadExecutor()
    release = threading.Event()
    future = executor.submit(release.wait, 30)
    assert not executor.wait_idle(0.05)
    release.set()
    assert executor.wait_idle(10)
    assert future.result(timeout=1) is True
    assert executor.wait_idle(0)


def test_a_failed_call_still_leaves_the_executor_idle():
    executor = DaemonThreadExecutor()
    future = executor.submit(lambda: 1 / 0)
    assert executor.wait_idle(10)
    assert isinstance(future.exception(timeout=1), ZeroDivisionError)


def test_a_node_that_cannot_wait_for_a_running_kernel_still_exits_with_its_code_and_its_output():
    # interpreter teardown under a daemon thread inside torch aborts (SIGABRT): node.cli.app leaves with
    # os._exit when NetworkThread.shutdown's wait for the work in flight ran out
    script = """
import logging, threading, time, torch
from node.cli.app import _exit_now
from node.runtime.network import DaemonThreadExecutor
def work():
    a = torch.ones(400, 400)
    while True:
        a = (a @ a).clamp_(-1, 1)
executor = DaemonThreadExecutor()
executor.submit(work)
time.sleep(0.3)
assert not executor.wait_idle(0)
logging.basicConfig(level=logging.INFO)
logging.getLogger("x").info("stopped cleanly")
print("last words", end="")
_exit_now(3)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "last words"
    assert "stopped cleanly" in done.stderr
