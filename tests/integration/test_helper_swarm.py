"""A volunteer far slower than the others helps instead of training, live: three daemons on their defaults
(``--inner-steps auto``, ``--helper-below 0.1``), one of them forty times slower (``--slowdown 40``).

The slow one measures itself under a tenth of the others' median speed for two rounds, says so and stops
its inner steps. From then on it arrives when the others' budget ends, joins each round with 0 samples
and stays bit-identical with them: every member of a round agrees that only the two trainers
contributed, and all three hold the same φ after it.
"""

from __future__ import annotations

from tests.helpers.swarm_utils import FAST_ARGS, NodeHandle, agreed_rounds, start_node

DEFAULTS = [a for i, a in enumerate(FAST_ARGS) if "--inner-steps" not in (a, FAST_ARGS[i - 1] if i else "")]
HELPED_ROUNDS = 6


def _helped(info: dict) -> list[dict]:
    """Rounds in sync in which the two trainers contributed and this node took no step (the helper's)."""
    return [r for r in info.get("rounds", []) if r["steps"] == 0 and len(r["members"]) == 2 and r["in_sync"]]


def _full(info: dict) -> list[dict]:
    return [r for r in info.get("rounds", []) if len(r["members"]) == 2 and r["group"] == 3 and r["in_sync"]]


def _start(tmp_path) -> list[NodeHandle]:
    run = [*DEFAULTS, "--run-id", "helper"]
    first = start_node(tmp_path, "n0", [*run, "--seed", "0"])
    boot = first.multiaddr()
    return [first, start_node(tmp_path, "n1", [*run, "--seed", "1"], [boot]),
            start_node(tmp_path, "n2", [*run, "--seed", "2", "--slowdown", "40"], [boot])]


def test_a_forty_times_slower_peer_helps_and_stays_bit_identical(tmp_path, nodes):
    nodes.extend(_start(tmp_path))
    helper = nodes[2]
    helper.wait(lambda i: len(_helped(i)) >= HELPED_ROUNDS, 240, f"{HELPED_ROUNDS} rounds helped in")
    for node in nodes:
        assert node.stop() == 0, node.log()[-2000:]
    infos = [node.info() for node in nodes]
    helper_info = infos[2]
    helper_id = helper_info["peer_id"][-8:]
    assert helper_info["role"] == "helper", helper_info.get("role")
    switched = [e for e in helper_info["events"] if e["event"] == "helping"]
    assert len(switched) == 1 and switched[0]["tokens_per_s"] < 0.1 * switched[0]["median_tokens_per_s"], switched
    assert "without training" in helper.log()
    # while the joiners' records spread, members can close a round with different views and a later round's vote
    # settles it (joining, tested elsewhere): from the first round all three averaged in, they agree every round
    first = min(set.intersection({r["round"] for r in _helped(helper_info)}, *({r["round"] for r in _full(i)} for i in infos[:2])))
    for number, records in agreed_rounds(infos, first).items():
        assert all(helper_id not in r["members"] for r in records), f"round {number}: the helper contributed: {records}"
    assert sum(1 for r in _helped(helper_info) if r["round"] >= first) >= HELPED_ROUNDS - 2
    for info in infos:
        late = [r for r in info["rounds"] if not r["in_sync"] and r["round"] > first]
        assert not late, f"{info['peer_id'][-8:]} fell out of sync once all three averaged: {late}"
    assert all(r["steps"] == 0 for r in helper_info["rounds"] if r["round"] >= first)
    assert all(r["steps"] > 0 for info in infos[:2] for r in info["rounds"] if r["round"] >= first and r["in_sync"])
