"""Real daemons on loopback: a 3-node DiLoCo swarm whose third node joins mid-run (adopting the state the
swarm agreed on and its round) trains, stays in sync, serves status and metrics, and stops cleanly on
SIGTERM with nothing left behind."""

import json
import time
from urllib.request import urlopen

import pytest

from tests.helpers.swarm_utils import FAST_ARGS, alive, descendants, start_node
from tests.helpers import zygote


def _rounds_by_number(info):
    return {r["round"]: r for r in info["rounds"]}


def _joined_the_agreed_state(a, b, c) -> None:
    """c, started after a and b trained together, downloaded the weights the swarm agreed on before its
    first round, and that round is the swarm's current one."""
    joined = c.info()
    event = next(e for e in joined["events"] if e["event"] == "joined")
    first = joined["rounds"][0]
    assert joined["joined_round"] >= 3
    assert first["round"] == joined["joined_round"], "the joiner's first round is the swarm's current round"
    assert event["fingerprint"] == event["peer_fingerprint"]
    assert event["reused"] == [], "a joiner from another seed, rounds late, holds nothing the swarm has"
    # (under load a and b may end round r−1 apart, one of them averaging alone, and the peer it
    # downloaded from may have resynced into round r itself rather than finished round r−1)
    r = first["round"]
    agreed = {rounds[r - 1]["fingerprint"] for rounds in map(_rounds_by_number, (a.info(), b.info())) if r - 1 in rounds}
    agreed |= {e["fingerprint"] for h in (a, b) for e in h.info()["events"]
               if e["event"] in ("joined", "resynced") and e.get("round") == r and "fingerprint" in e}
    assert event["fingerprint"] in agreed, (event, agreed)


def test_three_node_swarm_with_a_joiner_trains_in_sync_and_stops_cleanly(tmp_path, nodes):
    a = start_node(tmp_path, "a", FAST_ARGS + ["--seed", "1"])
    nodes.append(a)
    boot = a.multiaddr()
    b = start_node(tmp_path, "b", FAST_ARGS + ["--seed", "2"], [boot])
    nodes.append(b)
    a.wait(lambda i: i.get("outer_rounds", 0) >= 3, 240, "3 outer rounds")
    c = start_node(tmp_path, "c", FAST_ARGS + ["--seed", "3"], [boot])  # joins mid-run
    nodes.append(c)
    c.wait(lambda i: i.get("outer_rounds", 0) >= 2, 240, "2 outer rounds after joining")
    _joined_the_agreed_state(a, b, c)

    # after rounds that all three averaged together they hold the same weights (a member whose view of
    # the group lagged averages without it and resyncs after its next round)
    def full_rounds() -> list[int]:
        by_node = [_rounds_by_number(h.info()) for h in nodes]
        return [r for r in by_node[2] if all(r in n and n[r]["contributors"] == 3 for n in by_node)]

    deadline = time.time() + 120
    while len(full_rounds()) < 2 and time.time() < deadline:
        time.sleep(0.5)

    # status over the DHT + the status protocol, as a user would run it
    out = zygote.run(["status", "--initial-peers", boot, "--json"],
                         timeout=120)
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    peers = {p["peer_id"]: p for p in status["peers"]}
    assert {h.info()["peer_id"] for h in nodes} <= set(peers)
    for p in peers.values():
        assert p["reachable"] and p["role"] == "trainer" and p["device"] == "cpu" and p["record_age_s"] < 10
        assert "/locomesh/average/1.0" in p["protocols"]

    # real Prometheus exposition from a node
    text = urlopen(f"http://127.0.0.1:{a.metrics_port}/metrics", timeout=5).read().decode()
    for name in ("locomesh_train_loss", "locomesh_outer_rounds_total", "locomesh_bytes_sent_total", "locomesh_group_size",
                 "locomesh_round_duration_seconds_bucket", "locomesh_inner_steps_total", "locomesh_peers"):
        assert name in text, name

    family = {h.name: descendants(h.process.pid) for h in nodes}
    assert all(family.values()), "each daemon runs p2pd as a child"
    for handle in nodes:
        assert handle.stop() == 0, handle.log()[-2000:]
    time.sleep(1)
    leftovers = {name: [pid for pid in pids if alive(pid)] for name, pids in family.items()}
    assert not any(leftovers.values()), f"processes left after SIGTERM: {leftovers}"

    infos = [h.info() for h in nodes]
    for info in infos:
        assert info["state"] == "stopped"
        assert info["outer_rounds"] >= 2
        assert info["val_loss"] < infos[0]["train_loss_first"] - 1.5  # every replica is far better than the init
        assert info["bytes_sent"] > 0 and info["bytes_received"] > 0
    assert infos[0]["train_loss_last"] < infos[0]["train_loss_first"] - 1.5  # the bootstrap node started from scratch
    by_node = [_rounds_by_number(i) for i in infos]
    shared = full_rounds()
    assert len(shared) >= 2, by_node
    for r in shared:
        assert len({b[r]["fingerprint"] for b in by_node}) == 1, f"replicas differ after round {r}"

    # the checkpoint written at SIGTERM evaluates to the loss the node reported
    ckpt = infos[0]["checkpoint"]
    out = zygote.run(["eval", "--checkpoint", ckpt, "--batches", "4", "--batch-size", "8", "--json"],
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["val_loss"] == pytest.approx(infos[0]["val_loss"], abs=1e-4)


def test_sigkill_of_the_daemon_alone_leaves_no_orphans(tmp_path, nodes):
    """A crash (SIGKILL of the Python process only, not its group) must not leave p2pd running."""
    import os
    import signal

    node = start_node(tmp_path, "n", FAST_ARGS)
    nodes.append(node)
    node.multiaddr()
    family = descendants(node.process.pid)
    assert family, "the daemon runs p2pd as a child"
    os.kill(node.process.pid, signal.SIGKILL)
    node.process.wait(timeout=30)
    deadline = time.time() + 10
    while time.time() < deadline and any(alive(p) for p in family):
        time.sleep(0.2)
    assert not [p for p in family if alive(p)]
