"""Which peers answer a probe: a rendezvous waits only for members that did (``gossip.rendezvous``).

A DHT record can be signed by a key no daemon runs (keys are free), so a record proves a key, not a
running peer. :class:`Reachable` probes each new peer once (a stream this node opens to it), in the
background and at most ``MAX_PENDING`` at a time, and again after a failure only once ``retry_s`` passed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

logger = logging.getLogger(__name__)


MAX_PENDING = 64  # status probes a Reachable runs at once


class Reachable:
    """Which peers answer a probe (``probe(peer)``: a stream this node opens to them, e.g. a status
    request). A record can be signed by a key no daemon runs (an invented member: keys are free), so
    a rendezvous waits only for members that answered once; a new member is waited for while its
    first probe runs (at most ``timeout`` seconds), one that failed is probed again after ``retry_s``."""

    def __init__(self, probe: Callable[[str], Awaitable[object]], timeout: float = 5.0, retry_s: float = 30.0,
                 max_tracked: int = 4096) -> None:
        self.probe, self.timeout, self.retry_s, self.max_tracked = probe, timeout, retry_s, max_tracked
        self.answered: dict[str, None] = {}  # ordered: the oldest are forgotten first
        self.failed: dict[str, float] = {}
        self.pending: dict[str, asyncio.Task] = {}

    async def _try(self, peer: str) -> None:
        try:
            await asyncio.wait_for(self.probe(peer), self.timeout)
        except Exception as e:
            self.failed[peer] = time.monotonic()
            logger.info("not waiting for %s at rendezvous for %.0fs: it did not answer a probe (%s)", peer, self.retry_s,
                        type(e).__name__)
        else:
            self.answered[peer] = None
            self.failed.pop(peer, None)
            while len(self.answered) > self.max_tracked:
                del self.answered[next(iter(self.answered))]
        finally:
            while len(self.failed) > self.max_tracked:
                del self.failed[next(iter(self.failed))]
            self.pending.pop(peer, None)

    async def check(self, peers: set[str]) -> set[str]:
        """``peers`` that answered a probe, probing (and awaiting) those not tried yet."""
        self.filter(peers)
        waiting = [self.pending[p] for p in peers if p in self.pending]
        if waiting:
            await asyncio.wait(waiting)
        return {p for p in peers if p in self.answered}

    def filter(self, peers: set[str]) -> set[str]:
        """``peers`` that answered, or whose first probe is under way (probing the ones not tried yet, and again
        those that failed ``retry_s`` ago: they stay out until they answer). At most ``MAX_PENDING`` probes run
        at once; a peer waiting for its first one counts only once it is under way (a flood of invented
        records counted in full past the cap)."""
        now = time.monotonic()
        out = set()
        for peer in peers:
            if peer in self.answered:
                out.add(peer)
                continue
            failed_at = self.failed.get(peer)
            if peer not in self.pending and len(self.pending) < MAX_PENDING and (failed_at is None or now - failed_at > self.retry_s):
                self.pending[peer] = asyncio.create_task(self._try(peer))
            if failed_at is None and peer in self.pending:
                out.add(peer)
        return out
