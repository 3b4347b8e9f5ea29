"""The start-up barrier counts only trainers that answer a probe, and a ``leaving`` record ends the wait only
for a peer the wait saw train (node.runtime.barrier.wait_for_peers): invented records are free."""

from __future__ import annotations

import asyncio
import threading

import pytest

import node.runtime.barrier as barrier
from node.errors import NotStarted
from protocol.records import PeerRecord


class _Net:
    def call(self, coro, timeout=None):
        return asyncio.run(coro)


def _census(script: list[dict[str, str]]):
    """Census results in turn: {peer: role} ("trainer" or "leaving"); the last one repeats."""
    calls = {"n": 0}

    def census(net, run_id, me):
        roles = script[min(calls["n"], len(script) - 1)]
        calls["n"] += 1
        found = barrier.Census()
        for peer, role in roles.items():
            if role == "leaving":
                found.leaving.append(peer)
            else:
                found.trainers[peer] = PeerRecord(peer_id=peer, inner_step=5 if role == "training" else 0)
        return found

    return census


async def _only(peers: set[str]) -> set[str]:
    return peers & {"real"}


def _wait(monkeypatch: pytest.MonkeyPatch, script: list[dict[str, str]], wanted: int, timeout: float) -> int:
    monkeypatch.setattr(barrier, "census", _census(script))
    stop = threading.Event()
    monkeypatch.setattr(stop, "wait", lambda seconds: False)  # no pauses between reads
    return barrier.wait_for_peers(_Net(), "run", "me", wanted, timeout, stop, answering=_only)  # type: ignore[arg-type]


def test_an_invented_trainer_neither_counts_nor_releases_the_barrier(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(NotStarted, match="only 1 of --min-peers 2"):
        _wait(monkeypatch, [{"invented": "training"}], wanted=2, timeout=0.2)
    assert _wait(monkeypatch, [{"invented": "trainer", "real": "trainer"}], wanted=2, timeout=5) == 2


def test_a_leaving_record_ends_the_wait_only_for_a_peer_seen_training(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(NotStarted, match="only 1 of --min-peers 3"):  # an invented "leaving": wait on
        _wait(monkeypatch, [{"invented": "leaving"}], wanted=3, timeout=0.2)
    with pytest.raises(NotStarted, match="the run's peers have stopped"):  # the real peer trained, then left
        _wait(monkeypatch, [{"real": "trainer"}, {"real": "leaving"}], wanted=3, timeout=30)
