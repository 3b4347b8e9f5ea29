"""The bandwidth caps' token bucket (protocol.ratelimit): rate held, bursts bounded, small frames not
starved behind bulk transfers, and paced streams that deliver every byte in order."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.ratelimit import PacedReader, PacedWriter, RateLimits, TokenBucket, mbit_to_bytes_per_s


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def releases(bucket: TokenBucket, clock: FakeClock, requests: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """(release time, bytes) of requests made ``gap`` seconds apart, each caller waiting out its delay
    before its next request (one writer, like a stream)."""
    out = []
    for gap, n in requests:
        clock.now += gap
        clock.now += bucket.reserve(n)
        out.append((clock.now, n))
    return out


def test_sizes_follow_the_rate() -> None:
    bucket = TokenBucket(mbit_to_bytes_per_s(2))
    assert bucket.rate == 250_000
    assert bucket.burst == pytest.approx(62_500)  # a quarter second
    assert bucket.chunk <= bucket.burst
    assert TokenBucket(1.0).chunk <= TokenBucket(1.0).burst  # a tiny rate still has chunks within its burst
    with pytest.raises(ValueError, match="positive rate"):
        TokenBucket(0)


def test_a_long_transfer_runs_at_the_rate() -> None:
    clock = FakeClock()
    bucket = TokenBucket(100_000, clock=clock)
    out = releases(bucket, clock, [(0.0, bucket.chunk)] * 2000)
    total = sum(n for _, n in out)
    # 60 s worth of bytes take 60 s minus the initial burst
    assert out[-1][0] == pytest.approx((total - bucket.burst) / bucket.rate)
    assert total / out[-1][0] <= bucket.rate * 1.10


@settings(max_examples=200, deadline=None)
@given(rate=st.floats(1e3, 1e8), requests=st.lists(st.tuples(st.floats(0, 2.0), st.integers(1, 1 << 20)), min_size=1, max_size=60))
def test_any_window_passes_at_most_burst_plus_rate_times_its_length(rate: float, requests: list[tuple[float, int]]) -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate, clock=clock)
    chunked = [(gap if i == 0 else 0.0, min(n - i, bucket.chunk)) for gap, n in requests for i in range(0, n, bucket.chunk)]
    out = releases(bucket, clock, chunked)
    times = [t for t, _ in out]
    assert times == sorted(times)
    for i in range(len(out)):
        moved = 0
        for k in range(i, len(out)):
            moved += out[k][1]
            assert moved <= bucket.burst + rate * (out[k][0] - out[i][0]) + 1e-6 * moved


def test_after_a_quiet_spell_only_one_burst_passes_at_once() -> None:
    clock = FakeClock()
    bucket = TokenBucket(10_000, clock=clock)
    clock.now = 3600.0  # an hour idle does not bank an hour of tokens
    delays = [bucket.reserve(bucket.chunk) for _ in range(int(bucket.burst // bucket.chunk) + 1)]
    assert delays[-2] == 0.0 and delays[-1] > 0


@settings(max_examples=100, deadline=None)
@given(writers=st.integers(1, 8), rate=st.floats(1e4, 1e7), start=st.integers(0, 50))
def test_a_small_frame_waits_for_one_chunk_per_busy_writer_at_most(writers: int, rate: float, start: int) -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate, clock=clock)
    # `writers` bulk transfers, each holding one granted chunk at a time, interleaved in time
    ready = [0.0] * writers
    for _ in range(start):
        w = min(range(writers), key=ready.__getitem__)
        clock.now = max(clock.now, ready[w])
        ready[w] = clock.now + bucket.reserve(bucket.chunk)
    clock.now = max(clock.now, min(ready))
    wait = bucket.reserve(100)  # a control frame arrives now
    assert wait <= (writers * bucket.chunk + 100) / rate + 1e-9


def test_seconds_for_uses_the_slower_direction() -> None:
    limits = RateLimits.from_mbit(2, 8)
    assert limits.active
    assert limits.seconds_for(1_000_000, 1_000_000) == pytest.approx(4.0)  # 1 MB at 2 Mbit/s up
    assert limits.seconds_for(0, 4_000_000) == pytest.approx(4.0)  # 4 MB at 8 Mbit/s down
    assert RateLimits.from_mbit(None, None).seconds_for(1 << 30, 1 << 30) == 0.0
    assert not RateLimits().active


class Sink:
    def __init__(self) -> None:
        self.data = bytearray()
        self.writes: list[int] = []

    def write(self, data: bytes) -> None:
        self.data += data
        self.writes.append(len(data))

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_paced_streams_carry_every_byte_in_order_and_take_the_time_the_cap_says() -> None:
    payload = bytes(range(256)) * 800  # 200 KiB

    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        up = TokenBucket(400_000, clock=loop.time)
        sink = Sink()
        writer = PacedWriter(sink, up)
        started = loop.time()
        writer.write(payload)
        await writer.drain()
        sent_s = loop.time() - started
        assert bytes(sink.data) == payload and max(sink.writes) <= up.chunk
        writer.close()  # passed through to the real writer
        assert sink.closed

        down = TokenBucket(400_000, clock=loop.time)
        source = asyncio.StreamReader()
        source.feed_data(payload + b"tail")
        source.feed_eof()
        reader = PacedReader(source, down)
        started = loop.time()
        assert await reader.readexactly(len(payload)) == payload
        got_s = loop.time() - started
        assert await reader.read(100) == b"tail"
        with pytest.raises(asyncio.IncompleteReadError) as e:
            await reader.readexactly(4)
        assert e.value.partial == b""
        return sent_s, got_s

    sent_s, got_s = asyncio.run(main())
    floor = (len(payload) - 100_000) / 400_000  # at the rate, less one burst
    assert sent_s >= floor and got_s >= floor


def test_a_truncated_paced_read_reports_what_arrived() -> None:
    async def main() -> None:
        source = asyncio.StreamReader()
        source.feed_data(b"x" * 5000)
        source.feed_eof()
        reader = PacedReader(source, TokenBucket(1e9))
        with pytest.raises(asyncio.IncompleteReadError) as e:
            await reader.readexactly(1 << 20)
        assert e.value.partial == b"x" * 5000 and e.value.expected == 1 << 20

    asyncio.run(main())


def test_a_round_allows_the_time_its_transfers_take_at_the_caps_in_play() -> None:
    from types import SimpleNamespace

    from gossip.group_round import GroupAverager
    from gossip.partition import Partition
    from protocol.records import RoundEntry

    def averager(limits: RateLimits) -> GroupAverager:
        exchange = SimpleNamespace(transport=SimpleNamespace(limits=limits))
        return GroupAverager(None, None, exchange, "run", "me", None, gather_timeout=30.0, fetch_timeout=30.0,  # type: ignore[arg-type]
                             partition=Partition(), aggregation="mean")

    group = [RoundEntry("me", 1, "fp16"), RoundEntry("a", 1, "fp16"), RoundEntry("b", 1, "fp16")]
    capped = averager(RateLimits.from_mbit(2, None))
    assert capped.up_mbit == pytest.approx(2.0)
    assert capped.transfer_slack(1_000_000, group) == pytest.approx(8.0)  # 2 MB out at 2 Mbit/s
    assert capped.deadline.value == pytest.approx(38.0)  # the next rendezvous allows for it, past the ceiling
    assert capped.transfer_slack(1_000_000, group[:1]) == 0.0  # alone: nothing moves
    assert capped.deadline.value == 30.0  # and the next deadline drops back
    free = averager(RateLimits())
    assert free.up_mbit == 0.0 and free.transfer_slack(1_000_000, group) == 0.0
    slow_peer = [*group[:2], RoundEntry("b", 1, "fp16", up_mbit=1.0)]  # b announced its cap: the others wait for it
    assert free.transfer_slack(1_000_000, slow_peer) == pytest.approx(16.0)
    # a cap is a claim: one far below any real link waits as the floor would, and never past 4 × the ceiling
    liar = [*group[:2], RoundEntry("b", 1, "fp16", up_mbit=1e-300)]
    assert free.transfer_slack(1_000_000, liar) == pytest.approx(16.0)
    assert free.transfer_slack(10**12, liar) == pytest.approx(4 * 30.0)
    assert free.deadline.value == pytest.approx(30.0 + 4 * 30.0)
    # ... and bounded by what this node measured: b's answers arrived at 100 MB/s, so its 1 Mbit/s claim
    # counts as that rate: 2 MB (its payload to each of two members) at 100 MB/s
    from gossip.transfer_rates import TransferRates

    free.exchange.rates = TransferRates()
    free.exchange.rates.observe("b", 100_000_000, 1.0)
    assert free.transfer_slack(1_000_000, liar) == pytest.approx(0.02)
    free.exchange.rates.rates["b"] = 1000.0  # measured slower than it claims: the claim stands
    assert free.transfer_slack(1_000_000, slow_peer) == pytest.approx(16.0)
    assert RoundEntry.from_value(slow_peer[2].to_value()).up_mbit == 1.0
    assert RoundEntry.from_value({"peer_id": "old", "samples": 1, "codec": "fp16"}).up_mbit == 0.0  # older peers announce none
    with pytest.raises(Exception, match="up_mbit"):
        RoundEntry.from_value({"peer_id": "x", "samples": 1, "codec": "fp16", "up_mbit": -1})


def test_the_caps_are_flags_in_mbit_and_must_be_positive(capsys) -> None:
    import typer

    from node.cli.app import parse_join_args

    cfg = parse_join_args(["--max-upload-mbit", "2.5", "--max-download-mbit", "10"])
    limits = RateLimits.from_mbit(cfg.max_upload_mbit, cfg.max_download_mbit)
    assert limits.up is not None and limits.up.rate == 312_500 and limits.down is not None and limits.down.rate == 1_250_000
    assert parse_join_args([]).max_upload_mbit is None
    for bad in ("0", "-1"):
        with pytest.raises((SystemExit, typer.Exit)):
            parse_join_args(["--max-upload-mbit", bad])
        assert "--max-upload-mbit: Input should be greater than 0" in capsys.readouterr().err


def test_a_relay_circuit_between_paced_streams_moves_at_the_cap() -> None:
    """What ``protocol.relay.serve_hop`` splices are paced streams (both legs come from ``limits.pace``):
    the relay's bytes in and out count against its caps like its own."""
    from protocol.frames import FramedStream
    from protocol.relay import splice
    from tests.helpers.memory_transport import Sink as FrameSink

    payload = b"y" * 150_000

    async def main() -> tuple[tuple[int, int], float, bytes]:
        loop = asyncio.get_running_loop()
        limits = RateLimits(TokenBucket(300_000, clock=loop.time), TokenBucket(300_000, clock=loop.time))
        client_in, target_in = asyncio.StreamReader(), asyncio.StreamReader()
        client_in.feed_data(payload)
        client_in.feed_eof()  # the client's EOF ends the circuit (the target's side stays open)
        target_out = FrameSink()
        client = FramedStream(*limits.pace(client_in, FrameSink()), peer="client")
        target = FramedStream(*limits.pace(target_in, target_out), peer="target")
        started = loop.time()
        moved = await asyncio.wait_for(splice(client, target, 1 << 30, max_seconds=30, idle_seconds=10), 20)
        return moved, loop.time() - started, bytes(target_out.data)

    moved, took, relayed = asyncio.run(main())
    assert moved == (len(payload), 0) and relayed == payload
    # read at the download cap, then written at the upload cap: at least the rate's time less one burst
    assert took >= (len(payload) - 75_000) / 300_000


def test_a_state_download_allows_for_the_joiners_and_the_sources_caps() -> None:
    import threading
    from types import SimpleNamespace

    import torch

    from node.replica.joiner import Joiner
    from protocol.records import PeerRecord

    def joiner(limits: RateLimits) -> Joiner:
        return Joiner(net=SimpleNamespace(transport=SimpleNamespace(limits=limits)), run_id="r", peer_id="me", settings={},  # type: ignore[arg-type]
                      layout=lambda: {}, adopt=lambda _: None, announce=None, metrics=None, event=lambda *a, **k: None,  # type: ignore[arg-type]
                      stop=threading.Event(), join_timeout=1.0)

    layout = {"params": [((1000, 250), torch.float32)], "outer_momentum": [((1000, 250), torch.float32)]}  # 2 MB
    assert joiner(RateLimits())._capped_seconds(layout, ["a"]) == 0.0
    assert joiner(RateLimits.from_mbit(None, 4))._capped_seconds(layout, ["a"]) == pytest.approx(4.0)
    free = joiner(RateLimits())
    free.up_caps = {"a": 2.0, "b": 0.0}  # a announced a 2 Mbit/s upload cap in its record
    assert free._capped_seconds(layout, ["a"]) == pytest.approx(8.0)
    assert free._capped_seconds(layout, ["a", "b"]) == pytest.approx(4.0)  # a sends half the state
    free.up_caps["a"] = 1e-300  # a claim no link makes: the floor's 16 s, and never past 4 × the state timeout
    assert free._capped_seconds(layout, ["a"]) == pytest.approx(16.0)
    assert free._capped_seconds({"params": [((10**9, 250), torch.float32)]}, ["a"]) == pytest.approx(4 * 120.0)
    free.measured = {"a": 4_000_000.0}.get  # a's round answers arrived at 4 MB/s: its claim counts as that
    assert free._capped_seconds(layout, ["a"]) == pytest.approx(2_000_000 / 4_000_000.0)
    assert PeerRecord.from_value(PeerRecord("a", up_mbit=2.0).to_value()).up_mbit == 2.0
    assert PeerRecord.from_value({"peer_id": "old"}).up_mbit == 0.0
