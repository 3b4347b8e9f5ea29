"""``--active-hours``: the daily window of local time in which a node takes part in its swarm.

``22-07`` is 22:00 to 07:00 (across midnight), ``9-17`` is 09:00 to 17:00, ``8:30-12`` has minutes.
Everything here is a pure function of a naive local ``datetime``: the window holds wall-clock times,
so a day with a daylight-saving change keeps the same clock hours, and the supervisor
(``node.cli.active``) re-reads the clock while it waits instead of counting seconds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, time, timedelta

_FORM = re.compile(r"^\s*(\d{1,2})(?::(\d{2}))?\s*-\s*(\d{1,2})(?::(\d{2}))?\s*$")
_EXAMPLE = "give START-END in local hours, e.g. 22-07 (across midnight), 9-17 or 8:30-12"


@dataclass(frozen=True)
class ActiveHours:
    """A daily window [start, end) of local wall-clock time; end before start wraps midnight."""

    start: time
    end: time

    @property
    def text(self) -> str:
        """As a user writes it: ``22-07``, ``8:30-12``."""
        return f"{_clock(self.start)}-{_clock(self.end)}"

    def contains(self, now: datetime) -> bool:
        t = now.time()
        if self.start < self.end:
            return self.start <= t < self.end
        return t >= self.start or t < self.end

    def next_start(self, now: datetime) -> datetime:
        """The first moment at or after ``now`` at which the window opens."""
        at = datetime.combine(now.date(), self.start)
        return at if at >= now else datetime.combine(now.date() + timedelta(days=1), self.start)

    def end_after(self, now: datetime) -> datetime:
        """The first moment after ``now`` at which the window closes (for ``now`` inside it: its end)."""
        at = datetime.combine(now.date(), self.end)
        return at if at > now else datetime.combine(now.date() + timedelta(days=1), self.end)


def _clock(t: time) -> str:
    return f"{t.hour:02d}" if t.minute == 0 else f"{t.hour:02d}:{t.minute:02d}"


def parse_active_hours(text: str) -> ActiveHours:
    """``"22-07"`` → 22:00 to 07:00; ``ValueError`` saying the expected form otherwise."""
    m = _FORM.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a window of hours: {_EXAMPLE}")
    values = []
    for hour, minute in ((m.group(1), m.group(2)), (m.group(3), m.group(4))):
        h, mi = int(hour), int(minute or 0)
        if h == 24 and mi == 0:
            h = 0  # 24 is the midnight a window ends at
        if not (0 <= h <= 23 and 0 <= mi <= 59):
            raise ValueError(f"{text!r}: hours run from 0 to 24 and minutes from 0 to 59; {_EXAMPLE}")
        values.append(time(h, mi))
    if values[0] == values[1]:
        raise ValueError(f"{text!r} is an empty window (start equals end); leave --active-hours out to run all day")
    return ActiveHours(values[0], values[1])
