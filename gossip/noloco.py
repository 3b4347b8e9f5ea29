"""NoLoCo outer rounds (Kolehmainen et al. 2025, https://arxiv.org/abs/2506.10911): each member
averages with a small random group instead of the whole swarm. No all-reduce, no global barrier.

Matching goes through the DHT rendezvous of (run, round): members register as they finish their
inner steps and are grouped by order of arrival (the DHT entry's own timestamp, the same on every
member's view), ``size`` at a time: the 1st and 2nd arrivals form a pair, the 3rd and 4th, and so on.
Who arrives first is as random as the swarm's speeds and data; nobody waits for more than its group.
A member left over at the end (an odd count, or a partner that never came before the deadline)
pulls from one member that already arrived, chosen at random, and otherwise steps alone.

Each member publishes Δ (the run's codec, with error feedback) and φ (a near-lossless codec) and
applies, with ū the group's sample-weighted mean progress and φ̄ its mean weights::

    δ ← α·δ + β·ū + γ·(φ̄ − φ)      φ ← φ + δ      θ ← φ

Groups need not be symmetric: a pull is one-sided, and replicas are not meant to be bit-identical.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import zlib
from typing import Awaitable, Callable, Sequence

import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode

from compression import ErrorFeedback
from gossip.aggregate import ROBUST
from gossip.byzantine import Attacker
from gossip.group_round import GroupAverager, RoundResult
from gossip.exchange import Contribution, RoundExchange
from gossip.fingerprint import fingerprint
from gossip.outer import NoLoCoOuter, l2_norm, pseudo_gradient
from gossip.partition import Partition
from gossip.placement import to_host
from gossip.rendezvous import read_round_entries, register_soon, round_members
from protocol.records import RoundEntry

logger = logging.getLogger(__name__)
# the same for every member, so an entry's expiration tells when it was written
ENTRY_TTL_S = 120.0


PHI_RADIUS = 4.0  # a partner's φ counts at most this many own-update norms away from this member's φ


def bounded_mean_weights(own: Sequence[torch.Tensor], others: Sequence[Sequence[torch.Tensor]],
                         radius: float) -> tuple[list[torch.Tensor], list[float]]:
    """φ̄ over this member and its partners, each partner's φ − φ_own cut to norm ``radius`` first; returns
    φ̄ and, per partner, the factor its difference kept (1.0: within the radius).

    NoLoCo pulls φ toward φ̄ (γ = 1 moves it all the way), and φ travels with no majority to vote it down
    in a group of two: a partner sending φ far away would drag this member along. Honest members' φ stay
    within a few rounds of progress of each other (each pull brings a pair together), so a radius of a
    few own-update norms leaves them alone and bounds what any one partner can move φ per round.
    """
    factors, total = [], [t.to(torch.float32).clone() for t in own]
    for phi in others:
        diff = [p.to(torch.float32) - o.to(torch.float32) for p, o in zip(phi, own)]
        norm = sum(float(d.pow(2).sum()) for d in diff) ** 0.5
        scale = min(1.0, radius / norm) if norm > 0 else 1.0
        factors.append(scale)
        for acc, o, d in zip(total, own, diff):
            acc.add_(o.to(torch.float32) + d * scale)
    return [t / (len(others) + 1) for t in total], factors


def choose_group(arrivals: Sequence[tuple[float, str]], me: str, size: int, final: bool, seed: int) -> list[str] | None:
    """This member's group, or None to keep waiting.

    :param arrivals: (arrival time, peer id) of every registered member, this one included
    :param final: nobody else is expected (all arrived, or the deadline passed): settle for less
    :param seed: seeds the pick of a partner for a member left over (e.g. hash of run and round)
    """
    order = [peer for _, peer in sorted(arrivals)]
    k = order.index(me)
    start = (k // size) * size
    group = order[start : start + size]
    if len(group) == size:
        return group
    if not final:
        return None
    earlier = order[:start]
    if not earlier:
        return group
    missing = size - len(group)
    return group + random.Random(seed).sample(earlier, min(missing, len(earlier)))


class NoLoCoAverager(GroupAverager):
    """Runs NoLoCo rounds for one member (see the module docstring).

    :param exchange: serves/fetches contributions; its layout for round r is Δ's parts then φ's parts
    :param outer: the NoLoCo outer step holding this member's momentum δ
    :param group_size: n, members per group (default 2)
    :param gather_timeout: longest wait for a partner (the adaptive deadline's ceiling)
    """

    def __init__(
        self,
        dht: DHTNode,
        validator: RSASignatureValidator,
        exchange: RoundExchange,
        run_id: str,
        peer_id: str,
        outer: NoLoCoOuter,
        group_size: int = 2,
        gather_timeout: float = 30.0,
        fetch_timeout: float = 30.0,
        partition: Partition = Partition(),
        aggregation: str = "mean",
        poll_interval: float = 0.2,
        max_samples: int | None = None,
        attacker: Attacker | None = None,
    ) -> None:
        if group_size < 2:
            raise ValueError(f"a NoLoCo group needs at least 2 members, got {group_size}")
        super().__init__(dht, validator, exchange, run_id, peer_id, outer, gather_timeout, fetch_timeout, partition, aggregation,
                         max_samples, attacker)
        self.outer: NoLoCoOuter = outer
        self.group_size, self.poll_interval = group_size, poll_interval
        self.entries: dict[str, RoundEntry] = {}  # the last rendezvous read: members' announced upload caps

    async def _match(self, round_no: int, deadline_s: float) -> tuple[list[str], bool]:
        """Poll the rendezvous until this member's group is settled; returns (group, complete)."""
        give_up = time.monotonic() + deadline_s
        seed = zlib.crc32(f"{self.run_id}/{round_no}/{self.peer_id}".encode())
        while True:
            entries = await read_round_entries(self.dht, self.run_id, round_no)
            self.entries = {peer: entry for peer, (entry, _) in entries.items()}
            arrivals = [(expiration - ENTRY_TTL_S, peer) for peer, (_, expiration) in entries.items()]
            if self.peer_id not in entries:  # our own store has not propagated to our own view yet
                arrivals.append((float("inf"), self.peer_id))
            expected = await round_members(self.dht, self.run_id, round_no)
            final = time.monotonic() >= give_up or expected <= set(entries)
            group = choose_group(arrivals, self.peer_id, self.group_size, final, seed)
            if group is not None:
                return sorted(group), len(group) == self.group_size
            await asyncio.sleep(self.poll_interval)

    async def run_round(
        self,
        round_no: int,
        phi: Sequence[torch.Tensor],
        theta: Sequence[torch.Tensor],
        samples: int,
        before_gather: Callable[[], Awaitable[None]] | None = None,
        indices: Sequence[int] | None = None,
        feedback: Sequence[ErrorFeedback | None] | None = None,
    ) -> RoundResult:
        """Average with this round's group and step ``phi`` in place; never waits past the deadline
        for a partner (a member with no partner takes a local outer step)."""
        started = time.monotonic()
        shapes = [tuple(p.shape) for p in phi]
        own, samples = self.contribute(to_host(pseudo_gradient(phi, theta)), samples)  # codecs and the wire work on the CPU
        delta = self.partition.split(own)
        weights = self.partition.split(to_host([p.detach().float() for p in phi]))
        n_delta = len(delta)
        blobs, decoded = await asyncio.to_thread(
            self.exchange.encode, round_no, delta + weights, list(feedback or [None] * n_delta) + [None] * len(weights)
        )
        mine = Contribution(round_no, samples, fingerprint(phi), self.exchange.wire, blobs, self.peer_id, decoded)
        self.exchange.publish(mine)
        if before_gather is not None:
            await before_gather()

        entry = RoundEntry(peer_id=self.peer_id, samples=samples, codec=self.exchange.wire, up_mbit=self.up_mbit)
        await register_soon(self.dht, self.validator, self.run_id, round_no, entry, ENTRY_TTL_S)
        deadline, registered = self.deadline.value, time.monotonic()
        group, complete = await self._match(round_no, deadline)
        gathered = time.monotonic()
        self.deadline.observe(gathered - registered, complete)
        others = [p for p in group if p != self.peer_id]
        members_entries = [self.entries.get(p, RoundEntry(p, 0, "")) for p in group]
        slack = self.transfer_slack(sum(len(b) for b in blobs), members_entries)
        got, failures = await self.exchange.gather(others, round_no, self.fetch_timeout + slack, expected=sum(len(b) for b in blobs))
        exchanged = time.monotonic()

        contributions = {self.peer_id: mine, **got}
        members = sorted(contributions)
        agg = await asyncio.to_thread(self.combine, members, [contributions[p].decoded[:n_delta] for p in members],
                                      [contributions[p].samples for p in members])
        failures.update(agg.dropped)
        used = [p for p in members if p in agg.used]
        phi_of = {p: contributions[p].decoded[n_delta:] for p in used}
        clipped = dict(agg.clipped)
        if self.aggregation in ROBUST and self.peer_id in phi_of:  # partners' φ bounded around ours (see bounded_mean_weights)
            partners = [p for p in used if p != self.peer_id]
            radius = PHI_RADIUS * l2_norm(own)
            mean_phi, factors = bounded_mean_weights(phi_of[self.peer_id], [phi_of[p] for p in partners], radius)
            clipped.update({f"{p}:phi": f for p, f in zip(partners, factors) if f < 1.0})
        else:
            mean_phi = [torch.stack([phi_of[p][i] for p in used]).mean(0) for i in range(len(weights))]
        mean_progress = [-d for d in agg.update]  # u = θ − φ = −Δ
        await asyncio.to_thread(
            self.outer.step, phi, self.partition.join(mean_phi, shapes), self.partition.join(mean_progress, shapes), indices
        )
        return RoundResult(
            round=round_no,
            group=group,
            contributors=used,
            failures=failures,
            gather_s=gathered - started,
            deadline_s=deadline,
            exchange_s=exchanged - gathered,
            duration_s=time.monotonic() - started,
            samples=sum(self.claimed({p: contributions[p].samples for p in members})[p] for p in used),
            norms=agg.norms,
            clipped=clipped,
            capped=agg.capped,
            update_norm=l2_norm(agg.update),
        )
