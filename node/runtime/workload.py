"""What a node trains: the model's architecture and its data, resolved once from the settings.

Data is either bytes (the embedded corpus, or ``--data`` a text file or folder: vocabulary 256) or
prepared token shards (``--data`` a folder written by ``node data prepare``: its tokenizer sets the
vocabulary). The architecture is a ``--model`` preset, a Hugging Face ``config.json``
(``--model-config``), or the folder of ``--init-from`` (a Hugging Face model folder, whose weights
start the run). Every peer of a run must agree on both: :func:`identity` is what joins the run's
settings (``node/runtime/settings.py``), cheap enough to compute before anything is loaded.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from node.errors import UserError
from node.checkpoints.contents import checkpoint_model, is_hf_folder
from node.data.shard_format import is_shard_dir

BYTES = "bytes"  # the tokenizer identity of byte-level data


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def identity(cfg: Any) -> dict[str, str]:
    """The run-shaping identity of the model and the tokenizer: ``{"model": ..., "tokenizer": ...}``.

    ``model`` is the preset's name, or ``custom-<digest>`` of an architecture read from a file;
    ``tokenizer`` is ``bytes`` or the tokenizer's hash. Reads only small JSON files, once.
    """
    return dict(_identity(cfg.data, cfg.model, cfg.model_config_file, cfg.init_from, cfg.context))


@functools.lru_cache(maxsize=16)
def _identity(data: Path | None, model: str, model_config: Path | None, init_from: Path | None,
              context: int | None) -> tuple[tuple[str, str], ...]:
    tokenizer = BYTES
    if data is not None and is_shard_dir(data) and (Path(data) / "manifest.json").is_file():
        try:
            tokenizer = json.loads((Path(data) / "manifest.json").read_text())["tokenizer_hash"]
        except (OSError, ValueError, KeyError):
            tokenizer = "unreadable"  # open_shards says what is wrong when the node loads the data
    source = model_config or (Path(init_from) / "config.json" if is_hf_folder(init_from) else None)
    if source is not None:
        try:
            model = f"custom-{_digest(json.loads(Path(source).read_text()))}"
        except (OSError, ValueError):
            model = "custom-unreadable"
    if context is not None:
        model = f"{model}@{context}"
    return (("model", model), ("tokenizer", tokenizer))


@functools.lru_cache(maxsize=4)
def load_init_weights(path: Path, model: Any) -> tuple[list[Any], Path]:
    """The weights of a locomesh checkpoint for ``--init-from`` (``phi``, else ``theta``); raises :class:`UserError`."""
    from node.checkpoints.checkpoint import CHECKPOINT_NAME, load
    from swarm.models.presets import PRESETS

    file = Path(path) / CHECKPOINT_NAME if Path(path).is_dir() else Path(path)
    hint = "give the checkpoint.pt a locomesh node wrote (or its --checkpoint-dir), or a Hugging Face model folder"
    if not file.is_file():
        raise UserError(f"--init-from {path}: no checkpoint at {file}; {hint}")
    try:
        state = load(file)
    except ValueError as e:
        raise UserError(f"--init-from {path}: {e}") from None
    if state.get("role") in ("stage", "trainer"):
        raise UserError(f"--init-from {path}: {file} is a pipeline {state['role']}'s checkpoint (--stages > 1) and holds "
                        f"{'one stage' if state['role'] == 'stage' else 'no weights'} of the model; {hint}")
    weights = state.get("phi", state.get("theta"))
    if not isinstance(weights, list) or not isinstance(state.get("model_config"), dict):
        raise UserError(f"--init-from {path}: {file} holds no model weights; {hint}")
    if state["model_config"] != model.to_dict():
        names = [n for n, c in PRESETS.items() if c.to_dict() == state["model_config"]]
        raise UserError(f"--init-from {path} holds a {' / '.join(names) or 'custom'} model, not this one; "
                        f"pass --model {names[0] if names else 'matching the checkpoint'} (and the same --data)")
    return [t.float() for t in weights], file


@dataclass
class Workload:
    """The resolved model config, batches and tokenizer of a node.

    ``val`` holds fixed held-out batches identical on every node; ``val_bytes`` the UTF-8 bytes their
    targets decode to (bits per byte = nats × targets ÷ bytes ÷ ln 2); ``tokenizer_json`` travels in
    checkpoints so ``node eval`` and ``node export`` need nothing else.
    """

    model_cfg: Any
    source: str
    val: list[tuple[Any, Any]]
    val_bytes: int
    tokenizer_json: str | None
    init_weights: list[Any] | None  # from --init-from, when the run starts fresh
    _dataset: Any
    _corpus: Any
    init_source: str | None = None

    @property
    def unit(self) -> str:
        return "byte" if self.tokenizer_json is None else "token"

    def train_batches(self, batch_size: int, seed: int) -> Any:
        """This node's seeded training batches (``next()``, ``state_dict()``, ``load_state_dict()``)."""
        if self._dataset is not None:
            from node.data.token_batches import TokenBatches

            return TokenBatches(dataset=self._dataset, batch_size=batch_size, context=self.model_cfg.context, seed=seed)
        from node.data.bytes import ByteBatches

        return ByteBatches(data=self._corpus.train, batch_size=batch_size, context=self.model_cfg.context, seed=seed)

    def bits_per_byte(self, loss: float) -> float | None:
        """Bits per UTF-8 byte of the held-out batches at mean loss ``loss`` (nats per token or byte)."""
        targets = sum(y.numel() for _, y in self.val)
        if not self.val_bytes or not math.isfinite(loss):
            return None
        return loss * targets / self.val_bytes / math.log(2)


def _architecture(cfg: Any, vocab: int) -> tuple[Any, list[Any] | None, str | None]:
    """(model config, initial weights or None, tokenizer JSON of an --init-from folder or None) for data of
    ``vocab`` ids: a preset takes the data's vocabulary, an architecture from a file must have room for it."""
    from swarm.models.presets import config_from_hf, preset, with_vocab

    weights, folder_tokenizer = None, None
    if is_hf_folder(cfg.init_from):
        from node.checkpoints.hf_export import load_hf_folder

        model_cfg, weights, folder_tokenizer = load_hf_folder(Path(cfg.init_from))
        where = f"--init-from {cfg.init_from}"
    elif cfg.model_config_file is not None:
        try:
            model_cfg = config_from_hf(cfg.model_config_file)
        except ValueError as e:
            raise UserError(f"--model-config {cfg.model_config_file}: {e}") from None
        where = f"--model-config {cfg.model_config_file}"
    else:
        model_cfg, where = with_vocab(preset(cfg.model), vocab), ""
    if where and vocab > model_cfg.vocab_size:
        raise UserError(f"{where} has {model_cfg.vocab_size} token embeddings, fewer than the {vocab} ids of the data "
                        f"({'bytes' if vocab == 256 else 'its tokenizer'}): train on data prepared with the model's tokenizer")
    if cfg.context is not None:
        if weights is None or cfg.context <= model_cfg.context:
            model_cfg = replace(model_cfg, context=cfg.context)  # rotary weights do not depend on the context
        else:
            raise UserError(f"--context {cfg.context} is longer than the {model_cfg.context} tokens {where} was trained for")
    return model_cfg, weights, folder_tokenizer


def load_workload(cfg: Any, batch_size: int | None = None, max_batches: int | None = None) -> Workload:
    """Everything a node trains on, from its settings; problems are one-line :class:`UserError`s."""
    batch_size = batch_size or cfg.batch_size
    max_batches = max_batches if max_batches is not None else cfg.eval_batches
    if cfg.data is not None and is_shard_dir(cfg.data):
        from node.data.shard_format import open_shards
        from node.data.token_batches import token_validation_batches
        from node.data.tokenizer import tokenizer_hash

        dataset = open_shards(Path(cfg.data))
        tokenizer_json = dataset.tokenizer_path.read_text(encoding="utf-8")
        model_cfg, weights, folder_tokenizer = _architecture(cfg, dataset.vocab_size)
        if folder_tokenizer is not None and tokenizer_hash(folder_tokenizer) != dataset.tokenizer_hash:
            raise UserError(f"--init-from {cfg.init_from}: its tokenizer.json differs from the one the shards in {cfg.data} "
                            "were prepared with; prepare them with the folder's tokenizer (node data prepare --tokenizer "
                            f"{Path(cfg.init_from) / 'tokenizer.json'})")
        if dataset.tokens("train") < model_cfg.context + 1:
            raise UserError(f"--data {cfg.data}: {dataset.tokens('train')} training tokens, fewer than one sequence of "
                            f"{model_cfg.context + 1}; add data or use a model with a shorter context")
        val = token_validation_batches(dataset, batch_size, model_cfg.context, max_batches=max_batches)
        tok = dataset.load_tokenizer()
        val_bytes = sum(len(tok.decode(row.tolist()).encode("utf-8")) for _, y in val for row in y)
        return _with_checkpoint_init(cfg, Workload(model_cfg, f"{cfg.data} ({dataset.tokens('train'):,} training tokens)",
                                                   val, val_bytes, tokenizer_json, weights, dataset, None))
    from node.data.byte_corpus import load_corpus
    from node.data.bytes import validation_batches

    if is_hf_folder(cfg.init_from) and not _byte_level_folder(Path(cfg.init_from)):
        raise UserError(f"--init-from {cfg.init_from} is a tokenized model: give --data a folder prepared with its "
                        f"tokenizer (node data prepare --tokenizer {Path(cfg.init_from) / 'tokenizer.json'} ...)")
    model_cfg, weights, _ = _architecture(cfg, 256)
    corpus = load_corpus(str(cfg.data) if cfg.data else None, context=model_cfg.context)
    val = validation_batches(corpus.val, batch_size, model_cfg.context, max_batches=max_batches)
    return _with_checkpoint_init(cfg, Workload(model_cfg, corpus.source, val, sum(y.numel() for _, y in val), None, weights,
                                               None, corpus))


def _byte_level_folder(folder: Path) -> bool:
    """A Hugging Face folder of a model trained on bytes: its tokenizer.json maps text to its UTF-8 bytes
    (what ``node export`` writes for byte-level runs), or it has none and 256 token embeddings."""
    from node.data.tokenizer import is_byte_level

    tok_file = folder / "tokenizer.json"
    if tok_file.is_file():
        try:
            return is_byte_level(tok_file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            return False
    try:
        return json.loads((folder / "config.json").read_text()).get("vocab_size") == 256
    except (OSError, ValueError, AttributeError):
        return False


def _with_checkpoint_init(cfg: Any, work: Workload) -> Workload:
    """``--init-from`` a Hugging Face folder is read with the architecture; a locomesh checkpoint here."""
    if cfg.init_from is not None:
        if work.init_weights is None:
            work.init_weights, path = load_init_weights(Path(cfg.init_from), work.model_cfg)
            work.init_source = str(path)
        else:
            work.init_source = str(cfg.init_from)
    return work
