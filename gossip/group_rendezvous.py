"""The rendezvous of a DiLoCo round, with bounded groups: who a member waits for, and where.

A swarm with more live members than ``max_group_size`` averages in random groups (``gossip.groups``).
:class:`GroupedRendezvous` holds what :class:`gossip.diloco.DiLoCoAverager` does before the exchange:
read the live members and decide this member's group of the round (``_choose_group``), then register
under that group's key and wait for its members (``_rendezvous``), up to the adaptive deadline. It
waits only for members that answer (``reachable``), not for peers that came in after the read that
decided the grouping when they would change the group count, and not for those it finds registered
under a neighbouring grouping (near a grouping boundary only).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable

from gossip.groups import group_count, group_of, near_a_grouping_boundary, other_groupings
from gossip.quorum import GatherTimes, GraceWindow, quorum_size
from gossip.rendezvous import gather_group, read_round_entries, round_members
from protocol.records import RoundEntry


class GroupedRendezvous:
    """The rendezvous steps of a DiLoCo round (a mixin of :class:`gossip.diloco.DiLoCoAverager`, whose
    attributes it reads: ``dht``, ``validator``, ``run_id``, ``peer_id``, ``member_role``,
    ``max_group_size``, ``reachable``, ``deadline``, ``up_mbit``, and ``_gathering``/``_poke``: a round's rendezvous
    polls again at once when a member asks for its contribution). A round, ``rnd``, is
    ``gossip.diloco._Round``: typed ``Any`` here, since importing it would make an import circle."""

    _gathering: int | None = None
    _poke: asyncio.Event
    quorum: float = 1.0  # a quorum of this share of the expected members starts the round's grace (≥ 1: wait for all)
    grace: GraceWindow | None = None  # made on first use

    async def expected_members(self, round_no: int) -> set[str]:
        return await round_members(self.dht, self.run_id, round_no, self.member_role)

    def _rendezvous_view(self, round_no: int, members: set[str] | None,
                         grouping: tuple[int, int] | None) -> Callable[[], Awaitable[set[str]]]:
        """The members the rendezvous waits for (of this member's group only, in a grouped round); its
        first poll reuses ``members``, the read that decided the grouping. Peers that came into the round
        after that read are waited for only if counting them gives the same number of groups: otherwise
        they may have decided on another grouping and would register under another key (a joiner's round
        of three once waited its whole deadline for a member that was averaging in a group of two)."""
        first = [] if members is None else [members]
        mine = 1 if grouping is None else grouping[1]

        async def expected() -> set[str]:
            live = first.pop() if first else await self.expected_members(round_no)
            if members is not None and self.max_group_size is not None:
                newcomers = live - members - {self.peer_id}
                if newcomers and group_count(len(live | {self.peer_id}), self.max_group_size) != mine:
                    live -= newcomers
            if self.reachable is not None:
                live = self.reachable.filter(live - {self.peer_id}) | (live & {self.peer_id})
            if grouping is None:
                return live
            return {p for p in live if group_of(self.run_id, round_no, p, grouping[1]) == grouping[0]}

        return expected

    async def _registered_elsewhere(self, round_no: int, peers: set[str], grouping: tuple[int, int] | None) -> set[str]:
        """Which of ``peers`` (awaited, not yet come) registered for ``round_no`` under another number of
        groups than this member's: they counted the members otherwise and will not come to its key."""
        if not peers or self.max_group_size is None:
            return set()
        keys = other_groupings(self.run_id, round_no, peers, 1 if grouping is None else grouping[1], self.max_group_size)
        found: set[str] = set()
        for tag, candidates in keys.items():
            found |= candidates & set(await read_round_entries(self.dht, self.run_id, round_no, tag))
        return found

    async def _choose_group(self, rnd: Any) -> None:
        """With a bounded group size, read the live members and, when more of them than one group holds
        (``gossip.groups``), set ``rnd.grouping`` to this member's group of the round."""
        if self.max_group_size is None:
            return
        rnd.members = await self.expected_members(rnd.number)
        count = group_count(len(rnd.members | {self.peer_id}), self.max_group_size)
        if count > 1:
            rnd.grouping = (group_of(self.run_id, rnd.number, self.peer_id, count), count)

    async def _rendezvous(self, rnd: Any) -> list[RoundEntry]:
        """Register in the round's DHT rendezvous (this member's group's, if grouped) and wait for the
        group, up to the adaptive deadline (which learns from this wait). Returns the group, self included."""
        if self.grace is None:
            self.grace = GraceWindow()
        early = self.quorum < 1
        entry = RoundEntry(peer_id=self.peer_id, samples=rnd.samples, codec=rnd.wire, up_mbit=self.up_mbit, tokens_per_s=self.speed,
                           grace_s=self.grace.proposal() if early else 0.0)
        rnd.deadline_s, registered = self.deadline.value, time.monotonic()
        times = GatherTimes()

        async def elsewhere(peers: set[str]) -> set[str]:
            return await self._registered_elsewhere(rnd.number, peers, rnd.grouping)

        near = (rnd.members is not None and self.max_group_size is not None
                and near_a_grouping_boundary(len(rnd.members | {self.peer_id}), 1 if rnd.grouping is None else rnd.grouping[1],
                                             self.max_group_size))
        group, complete = await gather_group(self.dht, self.validator, self.run_id, rnd.number, entry,
                                             self._rendezvous_view(rnd.number, rnd.members, rnd.grouping),
                                             rnd.deadline_s, group=rnd.tag, elsewhere=elsewhere if near else None,
                                             poke=self._poke if self._gathering == rnd.number else None,
                                             quorum=(lambda n: quorum_size(n, self.quorum)) if early else None, times=times,
                                             grace_from=rnd.due_at)
        rnd.gathered = time.monotonic()
        self.deadline.observe(rnd.gathered - registered, complete)
        spread = None if times.quorum_at is None or not complete else max(0.0, rnd.gathered - times.grace_start(rnd.due_at))
        self.grace.observe(times.closed_by, spread)
        rnd.closed_by = times.closed_by
        return group
