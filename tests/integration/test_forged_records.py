"""A forging peer against real daemons (tests/helpers/attacker.py): records "of" honest members, invented
members and a round far ahead change nothing. Rounds keep their real members, nobody waits for the
invented ones, nobody downloads from the forger, and the members' records stay their own."""

import json
import signal
import time

from node.ops.launcher import free_port
from protocol.peer_identity import peer_id_of, write_identity
from tests.helpers.swarm_utils import FAST_ARGS, attacker_report, start_attacker, start_node

ARGS = FAST_ARGS + ["--averaging-timeout", "15"]
JUMPS = ("joined", "caught_up", "resynced")


def test_forged_records_change_no_round(tmp_path, nodes):
    # a's address is known before it starts (its identity and port), so all three start at once
    boot = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{peer_id_of(write_identity(tmp_path / 'a.id'))}"
    a = start_node(tmp_path, "a", ARGS + ["--identity", str(tmp_path / "a.id")], listen=boot.split("/p2p/")[0])
    nodes.append(a)
    b = start_node(tmp_path, "b", ARGS + ["--join-timeout", "120"], [boot])
    nodes.append(b)
    attacker, report = start_attacker(tmp_path, boot)
    nodes.append(attacker)
    for h in (a, b):
        h.wait(lambda i: any(r["contributors"] == 2 for r in i.get("rounds", [])), 180, "a round of two")
    found = attacker_report(attacker, report, lambda f: f["passes"] >= 2 and f["victims"])
    started = time.time()
    for h in (a, b):  # two whole rounds while the forged records stand
        h.wait(lambda i: sum(r["t"] > started for r in i.get("rounds", [])) >= 2, 150, "2 rounds under attack")
    attacker_report(attacker, report, lambda f: f["passes"] >= found["passes"] + 3)  # and the attacker kept storing meanwhile
    attacker.process.send_signal(signal.SIGTERM)
    attacker.process.wait(timeout=30)
    ended = time.time()
    found = json.loads(report.read_text())
    ids = {a.info()["peer_id"], b.info()["peer_id"]}
    forged = set(found["invented"]) | {found["peer_id"]}
    assert set(found["victims"]) == ids, found
    for h in (a, b):
        h.process.send_signal(signal.SIGTERM)  # both at once (a second SIGTERM would force the exit)
    assert [h.process.wait(timeout=60) for h in (a, b)] == [0, 0]
    for h in (a, b):
        info = h.info()
        rounds = [r for r in info["rounds"] if started < r["t"] < ended]
        assert all(r["group"] == 2 and r["contributors"] == 2 and r["in_sync"] for r in rounds), rounds
        waited = [line for line in h.log().splitlines() if "gave up waiting for" in line and any(f in line for f in forged)]
        assert not waited, waited
        jumps = [e for e in info["events"] if e["event"] in JUMPS and e["t"] > started]
        assert not jumps, jumps
        assert max(r["round"] for r in info["rounds"]) < found["round"] + 100, "the node followed a forged round"
