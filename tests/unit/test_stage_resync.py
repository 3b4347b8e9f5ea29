"""A stage replica a round found out of sync takes that round's state from the replica it follows, not the
state that replica offered a moment before (it applies and publishes the round just after the one behind
learns it is behind). Taking the older state left it a round behind again: the two replicas of a stage
took turns being out of sync, round after round. Real state servers over in-memory streams (``LoopNet``)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import torch

import node.pipeline.stage_state as stage_state
from gossip.outer import NesterovOuter
from gossip.state_transfer import StateSnapshot
from swarm.stages import stage_run
from tests.unit.test_state_sources import HONEST, OTHER, ROUND, SETTINGS, _stage_records, _stage_role, net  # noqa: F401


class _Worker:
    """The parts of a StageWorker a resync touches: its module, a lock'd load and a snapshot."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.stage, self.lock = module, threading.Lock()

    def parameters(self):
        return self.stage.parameters()

    def load_weights(self, tensors, keep: float = 0.0) -> None:
        with torch.no_grad():
            for p, t in zip(self.stage.parameters(), tensors):
                p.copy_(t)

    def snapshot(self, device="cpu"):
        return [p.detach().clone() for p in self.stage.parameters()]


def _resync(net, monkeypatch, publish_after_s: float | None, tries: int):
    sub = stage_run("run", 1)
    source = net.serve("a", OTHER, round_no=ROUND - 1, run_id=sub)  # the state of the round before
    later = threading.Timer(publish_after_s or 0.0, lambda: source.publish(
        StateSnapshot(round=ROUND, tensors=HONEST, fingerprint="fp", meta=dict(SETTINGS))))
    if publish_after_s is not None:
        later.start()
    role, module = _stage_role(net)
    role.cfg, role.stage, role.placement = SimpleNamespace(run_id="run"), 1, SimpleNamespace(device="cpu")
    role.outer, role.round, role.schedule_step, role.stage_steps = NesterovOuter(), ROUND - 1, 0, 0
    role.publish_state = lambda: None

    async def listed(dht, run_id):
        return _stage_records({"a": ROUND})

    monkeypatch.setattr(stage_state, "list_peers", listed)
    monkeypatch.setattr(stage_state, "RESYNC_TRIES", tries)
    role.resync(_Worker(module), SimpleNamespace(round=ROUND, sync_peer="a"))
    if publish_after_s is not None:
        later.join()
    return role, module


def test_an_out_of_sync_replica_waits_for_its_source_to_publish_the_round(net, monkeypatch) -> None:  # noqa: F811
    role, module = _resync(net, monkeypatch, publish_after_s=1.2, tries=20)
    assert all(torch.equal(p, t) for p, t in zip(module.parameters(), HONEST["params"])), "the round's state"
    assert role.round == ROUND and all(torch.equal(p, t) for p, t in zip(role.phi, HONEST["params"]))


def test_without_the_wait_it_took_the_state_of_the_round_before(net, monkeypatch) -> None:  # noqa: F811
    _, module = _resync(net, monkeypatch, publish_after_s=1.2, tries=1)
    assert all(torch.equal(p, t) for p, t in zip(module.parameters(), OTHER["params"])), "what the old code did"


def test_a_source_that_never_publishes_the_round_still_hands_over_its_state_after_the_tries(net, monkeypatch) -> None:  # noqa: F811
    monkeypatch.setattr(stage_state, "RESYNC_WAIT_S", 0.05)
    role, module = _resync(net, monkeypatch, publish_after_s=None, tries=3)
    assert all(torch.equal(p, t) for p, t in zip(module.parameters(), OTHER["params"])), "the newest it offers"
    assert role.round == ROUND
