"""The reduce-scatter half of a dense DiLoCo round (``gossip.diloco``): reduce the parts this member
owns, serve them, collect every other owner's, and reduce locally what an owner failed to give.

Who owns which parts and when reduce-scatter pays is decided in ``gossip.reduce_scatter``.

A member whose Δ the round does not use (a stage replica that served no microbatch since the last
round, ``node.pipeline.stage_server``) still takes part, so that its φ stays the group's: it reduces
its parts from the others' updates and applies the round's result. Having no update of its own, it
checks an owner's share against its own reduced parts (their root mean square) instead of its update.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Sequence

import torch

from gossip.exchange import Contribution, ReducedShare
from gossip.group_round import GroupAverager, RoundResult
from gossip.outer import l2_norm
from gossip.reduce_scatter import OWNER_NORM_BOUND, bounded_unseen, implausible_share, steps_scale

logger = logging.getLogger(__name__)

# A listener's bound on an owner's share: its root mean square may be at most this many times the root
# mean square of the listener's own reduced parts. Looser than OWNER_NORM_BOUND: other parts hold other
# layers, whose updates differ in scale; a share refused wrongly only costs bytes (its parts are reduced here).
LISTENER_RMS_BOUND = 4 * OWNER_NORM_BOUND
UNANSWERED = ("timeout", "connection")  # a member whose update fetch failed so is not asked for its reduced parts


def _rms(tensors: Sequence[torch.Tensor]) -> float:
    count = sum(t.numel() for t in tensors)
    return l2_norm(tensors) / math.sqrt(count) if count else 0.0


def implausible_for_listener(share: ReducedShare, parts: Sequence[int], own_reduced: Sequence[torch.Tensor]) -> str | None:
    """Why an owner's reduced ``parts`` cannot be the round's aggregate, judged by a member without an update
    of its own: not finite, or a root mean square over ``LISTENER_RMS_BOUND`` × that of ``own_reduced``
    (the parts it reduced itself; with none, only finiteness is checked). None when plausible."""
    theirs = [share.decoded[i] for i in parts]
    if not all(bool(torch.isfinite(t).all()) for t in theirs):
        return "values that are not finite"
    if not own_reduced:
        return None
    rms, bound = _rms(theirs), LISTENER_RMS_BOUND * _rms(own_reduced)
    if rms > bound:
        return f"root mean square {rms:.4g} against {bound:.4g} (this member's own reduced parts × {LISTENER_RMS_BOUND:g})"
    return None


class ReduceScatterRound(GroupAverager):
    """The reduce-scatter exchange of a DiLoCo round, on the averager's exchange and aggregation."""

    async def _reduce_scatter(self, round_no: int, owners: dict[str, list[int]], contributions: dict[str, Contribution],
                              my_decoded: list[torch.Tensor], used: list[str], majority_fp: str, result: RoundResult,
                              method: str | None = None, fetch_timeout: float | None = None,
                              part_bytes: Sequence[int] | None = None, agreed_phi: bool = True) -> list[torch.Tensor]:
        """Reduce this member's parts, serve them, and collect every other owner's: the round's whole
        averaged update, part by part (bit-identical on every member that got each part from its owner).
        ``used``: the members whose updates the round averages (this one among them unless its Δ is not used);
        ``method``: the aggregation, if not the run's (``_weights_method``); ``fetch_timeout``: the round's
        (the run's, stretched by bandwidth caps); ``part_bytes``: each wire part's size (fetch deadlines grow with it);
        ``agreed_phi``: the members hold one φ (not a bounded group's), so a share reduced on another is refused."""
        fetch_timeout = fetch_timeout or self.fetch_timeout
        specs = self.exchange.layout(round_no)
        mine = owners[self.peer_id]
        contributing = self.peer_id in used
        update: dict[int, torch.Tensor] = {}
        share: ReducedShare | None = None
        claims = self.claimed({p: contributions[p].samples for p in used})
        if mine:
            agg = await asyncio.to_thread(self.combine, used, [contributions[p].decoded for p in used],
                                          [contributions[p].samples for p in used], method)
            # the claims as they weighed on these parts (bounded by what the updates show): a lying claim must
            # not widen the bound on the other owners' parts (steps_scale) either
            claims.update(agg.weights)
            result.failures.update(agg.dropped)
            blobs, decoded = await asyncio.to_thread(self.exchange.encode_parts, round_no, mine, agg.update)
            share = ReducedShare(round_no, sum(claims[p] for p in agg.used), agg.used, majority_fp,
                                 dict(zip(mine, blobs)), dict(zip(mine, decoded)))
            update.update(share.decoded)
            result.contributors, result.norms, result.clipped, result.capped = agg.used, agg.norms, agg.clipped, agg.capped
            result.samples = share.samples
        else:  # no update was seen here: claims are bounded by the round's median instead of by norms
            claims = bounded_unseen(claims)
        self.exchange.publish_reduced(round_no, share)
        sources = {o: parts for o, parts in owners.items() if o != self.peer_id and parts}
        # an owner waits for every member's parts before it serves, so its answer may take a whole fetch
        # timeout; an owner that cannot be reached is not waited for: its parts are fetched directly. Nor is one
        # that did not answer for its update this round (a stalled process whose p2pd still takes streams held a
        # round of three 60 s: a fetch timeout for its update, then two for its reduced parts)
        gone = {o: result.failures[o] for o in sources if result.failures.get(o) in UNANSWERED}
        asked = {o: parts for o, parts in sources.items() if o not in gone}
        size = (lambda parts: sum(part_bytes[i] for i in parts)) if part_bytes is not None else (lambda parts: 0)
        shares, failed = await self.exchange.gather(list(asked), round_no, 2 * fetch_timeout, reduced=asked,
                                                    retry_for=min(5.0, self.fetch_timeout / 4),
                                                    expected={o: size(parts) for o, parts in asked.items()}) if asked else ({}, {})
        failed.update(gone)
        scale = steps_scale(list(claims.values()), claims.get(self.peer_id, 0))
        for owner, got in shares.items():
            assert isinstance(got, ReducedShare)
            # a share on another φ: an owner cut off from the others' updates votes alone and serves its own
            if agreed_phi and got.fingerprint != majority_fp:
                reason: str | None = f"reduced on another φ ({got.fingerprint[:12]})"
            elif contributing:
                reason = implausible_share(got, sources[owner], my_decoded, scale)
            else:
                reason = implausible_for_listener(got, sources[owner], list(share.decoded.values()) if share else [])
            if reason is not None:
                logger.warning("round %d: not applying the parts %s reduced: %s", round_no, owner, reason)
                failed[owner] = "implausible"
                continue
            update.update(got.decoded)
        if failed:
            # owners gone or broken: fetch all their parts at once from the other members (one fetch
            # timeout in all, however many owners failed) and reduce them here
            for owner, reason_kind in failed.items():
                result.failures.setdefault(owner, f"reduce_{reason_kind}")
            parts = sorted(i for owner in failed for i in sources[owner])
            members = [p for p in used if p != self.peer_id]  # a failed owner may still serve its own update
            got_parts, _ = await self.exchange.gather(members, round_no, fetch_timeout, parts=parts, expected=size(parts))
            direct = {p: c.decoded for p, c in got_parts.items() if isinstance(c, Contribution)}
            if contributing:
                direct[self.peer_id] = [my_decoded[i] for i in parts]
            senders = sorted(direct)
            if senders:
                samples = [contributions[p].samples for p in senders]
                agg = await asyncio.to_thread(self.combine, senders, [direct[p] for p in senders], samples, method)
                update.update(dict(zip(parts, agg.update)))
            else:  # nobody left to reduce them from: those parts stay where φ is
                update.update({i: torch.zeros(specs[i].shape) for i in parts})
        return [update[i] for i in range(len(specs))]
