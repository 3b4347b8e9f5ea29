"""DiLoCo outer rounds over the swarm: rendezvous, all-gather of pseudo-gradients, outer Nesterov step.

One round, for a member holding φ (agreed weights) and θ (weights after its inner steps):

1. Δ = φ − θ (of the round's parameters: all of them, or one fragment in streaming DiLoCo), cut
   into wire parts and encoded with the run's codec (with error feedback for lossy codecs). The member keeps the decoded
   version of its own parts so that it averages exactly what its peers receive.
2. It publishes the contribution, registers in the DHT rendezvous for (run, round) and waits until
   every live member of that round registered, or the gather deadline passed. The deadline adapts
   to the waits of recent complete rounds (``gossip.deadline``).
3. It fetches every other member's contribution (each fetch bounded by the fetch timeout); a member
   that fails is left out of this round and counted. Dense rounds of three members or more
   reduce-scatter instead (``gossip.reduce_scatter``, ``gossip.reduce_scatter_round``): a member fetches only the parts it owns from
   each other member, reduces and serves them, then fetches every other owner's reduced parts; the
   parts of an owner that fails are fetched from the members directly and reduced locally.
4. Contributions whose φ fingerprint differs from the group's majority (of established peers,
   ``gossip.votes``) are dropped. The rest are
   averaged, weighted by samples, in peer-id order (bit-identical on every member), and the outer
   optimizer steps φ. A member in the minority reports ``in_sync = False`` and re-downloads state.
   A member of no samples (it took no step) votes and steps φ with the others, but its Δ is not
   averaged; a round in which nobody took a step leaves φ as it was.

A swarm with more live members than ``max_group_size`` splits every round into random bounded groups
(``gossip.groups``), each with its own rendezvous. Their φ differ, so such a round averages weights:
each member steps φ with its own Δ first, then the group's mean of the stepped weights becomes φ
(no fingerprint vote).

SparseLoCo is this round with a top-k + quantizing codec, error feedback and a plain SGD outer
step (momentum 0, η = 1): the error-feedback buffer acts as the momentum.

Reference: Douillard et al. 2023, DiLoCo, https://arxiv.org/abs/2311.08105.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Sequence

import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode

from compression import ErrorFeedback
from gossip.aggregate import ROBUST
from gossip.byzantine import Attacker
from gossip.exchange import Contribution, RoundExchange
from gossip.fingerprint import fingerprint
from gossip.group_round import RoundResult
from gossip.group_rendezvous import GroupedRendezvous
from gossip.groups import group_tag
from gossip.late_round import closed_without_me
from gossip.outer import NesterovOuter, l2_norm, pseudo_gradient
from gossip.partition import Partition
from gossip.placement import to_host
from gossip.reduce_scatter import assign_owners, is_dense, use_reduce_scatter
from gossip.reduce_scatter_round import ReduceScatterRound
from gossip.reachable import Reachable
from gossip.scores import MIN_MEMBERS
from gossip.screen_votes import agree_on_screen
from gossip.stepping_rendezvous import Handover, SteppingRendezvous
from gossip.votes import Tenure, vote
from gossip.wire_parts import PartSpec
from protocol.records import RoundEntry

logger = logging.getLogger(__name__)


@dataclass
class _Round:
    """One outer round on this member, filled in step by step by :meth:`DiLoCoAverager.run_round`."""

    number: int
    phi: Sequence[torch.Tensor]
    samples: int
    indices: Sequence[int] | None
    started: float  # time.monotonic() when the round began
    shapes: list[tuple[int, ...]]  # of the round's parameters
    fingerprint: str  # of φ as this member holds it
    members: set[str] | None = None  # the live members read to decide the grouping (None: not read)
    grouping: tuple[int, int] | None = None  # (this member's group, group count) in a grouped round
    wire: str = ""  # the round's wire settings
    blobs: list[bytes] = field(default_factory=list)  # this member's encoded wire parts...
    decoded: list[torch.Tensor] = field(default_factory=list)  # ...and what its peers decode from them
    owners: dict[str, list[int]] | None = None  # {member: the parts it reduces} when the round reduce-scatters
    deadline_s: float = 0.0  # the rendezvous deadline this round waited under
    closed_by: str = ""  # how the rendezvous ended: complete, grace (after a quorum: gossip.quorum) or deadline
    due_at: float | None = None  # when a member stepping through the rendezvous has spent its budget (time.monotonic())
    gathered: float = 0.0  # time.monotonic() when the rendezvous ended
    exchanged: float = 0.0  # time.monotonic() when the contributions were fetched
    fetch_timeout: float = 0.0  # the run's fetch timeout plus the time the group's transfers take at its caps

    @property
    def tag(self) -> str:
        """The group's tag (e.g. g1of2) in a grouped round, else empty."""
        return "" if self.grouping is None else group_tag(*self.grouping)


def _assign(phi: Sequence[torch.Tensor], mean: Sequence[torch.Tensor], indices: object = None, round_no: object = None) -> None:
    """A bounded group's result: φ becomes the group's mean weights (the outer step was taken before)."""
    with torch.no_grad():
        for p, m in zip(phi, mean):
            p.copy_(m)


class DiLoCoAverager(SteppingRendezvous, GroupedRendezvous, ReduceScatterRound):
    """Runs DiLoCo outer rounds for one member.

    :param dht: the node's DHT
    :param validator: signs this node's DHT records
    :param exchange: serves/fetches contributions (owns the codec and the wire partition)
    :param outer: the outer optimizer whose state this member keeps in sync with its group
    :param gather_timeout: longest wait for late members at the rendezvous (the adaptive deadline's ceiling)
    :param fetch_timeout: longest wait for one member's contribution
    :param aggregation: ``mean``, ``sparse-mean``, ``centered-clip``, ``sparse-clip``, ``median-clip`` or
        ``trimmed-mean`` (see ``gossip.aggregate``); with reduce-scatter, each owner applies it to its parts
    :param max_samples: the most samples a round of the run holds: every claimed count is capped there
    :param attacker: experiments only: this member sends the attacker's rewrite of its Δ (``gossip.byzantine``)
    :param max_group_size: a swarm with more live members averages in random groups of about this many
        (``gossip.groups``); None: one group, whatever the swarm's size
    :param weight_codec: how the weights travel in such groups (near-lossless: ``none`` or ``fp16``)
    """

    back_off = True  # the whole group is expected every round

    def __init__(
        self,
        dht: DHTNode,
        validator: RSASignatureValidator,
        exchange: RoundExchange,
        run_id: str,
        peer_id: str,
        outer: NesterovOuter,
        gather_timeout: float = 30.0,
        fetch_timeout: float = 30.0,
        partition: Partition = Partition(),
        aggregation: str = "mean",
        member_role: str = "trainer",
        keep_others: bool = False,
        max_group_size: int | None = None,
        weight_codec: str = "none",
        max_samples: int | None = None,
        attacker: Attacker | None = None,
    ) -> None:
        super().__init__(dht, validator, exchange, run_id, peer_id, outer, gather_timeout, fetch_timeout, partition, aggregation,
                         max_samples, attacker)
        self.outer: NesterovOuter = outer
        self.member_role, self.keep_others = member_role, keep_others
        self.max_group_size, self.weight_codec = max_group_size, weight_codec
        self.tenure = Tenure()  # whose fingerprint votes count (gossip.votes)
        self.reachable: Reachable | None = None  # set by the node: rendezvous wait only for members that answer
        self._gathering: int | None = None  # the round whose rendezvous runs
        self._poke = asyncio.Event()  # set when a member asks for that round's contribution (gossip.rendezvous.gather_group)
        exchange.asked = self._asked

    async def run_round(
        self,
        round_no: int,
        phi: Sequence[torch.Tensor],
        theta: Sequence[torch.Tensor] | None,
        samples: int,
        before_gather: Callable[[], Awaitable[None]] | None = None,
        indices: Sequence[int] | None = None,
        feedback: Sequence[ErrorFeedback | None] | None = None,
        later: Callable[[Sequence[RoundEntry]], Awaitable[Handover]] | None = None,
        asked: Callable[[], None] | None = None,
        due_at: float | None = None,
    ) -> RoundResult:
        """Average this member's Δ with its group and step ``phi`` in place (when in sync).

        In a swarm split into bounded groups (``gossip.groups``) the group averages weights instead:
        each member first steps φ with its own Δ (and its own outer momentum), then φ becomes the
        group's mean of the stepped weights. The step is linear, so the swarm's mean φ moves exactly as
        one DiLoCo step on the mean Δ; the groups' φ differ a little and mix as groups change.

        :param indices: which model parameters ``phi``/``theta`` hold (streaming: one fragment)
        :param feedback: error-feedback buffers of the round's wire parts, if the codec is lossy
        :param later: θ comes after the rendezvous: this member registers first and keeps taking inner steps
            while it waits for the others; ``later(group)``, awaited once the group is complete (with its entries)
            or a member asks (with none), hands over θ and the samples (``theta`` and ``samples`` are then unused)
        :param asked: called (on the event loop) when a member asks for this round's contribution before this
            member handed θ over: that member found the group complete and waits for this one
        :param due_at: with ``later``, when this member's budget runs out (``time.monotonic()``): it registered ahead
            of it, so a grace after a quorum (``gossip.quorum``) counts from then at the earliest
        """
        rnd = _Round(round_no, phi, samples, indices, time.monotonic(), [tuple(p.shape) for p in phi], fingerprint(phi))
        rnd.due_at = due_at if later is not None else None
        if later is None:
            assert theta is not None
            delta = await asyncio.to_thread(lambda: to_host(pseudo_gradient(phi, theta)))  # codecs and the wire work on the CPU
            await self._choose_group(rnd)
            await self._publish(rnd, delta, feedback)
            del delta  # the wire parts hold what was sent: Δ itself is not kept through the exchange
            if before_gather is not None:
                await before_gather()
            group = await self._gather(rnd, asked)
        else:
            group = await self._gather_first(rnd, before_gather, later, feedback, asked)
        self.exchange.close_group(rnd.number, {e.peer_id for e in group})
        self.ask_ahead(rnd.number, [e.peer_id for e in group])
        contributions, failures = await self._exchange(rnd, group)
        closers = closed_without_me([e.peer_id for e in group if e.peer_id != self.peer_id], failures) if rnd.grouping is None else []
        if closers:
            return await self._late(rnd, group, closers, failures)
        result = self._vote(rnd, group, contributions, failures)
        if rnd.owners is not None:
            await self._apply_reduce_scatter(rnd, contributions, result)
        else:
            await self._apply_aggregate(rnd, contributions, result)
        # tenure (whose votes count) is earned by work this round used: not by a member out of sync, dropped
        # by the aggregation or screened out (three rounds of garbage used to make a voter)
        self.tenure.observe(result.contributors, rnd.number)
        result.duration_s = time.monotonic() - rnd.started
        return result

    async def _late(self, rnd: _Round, group: list[RoundEntry], closers: list[str], failures: dict[str, str]) -> RoundResult:
        """Most of the group closed without this member (``gossip.late_round``): φ and the momentum stay, and the
        result carries this member's own decoded Δ for the node to keep on top of the round's state."""
        self.exchange.publish_reduced(rnd.number, None)  # nobody reduces with this member's parts
        logger.info("round %d: late: the group of %s closed without this node; following the round",
                    rnd.number, ", ".join(p[-8:] for p in closers))
        own = await asyncio.to_thread(self.partition.join, rnd.decoded, rnd.shapes)
        return RoundResult(round=rnd.number, group=[e.peer_id for e in group], contributors=[], failures=failures, in_sync=False,
                           sync_peer=closers[0], gather_s=rnd.gathered - rnd.started, deadline_s=rnd.deadline_s, closed_by=rnd.closed_by,
                           exchange_s=rnd.exchanged - rnd.gathered, duration_s=time.monotonic() - rnd.started, samples=rnd.samples,
                           late_for=closers, late_update=own)

    async def _publish(self, rnd: _Round, delta: list[torch.Tensor], feedback: Sequence[ErrorFeedback | None] | None) -> None:
        """Encode this member's contribution and serve it: its Δ cut into wire parts (with error feedback),
        or in a grouped round its weights after stepping φ with its own Δ (at the weight codec, no feedback).
        Keeps the encoded parts and their decoded values in ``rnd``."""
        if rnd.grouping is None:
            delta, rnd.samples = self.contribute(delta, rnd.samples)
            sent = self.partition.split(delta)
        else:
            await asyncio.to_thread(self.outer.step, rnd.phi, delta, rnd.indices, rnd.number)
            sent, feedback = self.partition.split(to_host([p.detach().float() for p in rnd.phi])), None
            self.exchange.regroup(rnd.number, [PartSpec(tuple(p.shape), self.weight_codec) for p in sent], rnd.tag)
        rnd.blobs, rnd.decoded = await asyncio.to_thread(self.exchange.encode, rnd.number, sent, feedback)
        rnd.wire = self.exchange.wire_of(rnd.number)
        self.exchange.publish(Contribution(rnd.number, rnd.samples, rnd.fingerprint, rnd.wire, rnd.blobs, self.peer_id, rnd.decoded))

    def _plan_reduce_scatter(self, rnd: _Round, group: list[RoundEntry], specs: Sequence[PartSpec]) -> None:
        """Decide whether the group reduce-scatters (``gossip.reduce_scatter``): if so, set ``rnd.owners``
        to the parts each member reduces; if not, refuse requests for reduced parts."""
        if use_reduce_scatter(all(is_dense(s.codec) for s in specs), len(group), self.aggregation,
                              self.keep_others and rnd.grouping is None):
            rnd.owners = assign_owners([torch.Size(s.shape).numel() for s in specs], [e.peer_id for e in group])
        else:
            # a late member may count more members than this one did and ask it for reduced parts: refuse at
            # once (it falls back to the contributions) instead of leaving it waiting for the serve timeout
            self.exchange.publish_reduced(rnd.number, None)

    async def _exchange(self, rnd: _Round, group: list[RoundEntry]) -> tuple[dict[str, Contribution], dict[str, str]]:
        """Fetch every other member's contribution (in a reduce-scattering round, only the parts this
        member owns). Returns the contributions by peer, this member's own first (cut to the same parts),
        and the members that failed, with the reason."""
        specs = self.exchange.specs(rnd.number)
        self._plan_reduce_scatter(rnd, group, specs)
        owners = rnd.owners or {}
        others = [e.peer_id for e in group if e.peer_id != self.peer_id]
        rnd.fetch_timeout = self.fetch_timeout + self.transfer_slack(sum(len(b) for b in rnd.blobs), group)
        fetched = owners.get(self.peer_id, range(len(specs)))
        got, failures = await self.exchange.gather(others, rnd.number, rnd.fetch_timeout, parts=owners.get(self.peer_id),
                                                   expected=sum(len(rnd.blobs[i]) for i in fetched))
        rnd.exchanged = time.monotonic()
        mine = owners.get(self.peer_id, range(len(specs)))
        contributions = {self.peer_id: Contribution(rnd.number, rnd.samples, rnd.fingerprint, "", [rnd.blobs[i] for i in mine],
                                                    self.peer_id, [rnd.decoded[i] for i in mine]), **got}
        return contributions, failures  # type: ignore[return-value]

    def _vote(self, rnd: _Round, group: list[RoundEntry], contributions: dict[str, Contribution], failures: dict[str, str]) -> RoundResult:
        """Keep the contributions holding the majority's φ (by fingerprint; the others fail as
        ``out_of_sync``) and start the round's result: whether this member is in sync, and with whom if not.
        A bounded group's φ differ by design (it averages them): its members do not vote."""
        majority = self.peer_id
        if rnd.grouping is None:
            _, majority = vote({p: c.fingerprint for p, c in contributions.items()}, rnd.number, self.peer_id, self.tenure)
        majority_fp = contributions[majority].fingerprint
        synced = sorted(p for p, c in contributions.items() if rnd.grouping is not None or c.fingerprint == majority_fp)
        failures.update({p: "out_of_sync" for p in contributions if p not in synced and p != self.peer_id})
        # a member of no samples (a stage replica no microbatch reached) takes part to keep φ, but its Δ is not
        # averaged: it weighs nothing, and a zero update would pull the robust aggregations' references down
        used = [p for p in synced if rnd.grouping is not None or contributions[p].samples > 0]
        return RoundResult(
            round=rnd.number,
            group=[e.peer_id for e in group],
            contributors=used,
            failures=failures,
            in_sync=rnd.fingerprint == majority_fp,
            sync_peer=None if rnd.fingerprint == majority_fp else majority,
            gather_s=rnd.gathered - rnd.started,
            deadline_s=rnd.deadline_s,
            closed_by=rnd.closed_by,
            exchange_s=rnd.exchanged - rnd.gathered,
            samples=sum(contributions[p].samples for p in used),
            groups=1 if rnd.grouping is None else rnd.grouping[1],
            group_tag=rnd.tag,
            rates={e.peer_id: e.tokens_per_s for e in group if e.tokens_per_s > 0},
        )

    async def _apply(self, rnd: _Round, update: list[torch.Tensor]) -> None:
        """Step φ with the round's averaged update: the outer optimizer's step or, in a grouped round, φ
        becomes the group's mean weights. Row-block parts apply to views of φ (and of the momentum), flat
        runs are joined back into the parameters' shapes first."""
        if self.partition.flat:  # runs across tensors: join them back into the parameters' shapes
            apply = self.outer.step if rnd.grouping is None else _assign
            await asyncio.to_thread(lambda: apply(rnd.phi, self.partition.join(update, rnd.shapes), rnd.indices, rnd.number))
        elif rnd.grouping is None:  # row blocks: step φ part by part through views, without a joined copy of the model
            await asyncio.to_thread(self.outer.step, rnd.phi, update, rnd.indices, rnd.number, self.partition.split)
        else:
            await asyncio.to_thread(_assign, self.partition.split(rnd.phi), update)

    async def _apply_reduce_scatter(self, rnd: _Round, contributions: dict[str, Contribution], result: RoundResult) -> None:
        """A reduce-scattering round's end: when in sync, reduce and serve this member's parts, collect
        the other owners' and step φ; when not, refuse requests for reduced parts."""
        result.reduce_scatter = True
        if not result.in_sync or not result.contributors:  # none: nobody took a step, φ stays (so does the momentum)
            self.exchange.publish_reduced(rnd.number, None)
            return
        update = await self._reduce_scatter(rnd.number, rnd.owners, contributions, rnd.decoded,  # type: ignore[arg-type]
                                            result.contributors, rnd.fingerprint, result,
                                            self._weights_method(rnd, len(result.contributors)), rnd.fetch_timeout,
                                            [len(b) for b in rnd.blobs], agreed_phi=rnd.grouping is None)  # in sync: my φ is the majority's
        result.exchange_s = time.monotonic() - rnd.gathered
        result.update_norm = await asyncio.to_thread(l2_norm, update)
        await self._apply(rnd, update)

    def _weights_method(self, rnd: _Round, members: int) -> str | None:
        """The aggregation of a grouped round, which averages weights, not pseudo-gradients: norms per
        sample mean nothing for weights, so clipping them to the smaller one (a robust round of two)
        would shrink the model. Centered clipping (distances between the members' weights) from three
        members on where the run aggregates robustly, else the mean; None: the run's own aggregation."""
        if rnd.grouping is None:
            return None
        return "centered-clip" if self.aggregation in ROBUST and members >= 3 else "mean"

    async def _apply_aggregate(self, rnd: _Round, contributions: dict[str, Contribution], result: RoundResult) -> None:
        """A round without reduce-scatter, when in sync: aggregate the majority's contributions
        (``gossip.aggregate``, which may drop some), keep the others' sum if asked (eager updates) and
        step φ. Does nothing when out of sync."""
        if not result.in_sync or not result.contributors:  # none: nobody took a step, φ stays (so does the momentum)
            return
        used = result.contributors
        if self.scorer is not None and rnd.grouping is None:  # the node sets a scorer only where φ is the whole model
            used = await self._screen(rnd, contributions, result)
            if not used:
                return  # every update raised the loss: φ stays as it was, on every member alike
        agg = await asyncio.to_thread(self.combine, used, [contributions[p].decoded for p in used],
                                      [contributions[p].samples for p in used], self._weights_method(rnd, len(used)))
        result.failures.update(agg.dropped)
        result.contributors, result.norms, result.clipped, result.capped = agg.used, agg.norms, agg.clipped, agg.capped
        claims = self.claimed({p: contributions[p].samples for p in used}) | agg.weights  # as they weighed
        result.samples = sum(claims[p] for p in agg.used)
        result.update_norm = l2_norm(agg.update)
        others = [p for p in agg.used if p != self.peer_id]
        if self.keep_others and others and rnd.grouping is None:
            weights = {p: claims[p] for p in others}
            summed = [sum(weights[p] * contributions[p].decoded[i] for p in others) for i in range(len(agg.update))]
            result.others_sum = self.partition.join(summed, rnd.shapes)  # type: ignore[arg-type]
            result.others_samples = sum(weights.values())
        await self._apply(rnd, agg.update)

    async def _screen(self, rnd: _Round, contributions: dict[str, Contribution], result: RoundResult) -> list[str]:
        """The contributors whose whole update does not raise the loss (``gossip.scores``), as the majority
        of the judged members' verdicts has it (``gossip.screen_votes``): members whose screens differ (their
        own data, their own hardware) still drop the same peers."""
        assert self.scorer is not None
        if len(result.contributors) < MIN_MEMBERS:  # too few to judge (gossip.scores): not worth a joined copy of each update
            return result.contributors
        updates = {p: self.partition.join(contributions[p].decoded, rnd.shapes) for p in result.contributors}
        shown = await asyncio.to_thread(self.scorer, rnd.number, rnd.phi, updates)
        result.gains = shown.gains
        if not shown.gains:  # too few to judge: nobody screens, nobody votes
            return shown.kept
        agreed = await agree_on_screen(self.dht, self.validator, self.run_id, rnd.number, self.peer_id, shown.peers,
                                       shown.dropped, self.fetch_timeout)
        if agreed.overruled:
            logger.info("round %d: the members' majority overruled this member's screen on %s (%d verdicts read%s)", rnd.number,
                        ", ".join(sorted(agreed.overruled)), agreed.verdicts, "" if agreed.decided else ", timed out undecided")
        result.overruled = sorted(agreed.overruled)
        result.failures.update({p: "harmful_update" for p in agreed.dropped})
        result.contributors = [p for p in shown.peers if p not in agreed.dropped]
        return result.contributors
