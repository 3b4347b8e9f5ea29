"""A modified member inside a live swarm of three: it trains and sends its honest update, but announces
an upload cap of 10⁻³⁰⁰ Mbit/s (which once stretched every member's deadlines by ~10³⁰² s), asks every
member for its next 16 rounds each round (which once filled every member's wait pool, so honest fetches
were refused) and claims 10⁹ samples. The honest members keep completing rounds with each other, in
sync, on deadlines the lie does not stretch past ``--averaging-timeout``, and no fetch between them
fails; the requests past its own cap are refused to the attacker alone (whose own fetches then fail:
it averages by itself)."""

from tests.helpers.swarm_utils import FAST_ARGS, start_node

TIMEOUT = 20  # FAST_ARGS' --averaging-timeout


def test_a_member_that_lies_about_its_cap_and_asks_for_future_rounds_stalls_nobody(tmp_path, nodes):
    run = ["--run-id", "hostile-member", "--init-seed", "0"]
    a = start_node(tmp_path, "a", [*FAST_ARGS, *run, "--seed", "1"])
    nodes.append(a)
    boot = [a.multiaddr()]
    nodes.append(start_node(tmp_path, "b", [*FAST_ARGS, *run, "--seed", "2"], boot))
    nodes.append(start_node(tmp_path, "z", [*FAST_ARGS, *run, "--seed", "3", "--attack", "cap,future,samples"], boot))
    honest, attacker = nodes[:2], nodes[2]
    for node in nodes:
        node.wait(lambda i: i.get("peer_id"), 120, "its peer id")
    ids = {n.info()["peer_id"] for n in honest}
    short = {p[-8:] for p in ids}

    def joint(info):  # rounds that both honest members averaged, in sync, with the attacker in the rendezvous
        return [r for r in info.get("rounds", []) if r["in_sync"] and short <= set(r["members"]) and r["group"] == 3]

    for node in honest:
        node.wait(lambda i: len(joint(i)) >= 8, 300, "eight rounds of both honest members beside the attacker")
    assert "this node ATTACKS the swarm" in attacker.log()
    assert any("rounds not published yet" in n.log() for n in honest), "the attacker's future requests were never refused"
    for node in honest:
        rounds = joint(node.info())[2:]  # the first deadlines were set before the attacker's entries were read
        assert all(r["deadline_s"] <= TIMEOUT for r in rounds), [(r["round"], r["deadline_s"]) for r in rounds]
        assert not [r for r in rounds if set(r["failures"]) & ids], [(r["round"], r["failures"]) for r in rounds]
    # rounds both counted with the same members end alike (in a start-up round the attacker's contribution
    # may reach one honest member and not the other: docs/robustness.md, members agree on the group)
    by_round = [{r["round"]: (tuple(r["members"]), r["fingerprint"]) for r in joint(n.info())} for n in honest]
    shared = [r for r in set(by_round[0]) & set(by_round[1]) if by_round[0][r][0] == by_round[1][r][0]]
    assert len(shared) >= 4 and all(by_round[0][r][1] == by_round[1][r][1] for r in shared), (by_round, shared)
