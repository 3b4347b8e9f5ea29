"""The majority of the judged members' screen verdicts (``gossip.screen_votes.tally``): a decided outcome
is final whatever the missing verdicts say, and only voters' verdicts on voters count."""

from hypothesis import given, settings
from hypothesis import strategies as st

from gossip.screen_votes import tally

VOTERS = ["a", "b", "c", "d", "e"]


def test_a_strict_majority_drops_and_a_missing_verdict_counts_as_keep() -> None:
    voters = ["a", "b", "c", "z"]
    assert tally(voters, {"a": {"z"}, "b": {"z", "a"}, "c": {"z"}, "z": {"a", "b", "c"}}) == ({"z"}, set())
    # z stays silent: every outcome is already decided (z's verdict could not change one)
    assert tally(voters, {"a": {"z"}, "b": {"z", "a"}, "c": {"z"}}) == ({"z"}, set())
    # split honest verdicts and a silent voter: z's outcome hangs on the missing verdict
    assert tally(["a", "b", "z"], {"a": {"z"}, "b": set()}) == (set(), {"z"})


def test_only_voters_verdicts_on_voters_count() -> None:
    voters = ["a", "b", "c"]
    stranger = {f"x{i}": {"a"} for i in range(10)}  # ten outsiders drop a: nothing
    assert tally(voters, {"a": set(), "b": {"outsider", "c"}, "c": set(), **stranger}) == (set(), set())


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5), st.data())
def test_a_decided_outcome_holds_whatever_the_missing_verdicts_say(count, data) -> None:
    voters = VOTERS[:count]
    verdict = st.sets(st.sampled_from(voters))
    seen = data.draw(st.dictionaries(st.sampled_from(voters), verdict))
    dropped, undecided = tally(voters, seen)
    completed = {**{v: data.draw(verdict) for v in voters if v not in seen}, **seen}
    final, left = tally(voters, completed)
    assert not left, "with every verdict in, nothing is undecided"
    decided = set(voters) - undecided
    assert final & decided == dropped & decided, "a decided outcome changed when the missing verdicts came in"
    assert tally(list(reversed(voters)), dict(reversed(list(seen.items())))) == (dropped, undecided)
