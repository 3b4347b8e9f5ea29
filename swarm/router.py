"""Throughput-weighted stochastic wiring (SWARM): which peer of a stage gets the next microbatch.

Per stage each peer carries a virtual load. The peer with the smallest load takes the task and its
load grows by task_size / throughput, an interleaved weighted round-robin: over many tasks each peer
receives a share proportional to its throughput. No peer's load runs more than one task (at its
current estimate) ahead of the least loaded peer's, so charges made at an outdated estimate cannot
starve it. A new peer enters at the stage's current minimum (it neither floods nor starves), a peer
that fails is banned until its DHT record would expire, and peers that left the DHT are forgotten.
Ties are broken at random (seeded). A throughput is its peer's claim: it is bounded by the stage's
median and by what this router measured the peer answer at (:meth:`Router.observe`).
"""

from __future__ import annotations

import random
import time
from typing import Callable, Iterable


STALE_S = 30.0  # an announced throughput unchanged this long is treated as unmeasured
MIN_SHARE_OF_MEDIAN = 0.25  # no peer counts as slower than this fraction of its stage's median
MAX_MULTIPLE_OF_MEDIAN = 64.0  # nor faster than this multiple of the lower median: a throughput is its peer's claim
# ... nor faster than this multiple of the rate this router measured from it (tokens over each answered
# request's wall time, queueing and network included: below a server's own compute rate, hence the slack)
MAX_MULTIPLE_OF_OBSERVED = 8.0
MIN_OBSERVATIONS = 3  # answers measured before the measured rate bounds a claim


class NoPeerAvailable(Exception):
    """Every peer of a stage is banned, excluded or gone."""


class Router:
    """Chooses stage peers for microbatches.

    :param ban_s: how long a failing peer is avoided (default: a peer record's lifetime)
    """

    def __init__(self, seed: int = 0, ban_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 stale_s: float = STALE_S) -> None:
        self.rng = random.Random(seed)
        self.ban_s, self.clock, self.stale_s = ban_s, clock, stale_s
        self.loads: dict[int, dict[str, float]] = {}
        self.throughput: dict[str, float] = {}
        self.banned: dict[str, float] = {}
        self.announced: dict[str, tuple[float, float]] = {}  # peer → (announced throughput, when it last changed)
        self.observed: dict[str, tuple[float, int]] = {}  # peer → (measured tokens/s, a moving average; answers measured)

    def update(self, stage: int, peers: dict[str, float]) -> None:
        """The stage's live peers with their announced throughput.

        A peer that has not measured its throughput yet (≤ 0) counts as the stage's median peer, so it
        is neither flooded nor starved. A server measures its speed only on the work it gets, so an
        estimate that has not changed for ``stale_s`` (a replica the router stopped choosing) counts
        as at least the median again until it is re-measured; and no peer counts below a quarter of
        the median, so every replica keeps a share of the work; and none above ``MAX_MULTIPLE_OF_MEDIAN``
        times the lower median, so a peer announcing 1e30 tokens/s does not draw all the work (real
        replicas differ by 40× and more: a CPU beside a GPU)."""
        now = self.clock()
        loads = self.loads.setdefault(stage, {})
        floor = min(loads.values(), default=0.0)
        for gone in set(loads) - set(peers):
            del loads[gone]
        known = sorted(tp for tp in peers.values() if tp > 0)
        median = known[len(known) // 2] if known else 1.0
        cap = MAX_MULTIPLE_OF_MEDIAN * (known[(len(known) - 1) // 2] if known else 1.0)  # one huge claim is not the lower median
        for peer, tp in peers.items():
            if peer not in self.announced or self.announced[peer][0] != tp:
                self.announced[peer] = (tp, now)
            estimate = tp if tp > 0 else median
            if now - self.announced[peer][1] > self.stale_s:
                estimate = max(estimate, median)
            bound = cap
            rate, answers = self.observed.get(peer, (0.0, 0))
            if answers >= MIN_OBSERVATIONS:
                bound = min(bound, MAX_MULTIPLE_OF_OBSERVED * rate)
            self.throughput[peer] = min(max(estimate, MIN_SHARE_OF_MEDIAN * median), bound)
            loads.setdefault(peer, floor)
        live = {p for stage_loads in self.loads.values() for p in stage_loads}
        for gone in set(self.observed) - live:
            del self.observed[gone]

    def peers(self, stage: int) -> list[str]:
        return sorted(self.loads.get(stage, {}))

    def available(self, stage: int, exclude: Iterable[str] = ()) -> list[str]:
        now, excluded = self.clock(), set(exclude)
        return [p for p in self.loads.get(stage, {}) if p not in excluded and self.banned.get(p, 0.0) <= now]

    def choose(self, stage: int, task_size: float = 1.0, exclude: Iterable[str] = ()) -> str:
        candidates = self.available(stage, exclude)
        if not candidates:
            raise NoPeerAvailable(f"no live peer serves stage {stage} (known: {len(self.loads.get(stage, {}))}, all banned or excluded)")
        loads = self.loads[stage]
        least = min(loads[p] for p in candidates)
        for p in candidates:
            # no peer runs more than one task (at its current speed) ahead of the least loaded one:
            # charges made at an outdated estimate (a slow warm-up measurement) must not starve it for
            # thousands of tasks; with steady estimates this never binds
            loads[p] = min(loads[p], least + self._cost(p, task_size))
        peer = self.rng.choice(sorted(p for p in candidates if loads[p] == least))
        loads[peer] += self._cost(peer, task_size)
        return peer

    def _cost(self, peer: str, task_size: float) -> float:
        """The virtual load a task adds to a peer: its size over the peer's estimated throughput."""
        return task_size / self.throughput.get(peer, 1.0)

    def observe(self, peer: str, tokens: float, seconds: float) -> None:
        """A request of ``tokens`` tokens that ``peer`` answered in ``seconds`` (wall time, as seen here):
        the next :meth:`update` bounds the peer's announced throughput by a multiple of this rate."""
        if seconds <= 0 or tokens <= 0:
            return
        rate, answers = self.observed.get(peer, (0.0, 0))
        sample = tokens / seconds
        self.observed[peer] = (sample if answers == 0 else 0.7 * rate + 0.3 * sample, answers + 1)

    def refund(self, stage: int, peer: str, task_size: float = 1.0) -> None:
        """Take back the load :meth:`choose` charged for a task the peer refused unstarted (busy), so a
        loaded replica is not starved later for work it never did."""
        loads = self.loads.get(stage, {})
        if peer in loads:
            loads[peer] -= self._cost(peer, task_size)

    def ban(self, peer: str, seconds: float | None = None) -> None:
        self.banned[peer] = self.clock() + (self.ban_s if seconds is None else seconds)
