"""One daemon per checkpoint folder: a lock file holding the owner's pid and peer id.

The lock is an ``flock`` on ``<folder>/.locomesh.lock``, so the kernel releases it when the process
dies however it dies; the file's text (pid, peer id, start time) only names the owner in messages.
A second daemon is refused with that owner named; a lock file left by a dead process is taken over
with a warning.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from pathlib import Path

from node.errors import UserError

logger = logging.getLogger("locomesh.node")
LOCK_NAME = ".locomesh.lock"


class FolderLock:
    """An exclusive lock on a checkpoint folder for this process's lifetime (or until :meth:`release`)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> "FolderLock":
        """Take the lock; raises :class:`UserError` naming the owner when another live daemon holds it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _describe(_read(fd))
            os.close(fd)
            raise UserError(f"--checkpoint-dir {self.folder} is in use by {owner}: stop that daemon first, "
                            "or give this one another --checkpoint-dir") from None
        previous = _read(fd)
        if previous.get("pid") and previous.get("pid") != os.getpid():
            logger.warning("taking over the lock of %s in %s: that process is gone", _describe(previous), self.folder)
        self._fd = fd
        self.set_peer("")
        return self

    def set_peer(self, peer_id: str) -> None:
        """Record this daemon's peer id once the network is up (shown to a second daemon)."""
        if self._fd is None:
            return
        text = json.dumps({"pid": os.getpid(), "peer_id": peer_id, "since": round(time.time(), 3)}).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, text, 0)

    def release(self) -> None:
        """Give the lock up, leaving an empty file: a later daemon then finds no stale owner. (The file
        is not removed: a daemon that opened it just before would lock a file nobody else sees.)"""
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _read(fd: int) -> dict:
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _describe(owner: dict) -> str:
    pid, peer = owner.get("pid"), owner.get("peer_id")
    if not pid:
        return "another daemon"
    return f"pid {pid}" + (f" (peer {peer})" if peer else "")
