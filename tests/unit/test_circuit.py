"""Relayed streams are authenticated end to end and sealed (protocol.circuit): a relay in the middle
can neither read, change, replay nor inject frames, nor speak for a peer whose key it lacks. Also: a
peer that stops inside a frame is given up on, and a timed-out network call is cancelled."""

from __future__ import annotations

import asyncio
from typing import Callable

import pytest
from hivemind.utils.crypto import RSAPrivateKey

from protocol import circuit
from protocol.errors import AuthError, StreamTimeout
from protocol.frames import FramedStream, read_frame
from protocol.peer_identity import peer_id_of
from tests.helpers.memory_transport import PipeWriter, byte_flipper

STATE = "/locomesh/state/1.0"
CLIENT_KEY, TARGET_KEY, RELAY_KEY = RSAPrivateKey(), RSAPrivateKey(), RSAPrivateKey()
CLIENT, TARGET, RELAY = peer_id_of(CLIENT_KEY), peer_id_of(TARGET_KEY), peer_id_of(RELAY_KEY)
Tamper = Callable[[bytes], bytes]


class _RelayWriter(PipeWriter):
    """A relay's copy: every byte written passes ``tamper`` on its way (and is kept in ``seen``)."""

    def __init__(self, reader: asyncio.StreamReader, tamper: Tamper) -> None:
        super().__init__(reader)
        self.tamper, self.seen = tamper, bytearray()

    def write(self, b: bytes) -> None:
        self.seen += b
        data = self.tamper(b)
        if data:
            self.reader.feed_data(data)


def _pair(up: Tamper = lambda b: b, down: Tamper = lambda b: b) -> tuple[FramedStream, FramedStream, _RelayWriter]:
    """(client end, target end, the relay's target → client leg) of a stream through a relay."""
    to_target, to_client = asyncio.StreamReader(), asyncio.StreamReader()
    down_leg = _RelayWriter(to_client, down)
    client = FramedStream(to_client, _RelayWriter(to_target, up), peer=TARGET)  # type: ignore[arg-type]
    target = FramedStream(to_target, down_leg, peer=CLIENT, idle_timeout=5)  # type: ignore[arg-type]
    return client, target, down_leg


async def _handshake(client: FramedStream, target: FramedStream, origin: str = CLIENT, expected: str = TARGET,
                     target_key: RSAPrivateKey = TARGET_KEY) -> None:
    await asyncio.wait_for(asyncio.gather(
        circuit.client_handshake(client, CLIENT_KEY, STATE, CLIENT, expected),
        circuit.target_handshake(target, target_key, STATE, origin, peer_id_of(target_key))), 10)


def test_a_sealed_circuit_carries_frames_both_ways_and_the_relay_reads_none() -> None:
    async def run() -> tuple[dict, dict, bytes]:
        client, target, down = _pair()
        await _handshake(client, target)
        await client.send("get_state", {"run_id": "secret-run"})
        asked = (await target.recv(expect="get_state")).body
        await target.send("state", {"blob": b"weights-in-clear" * 100})
        got = (await client.recv(expect="state")).body
        for _ in range(3):  # counters advance in step on both sides
            await target.send("state", {"n": 1})
            await client.recv()
        return asked, got, bytes(down.seen)

    asked, got, wire = asyncio.run(run())
    assert asked == {"run_id": "secret-run"} and got["blob"] == b"weights-in-clear" * 100
    assert b"weights-in-clear" not in wire  # sealed, not only signed


def test_a_relay_that_changes_one_byte_of_a_sealed_frame_is_caught() -> None:
    async def run() -> None:
        client, target, down = _pair(down=byte_flipper(3000))  # the handshake is under 3,000 bytes; the reply is not
        await _handshake(client, target)
        await target.send("state", {"blob": bytes(5000)})
        with pytest.raises(AuthError, match="failed its end-to-end check"):
            await client.recv()

    asyncio.run(run())


def test_a_relay_that_replays_or_drops_a_frame_is_caught() -> None:
    frames: list[bytes] = []

    def replay_first(b: bytes) -> bytes:  # writes: circuit_ok, sealed frame 1, sealed frame 2
        frames.append(b)
        return frames[1] if len(frames) == 3 else b  # frame 1 again instead of frame 2

    async def run() -> None:
        client, target, _ = _pair(down=replay_first)
        await _handshake(client, target)
        await target.send("state", {"n": 1})
        await target.send("state", {"n": 2})
        assert (await client.recv()).body == {"n": 1}
        with pytest.raises(AuthError):  # a copy of frame 1 where frame 2 belongs
            await client.recv()

    asyncio.run(run())


def test_a_relay_cannot_name_another_origin() -> None:
    async def run() -> None:
        client, target, _ = _pair()
        with pytest.raises(AuthError, match=f"holds the key of {CLIENT}, not of {RELAY}"):
            await _handshake(client, target, origin=RELAY)  # the relay said the stream comes from RELAY

    asyncio.run(run())


def test_a_relay_cannot_answer_for_the_target() -> None:
    async def run() -> None:
        client, target, _ = _pair()
        with pytest.raises(AuthError, match=f"holds the key of {RELAY}, not of {TARGET}"):
            await _handshake(client, target, target_key=RELAY_KEY)  # the relay answers itself

    asyncio.run(run())


def test_a_handshake_signed_for_another_stream_is_refused() -> None:
    """A recorded circuit_ok cannot be reused: the signature covers both fresh ephemeral keys."""

    async def run() -> None:
        first, target, down = _pair()
        await _handshake(first, target)
        recorded = bytes(down.seen)  # the target's circuit_ok (and nothing else yet)
        to_client = asyncio.StreamReader()
        to_client.feed_data(recorded)
        again = FramedStream(to_client, PipeWriter(asyncio.StreamReader()), peer=TARGET)  # type: ignore[arg-type]
        with pytest.raises(AuthError, match="did not sign"):
            await circuit.client_handshake(again, CLIENT_KEY, STATE, CLIENT, TARGET)

    asyncio.run(run())


def test_a_frame_that_stops_half_way_is_given_up_on_after_the_stall_timeout() -> None:
    async def run() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data((1000).to_bytes(4, "big") + b"x" * 10)  # a header, ten bytes, then silence
        with pytest.raises(StreamTimeout, match="stopped after 10 of 1000 bytes"):
            await asyncio.wait_for(read_frame(reader, stall_timeout=0.2), 10)

    asyncio.run(run())


def test_a_slow_frame_that_keeps_moving_is_read_whole() -> None:
    async def run() -> bytes:
        reader = asyncio.StreamReader()
        reader.feed_data((30).to_bytes(4, "big"))

        async def trickle() -> None:
            for _ in range(30):
                await asyncio.sleep(0.02)
                reader.feed_data(b"y")

        feeder = asyncio.ensure_future(trickle())
        body = await asyncio.wait_for(read_frame(reader, stall_timeout=0.2), 10)  # 0.6 s in all, never 0.2 s idle
        await feeder
        return body

    assert asyncio.run(run()) == b"y" * 30


def test_a_network_call_that_times_out_is_cancelled() -> None:
    from node.runtime.network import NetworkThread

    net = NetworkThread()
    net._thread.start()
    cancelled = asyncio.Event()

    async def hangs() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            net.loop.call_soon(cancelled.set)
            raise

    async def was_cancelled() -> bool:
        await asyncio.wait_for(cancelled.wait(), 5)
        return True

    try:
        with pytest.raises(TimeoutError):
            net.call(hangs(), timeout=0.2)
        assert net.call(was_cancelled(), timeout=10)  # without the cancel the first call would sleep on
    finally:
        net.loop.call_soon_threadsafe(net.loop.stop)
