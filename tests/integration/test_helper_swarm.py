"""A volunteer far slower than the others helps instead of training, live: three daemons on their defaults
(``--inner-steps auto``, ``--helper-below 0.1``), one of them forty times slower (``--slowdown 40``).

The slow one measures itself under a tenth of the others' median speed for two rounds, says so and stops
its inner steps. From then on it arrives when the others' budget ends, joins each round with 0 samples
and stays bit-identical with them: every member of a round agrees that only the two trainers
contributed, and all three hold the same φ after it.
"""

from __future__ import annotations

from tests.helpers.swarm_utils import FAST_ARGS, NodeHandle, start_node

DEFAULTS = [a for i, a in enumerate(FAST_ARGS) if "--inner-steps" not in (a, FAST_ARGS[i - 1] if i else "")]
HELPED_ROUNDS = 6


def _helped(info: dict) -> list[dict]:
    """The helper's rounds in sync with all three in the group, from the first it helped in."""
    return [r for r in info.get("rounds", []) if r["steps"] == 0 and r["group"] == 3 and r["in_sync"]]


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
    helped = {r["round"]: r for r in _helped(helper_info)}
    for info in infos[:2]:
        both = [r for r in info["rounds"] if r["round"] in helped and r["in_sync"]]
        assert len(both) >= HELPED_ROUNDS - 1, f"{info['peer_id'][-8:]} shares too few rounds with the helper: {both}"
        for r in both:
            mine = helped[r["round"]]
            assert r["fingerprint"] == mine["fingerprint"], f"round {r['round']}: φ differs from the helper's: {r} {mine}"
            assert r["members"] == mine["members"] and helper_id not in r["members"] and len(r["members"]) == 2, (r, mine)
            assert r["steps"] > 0
