"""Requests that wait for a round this node has not published yet (``gossip.exchange``).

A member may ask for a round before this node gets there: the request waits, up to the serve timeout,
on the round's event in one of the exchange's tables (contributions, reduced parts). A request may name
any round, so the rounds awaited are capped, in all and per client (the authenticated peer: one client
asking for 16 future rounds used to fill the cap for everyone; its requests for one round count once),
and a round's event that nobody published is dropped when its last waiter gives up: no bookkeeping
grows with requests.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from protocol.errors import SchemaError

MAX_AWAITED_ROUNDS = 16  # rounds requests may wait for in one table before this node publishes them
MAX_ROUNDS_PER_CLIENT = 8  # of those rounds (both tables), how many one client may wait for at once

Table = dict[int, asyncio.Event]


def event_in(table: Table, round_no: int) -> asyncio.Event:
    """The event of ``round_no`` in ``table``, made when it is not there yet."""
    if round_no not in table:
        table[round_no] = asyncio.Event()
    return table[round_no]


class RoundWaits:
    """The requests waiting on each table's rounds, by round and by client.

    :param timeout: how long a request may wait (the exchange's serve timeout)
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.waiting: dict[tuple[int, int], int] = {}  # (table, round) → requests waiting for it
        self.clients: dict[str, Counter[tuple[int, int]]] = {}  # authenticated client → its waiting requests by (table, round)

    async def wait(self, table: Table, round_no: int, what: str, client: str) -> None:
        """Until round ``round_no`` is published in ``table`` (``what`` it holds, for the refusal)."""
        key = (id(table), round_no)
        mine = self.clients.get(client, Counter())
        if round_no not in table or not table[round_no].is_set():
            if key not in mine and len(mine) >= MAX_ROUNDS_PER_CLIENT:
                raise SchemaError(f"you already wait here for {MAX_ROUNDS_PER_CLIENT} rounds not published yet")
            if round_no not in table and sum(not e.is_set() for e in table.values()) >= MAX_AWAITED_ROUNDS:
                raise SchemaError(f"too many rounds awaited at once; round {round_no} is not published here")
        event = event_in(table, round_no)
        self.waiting[key] = self.waiting.get(key, 0) + 1
        self.clients.setdefault(client, Counter())[key] += 1
        try:
            await asyncio.wait_for(event.wait(), timeout=self.timeout)
        except asyncio.TimeoutError:
            raise SchemaError(f"no {what} for round {round_no} within {self.timeout:.0f}s") from None
        finally:
            self._done(client, key)
            if key not in self.waiting and not event.is_set() and table.get(round_no) is event:
                del table[round_no]

    def _done(self, client: str, key: tuple[int, int]) -> None:
        self.waiting[key] -= 1
        if not self.waiting[key]:
            del self.waiting[key]
        mine = self.clients[client]
        mine[key] -= 1
        if not mine[key]:
            del mine[key]
            if not mine:
                del self.clients[client]
