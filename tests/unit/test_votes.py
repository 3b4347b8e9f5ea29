"""The fingerprint vote: only established peers count, and ties are not decided by peer ids (gossip.votes)."""

from gossip.votes import Tenure, vote


def _tenure(rounds: dict[str, int], established_rounds: int = 3) -> Tenure:
    tenure = Tenure(established_rounds)
    for r in range(max(rounds.values())):
        tenure.observe([p for p, n in rounds.items() if r < n], r)
    return tenure


def test_fresh_sybils_do_not_outvote_established_peers():
    tenure = _tenure({"honest1": 5, "honest2": 5})
    fps = {"honest1": "good", "honest2": "good", **{f"sybil{i}": "evil" for i in range(10)}}
    assert vote(fps, 9, "honest1", tenure) == ("good", "honest1")
    # without tenure (the old rule) the ten ids win
    assert vote(fps, 9, "honest1")[0] == "evil"


def test_a_peer_becomes_established_after_taking_part_in_enough_rounds():
    tenure = Tenure(3)
    for r in range(2):
        tenure.observe(["p"], r)
    tenure.observe(["p"], 1)  # the same round seen twice counts once
    assert not tenure.established("p")
    tenure.observe(["p"], 2)
    assert tenure.established("p")


def test_a_node_that_knows_no_established_voter_counts_everyone():
    # its first rounds: it must still find out it drifted from the members it just met
    assert vote({"me": "mine", "a": "theirs", "b": "theirs"}, 1, "me", Tenure())[0] == "theirs"
    # one established voter suffices to shut the fresh ones out
    tenure = _tenure({"a": 3})
    assert vote({"me": "mine", "a": "mine", "s1": "evil", "s2": "evil", "s3": "evil"}, 3, "me", tenure)[0] == "mine"


def test_a_tie_does_not_depend_on_peer_ids_and_is_the_same_at_every_member():
    tenure = _tenure({"a": 5, "b": 5, "c": 5, "d": 5})
    fps = {"a": "x", "b": "x", "c": "y", "d": "y"}
    picks = {vote(fps, 7, me, tenure)[0] for me in fps}
    assert len(picks) == 1
    renamed = {"zz" + p: fp for p, fp in fps.items()}  # ground ids would not move the tie
    renamed_tenure = _tenure({p: 5 for p in renamed})
    assert vote(renamed, 7, "zza", renamed_tenure)[0] == picks.pop()
    # over rounds, ties go both ways (the round is in the hash)
    assert len({vote(fps, r, "a", tenure)[0] for r in range(32)}) == 2


def test_tenure_is_bounded():
    tenure = Tenure(max_tracked=10)
    for i in range(100):
        tenure.observe([f"p{i}"], i)
    assert len(tenure.seen) == 10 and "p99" in tenure.seen


def test_a_tie_of_established_votes_goes_to_the_state_more_members_seen_here_hold():
    """Seen live (a modified member that fetched nothing and averaged alone): b had averaged with the
    drifted z for 4 rounds and with a for 2, so only b's own vote and z's counted, a tie, and b resynced
    to z's state in half the rounds though a held b's φ. a, seen in b's rounds, now breaks the tie;
    ids never seen in a round do not."""
    tenure = _tenure({"z": 4, "a": 2})
    assert all(vote({"b": "honest", "a": "honest", "z": "drifted"}, r, "b", tenure)[0] == "honest" for r in range(32))
    sybils = {f"s{i}": "drifted" for i in range(5)}  # never seen in a round here
    picks = {vote({"b": "honest", "z": "drifted", **sybils}, r, "b", tenure)[0] for r in range(32)}
    assert picks == {"honest", "drifted"}, "fresh ids moved the tie"
    # a seen but unestablished peer never outweighs established votes
    tenure = _tenure({"z": 4, "y": 4, "a": 2})
    assert vote({"b": "honest", "a": "honest", "z": "drifted", "y": "drifted"}, 3, "b", tenure)[0] == "drifted"
