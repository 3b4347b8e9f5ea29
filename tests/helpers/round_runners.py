"""RoundRunners (``node.replica.rounds``) for in-process DiLoCo members (``tests.helpers.diloco_members``), for
unit tests of whole rounds as the replica daemon runs them: one event-loop thread stands in for the node's
network thread, and the DHT rendezvous is replaced by a fixed, complete group of the members."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import gossip.group_rendezvous as rendezvous_steps  # the rendezvous steps of a DiLoCo round live there
from node.replica.rounds import RoundRunner
from protocol.records import RoundEntry


class LoopThread:
    """The part of NetworkThread that RoundRunner uses: ``submit`` a coroutine to a loop on a thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


async def _noop() -> None:
    return None


def with_runners(monkeypatch: Any, members: list[dict[str, Any]], eager: bool) -> LoopThread:
    """Start every member's exchange on a new loop thread and give each a ``runner``; every rendezvous returns
    the whole group at once. Close the returned thread when done."""
    entries = sorted((RoundEntry(peer_id=m["peer"], samples=m["samples"], codec="none") for m in members), key=lambda e: e.peer_id)

    async def fixed_group(*args, **kwargs):
        return entries, True

    monkeypatch.setattr(rendezvous_steps, "gather_group", fixed_group)
    net = LoopThread()
    for m in members:
        net.submit(m["exchange"].start()).result(10)
        m["runner"] = RoundRunner(net=net, averager=m["averager"], eager=eager, before_gather=_noop, stop=threading.Event(),  # type: ignore[arg-type]
                                  final_timeout=20)
    return net
