"""Fetch deadlines that fit the payload (gossip.transfer_rates): a peer's measured rate stretches its
fetch; a big round from a slow but healthy member completes, and a member that stalls is still dropped.
Rounds run over the in-memory transport with the DHT rendezvous replaced by a fixed group."""

from __future__ import annotations

import asyncio

import pytest
import torch

import gossip.group_rendezvous as diloco_module
from gossip.transfer_rates import FLOOR_BYTES_PER_S, MAX_PEERS, MAX_SLACK_FACTOR, SLACK_FACTOR, TransferRates
from protocol.records import RoundEntry
from tests.helpers.diloco_members import diloco_members
from tests.helpers.memory_transport import Network, PipeWriter


def test_a_measured_peer_gets_the_time_its_payload_needs_and_a_stranger_the_floor() -> None:
    rates = TransferRates()
    rates.observe("fast", 100 << 20, 1.0)
    assert rates.slack("fast", 100 << 20, 30.0) == pytest.approx(SLACK_FACTOR * 1.0)
    assert rates.slack("stranger", 10_000_000, 30.0) == pytest.approx(SLACK_FACTOR * 10_000_000 / FLOOR_BYTES_PER_S)
    assert rates.slack("stranger", 10**12, 30.0) == MAX_SLACK_FACTOR * 30.0  # capped: a stalled peer is dropped in time
    assert rates.slack("anyone", 0, 30.0) == 0.0


def test_small_answers_do_not_measure_and_the_oldest_peers_are_forgotten() -> None:
    rates = TransferRates()
    rates.observe("p", 1000, 10.0)  # latency, not throughput
    assert "p" not in rates.rates
    rates.observe("p", 4 << 20, 1.0)
    rates.observe("p", 4 << 20, 4.0)
    assert (1 << 20) < rates.rate("p") < (4 << 20)  # smoothed between the two samples
    for k in range(MAX_PEERS + 5):
        rates.observe(f"q{k}", 2 << 20, 1.0)
    assert len(rates.rates) == MAX_PEERS and "p" not in rates.rates and f"q{MAX_PEERS + 4}" in rates.rates


class _SlowPipe(PipeWriter):
    """A link that delivers ``rate`` bytes per second (0: it stalls after the first frame header's bytes)."""

    def __init__(self, reader: asyncio.StreamReader, rate: float) -> None:
        super().__init__(reader)
        self.rate, self.pending = rate, bytearray()

    def write(self, b: bytes) -> None:
        self.pending += b

    async def drain(self) -> None:
        while self.pending:
            if not self.rate:
                await asyncio.sleep(3600)
            part = bytes(self.pending[:1 << 16])
            del self.pending[:len(part)]
            await asyncio.sleep(len(part) / self.rate)
            self.reader.feed_data(part)


def _round_with_a_slow_member(rate: float, monkeypatch) -> list:
    network = Network()
    shapes = [(512, 1024), (512, 1024)]  # 4 MiB of fp32 each way: 2 s at 2 MiB/s, past the 1.5-s fetch timeout
    _, members = diloco_members(2, network, shapes, "none", part_numel=1 << 18, fetch_timeout=1.5, serve_timeout=30)
    slow = members[1]["peer"]
    handlers = network.handlers

    def wrap(handler):
        async def serve(stream):
            stream.writer = _SlowPipe(stream.writer.reader, rate)
            await handler(stream)
        return serve

    entries = sorted((RoundEntry(peer_id=m["peer"], samples=m["samples"], codec="none") for m in members), key=lambda e: e.peer_id)

    async def fixed_group(*args, **kwargs):
        return entries, True

    monkeypatch.setattr(diloco_module, "gather_group", fixed_group)

    async def run():
        for m in members:
            await m["exchange"].start()
        for key in [k for k in handlers if k[0] == slow]:
            handlers[key] = wrap(handlers[key])
        return await asyncio.gather(*(m["averager"].run_round(0, m["phi"], m["theta"], m["samples"]) for m in members))

    results = asyncio.run(run())
    return [sorted(r.contributors) for r in results], members


def test_a_big_round_from_a_slow_but_healthy_member_is_not_cut(monkeypatch) -> None:
    contributors, members = _round_with_a_slow_member(2 << 20, monkeypatch)
    everyone = sorted(m["peer"] for m in members)
    assert contributors[0] == everyone  # the fast member waited for the slow one's 4 MiB
    assert members[0]["exchange"].rates.rate(members[1]["peer"]) < 4 << 20  # and measured it


def test_a_member_that_stalls_is_still_dropped(monkeypatch) -> None:
    contributors, members = _round_with_a_slow_member(0, monkeypatch)
    assert contributors[0] == [members[0]["peer"]]
    assert torch.isfinite(members[0]["phi"][0]).all()
