"""What a pipeline node keeps in its checkpoint, and which checkpoint a restarted node may resume.

The file is the replicas' (``node.runtime.base``: settings, config, model config, round, written
atomically under the folder lock; ``node.runtime.resume`` refuses one of another run). A pipeline node
adds what it held:

- a **stage server**: ``role: "stage"`` and ``stage`` = the stage's index and cut (blocks, CheckFree+
  replicas, parameter names and shapes), its averaged weights φ, its served weights θ, outer momentum,
  inner optimizer, the worker's step count (learning-rate warm-up) and ``stage_steps``: the optimizer
  steps the stage's weights hold since the run began (carried by checkpoints and state downloads), by
  which a restarted server tells whether a live replica is ahead of its checkpoint;
- a **trainer**: ``role: "trainer"``, its data position (``data_order``) and steps so far.

Both record ``asked``: the role and stage the node was started for. A node asked for a stage serves
the checkpoint's stage when the checkpoint holds that stage, or when a node asked for the same thing
wrote it (the swarm moved it: rebalancing, recovery); any other checkpoint is refused before anything
starts, with what it holds and what was asked named in one line. ``--role auto`` resumes whatever
the checkpoint holds.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from node.config import NodeConfig
from node.runtime.resume import ResumeRefused
from swarm.models.presets import ModelConfig
from swarm.stages import block_range

FIX = "use --fresh (moves it aside) or another --checkpoint-dir"

logger = logging.getLogger("locomesh.pipeline")


def asked(cfg: NodeConfig) -> dict[str, Any]:
    """The role (and stage) this node was started for."""
    return {"role": cfg.role, "stage": cfg.stage if cfg.role == "stage" else None}


def describe_ask(ask: dict[str, Any]) -> str:
    if ask.get("role") == "stage":
        return "the stage the swarm needs" if ask.get("stage") is None else f"stage {ask['stage']}"
    return {"trainer": "a trainer", "spare": "a spare"}.get(str(ask.get("role")), f"role {ask.get('role')}")


def held(state: dict[str, Any]) -> dict[str, Any]:
    """What a pipeline checkpoint holds: ``{"role": "stage", "stage": i}``, ``{"role": "trainer"}``, or
    ``{"role": None}`` when it holds neither."""
    if state.get("role") == "stage" and isinstance(state.get("stage"), dict):
        return {"role": "stage", "stage": int(state["stage"]["index"])}
    if state.get("role") == "trainer":
        return {"role": "trainer", "stage": None}
    return {"role": None, "stage": None}


def describe_held(state: dict[str, Any]) -> str:
    run = (state.get("settings") or {}).get("run_id", "?")
    what = held(state)
    if what["role"] == "stage":
        return f"stage {what['stage']} of run {run}"
    if what["role"] == "trainer":
        return f"a trainer's data position in run {run}"
    return f"no pipeline stage or trainer of run {run}"


def check_role(directory: Path, state: dict[str, Any], cfg: NodeConfig) -> None:
    """Raise :class:`ResumeRefused` when this checkpoint is not this node's to resume: it holds another
    stage or role than the node was asked for (and the swarm did not move a node so asked there)."""
    what, ask = held(state), asked(cfg)
    if what["role"] is None:
        raise ResumeRefused(f"checkpoint in {directory} holds {describe_held(state)}: {FIX}")
    if ask["role"] == "auto" or state.get("asked") == ask:
        return
    if what["role"] == ask["role"] and (ask["stage"] is None or what["stage"] == ask["stage"]):
        return
    raise ResumeRefused(f"checkpoint in {directory} holds {describe_held(state)}; this node was asked for "
                        f"{describe_ask(ask)}: {FIX}")


def stage_cut(model_cfg: ModelConfig, index: int, stages: int, plus: bool) -> dict[str, Any]:
    """How the model is cut to give stage ``index``: its blocks and whether it holds CheckFree+ replicas."""
    start, end = block_range(model_cfg.n_layer, index, stages)
    return {"index": index, "stages": stages, "blocks": [start, end], "plus": plus}


def check_cut(directory: Path, state: dict[str, Any], model_cfg: ModelConfig, stages: int, plus: bool) -> None:
    """Raise :class:`ResumeRefused` when the checkpoint's stage was cut otherwise than this node would cut it."""
    saved = state.get("stage")
    if held(state)["role"] != "stage" or not isinstance(saved, dict):
        return
    mine = stage_cut(model_cfg, int(saved["index"]), stages, plus)
    theirs = {k: saved.get(k) for k in mine}
    if theirs == mine:
        return

    def show(cut: dict[str, Any]) -> str:
        blocks = cut.get("blocks") or ["?", "?"]
        return (f"stage {cut.get('index')} of {cut.get('stages')} as blocks {blocks[0]}-{blocks[1]}"
                f"{' with --checkfree-plus replicas' if cut.get('plus') else ''}")

    raise ResumeRefused(f"checkpoint in {directory} holds {show(theirs)}; this node cuts it as {show(mine)}: {FIX}")


def resumes_stage(path: Path, saved: dict[str, Any], index: int, module: torch.nn.Module) -> bool:
    """Whether a stage server's checkpoint entries ``saved`` (read from ``path``) can resume stage ``index``
    served by ``module``: the same stage, tensors of the same shapes (else it says why in the log)."""
    if int(saved["index"]) != index:
        logger.info("not resuming %s: it holds stage %s, this node now serves stage %d", path, saved["index"], index)
        return False
    if [tuple(t.shape) for t in saved["theta"]] != [tuple(p.shape) for p in module.parameters()]:
        logger.warning("checkpoint %s holds tensors of other shapes than stage %d; ignoring it", path, index)
        return False
    return True
