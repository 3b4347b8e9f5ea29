"""Corpora for byte-level training: loading them and splitting them into training and validation.

A corpus is either the embedded public-domain Shakespeare plays shipped inside the package
(verified against its SHA-256 on every load) or the user's own text file or folder. Validation
always holds out whole documents where there is more than one, so the validation loss measures
generalisation to unseen text rather than to neighbouring lines. The splits are byte streams
(:mod:`node.data.bytes` batches them).
"""

from __future__ import annotations

import hashlib
import json
import lzma
import math
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from node.data.bytes import bytes_tensor, encode

__all__ = [
    "DOC_SEPARATOR",
    "DEFAULT_CONTEXT",
    "Corpus",
    "load_corpus",
    "load_embedded_corpus",
    "load_text_corpus",
]

DOC_SEPARATOR = "\n\n"
DEFAULT_CONTEXT = 128  # the default GPTConfig.context; callers pass their model's context

_CORPUS_PACKAGE = "node.data.corpus"
_CORPUS_FILE = "shakespeare.json.xz"
_SHA_FILE = "SHA256"
_TEXT_SUFFIXES = (".txt", ".md")


@dataclass(frozen=True, eq=False)
class Corpus:
    """A byte corpus split into training and validation streams.

    ``train``/``val`` are 1-D ``uint8`` tensors holding the documents of each split joined
    by :data:`DOC_SEPARATOR`; ``train_docs``/``val_docs`` are those documents as text, and
    ``source`` says where the corpus came from.
    """

    train: torch.Tensor
    val: torch.Tensor
    train_docs: list[str]
    val_docs: list[str]
    source: str

    def __post_init__(self) -> None:
        for name in ("train", "val"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
                raise TypeError(f"Corpus.{name} must be a 1-D uint8 tensor")

    def __repr__(self) -> str:
        return (
            f"Corpus(source={self.source!r}, train={self.train.numel():,} bytes in {len(self.train_docs)} docs, "
            f"val={self.val.numel():,} bytes in {len(self.val_docs)} docs)"
        )


def _parse_corpus_blob(blob: bytes, expected_sha256: str) -> list[tuple[str, str]]:
    """Verify ``blob`` (the compressed corpus file) against ``expected_sha256`` and return its (title, text) pairs.

    Raises ``RuntimeError`` when the digest does not match or the content is malformed.
    """
    expected = expected_sha256.strip().lower()
    actual = hashlib.sha256(blob).hexdigest()
    if actual != expected:
        raise RuntimeError(f"corpus file corrupted: expected sha256 {expected}, got {actual}; reinstall locomesh")
    plays = _DECODED.get(actual)
    if plays is None:
        # The (cheap) digest check runs on every load; the (slower) decompression and JSON
        # parse happen once per process per verified digest.
        plays = _DECODED[actual] = _decompress_corpus(actual, blob)
    return list(plays)


_DECODED: dict[str, tuple[tuple[str, str], ...]] = {}


def _decompress_corpus(digest: str, blob: bytes) -> tuple[tuple[str, str], ...]:
    try:
        records = json.loads(lzma.decompress(blob).decode("utf-8"))
        plays = tuple((str(r["title"]), str(r["text"])) for r in records)
    except (lzma.LZMAError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise RuntimeError(
            f"corpus file {_CORPUS_FILE} (sha256 {digest}) is unreadable: {exc}; reinstall locomesh"
        ) from exc
    if not plays:
        raise RuntimeError(f"corpus file {_CORPUS_FILE} holds no documents; reinstall locomesh")
    return plays


def _read_embedded_resources() -> tuple[bytes, str]:
    """Raw bytes of the packaged corpus file and the expected sha256 hex from ``SHA256``."""
    pkg = resources.files(_CORPUS_PACKAGE)
    try:
        blob = pkg.joinpath(_CORPUS_FILE).read_bytes()
        expected = pkg.joinpath(_SHA_FILE).read_text(encoding="ascii").strip()
    except (FileNotFoundError, OSError) as exc:
        raise RuntimeError(
            f"embedded corpus missing from package {_CORPUS_PACKAGE}: {exc}; reinstall locomesh"
        ) from exc
    return blob, expected


def _spread_indices(n: int, k: int) -> list[int]:
    """``k`` distinct indices out of ``n``: the last of each consecutive group of ``n // k`` (every k-th item)."""
    if not 1 <= k <= n:
        raise ValueError(f"cannot pick {k} of {n} items")
    step = n // k
    return [(i + 1) * step - 1 for i in range(k)]


def _join(docs: Sequence[str]) -> torch.Tensor:
    return encode(DOC_SEPARATOR.join(docs))


def load_embedded_corpus(val_docs: int = 3) -> Corpus:
    """The packaged Shakespeare corpus (38 plays), verified against its SHA-256.

    ``val_docs`` whole plays are held out for validation: with plays sorted by title, the
    last play of each of ``val_docs`` equal consecutive groups (every ``38 // val_docs``-th
    play), which spreads validation across comedies, histories and tragedies.
    """
    blob, expected = _read_embedded_resources()
    plays = _parse_corpus_blob(blob, expected)
    plays.sort(key=lambda p: p[0])
    if not isinstance(val_docs, int) or not 1 <= val_docs < len(plays):
        raise ValueError(
            f"val_docs must be an integer in 1..{len(plays) - 1} (the corpus has {len(plays)} plays), got {val_docs!r}"
        )
    held = set(_spread_indices(len(plays), val_docs))
    train = [text for i, (_, text) in enumerate(plays) if i not in held]
    val = [text for i, (_, text) in enumerate(plays) if i in held]
    titles = ", ".join(plays[i][0] for i in sorted(held))
    return Corpus(
        train=_join(train),
        val=_join(val),
        train_docs=train,
        val_docs=val,
        source=f"embedded:{_CORPUS_FILE} ({len(plays)} plays, sha256 {expected[:12]}; validation: {titles})",
    )


def _collect_text_files(root: Path) -> list[Path]:
    files = []
    for p in root.rglob("*"):
        rel = p.relative_to(root)
        if any(part.startswith(".") for part in rel.parts):
            continue  # hidden files and folders (.git, editor backups)
        if p.suffix.lower() in _TEXT_SUFFIXES and p.is_file():
            files.append(p)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def load_text_corpus(path: str | Path, val_fraction: float = 0.05, *, context: int = DEFAULT_CONTEXT) -> Corpus:
    """A corpus from a UTF-8 text file, or a folder of ``*.txt``/``*.md`` files (recursive, sorted by path).

    With two or more non-empty files, whole files are held out for validation (at least
    one; about ``val_fraction`` of the files, spread over the sorted list, and more if
    needed so validation covers one ``context`` window). A single file is split by bytes:
    its last ``val_fraction`` (at least ``context + 1`` bytes) is validation. Both splits
    must hold at least ``context + 1`` bytes. Invalid UTF-8 is kept as raw bytes in the
    tensors and shown as U+FFFD in the ``*_docs`` strings.

    Raises ``ValueError`` for a missing path, an empty corpus, or one too short to fill
    one context window in each split.
    """
    if not isinstance(val_fraction, (int, float)) or not 0.0 < float(val_fraction) < 1.0:
        raise ValueError(f"val_fraction must be strictly between 0 and 1, got {val_fraction!r}")
    if not isinstance(context, int) or context < 1:
        raise ValueError(f"context must be a positive integer, got {context!r}")
    root = Path(path).expanduser()
    hint = (
        "pass an existing UTF-8 .txt/.md file or a folder of them, "
        "or give no corpus path to use the embedded Shakespeare corpus"
    )
    if not root.exists():
        raise ValueError(f"corpus path {str(path)!r} does not exist; {hint}")
    if root.is_dir():
        files = _collect_text_files(root)
        if not files:
            raise ValueError(f"corpus folder {str(path)!r} holds no *.txt or *.md files (searched recursively); {hint}")
    elif root.is_file():
        files = [root]
    else:
        raise ValueError(f"corpus path {str(path)!r} is neither a file nor a folder; {hint}")

    raws = [(f, f.read_bytes()) for f in files]
    raws = [(f, b) for f, b in raws if b.strip()]
    if not raws:
        raise ValueError(f"corpus {str(path)!r} is empty (no text in {len(files)} file(s)); add text to it or {hint}")
    need = context + 1
    total = sum(len(b) for _, b in raws) + len(DOC_SEPARATOR) * (len(raws) - 1)
    if total < 2 * need:
        raise ValueError(
            f"corpus {str(path)!r} holds {total:,} bytes but needs at least {2 * need:,} "
            f"(one window of context + 1 = {need} bytes for training and one for validation); "
            f"add more text or use a model with a smaller context"
        )
    sep = DOC_SEPARATOR.encode("utf-8")

    def text(b: bytes) -> str:
        return b.decode("utf-8", errors="replace")

    if len(raws) == 1:
        (f, raw), = raws
        n_val = min(max(math.ceil(len(raw) * float(val_fraction)), need), len(raw) - need)
        train_b, val_b = raw[: len(raw) - n_val], raw[len(raw) - n_val :]
        return Corpus(
            train=bytes_tensor(train_b),
            val=bytes_tensor(val_b),
            train_docs=[text(train_b)],
            val_docs=[text(val_b)],
            source=f"text:{root} (1 file, last {n_val:,} bytes held out)",
        )

    n = len(raws)

    def split_bytes(held: set[int]) -> tuple[int, int]:
        tr = [len(b) for i, (_, b) in enumerate(raws) if i not in held]
        va = [len(b) for i, (_, b) in enumerate(raws) if i in held]
        return sum(tr) + len(sep) * (len(tr) - 1), sum(va) + len(sep) * (len(va) - 1)

    def choose() -> set[int] | None:
        # Every k-th file first; if a split comes out shorter than one window, shift the
        # picks back within their groups, then hold out more files.
        for n_val in range(min(max(1, round(n * float(val_fraction))), n - 1), n):
            step = n // n_val
            for shift in range(step):
                held = {i - shift for i in _spread_indices(n, n_val)}
                tr_bytes, va_bytes = split_bytes(held)
                if tr_bytes >= need and va_bytes >= need:
                    return held
        return None

    held = choose()
    if held is None:
        raise ValueError(
            f"corpus {str(path)!r}: cannot hold out whole files so that both training and validation "
            f"hold one window of context + 1 = {need} bytes (the files are too unevenly sized); "
            f"add more text, merge the files into one, or use a model with a smaller context"
        )
    train_raw = [b for i, (_, b) in enumerate(raws) if i not in held]
    val_raw = [b for i, (_, b) in enumerate(raws) if i in held]
    names = ", ".join(raws[i][0].relative_to(root).as_posix() for i in sorted(held))
    return Corpus(
        train=bytes_tensor(sep.join(train_raw)),
        val=bytes_tensor(sep.join(val_raw)),
        train_docs=[text(b) for b in train_raw],
        val_docs=[text(b) for b in val_raw],
        source=f"text:{root} ({n} files; validation: {names})",
    )


def load_corpus(path: str | Path | None, *, context: int = DEFAULT_CONTEXT) -> Corpus:
    """The embedded corpus when ``path`` is None, else :func:`load_text_corpus` of ``path``."""
    if path is None:
        return load_embedded_corpus()
    return load_text_corpus(path, context=context)
