"""Byte-level BPE tokenizers for real workloads: training, loading, hashing, and encoding workers.

:func:`train_tokenizer` trains a GPT-2-style byte-level BPE (the Hugging Face ``tokenizers``
library: ByteLevel pre-tokenizer and decoder, so any text round-trips exactly) on the user's
documents (:mod:`node.data.documents`). Its first token, id 0, is the special ``<|endoftext|>``, the
end-of-document separator written after every document in token shards (:mod:`node.data.shards`).
Any ``tokenizer.json`` with an ``<|endoftext|>`` token (GPT-2's, for one) can be used instead.

A tokenizer is identified by :func:`tokenizer_hash`, the sha256 of its canonical JSON (keys
sorted, no whitespace), so the same tokenizer saved twice has one hash.

This module imports neither torch nor the rest of the node, so the worker processes of
``node data prepare`` (which run :func:`encode_chunk`) start quickly.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from node.data.documents import collect_inputs, iter_documents
from node.errors import UserError

__all__ = [
    "EOS_TOKEN",
    "MIN_VOCAB",
    "MAX_VOCAB",
    "train_tokenizer",
    "load_tokenizer",
    "tokenizer_hash",
    "eos_id",
    "vocab_size",
    "encode_documents",
    "atomic_write_bytes",
]

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
MIN_VOCAB = 260  # 1 special token + 256 byte tokens + a few merges
MAX_VOCAB = 1_000_000


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and ``os.replace``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as f:  # the umask's permissions, like any file the user writes
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def train_tokenizer(inputs: list[Path], vocab_size: int, out: Path, progress: bool = True) -> Path:
    """Train a byte-level BPE tokenizer of (at most) ``vocab_size`` tokens on ``inputs``; write it to ``out``.

    ``<|endoftext|>`` is id 0; the 256 byte tokens follow, then the merges. The file is written
    atomically (nothing at ``out`` until training has finished). A corpus too small to learn
    ``vocab_size - 257`` merges gives a smaller vocabulary. Returns ``out``.

    Raises :class:`UserError` for a vocabulary size out of range, an output path that is a
    folder, and any bad input (see :mod:`node.data.documents`).
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise UserError(f"--vocab-size {vocab_size}: use a vocabulary of {MIN_VOCAB:,} to {MAX_VOCAB:,} tokens "
                        "(32768 fits uint16 shards)")
    out = Path(out).expanduser()
    if out.is_dir():
        raise UserError(f"--out {out} is a folder; give the tokenizer file to write, e.g. {out / 'tokenizer.json'}")
    files = collect_inputs(inputs)  # path mistakes surface before training starts
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    texts = (text for _, text in iter_documents(files))
    tok.train_from_iterator(texts, trainer=trainer)  # a UserError raised by the reader propagates as is
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(out, tok.to_str().encode("utf-8"))
    except OSError as e:
        raise UserError(f"--out {out}: cannot write it ({e.strerror or e}); choose a path you can write to") from None
    logger.info("tokenizer %s: %d tokens, hash %s", out, tok.get_vocab_size(), tokenizer_hash(out))
    return out


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer saved at ``path`` (a ``tokenizer.json``); :class:`UserError` if missing or unreadable."""
    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"tokenizer {path}: no such file; train one with `node data tokenizer --out {path}`") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"tokenizer {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    try:
        return Tokenizer.from_str(text)
    except Exception as e:
        msg = " ".join(str(e).split())
        raise UserError(f"tokenizer {path}: not a tokenizers JSON file ({msg})") from None


def tokenizer_hash(source: str | Path | Tokenizer) -> str:
    """First 16 hex digits of the sha256 of a tokenizer's canonical JSON.

    ``source`` is a tokenizer file path, its JSON text, or a loaded :class:`Tokenizer`.
    """
    if isinstance(source, Tokenizer):
        text = source.to_str()
    elif isinstance(source, Path) or not str(source).lstrip().startswith("{"):
        path = Path(source).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"tokenizer {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    else:
        text = str(source)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"tokenizer {source if isinstance(source, Path) else 'text'}: not JSON ({e.msg})") from None
    canonical = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in character of each byte 0..255 (what the ByteLevel pre-tokenizer emits)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    return [chars[b] for b in range(256)]


def byte_level_tokenizer_json() -> str:
    """A tokenizer whose ids are the text's UTF-8 bytes (id = byte value: 256 tokens, no merges, no special
    tokens): the tokenizer of a model trained on plain text, for ``node export`` of byte-level runs."""
    vocab = {c: b for b, c in enumerate(_byte_chars())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


BYTE_PROBE = "Byte-level? ¿Sí: ünïcode ✓ 中文\n\t{}"


def is_byte_level(tokenizer_json: str | None) -> bool:
    """True when ``tokenizer_json`` encodes text to its UTF-8 bytes and back (a byte-level model's tokenizer)."""
    if not tokenizer_json:
        return False
    try:
        tok = Tokenizer.from_str(tokenizer_json)
        ids = tok.encode(BYTE_PROBE, add_special_tokens=False).ids
        return vocab_size(tok) == 256 and ids == list(BYTE_PROBE.encode("utf-8")) and tok.decode(ids) == BYTE_PROBE
    except Exception:
        return False


def eos_id(tok: Tokenizer) -> int:
    """Id of ``<|endoftext|>``, the document separator; :class:`UserError` if the tokenizer has none."""
    i = tok.token_to_id(EOS_TOKEN)
    if i is None:
        raise UserError(f"the tokenizer has no {EOS_TOKEN} token to separate documents; "
                        "train one with `node data tokenizer`")
    return int(i)


def vocab_size(tok: Tokenizer) -> int:
    """Number of token ids, special tokens included (every id is below it)."""
    return int(tok.get_vocab_size(with_added_tokens=True))


def encode_documents(tok: Tokenizer, texts: Iterable[str], eos: int, dtype: np.dtype | str) -> list[np.ndarray]:
    """Each text's token ids followed by ``eos``, as arrays of ``dtype``.

    Special-token strings inside a text are encoded as plain text, so a document that quotes
    ``<|endoftext|>`` is not cut in two; no BOS or other post-processing tokens are added.
    """
    before = tok.encode_special_tokens
    tok.encode_special_tokens = True
    try:
        encodings = tok.encode_batch(list(texts), add_special_tokens=False)
    finally:
        tok.encode_special_tokens = before
    out = []
    for enc in encodings:
        ids = enc.ids
        arr = np.empty(len(ids) + 1, dtype=dtype)
        arr[:-1] = ids
        arr[-1] = eos
        out.append(arr)
    return out


# ----------------------------------------------------------------- worker processes (node data prepare)

_WORKER: dict[str, object] = {}


def init_worker(tokenizer_json: str, eos: int, dtype: str) -> None:
    """Initializer of a tokenizing worker process: one tokenizer, single-threaded (the pool is the parallelism)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER.update(tok=Tokenizer.from_str(tokenizer_json), eos=eos, dtype=dtype)


def encode_chunk(texts: list[str]) -> list[np.ndarray]:
    """Run in a worker set up by :func:`init_worker`: :func:`encode_documents` of one chunk."""
    return encode_documents(_WORKER["tok"], texts, _WORKER["eos"], _WORKER["dtype"])  # type: ignore[arg-type]
