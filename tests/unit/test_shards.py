"""Tokenizer training and prepared token shards: node.data.documents, node.data.tokenizer, node.data.shards,
node.data.shard_writer, node.data.shard_format, node.data.token_batches and the ``node data`` commands (all on
tiny generated data)."""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections import Counter
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from node.data import shard_writer as W
from node.data import shards as S
from node.data.documents import iter_documents
from node.errors import UserError
from node.data.shard_format import MANIFEST, STATE, TOKENIZER_FILE, Manifest, ShardInfo, open_shards
from node.data.token_batches import TokenBatches, epoch_layout, permute, token_validation_batches
from node.data.tokenizer import EOS_TOKEN, encode_documents, eos_id, load_tokenizer, tokenizer_hash, train_tokenizer

WORDS = ("the quick brown fox jumps over a lazy dog while peers average their pseudo gradients "
         "across slow links and shards of tokens wait on disk ünïcödé 日本語 ✓").split()


def _doc(rng: random.Random, n: int, extra: str = "") -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)) + extra


def _make_corpus(root: Path) -> Path:
    rng = random.Random(0)
    (root / "nested").mkdir(parents=True)
    for i in range(4):
        (root / f"book{i}.txt").write_text(_doc(rng, 120) + "\n")
    (root / "notes.md").write_text("# Notes\n\n" + _doc(rng, 60))
    (root / "nested" / "web.jsonl").write_text("\n".join(
        json.dumps({"text": _doc(rng, 40, " jsonlonlyword" * 5), "id": i}) for i in range(20)) + "\n\n")
    pq.write_table(pa.table({"text": [_doc(rng, 40, " parquetonlyword" * 5) for _ in range(20)] + [None],
                             "n": list(range(21))}), root / "nested" / "rows.parquet", row_group_size=7)
    (root / "ignored.csv").write_text("a,b\n1,2\n")
    return root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _make_corpus(tmp_path_factory.mktemp("corpus") / "texts")


@pytest.fixture(scope="module")
def tok_path(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tokenizer([corpus], 400, tmp_path_factory.mktemp("tok") / "tokenizer.json", progress=False)


@pytest.fixture(scope="module")
def prepared(corpus: Path, tok_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shards") / "out"
    S.prepare([corpus], tok_path, out, val_fraction=0.2, shard_tokens=600, workers=1, progress=False)
    return out


def one_line_error(exc: pytest.ExceptionInfo, *named: str) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    for n in named:
        assert n in msg, (n, msg)
    return msg


# ----------------------------------------------------------------- tokenizer


def test_tokenizer_trains_on_every_format_and_round_trips(corpus: Path, tok_path: Path) -> None:
    tok = load_tokenizer(tok_path)
    assert eos_id(tok) == 0 and tok.id_to_token(0) == EOS_TOKEN
    assert 257 < tok.get_vocab_size() <= 400
    # words that occur only in the jsonl and only in the parquet file were learned as merges
    for word in (" jsonlonlyword", " parquetonlyword"):
        assert len(tok.encode(word).ids) <= 2, word
    docs = [text for _, text in iter_documents([corpus])]
    assert len(docs) == 4 + 1 + 20 + 20  # the None row, the blank line and the .csv are skipped
    tricky = "  tabs\tand\nnewlines  ünïcode 日本語 \x00 and a literal <|endoftext|> inside"
    for text in docs[:5] + [tricky]:
        ids = encode_documents(tok, [text], 0, "uint16")[0]
        assert ids[-1] == 0 and 0 not in ids[:-1].tolist()  # the literal special string is plain text
        assert tok.decode(ids[:-1].tolist(), skip_special_tokens=False) == text


def test_tokenizer_hash_is_canonical(tok_path: Path, tmp_path: Path) -> None:
    h = tokenizer_hash(tok_path)
    assert len(h) == 16
    pretty = tmp_path / "pretty.json"
    pretty.write_text(json.dumps(json.loads(tok_path.read_text()), indent=4))
    assert tokenizer_hash(pretty) == h == tokenizer_hash(tok_path.read_text()) == tokenizer_hash(load_tokenizer(tok_path))
    other = train_tokenizer([_write(tmp_path / "o.txt", "other words entirely " * 50)], 300, tmp_path / "o.json", False)
    assert tokenizer_hash(other) != h


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.mark.parametrize("vocab", [0, 259, 1_000_001])
def test_tokenizer_vocab_out_of_range(corpus: Path, tmp_path: Path, vocab: int) -> None:
    with pytest.raises(UserError) as e:
        train_tokenizer([corpus], vocab, tmp_path / "t.json", progress=False)
    one_line_error(e, "--vocab-size", str(vocab))
    assert not (tmp_path / "t.json").exists()


# ----------------------------------------------------------------- prepare


def _split_docs(ds, split: str) -> list[list[int]]:
    docs: list[list[int]] = []
    for s in ds.shards(split):
        ids = np.asarray(ds.array(s)).tolist()
        assert ids[-1] == ds.eos_id  # a shard ends with a whole document
        cur: list[int] = []
        for t in ids:
            if t == ds.eos_id:
                docs.append(cur)
                cur = []
            else:
                cur.append(t)
        assert len(docs) == sum(x.docs for x in ds.shards(split)[: ds.shards(split).index(s) + 1])
    return docs


def test_prepare_writes_uint16_shards_of_whole_documents(corpus: Path, prepared: Path) -> None:
    ds = open_shards(prepared, verify=True)
    assert S.is_shard_dir(prepared) and not S.is_shard_dir(corpus)
    m = json.loads((prepared / MANIFEST).read_text())
    assert m["dtype"] == "uint16" and m["version"] == 1 and m["eos_id"] == 0
    assert m["tokenizer_hash"] == tokenizer_hash(prepared / TOKENIZER_FILE)
    assert m["inputs"] == [str(corpus)] and len(m["files"]) == 7
    assert len(ds.shards("train")) >= 3 and len(ds.shards("val")) >= 1
    for s in ds.manifest.shards:
        raw = (prepared / s.name).read_bytes()
        assert len(raw) == 2 * s.tokens and hashlib.sha256(raw).hexdigest() == s.sha256
        assert np.array_equal(np.fromfile(prepared / s.name, dtype="<u2"), np.asarray(ds.array(s)))
    for split in ("train", "val"):
        assert m["splits"][split]["tokens"] == sum(s.tokens for s in ds.shards(split))
    tok = ds.load_tokenizer()
    texts = {split: [tok.decode(d, skip_special_tokens=False) for d in _split_docs(ds, split)] for split in ("train", "val")}
    source = [text for _, text in iter_documents([corpus])]
    assert Counter(texts["train"] + texts["val"]) == Counter(source)  # every document whole, exactly once
    assert not set(texts["train"]) & set(texts["val"])
    assert m["splits"]["val"]["docs"] == len(texts["val"]) >= 1


def test_prepare_in_worker_processes_writes_the_same_shards(corpus: Path, tok_path: Path, prepared: Path,
                                                          tmp_path: Path) -> None:
    m = S.prepare([corpus], tok_path, tmp_path / "w2", val_fraction=0.2, shard_tokens=600, workers=2, progress=False)
    assert [s.sha256 for s in m.shards] == [s.sha256 for s in open_shards(prepared).manifest.shards]


def test_rerun_skips_finished_shards(corpus: Path, tok_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = S.prepare([corpus], tok_path, out, val_fraction=0.2, shard_tokens=600, workers=1, progress=False)
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.iterdir() if not p.name.startswith(".")}
    again = S.prepare([corpus], tok_path, out, val_fraction=0.2, shard_tokens=600, workers=1, progress=False)
    assert sorted(again.skipped) == sorted(s.name for s in first.shards)
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir() if not p.name.startswith(".")} == mtimes
    assert sorted(mtimes) == sorted([MANIFEST, TOKENIZER_FILE] + [s.name for s in first.shards])
    # other settings: the folder starts over, nothing stale remains
    third = S.prepare([corpus], tok_path, out, val_fraction=0.2, shard_tokens=10_000, workers=1, progress=False)
    assert third.skipped == [] and len(third.shards) < len(first.shards)
    assert sorted(p.name for p in out.glob("*.bin")) == sorted(s.name for s in third.shards)


def test_interrupted_run_leaves_no_manifest_and_resumes(corpus: Path, tok_path: Path, prepared: Path,
                                                         tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    real_finish, calls = W.ShardWriter.finish, []

    def finish_then_die(self: W.ShardWriter) -> ShardInfo:
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(1)
        return real_finish(self)

    monkeypatch.setattr(W.ShardWriter, "finish", finish_then_die)
    with pytest.raises(KeyboardInterrupt):
        S.prepare([corpus], tok_path, out, val_fraction=0.2, shard_tokens=600, workers=1, progress=False)
    assert not (out / MANIFEST).exists() and (out / STATE).exists()
    assert not list(out.glob("*.tmp")) and len(list(out.glob("*.bin"))) == 2
    with pytest.raises(UserError, match="unfinished"):
        open_shards(out)
    assert S.is_shard_dir(out)
    done = {p.name: p.stat().st_mtime_ns for p in out.glob("*.bin")}
    monkeypatch.setattr(W.ShardWriter, "finish", real_finish)
    m = S.prepare([corpus], tok_path, out, val_fraction=0.2, shard_tokens=600, workers=1, progress=False)
    assert sorted(m.skipped) == sorted(done) and not (out / STATE).exists()
    assert all((out / n).stat().st_mtime_ns == t for n, t in done.items())
    assert [s.to_json() for s in m.shards] == [s.to_json() for s in open_shards(prepared).manifest.shards]


def test_one_prepare_per_folder(corpus: Path, tok_path: Path, tmp_path: Path) -> None:
    import fcntl

    out = tmp_path / "busy"
    out.mkdir()
    with open(out / ".prepare.lock", "w") as held:
        held.write("4242")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(UserError) as e:
            S.prepare([corpus], tok_path, out, workers=1, progress=False)
        one_line_error(e, f"--out {out}", "pid 4242")
    assert sorted(p.name for p in out.iterdir()) == [".prepare.lock"]

def test_validation_gets_at_least_one_of_two_documents_and_none_of_one(tok_path: Path, tmp_path: Path) -> None:
    rng = random.Random(1)
    two = tmp_path / "two"
    for name in ("a.txt", "b.txt"):
        _write(two / name, _doc(rng, 50))
    m = S.prepare([two], tok_path, tmp_path / "o2", val_fraction=0.01, workers=1, progress=False)
    assert m.docs("train") == 1 and m.docs("val") == 1
    one = _write(tmp_path / "one.txt", _doc(rng, 50))
    m = S.prepare([one], tok_path, tmp_path / "o1", val_fraction=0.5, workers=1, progress=False)
    assert m.docs("train") == 1 and m.docs("val") == 0
    with pytest.raises(UserError) as e:
        token_validation_batches(open_shards(tmp_path / "o1"), 2, 8)
    one_line_error(e, "no validation documents")


# ----------------------------------------------------------------- synthetic shard folders


def _synthetic(root: Path, splits: dict[str, list[np.ndarray]], tok_path: Path, vocab: int | None = None,
               max_token: int | None = None) -> Path:
    """A shard folder written directly: .bin files (in chunks) and a manifest, no tokenizing."""
    root.mkdir(parents=True)
    (root / TOKENIZER_FILE).write_text(tok_path.read_text())
    infos = []
    for split, arrays in splits.items():
        for i, arr in enumerate(arrays):
            name, h = f"{split}-{i:05d}.bin", hashlib.sha256()
            with open(root / name, "wb") as f:
                for lo in range(0, len(arr), 1 << 22):
                    raw = arr[lo: lo + (1 << 22)].astype("<u2").tobytes()
                    f.write(raw)
                    h.update(raw)
            top = int(arr.max()) if max_token is None else max_token
            infos.append(ShardInfo(name, split, len(arr), 1, h.hexdigest(), top))
    m = Manifest(tokenizer_hash=tokenizer_hash(tok_path), vocab_size=vocab or load_tokenizer(tok_path).get_vocab_size(),
                 dtype="uint16", eos_id=0, shards=infos, val_fraction=0.1, shard_tokens=0, inputs=[], files=[], key="x")
    (root / MANIFEST).write_text(json.dumps(m.to_json()))
    return root


@pytest.fixture(scope="module")
def counting(tok_path: Path, tmp_path_factory: pytest.TempPathFactory):
    """Shards whose token i is i mod vocab: any window shows whether it is contiguous."""
    vocab = 300
    lengths = [1000, 37, 2500, 129]
    arrays = [(np.arange(n) + 7 * k) % vocab for k, n in enumerate(lengths)]
    root = _synthetic(tmp_path_factory.mktemp("count") / "ds", {"train": arrays, "val": [np.arange(700) % vocab]},
                      tok_path, vocab=vocab)
    return open_shards(root, verify=True)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), batch=st.integers(1, 9), context=st.integers(1, 128), draws=st.integers(1, 4))
def test_token_windows_are_contiguous_and_y_is_x_shifted(counting, seed: int, batch: int, context: int,
                                                          draws: int) -> None:
    b = TokenBatches(dataset=counting, batch_size=batch, context=context, seed=seed)
    for _ in range(draws):
        x, y = b.next()
        assert x.shape == y.shape == (batch, context) and x.dtype == y.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
        assert torch.equal((x + 1) % 300, y)  # consecutive tokens of one shard: the window never crosses shards


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3000), key=st.integers(0, 2**64 - 1))
def test_permutation_is_a_bijection(n: int, key: int) -> None:
    out = permute(np.arange(n, dtype=np.uint64), n, [key, key ^ 1, key // 3, 7])
    assert np.array_equal(np.sort(out), np.arange(n, dtype=np.uint64))


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 5000), min_size=1, max_size=6), context=st.integers(1, 300),
       seed=st.integers(0, 1000), epoch=st.integers(0, 5))
def test_epoch_windows_stay_inside_their_shard(lengths: list[int], context: int, seed: int, epoch: int) -> None:
    lens = np.array(lengths, dtype=np.int64)
    lay = epoch_layout(lens, context, seed, epoch)
    if lay.windows == 0:
        assert (lens <= context).all()
        return
    shard, start = lay.locate(np.arange(lay.windows), context)
    assert (start >= 0).all() and (start + context + 1 <= lens[shard]).all()
    assert len(set(zip(shard.tolist(), start.tolist()))) == lay.windows  # non-overlapping, each once


def test_token_batches_are_seeded_and_resume_exactly(counting) -> None:
    a, b, c = (TokenBatches(dataset=counting, batch_size=4, context=16, seed=seed) for seed in (1, 1, 2))
    first = [a.next() for _ in range(5)]
    assert all(torch.equal(p[0], q[0]) for p, q in zip(first, (b.next() for _ in range(5))))
    assert not all(torch.equal(p[0], q[0]) for p, q in zip(first, (c.next() for _ in range(5))))
    state = json.loads(json.dumps(a.state_dict()))  # plain JSON-able ints and strings
    ahead = [a.next() for _ in range(300)]  # crosses several epochs
    assert a.epoch >= 2
    resumed = TokenBatches(dataset=counting, batch_size=4, context=16, seed=123)
    resumed.load_state_dict(state)
    assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(ahead, (resumed.next() for _ in range(300))))
    with pytest.raises(ValueError, match="context"):
        TokenBatches(dataset=counting, batch_size=4, context=8, seed=1).load_state_dict(state)


def test_an_epoch_visits_every_window_once(counting) -> None:
    b = TokenBatches(dataset=counting, batch_size=1, context=32, seed=5)
    n = b.layout(0).windows
    which, starts = b._next_windows(n)
    assert len(set(zip(which.tolist(), starts.tolist()))) == n and (b.epoch, b.position) == (1, 0)


def test_validation_windows_are_fixed(counting) -> None:
    full = token_validation_batches(counting, 4, 10)
    assert sum(len(x) for x, _ in full) == 699 // 10
    assert torch.equal(full[0][0][0], torch.arange(10)) and torch.equal(full[0][1][0], torch.arange(1, 11))
    few = token_validation_batches(counting, 4, 10, max_batches=2)
    again = token_validation_batches(counting, 4, 10, max_batches=2)
    assert len(few) == 2 and all(torch.equal(p[0], q[0]) for p, q in zip(few, again))


def test_memmap_rss_does_not_grow_with_the_shards(tok_path: Path, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    n = 32 << 20  # 64 MB of uint16 tokens, written in 8 MB pieces
    root = tmp_path / "big"
    root.mkdir()
    (root / TOKENIZER_FILE).write_text(tok_path.read_text())
    h = hashlib.sha256()
    with open(root / "train-00000.bin", "wb") as f:
        for _ in range(8):
            raw = rng.integers(1, 300, size=n // 8, dtype=np.uint16).astype("<u2").tobytes()
            f.write(raw)
            h.update(raw)
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # as if on disk, not in the page cache
    m = Manifest(tokenizer_hash=tokenizer_hash(tok_path), vocab_size=300, dtype="uint16", eos_id=0,
                 shards=[ShardInfo("train-00000.bin", "train", n, 1, h.hexdigest(), 299)], val_fraction=0.1,
                 shard_tokens=n, inputs=[], files=[], key="x")
    (root / MANIFEST).write_text(json.dumps(m.to_json()))
    proc = psutil.Process()
    ds = open_shards(root)
    batches = TokenBatches(dataset=ds, batch_size=8, context=128, seed=0)
    batches.next()
    before = proc.memory_info()
    for _ in range(200):
        x, y = batches.next()
    after = proc.memory_info()
    # 1600 windows of 129 tokens: the pages they span (~7 MB at most), not the 64 MB shard
    assert after.rss - before.rss < (64 << 20) // 4
    assert (after.rss - after.shared) - (before.rss - before.shared) < 4 << 20  # private memory stays flat
    assert int(x.max()) < 300


# ----------------------------------------------------------------- corrupt shards and bad inputs


def test_corrupt_shards_are_named(prepared: Path, tmp_path: Path) -> None:
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(prepared, bad)
    shard = bad / "train-00001.bin"
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 0xFF
    shard.write_bytes(bytes(raw))
    open_shards(bad)  # sizes agree: only a full check sees it
    with pytest.raises(UserError) as e:
        open_shards(bad, verify=True)
    one_line_error(e, str(shard), "sha256")
    shard.write_bytes(bytes(raw[:-3]))
    with pytest.raises(UserError) as e:
        open_shards(bad)
    one_line_error(e, str(shard), "truncated")
    shard.unlink()
    with pytest.raises(UserError) as e:
        open_shards(bad)
    one_line_error(e, str(shard), "missing")


def test_tokenizer_must_match_the_shards(prepared: Path, tmp_path: Path) -> None:
    other = train_tokenizer([_write(tmp_path / "o.txt", "something else again " * 40)], 300, tmp_path / "o.json", False)
    ds = open_shards(prepared)
    ds.check_tokenizer(prepared / TOKENIZER_FILE)
    with pytest.raises(UserError) as e:
        ds.check_tokenizer(other)
    one_line_error(e, f"tokenizer {other} does not match the shards in {prepared}", tokenizer_hash(other))
    import shutil

    swapped = tmp_path / "swapped"
    shutil.copytree(prepared, swapped)
    (swapped / TOKENIZER_FILE).write_text(other.read_text())
    with pytest.raises(UserError) as e:
        open_shards(swapped)
    one_line_error(e, str(swapped / TOKENIZER_FILE), "hash")


def test_token_id_beyond_vocabulary_is_named(tok_path: Path, tmp_path: Path) -> None:
    arr = np.arange(2000) % 300
    arr[1500] = 999
    honest = _synthetic(tmp_path / "honest", {"train": [arr]}, tok_path, vocab=300)
    with pytest.raises(UserError) as e:
        open_shards(honest)
    one_line_error(e, str(honest / "train-00000.bin"), "999", "vocabulary")
    lying = _synthetic(tmp_path / "lying", {"train": [arr]}, tok_path, vocab=300, max_token=299)
    with pytest.raises(UserError) as e:
        open_shards(lying, verify=True)
    one_line_error(e, str(lying / "train-00000.bin"), "999")
    batches = TokenBatches(dataset=open_shards(lying), batch_size=64, context=30, seed=0)  # lazily: the window holding it
    with pytest.raises(UserError) as e:
        for _ in range(100):
            batches.next()
    one_line_error(e, str(lying / "train-00000.bin"), "999")


def _bad_inputs(root: Path) -> dict[str, tuple[Path, list[str]]]:
    cases: dict[str, tuple[Path, list[str]]] = {}
    cases["missing"] = (root / "nope", ["nope", "no such file"])
    _write(root / "empty" / "a.txt", "")
    _write(root / "empty" / "b.md", "  \n")
    cases["empty"] = (root / "empty", ["no text"])
    (root / "nothing").mkdir()
    _write(root / "nothing" / "x.csv", "1,2")
    cases["no files"] = (root / "nothing", ["nothing", "no .txt"])
    cases["suffix"] = (_write(root / "data.csv", "x"), ["data.csv", "unsupported"])
    cases["json"] = (_write(root / "j" / "bad.jsonl", '{"text": "fine"}\n{"text": oops}\n'), ["bad.jsonl:2", "not a JSON"])
    cases["field"] = (_write(root / "f" / "nofield.jsonl", '{"body": "x"}\n'), ["nofield.jsonl:1", "'text'", "body"])
    (root / "p").mkdir()
    pq.write_table(pa.table({"body": ["a", "b"]}), root / "p" / "cols.parquet")
    cases["column"] = (root / "p" / "cols.parquet", ["cols.parquet", "'text' column", "body"])
    cases["not parquet"] = (_write(root / "q" / "junk.parquet", "not parquet"), ["junk.parquet", "parquet"])
    return cases


def test_bad_inputs_are_one_line_errors_naming_the_file(tok_path: Path, tmp_path: Path) -> None:
    for name, (path, named) in _bad_inputs(tmp_path / "in").items():
        with pytest.raises(UserError) as e:
            train_tokenizer([path], 300, tmp_path / "t.json", progress=False)
        one_line_error(e, *named)
        assert not (tmp_path / "t.json").exists(), name
        with pytest.raises(UserError) as e:
            S.prepare([path], tok_path, tmp_path / "out", workers=1, progress=False)
        one_line_error(e, *named)
        assert not (tmp_path / "out").exists(), name


def test_bad_settings(corpus: Path, tok_path: Path, tmp_path: Path) -> None:
    for kw, named in (({"val_fraction": 0.0}, "--val-fraction"), ({"val_fraction": 1.0}, "--val-fraction"),
                      ({"workers": 0}, "--workers"), ({"shard_tokens": 0}, "--shard-tokens")):
        with pytest.raises(UserError) as e:
            S.prepare([corpus], tok_path, tmp_path / "o", progress=False, **kw)
        one_line_error(e, named)
    noeos = tmp_path / "noeos.json"
    obj = json.loads(tok_path.read_text())
    obj["added_tokens"] = []
    obj["model"]["vocab"] = {k: v for k, v in obj["model"]["vocab"].items() if k != EOS_TOKEN}
    noeos.write_text(json.dumps(obj))
    for tok, named in ((noeos, EOS_TOKEN), (tmp_path / "none.json", "no such file"), (corpus / "notes.md", "not a tokenizers")):
        with pytest.raises(UserError) as e:
            S.prepare([corpus], tok, tmp_path / "o", workers=1, progress=False)
        one_line_error(e, str(tok), named)
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------- node data (CLI)


def _node(args: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    from node.cli.app import main

    with pytest.raises(SystemExit) as e:
        main(args)
    out, err = capsys.readouterr()
    return e.value.code, out, err


def test_cli_tokenizer_and_prepare(corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    tok = tmp_path / "tok" / "t.json"
    code, out, err = _node(["data", "tokenizer", "--input", str(corpus), "--vocab-size", "300", "--out", str(tok),
                            "--no-progress"], capsys)
    assert code == 0, err
    assert out.count("\n") == 1 and str(tok) in out and tokenizer_hash(tok) in out
    shards = tmp_path / "shards"
    args = ["data", "prepare", "-i", str(corpus / "book0.txt"), "-i", str(corpus / "nested"), "--tokenizer", str(tok),
            "--out", str(shards), "--val-fraction", "0.1", "--workers", "1", "--shard-tokens", "700", "--no-progress"]
    code, out, err = _node(args, capsys)
    assert code == 0, err
    assert out.count("\n") == 1 and out.startswith(f"prepared {shards}: train ") and "uint16" in out
    assert open_shards(shards, verify=True).manifest.docs("train") + open_shards(shards).manifest.docs("val") == 41
    code, out, _ = _node(args, capsys)
    assert code == 0 and "reused" in out


def test_cli_bad_input_is_one_error_line_and_writes_nothing(corpus: Path, tok_path: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture) -> None:
    mixed = tmp_path / "mixed"
    _write(mixed / "a.txt", "good text " * 100)
    _write(mixed / "b.jsonl", '{"text": "fine"}\n' * 5 + "garbage\n")
    cases = [
        (["data", "tokenizer", "--input", str(mixed), "--out", str(tmp_path / "t.json"), "--vocab-size", "300"],
         ["b.jsonl:6"]),
        (["data", "tokenizer", "--input", str(corpus), "--out", str(tmp_path / "t.json"), "--vocab-size", "12"],
         ["--vocab-size 12"]),
        (["data", "prepare", "--input", str(mixed), "--tokenizer", str(tok_path), "--out", str(tmp_path / "o"),
          "--workers", "1"], ["b.jsonl:6"]),
        (["data", "prepare", "--input", str(corpus), "--tokenizer", str(tmp_path / "missing.json"),
          "--out", str(tmp_path / "o")], ["missing.json"]),
        (["data", "prepare", "--input", str(corpus), "--out", str(tmp_path / "o")], ["--tokenizer"]),
    ]
    for args, named in cases:
        code, out, err = _node(args, capsys)
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (args, err)
        assert "Traceback" not in err + out
        for n in named:
            assert n in lines[0], (n, lines[0])
    assert not (tmp_path / "t.json").exists() and not (tmp_path / "o").exists()
    assert not list(tmp_path.glob(".t.json*"))
