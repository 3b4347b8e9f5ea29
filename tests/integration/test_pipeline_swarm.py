"""A SWARM pipeline with real daemons on loopback: 2 stages × 2 replicas + 2 trainers.

It trains (the trainers' loss falls), replicas of a stage agree after their averaging rounds, and
when one replica is SIGKILLed the trainers reroute its microbatches to the other replica: training
goes on and no microbatch is lost (a step only counts once every stage ran it).
"""

import os
import time
import signal

from node.runtime.base import HEARTBEAT_S, RECORD_TTL_S
from tests.helpers.swarm_utils import start_node

PIPE = ["--model", "nano", "--batch-size", "8", "--threads", "1", "--warmup-steps", "10", "--eval-batches", "4",
        "--stages", "2", "--sync-every", "6", "--eval-every", "2", "--run-id", "pipe-test", "--averaging-timeout", "10"]


def _matching_rounds(a: dict, b: dict) -> list[tuple[dict, dict]]:
    rounds_b = {r["round"]: r for r in b.get("rounds", [])}
    return [(r, rounds_b[r["round"]]) for r in a.get("rounds", []) if r["round"] in rounds_b]


def test_pipeline_trains_replicas_agree_and_a_killed_replica_is_routed_around(tmp_path, nodes):
    boot = start_node(tmp_path, "s0a", [*PIPE, "--role", "stage", "--stage", "0"])
    nodes.append(boot)
    addr = boot.multiaddr()
    for name, role in (("s1a", ["--role", "stage", "--stage", "1"]), ("s0b", ["--role", "stage", "--stage", "0"]),
                       ("s1b", ["--role", "stage", "--stage", "1"]), ("t0", ["--role", "trainer", "--seed", "1"]),
                       ("t1", ["--role", "trainer", "--seed", "2"])):
        nodes.append(start_node(tmp_path, name, [*PIPE, *role], [addr]))
    s0a, s1a, s0b, s1b, t0, t1 = nodes
    servers = (s0a, s1a, s0b, s1b)
    # under load the last servers come up after the trainers' first steps: count shares from the moment
    # every replica has served (a replica that is never chosen fails this wait)
    for server in servers:
        server.wait(lambda i: i.get("microbatches_served", 0) >= 1, 240, "a first microbatch on every stage server")
    served_before = {s.name: s.info()["microbatches_served"] for s in servers}
    trained_before = {t.name: t.info()["steps"] for t in (t0, t1)}
    for trainer in (t0, t1):
        trainer.wait(lambda i, n=trained_before[trainer.name]: i.get("steps", 0) >= max(60, n + 40), 240, "60 pipeline steps")
    time.sleep(2 * HEARTBEAT_S)  # a server's --info-file is rewritten every heartbeat: let both catch up
    # every replica gets work: at least a quarter of its fair share of microbatches (optimizer steps would
    # undercount a replica that batches more requests into one step)
    for a, b in ((s0a, s0b), (s1a, s1b)):
        served = [a.info()["microbatches_served"] - served_before[a.name], b.info()["microbatches_served"] - served_before[b.name]]
        ids = {a.info()["peer_id"]: a.name, b.info()["peer_id"]: b.name}
        routes = {t.name: {ids[p]: (n, t.info()["route_throughput"].get(p)) for p, n in t.info()["routed"].items() if p in ids} for t in (t0, t1)}
        assert min(served) >= 0.25 * sum(served) / 2, (served, "microbatches routed and speed estimates:", routes,
                                                       "refused busy:", [a.info()["refused_busy"], b.info()["refused_busy"]])

    # a round both replicas averaged together leaves them equal (a replica whose fetch missed the
    # deadline averages alone, says so with contributors 1, and resyncs at its next round)
    def joint_rounds(a, b):
        return [(x, y) for x, y in _matching_rounds(a.info(), b.info())
                if x["contributors"] == y["contributors"] == 2 and x["in_sync"] and y["in_sync"]]

    for a, b in ((s0a, s0b), (s1a, s1b)):
        a.wait(lambda i, a=a, b=b: bool(joint_rounds(a, b)), 120, "a joint averaging round")
        joint = joint_rounds(a, b)
        assert all(x["fingerprint"] == y["fingerprint"] for x, y in joint), ("replicas of a stage agree after averaging", joint)

    os.killpg(s1b.process.pid, signal.SIGKILL)
    # by the time its record has expired, a trainer has either called the dead replica (and retried
    # elsewhere) or dropped it; only then count steps (a trainer's --info-file may lag by dozens of steps)
    time.sleep(RECORD_TTL_S + 2 * HEARTBEAT_S)
    before = {t.name: t.info()["steps"] for t in (t0, t1)}
    for trainer in (t0, t1):
        trainer.wait(lambda i, n=before[trainer.name]: i.get("steps", 0) >= n + 40, 180, "40 steps after the kill")
    for node in (t0, t1, s0a, s1a, s0b):  # trainers first: a pipeline without stage servers cannot step
        assert node.stop() == 0, node.log()[-2000:]
    # the trainers share the stages: one that took its first step after the other had trained for a
    # while starts from a lower loss (3.44 once in a full suite run), so compare with the swarm's first loss
    first_loss = max(t.info()["train_loss_first"] for t in (t0, t1))
    for trainer in (t0, t1):
        info = trainer.info()
        assert info["train_loss_last"] < first_loss - 1.0, info
        assert info["val_loss"] < 3.5
        kinds = [e["event"] for e in info["events"]]
        assert "step_failed" not in kinds[kinds.index("rerouted") if "rerouted" in kinds else 0:], "another replica took over"
    # routed around either way: a call that reached the dead replica was retried elsewhere, or its DHT
    # record expired before any trainer chose it again (seen once under a loaded make test)
    dead = s1b.info()["peer_id"]
    events = [e for t in (t0, t1) for e in t.info()["events"]]
    assert any(e["event"] == "rerouted" or (e["event"] == "stage_peer_gone" and e["peer"] == dead) for e in events), \
        "the dead replica's calls were retried elsewhere or it was dropped when its record expired"
    last = s1a.info()
    assert last["train_loss_last"] < last["train_loss_first"]
