"""A modified member inside a live swarm of three: it trains and sends its honest update, but announces
an upload cap of 10⁻³⁰⁰ Mbit/s (which once stretched every member's deadlines by ~10³⁰² s), asks every
member for its next 16 rounds each round (which once filled every member's wait pool, so honest fetches
were refused), claims 10⁹ samples, opens 40 relayed streams to every member each round, each from a
made-up origin (which once escaped every per-client limit), and serves joiners a sign-flipped φ under the
smallest peer id of the swarm (ties between state sources once went to the lowest id).

The honest members keep completing rounds with each other, in sync, on deadlines the lie does not stretch
past ``--averaging-timeout``, and no fetch between them fails; the requests past its own cap are refused to
the attacker alone (whose own fetches then fail: it averages by itself); every relayed stream is refused;
an honest joiner downloads the honest members' state, not the attacker's, and averages in sync with them."""

from hivemind.utils.crypto import RSAPrivateKey

from protocol.peer_identity import peer_id_of, write_identity
from tests.helpers.swarm_utils import FAST_ARGS, start_node

TIMEOUT = 20  # FAST_ARGS' --averaging-timeout


def ends(info: dict) -> dict[int, tuple[int, str]]:
    """{round: (its group size, the fingerprint of φ after it)} of a node's last record of each round."""
    return {r["round"]: (r["group"], r["fingerprint"]) for r in info.get("rounds", [])}


def _identities(tmp_path, names):
    """An identity file per name, the attacker's ("z") holding the smallest peer id of them all."""
    keys = sorted((RSAPrivateKey() for _ in names), key=peer_id_of)
    order = ["z", *sorted(n for n in names if n != "z")]
    files = {}
    for name, key in zip(order, keys):
        files[name] = tmp_path / f"{name}.key"
        write_identity(files[name], key)
    return files, {name: peer_id_of(key) for name, key in zip(order, keys)}


def test_a_member_that_lies_about_its_cap_floods_relayed_streams_and_serves_a_poisoned_state_stalls_nobody(tmp_path, nodes):
    keys, ids_of = _identities(tmp_path, "abzc")
    assert ids_of["z"] == min(ids_of.values())
    run = ["--run-id", "hostile-member", "--init-seed", "0"]

    def start(name, seed, extra=(), boot=None):
        return start_node(tmp_path, name, [*FAST_ARGS, *run, "--seed", str(seed), "--identity", str(keys[name]), *extra], boot)

    a = start("a", 1)
    nodes.append(a)
    boot = [a.multiaddr()]
    nodes.append(start("b", 2, boot=boot))
    nodes.append(start("z", 3, ["--attack", "cap,future,samples,relayed,state"], boot))
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
    flood = [line for line in attacker.log().splitlines() if "relayed flood" in line]
    assert flood and "refused:schema" in flood[-1] and "served" not in flood[-1], flood[-1:]
    assert all("is not a relay of this node" in n.log() for n in honest)
    for node, other in ((honest[0], honest[1]), (honest[1], honest[0])):
        rounds = joint(node.info())[2:]  # the first deadlines were set before the attacker's entries were read
        assert all(r["deadline_s"] <= TIMEOUT for r in rounds), [(r["round"], r["deadline_s"]) for r in rounds]
        # no fetch between honest members fails in a round both began from the same φ and counted alike. The
        # attacker averages alone and catches up, so it registers late: under a full suite's load it registered
        # just as one honest member closed the group and the other counted it (groups of 2 and 3; its fetch of
        # the first one's reduced parts failed, and the next round's vote resynced one of them). Members agree
        # on the group only up to that moment: docs/robustness.md, "not defended yet".
        mine, theirs = ends(node.info()), ends(other.info())
        alike = [r for r in rounds if theirs.get(r["round"], (None,))[0] == r["group"]
                 and r["round"] - 1 in mine and mine[r["round"] - 1][1] == theirs.get(r["round"] - 1, (None, None))[1]]
        assert len(alike) >= 4, ([(r["round"], r["group"]) for r in rounds], theirs)
        assert not [r for r in alike if set(r["failures"]) & ids], [(r["round"], r["failures"]) for r in alike]
    # rounds both counted with the same members end alike (in a start-up round the attacker's contribution
    # may reach one honest member and not the other: docs/robustness.md, "not defended yet")
    by_round = [{r["round"]: (tuple(r["members"]), r["fingerprint"]) for r in joint(n.info())} for n in honest]
    shared = [r for r in set(by_round[0]) & set(by_round[1]) if by_round[0][r][0] == by_round[1][r][0]]
    assert len(shared) >= 4 and all(by_round[0][r][1] == by_round[1][r][1] for r in shared), (by_round, shared)

    # an honest joiner: the attacker holds the smallest id and serves a sign-flipped φ at the swarm's round
    joiner = start("c", 4, boot=boot)
    nodes.append(joiner)
    joined = joiner.wait(lambda i: any(e["event"] == "joined" for e in i.get("events", [])), 180, "its join")
    event = next(e for e in joined["events"] if e["event"] == "joined")
    # never the attacker's φ (when it answered at the majority's round, the joiner's log names it as dissent)
    assert event["peer"] and set(event["peer"].split(",")) <= ids and event["verified"] == "majority", (event, ids)
    # then it averages with the honest members and ends those rounds where they do (the round it arrives in
    # may split them: members agree on the group, docs/robustness.md)
    everyone = {*short, event["fingerprint"] and joined["peer_id"][-8:]}

    def together(info):
        return {r["round"]: r["fingerprint"] for r in info.get("rounds", []) if r["in_sync"] and set(r["members"]) == everyone}

    mine = together(joiner.wait(lambda i: len(together(i)) >= 2, 180, "two rounds in sync with both honest members"))
    theirs = together(honest[0].wait(lambda i: set(mine) <= set(together(i)), 120, "the same rounds"))
    assert all(theirs[r] == f for r, f in mine.items()), (mine, theirs)
