"""A quorum and a grace window (``gossip.quorum``): who closes a round early, under which grace, and what a liar can do
to it; the rendezvous that applies them (``gossip.rendezvous.gather_group``, its DHT reads replaced by a schedule)."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gossip.rendezvous as rendezvous_module
from gossip.quorum import GRACE_FLOOR_S, GatherTimes, GraceWindow, quorum_size, round_grace
from protocol.errors import SchemaError
from protocol.records import RoundEntry


@given(st.integers(1, 200), st.floats(0, 1))
def test_a_quorum_is_more_than_its_share_and_never_more_than_everyone(n, fraction):
    q = quorum_size(n, fraction)
    assert 1 <= q <= n
    assert q == n or q > fraction * n
    assert quorum_size(n, 1.0) == n


def test_a_strict_majority_by_default_and_both_of_two():
    assert [quorum_size(n, 0.5) for n in (1, 2, 3, 4, 5, 8)] == [1, 2, 2, 3, 3, 5]


@settings(max_examples=200)
@given(st.lists(st.floats(0.01, 100), min_size=1, max_size=10), st.floats(0, 1000))
def test_a_liars_proposal_can_lengthen_a_rounds_grace_never_shorten_it(honest, lie):
    base = round_grace(honest)
    assert base == max(honest)
    lied = round_grace([*honest, lie])
    assert lied is None or lied >= base  # none: no early close at all, the rule without a quorum


@pytest.mark.parametrize("proposal", [0.0, -1.0, math.nan, math.inf])
def test_one_member_without_a_grace_keeps_the_round_waiting_to_the_deadline(proposal):
    assert round_grace([2.0, proposal, 3.0]) is None
    assert round_grace([]) is None


def test_a_round_entry_carries_its_grace_and_refuses_a_bad_one():
    entry = RoundEntry(peer_id="p", samples=3, codec="none", grace_s=1.5)
    assert RoundEntry.from_value(entry.to_value()).grace_s == 1.5
    old = entry.to_value()
    del old["grace_s"]  # an entry of a build before the quorum: it proposes none
    assert RoundEntry.from_value(old).grace_s == 0.0
    for bad in (-1.0, math.nan, math.inf, "2"):
        with pytest.raises(SchemaError):
            RoundEntry.from_value({**entry.to_value(), "grace_s": bad})


def test_the_grace_is_learned_from_arrival_spreads_and_doubles_while_it_cuts_members():
    grace = GraceWindow(learn_rounds=3)
    for spread in (0.2, 0.5):
        grace.observe("complete", spread)
        assert grace.value is None and grace.proposal() == 0.0, "no grace before it has seen enough rounds"
    grace.observe("complete", 0.1)
    assert grace.value == pytest.approx(3 * 0.5)
    grace.observe("grace", None)
    grace.observe("grace", None)
    assert grace.value == pytest.approx(4 * 3 * 0.5), "each round in a row closed without a member doubles it"
    grace.observe("deadline", None)
    assert grace.value == pytest.approx(4 * 3 * 0.5), "a round at the deadline teaches nothing"
    grace.observe("complete", None)
    assert grace.value == pytest.approx(4 * 3 * 0.5), "a round of two (no quorum short of everyone) says nothing of it"
    grace.observe("complete", 0.2)
    assert grace.value == pytest.approx(3 * 0.5), "a complete round beyond a quorum ends the back-off"


def test_the_grace_is_never_under_its_floor():
    grace = GraceWindow(learn_rounds=1)
    grace.observe("complete", 0.0)
    assert grace.value == GRACE_FLOOR_S


def _schedule(monkeypatch, arrivals: dict[str, tuple[float, float]]):
    """Entries that appear at their time after the gather starts: ``{peer: (seconds, grace it proposes)}``."""
    started = time.monotonic()

    async def entries(dht, run_id, round_no, group="", timeout=3.0):
        now = time.monotonic() - started
        return {p: (RoundEntry(peer_id=p, samples=1, codec="none", grace_s=g), 0.0) for p, (at, g) in arrivals.items() if at <= now}

    async def registered(*args, **kwargs):
        return True

    monkeypatch.setattr(rendezvous_module, "read_round_entries", entries)
    monkeypatch.setattr(rendezvous_module, "register_round", registered)


def _gather(me: RoundEntry, expected: set[str], deadline: float, fraction: float = 0.5, due_in: float | None = None):
    async def view() -> set[str]:
        return expected

    async def run():
        times = GatherTimes()
        started = time.monotonic()
        group, complete = await rendezvous_module.gather_group(None, None, "run", 3, me, view, deadline, poll_interval=0.05,
                                                               quorum=lambda n: quorum_size(n, fraction), times=times,
                                                               grace_from=None if due_in is None else started + due_in)
        return sorted(e.peer_id for e in group), complete, times, time.monotonic() - started

    return asyncio.run(run())


def test_a_round_closes_its_grace_after_a_quorum_came_instead_of_at_the_deadline(monkeypatch):
    _schedule(monkeypatch, {"b": (0.0, 0.4), "c": (0.1, 0.3)})  # d never comes
    me = RoundEntry(peer_id="a", samples=1, codec="none", grace_s=0.2)
    group, complete, times, took = _gather(me, {"a", "b", "c", "d"}, deadline=5.0)
    assert group == ["a", "b", "c"] and not complete and times.closed_by == "grace"
    assert times.grace_s == 0.4, "the largest grace the registered members propose"
    assert 0.4 <= took < 2.0, took


def test_a_member_within_the_grace_makes_the_round_complete_and_its_spread_is_seen(monkeypatch):
    _schedule(monkeypatch, {"b": (0.0, 1.0), "c": (0.0, 1.0), "d": (0.3, 1.0)})
    me = RoundEntry(peer_id="a", samples=1, codec="none", grace_s=1.0)
    group, complete, times, took = _gather(me, {"a", "b", "c", "d"}, deadline=5.0)
    assert group == ["a", "b", "c", "d"] and complete and times.closed_by == "complete"
    assert times.quorum_at is not None and took < 1.0


@pytest.mark.parametrize("arrivals, why", [
    ({"b": (0.0, 0.2), "c": (0.0, 0.0)}, "a member proposes no grace"),
    ({"b": (0.0, 0.2)}, "no quorum: two of four"),
])
def test_without_a_quorum_or_with_a_member_that_proposes_none_the_round_waits_to_the_deadline(monkeypatch, arrivals, why):
    _schedule(monkeypatch, arrivals)
    me = RoundEntry(peer_id="a", samples=1, codec="none", grace_s=0.2)
    group, complete, times, took = _gather(me, {"a", "b", "c", "d"}, deadline=1.0)
    assert not complete and times.closed_by == "deadline" and took >= 1.0, why


def test_a_quorum_of_one_is_never_taken_from_a_fraction_of_one(monkeypatch):
    _schedule(monkeypatch, {"b": (0.0, 0.1), "c": (0.0, 0.1)})
    me = RoundEntry(peer_id="a", samples=1, codec="none", grace_s=0.1)
    _, complete, times, took = _gather(me, {"a", "b", "c", "d"}, deadline=0.8, fraction=1.0)
    assert not complete and times.closed_by == "deadline" and took >= 0.8


def test_a_member_that_registered_ahead_of_its_budget_counts_the_grace_from_the_budgets_end(monkeypatch):
    """A member stepping on through the rendezvous registers ahead of its budget (by 0.25–2 s, and a slow member by one
    of its steps): the members' registrations spread by those leads, which cost nobody anything."""
    _schedule(monkeypatch, {"b": (0.0, 0.3), "c": (0.0, 0.3)})
    me = RoundEntry(peer_id="a", samples=1, codec="none", grace_s=0.3)
    _, complete, times, took = _gather(me, {"a", "b", "c", "d"}, deadline=5.0, due_in=0.8)
    assert not complete and times.closed_by == "grace" and 1.1 <= took < 2.5, took
    assert times.grace_start(None) == times.quorum_at < times.grace_start(times.quorum_at + 1)
