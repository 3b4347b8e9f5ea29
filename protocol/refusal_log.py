"""Log lines for refused requests, at most one a minute per client and protocol.

A node refuses a malformed or unwelcome request with an error frame and a warning. A peer that sends
thousands of such requests (40 relayed streams to every member each round, say) would otherwise write
as many lines to the node's log; the refusals are still answered and counted (``on_error``, the
``locomesh_errors_total`` metric), but the log gets the first of each client's refusals of a protocol
and then one line a minute that says how many more there were.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

INTERVAL_S = 60.0
MAX_KEYS = 4096  # (protocol, client) pairs remembered; the oldest half is forgotten past it


class RefusalLog:
    """Writes refusal warnings to ``logger``, each (protocol, client) at most once per ``interval`` seconds."""

    def __init__(self, logger: logging.Logger, interval: float = INTERVAL_S, max_keys: int = MAX_KEYS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.interval, self.max_keys, self.clock = logger, interval, max_keys, clock
        self._seen: dict[tuple[str, str], tuple[float, int]] = {}  # key -> (when last logged, refusals not logged since)

    def refused(self, protocol: str, client: str, reason: object) -> bool:
        """Log that ``client``'s ``protocol`` request was refused for ``reason``, unless a line for the same pair
        was written less than ``interval`` seconds ago (then count it for the next line). True when logged."""
        key, now = (protocol, client), self.clock()
        last, skipped = self._seen.get(key, (-float("inf"), 0))
        if now - last < self.interval:
            self._seen[key] = (last, skipped + 1)
            return False
        more = f" ({skipped} more of its {protocol} requests refused since the last line)" if skipped else ""
        self.logger.warning("refused %s request from %s: %s%s", protocol, client, reason, more)
        self._seen.pop(key, None)  # re-inserted last: the dict stays ordered by when each pair was last logged
        self._seen[key] = (now, 0)
        if len(self._seen) > self.max_keys:
            for old in list(self._seen)[: len(self._seen) // 2]:
                del self._seen[old]
        return True
