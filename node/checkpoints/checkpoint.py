"""Checkpoints: written atomically (temp file, fsync, rename, fsync dir) and loaded with ``weights_only=True``."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)
CHECKPOINT_NAME = "checkpoint.pt"


def save_atomic(state: dict[str, Any], path: Path) -> Path:
    """Write ``state`` so that ``path`` holds either the old or the new checkpoint, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    return path


def remove_partial(directory: Path) -> list[Path]:
    """Remove the temporary files of writes that never finished (a process killed mid-write leaves one;
    ``checkpoint.pt`` itself is whole). Call only while holding the folder's lock. Returns what went."""
    gone = sorted(Path(directory).glob(f"{CHECKPOINT_NAME}.*.tmp"))
    for path in gone:
        logger.warning("removing %s: a checkpoint write that never finished (the checkpoint itself is whole)", path)
        _unlink_quietly(str(path))
    return gone


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def load(path: Path) -> dict[str, Any]:
    """Load a checkpoint (tensors and plain containers only)."""
    try:
        return torch.load(Path(path), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"no checkpoint at {path}") from None
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise ValueError(f"{path} is not a readable locomesh checkpoint ({first}); give the checkpoint.pt a node wrote") from None


def newest_valid(directory: Path) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint in ``directory`` if it loads, else None (a corrupt file is reported, not fatal)."""
    path = Path(directory) / CHECKPOINT_NAME
    if not path.exists():
        return None
    try:
        return path, load(path)
    except ValueError as e:
        logger.warning("ignoring checkpoint: %s", e)
        return None
