"""Prepared token shards: tokenize a user's documents once, train on memory-mapped windows.

:func:`prepare` (``node data prepare``) reads documents (:mod:`node.data.documents`), sends chunks
of them to worker processes that tokenize them (:mod:`node.data.tokenizer`), and writes the tokens
of each split into flat shard files of about ``shard_tokens`` tokens (the format is in
:mod:`node.data.shard_format`). Whole documents go to validation, chosen by a hash of each
document's source, so re-runs and other machines agree.

Interrupted runs resume: every shard is written to a temporary file and renamed when whole,
then recorded with its sha256 in ``prepare-state.json``; ``manifest.json`` is written last.
A re-run with the same inputs (names, sizes, mtimes), tokenizer and settings verifies the
shards already finished and skips them (and their documents' tokenization); anything else
starts the folder over (the writing and resuming side is :mod:`node.data.shard_writer`).

Reading side: :func:`open_shards` → :class:`TokenDataset`; :class:`TokenBatches` draws
training windows and :func:`token_validation_batches` gives fixed validation windows (both in
:mod:`node.data.token_batches`, imported on first use: they need torch, the writer does not).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import multiprocessing as mp
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from node.data.documents import InputFile, collect_inputs, read_file
from node.errors import UserError
from node.data.shard_format import (
    FORMAT, MANIFEST, SPLITS, STATE, TOKENIZER_FILE, VERSION, Manifest, ShardInfo, TokenDataset, dtype_for,
    is_shard_dir, open_shards, read_manifest,
)
from node.data.shard_writer import LOCK_FILE, ShardWriter, lock_folder, previous_run, run_key, write_json
from node.data.tokenizer import (
    atomic_write_bytes, encode_chunk, encode_documents, eos_id, init_worker, load_tokenizer, tokenizer_hash, vocab_size,
)

__all__ = [
    "DEFAULT_SHARD_TOKENS",
    "Manifest",
    "ShardInfo",
    "TokenDataset",
    "prepare",
    "is_shard_dir",
    "open_shards",
]  # and, imported on first use (torch): TokenBatches, token_validation_batches

logger = logging.getLogger(__name__)

DEFAULT_SHARD_TOKENS = 50_000_000  # 100 MB of uint16 per shard
_CHUNK_DOCS = 256  # documents per task sent to a worker...
_CHUNK_CHARS = 500_000  # ...or fewer, when they are long


def __getattr__(name: str) -> Any:  # the reading side needs torch: imported when first asked for
    if name in ("TokenBatches", "token_validation_batches"):
        from node.data import token_batches

        return getattr(token_batches, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _unit_hash(source: str) -> float:
    """A document's place in [0, 1), from its source name only."""
    return int.from_bytes(hashlib.sha256(source.encode("utf-8")).digest()[:8], "big") / 2.0**64


class _Router:
    """Sends each document to ``train`` or ``val``, in a deterministic order.

    A document goes to validation when the hash of its source is below ``val_fraction``, except
    the very first one (so a single document trains). The training document with the smallest
    hash is held back to the end: it goes to validation if nothing else did and there are at
    least two documents.
    """

    def __init__(self, val_fraction: float) -> None:
        self.val_fraction = val_fraction
        self.n = self.n_val = 0
        self.reserve: tuple[float, str] | None = None

    def push(self, source: str, text: str) -> list[tuple[str, str]]:
        h = _unit_hash(source)
        first, self.n = self.n == 0, self.n + 1
        if h < self.val_fraction and not first:
            self.n_val += 1
            return [("val", text)]
        if self.reserve is None:
            self.reserve = (h, text)
            return []
        out = (h, text)
        if h < self.reserve[0]:
            self.reserve, out = out, self.reserve
        return [("train", out[1])]

    def finish(self) -> list[tuple[str, str]]:
        if self.reserve is None:
            return []
        return [("val" if self.n_val == 0 and self.n >= 2 else "train", self.reserve[1])]


def _encoded(chunks: Iterator[tuple[list[str], list[str]]], tok: Any, tok_json: str, eos: int, dtype: str,
             workers: int) -> Iterator[tuple[list[str], list[np.ndarray]]]:
    """``(splits, token arrays)`` of each chunk, in order; at most ``2 × workers`` chunks in flight."""
    if workers <= 1:
        for splits, texts in chunks:
            yield splits, encode_documents(tok, texts, eos, dtype)
        return
    # spawn: the workers start clean (no copy of torch's threads or of the tokenizer's thread pool)
    pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=init_worker,
                               initargs=(tok_json, eos, dtype))
    try:
        inflight: deque = deque()
        for splits, texts in chunks:
            inflight.append((splits, pool.submit(encode_chunk, texts)))
            if len(inflight) >= 2 * workers:
                s, fut = inflight.popleft()
                yield s, fut.result()
        while inflight:
            s, fut = inflight.popleft()
            yield s, fut.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def prepare(inputs: list[str | Path], tokenizer_path: str | Path, out_dir: str | Path, val_fraction: float = 0.01,
            shard_tokens: int = DEFAULT_SHARD_TOKENS, workers: int | None = None, progress: bool = True) -> Manifest:
    """Tokenize ``inputs`` with the tokenizer at ``tokenizer_path`` into shards in ``out_dir``.

    ``workers`` tokenizing processes (default: the CPU count; 1 tokenizes in this process; more
    are started with ``spawn``, so a script calling this needs the ``if __name__ == "__main__":`` guard);
    ``progress`` shows a progress bar on a terminal. Returns the manifest written (its
    ``skipped`` lists the shards found finished by an earlier run). Raises :class:`UserError`
    for bad settings, a bad tokenizer and bad inputs (found before anything is written, except
    a bad line or row met on the way: then no manifest is written).
    """
    t0 = time.monotonic()
    if not isinstance(val_fraction, (int, float)) or not 0.0 < float(val_fraction) < 1.0:
        raise UserError(f"--val-fraction {val_fraction}: use a fraction strictly between 0 and 1, e.g. 0.01")
    if isinstance(shard_tokens, bool) or not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise UserError(f"--shard-tokens {shard_tokens}: use a positive number of tokens per shard")
    workers = (os.cpu_count() or 1) if workers is None else workers
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise UserError(f"--workers {workers}: use at least 1 tokenizing process")
    tpath = Path(tokenizer_path).expanduser()
    tok = load_tokenizer(tpath)
    try:
        eos = eos_id(tok)
    except UserError as e:
        raise UserError(f"tokenizer {tpath}: {e}") from None
    vocab = vocab_size(tok)
    dtype = dtype_for(vocab)
    tok_text = tpath.read_text(encoding="utf-8")
    thash = tokenizer_hash(tok_text)
    files = collect_inputs(inputs)
    if all(f.size == 0 for f in files):
        raise UserError(f"{', '.join(str(p) for p in inputs)}: no text in {len(files)} input file(s); add documents")
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; give a folder for the shards")
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot create it ({e.strerror or e}); choose a folder you can write to") from None
    key = run_key(thash, dtype, float(val_fraction), shard_tokens, files)
    manifest = Manifest(tokenizer_hash=thash, vocab_size=vocab, dtype=dtype, eos_id=eos, shards=[],
                        val_fraction=float(val_fraction), shard_tokens=shard_tokens,
                        inputs=[str(p) for p in inputs], files=[f.fingerprint() for f in files], key=key)
    lock = lock_folder(out)
    finished: list[ShardInfo] = []
    try:
        kept, complete = previous_run(out, key, np.dtype(dtype).itemsize)
        tok_file = out / TOKENIZER_FILE
        if not tok_file.is_file() or tokenizer_hash(tok_file) != thash:
            atomic_write_bytes(tok_file, tok_text.encode("utf-8"))
        skipped = [s.name for s in kept["train"] + kept["val"]]
        if complete:
            manifest = read_manifest(out / MANIFEST)
            logger.info("%s: all %d shards already prepared", out, len(skipped))
        else:
            finished.extend(kept["train"] + kept["val"])
            _write_shards(out, files, manifest, kept, finished, tok, tok_text, workers, progress)
            manifest.shards = sorted(finished, key=lambda s: (SPLITS.index(s.split), s.name))
            write_json(out / MANIFEST, manifest.to_json())  # last: from now on the folder is finished
            (out / STATE).unlink(missing_ok=True)
    except BaseException:
        if not finished:  # nothing worth resuming: leave nothing behind
            (out / STATE).unlink(missing_ok=True)
            if created:
                for name in (TOKENIZER_FILE, LOCK_FILE):
                    (out / name).unlink(missing_ok=True)
                try:
                    out.rmdir()
                except OSError:
                    pass
        raise
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
        os.close(lock)
    manifest.skipped = skipped
    logger.info("%s: %d shards (%d reused) in %.1f s", out, len(manifest.shards), len(skipped), time.monotonic() - t0)
    return manifest


def _write_shards(out: Path, files: list[InputFile], m: Manifest, kept: dict[str, list[ShardInfo]],
                  finished: list[ShardInfo], tok: Any, tok_text: str, workers: int, progress: bool) -> None:
    """Tokenize the documents not in ``kept`` shards and write them; ``finished`` grows with each shard
    (the state file is rewritten after each)."""
    state = {"format": FORMAT + "-state", "version": VERSION, "key": m.key, "shards": []}

    def save_state() -> None:
        state["shards"] = [s.to_json() for s in finished]
        write_json(out / STATE, state)

    save_state()
    to_skip = {s: sum(x.docs for x in kept[s]) for s in SPLITS}
    writers = {s: ShardWriter(out=out, split=s, index=len(kept[s]), dtype=m.dtype) for s in SPLITS}
    bar = _Bar(len(files), progress and sys.stderr.isatty())

    def routed() -> Iterator[tuple[str, str]]:
        router = _Router(m.val_fraction)
        for f in files:
            for source, text in read_file(f):
                if text.strip():
                    yield from router.push(source, text)
            bar.file_done()
        yield from router.finish()

    def chunks() -> Iterator[tuple[list[str], list[str]]]:
        splits: list[str] = []
        texts: list[str] = []
        size = 0
        for split, text in routed():
            if to_skip[split]:
                to_skip[split] -= 1  # its tokens are in a finished shard
                continue
            splits.append(split)
            texts.append(text)
            size += len(text)
            if len(texts) >= _CHUNK_DOCS or size >= _CHUNK_CHARS:
                yield splits, texts
                splits, texts, size = [], [], 0
        if texts:
            yield splits, texts

    try:
        with bar:
            for splits, arrays in _encoded(chunks(), tok, tok_text, m.eos_id, m.dtype, workers):
                for split, ids in zip(splits, arrays):
                    w = writers[split]
                    w.append(ids)
                    bar.tokens(len(ids))
                    if w.tokens >= m.shard_tokens:
                        finished.append(w.finish())
                        save_state()
            for w in writers.values():
                if w.tokens:
                    finished.append(w.finish())
    finally:
        for w in writers.values():
            w.abort()
    if not finished:
        names = ", ".join(m.inputs)
        raise UserError(f"{names}: no text in {len(files)} input file(s); add documents")


class _Bar:
    """A rich progress bar on stderr (files read, tokens written), or nothing."""

    def __init__(self, n_files: int, show: bool) -> None:
        self.show, self.n_files = show, n_files
        self._progress = None
        self._tokens = 0

    def __enter__(self) -> _Bar:
        if self.show:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(TextColumn("tokenizing"), BarColumn(), MofNCompleteColumn(), TextColumn("files"),
                                      TextColumn("{task.fields[tokens]} tokens"), TimeElapsedColumn(),
                                      console=Console(stderr=True), transient=True)
            self._progress.start()
            self._task = self._progress.add_task("prepare", total=self.n_files, tokens="0")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def file_done(self) -> None:
        if self._progress is not None:
            self._progress.advance(self._task)

    def tokens(self, n: int) -> None:
        self._tokens += n
        if self._progress is not None:
            self._progress.update(self._task, tokens=f"{self._tokens:,}")
