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
        # well below the untrained ~5.5 and no climb (the plain mean climbs past 10): the clipped attacker still
        # adds about an honest update of noise a round, so the end may sit a little above the first evaluation
        # (after two rounds), as it did in two loaded full-suite runs (3.40 and 3.50 against 3.35)
        assert info["val_loss"] < min(losses[0] + 0.2, 4.2), (info["val_loss"], losses)
        # b and c joined with a's state (a low first loss of their own): compare with a's untrained start
        assert info["train_loss_last"] < a.info()["train_loss_first"] - 0.5, (info["train_loss_last"], a.info()["train_loss_first"])


def test_a_sign_flipping_attacker_in_a_sparseloco_swarm_is_screened_out(tmp_path, nodes):
    """SparseLoCo, defaults: an update of honest size pointing uphill passes any norm clip, and in
    ``sparse-mean`` a coordinate only the attacker carries takes its value whole. The contribution
    screen (gossip.scores, on by default in an open swarm) sees it raise the loss and drops it; with
    ``--contribution-scores off`` (the old default) nothing is dropped and this test fails."""
    run = ["--run-id", "byzantine-sparse", "--eval-every", "2", "--algorithm", "sparseloco", "--inner-steps", "by-replicas"]
    a = start_node(tmp_path, "a", [*FAST_ARGS, *run, "--seed", "0"])
    nodes.append(a)
    boot = [a.multiaddr()]
    for name, seed, extra in (("b", 1, []), ("z", 2, ["--attack", "sign"])):
        nodes.append(start_node(tmp_path, name, [*FAST_ARGS, *run, "--seed", str(seed), *extra], boot))
    honest, attacker = nodes[:2], nodes[2]

    def attacked_rounds(info):
        return [r for r in info.get("rounds", []) if r["group"] == 3 and r["in_sync"] and len(r.get("gains", {})) == 3]

    for node in honest:
        node.wait(lambda i: len(attacked_rounds(i)) >= 5, 180, "five screened rounds of three")
    attacker_id = attacker.info()["peer_id"]
    assert all(node.stop() == 0 for node in nodes)
    for node in honest:
        info = node.info()
        rounds = attacked_rounds(info)
        dropped = [r for r in rounds if r["failures"].get(attacker_id) == "harmful_update"]
        # near the untrained start an update turned uphill raises the loss little (it is close to its
        # ceiling already): live, the attacker's first attacked gain was −0.04 to −0.06 against honest
        # gains of 0.14–0.33, inside the screen's margin. From the third attacked round on it is always out.
        assert all(r in dropped for r in rounds[2:]), [(r["round"], r["gains"], r["failures"]) for r in rounds]
        honest_drops = [r for r in rounds if any(kind == "harmful_update" and p != attacker_id for p, kind in r["failures"].items())]
        assert len(honest_drops) <= 1, [(r["round"], r["gains"], r["failures"]) for r in rounds]
        assert all(r["contributors"] == 2 for r in dropped if r not in honest_drops)  # the two honest updates were averaged
        # b joined with a's state (a low first loss of its own): compare with a's untrained start
        assert info["val_loss"] < a.info()["train_loss_first"] - 1.0, (info["val_loss"], a.info()["train_loss_first"])
    # both honest replicas stepped φ alike: their last common round has one fingerprint
    last = [{r["round"]: r["fingerprint"] for r in n.info()["rounds"] if r["in_sync"]} for n in honest]
    common = sorted(set(last[0]) & set(last[1]))
    assert common and last[0][common[-1]] == last[1][common[-1]]
