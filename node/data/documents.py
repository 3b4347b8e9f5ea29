"""Documents from a user's local text: the inputs of tokenizer training and of token shards.

An input is a file or a folder (walked recursively, in sorted path order, hidden entries
skipped). Supported files:

- ``.txt`` / ``.md``: the whole file is one document (UTF-8; invalid bytes become U+FFFD);
- ``.jsonl``: one JSON object per line, its ``text`` field is one document (blank lines skipped);
- ``.parquet``: its ``text`` column, one document per row, read in row batches (never whole).

Every document has a stable *source* name: ``NAME`` for a text file, ``NAME:LINE`` for a JSON
line and ``NAME:#ROW`` for a parquet row, where ``NAME`` is a file's own name, or, inside a
folder input, the folder's name and the path below it. Sources do not depend on where the
folder lives, so a hash of the source chooses the same validation documents on every machine.

Anything wrong with an input raises one :class:`~node.errors.UserError` that names the file
(and line) and says what is wrong.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from node.errors import UserError

__all__ = ["SUFFIXES", "InputFile", "collect_inputs", "read_file", "iter_documents"]

SUFFIXES = (".txt", ".md", ".jsonl", ".parquet")
_TEXT_FIELD = "text"
_PARQUET_BATCH_ROWS = 1024


@dataclass(frozen=True)
class InputFile:
    """One input file: where it is, its stable ``name``, and the size/mtime that fingerprint it."""

    path: Path
    name: str
    size: int
    mtime_ns: int

    @property
    def kind(self) -> str:
        return self.path.suffix.lower().lstrip(".")

    def fingerprint(self) -> dict[str, object]:
        return {"name": self.name, "bytes": self.size, "mtime_ns": self.mtime_ns}


def _one_line(e: object) -> str:
    return " ".join(str(e).split())


def _supported(p: Path) -> bool:
    return p.suffix.lower() in SUFFIXES


def _input_file(path: Path, name: str) -> InputFile:
    try:
        st = path.stat()
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror or e})") from None
    if not os.access(path, os.R_OK):
        raise UserError(f"{path}: not readable by this user; check its permissions")
    if path.suffix.lower() == ".parquet":
        _parquet_file(path)  # the schema is checked before anything is read or written
    return InputFile(path=path, name=name, size=st.st_size, mtime_ns=st.st_mtime_ns)


def collect_inputs(inputs: Iterable[str | Path]) -> list[InputFile]:
    """The files of ``inputs`` (files or folders), folders walked recursively in sorted order.

    Raises :class:`UserError` for no inputs, a path that does not exist, a file with an
    unsupported suffix, a folder with no supported files, an unreadable file, or a parquet
    file without a ``text`` column.
    """
    paths = [Path(p).expanduser() for p in inputs]
    if not paths:
        raise UserError(f"no input given; pass text files or folders ({', '.join(SUFFIXES)})")
    files: list[InputFile] = []
    for root in paths:
        if not root.exists():
            raise UserError(f"{root}: no such file or folder; give a file or folder of {', '.join(SUFFIXES)} files")
        if root.is_dir():
            found = []
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames[:] = [d for d in dirnames if not d.startswith(".")]
                for f in filenames:
                    p = Path(dirpath) / f
                    if not f.startswith(".") and _supported(p) and p.is_file():
                        found.append(p)
            found.sort(key=lambda p: p.relative_to(root).as_posix())
            if not found:
                raise UserError(f"{root}: the folder holds no {', '.join(SUFFIXES)} files (searched recursively)")
            base = root.resolve().name or "input"
            files.extend(_input_file(p, f"{base}/{p.relative_to(root).as_posix()}") for p in found)
        elif root.is_file():
            if not _supported(root):
                raise UserError(f"{root}: unsupported file type {root.suffix or '(no suffix)'!r}; "
                                f"use {', '.join(SUFFIXES)} files")
            files.append(_input_file(root, root.name))
        else:
            raise UserError(f"{root}: neither a file nor a folder")
    return files


def _parquet_file(path: Path):  # -> pyarrow.parquet.ParquetFile
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # ArrowInvalid, OSError, ...
        raise UserError(f"{path}: not a readable parquet file ({_one_line(e)})") from None
    names = pf.schema_arrow.names
    if _TEXT_FIELD not in names:
        shown = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
        raise UserError(f"{path}: the parquet file has no {_TEXT_FIELD!r} column (columns: {shown or 'none'})")
    return pf


def _read_text(f: InputFile) -> Iterator[tuple[str, str]]:
    try:
        raw = f.path.read_bytes()
    except OSError as e:
        raise UserError(f"{f.path}: cannot read it ({e.strerror or e})") from None
    yield f.name, raw.decode("utf-8", errors="replace")


def _read_jsonl(f: InputFile) -> Iterator[tuple[str, str]]:
    try:
        fh = f.path.open("rb")
    except OSError as e:
        raise UserError(f"{f.path}: cannot read it ({e.strerror or e})") from None
    with fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise UserError(f"{f.path}:{lineno}: not a JSON object ({_one_line(e)})") from None
            if not isinstance(record, dict) or _TEXT_FIELD not in record:
                what = f"keys: {', '.join(list(record)[:10])}" if isinstance(record, dict) else type(record).__name__
                raise UserError(f"{f.path}:{lineno}: no {_TEXT_FIELD!r} field ({what}); "
                                f"each line must be an object like {{\"text\": \"...\"}}")
            text = record[_TEXT_FIELD]
            if text is None:
                continue
            if not isinstance(text, str):
                raise UserError(f"{f.path}:{lineno}: the {_TEXT_FIELD!r} field is a {type(text).__name__}, not a string")
            yield f"{f.name}:{lineno}", text


def _read_parquet(f: InputFile) -> Iterator[tuple[str, str]]:
    pf = _parquet_file(f.path)
    row = 0
    try:
        for batch in pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[_TEXT_FIELD]):
            for text in batch.column(0).to_pylist():
                if text is not None:
                    if isinstance(text, bytes):
                        text = text.decode("utf-8", errors="replace")
                    if not isinstance(text, str):
                        raise UserError(f"{f.path}: row {row}: the {_TEXT_FIELD!r} column holds "
                                        f"{type(text).__name__} values, not strings")
                    yield f"{f.name}:#{row}", text
                row += 1
    except UserError:
        raise
    except Exception as e:  # a corrupt page
        raise UserError(f"{f.path}: cannot read row batch at row {row} ({_one_line(e)})") from None


_READERS = {"txt": _read_text, "md": _read_text, "jsonl": _read_jsonl, "parquet": _read_parquet}


def read_file(f: InputFile) -> Iterator[tuple[str, str]]:
    """``(source, text)`` of every document in one input file, in file order (empty text included)."""
    return _READERS[f.kind](f)


def iter_documents(inputs: Iterable[str | Path] | list[InputFile]) -> Iterator[tuple[str, str]]:
    """``(source, text)`` of every non-blank document of ``inputs``, in a deterministic order.

    ``inputs`` are paths (collected with :func:`collect_inputs` first, so path mistakes surface
    before any document is read) or already collected :class:`InputFile`\\ s. Raises
    :class:`UserError` for a bad line or row, and once all inputs are read if none held text.
    """
    items = list(inputs)
    files = items if items and all(isinstance(i, InputFile) for i in items) else collect_inputs(items)
    count = 0
    for f in files:
        for source, text in read_file(f):
            if text.strip():
                count += 1
                yield source, text
    if count == 0:
        names = ", ".join(str(f.path) for f in files[:3]) + (", ..." if len(files) > 3 else "")
        raise UserError(f"{names}: no text in {len(files)} input file(s); add documents to them")
