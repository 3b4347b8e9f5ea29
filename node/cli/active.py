"""``node join --active-hours 22-07``: a supervisor that runs one ``node join`` per window of active hours.

Outside the window it waits ("outside --active-hours 22-07: waiting until 22:00"); at the window's start
it starts the same ``node join`` as a child process (which resumes from its --checkpoint-dir or downloads
the swarm's state, as any joiner does); at the window's end it sends the child SIGTERM, so the node
leaves by its normal path (final checkpoint, record removed), and waits again. A fresh process per
window gives back all of the node's memory while it is out. SIGTERM or SIGINT to the supervisor is
passed on to the child and ends both. A child that stops by itself (--max-steps, --duration, refused,
failed) ends the supervisor with its exit code, so a service manager restarts it on failure.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from datetime import datetime
from typing import Any

from node.config import NodeConfig
from node.config.active_hours import ActiveHours, parse_active_hours
from node.errors import UserError

SUPERVISED_ENV = "LOCOMESH_SUPERVISED"  # set for the supervisor's child: it runs its window without supervising
POLL_S = 1.0  # how often the clock is read: a DST change or a suspended laptop is noticed within this
logger = logging.getLogger("locomesh.node")
invocation: list[str] = []  # ``node``'s own arguments (set by node.cli.app.main), given again to each child


def supervise(active_hours: str, args: list[str] | None = None) -> int:
    """Run ``node <args>`` inside each window of ``active_hours`` until SIGTERM/SIGINT; returns the exit code."""
    hours = parse_active_hours(active_hours)
    args = list(args if args is not None else invocation or sys.argv[1:])
    stop = threading.Event()

    def handler(signum: int, _frame: Any) -> None:
        if not stop.is_set():
            logger.info("received %s: stopping", signal.Signals(signum).name)
            stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    while not stop.is_set():
        now = datetime.now()
        if not hours.contains(now):
            _wait_for_window(hours, now, stop)
            continue
        code, closed = _run_window(hours, args, stop)
        if not closed and not stop.is_set():
            return code  # the node stopped by itself: finished, refused or failed
        if code != 0:
            logger.error("the node exited with code %d while leaving (--active-hours %s)", code, hours.text)
            return code
    return 0


def check_memory(cfg: NodeConfig, args: list[str] | None = None) -> None:
    """``node join``'s memory check for a supervisor. On a GPU it runs as ``node join ... --dry-run`` in a
    process of its own: asking CUDA for its free memory here would keep a CUDA context in the supervisor
    for as long as it runs."""
    from node.cli.preflight import check_memory as check_here
    from node.ops.memory import device_of

    if device_of(cfg) != "cuda":
        check_here(cfg)
        return
    args = list(args if args is not None else invocation or sys.argv[1:])
    out = subprocess.run([sys.executable, "-m", "node", *args, "--dry-run"], capture_output=True, text=True,
                         env={**os.environ, SUPERVISED_ENV: "1"})
    if out.returncode != 0:
        lines = (out.stdout.strip() or out.stderr.strip()).splitlines()
        raise UserError(lines[-1].removeprefix("error: ") if lines else f"the memory check failed (exit {out.returncode})")


def _wait_for_window(hours: ActiveHours, now: datetime, stop: threading.Event) -> None:
    start = hours.next_start(now)
    logger.info("outside --active-hours %s: waiting until %s", hours.text, start.strftime("%H:%M"))
    while not stop.is_set() and not hours.contains(datetime.now()):
        stop.wait(POLL_S)


def _run_window(hours: ActiveHours, args: list[str], stop: threading.Event) -> tuple[int, bool]:
    """One ``node join`` from now to the window's end; (its exit code, whether the window's end stopped it)."""
    end = hours.end_after(datetime.now())
    logger.info("inside --active-hours %s until %s: joining", hours.text, end.strftime("%H:%M"))
    proc = subprocess.Popen([sys.executable, "-m", "node", *args], env={**os.environ, SUPERVISED_ENV: "1"})
    closed = False
    while proc.poll() is None:
        if not closed and (stop.is_set() or not hours.contains(datetime.now())):
            if not stop.is_set():
                logger.info("--active-hours %s ended: leaving the swarm until %s", hours.text,
                            hours.next_start(datetime.now()).strftime("%H:%M"))
            proc.send_signal(signal.SIGTERM)  # the node leaves by its own path; then wait for it
            closed = True
        try:
            proc.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
    return proc.returncode, closed
