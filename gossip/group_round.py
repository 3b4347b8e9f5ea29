"""What every kind of outer round shares: its result, and the averager base class.

:class:`GroupAverager` holds the DHT, the exchange, this member's outer optimizer, the timing of the
rendezvous and fetches, and the rules every round applies to its members' contributions: claimed
sample counts capped at what a round of the run holds, the run's aggregation (``gossip.aggregate``),
and, on a node told to attack for an experiment, the attacker's rewrite of its own contribution.
DiLoCo (``gossip.diloco``) and NoLoCo (``gossip.noloco``) rounds build on it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode

from gossip.aggregate import Aggregate, aggregate, claim_cap
from gossip.byzantine import FUTURE_ROUNDS, LYING_UP_MBIT, Attacker
from gossip.deadline import AdaptiveDeadline
from gossip.exchange import RoundExchange
from gossip.partition import Partition
from gossip.relay_flood import RelayFlood
from gossip.scores import ContributionScorer
from gossip.transfer_rates import MAX_SLACK_FACTOR
from protocol.ratelimit import RateLimits, announced_seconds
from protocol.records import RoundEntry


@dataclass
class RoundResult:
    """What happened in one outer round (the node turns it into metrics, logs and report events)."""

    round: int
    group: list[str]
    contributors: list[str]
    failures: dict[str, str] = field(default_factory=dict)
    in_sync: bool = True
    sync_peer: str | None = None
    gather_s: float = 0.0
    deadline_s: float = 0.0
    closed_by: str = ""  # how the rendezvous ended: complete, grace (after a quorum: gossip.quorum) or deadline
    exchange_s: float = 0.0
    duration_s: float = 0.0
    samples: int = 0
    norms: dict[str, float] = field(default_factory=dict)
    clipped: dict[str, float] = field(default_factory=dict)  # robust aggregation: members scaled down, by the factor kept
    capped: dict[str, int] = field(default_factory=dict)  # members whose claimed samples were cut: their claim
    gains: dict[str, float] = field(default_factory=dict)  # contribution screen: each member's loss gain (gossip.scores)
    overruled: list[str] = field(default_factory=list)  # peers this member's screen judged otherwise than the voters' majority
    update_norm: float = 0.0
    others_sum: list[torch.Tensor] | None = None  # Σ_{j≠self} samples_j·Δ_j of the members used (eager updates)
    others_samples: int = 0
    reduce_scatter: bool = False
    groups: int = 1  # the swarm was split into this many bounded groups (gossip.groups); 1: one group
    group_tag: str = ""  # which of them this member averaged in (e.g. g1of2)
    rates: dict[str, float] = field(default_factory=dict)  # the speeds the group's entries announced (tokens/s)
    late_for: list[str] = field(default_factory=list)  # members whose group closed without this one (gossip.late_round)
    late_update: list[torch.Tensor] | None = None  # then this member's own decoded Δ (its parameters' shapes), to keep



class GroupAverager:
    """What every kind of outer round needs: the DHT, the exchange, this member's outer optimizer
    and the timing of the rendezvous and fetches."""

    back_off = False  # whether incomplete rounds in a row lengthen the rendezvous deadline (gossip.deadline)
    scorer: ContributionScorer | None = None  # screens whole updates by their loss before they are averaged
    speed: float = 0.0  # this member's measured tokens/s, announced in its rendezvous entries (set by the node)
    claim_factor: float | None = None  # no claim weighs more than this × the round's lower-median claim (gossip.aggregate)

    def __init__(self, dht: DHTNode, validator: RSASignatureValidator, exchange: RoundExchange, run_id: str, peer_id: str,
                 outer: object, gather_timeout: float, fetch_timeout: float, partition: Partition, aggregation: str,
                 max_samples: int | None = None, attacker: Attacker | None = None) -> None:
        self.dht, self.validator, self.exchange = dht, validator, exchange
        self.run_id, self.peer_id, self.outer = run_id, peer_id, outer
        self.fetch_timeout, self.partition, self.aggregation = fetch_timeout, partition, aggregation
        self.max_samples, self.attacker = max_samples, attacker
        self.deadline = AdaptiveDeadline.for_timeout(gather_timeout, back_off=self.back_off)
        self._asked_ahead: set[asyncio.Future] = set()  # the ``future`` attack's open requests
        self._flood: RelayFlood | None = None  # the ``relayed`` attack (gossip.relay_flood)
        self._flooding: asyncio.Future | None = None

    @property
    def limits(self) -> RateLimits:
        """This node's bandwidth caps (none on a transport without them)."""
        return getattr(self.exchange.transport, "limits", None) or RateLimits()

    @property
    def up_mbit(self) -> float:
        """The upload cap this member announces in its rendezvous entries (0: none)."""
        if self.attacker is not None and self.attacker.does("cap"):
            return LYING_UP_MBIT
        up = self.limits.up
        return 0.0 if up is None else up.rate * 8 / 1e6

    def transfer_slack(self, payload: int, group: Sequence[RoundEntry]) -> float:
        """Seconds a round moving ``payload`` bytes per member takes at least under the caps in play: this
        member sends its payload to, and receives one about as large from, each other member at its own
        caps; each capped member sends its payload to every other member at the cap it announced (a claim,
        bounded by ``protocol.ratelimit.announced_seconds``, and by the rate measured from it). Fetch timeouts
        add it (0 when nobody is capped; the exchange adds the time each peer's answer needs at the rate
        measured from it). The next
        rendezvous deadline adds the larger of it and the time this round's payload takes at the slowest
        rate measured from a member (``gossip.transfer_rates``): members reach the next round that much later."""
        moved = payload * max(0, len(group) - 1)
        rates = getattr(self.exchange, "rates", None)
        measured_of = (lambda peer: rates.rates.get(peer, 0.0)) if rates is not None else (lambda peer: 0.0)
        theirs = [announced_seconds(moved, e.up_mbit, self.deadline.ceiling, measured_of(e.peer_id))
                  for e in group if e.peer_id != self.peer_id]
        capped = max([self.limits.seconds_for(moved, moved), *theirs])
        measured = [min(payload / rates.rates[e.peer_id], MAX_SLACK_FACTOR * self.deadline.ceiling)
                    for e in group if rates is not None and e.peer_id in rates.rates]
        self.deadline.slack = max([capped, *measured])
        return capped

    def claimed(self, claims: Mapping[str, int]) -> dict[str, int]:
        """The members' sample counts as they may weigh: each claim capped as ``combine`` caps it (at what
        a round of the run can hold and, with ``claim_factor``, relative to the claims of ``claims``)."""
        cap = claim_cap(list(claims.values()), self.max_samples, self.claim_factor)
        return {p: s if cap is None else min(s, cap) for p, s in claims.items()}

    def combine(self, peers: Sequence[str], updates: Sequence[Sequence[torch.Tensor]], samples: Sequence[int],
                method: str | None = None) -> Aggregate:
        """``gossip.aggregate`` with this run's aggregation (or ``method``) and sample caps."""
        return aggregate(peers, updates, samples, method or self.aggregation, max_samples=self.max_samples,
                         claim_factor=self.claim_factor)

    def ask_ahead(self, round_no: int, peers: Sequence[str]) -> None:
        """Experiments only (the protocol attacks of ``gossip.byzantine``), in the background: ``future`` asks
        each of ``peers`` for its contributions to the next ``FUTURE_ROUNDS`` rounds, leaving the requests
        open; ``relayed`` floods them with relayed streams from made-up origins (``gossip.relay_flood``).
        Does nothing on an honest node."""
        if self.attacker is not None and self.attacker.does("relayed") and (self._flooding is None or self._flooding.done()):
            self._flood = self._flood or RelayFlood(self.exchange.transport, self.run_id)
            self._flooding = asyncio.ensure_future(self._flood.round(peers))
        if self.attacker is None or not self.attacker.does("future"):
            return

        async def ask(peer: str, ahead: int) -> None:
            try:
                await asyncio.wait_for(self.exchange.fetch(peer, ahead, None), timeout=2 * self.fetch_timeout)
            except Exception:
                pass  # refused or timed out: the attack only wants the request held

        for peer in peers:
            for ahead in range(round_no + 1, round_no + 1 + FUTURE_ROUNDS):
                if peer != self.peer_id:
                    task = asyncio.ensure_future(ask(peer, ahead))
                    self._asked_ahead.add(task)
                    task.add_done_callback(self._asked_ahead.discard)

    def contribute(self, delta: list[torch.Tensor], samples: int) -> tuple[list[torch.Tensor], int]:
        """What this member sends: its Δ and sample count, or, on a node told to attack (experiments
        only, ``--attack``), the attacker's rewrite of them."""
        if self.attacker is None:
            return delta, samples
        return self.attacker.contribution(delta, samples)
