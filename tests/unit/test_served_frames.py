"""How long a served stream waits for a request: ``idle_timeout`` for a frame to begin, then as long as
its body keeps moving at 1 Mbit/s or more on average (a slow link or this node's own download cap can
deliver a frame of any size; a peer trickling bytes to hold the stream is refused)."""

from __future__ import annotations

import asyncio

import pytest

from protocol.errors import StreamTimeout
from protocol.frames import MIN_FRAME_RATE, FramedStream, encode_frame, encode_message
from protocol.ratelimit import PacedReader, TokenBucket


def _served(reader: asyncio.StreamReader, idle: float) -> FramedStream:
    return FramedStream(reader, None, peer="client", idle_timeout=idle)  # type: ignore[arg-type]


async def _trickle(reader: asyncio.StreamReader, data: bytes, pieces: int, pause: float) -> None:
    step = -(-len(data) // pieces)
    for i in range(0, len(data), step):
        reader.feed_data(data[i:i + step])
        await asyncio.sleep(pause)


def test_a_request_longer_than_the_idle_timeout_is_read_while_it_keeps_moving() -> None:
    frame = encode_frame(encode_message("part", {"payload": bytes(400_000)}))  # 400 kB over ~2 s: 1.6 Mbit/s, 2× the idle timeout

    async def run() -> str:
        reader = asyncio.StreamReader()
        feeder = asyncio.ensure_future(_trickle(reader, frame, 40, 0.05))
        msg = await asyncio.wait_for(_served(reader, idle=1.0).recv(), 10)
        await feeder
        return msg.kind

    assert asyncio.run(run()) == "part"


def test_a_request_trickled_below_the_floor_rate_is_refused() -> None:
    frame = encode_frame(encode_message("part", {"payload": bytes(100_000)}))  # 1 kB per 0.05 s: 0.16 Mbit/s, never idle 1 s

    async def run() -> None:
        reader = asyncio.StreamReader()
        feeder = asyncio.ensure_future(_trickle(reader, frame, 100, 0.05))
        try:
            with pytest.raises(StreamTimeout, match="slower than 1 Mbit/s"):
                await asyncio.wait_for(_served(reader, idle=1.0).recv(), 10)
        finally:
            feeder.cancel()

    asyncio.run(run())


def test_a_request_that_never_begins_or_stops_half_way_is_refused_after_the_idle_timeout() -> None:
    async def run() -> None:
        with pytest.raises(StreamTimeout, match="began within"):
            await asyncio.wait_for(_served(asyncio.StreamReader(), idle=0.2).recv(), 10)
        reader = asyncio.StreamReader()
        reader.feed_data(encode_frame(encode_message("part", {"payload": bytes(1000)}))[:500])
        with pytest.raises(StreamTimeout, match="stopped after"):
            await asyncio.wait_for(_served(reader, idle=0.2).recv(), 10)

    asyncio.run(run())


def test_a_node_with_a_download_cap_below_the_floor_allows_twice_its_own_pace() -> None:
    """A node capped at 0.4 Mbit/s reads a 120 kB request in ~2.4 s: past the idle timeout and past the
    1 Mbit/s floor's 1 + 0.96 s, within half its own rate's 1 + 4.8 s."""
    frame = encode_frame(encode_message("part", {"payload": bytes(120_000)}))
    rate = 50_000.0  # bytes/s: 0.4 Mbit/s
    assert rate < MIN_FRAME_RATE

    async def run() -> str:
        inner = asyncio.StreamReader()
        inner.feed_data(frame)
        paced = PacedReader(inner, TokenBucket(rate, burst=1024))
        stream = FramedStream(paced, None, peer="client", idle_timeout=1.0)  # type: ignore[arg-type]
        return (await asyncio.wait_for(stream.recv(), 10)).kind

    assert asyncio.run(run()) == "part"
