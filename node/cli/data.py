"""``node data``: turn local text into training data — ``tokenizer`` trains a byte-level BPE, ``prepare``
tokenizes documents into token shards (``node join --data DIR`` trains on them).

Inputs are ``.txt``/``.md`` files (one document each), ``.jsonl`` (a ``text`` field per line) and
``.parquet`` (a ``text`` column), or folders of them. Heavy imports happen inside the commands.
"""

import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from node.cli import command_group

data_app = command_group("data", "Prepare training data: train a tokenizer, tokenize text into shards.")


INPUT_HELP = "A .txt, .md, .jsonl or .parquet file, or a folder of them (repeatable)"


@data_app.command("tokenizer")
def tokenizer_cmd(
    inputs: Annotated[list[Path], typer.Option("--input", "-i", metavar="PATH", help=INPUT_HELP, show_default=False)],
    vocab_size: Annotated[int, typer.Option("--vocab-size", help="Tokens in the vocabulary, 260 to 1000000; up to 65535 gives uint16 shards")] = 32768,
    out: Annotated[Path, typer.Option("--out", help="Tokenizer file to write")] = Path("tokenizer.json"),
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar")] = True,
) -> None:
    """Train a byte-level BPE tokenizer on local text.

    Its token 0 is <|endoftext|>, the separator written after every document.
    """
    from node.data import tokenizer as T

    t0 = time.monotonic()
    path = T.train_tokenizer(inputs, vocab_size, out, progress)
    n = T.vocab_size(T.load_tokenizer(path))
    note = "" if n == vocab_size else f" (asked {vocab_size:,}: the text holds no more merges)"
    print(f"wrote {path}: vocabulary {n:,}{note}, hash {T.tokenizer_hash(path)}, {time.monotonic() - t0:.1f} s")


@data_app.command("prepare")
def prepare_cmd(
    inputs: Annotated[list[Path], typer.Option("--input", "-i", metavar="PATH", help=INPUT_HELP, show_default=False)],
    tokenizer: Annotated[Path, typer.Option("--tokenizer", help="tokenizer.json to encode with (from `node data tokenizer`)", show_default=False)],
    out: Annotated[Path, typer.Option("--out", metavar="DIR", help="Folder for the shards and manifest.json", show_default=False)],
    val_fraction: Annotated[float, typer.Option("--val-fraction", help="Share of documents held out, whole, for validation")] = 0.01,
    workers: Annotated[Optional[int], typer.Option("--workers", help="Tokenizing processes (default: CPU count)", show_default=False)] = None,
    shard_tokens: Annotated[Optional[int], typer.Option("--shard-tokens", help="Tokens per shard file (default: 50000000)", show_default=False)] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar")] = True,
) -> None:
    """Tokenize documents into token shards.

    Shards are flat uint16 (or uint32) token files with a manifest.json, written
    by worker processes; whole documents are held out for validation. A re-run
    with the same inputs and tokenizer skips the shards already finished.
    """
    from node.data.shards import DEFAULT_SHARD_TOKENS, prepare

    t0 = time.monotonic()
    m = prepare(inputs, tokenizer, out, val_fraction=val_fraction, workers=workers,
                shard_tokens=DEFAULT_SHARD_TOKENS if shard_tokens is None else shard_tokens, progress=progress)
    parts = [f"{s} {m.tokens(s):,} tokens in {len(m.shards_of(s))} shards ({m.docs(s):,} docs)" for s in ("train", "val")]
    reused = f", {len(m.skipped)} reused" if m.skipped else ""
    print(f"prepared {out}: {', '.join(parts)}, {m.dtype}, vocabulary {m.vocab_size:,}{reused}, "
          f"{time.monotonic() - t0:.1f} s")


@data_app.command("corpus")
def corpus_cmd(
    out: Annotated[Path, typer.Option("--out", help="Folder to write: train/ and val/ with one .txt file per play")] = Path("shakespeare"),
) -> None:
    """Write the embedded Shakespeare corpus as text files, to try the token pipeline with nothing to download.

    val/ holds the plays the byte-level demo holds out, so `node eval --data OUT/val` scores a
    tokenized model on the same text as the byte GPT (compare bits per byte).
    """
    from node.data.byte_corpus import load_embedded_corpus
    from node.errors import UserError
    from node.data.tokenizer import atomic_write_bytes

    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out {out} is not empty; give a new folder")
    corpus = load_embedded_corpus()
    for split, docs in (("train", corpus.train_docs), ("val", corpus.val_docs)):
        (out / split).mkdir(parents=True, exist_ok=True)
        for i, text in enumerate(docs):
            atomic_write_bytes(out / split / f"{i:02d}.txt", text.encode("utf-8"))
    print(f"wrote {out}: {len(corpus.train_docs)} plays in train/, {len(corpus.val_docs)} in val/")
