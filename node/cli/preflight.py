"""Checks of a ``node join`` configuration against this machine, before anything starts.

Each mistake a user can make with a path, a port or a device is found here and raised as one
:class:`UserError` that names the flag, what is wrong and what to do; the checkpoint folder is
locked (one daemon per folder, ``node.checkpoints.folder_lock``). The daemon itself then only fails on what
cannot be known in advance (a peer that refuses us, a disk that fills up).
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

from node.config import NodeConfig
from node.errors import UserError
from node.checkpoints.folder_lock import FolderLock


def _why(e: OSError) -> str:
    return e.strerror or str(e)


def check_data(path: Path | None) -> None:
    """``--data``: an existing, readable text file or folder."""
    if path is None:
        return
    if not path.exists():
        raise UserError(f"--data {path}: no such file or folder; give a text file or a folder of .txt/.md files "
                        "(or leave --data out to train on the embedded corpus)")
    if not os.access(path, os.R_OK):
        raise UserError(f"--data {path}: not readable by this user; check its permissions")
    if path.is_file() and path.stat().st_size == 0:
        raise UserError(f"--data {path} is empty; add text to it or point --data elsewhere")


def check_writable_folder(flag: str, folder: Path) -> None:
    """``folder`` exists (created if needed), is a folder, and this user may write in it."""
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{flag} {folder} is a file, not a folder; give a folder path")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{flag} {folder}: cannot create it ({_why(e)}); choose a folder you can write to") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {folder}: this user cannot write there; choose a folder you can write to")


def check_port_free(flag: str, port: int) -> None:
    """Nothing else listens on TCP ``port`` (0 means off or any port)."""
    if not port:
        return
    with socket.socket() as s:
        # as the metrics server binds: a port left in TIME_WAIT by a previous run is free to reuse
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise UserError(f"{flag} {port} is in use by another program: pick another port, or 0") from None
            if e.errno == errno.EACCES:
                raise UserError(f"{flag} {port}: ports below 1024 need root; pick a port above 1023") from None
            raise UserError(f"{flag} {port}: cannot listen there ({_why(e)})") from None


def check_device(device: str) -> None:
    if device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise UserError("--device cuda: torch sees no CUDA device on this machine; use --device auto (or cpu), "
                        "or install a CUDA build of torch and its driver")


def preflight(cfg: NodeConfig) -> FolderLock | None:
    """Check ``cfg`` against this machine and lock the checkpoint folder; returns the lock (release it
    when the node stops). Raises :class:`UserError`."""
    check_data(cfg.data)
    check_device(cfg.device)
    check_port_free("--metrics-port", cfg.metrics_port)
    if cfg.info_file is not None:
        check_writable_folder("--info-file's folder", Path(cfg.info_file).parent)
    if cfg.identity is not None and not Path(cfg.identity).exists():
        check_writable_folder("--identity's folder", Path(cfg.identity).parent)
    if cfg.checkpoint_dir is None:
        return None
    check_writable_folder("--checkpoint-dir", Path(cfg.checkpoint_dir))
    return FolderLock(Path(cfg.checkpoint_dir)).acquire()


def check_memory(cfg: NodeConfig, show: bool = False) -> int:
    """The memory estimate of ``cfg`` against this machine's free RAM and VRAM (``node.ops.memory``): with
    ``show``, print it as a table and return 0 if it fits, else 2; without, raise one :class:`UserError` line
    naming what does not fit and the largest settings that do."""
    from node.ops.memory import check_fit, refusal, render

    check_device(cfg.device)  # before asking CUDA for its free memory
    try:
        est = check_fit(cfg)
    except (ValueError, OSError) as e:  # an unreadable architecture file: the workload says why when the node starts
        if show:
            raise UserError(f"cannot estimate the memory of these options: {e}") from None
        return 0
    if show:
        render(est)
        return 0 if est.fits else 2
    if not est.fits:
        raise UserError(refusal(est))
    return 0
