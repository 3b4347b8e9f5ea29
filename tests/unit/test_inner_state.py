"""The inner training state a node keeps across a join and a restart: the lr schedule's position travels in
the state a joiner downloads (so it continues the swarm's schedule instead of restarting warm-up), and a
checkpoint resumes it with the inner optimizer's state (AdamW or Muon + AdamW)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from gossip.state_server import StateServer
from gossip.state_transfer import download_state
from node.config import NodeConfig
from node.replica.node import Daemon
from swarm.inner_optimizer import MuonAdamW, build_inner_optimizer, is_muon_param
from swarm.lr_schedule import SCHEDULE_STEP
from swarm.models.presets import build_model, preset
from tests.helpers.memory_transport import Network

SCHEDULED = dict(model="nano", batch_size=4, lr_schedule="cosine", warmup_steps=5, total_steps=60, device="cpu", threads=1)


def _daemon(**overrides) -> Daemon:
    d = Daemon(NodeConfig(**{**SCHEDULED, **overrides}))
    d._prepare()
    return d


def _train(d: Daemon, steps: int) -> None:
    for _ in range(steps):
        d.trainer.step(*d.batches.next())


def _join_through_state_transfer(source: Daemon, joiner: Daemon, progress: int) -> None:
    """``source`` serves its state (``progress`` steps into its round) in memory; ``joiner`` downloads and adopts it."""

    async def go():
        network = Network()
        source.state_server = StateServer(network.transport("source"), source.cfg.run_id, progress=lambda: progress)  # type: ignore[arg-type]
        await source.state_server.start()
        source._publish_snapshot()
        got = await download_state(network.transport("joiner"), "source", joiner.cfg.run_id, joiner._state_layout())  # type: ignore[arg-type]
        await asyncio.gather(*network.tasks)
        return got

    got = asyncio.run(go())
    assert got.snapshot.meta[SCHEDULE_STEP] == source.trainer.steps - source.inner_step
    joiner._adopt(got)


def test_a_joiner_continues_the_swarms_lr_schedule():
    source = _daemon(seed=1)
    _train(source, 23)  # 20 steps of earlier rounds and 3 into the current one
    source.round, source.inner_step = 2, 3  # rounds 0 and 1 of 10 steps each, then round 2
    joiner = _daemon(seed=2, inner_steps=10)
    assert joiner.trainer.current_lr() != source.trainer.current_lr()  # a fresh node would restart warm-up
    _join_through_state_transfer(source, joiner, progress=3)
    assert joiner.inner_step == 3
    assert joiner.trainer.steps == source.trainer.steps == 23
    assert joiner.trainer.current_lr() == source.trainer.current_lr() < 1e-3


def test_a_joiner_keeps_its_own_lr_schedule_when_a_source_claims_more_steps_than_its_rounds_hold():
    source = _daemon(seed=1)
    _train(source, 23)
    source.round, source.inner_step = 0, 3  # 20 steps before round 0 (a round holds 10; one round of slack)
    joiner = _daemon(seed=2, inner_steps=10)
    _join_through_state_transfer(source, joiner, progress=3)
    assert joiner.inner_step == 3 and joiner.trainer.steps == 0


def test_a_checkpoint_resumes_the_schedule_position_and_the_optimizer(tmp_path: Path):
    for kind in ("adamw", "muon"):
        folder = tmp_path / kind
        d = _daemon(checkpoint_dir=folder, inner_optimizer=kind)
        _train(d, 7)
        d._save_checkpoint()
        again = _daemon(checkpoint_dir=folder, inner_optimizer=kind)
        assert again._resume()
        assert again.trainer.steps == 7 and again.trainer.current_lr() == d.trainer.current_lr()
        _assert_same_state(again.trainer.optimizer.state_dict(), d.trainer.optimizer.state_dict())
        x, y = d.batches.next()
        assert again.trainer.step(x, y) == d.trainer.step(x, y), f"{kind}: the resumed node steps as the one that wrote it"
        assert all(torch.equal(a, b) for a, b in zip(again.trainer.parameters(), d.trainer.parameters()))


def test_a_checkpoint_of_another_inner_optimizer_is_refused(tmp_path: Path):
    from node.runtime.resume import ResumeRefused

    d = _daemon(checkpoint_dir=tmp_path, inner_optimizer="muon")
    d._save_checkpoint()
    with pytest.raises(ResumeRefused, match="--inner-optimizer muon"):
        _daemon(checkpoint_dir=tmp_path, inner_optimizer="adamw")


def _assert_same_state(a, b) -> None:
    if isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            _assert_same_state(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for u, v in zip(a, b):
            _assert_same_state(u, v)
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


def test_muon_steps_the_blocks_matrices_and_adamw_the_rest():
    model = build_model(preset("nano"))
    opt = build_inner_optimizer(model.named_parameters(), "muon", 1e-3, 0.1)
    assert isinstance(opt, MuonAdamW)
    muon = {id(p) for g in opt.muon.param_groups for p in g["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in muon}
    assert names and all(n.startswith("blocks.") and n.endswith(".weight") and "ln" not in n for n in names)
    assert "tok_emb.weight" not in names and "pos_emb.weight" not in names
    assert opt.muon.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters())), "every parameter is stepped once"
    assert all(is_muon_param(n, p) == (p.dim() == 2 and n.startswith("blocks.")) for n, p in model.named_parameters())


def test_config_refuses_what_does_not_fit():
    with pytest.raises(ValueError, match="--total-steps or --max-steps"):
        NodeConfig(model="nano", lr_schedule="cosine")
    assert NodeConfig(model="nano", lr_schedule="wsd", max_steps=500).schedule().total_steps == 500
    assert NodeConfig(model="nano", lr_schedule="wsd", max_steps=500, total_steps=800).schedule().total_steps == 800
    for wrong in ({"lr_schedule": "cosine", "total_steps": 100}, {"inner_optimizer": "muon"}):
        with pytest.raises(ValueError, match="do not apply to --algorithm zo"):
            NodeConfig(model="nano", algorithm="zo", **wrong)


def test_a_stage_worker_steps_on_the_schedule_from_its_position_and_with_muon():
    """A stage server's worker counts one schedule step per backward request, starting where the stage's
    state said (``steps``); Muon steps a stage's block matrices and its state round-trips."""
    from swarm.lr_schedule import LrSchedule
    from swarm.stage_worker import StageWorker
    from swarm.stages import Stage

    cfg, schedule = preset("nano"), LrSchedule("wsd", 5, 40, 0.1)
    worker = StageWorker(Stage(cfg, 1, 2, seed=1), torch.device("cpu"), lr=1e-3, schedule=schedule, inner_optimizer="muon", steps=35)
    before = [p.detach().clone() for p in worker.parameters()]
    x, y = torch.randn(2, 16, cfg.d_model), torch.randint(0, 256, (2, 16))
    worker.loss_step(x, y)
    assert worker.steps == 36
    assert all(g["lr"] == 1e-3 * schedule.factor(35) < 1e-3 for g in worker.optimizer.param_groups)
    assert all(not torch.equal(a, b) for a, b in zip(before, worker.parameters()) if a.dim() == 2)
    again = StageWorker(Stage(cfg, 1, 2, seed=1), torch.device("cpu"), inner_optimizer="muon")
    again.optimizer.load_state_dict(worker.optimizer.state_dict())
    _assert_same_state(again.optimizer.state_dict(), worker.optimizer.state_dict())
