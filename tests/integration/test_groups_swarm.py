"""A real 6-node DiLoCo swarm on loopback with ``--max-group-size 3``: every round splits into two
random groups (a DHT rendezvous each), each group ends with identical weights, a member pays about
twice the payload, and nobody falls out of sync (the members' weights differ across groups by
design: grouped rounds average them instead of voting on them)."""

import pytest

from swarm.models.presets import num_params, preset
from tests.helpers.swarm_utils import FAST_ARGS, events, start_node

NODES = 6


@pytest.mark.slow
def test_six_nodes_average_in_two_groups_that_change_every_round(tmp_path, nodes):
    args = FAST_ARGS + ["--averaging-timeout", "60", "--init-seed", "0", "--max-group-size", "3"]
    a = start_node(tmp_path, "n0", args + ["--seed", "1"])
    nodes.append(a)
    boot = a.multiaddr()
    nodes.extend(start_node(tmp_path, f"n{i}", args + ["--seed", str(i + 1)], [boot]) for i in range(1, NODES))

    def grouped(info) -> list[dict]:
        return [r for r in info["rounds"] if r.get("groups") == 2 and r["contributors"] == r["group"] >= 2]

    for handle in nodes:
        handle.wait(lambda i: len(grouped(i)) >= 6, 600, "6 rounds averaged with a whole group of two or more")
    payload = 4 * num_params(preset("nano"))
    infos = [h.info() for h in nodes]
    for info in infos:
        # bytes count in the record of the round during which they went out, so a late member's fetch
        # served after a round lands in the next one: the mean over rounds is what a member pays
        sent = [r["average_bytes_sent"] for r in grouped(info)[1:]]  # the first may carry a joiner's late bytes
        assert sum(sent) / len(sent) <= 2.5 * payload, (sent, payload)
    # a group whose members all recorded the round once, each with the whole group, ends bit-identical
    # (start-up transients, e.g. a node pulled back a round, record a round twice and are left out)
    records: dict[tuple[int, str], list[dict]] = {}
    for info in infos:
        for r in grouped(info):
            records.setdefault((r["round"], r["group_tag"]), []).append(r)
    whole = {key: rs for key, rs in records.items() if all(r["group"] == len(rs) for r in rs)}
    assert len(whole) >= 4, records
    for (round_no, tag), rs in whole.items():
        assert len({r["fingerprint"] for r in rs}) == 1, f"round {round_no}: group {tag}'s replicas differ: {rs}"
    by_round: dict[int, set[str]] = {}
    for round_no, tag in records:
        by_round.setdefault(round_no, set()).add(tag)
    assert any(len(tags) == 2 for tags in by_round.values()), "rounds should have two groups"
    partners = [{r["round"]: r["group_tag"] for r in grouped(info)} for info in infos]
    common = sorted(set.intersection(*(set(p) for p in partners)))
    assert len({tuple(p[r] for p in partners) for r in common}) > 1 or len(common) < 2, "the groups never changed"
    late = [e for h in nodes for e in events(h, "out_of_sync") if e.get("round", 0) > grouped(infos[0])[0]["round"]]
    assert not late, late
