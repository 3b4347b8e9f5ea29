"""``node eval``: held-out loss of a saved checkpoint, in nats per token and bits per UTF-8 byte.

A byte-level checkpoint is scored on the embedded corpus's held-out plays or on given text. A
checkpoint trained on token shards carries its tokenizer: it tokenizes given text itself, or reads
the validation split of a shard folder prepared with the same tokenizer, or (no ``--data``) that of
the folder it trained on. Bits per byte make the two comparable: nats × targets ÷ bytes ÷ ln 2, where
bytes are those the scored target tokens decode to.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from node.checkpoints.checkpoint import load
from node.data.byte_corpus import load_corpus, load_text_corpus
from node.data.bytes import validation_batches
from node.errors import UserError
from node.runtime.local_training import LocalTrainer, pick_device
from swarm.models.presets import config_from_dict

Batches = list[tuple[torch.Tensor, torch.Tensor]]


def evaluate_checkpoint(path: Path, data: Path | None, weights: str, max_batches: int, batch_size: int) -> dict[str, Any]:
    state = load(path)
    if weights not in ("theta", "phi"):
        raise ValueError(f"--weights must be theta or phi, got {weights!r}")
    if state.get("role") in ("stage", "trainer"):
        raise ValueError(f"{path} is a pipeline {state['role']}'s checkpoint (--stages > 1) and holds "
                         f"{'one stage' if state['role'] == 'stage' else 'no weights'} of the model; evaluate a whole-model one")
    for key in ("model_config", weights, "round"):
        if key not in state:
            raise ValueError(f"{path} lacks {key!r}: not a locomesh checkpoint")
    cfg = config_from_dict(state["model_config"])
    trainer = LocalTrainer(cfg=cfg, device=pick_device("auto"), lr=1e-3)
    trainer.load_weights(state[weights])
    tokenizer_json = state.get("tokenizer")
    if tokenizer_json is None:
        batches, source = _byte_batches(data, batch_size, cfg.context, max_batches)
        n_bytes = sum(y.numel() for _, y in batches)
    else:
        trained_on = (state.get("config") or {}).get("data")
        batches, source, n_bytes = _token_batches(tokenizer_json, data, trained_on, batch_size, cfg.context, max_batches)
    loss = trainer.evaluate(batches)
    targets = sum(y.numel() for _, y in batches)
    return {
        "val_loss": loss, "loss": loss, "unit": "byte" if tokenizer_json is None else "token",
        "bits_per_byte": loss * targets / n_bytes / math.log(2) if n_bytes else None,
        "tokens": targets, "bytes": n_bytes, "data": source, "round": int(state["round"]), "weights": weights,
    }


def _byte_batches(data: Path | None, batch_size: int, context: int, max_batches: int) -> tuple[Batches, str]:
    if data is None:
        split, source = load_corpus(None).val, "the embedded corpus's held-out plays"
    else:
        corpus = load_text_corpus(data)
        split, source = torch.cat([corpus.train, corpus.val]), str(data)
    return validation_batches(split, batch_size, context, max_batches=max_batches), source


def _token_batches(tokenizer_json: str, data: Path | None, trained_on: str | None, batch_size: int, context: int,
                   max_batches: int) -> tuple[Batches, str, int]:
    from tokenizers import Tokenizer

    from node.data.shard_format import is_shard_dir, open_shards
    from node.data.token_batches import token_validation_batches
    from node.data.tokenizer import tokenizer_hash

    tok = Tokenizer.from_str(tokenizer_json)
    folder = data if data is not None and is_shard_dir(data) else None
    if data is None:
        if not trained_on or not is_shard_dir(trained_on):
            raise UserError(f"this checkpoint was trained on token shards ({trained_on or 'unknown folder'}) that are not "
                            "here: pass --data with held-out text or a shard folder prepared with its tokenizer")
        folder = Path(trained_on)
    if folder is not None:
        dataset = open_shards(folder)
        if dataset.tokenizer_hash != tokenizer_hash(tokenizer_json):
            raise UserError(f"--data {folder} was prepared with tokenizer {dataset.tokenizer_hash}, the checkpoint's is "
                            f"{tokenizer_hash(tokenizer_json)}: pass text instead, or shards of the same tokenizer")
        batches = token_validation_batches(dataset, batch_size, context, max_batches=max_batches)
        source = f"the validation split of {folder}"
    else:
        assert data is not None
        corpus = load_text_corpus(data, context=1)
        eos = tok.token_to_id("<|endoftext|>")
        ids: list[int] = []
        for doc in corpus.train_docs + corpus.val_docs:
            ids.extend(tok.encode(doc, add_special_tokens=False).ids)
            if eos is not None:
                ids.append(eos)
        stream = torch.tensor(ids, dtype=torch.int64)
        if stream.numel() < context + 1:
            raise UserError(f"--data {data}: {stream.numel()} tokens, fewer than one sequence of {context + 1}")
        batches = _windows(stream, batch_size, context, max_batches)
        source = str(data)
    n_bytes = sum(len(tok.decode(row.tolist()).encode("utf-8")) for _, y in batches for row in y)
    return batches, source, n_bytes


def _windows(stream: torch.Tensor, batch_size: int, context: int, max_batches: int) -> Batches:
    """Non-overlapping windows of a token stream, evenly spaced when there are more than the batches hold."""
    n_windows = (stream.numel() - 1) // context
    starts = torch.arange(n_windows, dtype=torch.int64) * context
    if n_windows > max_batches * batch_size:
        keep = max_batches * batch_size
        starts = starts[(torch.arange(keep, dtype=torch.int64) * n_windows) // keep]
    steps = torch.arange(context, dtype=torch.int64)
    return [(stream[chunk[:, None] + steps], stream[chunk[:, None] + steps + 1]) for chunk in starts.split(batch_size)]
