"""Writing prepared token shards so that an interrupted ``node data prepare`` resumes.

:class:`ShardWriter` streams a split's tokens into ``<split>-NNNNN.bin.tmp`` and renames the file
when the shard is whole. A run is identified by :func:`run_key` (tokenizer, settings and the
inputs' names, sizes and mtimes); :func:`previous_run` finds the shards an earlier run with the
same key finished (recorded with their sha256 in ``prepare-state.json`` or ``manifest.json``) and
clears everything else. :func:`lock_folder` keeps two runs out of one folder. The pipeline that
feeds them (reading, routing, tokenizing) is :func:`node.data.shards.prepare`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from node.data.documents import InputFile
from node.data.shard_format import MANIFEST, SHARD_RE, SPLITS, STATE, VERSION, ShardInfo, file_sha256, shard_name
from node.data.tokenizer import atomic_write_bytes
from node.errors import UserError

__all__ = ["LOCK_FILE", "ShardWriter", "lock_folder", "previous_run", "run_key", "write_json"]

LOCK_FILE = ".prepare.lock"


class ShardWriter:
    """Appends documents' tokens to ``<split>-NNNNN.bin.tmp`` and renames it when the shard is done."""

    def __init__(self, *, out: Path, split: str, index: int, dtype: str) -> None:
        self.out, self.split, self.index = out, split, index
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self._f = None
        self.tokens = self.docs = self.max_token = 0

    @property
    def tmp(self) -> Path:
        return self.out / (shard_name(self.split, self.index) + ".tmp")

    def append(self, ids: np.ndarray) -> None:
        if self._f is None:
            self._f = open(self.tmp, "wb")
            self._sha = hashlib.sha256()
        raw = ids.astype(self.dtype, copy=False).tobytes()
        self._f.write(raw)
        self._sha.update(raw)
        self.tokens += len(ids)
        self.docs += 1
        self.max_token = max(self.max_token, int(ids.max()))

    def finish(self) -> ShardInfo:
        assert self._f is not None
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        self._f = None
        name = shard_name(self.split, self.index)
        os.replace(self.tmp, self.out / name)
        info = ShardInfo(name, self.split, self.tokens, self.docs, self._sha.hexdigest(), self.max_token)
        self.index += 1
        self.tokens = self.docs = self.max_token = 0
        return info

    def abort(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
            self.tmp.unlink(missing_ok=True)


def run_key(thash: str, dtype: str, val_fraction: float, shard_tokens: int, files: list[InputFile]) -> str:
    """What a run's shards depend on (format version, tokenizer, dtype, settings, the inputs' names, sizes
    and mtimes), hashed: a re-run with the same key may reuse the shards."""
    spec = {"version": VERSION, "tokenizer": thash, "dtype": dtype, "val_fraction": val_fraction,
            "shard_tokens": shard_tokens, "files": [f.fingerprint() for f in files]}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def lock_folder(out: Path) -> int:
    """An exclusive ``flock`` on ``out/.prepare.lock`` (released by the kernel if this process dies)."""
    fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise UserError(f"--out {out} is in use by another `node data prepare` (pid {owner}); "
                        "wait for it to finish or choose another folder") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON, atomically."""
    atomic_write_bytes(path, (json.dumps(obj, indent=1) + "\n").encode("utf-8"))


def previous_run(out: Path, key: str, itemsize: int) -> tuple[dict[str, list[ShardInfo]], bool]:
    """Shards of an earlier run with this ``key`` that are still whole (a verified prefix per split),
    and whether that run had finished. Leaves nothing else of ours in ``out``: a manifest that no
    longer holds is removed first, then stale shard and temporary files."""
    kept: dict[str, list[ShardInfo]] = {s: [] for s in SPLITS}
    complete, recorded = False, []
    mpath, spath = out / MANIFEST, out / STATE
    for path, done in ((mpath, True), (spath, False)):
        if path.is_file():
            try:
                obj = json.loads(path.read_text(encoding="utf-8"))
                if obj.get("key") == key and obj.get("version") == VERSION:
                    recorded, complete = [ShardInfo.from_json(s) for s in obj["shards"]], done
                    break
            except (OSError, ValueError, KeyError, TypeError):
                pass
    broken: set[str] = set()  # splits whose run of whole shards has ended
    for s in recorded:
        prefix, p = kept[s.split], out / s.name
        if (s.split not in broken and s.name == shard_name(s.split, len(prefix)) and p.is_file()
                and p.stat().st_size == s.tokens * itemsize and file_sha256(p) == s.sha256):
            prefix.append(s)
        else:
            broken.add(s.split)
            complete = False
    if complete:
        return kept, True
    mpath.unlink(missing_ok=True)  # first: from here on nothing looks finished
    names = {s.name for v in kept.values() for s in v}
    for p in out.iterdir():
        if SHARD_RE.match(p.name) and p.name not in names:
            p.unlink(missing_ok=True)
    return kept, False
