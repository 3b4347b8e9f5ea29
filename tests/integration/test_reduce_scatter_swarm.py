"""A real 8-node DiLoCo swarm on loopback: its dense rounds reduce-scatter, so each member sends and
receives about twice the payload per round (not seven times, as an all-gather would), and the replicas
stay bit-identical after every round all eight averaged."""

import pytest

from swarm.models.presets import num_params, preset
from tests.helpers.swarm_utils import FAST_ARGS, full_rounds, start_node

NODES = 8


@pytest.mark.slow
def test_eight_nodes_reduce_scatter_at_about_twice_the_payload(tmp_path, nodes):
    args = FAST_ARGS + ["--averaging-timeout", "60", "--init-seed", "0"]
    a = start_node(tmp_path, "n0", args + ["--seed", "1"])
    nodes.append(a)
    boot = a.multiaddr()
    nodes.extend(start_node(tmp_path, f"n{i}", args + ["--seed", str(i + 1)], [boot]) for i in range(1, NODES))
    for handle in nodes:
        handle.wait(lambda i: len(full_rounds(i, NODES)) >= 3, 600, "3 rounds that all eight averaged")
    payload = 4 * num_params(preset("nano"))
    infos = [h.info() for h in nodes]
    for info in infos:
        rounds = full_rounds(info, NODES)[1:]  # the first full round may still carry a joiner's late bytes
        assert all(r["scheme"] == "reduce-scatter" for r in rounds), rounds
        for r in rounds:
            assert r["average_bytes_sent"] <= 2.5 * payload, (r, payload)
            assert r["average_bytes_received"] <= 2.5 * payload, (r, payload)
    by_round = [{r["round"]: r["fingerprint"] for r in full_rounds(info, NODES)} for info in infos]
    shared = set.intersection(*(set(b) for b in by_round))
    assert shared, "no round that every node recorded as full"
    for r in shared:
        assert len({b[r] for b in by_round}) == 1, f"replicas differ after round {r}"
