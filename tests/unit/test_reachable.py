"""Who counts as a live peer (gossip.reachable.Reachable): a signed record proves a key, not a daemon,
so a peer counts only until its first probe fails, and stays out while it is probed again until it answers."""

from __future__ import annotations

import asyncio

from gossip.reachable import Reachable


def test_a_peer_that_fails_its_probe_stays_out_until_it_answers() -> None:
    async def run() -> list[set[str]]:
        up = {"honest"}

        async def probe(peer: str) -> None:
            if peer not in up:
                raise ConnectionError("no daemon")

        live = Reachable(probe, timeout=1.0, retry_s=0.05)
        seen = [live.filter({"honest", "invented"})]  # not probed yet: both count while their probe runs
        seen.append(await live.check({"honest", "invented"}))
        await asyncio.sleep(0.1)  # past retry_s: the invented peer is probed again...
        seen.append(live.filter({"honest", "invented"}))  # ...and stays out meanwhile
        await asyncio.sleep(0.05)
        seen.append(await live.check({"honest", "invented"}))
        up.add("invented")  # a peer that was only slow to start answers its next probe
        await asyncio.sleep(0.1)
        live.filter({"invented"})
        await asyncio.sleep(0.05)
        seen.append(live.filter({"honest", "invented"}))
        return seen

    first, checked, reprobed, still, later = asyncio.run(run())
    assert first == {"honest", "invented"}
    assert checked == reprobed == still == {"honest"}
    assert later == {"honest", "invented"}


def test_failed_peers_are_bounded() -> None:
    async def run() -> int:
        async def probe(peer: str) -> None:
            raise ConnectionError("no daemon")

        live = Reachable(probe, timeout=1.0, max_tracked=10)
        for batch in range(5):
            await live.check({f"fake{batch}-{i}" for i in range(8)})
        return len(live.failed)

    assert asyncio.run(run()) == 10


def test_peers_past_the_probe_cap_count_only_once_their_probe_is_under_way() -> None:
    """200 invented records at once: those past the 64 probes that may run do not count meanwhile (they used
    to count, unprobed, and every rendezvous waited for them)."""
    from gossip.reachable import MAX_PENDING

    async def run() -> tuple[int, int, int]:
        release = asyncio.Event()

        async def probe(peer: str) -> None:
            await release.wait()
            raise ConnectionError("no daemon")

        live = Reachable(probe, timeout=5.0)
        counted = len(live.filter({f"fake{i}" for i in range(200)}))
        running = len(live.pending)
        release.set()
        await asyncio.sleep(0.05)
        return counted, running, len(live.filter({f"fake{i}" for i in range(200)}))

    counted, running, after = asyncio.run(run())
    assert running == MAX_PENDING and counted == MAX_PENDING
    assert after == MAX_PENDING, "the next 64 are probed, the failed ones stay out"
