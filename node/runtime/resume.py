"""Resuming a node's own checkpoint, only when it belongs to the same run and settings.

A checkpoint folder reused by a run with another algorithm, codec, model or run id would otherwise
be resumed silently and the new run would measure nothing it claims to. :func:`load_resumable`
refuses such a checkpoint with a message naming each difference and the way out (another
``--checkpoint-dir``, or ``--fresh``, which moves the old checkpoint aside and starts over).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from node.checkpoints.checkpoint import CHECKPOINT_NAME, load
from node.runtime.settings import differences, settings_from_saved_config

logger = logging.getLogger("locomesh.node")


class ResumeRefused(Exception):
    """The checkpoint in ``--checkpoint-dir`` was written by another run or with other settings."""


def saved_settings(state: dict[str, Any]) -> dict[str, Any]:
    """The run settings a checkpoint was written with."""
    if isinstance(state.get("settings"), dict):
        return state["settings"]
    return settings_from_saved_config(state.get("config") or {})


def move_aside(path: Path) -> Path:
    """Rename a checkpoint to ``checkpoint.replaced-<UTC time>.pt`` next to it; returns the new path."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = path.with_name(f"{path.stem}.replaced-{stamp}{path.suffix}")
    n = 1
    while target.exists():
        target = path.with_name(f"{path.stem}.replaced-{stamp}-{n}{path.suffix}")
        n += 1
    os.replace(path, target)
    return target


def inspect_checkpoint(directory: Path, settings: dict[str, Any]) -> tuple[Path, int, list[str]] | None:
    """(path, round, differences from ``settings``) of the checkpoint in ``directory``, or None when there
    is none or it does not load. Changes nothing (``node swarm`` says before it starts what will resume)."""
    path = Path(directory) / CHECKPOINT_NAME
    if not path.exists():
        return None
    try:
        state = load(path)
    except ValueError:
        return None
    return path, int(state.get("round", 0)), differences(settings, saved_settings(state))


def check_resumable(directory: Path, settings: dict[str, Any], fresh: bool = False) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint in ``directory`` to resume, or None to start fresh.

    With ``fresh`` an existing checkpoint is moved aside (logged) and None returned. A checkpoint that
    does not load is reported and ignored (a torn file cannot be resumed anyway). Raises
    :class:`ResumeRefused` when it was written with other run settings."""
    path = Path(directory) / CHECKPOINT_NAME
    if not path.exists():
        return None
    if fresh:
        moved = move_aside(path)
        logger.warning("--fresh: moved the old checkpoint aside to %s; starting over", moved)
        return None
    try:
        state = load(path)
    except ValueError as e:
        logger.warning("ignoring checkpoint: %s", e)
        return None
    diffs = differences(settings, saved_settings(state))
    if diffs:
        raise ResumeRefused(
            f"checkpoint {path} was written with {', '.join(diffs)}: resuming it would mix two runs. "
            f"Use another --checkpoint-dir, or add --fresh to move it aside and start over"
        )
    return path, state

