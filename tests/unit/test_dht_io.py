"""gossip.dht_io.answers: a read that one peer never answers ends a grace after most answered, not at its timeout."""

import asyncio
import time

from gossip import dht_io


def _ask(delays: dict[str, float | None]):
    async def ask(peer: str) -> dict | None:
        delay = delays[peer]
        if delay is None:  # a frozen peer: its stream opens, its answer never comes
            await asyncio.sleep(3600)
        await asyncio.sleep(delay)
        return {"from": peer}
    return ask


def _run(delays: dict[str, float | None], timeout: float) -> tuple[list, float]:
    started = time.monotonic()
    got = asyncio.run(dht_io.answers(_ask(delays), list(delays), timeout))
    return got, time.monotonic() - started


def test_every_answer_is_kept_when_everyone_answers() -> None:
    got, took = _run({"a": 0.0, "b": 0.01, "c": 0.05}, timeout=3.0)
    assert got == [{"from": "a"}, {"from": "b"}, {"from": "c"}] and took < 1.0


def test_a_frozen_peer_holds_a_read_only_the_grace_after_half_answered() -> None:
    got, took = _run({"a": 0.0, "frozen": None}, timeout=3.0)
    assert got == [{"from": "a"}, None]
    assert dht_io.STRAGGLER_GRACE_S <= took < dht_io.STRAGGLER_GRACE_S + 1.0, took  # not the 3 s timeout


def test_a_slow_but_answering_peer_is_waited_for_by_the_grace() -> None:
    got, _ = _run({"a": 0.0, "b": 0.0, "slow": 0.2}, timeout=3.0)
    assert got[2] == {"from": "slow"}  # within STRAGGLER_GRACE_S of the others


def test_nobody_answering_ends_at_the_timeout() -> None:
    got, took = _run({"x": None, "y": None}, timeout=0.3)
    assert got == [None, None] and 0.3 <= took < 1.0


def test_no_peers_is_no_answers() -> None:
    assert asyncio.run(dht_io.answers(_ask({}), [], 1.0)) == []
