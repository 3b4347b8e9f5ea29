"""``node eval``: validation loss of a saved checkpoint on the held-out split or on given text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from node.checkpoint import load
from node.data import load_corpus, load_text_corpus, validation_batches
from swarm.model import config_from_dict
from node.trainer import LocalTrainer, pick_device


def evaluate_checkpoint(path: Path, data: Path | None, weights: str, max_batches: int, batch_size: int) -> dict[str, Any]:
    state = load(path)
    if weights not in ("theta", "phi"):
        raise ValueError(f"--weights must be theta or phi, got {weights!r}")
    for key in ("model_config", weights, "round"):
        if key not in state:
            raise ValueError(f"{path} lacks {key!r}: not a locomesh checkpoint")
    cfg = config_from_dict(state["model_config"])
    trainer = LocalTrainer(cfg, pick_device("auto"), lr=1e-3)
    trainer.load_weights(state[weights])
    if data is None:
        split, source = load_corpus(None).val, "the embedded corpus's held-out plays"
    else:
        corpus = load_text_corpus(data)
        split, source = torch.cat([corpus.train, corpus.val]), str(data)
    batches = validation_batches(split, batch_size, cfg.context, max_batches=max_batches)
    loss = trainer.evaluate(batches)
    return {"val_loss": loss, "tokens": sum(x.numel() for x, _ in batches), "data": source, "round": int(state["round"]), "weights": weights}
