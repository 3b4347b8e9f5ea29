"""``--algorithm zo`` with real daemons on loopback: two replicas fine-tune a checkpoint written by a
short DiLoCo run, exchange one byte per step and stay bit-identical round after round."""

import signal
import time

from tests.helpers.swarm_utils import FAST_ARGS, start_node

ZO = [*FAST_ARGS, "--algorithm", "zo", "--eval-every", "2", "--run-id", "zo-pair"]


def test_two_zo_replicas_from_a_diloco_checkpoint_stay_identical_on_one_byte_per_step(tmp_path, nodes):
    pre = start_node(tmp_path, "pre", [*FAST_ARGS, "--run-id", "zo-pre", "--max-steps", "30"])
    nodes.append(pre)
    assert pre.process.wait(timeout=180) == 0, pre.log()[-2000:]
    start_loss = pre.info()["val_loss"]
    checkpoint = str(pre.directory / "checkpoint.pt")

    a = start_node(tmp_path, "a", [*ZO, "--init-from", checkpoint, "--seed", "0"])
    nodes.append(a)
    boot = a.multiaddr()
    # b joins by the log after a few rounds of a alone, whatever b's start-up costs (bytes per step count
    # a's whole run: forked test daemons start in ~1 s, and a's per-round overhead then had fewer steps)
    a.wait(lambda i: len(i.get("rounds", [])) >= 3, 120, "three rounds alone")
    b = start_node(tmp_path, "b", [*ZO, "--init-from", checkpoint, "--seed", "1"], [boot])
    nodes.append(b)
    for node in (a, b):
        node.wait(lambda i: sum(r["contributors"] == 2 for r in i.get("rounds", [])) >= 4, 180, "four rounds of two")
    stopped = []  # seconds from SIGTERM to the node's last report (state "stopped": checkpoint written, p2pd down)
    for node in (a, b):
        sent = time.time()
        node.process.send_signal(signal.SIGTERM)
        assert node.process.wait(timeout=60) == 0, node.log()[-3000:]
        stopped.append(node.info_file.stat().st_mtime - sent)
    assert max(stopped) < 10, f"a node must stop within 10 s of SIGTERM, took {stopped}"
    infos = {"a": a.info(), "b": b.info()}
    assert all(info["state"] == "stopped" and info["checkpoint"] for info in infos.values())
    joined = next(e for e in infos["b"]["events"] if e["event"] == "joined")
    assert joined["how"] in ("log", "snapshot+log")
    # the fingerprint of the weights each round led to, by the round they start (a late member catches up
    # several), for rounds that applied both members' codes: a round in which one member's fetch failed
    # (the other was already stopping) leaves the stopping member's last weights apart, and the vote of
    # the next round (with nobody left to vote) cannot bring them back
    reached = {name: {r["round_after"]: r["fingerprint"] for r in info["rounds"] if r["contributors"] == 2}
               for name, info in infos.items()}
    common = sorted(set(reached["a"]) & set(reached["b"]))
    assert len(common) >= 4
    for name, info in infos.items():
        assert all(r["matched"] for r in info["rounds"]), [(r["round"], r["failures"]) for r in info["rounds"] if not r["matched"]]
        assert not [e for e in info["events"] if e["event"] in ("out_of_sync", "resync_failed")], info["events"]
        assert all(e["how"] == "log" for e in info["events"] if e["event"] == "resynced"), "late only, never off"
        assert info["val_loss"] < start_loss + 0.05, (name, start_loss, info["val_loss"])
        per_step = info["bytes_sent_by_kind"].get("zo", 0) / info["steps"]
        assert 0 < per_step <= 16, f"{name} sent {per_step:.1f} bytes per step"
        assert "average" not in info["bytes_sent_by_kind"], "no pseudo-gradients travel"
    for n in common:  # the same weights, bit for bit, after every round both applied
        assert reached["a"][n] == reached["b"][n], n
