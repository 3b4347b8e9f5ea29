"""Tests for node.data.byte_corpus (the embedded corpus, text corpora) and node.data.bytes (byte batching,
validation windows)."""

from __future__ import annotations

import hashlib
from importlib import resources
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from node.data import byte_corpus as C
from node.data import bytes as D


@pytest.fixture(scope="module")
def corpus() -> C.Corpus:
    return C.load_embedded_corpus()


def _resources() -> tuple[bytes, str]:
    pkg = resources.files("node.data.corpus")
    return pkg.joinpath("shakespeare.json.xz").read_bytes(), pkg.joinpath("SHA256").read_text().strip()


# ----------------------------------------------------------------- embedded corpus


def test_sha256_file_matches_packaged_corpus() -> None:
    blob, expected = _resources()
    assert len(expected) == 64
    assert hashlib.sha256(blob).hexdigest() == expected
    plays = C._parse_corpus_blob(blob, expected)
    assert len(plays) == 38


def test_corrupted_blob_is_detected() -> None:
    blob, expected = _resources()
    corrupted = bytearray(blob)
    corrupted[len(corrupted) // 2] ^= 0x01
    with pytest.raises(RuntimeError, match=r"corpus file corrupted: expected .*, got .*; reinstall locomesh"):
        C._parse_corpus_blob(bytes(corrupted), expected)
    with pytest.raises(RuntimeError, match="corrupted"):
        C._parse_corpus_blob(blob[:-1], expected)


def test_load_embedded_corpus_rejects_corrupted_resource(monkeypatch: pytest.MonkeyPatch) -> None:
    blob, expected = _resources()
    monkeypatch.setattr(C, "_read_embedded_resources", lambda: (blob[:100] + b"x" + blob[101:], expected))
    with pytest.raises(RuntimeError, match="reinstall locomesh"):
        C.load_embedded_corpus()


def test_embedded_corpus_shape(corpus: C.Corpus) -> None:
    assert len(corpus.train_docs) + len(corpus.val_docs) == 38
    assert len(corpus.val_docs) == 3
    assert corpus.train.dtype == torch.uint8 and corpus.train.dim() == 1
    assert corpus.val.dtype == torch.uint8 and corpus.val.dim() == 1
    total = corpus.train.numel() + corpus.val.numel()
    assert 4_000_000 <= total <= 6_000_000
    text = D.decode(corpus.train) + D.decode(corpus.val)
    assert "HAMLET" in text and "To be, or not to be" in text
    assert text.isascii()
    for marker in ("**", "_", "#", "\\[", "<", "  "):
        assert marker not in text, marker


def test_embedded_split_is_disjoint_whole_plays(corpus: C.Corpus) -> None:
    blob, expected = _resources()
    plays = dict(C._parse_corpus_blob(blob, expected))
    by_text = {text: title for title, text in plays.items()}
    assert all(doc in by_text for doc in corpus.train_docs + corpus.val_docs)
    train_titles = {by_text[d] for d in corpus.train_docs}
    val_titles = {by_text[d] for d in corpus.val_docs}
    assert not train_titles & val_titles
    assert len(train_titles | val_titles) == 38
    # The tensors are exactly the documents joined by the separator.
    assert D.decode(corpus.train) == C.DOC_SEPARATOR.join(corpus.train_docs)
    assert D.decode(corpus.val) == C.DOC_SEPARATOR.join(corpus.val_docs)
    # Deterministic: a second load holds out the same plays.
    again = C.load_embedded_corpus()
    assert again.val_docs == corpus.val_docs
    assert torch.equal(again.train, corpus.train)


def test_embedded_val_docs_argument() -> None:
    assert len(C.load_embedded_corpus(val_docs=5).val_docs) == 5
    with pytest.raises(ValueError):
        C.load_embedded_corpus(val_docs=0)
    with pytest.raises(ValueError):
        C.load_embedded_corpus(val_docs=38)


def test_load_corpus_none_is_embedded(corpus: C.Corpus) -> None:
    assert C.load_corpus(None).source == corpus.source


# ----------------------------------------------------------------- encode / decode


@settings(max_examples=50, deadline=None, derandomize=True, database=None)
@given(st.text(max_size=200))
def test_encode_decode_roundtrip(text: str) -> None:
    t = D.encode(text)
    assert t.dtype == torch.uint8 and t.numel() == len(text.encode("utf-8"))
    assert D.decode(t) == text
    assert D.decode(t.long().tolist()) == text


def test_decode_replaces_invalid_utf8_and_rejects_out_of_range() -> None:
    assert D.decode(torch.tensor([0xFF, 65], dtype=torch.uint8)) == "\ufffdA"
    assert D.decode(b"") == ""
    with pytest.raises(ValueError):
        D.decode(torch.tensor([256]))
    assert D.VOCAB_SIZE == 256


# ----------------------------------------------------------------- ByteBatches


def _stream(n: int = 5000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g, dtype=torch.int64).to(torch.uint8)


def test_bytebatches_same_seed_same_batches_different_seed_differs() -> None:
    data = _stream()
    a, b, c = (D.ByteBatches(data=data, batch_size=4, context=16, seed=s) for s in (7, 7, 8))
    for _ in range(5):
        (xa, ya), (xb, yb), (xc, _) = a.next(), b.next(), c.next()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(xa, xc)


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(
    n=st.integers(min_value=2, max_value=300),
    batch=st.integers(min_value=1, max_value=8),
    context=st.integers(min_value=1, max_value=64),
    seed=st.integers(min_value=0, max_value=2**31),
)
def test_bytebatches_shapes_shift_and_range(n: int, batch: int, context: int, seed: int) -> None:
    context = min(context, n - 1)
    data = _stream(n, seed=1)
    batches = D.ByteBatches(data=data, batch_size=batch, context=context, seed=seed)
    for x, y in (batches.next(), next(iter(batches))):
        assert x.shape == y.shape == (batch, context)
        assert x.dtype == y.dtype == torch.int64
        assert int(x.min()) >= 0 and int(x.max()) < 256
        assert torch.equal(x[:, 1:], y[:, :-1])
        # Every row is a real window of the stream and y is its next byte.
        for row_x, row_y in zip(x, y):
            hits = [o for o in range(n - context) if torch.equal(data[o : o + context].long(), row_x)]
            assert any(torch.equal(data[o + 1 : o + context + 1].long(), row_y) for o in hits)


def test_bytebatches_reaches_both_ends() -> None:
    data = torch.arange(40, dtype=torch.uint8)
    batches = D.ByteBatches(data=data, batch_size=64, context=8, seed=0)
    firsts = torch.cat([batches.next()[0][:, 0] for _ in range(10)])
    assert int(firsts.min()) == 0 and int(firsts.max()) == 40 - 8 - 1


def test_bytebatches_state_dict_resumes_order() -> None:
    data = _stream()
    a = D.ByteBatches(data=data, batch_size=3, context=12, seed=3)
    for _ in range(4):
        a.next()
    state = a.state_dict()
    expected = [a.next() for _ in range(3)]
    b = D.ByteBatches(data=data, batch_size=3, context=12, seed=999)
    b.load_state_dict(state)
    assert b.seed == 3 and b.batches_drawn == 4
    for (xe, ye), (xb, yb) in zip(expected, (b.next() for _ in range(3))):
        assert torch.equal(xe, xb) and torch.equal(ye, yb)
    with pytest.raises(ValueError):
        b.load_state_dict({})


def test_bytebatches_errors() -> None:
    with pytest.raises(ValueError, match="context"):
        D.ByteBatches(data=torch.zeros(8, dtype=torch.uint8), batch_size=2, context=8, seed=0)
    with pytest.raises(ValueError):
        D.ByteBatches(data=torch.zeros(100, dtype=torch.uint8), batch_size=0, context=8, seed=0)
    with pytest.raises(ValueError):
        D.ByteBatches(data=torch.zeros(2, 50, dtype=torch.uint8), batch_size=2, context=8, seed=0)


# ----------------------------------------------------------------- validation_batches


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(
    n=st.integers(min_value=2, max_value=400),
    batch=st.integers(min_value=1, max_value=6),
    context=st.integers(min_value=1, max_value=32),
)
def test_validation_batches_cover_in_order(n: int, batch: int, context: int) -> None:
    context = min(context, n - 1)
    data = _stream(n, seed=2)
    batches = D.validation_batches(data, batch, context)
    assert batches == [] or all(x.shape[1] == context for x, _ in batches)
    xs = torch.cat([x for x, _ in batches]).reshape(-1)
    ys = torch.cat([y for _, y in batches]).reshape(-1)
    n_windows = (n - 1) // context
    assert all(x.shape[0] == batch for x, _ in batches[:-1])
    assert xs.numel() == n_windows * context
    # Non-overlapping, in order, starting at 0: the x windows tile the stream's prefix.
    assert torch.equal(xs, data[: n_windows * context].long())
    assert torch.equal(ys, data[1 : n_windows * context + 1].long())
    assert (n - 1) - n_windows * context < context  # only a partial window is left out
    again = D.validation_batches(data, batch, context)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches, again))


def test_validation_batches_capped_are_evenly_spaced() -> None:
    data = _stream(10_000, seed=4)
    n_windows = (10_000 - 1) // 8
    batches = D.validation_batches(data, 4, 8, max_batches=3)
    assert len(batches) == 3 and all(x.shape == y.shape == (4, 8) for x, y in batches)
    starts = [(i * n_windows) // 12 * 8 for i in range(12)]
    rows = [(rx, ry) for x, y in batches for rx, ry in zip(x, y)]
    for s, (rx, ry) in zip(starts, rows):
        assert torch.equal(rx, data[s : s + 8].long()) and torch.equal(ry, data[s + 1 : s + 9].long())
    assert starts[0] == 0 and starts[-1] > 0.9 * 10_000
    again = D.validation_batches(data, 4, 8, max_batches=3)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again))
    # A cap above the available windows changes nothing.
    assert len(D.validation_batches(data, 4, 8, max_batches=10_000)) == -(-n_windows // 4)
    with pytest.raises(ValueError):
        D.validation_batches(data, 4, 8, max_batches=0)


def test_validation_batches_too_short() -> None:
    with pytest.raises(ValueError, match="smaller context"):
        D.validation_batches(torch.zeros(4, dtype=torch.uint8), 2, 8)


# ----------------------------------------------------------------- text corpora


def test_load_text_corpus_folder(tmp_path: Path) -> None:
    texts = {f"part{i:02d}.txt": f"Document {i}. " + "lorem ipsum dolor " * (20 + i) for i in range(6)}
    (tmp_path / "sub").mkdir()
    for name, text in texts.items():
        (tmp_path / ("sub" if name.endswith("3.txt") else ".") / name).write_text(text)
    (tmp_path / "notes.md").write_text("# Notes\n" + "markdown counts too. " * 20)
    (tmp_path / "ignored.csv").write_text("a,b\n" * 100)
    (tmp_path / ".hidden.txt").write_text("hidden " * 100)
    (tmp_path / "empty.txt").write_text("")
    c = C.load_text_corpus(tmp_path, val_fraction=0.2, context=16)
    docs = c.train_docs + c.val_docs
    assert len(docs) == 7 and len(c.val_docs) >= 1
    assert set(docs) == set(texts.values()) | {(tmp_path / "notes.md").read_text()}
    assert not set(c.train_docs) & set(c.val_docs)
    assert D.decode(c.train) == C.DOC_SEPARATOR.join(c.train_docs)
    assert D.decode(c.val) == C.DOC_SEPARATOR.join(c.val_docs)
    again = C.load_text_corpus(str(tmp_path), 0.2, context=16)
    assert again.val_docs == c.val_docs


def test_load_text_corpus_single_file(tmp_path: Path) -> None:
    text = "".join(f"line {i}: the quick brown fox\n" for i in range(400))
    f = tmp_path / "book.txt"
    f.write_text(text)
    c = C.load_corpus(f, context=32)
    raw = text.encode()
    assert torch.equal(torch.cat([c.train, c.val]), D.encode(text))
    n_val = c.val.numel()
    assert n_val == max(-(-len(raw) * 5 // 100), 33)
    assert c.train_docs == [text[: len(raw) - n_val]] and c.val_docs == [text[len(raw) - n_val :]]
    # A short file still gets one full window in each split.
    short = tmp_path / "short.txt"
    short.write_text("x" * 100)
    s = C.load_text_corpus(short, context=40)
    assert s.val.numel() == 41 and s.train.numel() == 59


def test_load_text_corpus_two_files_holds_out_one(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("alpha " * 50)
    (tmp_path / "b.txt").write_text("beta " * 50)
    c = C.load_text_corpus(tmp_path, context=16)
    assert len(c.train_docs) == 1 and len(c.val_docs) == 1
    # A file too small to be the validation split is not picked: another one is held out.
    (tmp_path / "c.txt").write_text("z")
    c3 = C.load_text_corpus(tmp_path, context=16)
    assert c3.val_docs == ["beta " * 50]


def test_load_text_corpus_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=r"does not exist.*embedded"):
        C.load_text_corpus(missing)
    with pytest.raises(ValueError, match=r"does not exist"):
        C.load_corpus(str(missing))
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ValueError, match=r"no \*\.txt or \*\.md files"):
        C.load_text_corpus(tmp_path / "empty_dir")
    (tmp_path / "blank.txt").write_text("  \n\n ")
    with pytest.raises(ValueError, match="is empty"):
        C.load_text_corpus(tmp_path / "blank.txt")
    (tmp_path / "tiny.txt").write_text("to be or not to be")
    with pytest.raises(ValueError, match=r"holds 18 bytes but needs at least 258"):
        C.load_text_corpus(tmp_path / "tiny.txt", context=128)
    with pytest.raises(ValueError, match="val_fraction"):
        C.load_text_corpus(tmp_path / "tiny.txt", val_fraction=1.5)
    uneven = tmp_path / "uneven"
    uneven.mkdir()
    (uneven / "a.txt").write_text("x" * 500)
    (uneven / "b.txt").write_text("y" * 5)
    with pytest.raises(ValueError, match="too unevenly sized"):
        C.load_text_corpus(uneven, context=64)
