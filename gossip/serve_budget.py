"""How much of a round one client may download from this node (``gossip.exchange``).

An honest member downloads each round of this node once: the whole contribution (all-gather), or
the parts it reduces and, when an owner fails, those parts again straight from this node
(reduce-scatter), plus what a broken stream makes it fetch again. Nothing bounded how often a
member might ask: one that asked for the same round over and over (the ``future`` attack's requests
for the next rounds, every one answered when the round was published) made each honest member send
about 6 × its payload a round instead of 1.3 × (a swarm of three, one such member). Now a client may
receive at most ``MAX_DOWNLOADS`` times a round's bytes from each table (contributions, reduced parts),
keyed on the authenticated peer that asks. A request's bytes are reserved before its first frame (concurrent requests cannot overdraw)
and what a broken stream did not send is given back.
"""

from __future__ import annotations

from protocol.errors import SchemaError

MAX_DOWNLOADS = 2  # × a round's bytes one client may receive from one table: one download and one retry


class ServeBudget:
    """Bytes served per table, round and client, for the rounds this node still serves.

    :param factor: how many times a round's bytes one client may receive
    """

    def __init__(self, factor: int = MAX_DOWNLOADS) -> None:
        self.factor = factor
        self.sent: dict[tuple[str, int], dict[str, int]] = {}  # (table, round) → client → bytes sent or reserved

    def reserve(self, table: str, round_no: int, client: str, nbytes: int, whole: int) -> None:
        """Reserve ``nbytes`` of round ``round_no``'s ``table`` (``whole`` bytes in all) for ``client``;
        raises :class:`SchemaError` when that would take it past ``factor`` × ``whole``."""
        clients = self.sent.setdefault((table, round_no), {})
        already = clients.get(client, 0)
        if already + nbytes > self.factor * max(whole, 1):
            raise SchemaError(f"you already received {already} bytes of round {round_no}'s {table} here: "
                              f"a member may receive {self.factor}× its {whole} bytes a round")
        clients[client] = already + nbytes

    def give_back(self, table: str, round_no: int, client: str, nbytes: int) -> None:
        """Return ``nbytes`` of a reservation that were not sent (a broken stream)."""
        clients = self.sent.get((table, round_no))
        if nbytes > 0 and clients is not None and client in clients:
            clients[client] = max(clients[client] - nbytes, 0)

    def forget(self, table: str, up_to: int) -> None:
        """Drop what was counted for the rounds of ``table`` up to ``up_to`` (rounds this node no longer serves)."""
        for key in [k for k in self.sent if k[0] == table and k[1] <= up_to]:
            del self.sent[key]
