"""The settings every peer and every checkpoint of one run must agree on, and how to say what differs.

A joiner is refused by a swarm whose state was trained with other settings, and a node refuses to
resume a checkpoint written with other settings: both compare :func:`run_settings` and name each
difference as the flag to change.
"""

from __future__ import annotations

from typing import Any

from node.config import NodeConfig

SETTINGS_FLAGS = {"run_id": "--run-id", "model": "--model", "algorithm": "--algorithm", "compression": "--compression",
                  "fragments": "--fragments", "stages": "--stages", "tokenizer": "--data with tokenizer",
                  "max_group_size": "--max-group-size", "inner_optimizer": "--inner-optimizer"}
SWARM_KEYS = ("model", "algorithm", "compression", "fragments", "tokenizer", "max_group_size")  # in a state download's meta (the run id is the request's)


def run_settings(cfg: NodeConfig) -> dict[str, Any]:
    """What shapes the training run: peers and checkpoints with other values cannot be mixed (the model is
    its preset's name or a digest of its architecture file; the tokenizer ``bytes`` or its hash). The inner
    optimizer is local to each peer, so the swarm leaves it out (not in ``SWARM_KEYS``), but a checkpoint holds
    its state, which only the same optimizer can resume."""
    from node.runtime.workload import identity

    return {"run_id": cfg.run_id, "algorithm": cfg.algorithm, "compression": cfg.codec, "fragments": cfg.fragments,
            "stages": cfg.stages, "max_group_size": cfg.max_group_size, "inner_optimizer": cfg.inner_optimizer, **identity(cfg)}


def settings_from_saved_config(config: dict[str, Any]) -> dict[str, Any]:
    """:func:`run_settings` of a checkpoint written before checkpoints stored them (from its config dump)."""
    algorithm = config.get("algorithm", "diloco")
    codec = config.get("compression") or ("topk:64/4096+q2" if algorithm == "sparseloco" else "none")
    return {"run_id": config.get("run_id", "locomesh-demo"), "model": config.get("model"), "algorithm": algorithm,
            "compression": codec, "fragments": config.get("fragments", 1), "stages": config.get("stages", 1)}


def differences(mine: dict[str, Any], theirs: dict[str, Any], keys: tuple[str, ...] | None = None) -> list[str]:
    """Each setting that differs, as ``--flag THEIRS (this node: MINE)``; keys missing on either side are skipped."""
    keys = keys if keys is not None else tuple(SETTINGS_FLAGS)
    return [f"{SETTINGS_FLAGS[k]} {theirs[k]} (this node: {mine[k]})"
            for k in keys if k in theirs and k in mine and theirs[k] != mine[k]]


def settings_mismatch(mine: dict[str, Any], swarm: dict[str, Any]) -> str | None:
    """What differs between this node's training settings and the swarm's (from its state's meta), or None."""
    return ", ".join(differences(mine, swarm, SWARM_KEYS)) or None
