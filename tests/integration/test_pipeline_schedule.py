"""A pipeline with Muon inner steps on a cosine lr schedule (real daemons on loopback: 2 stages + 1 trainer):
it trains, and a replica that joins a stage late continues the stage's schedule position (the backward
steps its replicas took) instead of restarting warm-up.

Slow (~30 s): the schedule position across a join is covered in-process by tests/unit/test_inner_state.py
(a joiner downloading a real node's state over the in-memory transport), and stage joins live by
test_pipeline_swarm.py.
"""

import pytest

from tests.helpers.swarm_utils import start_node

pytestmark = pytest.mark.slow

PIPE = ["--model", "nano", "--batch-size", "8", "--threads", "1", "--warmup-steps", "10", "--eval-batches", "4",
        "--stages", "2", "--sync-every", "4", "--eval-every", "0", "--run-id", "pipe-schedule", "--averaging-timeout", "10",
        "--lr-schedule", "cosine", "--total-steps", "5000", "--inner-optimizer", "muon"]


def _joined(info: dict) -> list[dict]:
    return [e for e in info.get("events", []) if e["event"] == "stage_joined"]


def test_a_late_stage_replica_continues_the_stages_lr_schedule(tmp_path, nodes):
    s0a = start_node(tmp_path, "s0a", [*PIPE, "--role", "stage", "--stage", "0"])
    nodes.append(s0a)
    addr = s0a.multiaddr()
    nodes.append(start_node(tmp_path, "s1a", [*PIPE, "--role", "stage", "--stage", "1"], [addr]))
    nodes.append(start_node(tmp_path, "t0", [*PIPE, "--role", "trainer", "--seed", "1"], [addr]))
    s1a, t0 = nodes[1], nodes[2]
    s0a.wait(lambda i: i.get("steps", 0) >= 20, 180, "20 backward steps on stage 0")
    rounds = len(s0a.info().get("rounds", []))
    s0a.wait(lambda i: len(i.get("rounds", [])) > rounds, 60, "a stage round after those steps (it republishes the stage's state)")
    published = s0a.info()["steps"]  # at least the steps the republished state carries
    s0b = start_node(tmp_path, "s0b", [*PIPE, "--role", "stage", "--stage", "0"], [addr])
    nodes.append(s0b)
    joined = _joined(s0b.wait(lambda i: bool(_joined(i)), 120, "joining stage 0"))[0]
    assert joined["source"] == s0a.info()["peer_id"], joined
    assert 20 <= joined["schedule_step"] <= s0a.info()["steps"], (joined, published)
    for node in (t0, s0a, s1a, s0b):
        assert node.stop() == 0, node.log()[-2000:]
    last_stage = s1a.info()
    assert last_stage["train_loss_last"] < last_stage["train_loss_first"] - 1.0, "Muon inner steps train the pipeline"
