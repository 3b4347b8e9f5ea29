"""One attacker among four real daemons, default settings: the open swarm's robust aggregation keeps it
from taking the model over (with the plain mean, which was the default, a 50× update among three
honest ones moves φ by 12.5 honest updates a round and the held-out loss climbs past 10)."""

import math

from tests.helpers.swarm_utils import FAST_ARGS, start_node


def test_one_scaling_attacker_of_four_is_clipped_and_the_swarm_trains(tmp_path, nodes):
    run = ["--run-id", "byzantine-live", "--eval-every", "2"]
    a = start_node(tmp_path, "a", [*FAST_ARGS, *run, "--seed", "0"])
    nodes.append(a)
    boot = [a.multiaddr()]
    for name, seed, extra in (("b", 1, []), ("c", 2, []), ("z", 3, ["--attack", "scale:50"])):
        node = start_node(tmp_path, name, [*FAST_ARGS, *run, "--seed", str(seed), *extra], boot)
        nodes.append(node)
    honest, attacker = nodes[:3], nodes[3]
    for node in honest:
        node.wait(lambda i: sum(r["contributors"] == 4 for r in i.get("rounds", [])) >= 4, 180, "four rounds of four")
    attacker_id = attacker.info()["peer_id"]
    assert all(node.stop() == 0 for node in nodes)
    assert "this node ATTACKS the swarm" in attacker.log()
    for node in honest:
        info = node.info()
        full = [r for r in info["rounds"] if r["contributors"] == 4]
        # the attacker's update was cut to about an honest one's distance in every full round
        assert full and all(r["in_sync"] for r in full)
        assert all(r["aggregation"] == "centered-clip" for r in full), full[0]
        assert all(r["clipped"].get(attacker_id[-8:], 1.0) < 0.2 for r in full), [r["clipped"] for r in full]
        losses = [r["val_loss"] for r in info["rounds"] if r.get("val_loss") is not None]
        assert losses and all(math.isfinite(v) for v in losses)
        assert info["val_loss"] < min(losses[0], 4.2), (info["val_loss"], losses)
        # b and c joined with a's state (a low first loss of their own): compare with a's untrained start
        assert info["train_loss_last"] < a.info()["train_loss_first"] - 0.5, (info["train_loss_last"], a.info()["train_loss_first"])
