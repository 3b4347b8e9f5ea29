"""The on-disk format of prepared token shards, and reading them back (memory-mapped, verified).

A shard folder written by ``node data prepare`` (:func:`node.data.shards.prepare`) holds:

- ``train-00000.bin``, ``train-00001.bin``, ..., ``val-00000.bin``, ...: flat arrays of token
  ids, little-endian ``uint16`` (vocabulary ≤ 65535) or ``uint32``, nothing else in the file
  (the nanoGPT/litgpt layout: ``np.memmap(path, dtype, mode="r")`` reads one). Every document
  is followed by the end-of-text id and lies whole in one shard, of one split;
- ``tokenizer.json``: the tokenizer that wrote them;
- ``manifest.json``, written last: format and version, the tokenizer's hash, vocabulary size,
  dtype, end-of-text id, per-shard ``{name, split, tokens, docs, sha256, max_token}``, the totals
  per split, and the inputs they came from.

:func:`open_shards` checks a folder against its manifest (and with ``verify=True`` every
shard's sha256 and largest token id) and returns a :class:`TokenDataset` whose shards are
memory-mapped on first use: only the windows a batch touches are ever read.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from node.errors import UserError

__all__ = [
    "FORMAT",
    "VERSION",
    "MANIFEST",
    "STATE",
    "TOKENIZER_FILE",
    "SPLITS",
    "ShardInfo",
    "Manifest",
    "TokenDataset",
    "dtype_for",
    "shard_name",
    "file_sha256",
    "is_shard_dir",
    "open_shards",
]

FORMAT = "locomesh-token-shards"
VERSION = 1
MANIFEST = "manifest.json"
STATE = "prepare-state.json"  # finished shards of an unfinished run
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "val")
SHARD_RE = re.compile(r"^(train|val)-\d{5}\.bin(\.tmp)?$")
_READ_CHUNK = 1 << 22  # bytes per read when hashing or scanning a shard


def dtype_for(vocab_size: int) -> str:
    """``uint16`` when every id fits (vocabulary ≤ 65535), else ``uint32``."""
    return "uint16" if vocab_size <= 65535 else "uint32"


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.bin"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class ShardInfo:
    """One shard file: its name, split, length in tokens, whole documents, sha256 and largest id."""

    name: str
    split: str
    tokens: int
    docs: int
    sha256: str
    max_token: int

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "split": self.split, "tokens": self.tokens, "docs": self.docs,
                "sha256": self.sha256, "max_token": self.max_token}

    @classmethod
    def from_json(cls, obj: Any) -> ShardInfo:
        info = cls(name=str(obj["name"]), split=str(obj["split"]), tokens=int(obj["tokens"]),
                   docs=int(obj["docs"]), sha256=str(obj["sha256"]), max_token=int(obj["max_token"]))
        if info.split not in SPLITS or not SHARD_RE.match(info.name) or info.name.endswith(".tmp") or info.tokens < 1:
            raise ValueError(f"bad shard entry {obj!r}")
        return info


@dataclass
class Manifest:
    """What ``manifest.json`` records (``skipped`` is not saved: the shards a re-run found finished)."""

    tokenizer_hash: str
    vocab_size: int
    dtype: str
    eos_id: int
    shards: list[ShardInfo]
    val_fraction: float
    shard_tokens: int
    inputs: list[str]
    files: list[dict[str, Any]]
    key: str
    version: int = VERSION
    skipped: list[str] = field(default_factory=list)

    def shards_of(self, split: str) -> list[ShardInfo]:
        return [s for s in self.shards if s.split == split]

    def tokens(self, split: str) -> int:
        return sum(s.tokens for s in self.shards_of(split))

    def docs(self, split: str) -> int:
        return sum(s.docs for s in self.shards_of(split))

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": self.version,
            "tokenizer": TOKENIZER_FILE,
            "tokenizer_hash": self.tokenizer_hash,
            "vocab_size": self.vocab_size,
            "dtype": self.dtype,
            "eos_id": self.eos_id,
            "splits": {s: {"tokens": self.tokens(s), "docs": self.docs(s), "shards": len(self.shards_of(s))}
                       for s in SPLITS},
            "shards": [s.to_json() for s in self.shards],
            "val_fraction": self.val_fraction,
            "shard_tokens": self.shard_tokens,
            "inputs": self.inputs,
            "files": self.files,
            "key": self.key,
        }

    @classmethod
    def from_json(cls, obj: Any) -> Manifest:
        """Parse a manifest dict; ``ValueError``/``KeyError``/``TypeError`` when malformed."""
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} manifest")
        m = cls(tokenizer_hash=str(obj["tokenizer_hash"]), vocab_size=int(obj["vocab_size"]), dtype=str(obj["dtype"]),
                eos_id=int(obj["eos_id"]), shards=[ShardInfo.from_json(s) for s in obj["shards"]],
                val_fraction=float(obj["val_fraction"]), shard_tokens=int(obj["shard_tokens"]),
                inputs=[str(i) for i in obj.get("inputs", [])], files=list(obj.get("files", [])),
                key=str(obj.get("key", "")), version=int(obj["version"]))
        if m.dtype not in ("uint16", "uint32"):
            raise ValueError(f"unknown dtype {m.dtype!r}")
        for s in SPLITS:
            recorded = obj.get("splits", {}).get(s, {}).get("tokens")
            if recorded is not None and int(recorded) != m.tokens(s):
                raise ValueError(f"the {s} total ({recorded}) is not the sum of its shards ({m.tokens(s)})")
        return m


class TokenDataset:
    """A checked shard folder: its :class:`Manifest` and read-only memory maps of its shards.

    ``array(shard)`` maps a shard on first use (``np.memmap(mode="r")``); nothing is read until
    a slice of it is. ``check_ids`` raises a :class:`UserError` naming the shard when a slice
    holds an id outside the vocabulary (a corrupt or foreign file).
    """

    def __init__(self, root: Path, manifest: Manifest) -> None:
        self.root = Path(root)
        self.manifest = manifest
        self.vocab_size = manifest.vocab_size
        self.eos_id = manifest.eos_id
        self.tokenizer_hash = manifest.tokenizer_hash
        self.dtype = np.dtype(manifest.dtype).newbyteorder("<")
        self._maps: dict[str, np.memmap] = {}

    @property
    def tokenizer_path(self) -> Path:
        return self.root / TOKENIZER_FILE

    def shards(self, split: str) -> list[ShardInfo]:
        return self.manifest.shards_of(split)

    def tokens(self, split: str) -> int:
        return self.manifest.tokens(split)

    def path(self, shard: ShardInfo) -> Path:
        return self.root / shard.name

    def fingerprint(self) -> str:
        """Identifies the shards' content: the tokenizer hash and every shard's sha256."""
        h = hashlib.sha256(self.tokenizer_hash.encode())
        for s in self.manifest.shards:
            h.update(f"{s.name}:{s.sha256}".encode())
        return h.hexdigest()[:16]

    def array(self, shard: ShardInfo) -> np.memmap:
        m = self._maps.get(shard.name)
        if m is None:
            m = self._maps[shard.name] = np.memmap(self.path(shard), dtype=self.dtype, mode="r", shape=(shard.tokens,))
            if hasattr(mmap, "MADV_RANDOM") and isinstance(getattr(m, "_mmap", None), mmap.mmap):
                # windows are drawn at random: no read-ahead, a window costs the pages it spans
                m._mmap.madvise(mmap.MADV_RANDOM)
        return m

    def check_ids(self, ids: np.ndarray, shard: ShardInfo) -> None:
        if ids.size and int(ids.max()) >= self.vocab_size:
            raise UserError(f"{self.path(shard)}: token id {int(ids.max())} is beyond the vocabulary of "
                            f"{self.vocab_size} (corrupt or from another tokenizer); prepare the shards again")

    def verify(self) -> None:
        """Check every shard's sha256 and that all its ids are in the vocabulary (reads every byte once)."""
        for s in self.manifest.shards:
            p = self.path(s)
            h = hashlib.sha256()
            top = 0
            with open(p, "rb") as f:
                while chunk := f.read(_READ_CHUNK - _READ_CHUNK % self.dtype.itemsize):
                    h.update(chunk)
                    ids = np.frombuffer(chunk, dtype=self.dtype)
                    top = max(top, int(ids.max()) if ids.size else 0)
            if h.hexdigest() != s.sha256:
                raise UserError(f"{p}: sha256 {h.hexdigest()[:16]}… does not match the manifest's "
                                f"{s.sha256[:16]}… (the file is corrupt); prepare the shards again")
            if top >= self.vocab_size:
                raise UserError(f"{p}: token id {top} is beyond the vocabulary of {self.vocab_size}; "
                                "prepare the shards again")

    def load_tokenizer(self):  # -> tokenizers.Tokenizer
        from node.data.tokenizer import load_tokenizer

        return load_tokenizer(self.tokenizer_path)

    def check_tokenizer(self, tokenizer: str | Path) -> None:
        """:class:`UserError` unless the tokenizer file ``tokenizer`` is the one these shards were written with."""
        from node.data.tokenizer import tokenizer_hash

        h = tokenizer_hash(Path(tokenizer))
        if h != self.tokenizer_hash:
            raise UserError(f"tokenizer {tokenizer} does not match the shards in {self.root} "
                            f"(hash {h} vs {self.tokenizer_hash}); use {self.tokenizer_path}")

    def __repr__(self) -> str:
        return (f"TokenDataset({str(self.root)!r}, train={self.tokens('train'):,} tokens in "
                f"{len(self.shards('train'))} shards, val={self.tokens('val'):,} in {len(self.shards('val'))}, "
                f"{self.manifest.dtype}, vocab {self.vocab_size})")


def read_manifest(path: Path) -> Manifest:
    """Parse ``path``; :class:`UserError` naming it when unreadable or malformed."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
        return Manifest.from_json(obj)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError, KeyError, TypeError) as e:
        msg = " ".join(str(e).split())
        raise UserError(f"{path}: not a readable shard manifest ({msg}); prepare the shards again") from None


def is_shard_dir(path: str | Path) -> bool:
    """Whether ``path`` is a folder written by ``node data prepare`` (finished or not): ``--data`` then
    means token shards (:func:`open_shards`) rather than a folder of text."""
    p = Path(path).expanduser()
    return p.is_dir() and ((p / MANIFEST).is_file() or (p / STATE).is_file())


def open_shards(root: str | Path, verify: bool = False) -> TokenDataset:
    """Open a folder written by ``node data prepare`` after checking it against its manifest.

    Checks the format version, that ``tokenizer.json`` is there with the manifest's hash, and
    that every shard file exists with exactly ``tokens × itemsize`` bytes; ``verify=True``
    also checks every shard's sha256 and largest token id. Each problem is one
    :class:`UserError` naming the file.
    """
    root = Path(root).expanduser()
    if not root.is_dir():
        raise UserError(f"{root}: no such folder; prepare shards with `node data prepare --out {root}`")
    mpath = root / MANIFEST
    if not mpath.is_file():
        if (root / STATE).exists():
            raise UserError(f"{root}: an unfinished `node data prepare` run (no {MANIFEST} yet); run it again to finish")
        raise UserError(f"{root}: no {MANIFEST}; prepare shards with `node data prepare --out {root}`")
    m = read_manifest(mpath)
    if m.version != VERSION:
        raise UserError(f"{mpath}: shard format version {m.version}, this locomesh reads version {VERSION}; "
                        "prepare the shards again with this version")
    ds = TokenDataset(root, m)
    tpath = ds.tokenizer_path
    if not tpath.is_file():
        raise UserError(f"{tpath}: missing; the shards cannot be decoded without it (prepare them again)")
    from node.data.tokenizer import tokenizer_hash

    if (h := tokenizer_hash(tpath)) != m.tokenizer_hash:
        raise UserError(f"{tpath}: hash {h} differs from the manifest's {m.tokenizer_hash} (replaced or corrupt); "
                        "prepare the shards again")
    for s in m.shards:
        p = ds.path(s)
        if not p.is_file():
            raise UserError(f"{p}: missing (listed in {mpath}); prepare the shards again")
        size, want = p.stat().st_size, s.tokens * ds.dtype.itemsize
        if size != want:
            raise UserError(f"{p}: {size:,} bytes, the manifest says {s.tokens:,} tokens = {want:,} bytes "
                            "(truncated or overwritten); prepare the shards again")
        if s.max_token >= m.vocab_size:
            raise UserError(f"{p}: token id {s.max_token} is beyond the vocabulary of {m.vocab_size}")
    if verify:
        ds.verify()
    return ds
