"""Reading loss curves between their evaluations: when a run reached a target, and its loss at a point.

A run is evaluated every so often; between two evaluations its loss is taken to move linearly. So the
time (or step, or token count) at which it reached a target loss is read between the two evaluations
that bracket the target, not at the later one: with evaluations a round apart, reading at the next
evaluation would round every run's time up by up to a round, more for the slower-evaluating one.
"""

from __future__ import annotations

from typing import Sequence


def crossing(points: Sequence[tuple[float, float]], target: float) -> float | None:
    """The x at which the loss first reached ``target``, from (x, loss) evaluations in order of x:
    interpolated linearly between the last evaluation above the target and the first at or below it.
    The first evaluation's x when that one is already at or below (nothing before it was measured);
    None when no evaluation reached the target."""
    previous: tuple[float, float] | None = None
    for x, loss in points:
        if loss <= target + 1e-9:
            if previous is None or previous[1] <= loss:
                return x
            x0, l0 = previous
            return x0 + (x - x0) * (l0 - target) / (l0 - loss)
        previous = (x, loss)
    return None


def value_at(points: Sequence[tuple[float, float]], x: float) -> float | None:
    """The loss at ``x``, interpolated linearly between the evaluations on either side of it (sorted
    by x first); an evaluation exactly at ``x`` is returned as is; None outside the evaluated range."""
    ordered = sorted(points)
    for (x0, v0), (x1, v1) in zip(ordered, ordered[1:]):
        if x0 <= x <= x1:
            return v0 if x1 == x0 else v0 + (v1 - v0) * (x - x0) / (x1 - x0)
    return ordered[-1][1] if ordered and ordered[-1][0] == x else None
