"""A relay circuit cannot hold a slot for good: it is cut when idle and after its time cap."""

import asyncio
import time

from protocol.frames import FramedStream
from protocol.relay import RelayLimits, splice
from tests.helpers.memory_transport import Sink


def _open_stream(peer: str) -> tuple[FramedStream, asyncio.StreamReader, Sink]:
    reader, sink = asyncio.StreamReader(), Sink()
    return FramedStream(reader, sink, peer=peer), reader, sink  # type: ignore[arg-type]


def test_a_silent_circuit_is_cut_at_the_idle_timeout() -> None:
    async def run() -> tuple[tuple[int, int], float]:
        client, _, _ = _open_stream("client")
        target, _, _ = _open_stream("target")
        start = time.monotonic()
        moved = await asyncio.wait_for(splice(client, target, 1 << 20, max_seconds=60, idle_seconds=0.3), 20)
        return moved, time.monotonic() - start

    moved, took = asyncio.run(run())
    assert moved == (0, 0) and took < 30  # without the idle timeout it would wait for the 60 s cap


def test_a_busy_circuit_is_cut_at_its_time_cap_and_counts_what_it_moved() -> None:
    async def run() -> tuple[int, int]:
        client, client_in, _ = _open_stream("client")
        target, _, target_out = _open_stream("target")

        async def chatter() -> None:
            while True:
                client_in.feed_data(b"x" * 100)
                await asyncio.sleep(0.01)

        feeder = asyncio.ensure_future(chatter())
        try:
            moved = await asyncio.wait_for(splice(client, target, 1 << 30, max_seconds=0.5, idle_seconds=0.2), 20)
        finally:
            feeder.cancel()
        assert len(target_out.data) == moved[0]
        return moved

    up, down = asyncio.run(run())
    assert up > 0 and down == 0


def test_the_promised_caps_are_the_defaults() -> None:
    limits = RelayLimits()
    assert (limits.seconds_per_circuit, limits.bytes_per_circuit, limits.circuits_per_peer) == (1800.0, 1 << 30, 16)
    assert limits.idle_seconds <= 300
