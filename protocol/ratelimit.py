"""Upload and download caps of a node (``--max-upload-mbit``, ``--max-download-mbit``): token buckets
that pace every byte of every locomesh stream, relayed ones included.

One :class:`TokenBucket` per direction is shared by all protocols and streams of the node. It lends
tokens on credit: a caller takes ``n`` bytes' worth at once and sleeps until the bucket's level is
back to zero, so callers are served in the order they asked and a small control frame waits at most
for the chunks already granted (one per concurrent writer), never behind a whole multi-megabyte
transfer: :class:`PacedWriter` and :class:`PacedReader` move large payloads in chunks of
:attr:`TokenBucket.chunk` bytes. In any window of time the bucket lets through at most
``burst + rate × window`` bytes (chunks are never larger than the burst).

What is not paced: hivemind's p2pd daemon carries the DHT's own traffic (small, not ours to pace),
and libp2p/TCP headers add a few percent on the wire.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Callable

BURST_SECONDS = 0.25  # the bucket holds a quarter second of traffic at most
MIN_CHUNK, MAX_CHUNK = 1 << 10, 1 << 16


# A peer's announced upload cap is its own claim: it may stretch this node's waits, never without bound.
MIN_ANNOUNCED_MBIT = 1.0  # a lower announced cap counts as this (1e-300 once asked for a 10^302 s wait)
ANNOUNCED_WAIT_FACTOR = 4.0  # the waits it adds stay below this many times the wait they extend


def mbit_to_bytes_per_s(mbit: float) -> float:
    """``mbit`` megabits (10^6 bits) per second in bytes per second."""
    return mbit * 1e6 / 8


def announced_seconds(nbytes: float, mbit: float, base_wait_s: float, measured_bytes_per_s: float = 0.0) -> float:
    """Seconds a peer that announced an upload cap of ``mbit`` (0: none) takes to send ``nbytes``, as this
    node allows for it: the cap is floored at :data:`MIN_ANNOUNCED_MBIT`, counts as at least the rate this
    node measured from the peer (``measured_bytes_per_s``, 0: never measured; a peer that sent faster than
    it claims has shown its claim false), and the result is capped at :data:`ANNOUNCED_WAIT_FACTOR` ×
    ``base_wait_s`` (the timeout it is added to)."""
    if mbit <= 0:
        return 0.0
    rate = max(mbit_to_bytes_per_s(max(mbit, MIN_ANNOUNCED_MBIT)), measured_bytes_per_s)
    return min(ANNOUNCED_WAIT_FACTOR * base_wait_s, nbytes / rate)


class TokenBucket:
    """Paces bytes at ``rate`` bytes per second with bursts of at most ``burst`` bytes.

    :param rate: bytes per second (> 0)
    :param burst: the most bytes that may pass at once after a quiet spell (default a quarter second's
        worth, at least one chunk)
    :param clock: monotonic seconds (a fake one in tests)
    """

    def __init__(self, rate: float, burst: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if not rate > 0:
            raise ValueError(f"a token bucket needs a positive rate, got {rate}")
        self.rate = float(rate)
        self.chunk = int(min(MAX_CHUNK, max(MIN_CHUNK, rate / 16)))  # ~16 chunks a second: pacing stays smooth
        self.burst = float(burst if burst is not None else max(rate * BURST_SECONDS, self.chunk))
        if self.burst < self.chunk:
            self.chunk = max(1, int(self.burst))
        self.clock = clock
        self.level = self.burst  # tokens in hand; negative: bytes granted on credit, not yet paid for by time
        self.stamp = clock()
        self.granted = 0  # bytes granted so far (the cap's own counter)

    def reserve(self, n: int) -> float:
        """Grant ``n`` bytes now; returns how many seconds the caller must wait before moving them."""
        now = self.clock()
        self.level = min(self.burst, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        self.level -= n
        self.granted += n
        return 0.0 if self.level >= 0 else -self.level / self.rate

    async def take(self, n: int) -> None:
        """Wait until ``n`` bytes may move (in chunks, so other streams' frames interleave)."""
        while n > 0:
            part = min(n, self.chunk)
            n -= part
            delay = self.reserve(part)
            if delay > 0:
                await asyncio.sleep(delay)


@dataclass
class RateLimits:
    """A node's caps, one bucket per direction (None: that direction is not capped)."""

    up: TokenBucket | None = None
    down: TokenBucket | None = None

    @classmethod
    def from_mbit(cls, upload_mbit: float | None, download_mbit: float | None) -> "RateLimits":
        return cls(TokenBucket(mbit_to_bytes_per_s(upload_mbit)) if upload_mbit else None,
                   TokenBucket(mbit_to_bytes_per_s(download_mbit)) if download_mbit else None)

    @property
    def active(self) -> bool:
        return self.up is not None or self.down is not None

    def seconds_for(self, sent: float, received: float) -> float:
        """How long moving ``sent`` and ``received`` bytes takes at least under these caps (both directions
        flow at once); 0 when uncapped. Timeouts of transfers this large add it."""
        up = sent / self.up.rate if self.up is not None else 0.0
        down = received / self.down.rate if self.down is not None else 0.0
        return max(up, down)

    def pace(self, reader: Any, writer: Any) -> tuple[Any, Any]:
        """A stream's reader and writer, paced by these caps (unchanged where a direction is uncapped)."""
        return (reader if self.down is None else PacedReader(reader, self.down),
                writer if self.up is None else PacedWriter(writer, self.up))


class PacedWriter:
    """An ``asyncio.StreamWriter`` whose bytes leave at the bucket's pace: ``write`` queues them,
    ``drain`` sends them chunk by chunk as tokens allow (every caller here writes, then drains)."""

    def __init__(self, inner: Any, bucket: TokenBucket) -> None:
        self.inner, self.bucket = inner, bucket
        self.pending = bytearray()

    def write(self, data: bytes) -> None:
        self.pending += data

    async def drain(self) -> None:
        while self.pending:
            part = bytes(self.pending[: self.bucket.chunk])
            del self.pending[: len(part)]
            await self.bucket.take(len(part))
            self.inner.write(part)
            await self.inner.drain()

    def __getattr__(self, name: str) -> Any:  # close, wait_closed, get_extra_info, ...
        return getattr(self.inner, name)


class PacedReader:
    """An ``asyncio.StreamReader`` that pulls bytes no faster than the bucket allows (what is not read
    stays in p2pd's and the kernel's buffers, and flow control stops the sender)."""

    def __init__(self, inner: Any, bucket: TokenBucket) -> None:
        self.inner, self.bucket = inner, bucket

    async def readexactly(self, n: int) -> bytes:
        parts: list[bytes] = []
        left = n
        while left > 0:
            part = min(left, self.bucket.chunk)
            await self.bucket.take(part)
            try:
                parts.append(await self.inner.readexactly(part))
            except asyncio.IncompleteReadError as e:
                raise asyncio.IncompleteReadError(b"".join(parts) + e.partial, n) from None
            left -= part
        return b"".join(parts)

    async def read(self, n: int = -1) -> bytes:
        size = self.bucket.chunk if n < 0 else min(n, self.bucket.chunk)
        data = await self.inner.read(size)
        await self.bucket.take(len(data))
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
