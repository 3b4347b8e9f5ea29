"""Real workloads end to end: tokenizer → shards → a Llama node → checkpoint → eval → Hugging Face export.

The unit half resolves workloads from settings (vocabulary from the tokenizer, architecture files,
mismatches as one-line errors); the process half runs one real ``node join`` on prepared shards.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from node.config import NodeConfig, load_config
from node.errors import UserError
from node.runtime.settings import run_settings
from node.data.shards import prepare
from node.data.tokenizer import train_tokenizer
from node.runtime.workload import identity, load_workload
from tests.helpers import zygote

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex jovial kings "
         "and queens of distant lands sing of rivers mountains stars and the sea").split()


def _documents(folder: Path, count: int = 12, words: int = 900) -> Path:
    import random

    rng = random.Random(7)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (folder / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(words)) + ".\n")
    return folder


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("workload")
    docs = _documents(root / "docs")
    tok = train_tokenizer([docs], 300, root / "tokenizer.json", progress=False)
    prepare([docs], tok, root / "shards", val_fraction=0.2, workers=1, progress=False)
    return root / "shards"


def test_a_shard_folder_sets_the_vocabulary_and_the_settings(shards: Path) -> None:
    cfg = NodeConfig(model="llama-tiny", data=shards, batch_size=4, eval_batches=2)
    work = load_workload(cfg)
    manifest = json.loads((shards / "manifest.json").read_text())
    assert work.model_cfg.vocab_size == manifest["vocab_size"] == 300
    assert work.unit == "token" and work.tokenizer_json is not None
    x, y = work.train_batches(4, seed=1).next()
    assert x.shape == (4, work.model_cfg.context) and int(x.max()) < 300 and torch.equal(x[:, 1:], y[:, :-1])
    assert 0 < work.val_bytes and work.bits_per_byte(math.log(2)) == pytest.approx(
        sum(t.numel() for _, t in work.val) / work.val_bytes)
    assert run_settings(cfg)["tokenizer"] == manifest["tokenizer_hash"]
    assert identity(NodeConfig(model="llama-tiny"))["tokenizer"] == "bytes"


def test_the_same_preset_on_bytes_has_256_ids_and_a_context_flag_cuts_sequences() -> None:
    work = load_workload(NodeConfig(model="llama-tiny", context=32, batch_size=2, eval_batches=1))
    assert work.model_cfg.vocab_size == 256 and work.model_cfg.context == 32 and work.unit == "byte"
    assert run_settings(NodeConfig(model="llama-tiny", context=32))["model"] == "llama-tiny@32"


def test_an_architecture_file_replaces_the_preset_and_must_fit_the_tokenizer(shards: Path, tmp_path: Path) -> None:
    conf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320,
            "max_position_embeddings": 48, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(conf))
    cfg = load_config({"model_config_file": path, "data": shards, "batch_size": 2, "eval_batches": 1})
    work = load_workload(cfg)
    assert (work.model_cfg.vocab_size, work.model_cfg.d_model, work.model_cfg.context) == (320, 64, 48)
    assert run_settings(cfg)["model"].startswith("custom-")
    path.write_text(json.dumps({**conf, "vocab_size": 200}))
    with pytest.raises(UserError, match="200 token embeddings, fewer than the 300 ids"):
        load_workload(load_config({"model_config_file": path, "data": shards}))
    path.write_text(json.dumps({**conf, "num_hidden_layers": 2}))
    with pytest.raises(UserError, match="--stages 3: model .* has only 2 blocks"):
        load_config({"model_config_file": path, "stages": 3})


def test_the_embedded_corpus_is_written_as_text_with_the_demo_held_out_plays(tmp_path: Path) -> None:
    from node.data.byte_corpus import load_embedded_corpus

    out = zygote.run(["data", "corpus", "--out", str(tmp_path / "plays")],
                         timeout=120)
    assert out.returncode == 0, out.stderr
    corpus = load_embedded_corpus()
    assert sorted(p.read_text() for p in (tmp_path / "plays" / "val").iterdir()) == sorted(corpus.val_docs)
    assert len(list((tmp_path / "plays" / "train").iterdir())) == len(corpus.train_docs)
    again = zygote.run(["data", "corpus", "--out", str(tmp_path / "plays")],
                           timeout=120)
    assert again.returncode == 2 and again.stderr.strip().startswith("error: ") and len(again.stderr.strip().splitlines()) == 1


def test_mismatches_are_one_line_errors(shards: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="--model-config: .*is not a file"):
        load_config({"model_config_file": tmp_path / "missing.json"})
    with pytest.raises(UserError, match="--init-from starts whole-model replicas"):
        load_config({"init_from": shards, "stages": 2, "model": "micro"})
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(UserError, match="is a tokenized model: give --data a folder prepared with its tokenizer"):
        load_workload(NodeConfig(init_from=folder))


def test_a_llama_node_trains_on_shards_resumes_evaluates_and_exports(shards: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    ckpt, info = tmp_path / "ck", tmp_path / "info.json"
    args = ["join", "--model", "llama-tiny", "--data", str(shards), "--inner-steps", "10",
            "--batch-size", "4", "--context", "64", "--eval-batches", "2", "--threads", "1",
            "--listen", "/ip4/127.0.0.1/tcp/0", "--checkpoint-dir", str(ckpt), "--info-file", str(info)]
    run = zygote.run(args + ["--max-steps", "20"], timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    first = json.loads(info.read_text())
    assert first["steps"] == 20 and first["val_bits_per_byte"] is not None
    state = torch.load(ckpt / "checkpoint.pt", weights_only=True)
    assert state["tokenizer"] == (shards / "tokenizer.json").read_text()
    assert state["settings"]["tokenizer"] == json.loads((shards / "manifest.json").read_text())["tokenizer_hash"]
    position = state["data_order"]

    # resumed: the data order goes on where it stopped, not from its start
    run = zygote.run(args + ["--max-steps", "30"], timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    resumed = json.loads(info.read_text())
    assert resumed["resumed_from"]["round"] == 2 and resumed["steps"] == 30
    assert torch.load(ckpt / "checkpoint.pt", weights_only=True)["data_order"] != position

    # node eval tokenizes text itself; the shard folder's validation split is its default
    text = tmp_path / "held_out.txt"
    _documents(tmp_path / "extra", count=1, words=600)
    text.write_text((tmp_path / "extra" / "doc00.txt").read_text())
    for data in ([], ["--data", str(text)]):  # the shards' validation split (the default), and text
        out = zygote.run(["eval", "--checkpoint", str(ckpt / "checkpoint.pt"), "--json",
                              "--batch-size", "4", "--batches", "2", *data], timeout=120, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        result = json.loads(out.stdout)
        assert result["unit"] == "token" and result["bytes"] > result["tokens"] > 0
        assert result["bits_per_byte"] == pytest.approx(result["loss"] * result["tokens"] / result["bytes"] / math.log(2))

    # the export opens in transformers with the same logits
    transformers = pytest.importorskip("transformers")
    out = zygote.run(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "hf"),
                          "--weights", "theta"], timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    from swarm.models.presets import build_model, config_from_dict

    state = torch.load(ckpt / "checkpoint.pt", weights_only=True)
    model = build_model(config_from_dict(state["model_config"])).eval()
    with torch.no_grad():
        for p, t in zip(model.parameters(), state["theta"]):
            p.copy_(t)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = tok("the quick brown fox jumps over the lazy dog", return_tensors="pt").input_ids
    with torch.no_grad():
        assert (hf(ids).logits - model(ids)[0]).abs().max() < 1e-4


def test_a_byte_level_llama_round_trips_through_export_and_init_from(tmp_path: Path) -> None:
    """Plain text (bytes) → llama-tiny → node export (with a byte-level tokenizer.json) → node join --init-from
    that folder, and --init-from the checkpoint without --model → node export → transformers, whose
    tokenizer gives the UTF-8 bytes and whose logits match the checkpoint's."""
    transformers = pytest.importorskip("transformers")
    from node.data.tokenizer import is_byte_level
    from swarm.models.presets import build_model, config_from_dict

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    text = tmp_path / "text.txt"
    _documents(tmp_path / "docs", count=1, words=3000)
    text.write_text((tmp_path / "docs" / "doc00.txt").read_text())

    def join(name: str, *extra: str) -> dict:
        info = tmp_path / f"{name}.json"
        run = zygote.run(["join", "--data", str(text), "--inner-steps", "10", "--batch-size", "4",
                              "--eval-batches", "2", "--threads", "1", "--max-steps", "20", "--seed", "0", "--init-seed", "0",
                              "--listen", "/ip4/127.0.0.1/tcp/0", "--checkpoint-dir", str(tmp_path / name), "--info-file", str(info), *extra],
                             timeout=300, env=env)
        assert run.returncode == 0, run.stderr[-2000:]
        return json.loads(info.read_text())

    def export(name: str) -> Path:
        out = zygote.run(["export", "--checkpoint", str(tmp_path / name), "--out", str(tmp_path / f"{name}-hf"),
                              "--weights", "theta"], timeout=120, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        return tmp_path / f"{name}-hf"

    fresh = join("fresh", "--model", "llama-tiny", "--context", "64")
    first = export("fresh")
    assert is_byte_level((first / "tokenizer.json").read_text()), "a byte-level model exports a byte-level tokenizer"
    # both ways back in: the exported folder (no --model: it has its own config.json) and the checkpoint
    from_folder = join("from-folder", "--init-from", str(first))
    from_checkpoint = join("from-checkpoint", "--init-from", str(tmp_path / "fresh" / "checkpoint.pt"), "--context", "64")
    for info in (from_folder, from_checkpoint):  # trained weights, not a fresh start at ~ln 256
        assert info["train_loss_first"] < fresh["train_loss_first"] - 0.5, (info["train_loss_first"], fresh["train_loss_first"])
    assert torch.load(tmp_path / "from-checkpoint" / "checkpoint.pt", weights_only=True)["config"]["model"] == "llama-tiny"

    last = export("from-folder")
    state = torch.load(tmp_path / "from-folder" / "checkpoint.pt", weights_only=True)
    model = build_model(config_from_dict(state["model_config"])).eval()
    with torch.no_grad():
        for p, t in zip(model.parameters(), state["theta"]):
            p.copy_(t)
    hf = transformers.AutoModelForCausalLM.from_pretrained(last).eval()
    tok = transformers.AutoTokenizer.from_pretrained(last)
    sample = "the quick brown fox — über naïve"
    ids = tok(sample, return_tensors="pt").input_ids
    assert ids[0].tolist() == list(sample.encode("utf-8"))
    assert tok.decode(ids[0]) == sample
    with torch.no_grad():
        assert (hf(ids).logits - model(ids)[0]).abs().max() < 1e-4
