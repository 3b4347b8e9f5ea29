"""Training data for a node: corpus loading, train/validation splits and byte-level batching.

The vocabulary is raw bytes (``VOCAB_SIZE = 256``), so any UTF-8 text trains without a
tokenizer. A corpus is either the embedded public-domain Shakespeare plays shipped inside
the package (verified against its SHA-256 on every load) or the user's own text file or
folder. Validation always holds out whole documents where there is more than one, so the
validation loss measures generalisation to unseen text rather than to neighbouring lines.

Each node draws training windows at random offsets from its own seeded generator
(:class:`ByteBatches`), so peers see different orders of the same data, a given seed
always replays the same batches, and the generator state can be checkpointed and resumed.
Validation windows (:func:`validation_batches`) are fixed and identical on every node so
that their losses are comparable.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "VOCAB_SIZE",
    "DOC_SEPARATOR",
    "DEFAULT_CONTEXT",
    "Corpus",
    "ByteBatches",
    "encode",
    "decode",
    "load_corpus",
    "load_embedded_corpus",
    "load_text_corpus",
    "validation_batches",
]

VOCAB_SIZE = 256
DOC_SEPARATOR = "\n\n"
DEFAULT_CONTEXT = 128  # the default GPTConfig.context; callers pass their model's context

_CORPUS_PACKAGE = "node.data.corpus"
_CORPUS_FILE = "shakespeare.json.xz"
_SHA_FILE = "SHA256"
_TEXT_SUFFIXES = (".txt", ".md")


# --------------------------------------------------------------------------- bytes <-> text


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as a 1-D ``uint8`` tensor."""
    raw = text.encode("utf-8")
    return _bytes_tensor(raw)


def decode(tokens: torch.Tensor | Sequence[int] | bytes) -> str:
    """Text of a byte sequence (tensor or ints in 0..255); invalid UTF-8 becomes U+FFFD."""
    if isinstance(tokens, (bytes, bytearray)):
        return bytes(tokens).decode("utf-8", errors="replace")
    t = torch.as_tensor(tokens).reshape(-1)
    if t.numel() == 0:
        return ""
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"decode expects integer byte values, got a {t.dtype} tensor")
    if t.dtype != torch.uint8 and (int(t.min()) < 0 or int(t.max()) >= VOCAB_SIZE):
        raise ValueError(f"decode expects byte values in 0..{VOCAB_SIZE - 1}, got {int(t.min())}..{int(t.max())}")
    return bytes(t.to(torch.uint8).cpu().tolist()).decode("utf-8", errors="replace")


def _bytes_tensor(raw: bytes | bytearray) -> torch.Tensor:
    if not raw:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


# --------------------------------------------------------------------------- corpus


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
            train=_bytes_tensor(train_b),
            val=_bytes_tensor(val_b),
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
        train=_bytes_tensor(sep.join(train_raw)),
        val=_bytes_tensor(sep.join(val_raw)),
        train_docs=[text(b) for b in train_raw],
        val_docs=[text(b) for b in val_raw],
        source=f"text:{root} ({n} files; validation: {names})",
    )


def load_corpus(path: str | Path | None, *, context: int = DEFAULT_CONTEXT) -> Corpus:
    """The embedded corpus when ``path`` is None, else :func:`load_text_corpus` of ``path``."""
    if path is None:
        return load_embedded_corpus()
    return load_text_corpus(path, context=context)


# --------------------------------------------------------------------------- batching


def _check_stream(data: torch.Tensor, batch_size: int, context: int, what: str) -> torch.Tensor:
    if not isinstance(data, torch.Tensor) or data.dim() != 1:
        raise ValueError(f"{what} expects a 1-D tensor of bytes")
    if data.dtype.is_floating_point or data.dtype.is_complex or data.dtype == torch.bool:
        raise ValueError(f"{what} expects integer byte values, got {data.dtype}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if not isinstance(context, int) or context < 1:
        raise ValueError(f"context must be a positive integer, got {context!r}")
    if data.numel() < context + 1:
        raise ValueError(
            f"{what}: the data holds {data.numel():,} bytes, fewer than one window of context + 1 = {context + 1}; "
            f"use a larger corpus or a smaller context"
        )
    data = data.detach().cpu()
    if data.dtype != torch.uint8:
        if int(data.min()) < 0 or int(data.max()) >= VOCAB_SIZE:
            raise ValueError(f"{what} expects byte values in 0..{VOCAB_SIZE - 1}")
        data = data.to(torch.uint8)
    return data.contiguous()


class ByteBatches:
    """Endless random training batches from a byte stream.

    ``next()`` returns ``(x, y)``, two ``int64`` tensors of shape ``(batch_size, context)``
    where ``y[:, t]`` is the byte after ``x[:, t]``. Window offsets are uniform over every
    position where a full window fits, drawn from a ``torch.Generator`` seeded with ``seed``:
    the same seed replays the same batches, and ``state_dict()``/``load_state_dict()``
    carry the generator state across a checkpoint so a resumed node continues its order.
    """

    def __init__(self, *, data: torch.Tensor, batch_size: int, context: int, seed: int) -> None:
        self.data = _check_stream(data, batch_size, context, "ByteBatches")
        self.batch_size = batch_size
        self.context = context
        self.seed = int(seed)
        self.batches_drawn = 0
        self._gen = torch.Generator(device="cpu")
        self._gen.manual_seed(self.seed)
        self._steps = torch.arange(context, dtype=torch.int64)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``(x, y)`` batch."""
        high = self.data.numel() - self.context  # offsets 0..high-1 leave room for the target byte
        offsets = torch.randint(0, high, (self.batch_size,), generator=self._gen, dtype=torch.int64)
        idx = offsets[:, None] + self._steps
        x = self.data[idx].long()
        y = self.data[idx + 1].long()
        self.batches_drawn += 1
        return x, y

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def state_dict(self) -> dict[str, Any]:
        """The resumable state: ``{"seed", "batches_drawn", "generator_state"}`` (a uint8 tensor)."""
        return {
            "seed": self.seed,
            "batches_drawn": self.batches_drawn,
            "generator_state": self._gen.get_state().clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`; the generator state may be a tensor, bytes or a list of ints."""
        if "generator_state" not in state:
            raise ValueError("ByteBatches state is missing 'generator_state'")
        gs = state["generator_state"]
        if isinstance(gs, (bytes, bytearray)):
            gs = _bytes_tensor(gs)
        gs = torch.as_tensor(gs, dtype=torch.uint8).cpu()
        try:
            self._gen.set_state(gs.clone())
        except RuntimeError as exc:
            raise ValueError(f"invalid ByteBatches generator state: {exc}") from exc
        self.seed = int(state.get("seed", self.seed))
        self.batches_drawn = int(state.get("batches_drawn", 0))

    def __repr__(self) -> str:
        return (
            f"ByteBatches({self.data.numel():,} bytes, batch_size={self.batch_size}, context={self.context}, "
            f"seed={self.seed}, batches_drawn={self.batches_drawn})"
        )


def validation_batches(
    data: torch.Tensor, batch_size: int, context: int, max_batches: int | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed validation batches: non-overlapping windows in order.

    Window ``i`` is ``x = data[i*context : (i+1)*context]`` with ``y`` shifted by one, so the
    windows' targets cover every byte after the first exactly once (up to a final partial
    window). Windows are grouped into batches of ``batch_size`` (the last may be smaller).
    With ``max_batches``, only ``max_batches * batch_size`` windows are kept, evenly spaced
    over the split. The result depends only on the arguments, so every node evaluates the
    same windows.
    """
    data = _check_stream(data, batch_size, context, "validation_batches")
    if max_batches is not None and (not isinstance(max_batches, int) or max_batches < 1):
        raise ValueError(f"max_batches must be a positive integer or None, got {max_batches!r}")
    n_windows = (data.numel() - 1) // context
    starts = torch.arange(n_windows, dtype=torch.int64) * context
    if max_batches is not None and n_windows > max_batches * batch_size:
        keep = max_batches * batch_size
        starts = starts[(torch.arange(keep, dtype=torch.int64) * n_windows) // keep]
    steps = torch.arange(context, dtype=torch.int64)
    batches = []
    for chunk in starts.split(batch_size):
        idx = chunk[:, None] + steps
        batches.append((data[idx].long(), data[idx + 1].long()))
    return batches
