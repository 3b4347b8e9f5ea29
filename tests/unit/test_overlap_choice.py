"""--auto-overlap's choice (node.replica.overlap_choice): measured blocked shares and speeds turn overlap on, keep it or
turn it off for good; the node flips between rounds as told."""

import pytest
import typer
from hypothesis import given, settings, strategies as st

from node.cli.app import parse_join_args
from node.config import ConfigError, load_config
from node.replica.overlap_choice import THRESHOLD, WINDOW, OverlapChooser, Span, combined


def feed(chooser: OverlapChooser, spans: list[tuple[float, float, int]], start=(0.0, 0.0, 0)):
    """Rounds of (wall seconds, blocked seconds, steps) after a first (start-up) round; the decisions made."""
    t, blocked, steps = start
    out = [chooser.observe(t, blocked, steps), chooser.observe(t + 30.0, blocked + 25.0, steps + 1)]  # start-up round
    t, blocked, steps = t + 30.0, blocked + 25.0, steps + 1
    for wall, waited, n in spans:
        t, blocked, steps = t + wall, blocked + waited, steps + n
        out.append(chooser.observe(t, blocked, steps))
    return [d for d in out if d is not None]


def test_cheap_rounds_keep_blocking_and_the_first_round_is_left_out():
    chooser = OverlapChooser()
    # the start-up round blocked 25 of 30 s (peers starting), the rest 2 %: no change
    assert feed(chooser, [(10.0, 0.2, 50)] * (3 * WINDOW)) == []
    assert chooser.state == "measuring" and not chooser.overlapping


def test_costly_rounds_turn_overlap_on_and_a_faster_loop_keeps_it():
    chooser = OverlapChooser()
    decisions = feed(chooser, [(10.0, 4.0, 50)] * WINDOW + [(7.0, 0.3, 50)] * WINDOW)
    assert [d.event for d in decisions] == ["overlap_on", "overlap_kept"]
    assert decisions[0].overlap and decisions[0].why["blocked_share"] == 0.4
    assert chooser.state == "on" and chooser.overlapping
    assert feed(chooser, [(10.0, 9.0, 5)] * WINDOW, start=(1e4, 1e3, 1000)) == []  # chosen: no more changes


def test_overlap_that_only_moves_the_wait_into_slower_steps_goes_off_for_good():
    chooser = OverlapChooser()
    # blocked 30 % at 5 steps/s; overlapped, blocked 2 % but still 5.1 steps/s (two shared cores)
    decisions = feed(chooser, [(10.0, 3.0, 50)] * WINDOW + [(10.0, 0.2, 51)] * WINDOW)
    assert [d.event for d in decisions] == ["overlap_on", "overlap_off"]
    off = decisions[1]
    assert not off.overlap and off.why["needed_gain"] == round(0.5 * 0.28, 4) and off.why["speed_gain"] == 0.02
    assert chooser.state == "off" and not chooser.overlapping
    assert feed(chooser, [(10.0, 5.0, 50)] * WINDOW, start=(1e4, 1e3, 1000)) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.1, 100), st.floats(0, 1), st.integers(0, 500)), min_size=0, max_size=30))
def test_at_most_two_changes_and_overlap_only_after_a_costly_window(rounds):
    chooser = OverlapChooser()
    spans = [(wall, wall * share, n) for wall, share, n in rounds]
    decisions = feed(chooser, spans)
    assert [d.event for d in decisions] in ([], ["overlap_on"], ["overlap_on", "overlap_kept"], ["overlap_on", "overlap_off"])
    if decisions:
        assert decisions[0].why["blocked_share"] >= THRESHOLD - 1e-4
        first = combined([Span(w, b, n) for w, b, n in spans[:WINDOW]])
        assert first.blocked_share >= THRESHOLD or len(spans) > WINDOW


def test_the_flag_parses():
    assert parse_join_args(["--auto-overlap"]).auto_overlap and not parse_join_args([]).auto_overlap


@pytest.mark.parametrize("extra", [{"overlap": True}, {"overlap_mode": "eager"}, {"stages": 2}, {"algorithm": "zo"}])
def test_what_contradicts_the_flag_is_refused_by_name(extra):
    with pytest.raises((ConfigError, typer.Exit, SystemExit, ValueError)) as err:
        load_config({"auto_overlap": True, **extra})
    assert "--auto-overlap" in str(err.value)
