"""A real DiLoCo swarm on loopback with ``--max-group-size``: every round splits into two groups (a DHT
rendezvous each), computed from a hash of (run, round, peer id): each member's group is the one
``gossip.groups.group_of`` names, each group ends with identical weights, the groups change from round
to round, a member pays at most about twice the payload, and nobody falls out of sync (the members'
weights differ across groups by design: grouped rounds average them instead of voting on them).
``make test`` runs 4 nodes in groups of 2; ``make test-slow`` also 6 nodes in groups of 3."""

import time

import pytest

from gossip.groups import group_of, group_tag
from swarm.models.presets import num_params, preset
from tests.helpers.swarm_utils import FAST_ARGS, events, start_node

RUN = "groups-test"


def _grouped(info) -> list[dict]:
    return [r for r in info.get("rounds", []) if r.get("groups") == 2 and r["contributors"] == r["group"] >= 2]


JUMPS = ("joined", "caught_up", "resynced", "out_of_sync")


def _whole_groups(infos, until: float = float("inf")) -> dict[tuple[int, str], list[tuple[str, dict]]]:
    """{(round, group tag): [(peer, record)]} for the groups whose members all recorded the round once,
    each with the whole group, after the swarm settled (start-up transients, e.g. a joiner pulled back a
    round, record a round twice, and a member may average a contribution published before it caught up:
    rounds up to the last state jump of any node before ``until`` are left out)."""
    settled = max((e["t"] for info in infos for e in info.get("events", []) if e["event"] in JUMPS and e["t"] < until), default=0.0)
    records: dict[tuple[int, str], list[tuple[str, dict]]] = {}
    for info in infos:
        numbers = [r["round"] for r in info.get("rounds", [])]
        # a round's record takes its fingerprint after the node's catch-up, which may have replaced the
        # group's weights (as the swarm shrinks at the stop): such a round is not the group's result
        jumped = {e.get("round") for e in info.get("events", []) if e["event"] in JUMPS}
        for r in _grouped(info):
            if r["t"] <= settled or numbers.count(r["round"]) > 1 or {r["round"], r["round"] + 1} & jumped:
                continue
            records.setdefault((r["round"], r["group_tag"]), []).append((info["peer_id"], r))
    return {key: rs for key, rs in records.items() if all(r["group"] == len(rs) for _, r in rs)}


@pytest.mark.parametrize("count, max_group, rounds", [
    # it failed 2 of 20 runs on a loaded 2-core machine, and a 2026-11-26 run took 101 s: the joiners' first
    # round (3 members, one group) waited its whole 60 s deadline for the first node, which had counted 4
    # members (two groups) and never came to their key. Fixed in DiLoCoAverager._rendezvous_view
    pytest.param(4, 2, 4, id="4-nodes-in-groups-of-2"),  # ~35 s
    pytest.param(6, 3, 6, id="6-nodes-in-groups-of-3", marks=pytest.mark.slow),
])
def test_nodes_average_in_two_groups_that_change_every_round(count, max_group, rounds, tmp_path, nodes):
    args = FAST_ARGS + ["--averaging-timeout", "60", "--init-seed", "0", "--max-group-size", str(max_group), "--run-id", RUN]
    a = start_node(tmp_path, "n0", args + ["--seed", "1"])
    nodes.append(a)
    boot = a.multiaddr()
    nodes.extend(start_node(tmp_path, f"n{i}", args + ["--seed", str(i + 1)], [boot]) for i in range(1, count))
    for handle in nodes:
        handle.wait(lambda i: len(_grouped(i)) >= rounds, 300, f"{rounds} rounds averaged with a whole group of two or more")
    # groups change: whole groups with at least 3 distinct member sets cannot all come from one split
    deadline = time.time() + 180
    while len({frozenset(p for p, _ in rs) for rs in _whole_groups([h.info() for h in nodes]).values()}) < 3:
        assert time.time() < deadline, _whole_groups([h.info() for h in nodes])
        for handle in nodes:
            assert handle.process.poll() is None, handle.log()[-3000:]
        time.sleep(0.5)
    stopping = time.time()  # from here the swarm shrinks: the last two nodes average in one group and vote
    for handle in nodes:
        assert handle.stop() == 0, handle.log()[-2000:]
    infos = [h.info() for h in nodes]
    peers = [info["peer_id"] for info in infos]
    # the loop above saw three member sets while the swarm ran; the records written at the stop can only
    # take rounds away from it (a catch-up as the swarm shrinks discards its round), so it is not redone
    whole = _whole_groups(infos, until=stopping)

    # every member averaged in the group the hash names (one the hash put there may still miss a
    # round's rendezvous, e.g. right after it caught up: the group is then smaller)
    for peer, info in zip(peers, infos):
        for r in _grouped(info):
            assert r["group_tag"] == group_tag(group_of(RUN, r["round"], peer, 2), 2), (peer, r)

    payload = 4 * num_params(preset("nano"))
    for info in infos:
        # bytes count in the record of the round during which they went out, so a late member's fetch
        # served after a round lands in the next one: the mean over rounds is what a member pays
        sent = [r["average_bytes_sent"] for r in _grouped(info)[1:]]  # the first may carry a joiner's late bytes
        assert sum(sent) / len(sent) <= 2.5 * payload, (sent, payload)
    # a group whose members all recorded the round once, each with the whole group, ends bit-identical
    for (round_no, tag), rs in whole.items():
        assert len({r["fingerprint"] for _, r in rs}) == 1, f"round {round_no}: group {tag}'s replicas differ: {rs}"
    late = [e for h in nodes for e in events(h, "out_of_sync")
            if e.get("round", 0) > _grouped(infos[0])[0]["round"] and e["t"] < stopping]
    assert not late, late
