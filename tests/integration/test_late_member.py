"""A member that reaches a round after its group closed follows the round and keeps its work (real daemons).

Three DiLoCo daemons, rounds of ~4 s (``--slowdown``: sleeps, little CPU). One is frozen (SIGSTOP: a laptop
that slept, a stalled machine) near the end of its inner steps until the others closed that round without it
(at their rendezvous deadline, 5 s at least, or a grace after a quorum of two came: ``gossip.quorum``). When it wakes, finishes its steps and asks
them for their contributions, they refuse it (their group closed without it): it is late
(``gossip.late_round``). It then takes the round's state from them and keeps its own update on top, so
it does not average that round alone, and all three average again. Before, it averaged that round alone
(this test then fails), drifted from their φ, and the next round's vote threw its work away with a resync.
While it is frozen the others' rounds keep to their deadline (its p2pd still takes streams, and each DHT
request to it hung 3–10 s: a round took 12–16 s against a 5 s deadline).

The freeze adapts to the machine's speed (rounds of ~4 s here took 25–40 s on a loaded CI machine, and a
fixed 10 s freeze then missed the window three times): the member is stopped a few inner steps before its
rendezvous and woken as soon as both others have closed that round without it. A freeze can still miss
(the others not closing that round within a minute, or not together: under a whole suite's load one of them was
late for it too): the test then freezes it again, three times at most.
"""

import os
import signal
import time
from urllib.request import urlopen

from tests.helpers.swarm_utils import FAST_ARGS, full_rounds, start_node

ARGS = [*FAST_ARGS, "--run-id", "late-member", "--slowdown", "20", "--eval-every", "0"]
INNER_STEPS = 15  # FAST_ARGS' --inner-steps
STEPS_LEFT = 5  # the member is frozen this many inner steps before its rendezvous (at most)
FROZEN_MAX_S = 60.0  # the longest it stays frozen waiting for the others to close its round
TRIES = 3


def test_a_member_late_for_a_round_follows_it_and_averages_the_next_round_in_sync(tmp_path, nodes):
    a = start_node(tmp_path, "a", [*ARGS, "--seed", "0"])
    nodes.append(a)
    boot = [a.multiaddr()]
    for name, seed in (("b", 1), ("late", 2)):
        nodes.append(start_node(tmp_path, name, [*ARGS, "--seed", str(seed)], boot))
    late = nodes[2]
    late.wait(lambda i: len(full_rounds(i, 3)) >= 2, 180, "two rounds of three")

    for _ in range(TRIES):
        frozen_at = freeze_before_rendezvous(late, nodes[:2])
        if frozen_at is None:  # the freeze missed the window: try again
            continue
        try:
            info = late.wait(lambda i: since(i, "late_update_kept", frozen_at), 60, "the late round followed, its update kept")
            break
        except AssertionError:
            continue
    else:
        raise AssertionError(f"the frozen member was never late for a round in {TRIES} tries:\n{late.log()[-3000:]}")

    followed = since(info, "late_for_round", frozen_at)[0]
    kept = since(info, "late_update_kept", frozen_at)[0]
    assert kept["round"] > followed["round"] and kept["samples"] >= followed["samples"] > 0, (followed, kept)
    mine = [r for r in info["rounds"] if r["round"] == followed["round"]][-1]
    # it did not average alone (it used to: contributors 1, and the next vote resynced it, its work lost)
    assert mine["contributors"] == 0 and not mine["in_sync"] and sorted(mine["late_for"]) == sorted(r[-8:] for r in others(nodes)), mine
    closed = [r for r in nodes[0].info()["rounds"] if r["round"] == followed["round"]]
    assert closed and closed[0]["contributors"] == 2 and closed[0]["t"] > frozen_at, closed  # the others went on without it
    assert closed[0]["gather_s"] < closed[0]["deadline_s"] + 3, closed  # ... on time, though a member did not answer

    # back in the swarm: a later round that all three averaged, in sync, agreeing on it (on a loaded machine it
    # may first be late again for the round it joined mid-way, keeping its work again)
    def back(i: dict) -> bool:
        return any(r["round"] > followed["round"] and r["in_sync"] and r["contributors"] == 3 for r in i["rounds"])

    first = min(r["round"] for r in late.wait(back, 120, "a round of three again")["rounds"]
                if r["round"] > followed["round"] and r["in_sync"] and r["contributors"] == 3)
    for node in nodes[:2]:
        node.wait(lambda i: any(r["round"] >= first for r in i["rounds"]), 60, f"round {first}")
    records = [r for n in nodes for r in n.info()["rounds"] if r["round"] == first and r["in_sync"]]
    assert len(records) == 3 and all(r["contributors"] == 3 for r in records), records
    assert len({tuple(r["members"]) for r in records}) == 1 and len({r["fingerprint"] for r in records}) == 1, records
    assert all(n.stop() == 0 for n in nodes)


def others(nodes) -> list[str]:
    """The peer ids of the two members that stayed awake."""
    return [n.info()["peer_id"] for n in nodes[:2]]


def inner_steps(node) -> float:
    """The inner steps ``node`` has taken, from its Prometheus endpoint."""
    text = urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics", timeout=5).read().decode()
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith("locomesh_inner_steps_total "))


def freeze_before_rendezvous(node, awake) -> float | None:
    """SIGSTOP ``node`` ``STEPS_LEFT`` inner steps before the rendezvous of its next round and SIGCONT it once every
    member of ``awake`` recorded that round (closed without it; ``FROZEN_MAX_S`` at most); returns when it was
    frozen, or None when it reached that rendezvous before it could be frozen or the others did not close it together."""
    done = len(node.info()["rounds"])
    node.wait(lambda i: len(i["rounds"]) > done, 120, "the next round's end")
    info = node.info()
    due, done = info["rounds"][-1]["round"] + 1, len(info["rounds"])
    # its steps when the round ended (info.json is written then; steps it took stepping on through the
    # rendezvous count in the next round and are in it, so at most STEPS_LEFT steps are left)
    start, give_up = info["steps"], time.time() + 120
    while inner_steps(node) < start + INNER_STEPS - STEPS_LEFT:
        if len(node.info()["rounds"]) > done or time.time() > give_up:  # a short round (after a download): next time
            return None
        time.sleep(0.05)
    os.kill(node.process.pid, signal.SIGSTOP)
    frozen_at = time.time()
    try:
        while time.time() < frozen_at + FROZEN_MAX_S:
            closed = [[r for r in n.info().get("rounds", []) if r["round"] == due and r["t"] > frozen_at] for n in awake]
            if all(closed):  # both closed it; together, without it? (one of them may have been late itself, under load)
                return frozen_at if all(r[0]["contributors"] == len(awake) for r in closed) else None
            time.sleep(0.2)
        return None
    finally:
        os.kill(node.process.pid, signal.SIGCONT)


def since(info: dict, kind: str, t: float) -> list[dict]:
    """The node's events of ``kind`` after time ``t``."""
    return [e for e in info.get("events", []) if e["event"] == kind and e["t"] > t]
