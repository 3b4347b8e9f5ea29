"""``--active-hours``: parsing, and the window's next start and end from a local datetime (midnight wrap, DST days)."""

from __future__ import annotations

from datetime import datetime, time, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.config import ConfigError, load_config
from node.config.active_hours import ActiveHours, parse_active_hours


def at(text: str) -> datetime:
    return datetime.fromisoformat(text)


def test_parse_forms() -> None:
    assert parse_active_hours("22-07") == ActiveHours(time(22), time(7))
    assert parse_active_hours("9-17") == ActiveHours(time(9), time(17))
    assert parse_active_hours(" 8:30 - 12 ") == ActiveHours(time(8, 30), time(12))
    assert parse_active_hours("18-24") == ActiveHours(time(18), time(0))
    assert parse_active_hours("9-17").text == "09-17"
    assert parse_active_hours("8:30-12").text == "08:30-12"


@pytest.mark.parametrize("bad", ["", "22", "22-", "-7", "25-07", "9-17:60", "9:5-17", "a-b", "9-9", "0-24", "22-07-01"])
def test_parse_refuses_with_the_form(bad: str) -> None:
    with pytest.raises(ValueError, match="22-07|start equals end"):
        parse_active_hours(bad)


def test_config_option_validates_and_normalises() -> None:
    assert load_config({"active_hours": "22-7"}, None).active_hours == "22-07"
    assert load_config({}, None).active_hours is None
    with pytest.raises(ConfigError, match="active-hours|active_hours"):
        load_config({"active_hours": "22-25"}, None)


def test_window_across_midnight() -> None:
    night = parse_active_hours("22-07")
    assert night.contains(at("2026-03-01T23:30")) and night.contains(at("2026-03-01T03:00"))
    assert night.contains(at("2026-03-01T22:00")) and not night.contains(at("2026-03-01T07:00"))
    assert not night.contains(at("2026-03-01T12:00"))
    assert night.next_start(at("2026-03-01T12:00")) == at("2026-03-01T22:00")
    assert night.next_start(at("2026-03-01T22:00")) == at("2026-03-01T22:00")
    assert night.end_after(at("2026-03-01T23:30")) == at("2026-03-02T07:00")  # tonight's window ends tomorrow
    assert night.end_after(at("2026-03-02T03:00")) == at("2026-03-02T07:00")  # last night's window ends this morning
    assert night.next_start(at("2026-12-31T23:59")) == at("2027-01-01T22:00")


def test_day_window() -> None:
    day = parse_active_hours("9-17")
    assert day.next_start(at("2026-03-01T17:00")) == at("2026-03-02T09:00")
    assert day.next_start(at("2026-03-01T08:59")) == at("2026-03-01T09:00")
    assert day.end_after(at("2026-03-01T09:00")) == at("2026-03-01T17:00")


def test_dst_days_keep_the_clock_hours() -> None:
    """Local wall-clock times: on the days clocks change (Europe 2026: 29 March, 25 October) the window
    still opens and closes at the same clock hours, not 24 h of elapsed time after the day before."""
    night = parse_active_hours("22-07")
    assert night.next_start(at("2026-03-29T08:00")) == at("2026-03-29T22:00")
    assert night.end_after(at("2026-03-28T23:00")) == at("2026-03-29T07:00")
    assert night.end_after(at("2026-10-24T23:00")) == at("2026-10-25T07:00")
    early = parse_active_hours("2:30-5")  # 02:30 does not exist on 29 March in Europe: the window opens when the clock passes it
    assert early.contains(at("2026-03-29T03:00"))


hours = st.integers(0, 23)
minutes = st.sampled_from([0, 15, 30, 59])
moments = st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1))


@settings(max_examples=300, deadline=None)
@given(hours, minutes, hours, minutes, moments)
def test_next_start_and_end_bound_the_window(h1: int, m1: int, h2: int, m2: int, now: datetime) -> None:
    if (h1, m1) == (h2, m2):
        return
    w = ActiveHours(time(h1, m1), time(h2, m2))
    start = w.next_start(now)
    assert now <= start < now + timedelta(days=1)
    assert w.contains(start) and (start == now or not w.contains(start - timedelta(microseconds=1)))
    if not w.contains(now):
        step = (start - now) / 7  # nothing of the window lies between now and its next start
        assert not any(w.contains(now + step * i) for i in range(7))
    else:
        end = w.end_after(now)
        assert now < end <= now + timedelta(days=1)
        assert not w.contains(end) and w.contains(end - timedelta(microseconds=1))
        step = (end - now) / 7  # the window holds every moment from now to its end
        assert all(w.contains(now + step * i) for i in range(7))
    assert w.contains(now) == (parse_active_hours(w.text).contains(now))
