"""Make helper processes die with the daemon, even when the daemon is SIGKILLed.

hivemind starts the go-libp2p daemon (p2pd) as a child process without a parent-death signal, so a
daemon killed with SIGKILL would leave p2pd running. ``guard_child`` starts a tiny shell watchdog
whose parent-death signal is SIGTERM: when the daemon dies for any reason, the kernel signals the
watchdog, which kills the guarded child.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess

logger = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def release(watchdog: subprocess.Popen) -> None:
    """Stop a watchdog after a clean shutdown (its whole group: the shell and its sleeping child)."""
    try:
        os.killpg(watchdog.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    watchdog.wait()


def guard_child(pid: int) -> subprocess.Popen | None:
    """Kill ``pid`` when this process dies; returns the watchdog (None where prctl is unavailable)."""
    parent = os.getpid()
    script = (
        f'trap \'kill -9 {pid} 2>/dev/null; kill $nap 2>/dev/null; exit 0\' TERM; '
        # the parent may have died between fork and prctl: then act at once
        f'[ "$PPID" = "{parent}" ] || {{ kill -9 {pid} 2>/dev/null; exit 0; }}; '
        "while :; do sleep 3600 & nap=$!; wait $nap; done"
    )
    try:
        return subprocess.Popen(["/bin/sh", "-c", script], preexec_fn=_die_with_parent, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    except (OSError, AttributeError) as e:
        logger.warning("cannot guard child %d against orphaning: %s", pid, e)
        return None
