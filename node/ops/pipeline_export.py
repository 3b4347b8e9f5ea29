"""``node export --run-id RUN --initial-peers ADDR``: a Hugging Face folder from a live pipeline run.

A pipeline holds its model in pieces, one stage per server, and writes no whole-model checkpoint. The
exporter joins the DHT as a client (as ``node status`` does), and for every stage asks one of its
servers for the stage's agreed weights φ over the state protocol (``/locomesh/state/1.0``, the download
a replica moving in makes, checked against the digests in its header). The first stage's header tells
the architecture and the stage count; each stage's parameters are renamed to the whole model's
(``swarm.stages.whole_model_names``; CheckFree+ replicas are left out) and written by
``node.checkpoints.hf_export.write_hf_folder``. The stages' head is untied from the embedding, and so is the export's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from gossip.rendezvous import list_peers
from gossip.state_transfer import download_state, state_header
from node.checkpoints.hf_export import write_hf_folder
from node.errors import UserError
from node.ops.status import StatusClient
from swarm.models.llama import LlamaConfig, hf_name, hf_names
from swarm.models.presets import config_from_dict
from swarm.stages import Stage, stage_run, whole_model_names

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class StageWeights:
    """One stage's agreed weights, as a server of it sent them."""

    index: int
    round: int
    peer: str
    meta: dict[str, Any]
    tensors: list[torch.Tensor]


def _stage_module(meta: dict[str, Any], index: int) -> Stage:
    """The stage a header's meta describes, on the meta device (names and shapes only)."""
    try:
        cfg = config_from_dict(meta["model_config"])
        with torch.device("meta"):
            return Stage(cfg, index, int(meta["stages"]), seed=0, plus=bool(meta.get("checkfree_plus", False)))
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"stage {index}'s server describes no model this version can read ({e}); is it a locomesh "
                        "pipeline server of the same version?") from None


async def fetch_stage(client: StatusClient, run_id: str, index: int, timeout: float) -> StageWeights:
    """Stage ``index``'s agreed weights from the first of its servers (newest round first) that sends them."""
    assert client.dht is not None
    sub = stage_run(run_id, index)
    records = await asyncio.wait_for(list_peers(client.dht, sub), timeout)
    servers = sorted((r for r in records.values() if r.role == "stage" and r.stage == index), key=lambda r: (-r.round, r.peer_id))
    errors = []
    for rec in servers:
        try:
            head = await state_header(client.transport, rec.peer_id, sub, timeout)
            module = _stage_module(head["meta"], index)
            shapes = [(tuple(p.shape), torch.float32) for p in module.parameters()]
            got = await asyncio.wait_for(
                download_state(client.transport, rec.peer_id, sub, {"params": shapes, "outer_momentum": shapes}), 10 * timeout)
        except UserError:
            raise
        except Exception as e:  # a server that left or failed: try the next one
            errors.append(f"{rec.peer_id[-8:]}: {type(e).__name__}: {e}")
            continue
        return StageWeights(index, got.snapshot.round, rec.peer_id, got.snapshot.meta, got.snapshot.tensors["params"])
    why = "; ".join(errors) if errors else "no server of it is in the DHT"
    raise UserError(f"stage {index} of run {run_id!r} could not be downloaded ({why}); export while every stage is served")


def assemble(stages: list[StageWeights]) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """The whole model's config (head untied) and its tensors by Hugging Face name, from every stage's weights."""
    meta = stages[0].meta
    cfg = config_from_dict(meta["model_config"])
    if not isinstance(cfg, LlamaConfig):
        raise UserError("the pipeline trains a byte-level GPT, which has no Hugging Face Llama equivalent; only "
                        "--model llama-* runs can be exported")
    named: dict[str, torch.Tensor] = {}
    for stage in stages:
        if stage.meta.get("model_config") != meta["model_config"] or stage.meta.get("stages") != meta["stages"]:
            raise UserError(f"stage {stage.index}'s server trains another model or stage count than stage 0's: "
                            "is another run using the same --run-id?")
        for name, t in zip(whole_model_names(_stage_module(stage.meta, stage.index)), stage.tensors):
            if name is not None:
                named[hf_name(name)] = t.detach().to(torch.float32).contiguous()
    cfg = dataclasses.replace(cfg, tie_embeddings=False)
    missing = [n for n in hf_names(cfg) if n not in named]
    if missing:
        raise UserError(f"the stages' servers sent no {', '.join(missing[:3])}: not the whole model")
    return cfg, named


def _tokenizer(run_tokenizer: str, data: Path | None) -> str | None:
    """The tokenizer.json text of a run on token shards (from ``data``, checked against the run's), None on bytes."""
    from node.data.tokenizer import tokenizer_hash

    if run_tokenizer == "bytes":
        return None
    if data is None:
        raise UserError(f"the run trains on token shards (tokenizer {run_tokenizer}): give --data the shard folder it "
                        "trains on, whose tokenizer.json goes into the export")
    file = Path(data).expanduser()
    file = file / "tokenizer.json" if file.is_dir() else file
    if not file.is_file():
        raise UserError(f"--data {data}: no tokenizer.json there; give the shard folder `node data prepare` wrote")
    if tokenizer_hash(file) != run_tokenizer:
        raise UserError(f"--data {data}: its tokenizer ({tokenizer_hash(file)}) is not the run's ({run_tokenizer}); give the "
                        "shard folder the run trains on")
    return file.read_text(encoding="utf-8")


async def _fetch_all(run_id: str, initial_peers: list[str], swarm_key: bytes | None, timeout: float) -> list[StageWeights]:
    async with StatusClient(initial_peers=initial_peers, run_id=run_id, timeout=timeout, swarm_key=swarm_key) as client:
        first = await fetch_stage(client, run_id, 0, timeout)
        count = int(first.meta.get("stages", 1))
        return [first] + [await fetch_stage(client, run_id, i, timeout) for i in range(1, count)]


def export_pipeline(*, run_id: str, initial_peers: list[str], out: Path, data: Path | None = None,
                    swarm_key: bytes | None = None, timeout: float = 30.0) -> Path:
    """Write the Hugging Face folder ``out`` from the live pipeline run ``run_id`` (every stage's agreed weights).
    Raises :class:`UserError` naming what is missing."""
    if not initial_peers:
        raise UserError("give --initial-peers: the multiaddr of any peer of the pipeline run")
    for maddr in initial_peers:
        if not maddr.startswith("/") or "/p2p/" not in maddr:
            raise UserError(f"--initial-peers {maddr!r} is not a node multiaddr like /ip4/HOST/tcp/PORT/p2p/PEER_ID; "
                            "use one a node prints (its --info-file 'multiaddrs')")
    try:
        stages = asyncio.run(_fetch_all(run_id, initial_peers, swarm_key, timeout))
    except UserError:
        raise
    except Exception as e:  # p2pd or the DHT could not start or reach the peers
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise UserError(f"could not reach the swarm through {' '.join(initial_peers)}: {reason}; check the multiaddr and "
                        "that the node runs") from None
    cfg, tensors = assemble(stages)
    tokenizer = _tokenizer(str(stages[0].meta.get("tokenizer", "bytes")), data)
    rounds = ",".join(str(s.round) for s in stages)
    write_hf_folder(out, cfg, tensors, tokenizer, {"run_id": run_id, "stage_rounds": rounds, "weights": "phi"},
                    f"run {run_id!r}")
    logger.info("exported run %s (%d stages, rounds %s) to %s", run_id, len(stages), rounds, out)
    return Path(out)
