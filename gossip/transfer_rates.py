"""How fast each peer's answers actually arrived here, so a round's deadlines fit its payload.

A fixed fetch timeout either cuts a big but healthy round (a 341 MB update over a 50 Mbit/s link takes
55 s: past the default 30-s ``--averaging-timeout``, every member would average alone) or waits far too
long for a peer that stalls. Every successful fetch records the bytes that arrived and the time they
took (from the answer's first frame, so a server waiting for its own update does not count); a fetch
then gets ``SLACK_FACTOR`` × the time its payload needs at that peer's measured rate on top of the
run's timeout, and a peer never measured is assumed to send at ``FLOOR_BYTES_PER_S``. The extra time
is capped at ``MAX_SLACK_FACTOR`` × the run's timeout. A peer that stops inside a frame is still given
up on after the transport's stall timeout, however long the deadline.

Rates are this node's own observations of authenticated streams: nothing a peer claims enters them.
"""

from __future__ import annotations

FLOOR_BYTES_PER_S = 1_250_000.0  # 10 Mbit/s: what a peer never measured is assumed to manage
MIN_SAMPLE_BYTES = 1 << 20  # smaller answers measure latency, not throughput
SLACK_FACTOR = 2.0  # a fetch may take twice what its payload needs at the measured rate
MAX_SLACK_FACTOR = 4.0  # ... but never more than this many run timeouts on top of the timeout
MAX_PEERS = 4096  # rates kept; the oldest are forgotten first
SMOOTHING = 0.5  # weight of a new sample in the running rate


class TransferRates:
    """Measured bytes per second of each peer's answers."""

    def __init__(self) -> None:
        self.rates: dict[str, float] = {}

    def observe(self, peer: str, nbytes: int, seconds: float) -> None:
        """Record that ``nbytes`` of ``peer``'s answer arrived in ``seconds``."""
        if nbytes < MIN_SAMPLE_BYTES or seconds <= 0:
            return
        rate = nbytes / seconds
        old = self.rates.pop(peer, None)  # re-inserted last: the dict's order is the forgetting order
        self.rates[peer] = rate if old is None else SMOOTHING * rate + (1 - SMOOTHING) * old
        while len(self.rates) > MAX_PEERS:
            self.rates.pop(next(iter(self.rates)))

    def rate(self, peer: str) -> float:
        """``peer``'s measured rate, or the floor when it was never measured."""
        return self.rates.get(peer, FLOOR_BYTES_PER_S)

    def slack(self, peer: str, nbytes: int, timeout: float) -> float:
        """Seconds to add to a ``timeout``-second fetch of ``nbytes`` from ``peer``."""
        return min(SLACK_FACTOR * nbytes / self.rate(peer), MAX_SLACK_FACTOR * timeout)
